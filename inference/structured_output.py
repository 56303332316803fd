"""Structured outputs: a grammar compiled once per spec, one matcher per sequence, a token mask per step.

A request asks for at most one of: a JSON schema, any JSON object, a regex, a choice among
strings, or an EBNF grammar (vLLM's `structured_outputs` / `guided_*` kinds). The grammar is
compiled on a background thread (the engine's step loop never waits for a compile; a request
is scheduled once its grammar is ready) and cached by spec, so repeated schemas cost nothing.
Each sequence gets its own matcher; before sampling, the rows that have one are masked to the
tokens the grammar allows, and EOS is allowed only where the grammar may end. Recompute
preemption keeps the output tokens, so a matcher needs no rollback; an n > 1 fork gets a fresh
matcher of the same grammar (forks happen before the first output token). Speculative decoding reads a
matcher ahead and rolls it back: proposals are cut to the prefix the grammar accepts, and each
verification row is masked as the grammar stands after the proposals before it; only the tokens the
scheduler appends advance it.

Backend: xgrammar (vLLM's default): its mask costs less per step than llguidance's at batch 1 and
the same at batch 64 (docs/kernels.md has the measurement).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one kind. `json` is a schema (dict or JSON text); `choice` a list of strings."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.choice, list):  # a str is not a list of choices (tuple("yes") would be 3)
            object.__setattr__(self, "choice", tuple(self.choice))
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {chosen or 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, tuple) or not choice or not all(isinstance(c, str) and c for c in choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value if isinstance(value, str) else json.dumps(value)

    def to_dict(self) -> dict:
        value = getattr(self, self.kind)
        return {self.kind: list(value) if self.kind == "choice" else value}


def build_grammar(spec: StructuredOutputs):
    """The spec as an xgrammar Grammar (parsed, not yet compiled against a vocabulary)."""
    from xgrammar import Grammar

    if spec.kind in ("json", "json_object"):
        schema = spec.json if spec.kind == "json" else {"type": "object"}
        # Compact JSON: "any whitespace" lets a small model pad with spaces until max_tokens.
        return Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema), any_whitespace=False)
    if spec.kind == "regex" and spec.regex is not None:
        return Grammar.from_regex(spec.regex)
    if spec.kind == "choice" and spec.choice is not None:
        return Grammar.from_regex("(" + "|".join(re.escape(choice) for choice in spec.choice) + ")")
    assert spec.grammar is not None  # StructuredOutputs holds exactly one kind, and its value
    return Grammar.from_ebnf(spec.grammar)


def check_syntax(spec: StructuredOutputs) -> None:
    """ValueError naming the kind when the spec does not parse: cheap (under a millisecond, no
    vocabulary), so the web tier answers a bad schema with a 400 before anything is queued."""
    with _naming_the_problem(spec):
        build_grammar(spec)


@contextmanager
def _naming_the_problem(spec: StructuredOutputs):
    try:
        yield
    except Exception as exc:  # xgrammar raises RuntimeError with "[time] file.cc:line: message"
        message = re.sub(r"^\[[\d:]+\] \S+: ", "", str(exc))
        raise ValueError(f"structured_outputs.{spec.kind} could not be compiled: {message}") from None


class GrammarCompiler:
    """Compiles specs off the caller's thread and caches the result (or the error) per spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._futures: dict[tuple[str, str], Future] = {}
        self.vocab_size = vocab_size

    def submit(self, spec: StructuredOutputs) -> Future:
        key = spec.cache_key()
        if key not in self._futures:
            self._futures[key] = self._pool.submit(self._compile, spec)
        return self._futures[key]

    def compile(self, spec: StructuredOutputs):
        """Blocking: the compiled grammar, or ValueError naming what could not be compiled."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputs):
        with _naming_the_problem(spec):
            return self._compiler.compile_grammar(build_grammar(spec))

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenMasker:
    """One bitmask buffer, reused; masks the rows of a logits batch that have a matcher."""

    def __init__(self, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def apply(self, logits, matchers: list) -> None:
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row in rows:
            matchers[row].fill_next_token_bitmask(self._bitmask, row)
        self._xgr.apply_token_bitmask_inplace(
            logits, self._bitmask[: logits.shape[0]].to(logits.device), vocab_size=self.vocab_size, indices=rows
        )


class StructuredOutputManager:
    """The engine's side: a request with structured outputs waits here until its grammar compiled.

    The compiler (and xgrammar's vocabulary scan, ~0.1 s) is built on first use, so engines that
    never see a grammar never pay for it.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._compiler_args = (tokenizer, vocab_size, list(stop_token_ids))
        self._compiler: GrammarCompiler | None = None
        self.pending: list = []  # Requests whose grammar (a Future on request.grammar) is compiling

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._compiler_args)
        return self._compiler

    def hold(self, request) -> bool:
        """Start compiling; True when the grammar was already compiled (the request may run now)."""
        request.grammar = self.compiler.submit(request.params.structured_outputs)
        if request.grammar.done() and request.grammar.exception() is None:
            request.matcher = self.new_matcher(request)
            return True
        self.pending.append(request)
        return False

    def release_ready(self) -> list:
        """Requests whose compile ended; those that compiled have their matcher, the others an exception."""
        ready = [r for r in self.pending if r.grammar.done()]
        self.pending = [r for r in self.pending if not r.grammar.done()]
        for request in ready:
            if request.grammar.exception() is None:
                request.matcher = self.new_matcher(request)
        return ready

    def new_matcher(self, seq):
        return self.compiler.matcher(seq.grammar.result())

    def wait(self, timeout: float) -> None:
        """Block until a pending compile ends (or timeout): an engine with nothing else to do."""
        if self.pending:
            wait([r.grammar for r in self.pending], timeout=timeout, return_when=FIRST_COMPLETED)

    def discard(self, request) -> None:
        if request in self.pending:
            self.pending.remove(request)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


# ---- speculative decoding: proposals read against the grammar ------------------------------------


def grammar_prefix(matcher, tokens: list[int]) -> list[int]:
    """The longest prefix of tokens the grammar accepts from the matcher's state; the state is unchanged."""
    accepted = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return tokens[:accepted]


class MatcherAfter:
    """A sequence's matcher read as it will be after `tokens` (a verification row's proposals before it):
    advanced through them for each read, then rolled back, so the sequence's own state never moves."""

    def __init__(self, matcher, tokens: list[int]):
        self.matcher, self.tokens = matcher, tokens

    def is_terminated(self) -> bool:
        with self._advanced():
            return self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        with self._advanced():
            self.matcher.fill_next_token_bitmask(bitmask, row)

    @contextmanager
    def _advanced(self):
        accepted = 0
        try:
            for token in self.tokens:
                if not self.matcher.accept_token(token):
                    raise ValueError(f"proposal {token} breaks the grammar (proposals are cut to its prefix)")
                accepted += 1
            yield
        finally:
            if accepted:
                self.matcher.rollback(accepted)
