"""The engine for encoder models (vLLM's pooling runner): add_request / step / abort_request -> embeddings.

It shares LLMEngine's interface (the worker and LLM drive either one) and its Scheduler: requests
wait and are admitted by priority under the step's token and sequence budgets. A pooling request
needs its whole prompt in one step, so chunked prefill and prefix caching are off, and it ends in
the step that runs it: its blocks only count the step's tokens and are freed at once (no K/V is
kept, the encoder attends over the step's own tokens).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from inference.config import DTYPES, EngineArgs
from inference.engine_setup import keep_freed_memory, resolve_device
from inference.fairness import check_weight
from inference.gguf_files import served_model_name
from inference.kv_cache_manager import KVCacheManager
from inference.layers import onednn
from inference.loader import (
    check_model_path,
    init_dummy_weights,
    load_tokenizer,
    load_weights,
    packed_gemms,
    process_weights_after_loading,
    tokenize_prompt,
)
from inference.metrics import EngineMetrics
from inference.models.bert import BertConfig, BertModel, is_encoder_config
from inference.outputs import RequestMetrics
from inference.pooling import PoolingConfig, PoolingParams, finish_embedding, pool
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("inference")


def is_encoder_model(path: str) -> bool:
    """A folder whose config.json names a BERT-family encoder (served by EmbeddingEngine)."""
    config = Path(path) / "config.json"
    return config.is_file() and is_encoder_config(json.loads(config.read_text()))


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (float32, 1-D), or the error that ended it."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: torch.Tensor | None
    finished: bool = True
    error: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    outputs: list = field(default_factory=list)  # no generated choices

    def float32_bytes(self) -> bytes:
        """The embedding as the protocol carries it: float32, little-endian."""
        assert self.embedding is not None, "a failed request has no embedding"
        return self.embedding.float().contiguous().numpy().astype("<f4").tobytes()


class PoolingRequest(Request):
    """A Request that runs once, whole, and keeps its embedding."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        pooling: PoolingParams,
        priority: int,
        arrival_time: float | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ):
        super().__init__(
            request_id,
            prompt,
            token_ids,
            SamplingParams(max_tokens=1),
            priority,
            arrival_time,
            tenant=tenant,
            weight=weight,
        )
        self.pooling = pooling
        self.embedding: torch.Tensor | None = None


class EmbeddingEngine:
    task = "embed"  # what the worker publishes (protocol.EMBED_TASK); LLMEngine generates

    def __init__(self, args: EngineArgs, progress: bool = True):
        self.args = args
        self.device = resolve_device(args.device)
        torch.manual_seed(args.seed)
        check_model_path(args.model, args.load_format)
        raw = json.loads((Path(args.model) / "config.json").read_text())
        self.model_config = cfg = BertConfig.from_dict(raw)
        self.pooling = PoolingConfig.from_folder(args.model, cfg.hidden_size, raw)
        self.dtype = self._dtype(args.dtype)
        self.max_model_len = self._max_model_len(args.max_model_len)
        self.tokenizer = load_tokenizer(args.model)
        self.served_model_name = args.served_model_name or served_model_name(args.model)
        self.model = self._load_model(progress)
        self.kv = KVCacheManager(self._num_blocks(), args.block_size, enable_prefix_caching=False)
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(self._scheduler_config(), self.kv, self.metrics)
        self.requests: dict[str, PoolingRequest] = {}
        self.memory = {
            "weights_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "max_model_len": self.max_model_len,
            "embedding_dimension": self.pooling.dimension,
        }
        keep_freed_memory(self.device)  # everything loaded: what follows is per-step memory
        logger.info("embedding engine ready: %s, %s pooling", self.memory, self.pooling.mode)

    # ---- start-up -------------------------------------------------------------------------

    def _dtype(self, asked: str) -> torch.dtype:
        dtype = asked if asked != "auto" else (self.model_config.torch_dtype or "float32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]

    def _max_model_len(self, asked: int | None) -> int:
        """The model's positions, and sentence-transformers' max_seq_length where the folder sets one."""
        limit = min(self.model_config.max_position_embeddings, self.pooling.max_seq_length or 1 << 30)
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens")
        return asked or limit

    def _load_model(self, progress: bool) -> BertModel:
        if self.args.tensor_parallel_size != 1 or self.args.quantization:
            raise ValueError("encoder models run on one device, unquantized")
        with torch.device(self.device):
            model = BertModel(self.model_config, self.dtype)
        if self.args.load_format == "dummy":
            init_dummy_weights(model, self.args.seed)
            process_weights_after_loading(model)
        else:
            load_weights(model, self.args.model, progress)
        onednn.warm_up(packed_gemms(model, max_rows=self.args.max_num_batched_tokens, max_logit_rows=0))
        return model.eval()

    def _num_blocks(self) -> int:
        """Room for one step's tokens (each prompt may leave a partial block): the blocks only count them."""
        return -(-self.args.max_num_batched_tokens // self.args.block_size) + self.args.max_num_seqs

    def _scheduler_config(self) -> SchedulerConfig:
        if self.args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.args.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): an embedding runs its whole prompt in one step"
            )
        return SchedulerConfig(
            self.args.max_num_seqs,
            self.args.max_num_batched_tokens,
            self.max_model_len,
            enable_chunked_prefill=False,
            scheduling_policy=self.args.scheduling_policy,
        )

    def shutdown(self) -> None:
        """Nothing to stop (one process); the worker calls it on every engine."""

    def served_info(self) -> dict:
        """What the web tier needs before it queues a request (published in the worker's heartbeat)."""
        pooling = self.pooling
        sizes = None if pooling.matryoshka_dimensions is None else list(pooling.matryoshka_dimensions)
        return {
            "task": self.task,
            "pooling": {
                "dimension": pooling.dimension,
                "matryoshka_dimensions": sizes,
                "mode": pooling.mode,
                "normalize": pooling.normalize,
            },
        }

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt,
        params: PoolingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> None:
        """prompt: text (tokenized with the model's special tokens) or {"prompt_token_ids": [...]};
        tenant / weight: its fair share, as LLMEngine's (the prompt is its whole service)."""
        weight = check_weight(weight)
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError("an embedding model takes PoolingParams, not sampling parameters")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.pooling.check_dimensions(params.dimensions)
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        self._validate_prompt(token_ids)
        request = PoolingRequest(request_id, text, token_ids, params, priority, arrival_time, tenant, weight)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's maximum is {self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.pop(rid, None)
            if request is not None and not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, final_only: bool = False) -> list[EmbeddingRequestOutput]:
        """Schedule whole prompts, encode them in one forward, pool; every scheduled request ends here."""
        plan = self.scheduler.schedule()
        ended = cast(list[PoolingRequest], list(plan.finished))  # this engine's scheduler holds nothing else
        if not plan.is_empty:
            requests = cast(list[PoolingRequest], list(plan.scheduled))
            try:
                vectors = self._encode(requests)
            except Exception as exc:  # the batch's requests fail; the next step runs as usual
                for request in requests:
                    self.scheduler.fail(request, "the forward pass", exc, plan)
            else:
                self.scheduler.update_from_output(plan, [])  # advances them (and counts prompt tokens)
                for request, vector in zip(requests, vectors):
                    self._finish(request, vector, plan)
            ended.extend(r for r in requests if r not in ended)
        return [self._output(request) for request in ended]

    def _encode(self, requests: list[PoolingRequest]) -> list[torch.Tensor]:
        lengths = [r.num_prompt_tokens for r in requests]
        ids = [t for r in requests for t in r.prompt_token_ids]
        positions = [p for n in lengths for p in range(n)]
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), lengths)
        return list(pool(hidden, lengths, self.pooling.mode))

    def _finish(self, request: PoolingRequest, vector: torch.Tensor, plan) -> None:
        try:
            request.embedding = finish_embedding(vector, self.pooling, request.pooling.dimensions).cpu()
        except Exception as exc:
            self.scheduler.fail(request, "pooling", exc, plan)
            return
        request.metrics.first_token_time = time.time()
        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        self.metrics.observe_finished(request.metrics, 0, RequestStatus.FINISHED_STOPPED.value)

    def _output(self, request: PoolingRequest) -> EmbeddingRequestOutput:
        self.requests.pop(request.request_id, None)
        if request.embedding is None and request.error is None:  # ended by the scheduler (it cannot fit)
            request.error = f"scheduling failed: the request ended as {request.status.value!r} without running"
        return EmbeddingRequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            embedding=request.embedding,
            error=request.error,
            metrics=request.metrics,
        )

    # ---- introspection --------------------------------------------------------------------

    def get_stats(self) -> dict:
        stats = self.kv.stats()
        stats.update(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.metrics.prompt_tokens_total,
            generation_tokens_total=0,
            requests_finished_total=self.metrics.requests_finished_total,
            kv_fill_at_peak=0.0,
            embedding_dimension=self.pooling.dimension,
        )
        return stats
