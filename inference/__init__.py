"""Tessera's inference engine: paged KV cache, continuous batching, vLLM-style API. No Django.

The public names load on first use (PEP 562), so `from inference import protocol` (the web
tier's side of the Redis protocol) does not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "EngineArgs": "inference.config",
    "LLMEngine": "inference.engine",
    "LLM": "inference.llm",
    "CompletionOutput": "inference.outputs",
    "Logprob": "inference.outputs",
    "RequestOutput": "inference.outputs",
    "SamplingParams": "inference.sampling_params",
    "PoolingParams": "inference.pooling",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'inference' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
