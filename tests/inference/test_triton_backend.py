"""The engine with the Triton backend (the interpreter on CPU) gives the torch backend's outputs."""

import pytest

from inference import LLM, SamplingParams


def test_triton_backend_matches_torch_backend_greedy(model_factory):
    model_dir = model_factory("llama")
    # A prefill, a prefix-cache hit for the second prompt, and mixed decode + prefill steps.
    prompts = [[7, 8, 9, 10, 11] * 4, [7, 8, 9, 10, 11] * 4 + [12, 13, 14], [40, 41, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=128,
            block_size=16,
            max_num_batched_tokens=16,
            attention_backend=backend,
        )
        assert llm.llm_engine.ops.name == backend
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["triton"] == results["torch"]


def test_unknown_backend_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=tiny_model_dir, attention_backend="cuda-magic")
