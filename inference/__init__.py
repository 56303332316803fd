"""Tessera's inference engine: paged KV cache, continuous batching, vLLM-style API. No Django."""
from inference.config import EngineArgs
from inference.engine import LLMEngine
from inference.llm import LLM
from inference.outputs import CompletionOutput, Logprob, RequestOutput
from inference.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
