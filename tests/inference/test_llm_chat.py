"""LLM.chat(messages): conversations rendered with the tokenizer's chat template, greedy replies equal
HF transformers' on the same prompt, as vLLM's LLM.chat."""

import pytest
from tiny_models import hf_greedy
from transformers import AutoTokenizer

from inference import SamplingParams

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to me"}]
OTHER = [{"role": "user", "content": "Count to three"}]


def template_ids(model_dir: str, conversation: list[dict]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_chat_renders_the_template_and_equals_hf_greedy(tiny_llm, tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = tiny_llm.chat([CONVERSATION, OTHER], params, use_tqdm=False)
    expected_prompts = [template_ids(tiny_model_dir, CONVERSATION), template_ids(tiny_model_dir, OTHER)]
    assert [o.prompt_token_ids for o in outputs] == expected_prompts
    assert expected_prompts[0].count(expected_prompts[0][0]) == 1  # the template's BOS is not doubled
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model_dir, expected_prompts, 8)


def test_one_conversation_gives_one_output(tiny_llm, tiny_model_dir):
    [output] = tiny_llm.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert output.prompt_token_ids == template_ids(tiny_model_dir, CONVERSATION)
    assert output.outputs[0].text == tiny_llm.get_tokenizer().decode(
        output.outputs[0].token_ids, skip_special_tokens=True
    )


def test_continue_final_message_leaves_the_assistant_turn_open(tiny_llm):
    partial = [*OTHER, {"role": "assistant", "content": "One,"}]
    [output] = tiny_llm.chat(
        partial, SamplingParams(temperature=0.0, max_tokens=2), continue_final_message=True, use_tqdm=False
    )
    prompt = tiny_llm.get_tokenizer().decode(output.prompt_token_ids)
    assert prompt.endswith("One,")


def test_no_chat_template_or_no_messages_is_a_value_error(tiny_llm, monkeypatch):
    with pytest.raises(ValueError, match="non-empty"):
        tiny_llm.chat([])
    monkeypatch.setattr(tiny_llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        tiny_llm.chat(OTHER)
