"""Model facts from config.json: what each family's options mean for the engine, and what the layer
code does not implement, refused at start-up by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference import LLM
from inference.config import ModelConfig
from inference.engine_setup import resolve_max_model_len


def test_phi3_sliding_window_caps_the_context_as_mistral_s_does(model_factory):
    # A window of W positions is full attention up to W tokens: exact there, so the context stops there.
    cfg = ModelConfig.from_path(model_factory("phi3", sliding_window=128))
    assert cfg.sliding_window == 128
    assert resolve_max_model_len(cfg, None) == 128
    with pytest.raises(ValueError, match="exceeds the model's limit of 128 positions"):
        resolve_max_model_len(cfg, 256)


@pytest.mark.parametrize(
    "family, option, message",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' .*: the gated MLP takes silu or gelu_pytorch_tanh"),
        ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention .*: the layers are causal"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 .*not supported"),
    ],
)
def test_options_the_layers_lack_are_refused_at_start(model_factory, family, option, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=model_factory(family, **option), dtype="float32", max_model_len=64)


def test_gemma_configs_that_name_plain_gelu_mean_its_tanh_form(model_factory):
    # early Gemma releases say "gelu"; transformers reads it as the tanh approximation, and so do we
    folder = Path(model_factory("gemma"))
    raw = json.loads((folder / "config.json").read_text()) | {"hidden_act": "gelu"}
    cfg = ModelConfig.from_dict(str(folder), raw)
    assert (cfg.hidden_act, cfg.embedding_scale, cfg.norm_weight_offset) == ("gelu_pytorch_tanh", 64**0.5, 1.0)
