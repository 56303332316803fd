"""An openai-agents agent with one function tool over Tessera's Responses API; run by the agents
virtualenv's python (tests/compat/test_openai_agents.py), never imported by the test session.

    python agents_run.py BASE_URL API_KEY MODEL [stream]

Prints one JSON object: the tool's calls, the run's item types, the final output, the model calls.
"""

import asyncio
import json
import sys

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

WEATHER = "sunny and 23 degrees"
calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    calls.append(city)
    return f"The weather in {city} is {WEATHER}."


async def main(base_url: str, api_key: str, model: str, stream: bool) -> dict:
    set_tracing_disabled(True)  # no export to api.openai.com
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Call get_weather, then answer with its result.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        # A 135M model needs the call forced on the first turn; the SDK resets tool_choice after it.
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=64),
    )
    question = "What is the weather in Paris?"
    if stream:
        result = Runner.run_streamed(agent, question, max_turns=4)
        events = [event.type async for event in result.stream_events()]
    else:
        result = await Runner.run(agent, question, max_turns=4)
        events = []
    return {
        "calls": calls,
        "items": [item.type for item in result.new_items],
        "tool_outputs": [item.output for item in result.new_items if item.type == "tool_call_output_item"],
        "final_output": result.final_output,
        "model_calls": len(result.raw_responses),
        "response_ids": [r.response_id for r in result.raw_responses],
        "usage": [[r.usage.input_tokens, r.usage.output_tokens] for r in result.raw_responses],
        "stream_event_types": sorted(set(events)),
    }


if __name__ == "__main__":
    base_url, api_key, model = sys.argv[1:4]
    print(json.dumps(asyncio.run(main(base_url, api_key, model, stream=sys.argv[4:] == ["stream"]))))
