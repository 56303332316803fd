"""Engine tests' shared fixtures: the tiny model as our engine and as HF transformers, one of each per module."""

import pytest
import torch

from inference import LLM


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def tiny_hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
