"""LiteLLM's proxy (`litellm[proxy]`) in front of Tessera: an openai/ provider entry per model pointed at
Tessera's /v1 with an API key; the official openai client talks to the proxy only."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import yaml
from openai import BadRequestError, OpenAI

from tessera.embedded_redis import free_port
from tests.compat.venvs import client_venv, installed_version, wait_until_serving

pytestmark = pytest.mark.compat

REQUIREMENTS = ["litellm[proxy]==1.108.7"]
MASTER_KEY = "sk-compat-master"  # the proxy's own key; Tessera's key stays in its config
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HELLO = [{"role": "user", "content": "Say hello in one sentence."}]


def proxy_config(tessera) -> dict:
    def entry(name: str, **extra) -> dict:
        params = {"model": f"openai/{name}", "api_base": tessera.base_url + "/v1", "api_key": tessera.api_key}
        return {"model_name": name, "litellm_params": params, **extra}

    return {
        "model_list": [entry(tessera.chat_model), entry(tessera.embedding_model, model_info={"mode": "embedding"})],
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"telemetry": False},
    }


@pytest.fixture(scope="module")
def proxy(tessera, tmp_path_factory):
    """`litellm --config` on a free port, its output in a file; the process group is killed at the end."""
    bin_dir = client_venv("litellm", REQUIREMENTS)
    work = tmp_path_factory.mktemp("litellm")
    (work / "config.yaml").write_text(yaml.safe_dump(proxy_config(tessera)))
    port = free_port()
    log = (work / "proxy.log").open("w")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no fetch of the price list from GitHub
    argv = [str(bin_dir / "litellm"), "--config", str(work / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_serving(
            f"http://127.0.0.1:{port}/health/liveliness", process, work / "proxy.log", "the LiteLLM proxy"
        )
        yield (
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER_KEY, max_retries=0),
            installed_version(bin_dir, "litellm"),
        )
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


def test_the_proxy_lists_tessera_models(proxy, tessera, compat_report):
    client, version = proxy
    assert {m.id for m in client.models.list()} == {tessera.chat_model, tessera.embedding_model}
    compat_report("litellm[proxy]", version, "models.list through the proxy", "passed: both Tessera models")


def test_chat_through_the_proxy(proxy, tessera, compat_report):
    client, version = proxy
    direct = OpenAI(base_url=tessera.base_url + "/v1", api_key=tessera.api_key, max_retries=0)
    reply = client.chat.completions.create(model=tessera.chat_model, messages=HELLO, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip() and reply.choices[0].finish_reason in ("stop", "length")
    expected = direct.chat.completions.create(model=tessera.chat_model, messages=HELLO, max_tokens=16, temperature=0)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens  # the same prompt reached Tessera
    compat_report("litellm[proxy]", version, "chat.completions", f"passed: {reply.usage.completion_tokens} tokens")


def test_streaming_through_the_proxy(proxy, tessera, compat_report):
    client, version = proxy
    stream = client.chat.completions.create(
        model=tessera.chat_model,
        messages=HELLO,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert text.strip() and deltas > 1, chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= deltas
    compat_report("litellm[proxy]", version, "chat.completions stream=True", f"passed: {deltas} text deltas, usage")


def test_a_tool_call_through_the_proxy(proxy, tessera, compat_report):
    client, version = proxy
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model=tessera.chat_model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=64
    )
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # The result goes back through the proxy as a tool message answering the call.
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "sunny and 23 degrees"}]
    answer = client.chat.completions.create(
        model=tessera.chat_model, messages=messages, tools=[WEATHER_TOOL], max_tokens=32
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    compat_report(
        "litellm[proxy]",
        version,
        "tool_choice=required, then the tool's result",
        f"passed: call get_weather({call.function.arguments}), result accepted",
    )


def test_embeddings_through_the_proxy(proxy, tessera, compat_report):
    client, version = proxy
    direct = OpenAI(base_url=tessera.base_url + "/v1", api_key=tessera.api_key, max_retries=0)
    texts = ["LiteLLM in front of Tessera", "embeddings through a gateway"]
    reply = client.embeddings.create(model=tessera.embedding_model, input=texts)
    expected = direct.embeddings.create(model=tessera.embedding_model, input=texts, encoding_format="float")
    assert len(reply.data) == 2 and [len(d.embedding) for d in reply.data] == [384, 384]
    assert max(abs(a - b) for d, e in zip(reply.data, expected.data) for a, b in zip(d.embedding, e.embedding)) < 1e-5
    compat_report("litellm[proxy]", version, "embeddings (2 inputs)", "passed: equal to Tessera's own answer")


def test_tessera_errors_reach_the_client_as_400s(proxy, tessera, compat_report):
    client, version = proxy
    with pytest.raises(BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=tessera.chat_model, messages=HELLO, max_tokens=-5)
    compat_report("litellm[proxy]", version, "a bad max_tokens", "passed: a 400 naming max_tokens")
