"""The step-level engine (vLLM's LLMEngine API): add_request / step / abort_request."""

from __future__ import annotations

import logging
import time

import torch

from inference.config import EngineArgs, ModelConfig
from inference.detokenizer import IncrementalDetokenizer
from inference.engine_setup import (
    choose_ops,
    keep_freed_memory,
    resolve_device,
    resolve_max_model_len,
    weight_bytes,
)
from inference.executor import create_executor
from inference.fairness import check_weight
from inference.gguf_files import served_model_name
from inference.kv_cache_manager import KVCacheManager
from inference.loader import check_model_path, end_of_turn_token_ids, load_model, load_tokenizer, tokenize_prompt
from inference.metrics import EngineMetrics
from inference.model_runner import ModelRunner
from inference.outputs import CompletionOutput, RequestOutput
from inference.quantization import describe_weights
from inference.request import Request, RequestStatus
from inference.sampler import Sampler, top_logprobs
from inference.sampling_params import SamplingParams
from inference.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from inference.spec_decode import SpeculativeConfig, create_speculator
from inference.structured_output import StructuredOutputManager
from tessera_kernels import quant_cpu

logger = logging.getLogger("inference")


class LLMEngine:
    def __init__(self, args: EngineArgs, progress: bool = True):
        self.args = args
        self.device = resolve_device(args.device)
        torch.manual_seed(args.seed)
        self.spec_config = SpeculativeConfig.parse(args.speculative_config)  # a bad value fails before any load
        check_model_path(args.model, args.load_format)
        self.model_config = cfg = ModelConfig.from_path(args.model)
        self.dtype = cfg.resolve_dtype(args.dtype)
        self.max_model_len = resolve_max_model_len(cfg, args.max_model_len)
        self.tokenizer = load_tokenizer(args.model)
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | end_of_turn_token_ids(self.tokenizer))
        self.served_model_name = args.served_model_name or served_model_name(args.model)
        self.ops = choose_ops(args, self.device)
        self.executor = create_executor(args, self.device)  # first: it says which shard this process builds
        try:
            self.model = self._load_model(progress)
            self.memory = self._plan_memory()
            num_blocks = self.memory["num_kv_blocks"]
            self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
            self.runner = ModelRunner(
                self.model, args.block_size, num_blocks, self.dtype, self.device, args.enforce_eager
            )
            self.executor.bind(self.runner)
        except BaseException:
            self.executor.shutdown()  # no rank left behind by a failed start
            raise
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(self._scheduler_config(), self.kv, self.metrics)
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.speculator = create_speculator(self.spec_config, self)
        self.requests: dict[str, Request] = {}
        self._idle_since_arrival: float | None = None
        self.warmed_up_at: float | None = None  # time.time() when warm_up() finished
        keep_freed_memory(self.device)  # everything loaded and allocated: what follows is per-step memory
        logger.info("engine ready: %s", self.memory)

    # ---- start-up -------------------------------------------------------------------------

    def _load_model(self, progress: bool):
        return load_model(
            self.args,
            self.model_config,
            self.ops,
            self.dtype,
            self.device,
            self.max_model_len,
            progress,
            self.executor.parallel,
        )

    # enough rows for the packed linears' dequantized path and AMX tiles to load too
    WARM_UP_PROMPT_TOKENS = max(quant_cpu.DEQUANTIZE_FROM_ROWS, quant_cpu.TILES_FROM_ROWS)

    def warm_up(self) -> None:
        """One short prefill and one decode through the model and the LM head, before a worker says it
        is ready: what loads on a forward's first use (the C kernel library, per-shape primitives,
        first-call allocations) loads here rather than on the first request. Once per engine;
        warmed_up_at says when it finished."""
        if self.warmed_up_at is not None:
            return
        tokens = max(1, min(self.WARM_UP_PROMPT_TOKENS, self.max_model_len - 1, self.args.max_num_batched_tokens))
        # blocks no sequence holds and no cached prefix names; an engine that has used them all is warm
        empty = [block for block, state in enumerate(self.kv.pool.state_codes()) if state == 0]
        table = empty[: self.kv.blocks_needed(tokens + 1)]
        if len(table) == self.kv.blocks_needed(tokens + 1):
            with torch.inference_mode():
                for inputs in self.runner.warm_up_inputs(tokens, table):
                    self.executor.execute(inputs)
        self.warmed_up_at = time.time()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op with one); also runs at interpreter exit."""
        self.structured.shutdown()
        self.executor.shutdown()

    def _plan_memory(self) -> dict:
        """Size the KV pool from num_kv_blocks or a memory budget; fail with numbers if too small."""
        cfg, args = self.model_config, self.args
        layer = self.model.layers[0].self_attn
        per_block = ModelRunner.bytes_per_block(
            cfg.num_layers, args.block_size, layer.num_kv_heads, cfg.head_dim, self.dtype
        )
        weights = weight_bytes(self.model)
        blocks_per_seq = -(-self.max_model_len // args.block_size)
        useful = args.max_num_seqs * blocks_per_seq
        activation_peak, total = 0, args.kv_cache_memory
        if args.num_kv_blocks is not None:
            num_blocks = args.num_kv_blocks
        elif self.device.type == "cuda":
            total, activation_peak = profile_cuda(self)
            budget = total * args.gpu_memory_utilization - weights - activation_peak
            num_blocks = min(int(budget // per_block), useful)
        else:
            num_blocks = min(args.kv_cache_memory // per_block, useful)
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"KV pool too small: {num_blocks} blocks x {args.block_size} tokens = "
                f"{num_blocks * args.block_size} tokens < max_model_len {self.max_model_len}; "
                f"one block takes {per_block} bytes. Raise num_kv_blocks / kv_cache_memory or lower max_model_len."
            )
        return {
            "total_bytes": int(total),
            "weights_bytes": int(weights),
            "activation_peak_bytes": int(activation_peak),
            "kv_pool_bytes": int(num_blocks * per_block),
            "num_kv_blocks": int(num_blocks),
            "block_size": args.block_size,
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": round(num_blocks / blocks_per_seq, 2),
            **describe_weights(self.model, self.dtype),  # weights_dtype, quantization, tensor_parallel_size
        }

    def _scheduler_config(self) -> SchedulerConfig:
        args = self.args
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({args.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )
        return SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            self.max_model_len,
            args.enable_chunked_prefill,
            args.long_prefill_token_threshold,
            tuple(self.eos_token_ids),
            args.scheduling_policy,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> None:
        """prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt" text too).

        tenant / weight: whose fair share it is served from and that tenant's weight (fairness.py);
        no tenant makes the request its own tenant.
        """
        weight = check_weight(weight)
        params = (sampling_params or SamplingParams()).with_model_defaults(self.model_config.generation_defaults)
        params = params.bind_tokenizer(self.tokenizer, self.model_config.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        self._validate_prompt(token_ids)
        request = Request(request_id, text, token_ids, params, priority, arrival_time, tenant=tenant, weight=weight)
        request.detok = self._detokenizer(request)
        self.requests[request_id] = request
        if not self.has_unfinished_requests():
            self._idle_since_arrival = time.monotonic()
        # with structured outputs: scheduled once its grammar is compiled, which runs off this thread
        if params.structured_outputs is None or self.structured.hold(request):
            self.scheduler.add_request(request)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one output token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        p = request.params
        return IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            p.skip_special_tokens,
            p.stop_strings,
            p.include_stop_str_in_output,
        )

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self.structured.discard(request)
            for seq in request.group:
                if not seq.is_finished:
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured.pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()  # the whole step: logits made in inference mode are updated in place by the sampler
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, run one forward, sample, detokenize; outputs of the requests that progressed.

        final_only=True (the offline API) returns only finished requests, which skips building
        cumulative outputs (and decoding text) for every running request every step. A request
        that fails in this step comes back finished with `error` set; the others go on.
        """
        if self._should_wait_for_more_arrivals():
            return []
        failed_grammars = self._release_compiled()
        failed_proposals = self._propose()
        plan = self.scheduler.schedule()
        plan.finished.extend(failed_proposals.finished)
        for request, exc in failed_grammars:
            self.scheduler.fail(request, "structured outputs", exc, plan)
        if plan.is_empty and not plan.finished:
            self.structured.wait(timeout=0.05)  # nothing to run until a grammar is ready: no busy loop
        updated = self._run(plan) if not plan.is_empty else []
        touched = {r.request_id: r for r in plan.finished}
        touched.update((seq.request_id, seq.root) for seq in updated)
        self._observe_kv_fill()
        roots = list(touched.values())
        return [self._output(root) for root in roots if not final_only or self._group_finished(root)]

    def _release_compiled(self) -> list[tuple[Request, BaseException]]:
        """Requests whose grammar compiled join the scheduler; those that could not come back to fail."""
        failed = []
        for request in self.structured.release_ready():
            exc = request.grammar.exception()
            if exc is None:
                self.scheduler.add_request(request)
            else:
                failed.append((request, exc))
        return failed

    def _propose(self) -> SchedulerOutput:
        """Speculative decoding's proposals for this step; a request whose proposal failed fails alone."""
        failed = SchedulerOutput()
        if self.speculator is not None:
            for request, exc in self.speculator.propose(self.scheduler.running):
                self.scheduler.fail(request, "the speculative proposal", exc, failed)
        return failed

    def _should_wait_for_more_arrivals(self) -> bool:
        """scheduler_delay_ms: an idle engine may wait briefly to batch a burst of arrivals."""
        if self._idle_since_arrival is None or not self.args.scheduler_delay_ms:
            return False
        if (time.monotonic() - self._idle_since_arrival) * 1000 < self.args.scheduler_delay_ms:
            return True
        self._idle_since_arrival = None
        return False

    def _run(self, plan: SchedulerOutput) -> list[Request]:
        start = time.perf_counter()
        try:
            self.executor.copy_blocks(plan.block_copies)
            inputs = self.runner.prepare(plan)
            hidden, logits = self.executor.execute(inputs)
        except Exception as exc:
            for request in plan.scheduled:  # the batch's requests fail (unless fatal); the next step runs as usual
                self.scheduler.fail(request, "the forward pass", exc, plan)
            return []
        self._record_prompt_logprobs(inputs, hidden, plan)
        sampled = self._sample_and_verify(inputs.sampling_requests, logits, plan) if logits is not None else []
        self._detokenize(sampled, plan)
        updated = self.scheduler.update_from_output(plan, sampled)
        # what k weighs: this machine's decode steps as they run (a captured step runs eagerly, several times slower)
        if self.speculator is not None and is_decoding(plan) and not self.runner.last_step_captured:
            self.speculator.costs.observe_step(plan.num_tokens, time.perf_counter() - start)
        return updated

    def _sample_and_verify(
        self, requests: list[Request], logits: torch.Tensor, plan: SchedulerOutput
    ) -> list[SampledToken]:
        """Plain rows through the batched sampler; each speculating sequence's 1 + k rows are verified."""
        if not plan.spec_tokens:
            return self._sample(requests, logits, plan)
        plain, plain_rows, verified, row = [], [], [], 0
        for request in requests:
            drafts = plan.spec_tokens.get(request)
            if drafts:
                verified.append((request, row, drafts))
                row += 1 + len(drafts)
            else:
                plain.append(request)
                plain_rows.append(row)
                row += 1
        sampled = self._sample(plain, logits[plain_rows], plan) if plain else []
        for request, first, drafts in verified:
            sampled.extend(self._verify(request, logits[first : first + 1 + len(drafts)], drafts, plan))
        return sampled

    def _verify(
        self, seq: Request, logits: torch.Tensor, drafts: list[int], plan: SchedulerOutput
    ) -> list[SampledToken]:
        assert self.speculator is not None  # only speculating engines verify
        try:
            tokens, entries = self.speculator.verify(logits, seq, drafts)
        except Exception as exc:
            self.scheduler.fail(seq, "speculative verification", exc, plan)
            return []
        kept = next(
            (
                i + 1
                for i, token in enumerate(tokens)  # a stop token ends the step's tokens there
                if self.scheduler.ends_at(seq, token, seq.num_output_tokens + i + 1)
            ),
            len(tokens),
        )
        return [SampledToken(seq, token, entry) for token, entry in zip(tokens[:kept], entries[:kept])]

    def _sample(self, requests: list[Request], logits: torch.Tensor, plan: SchedulerOutput) -> list[SampledToken]:
        seqs, rows = [], []
        for row, request in enumerate(requests):
            try:
                group = self._fork(request) if request.needs_fork else [request]
            except Exception as exc:
                self.scheduler.fail(request, "forking n sequences", exc, plan)
                continue
            seqs.extend(group)
            rows.extend([row] * len(group))
        if not seqs:
            return []
        if rows != list(range(len(requests))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = self._sample_isolated(logits, seqs, plan)
        return [
            SampledToken(seq, token, entry) for seq, token, entry in zip(seqs, tokens, logprobs) if token is not None
        ]

    def _fork(self, parent: Request) -> list[Request]:
        group = parent.fork()
        for child in group[1:]:
            child.detok = self._detokenizer(child)
            if child.grammar is not None:
                child.matcher = self.structured.new_matcher(child)
        return group

    def _sample_isolated(self, logits: torch.Tensor, seqs: list[Request], plan: SchedulerOutput):
        """The batched sampler; if it raises, each row alone, so only the failing requests fail.

        A row sampled alone draws the same noise from its own generator as in the batch (the
        generators are rewound first), so seeded and greedy requests keep their tokens.
        """
        saved = [(s.generator, s.generator.get_state()) for s in seqs if s.generator is not None]
        try:
            return self.sampler(logits, seqs)
        except Exception:
            logger.exception("batched sampling failed; sampling row by row")
        for generator, state in saved:
            generator.set_state(state)
        tokens, entries = [], []
        for row, seq in enumerate(seqs):
            token, entry = None, None
            if not seq.is_finished:
                try:
                    (token,), (entry,) = self.sampler(logits[row : row + 1], [seq])
                except Exception as exc:
                    self.scheduler.fail(seq, "sampling", exc, plan)
            tokens.append(token)
            entries.append(entry)
        return tokens, entries

    def _detokenize(self, sampled: list[SampledToken], plan: SchedulerOutput) -> None:
        stopped = set()  # a speculating sequence's tokens after a stop string are not its text
        for item in sampled:
            seq = item.seq
            if seq.is_finished or seq in stopped:
                continue
            try:
                if item.logprobs is not None:
                    self._decode_logprobs(item.logprobs)
                may_stop = seq.num_output_tokens + 1 >= seq.params.min_tokens  # counting this token
                assert seq.detok is not None  # every accepted request has one
                item.stop_string = seq.detok.add_token(item.token, check_stop=may_stop)
                if item.stop_string is not None:
                    stopped.add(seq)
            except Exception as exc:
                self.scheduler.fail(seq, "detokenization", exc, plan)

    def _decode_logprobs(self, entry) -> None:
        for token_id, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([token_id])

    def _record_prompt_logprobs(self, inputs, hidden, plan: SchedulerOutput) -> None:
        for request, (first_row, count, first_pos) in inputs.prompt_rows.items():
            try:
                self._prompt_logprobs_of(request, hidden[first_row : first_row + count], first_pos)
            except Exception as exc:
                self.scheduler.fail(request, "prompt logprobs", exc, plan)

    def _prompt_logprobs_of(self, request: Request, hidden_rows: torch.Tensor, first_pos: int) -> None:
        logprobs = torch.log_softmax(self.executor.logits_of(hidden_rows).float(), dim=-1)
        k = request.params.prompt_logprobs
        assert request.prompt_logprobs is not None and k is not None  # only requests that asked have rows
        for i in range(hidden_rows.shape[0]):
            target = first_pos + i + 1  # the row at position p predicts the token at p + 1
            # a preempted request recomputes its prompt: each position is recorded once
            if target == len(request.prompt_logprobs) and target < request.num_prompt_tokens:
                entry = top_logprobs(logprobs[i], request.prompt_token_ids[target], k)
                self._decode_logprobs(entry)
                request.prompt_logprobs.append(entry)

    def _observe_kv_fill(self) -> None:
        used = self.kv.pool.num_blocks - self.kv.pool.num_free
        if used:
            real = sum(r.num_computed_tokens for r in self.scheduler.running)
            self.metrics.observe_kv_fill(used * self.kv.block_size, real)

    # ---- outputs --------------------------------------------------------------------------

    @staticmethod
    def _group_finished(root: Request) -> bool:
        """All n sequences are done (or the prompt ended, failed or was aborted before it could fork)."""
        group = root.group
        return all(s.is_finished for s in group) and (
            len(group) == root.n
            or root.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
            or root.num_output_tokens == 0
        )

    def _output(self, root: Request) -> RequestOutput:
        finished = self._group_finished(root)
        if finished:
            self.requests.pop(root.request_id, None)
        outputs = [self._completion(s) for s in root.group]
        return RequestOutput(
            request_id=root.request_id,
            prompt=root.prompt,
            prompt_token_ids=root.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=root.num_cached_tokens,
            prompt_logprobs=root.prompt_logprobs,
            metrics=root.metrics,
            error=root.error,
        )

    @staticmethod
    def _completion(seq: Request) -> CompletionOutput:
        finished = seq.is_finished
        assert seq.detok is not None  # every accepted request has one
        return CompletionOutput(
            index=seq.index,
            text=seq.detok.visible_text(finished),
            token_ids=seq.output_token_ids,
            finish_reason=seq.status.value if finished else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        )

    # ---- introspection --------------------------------------------------------------------

    def get_stats(self) -> dict:
        stats = self.kv.stats()
        stats.update(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.metrics.prompt_tokens_total,
            generation_tokens_total=self.metrics.generation_tokens_total,
            requests_finished_total=self.metrics.requests_finished_total,
            kv_fill_at_peak=self.metrics.kv_fill_at_peak,
            **self.metrics.spec_decode(),
            scheduling_policy=self.scheduler.policy.name,
            tenant_shares=self.scheduler.counters.window.shares(),
        )
        return stats

    def block_map(self, top: int = 10) -> dict:
        """Compact per-block states (0 free, 1 cached, 2 used, 3 shared) and the biggest holders."""
        holders = sorted(((len(t), getattr(s, "request_id", "?")) for s, t in self.kv.tables.items()), reverse=True)
        return {
            "block_size": self.kv.block_size,
            "states": "".join(str(c) for c in self.kv.pool.state_codes()),
            "top_requests": [{"request_id": rid, "blocks": n} for n, rid in holders[:top]],
        }


def profile_cuda(engine: LLMEngine) -> tuple[int, int]:
    """Total device memory and the activation peak of a forward at max_num_batched_tokens."""
    total = torch.cuda.get_device_properties(engine.device).total_memory
    return total, engine.executor.activation_peak_bytes(engine)


def is_decoding(plan: SchedulerOutput) -> bool:
    """Every scheduled request decodes one token or verifies proposals: no prefill in the step."""
    return all(num_new == 1 or request in plan.spec_tokens for request, num_new in plan.scheduled.items())
