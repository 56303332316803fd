"""Per-request state as the scheduler and cache manager see it."""

from __future__ import annotations

import enum
import itertools
import time
import weakref

import torch

from inference.detokenizer import IncrementalDetokenizer
from inference.outputs import Logprob, RequestMetrics
from inference.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed in the engine (Request.error says why)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class Request:
    """One sequence: its tokens, how many of them have K/V in the cache, and its outputs.

    A request with n > 1 is the parent: after its prefill it forks into n sequences (index
    0..n-1) that share its blocks; `group` holds all of them.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        index: int = 0,
        tenant: str | None = None,
        weight: float = 1.0,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.tenant = tenant  # whose share it is served from (fairness.py); None: the request is its own tenant
        self.weight = weight  # the tenant's share weight: its counter grows by service / weight
        self.index = index
        self.n = params.n  # sequences this prompt forks into (kept after the fork sets params.n = 1)
        self.arrival_order = next(_arrival_counter)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.served_prompt_tokens = 0  # prompt positions charged to its tenant (a recompute is not charged again)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # set on the group's first sequence when the request failed
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.generator = self._make_generator(params.seed)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        # a fork's sequences: the root holds its children, a child only a weak reference to the root, so a
        # finished request is freed by its reference count instead of waiting for a full collection
        self.children: list[Request] = []
        self._root: weakref.ref[Request] | None = None
        self.detok: IncrementalDetokenizer | None = None  # set by the engine when it accepts the request
        self.grammar = None  # structured outputs: a Future of the compiled grammar, and this sequence's matcher
        self.matcher = None
        self.spec_token_ids: list[int] = []  # this step's proposed next tokens (speculative decoding)

    @staticmethod
    def _make_generator(seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = torch.Generator()
        gen.manual_seed(seed)
        return gen

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_order, self.index)

    @property
    def tenant_key(self) -> str | tuple[str, str]:
        """The fair-share tenant: the named one, or the request itself (its n sequences together)."""
        return self.tenant if self.tenant is not None else ("request", self.request_id)

    @property
    def root(self) -> "Request":
        """The prompt's first sequence (index 0), which holds the request's group."""
        root = self if self._root is None else self._root()
        assert root is not None, "a fork's root lives as long as the engine holds its group"
        return root

    @property
    def group(self) -> list["Request"]:
        """This prompt's sequences, the root first."""
        root = self.root
        return [root, *root.children]

    @property
    def needs_fork(self) -> bool:
        return self.n > 1 and self._root is None and not self.children

    def fork(self) -> list["Request"]:
        """n > 1 after prefill: spawn the other n - 1 sequences of this prompt; returns the group.

        The children copy this sequence's state; the scheduler gives them its blocks when it
        applies the step's samples (Scheduler.update_from_output).
        """
        root_params = self.params
        self.params = root_params.for_child(0)
        for index in range(1, root_params.n):
            child = Request(
                self.request_id,
                self.prompt,
                self.prompt_token_ids,
                root_params.for_child(index),
                self.priority,
                self.metrics.arrival_time,
                index=index,
                tenant=self.tenant,
                weight=self.weight,
            )
            child.arrival_order = self.arrival_order
            child.served_prompt_tokens = self.served_prompt_tokens
            child.token_ids = list(self.token_ids)
            child.num_cached_tokens = self.num_cached_tokens
            child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
            child.prompt_logprobs = self.prompt_logprobs
            child.grammar = self.grammar  # the engine gives each child a fresh matcher (no token yet)
            child._root = weakref.ref(self)
            self.children.append(child)
        return self.group

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        progress = f"{self.num_computed_tokens}/{self.num_tokens}"
        return f"Request({self.request_id}#{self.index}, {self.status.value}, {progress})"
