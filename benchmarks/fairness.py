"""Fair share under overload (issue 34), engine level: FCFS and `fair` alternating on one workload.

Two tenants, B arriving at twice A's rate, fixed prompt and output lengths, the engine's batch kept
full (max_num_seqs small); unless --rate is given, A's rate is a share of the capacity measured first
(--load: the total offered, 2.1x by default, so A sends 0.7x against a fair share of 0.5x and both stay
backlogged). Each user's backlog is recorded over time, and the max difference is printed both over the
whole window and over the stretches where both users had requests waiting (the paper's bound is for
those). Then four tenants with weights 1:2:3:4. Service is the paper's weighted tokens (prompt x1 when
the first token comes, output x2 as they come).

With --engine this runs the bare engine in this process. By default it drives `make run`'s stack
(the web tier, Redis and --workers engine workers, as tests/platform/live_stack.py starts them) over
HTTP with two users' API keys, one fresh stack per policy: per-user served tokens over time (each
request's service spread over [first token, last token] as the paper's artifact does), max |W_A - W_B|
against the 2U bound, the final ratio, throughput and TTFT p50/p99 per user; then, on the `fair` stack,
four users whose plans have shares 1:2:3:4, and an interactive user's TTFT alone and under another
user's flood. --vllm runs the same two-user workload against `vllm serve` (FCFS, no tenants) too.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import bench_model_dir, print_table, real_model_path
from inference import LLM, SamplingParams
from inference.fairness import service_bound

FLOOD_NICE = 10  # the interactive phase's flood client (interactive())
FLOOD_LEAD_S = 3.0  # how long the flood runs before the interactive user's first request under it


def engine_capacity(prompt_len: int, output_len: int, max_num_seqs: int) -> float:
    """Requests/s the bare engine finishes with its batch full: six batches' worth queued at once."""
    llm = LLM(model=bench_model_dir(), dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs)
    engine, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    count = 6 * max_num_seqs
    for i in range(count):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(prompt_len)]}, params)
    start = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    return count / (time.monotonic() - start)


def run(
    policy: str,
    rates: dict[str, float],
    weights: dict[str, float],
    seconds: float,
    prompt_len: int,
    output_len: int,
    max_num_seqs: int,
) -> dict:
    llm = LLM(
        model=bench_model_dir(),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    next_arrival = {tenant: 0.0 for tenant in rates}
    ids = itertools.count()
    tenant_of, sent_at, seen, ttft = {}, {}, {}, {tenant: [] for tenant in rates}
    served = {tenant: 0.0 for tenant in rates}
    max_diff, tokens, start = 0.0, 0, time.monotonic()
    times, diffs, both = [], [], []  # per step: W_A - W_B and whether both tenants had requests waiting
    while (now := time.monotonic() - start) < seconds:
        for tenant, rate in rates.items():
            while next_arrival[tenant] <= now:
                rid = str(next(ids))
                prompt = [rng.randrange(3, 8192) for _ in range(prompt_len)]
                engine.add_request(rid, {"prompt_token_ids": prompt}, params, tenant=tenant, weight=weights[tenant])
                tenant_of[rid], sent_at[rid] = tenant, time.monotonic()
                next_arrival[tenant] += rng.expovariate(rate)
        for out in engine.step():
            tenant, new = tenant_of[out.request_id], len(out.outputs[0].token_ids) - seen.get(out.request_id, 0)
            if new and out.request_id not in seen:
                ttft[tenant].append((time.monotonic() - sent_at[out.request_id]) * 1000)
                served[tenant] += prompt_len
            seen[out.request_id] = seen.get(out.request_id, 0) + new
            served[tenant] += 2 * new
            tokens += new
        if len(rates) == 2:
            a, b = (served[t] / weights[t] for t in rates)
            max_diff = max(max_diff, abs(a - b))
            waiting = {request.tenant for _, request in engine.scheduler.waiting}
            times.append(time.monotonic() - start)
            diffs.append(a - b)
            both.append(waiting >= set(rates))
    elapsed = time.monotonic() - start
    kv_tokens = engine.kv.pool.num_blocks * engine.kv.block_size
    engine.abort_request(list(engine.requests))
    return {
        "served": served,
        "max_diff": max_diff,
        "backlogged": backlogged_diff([0.0, *times], [0.0, *diffs], [False, *both]),
        "tok_s": tokens / elapsed,
        "ttft": ttft,
        "bound": service_bound(prompt_len, min(kv_tokens, max_num_seqs * (prompt_len + output_len))),
    }


def pct(values: list[float], q: float) -> float:
    """numpy's default percentile (as vLLM's benchmarks report): never past the largest value, where the
    exclusive method extrapolates beyond it for fewer than 100 values (a p99 of 60 TTFTs)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def served_cells(run: dict) -> list:
    """W_A, W_B, their ratio, max |W_A - W_B| over the whole window, when both users were backlogged, and
    the max difference over any interval in which both stayed backlogged."""
    served, backlogged = run["served"], run["backlogged"]
    return [
        round(served["A"]),
        round(served["B"]),
        served["B"] / max(served["A"], 1.0),
        round(run["max_diff"]),
        backlog_cell(backlogged),
        backlogged["max_diff"] if math.isnan(backlogged["max_diff"]) else round(backlogged["max_diff"]),
    ]


SERVED_HEADERS = ["W_A", "W_B", "W_B/W_A", "max |W_A-W_B|", "both backlogged", "max |dW_A-dW_B| backlogged"]


def backlogged_diff(times: list[float], diffs: list[float], both: list[bool]) -> dict:
    """Over the stretches where both users stayed backlogged (both[i]: throughout the sample interval ending
    at times[i]): the largest |dW_A - dW_B| over any interval inside one (the spread of W_A - W_B there,
    since the 2U bound holds for every such interval, not only from its start), the longest stretch in
    seconds from the window's start, and the share of the window the stretches cover."""
    stretches, i = [], 0
    while i < len(both):
        j = i
        while j < len(both) and both[j]:
            j += 1
        if j > i:
            stretches.append((max(i - 1, 0), j - 1))  # the samples that bound the stretch
        i = j + 1
    if not stretches:
        return {"max_diff": math.nan, "longest": None, "covered": 0.0}
    spread = max(max(diffs[a : b + 1]) - min(diffs[a : b + 1]) for a, b in stretches)
    a, b = max(stretches, key=lambda ab: times[ab[1]] - times[ab[0]])
    covered = sum(times[b_] - times[a_] for a_, b_ in stretches) / max(times[-1] - times[0], 1e-9)
    return {"max_diff": spread, "longest": (times[a] - times[0], times[b] - times[0]), "covered": covered}


def backlog_cell(backlogged: dict) -> str:
    """The longest stretch where both users were backlogged, and the share of the window all stretches cover."""
    if backlogged["longest"] is None:
        return "never"
    low, high = backlogged["longest"]
    return f"{low:.1f}-{high:.1f} s ({backlogged['covered']:.0%})"


def ttft_cells(run: dict) -> list:
    """TTFT p50 and p99 of A, then of B."""
    return [pct(run["ttft"][user], q) for user in ("A", "B") for q in (50, 99)]


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(prog="fairness")
    parser.add_argument("--seconds", type=float, default=None, help="each run's length (60; 180 with --engine)")
    parser.add_argument("--rate", type=float, default=None, help="A's requests/s (B sends twice as many)")
    parser.add_argument(
        "--load",
        type=float,
        default=2.1,
        help="without --rate: the total offered load as a multiple of the measured capacity (A a third of it)",
    )
    parser.add_argument("--calibrate-seconds", type=float, default=15.0, help="the stack's capacity measurement")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--engine", action="store_true", help="the bare engine in this process, not the stack")
    parser.add_argument("--rounds", type=int, default=1, help="FCFS and fair stacks, alternating")
    parser.add_argument(
        "--max-inflight", type=int, default=4096, help="requests a worker may hold (past it they wait in Redis, FCFS)"
    )
    parser.add_argument("--workers", type=int, default=1, help="engine workers reading one request stream")
    parser.add_argument("--model", choices=STACK_MODELS, default="bench", help="the model served")
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=bool(os.environ.get("VLLM_PYTHON")),
        help="the two users against vllm serve too (default: when VLLM_PYTHON names its venv's python)",
    )
    parser.add_argument("--interactive-interval", type=float, default=2.0)
    parser.add_argument("--interactive-seconds", type=float, default=180.0, help="each phase (p99 of ~60 requests)")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (180.0 if args.engine else 60.0)
    if not args.engine:
        return main_stack(args)
    if args.rate is None:
        args.capacity = engine_capacity(args.prompt, args.output, args.max_num_seqs)
        args.rate = args.load / 3 * args.capacity
    rows = []
    for policy in ("fcfs", "fair"):
        result = run(
            policy,
            {"A": args.rate, "B": 2 * args.rate},
            {"A": 1.0, "B": 1.0},
            args.seconds,
            args.prompt,
            args.output,
            args.max_num_seqs,
        )
        rows.append([policy, *served_cells(result), round(result["bound"]), result["tok_s"], *ttft_cells(result)])
    tables = [
        print_table(
            f"Two tenants, B at 2x A's rate ({rates_line(args)}), prompt {args.prompt}, output "
            f"{args.output}, max_num_seqs {args.max_num_seqs}, {args.seconds:.0f} s each (bare engine); both "
            "backlogged: both had requests waiting (the longest such stretch, and the share of the window)",
            [
                "policy",
                *SERVED_HEADERS,
                "2U",
                "output tok/s",
                "A TTFT p50 ms",
                "A p99",
                "B TTFT p50 ms",
                "B p99",
            ],
            rows,
        )
    ]
    weights = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}
    result = run(
        "fair", {t: 2 * args.rate for t in weights}, weights, args.seconds, args.prompt, args.output, args.max_num_seqs
    )
    total = sum(result["served"].values())
    tables.append(
        print_table(
            "Four tenants, weights 1:2:3:4, each at 2x A's rate (fair)",
            ["tenant", "weight", "share", "target"],
            [[t, w, result["served"][t] / total, w / 10] for t, w in weights.items()],
        )
    )
    return "\n".join(tables)


def rates_line(args) -> str:
    rates = f"{args.rate:.2f}/s and {2 * args.rate:.2f}/s"
    if getattr(args, "capacity", None) is None:
        return rates
    return f"{rates}: {args.load}x the measured capacity of {args.capacity:.2f} requests/s in all"


# ---------------------------------------------------------------- through the served stack (the default)


@dataclass
class Streamed:
    user: str
    sent: float
    first: float | None = None
    last: float | None = None
    done: float | None = None  # when it finished or failed; None if cut at the window's end
    tokens: int = 0
    error: str = ""


# --model: the 31M random-weight bench model in float32, or make run's default GGUF file as make run serves it
STACK_MODELS = ("bench", "smollm2")


def launch(policy: str, args, work_dir: Path):
    from tests.platform.live_stack import LiveStack

    print(f"starting the stack (scheduling_policy {policy}, {args.workers} worker(s), {args.model}) ...", flush=True)
    engine_args = {
        "device": "cpu",
        "max_model_len": 1024,
        "max_num_seqs": args.max_num_seqs,
        "scheduling_policy": policy,
        "seed": 0,
    }
    if args.model == "bench":
        model, engine_args["dtype"] = bench_model_dir(), "float32"
    else:
        model, engine_args["dtype"] = real_model_path(), "auto"  # a GGUF file on CPU: packed weights
    env = {
        "SERVED_MODEL_NAME": "bench",
        "ENGINE_HEARTBEAT_INTERVAL": "1",
        "ENGINE_HEARTBEAT_TTL": "5",
        "ENGINE_MAX_INFLIGHT": str(args.max_inflight),
        # one user's backlog may grow as large as the worker may hold: under a long overload the live stack's
        # quota would refuse part of B's, and a refused request is neither service nor backlog
        "QUOTA_CONCURRENT_REQUESTS": str(args.max_inflight),
    }
    if args.workers > 1:  # the workers share the cores instead of each spinning a thread per core
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))
    return LiveStack.start(model, work_dir, engine_args=engine_args, env=env, workers=args.workers)


def key_for(stack, username: str, share: float | None = None) -> str:
    """Another user with an API key of their own (the stack's first user is stack.username); with share, on a
    plan of that fair-share weight and no limits."""
    code = f"from django.contrib.auth.models import User; user = User.objects.create_user({username!r})"
    if share is not None:
        code += (
            "; from quotas.models import Plan, UserPlan"
            f"; UserPlan.objects.create(user=user, plan=Plan.objects.create(name={username!r}, share={share}))"
        )
    stack.manage("shell", "-c", code)
    return stack.manage("create_api_key", username, "--name", "fairness").strip().splitlines()[-1]


async def stream_one(session, url: str, key: str, prompt: list[int], max_tokens: int, record: Streamed) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    # logprobs: every token comes in a chunk of its own, also one whose text the detokenizer holds back (the
    # bench model's random weights emit partial UTF-8), so the first chunk is the first token
    body |= {"stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status != 200:
                record.error, record.done = f"HTTP {response.status}", time.monotonic()
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("logprobs"):
                    now = time.monotonic()
                    record.first = record.first or now
                    record.last = now
                    record.tokens += 0 if chunk.get("usage") else 1
        record.done = time.monotonic()
    except asyncio.CancelledError:
        record.error = "cut at the end of the window"
        raise
    except Exception as exc:  # a failed request is counted, not fatal
        record.error, record.done = repr(exc), time.monotonic()


async def open_loop(base_url: str, keys: dict, rates: dict, seconds: float, args, seed: int) -> tuple[list, float]:
    """Poisson arrivals per user for `seconds`; then every request still open is cut (aborted)."""
    import aiohttp

    rng = random.Random(seed)
    url = base_url + "/v1/completions"
    records: list[Streamed] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        next_at = {user: start + rng.expovariate(rate) for user, rate in rates.items()}
        tasks = []
        while (now := time.monotonic()) < start + seconds:
            for user, rate in rates.items():
                while next_at[user] <= now:
                    record = Streamed(user, now)
                    prompt = [rng.randrange(3, 8192) for _ in range(args.prompt)]
                    tasks.append(asyncio.create_task(stream_one(session, url, keys[user], prompt, args.output, record)))
                    records.append(record)
                    next_at[user] += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(min(next_at.values()), start + seconds) - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records, start


async def closed_loop(base_url: str, key: str, concurrency: int, seconds: float, args) -> list[Streamed]:
    """One user keeping `concurrency` requests in flight for `seconds`; then the open ones are cut."""
    import aiohttp

    rng = random.Random(0)
    url = base_url + "/v1/completions"
    records: list[Streamed] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def client() -> None:
            while True:
                record = Streamed("C", time.monotonic())
                records.append(record)
                prompt = [rng.randrange(3, 8192) for _ in range(args.prompt)]
                await stream_one(session, url, key, prompt, args.output, record)

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def measure_capacity(base_url: str, key: str, args) -> float:
    """Requests/s the stack finishes with its batches full: one user keeps twice the seats in flight; the
    first third of the time is warm-up. Under the benchmark's flood of open streams the web tier takes more
    of the cores, so the capacity then is lower and the users are, if anything, more backlogged."""
    concurrency = 2 * args.max_num_seqs * args.workers
    print(f"measuring the capacity ({concurrency} requests in flight, {args.calibrate_seconds:.0f} s) ...", flush=True)
    records = asyncio.run(closed_loop(base_url, key, concurrency, args.calibrate_seconds, args))
    counted_from = records[0].sent + args.calibrate_seconds / 3
    finished = [r for r in records if r.done is not None and not r.error and r.done >= counted_from]
    return len(finished) / (args.calibrate_seconds * 2 / 3)


def time_grid(start: float, seconds: float, step: float = 0.5) -> list[float]:
    return [start + step * i for i in range(int(seconds / step) + 1)]


def open_spans(spans: list[tuple[float, float | None]], grid: list[float]) -> tuple[list[int], list[int]]:
    """How many [begin, end) spans are open at each grid time, and the fewest open at any moment of the cell
    (previous grid time, this one]; an end of None never comes."""
    events = sorted([(begin, 1) for begin, _ in spans] + [(end, -1) for _, end in spans if end is not None])
    at, fewest, count, k = [], [], 0, 0
    for t in grid:
        low = count
        while k < len(events) and events[k][0] <= t:
            count += events[k][1]
            low = min(low, count)
            k += 1
        at.append(count)
        fewest.append(low)
    return at, fewest


def backlog_curves(records: list[Streamed], grid: list[float]) -> dict:
    """Per user, client-side: requests in flight (sent, not finished) and waiting (sent, no first token yet)
    at each grid time, and whether some request waited throughout each grid cell (the user was backlogged)."""
    curves = {}
    for user in sorted({r.user for r in records}):
        mine = [r for r in records if r.user == user]
        in_flight, _ = open_spans([(r.sent, r.done) for r in mine], grid)
        waiting, fewest = open_spans([(r.sent, r.first or r.done) for r in mine], grid)
        curves[user] = {"in_flight": in_flight, "waiting": waiting, "backlogged": [n >= 1 for n in fewest]}
    return curves


def service_curves(records: list[Streamed], start: float, seconds: float, prompt: int, step: float = 0.5) -> dict:
    """W_user(t): prompt x1 + output x2 of each request, spread evenly over [first token, last token]."""
    grid = time_grid(start, seconds, step)
    curves = {user: [0.0] * len(grid) for user in {r.user for r in records}}
    for r in records:
        if r.first is None or r.last is None:
            continue
        weight = prompt + 2 * r.tokens
        span = max(r.last - r.first, 1e-9)
        for i, t in enumerate(grid):
            curves[r.user][i] += weight * min(max((t - r.first) / span, 0.0), 1.0)
    return curves


def stack_run(policy: str, args, work_dir: Path, first_round: bool = True) -> dict:
    """The two users' workload; on the first round's fair stack, the weighted users and the interactive one too."""
    with launch(policy, args, work_dir) as stack:
        keys = {"A": key_for(stack, "user-a"), "B": stack.api_key}
        if args.rate is None:  # the first stack measures the capacity every run's rates come from
            args.capacity = measure_capacity(stack.base_url, keys["B"], args)
            args.rate = args.load / 3 * args.capacity
            wait_until_idle(stack)
        rates = {"A": args.rate, "B": 2 * args.rate}
        records, start = asyncio.run(open_loop(stack.base_url, keys, rates, args.seconds, args, seed=1))
        result = summarize_stack(records, start, args)
        result["preemptions"] = sum(int(w.get("num_preemptions", 0)) for w in stack.worker_stats())
        if policy == "fair" and first_round:
            wait_until_idle(stack)
            result["weighted"] = weighted_shares(stack, args)
            wait_until_idle(stack)
            result["interactive"] = interactive(stack, keys, args)
    return result


def wait_until_idle(stack, timeout: float = 600.0) -> None:
    """Until the workers hold no request: the requests cut at the end of the last window have been aborted,
    so the next measurement starts on an idle engine (its first requests waited seconds behind them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = stack.worker_stats()
        if stats and all(not (w.get("inflight") or w.get("num_running") or w.get("num_waiting")) for w in stats):
            time.sleep(2)  # a heartbeat later, in case the snapshot predates the last aborts
            return
        time.sleep(0.5)
    raise RuntimeError(f"the engine still held requests {timeout:.0f} s after the window closed")


def vllm_run(args) -> dict:
    """The two users' workload against vllm serve with the same batch size (it has no tenants: FCFS)."""
    from benchmarks.serving_peers import vllm_server

    extra = ("--max-num-seqs", str(args.max_num_seqs))
    with vllm_server(bench_model_dir(), "float32", extra_args=extra) as (base_url, key, _, _):
        rates = {"A": args.rate, "B": 2 * args.rate}
        records, start = asyncio.run(open_loop(base_url, {"A": key, "B": key}, rates, args.seconds, args, seed=1))
    return {**summarize_stack(records, start, args), "preemptions": "-"}


WEIGHTS = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}


def weighted_shares(stack, args) -> dict[str, float]:
    """Four users on plans of share 1:2:3:4, each sending at A's rate: their shares of the service."""
    keys = {user: key_for(stack, user, share) for user, share in WEIGHTS.items()}
    rates = dict.fromkeys(WEIGHTS, args.rate)
    records, start = asyncio.run(open_loop(stack.base_url, keys, rates, args.seconds, args, seed=4))
    served = {user: curve[-1] for user, curve in service_curves(records, start, args.seconds, args.prompt).items()}
    total = sum(served.values()) or 1.0
    return {user: served.get(user, 0.0) / total for user in WEIGHTS}


def summarize_stack(records: list[Streamed], start: float, args) -> dict:
    curves = service_curves(records, start, args.seconds, args.prompt)
    grid = time_grid(start, args.seconds)
    a, b = curves.get("A", [0.0] * len(grid)), curves.get("B", [0.0] * len(grid))
    backlog = backlog_curves(records, grid)
    idle = {"in_flight": [0] * len(grid), "waiting": [0] * len(grid), "backlogged": [False] * len(grid)}
    backlog_a, backlog_b = backlog.get("A", idle), backlog.get("B", idle)
    both = [x and y for x, y in zip(backlog_a["backlogged"], backlog_b["backlogged"])]
    tokens = sum(r.tokens for r in records)
    ttft = {u: [(r.first - r.sent) * 1000 for r in records if r.user == u and r.first] for u in ("A", "B")}
    points = [min(int(len(a) * k / 6), len(a) - 1) for k in range(1, 7)]
    return {
        "served": {"A": a[-1], "B": b[-1]},
        "over_time": [
            (
                round(k * args.seconds / 6),
                a[i],
                b[i],
                *(user[key][i] for key in ("waiting", "in_flight") for user in (backlog_a, backlog_b)),
            )
            for k, i in zip(range(1, 7), points)
        ],
        "max_diff": max(abs(x - y) for x, y in zip(a, b)),
        "backlogged": backlogged_diff([t - start for t in grid], [x - y for x, y in zip(a, b)], both),
        "tok_s": tokens / args.seconds,
        "sent": {u: sum(r.user == u for r in records) for u in ("A", "B")},
        "finished": sum(r.last is not None and not r.error for r in records) / args.seconds,
        "ttft": ttft,
    }


def interactive(stack, keys: dict, args) -> dict:
    """User A chats: one short request, its whole reply, a pause of about `interval` s, the next request;
    alone and then while user B floods as in the two-user workload (twice A's rate there). Each client runs
    in a process of its own, as another user's would: A's shares no event loop and no garbage collector with
    the flood's thousand open streams. The flood's process runs at a lower CPU priority (FLOOD_NICE): it
    stands in for other machines, and on this one it would otherwise take CPU from the stack it measures."""
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1) as probe, spawn.Pool(1, initializer=os.nice, initargs=(FLOOD_NICE,)) as flooder:
        for pool in (probe, flooder):
            pool.apply(client_ready)  # both processes are up, this module imported, before either phase starts
        alone = probe.apply(probe_ttfts, (stack.base_url, keys["A"], args, 2))
        # the flood is under way before A's first request and lasts a second past A's last
        seconds = FLOOD_LEAD_S + args.interactive_seconds + 1
        flood = flooder.apply_async(flood_for, (stack.base_url, keys, {"B": flood_rate(args)}, seconds, args))
        time.sleep(FLOOD_LEAD_S)
        loaded = probe.apply(probe_ttfts, (stack.base_url, keys["A"], args, 3))
        flood.get()
        return {"alone": alone, "flood": loaded}


def client_ready() -> None:
    """Run in each client process before the phases: unpickling it imports this module (and torch with it),
    which would otherwise happen as the flood starts, in the middle of the phase it measures."""
    import aiohttp  # noqa: F401


def flood_for(base_url: str, keys: dict, rates: dict, seconds: float, args) -> None:
    asyncio.run(open_loop(base_url, keys, rates, seconds, args, seed=5))


def flood_rate(args) -> float:
    return 2 * args.rate


def probe_ttfts(base_url: str, key: str, args, seed: int) -> list[float]:
    """The interactive user's TTFTs in ms over args.interactive_seconds: a closed loop, as a person chats
    (the next message after the last reply and a pause drawn with mean args.interactive_interval)."""
    records = asyncio.run(chat_loop(base_url, key, args, random.Random(seed)))
    return [(r.first - r.sent) * 1000 for r in records if r.first]


async def chat_loop(base_url: str, key: str, args, rng: random.Random) -> list[Streamed]:
    import aiohttp

    records: list[Streamed] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        end = time.monotonic() + args.interactive_seconds
        while time.monotonic() < end:
            record = Streamed("A", time.monotonic())
            records.append(record)
            prompt = [rng.randrange(3, 8192) for _ in range(args.prompt)]
            await stream_one(session, base_url + "/v1/completions", key, prompt, args.output, record)
            await asyncio.sleep(rng.expovariate(1.0 / args.interactive_interval))
    return records


def main_stack(args) -> str:
    import tempfile

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        for round_ in range(args.rounds):
            for policy in ("fcfs", "fair") if round_ % 2 == 0 else ("fair", "fcfs"):  # a drifting host favours neither
                run_ = stack_run(policy, args, Path(tmp) / f"{policy}-{round_}", first_round=round_ == 0)
                results.setdefault(policy, []).append(run_)
            if args.vllm:
                results.setdefault("vllm serve (fcfs)", []).append(vllm_run(args))
    bound = service_bound(args.prompt, args.workers * args.max_num_seqs * (args.prompt + args.output))
    rows, over_time = [], []
    for policy, runs in results.items():
        for run_ in runs:
            cells = [run_["tok_s"], run_["finished"], run_["preemptions"], *ttft_cells(run_)]
            rows.append([policy, *served_cells(run_), round(bound), *cells])
            over_time += [[policy, t, round(wa), round(wb), *backlog] for t, wa, wb, *backlog in run_["over_time"]]
    sent = results["fair"][0]["sent"]
    tables = [
        print_table(
            f"Through the stack ({args.model}, {args.workers} worker(s)): B at 2x A's rate ({rates_line(args)}; "
            f"{sent['A']} and {sent['B']} requests sent in {args.seconds:.0f} s), prompt "
            f"{args.prompt}, output {args.output}, max_num_seqs {args.max_num_seqs}, worker max_inflight "
            f"{args.max_inflight}; service = prompt x1 + output x2, spread over [first token, last token]; both "
            "backlogged: each user had a request waiting for its first token (client-side; the longest such "
            "stretch, and the share of the window)",
            [
                "policy",
                *SERVED_HEADERS,
                "2U",
                "output tok/s",
                "finished req/s",
                "preemptions",
                "A TTFT p50 ms",
                "A p99",
                "B TTFT p50 ms",
                "B p99",
            ],
            rows,
        ),
        print_table(
            "Served weighted tokens and each user's backlog over time (client-side: waiting = sent, no first token "
            "yet; in flight = sent, not finished)",
            ["policy", "t s", "W_A", "W_B", "A waiting", "B waiting", "A in flight", "B in flight"],
            over_time,
        ),
    ]
    pairs = list(zip(results["fcfs"], results["fair"]))
    per_round = [
        [i + 1, fcfs["tok_s"], fair["tok_s"], fair["tok_s"] / fcfs["tok_s"]] for i, (fcfs, fair) in enumerate(pairs)
    ]
    if len(pairs) > 1:
        fcfs_all, fair_all = (sum(run_["tok_s"] for run_ in results[policy]) for policy in ("fcfs", "fair"))
        per_round.append(["all", fcfs_all / len(pairs), fair_all / len(pairs), fair_all / fcfs_all])
    tables.append(
        print_table(
            "Output tok/s per round (fresh stacks; odd rounds start with FCFS, even rounds with fair)",
            ["round", "fcfs", "fair", "fair / fcfs"],
            per_round,
        )
    )
    shares = results["fair"][0]["weighted"]
    tables.append(
        print_table(
            f"Four users on plans of share 1:2:3:4, each at {args.rate:.2f}/s for {args.seconds:.0f} s (fair)",
            ["user", "share", "service share", "target"],
            [[user, WEIGHTS[user], shares[user], WEIGHTS[user] / sum(WEIGHTS.values())] for user in WEIGHTS],
        )
    )
    inter = results["fair"][0]["interactive"]
    tables.append(
        print_table(
            f"Interactive user: one request, its reply, a pause of {args.interactive_interval} s on average, for "
            f"{args.interactive_seconds:.0f} s alone, then as long with another user flooding at "
            f"{flood_rate(args):.2f}/s (fair)",
            ["phase", "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms"],
            [[phase, len(v), pct(v, 50), pct(v, 90), pct(v, 99)] for phase, v in inter.items()],
        )
    )
    return "\n".join(tables)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
