"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...)) and .chat(messages), as in vLLM."""

from __future__ import annotations

import itertools
import time
from typing import Any, cast

from tqdm.auto import tqdm

from inference.config import EngineArgs
from inference.embedding_engine import EmbeddingEngine, EmbeddingRequestOutput, PoolingParams, is_encoder_model
from inference.engine import LLMEngine
from inference.outputs import RequestOutput
from inference.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args):
        unknown = set(engine_args) - EngineArgs.names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        engine_cls = EmbeddingEngine if is_encoder_model(model) else LLMEngine  # encoders embed (vLLM: pooling)
        self.llm_engine = engine_cls(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's LLM.chat: each one rendered with the tokenizer's
        chat template (or chat_template), then run as generate() runs prompts.

        messages: one conversation (a list of {"role", "content"} dicts) or a list of them; one
        output per conversation, in order. A tokenizer without a chat template is a ValueError.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or not all(conversations):
            raise ValueError("messages must be a non-empty conversation or a list of non-empty conversations")
        prompts = [
            {
                "prompt_token_ids": self._chat_prompt_ids(
                    c, chat_template, add_generation_prompt, continue_final_message, tools, chat_template_kwargs
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_prompt_ids(
        self,
        conversation: list[dict],
        chat_template,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools,
        chat_template_kwargs,
    ) -> list[int]:
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        # The template writes the BOS token itself; adding special tokens again would double it.
        return list(tokenizer.encode(text, add_special_tokens=False))

    def generate(
        self, prompts=None, sampling_params=None, prompt_token_ids=None, priority=None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Bad input (an empty prompt, one longer than max_model_len, invalid sampling values)
        raises ValueError before anything is queued, so nothing else is affected. A request that
        fails inside the engine comes back finished with `error` set (finish_reason "error").
        """
        inputs = self._inputs(prompts, prompt_token_ids)
        params = self._per_prompt(sampling_params or SamplingParams(), len(inputs), "sampling_params")
        priorities = self._per_prompt(priority if priority is not None else 0, len(inputs), "priority")
        request_ids = [str(next(self._ids)) for _ in inputs]
        engine = self.llm_engine
        added = []
        try:
            for rid, prompt, sp, prio in zip(request_ids, inputs, params, priorities):
                engine.add_request(rid, prompt, sp, priority=prio)
                added.append(rid)
        except ValueError:
            engine.abort_request(added)
            raise
        return self._run_to_completion(request_ids, use_tqdm)

    def embed(
        self, prompts=None, pooling_params: PoolingParams | None = None, prompt_token_ids=None, use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """An encoder model's embeddings, one per prompt in input order (vLLM's LLM.embed)."""
        if not isinstance(self.llm_engine, EmbeddingEngine):
            raise ValueError("embed() needs an embedding (encoder) model; this one generates text")
        outputs = self.generate(prompts, pooling_params or PoolingParams(), prompt_token_ids, use_tqdm=use_tqdm)
        return cast(list[EmbeddingRequestOutput], outputs)  # what an EmbeddingEngine's steps return

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        """The engine's final outputs in request order: RequestOutputs, or an encoder's EmbeddingRequestOutputs."""
        engine = self.llm_engine
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=True):
                if out.finished:
                    finished[out.request_id] = out
                    generated += sum(len(o.token_ids) for o in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output {generated / (time.perf_counter() - start):.1f} tok/s")
        bar.close()
        return [finished[rid] for rid in request_ids]

    @staticmethod
    def _inputs(prompts, prompt_token_ids) -> list:
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if prompts is not None:
            return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        return [{"prompt_token_ids": ids} for ids in prompt_token_ids]

    @staticmethod
    def _per_prompt(value, count: int, name: str) -> list:
        if isinstance(value, list):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
            return value
        return [value] * count
