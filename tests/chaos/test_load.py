"""Load on `make run` (python -m tessera.run on loopback, tiny model): many concurrent SSE streams
through one and through two web processes (WEB_PROCESSES, one shared listening socket), and the
quota's admission under 100 parallel requests spread over four web processes.

Correctness only is asserted (no 5xx, no lost, duplicated or misrouted token, exact admission
counts); TTFT and wall times are printed and recorded, never compared with a threshold: the
machine may be busy with other work."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from tests.chaos.clients import Answer, completion_body, completion_streams, load_client, post_json, quantile
from tests.platform.run_stack import REPO, WEB_PROCESS, RunStack, environ, make_run_env

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

MAX_TOKENS = 16
# Every stream of a scenario fits the engine at once or in two waves; prompts are short.
ENGINE_ARGS = {"num_kv_blocks": 2048, "max_model_len": 128, "max_num_seqs": 256, "device": "cpu"}
UNLIMITED_PLAN = {
    "QUOTA_CONCURRENT_REQUESTS": "100000",
    "QUOTA_REQUESTS_PER_MINUTE": "1000000",
    "QUOTA_TOKENS_PER_DAY": "10000000000",
    "QUOTA_TOKENS_PER_MONTH": "100000000000",
}
PROMPTS = [f"Story {i}: the tiles of the old house were" for i in range(10)]
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request


def raise_open_files_limit() -> None:
    """500 streams need 500 sockets here (and the stack's children inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536,) * 2)


@contextmanager
def running_stack(model_dir: str, work: Path, web_processes: int, **extra: str):
    raise_open_files_limit()
    env = make_run_env(
        model_dir, work / "var", WEB_PROCESSES=str(web_processes), ENGINE_ARGS=json.dumps(ENGINE_ARGS), **extra
    )
    stack = RunStack.start(env, work / "make-run.log")
    try:
        yield stack
    finally:
        if stack.process.poll() is None:  # Ctrl-C, as a person stops `make run`; close() kills what is left
            stack.process.send_signal(signal.SIGTERM)
            try:
                stack.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        stack.close()


@pytest.fixture
def one_web(tiny_model_dir, tmp_path_factory):
    with running_stack(tiny_model_dir, tmp_path_factory.mktemp("load-1web"), 1, **UNLIMITED_PLAN) as stack:
        yield stack


@pytest.fixture
def two_webs(tiny_model_dir, tmp_path_factory):
    with running_stack(tiny_model_dir, tmp_path_factory.mktemp("load-2web"), 2, **UNLIMITED_PLAN) as stack:
        yield stack


@pytest.fixture(scope="module")  # the module's last two scenarios; closed when the module ends
def four_webs(tiny_model_dir):
    # The concurrency case freezes the engine for a few seconds: its heartbeat must outlive that. The quota
    # ledger's row locks are checked on the production database: `make run DB=postgres`'s embedded PostgreSQL.
    work = Path(tempfile.mkdtemp(prefix="tessera-quota-4web-"))  # outside pytest's 0700 folder: postgres enters it
    work.chmod(0o755)
    try:
        with running_stack(
            tiny_model_dir, work, 4, ENGINE_HEARTBEAT_TTL="60", TESSERA_DB="postgres", **UNLIMITED_PLAN
        ) as stack:
            yield stack
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- helpers


def web_pids(stack: RunStack) -> list[int]:
    return stack.pids(WEB_PROCESS)


def stack_redis(stack: RunStack) -> redis.Redis:
    return redis.Redis.from_url(environ(web_pids(stack)[0])["REDIS_URL"])


def database(stack: RunStack):
    """The stack's database: its embedded PostgreSQL (TESSERA_DB=postgres), else var/db.sqlite3."""
    if url := environ(web_pids(stack)[0]).get("DATABASE_URL"):
        return psycopg.connect(url, connect_timeout=10)
    return sqlite3.connect(Path(stack.env["TESSERA_VAR_DIR"]) / "db.sqlite3", timeout=30)


def usage_rows(stack: RunStack, request_ids: list[str], timeout: float = 60) -> dict[str, list[tuple]]:
    """request id -> its usage rows (status_code, completion_tokens), waiting for the rows still being written."""
    deadline = time.monotonic() + timeout
    while True:
        with closing(database(stack)) as db:
            rows = db.execute("SELECT request_id, status_code, completion_tokens FROM usage_usagerecord").fetchall()
        found: dict[str, list[tuple]] = {}
        for request_id, status, completion in rows:
            found.setdefault(request_id, []).append((status, completion))
        if all(rid in found for rid in request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def held_slots(stack: RunStack, timeout: float = 15) -> dict:
    """Concurrency slots still held once the load is over (waiting for the last settlements)."""
    r = stack_redis(stack)
    deadline = time.monotonic() + timeout
    while True:
        held = {key: r.zcard(key) for key in r.scan_iter(match="quota:*:conc*") if r.zcard(key)}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def served_by(stack: RunStack, since: int, request: str = "POST /v1/completions") -> Counter:
    """How many of these requests each web process answered (its access log, prefixed by name)."""
    pattern = re.compile(rf'^(web(?:-\d+)?)\s*\| .*"{re.escape(request)}(?: HTTP/[\d.]+)?" (\d{{3}})', re.MULTILINE)
    return Counter(m.group(1) for m in pattern.finditer(stack.output()[since:]))


def model_id(stack: RunStack, api_key: str) -> str:
    response = httpx.get(stack.base_url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def references(stack: RunStack, api_key: str, model: str) -> dict[str, tuple[str, list[str]]]:
    """Each prompt's text and tokens from a plain (non-streaming) request made alone, before the load.

    (A text is not always the concatenation of its token strings: a character split over byte-level
    tokens shows as U+FFFD in each token's own string.)"""
    found = {}
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as http:
        for prompt in PROMPTS:
            response = http.post("/v1/completions", json=completion_body(model, prompt, MAX_TOKENS, stream=False))
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert len(choice["logprobs"]["tokens"]) == MAX_TOKENS, choice
            found[prompt] = (choice["text"], choice["logprobs"]["tokens"])
    return found


def streams_scenario(stack: RunStack, n: int) -> dict:
    """n concurrent streams (prompts in turn); asserts every one is whole and right; the figures."""
    _, api_key = stack.admin_login()
    model = model_id(stack, api_key)
    expected = references(stack, api_key, model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    deadline = time.monotonic() + 30  # the references' access-log lines come after their answers
    while sum(served_by(stack, 0).values()) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.1)
    mark = stack.mark()
    bodies = [completion_body(model, prompt, MAX_TOKENS, stream=True) for prompt in prompts]
    results, wall = asyncio.run(completion_streams(stack.base_url, api_key, bodies))

    statuses = Counter(r.status for r in results)
    problems = {i: p for i, r in enumerate(results) if (p := r.problems(MAX_TOKENS))}
    assert not problems, (statuses, dict(list(problems.items())[:10]), stack.output()[-3000:])
    # Greedy on a model without near-ties: every stream of a prompt is that prompt's reference, token for
    # token, and its deltas add up to the reference's text, so no token was lost, repeated or delivered
    # to another stream under load.
    wrong = [
        (i, (r.text, r.tokens), expected[p])
        for i, (r, p) in enumerate(zip(results, prompts))
        if (r.text, r.tokens) != expected[p]
    ]
    assert not wrong, wrong[:5]
    request_ids = [next(iter(r.ids)) for r in results]
    assert len(set(request_ids)) == n
    rows = usage_rows(stack, request_ids)
    bad_rows = {rid: rows.get(rid) for rid in request_ids if rows.get(rid) != [(200, MAX_TOKENS)]}
    assert not bad_rows, list(bad_rows.items())[:10]
    assert not (held := held_slots(stack)), ("concurrency slots still held after the load", held)

    ttfts = [r.ttft for r in results]
    served = served_by(stack, mark)
    figures = {
        "n": n,
        "wall": wall,
        "ttft_p50": quantile(ttfts, 0.5),
        "ttft_p99": quantile(ttfts, 0.99),
        "ttft_max": max(ttfts),
        "last_end": max(r.ended_at - r.sent_at for r in results),
        "statuses": statuses,
        "served": served,
        "tokens": sum(len(r.tokens) for r in results),
    }
    print(
        f"\n{n} streams: {dict(statuses)}; wall {wall:.1f} s; TTFT p50 {figures['ttft_p50']:.2f} s, "
        f"p99 {figures['ttft_p99']:.2f} s, max {figures['ttft_max']:.2f} s; {figures['tokens']} tokens; "
        f"served by {dict(served)}; load average {os.getloadavg()[0]:.1f}"
    )
    return figures


def _figures_text(f: dict) -> str:
    served = ", ".join(f"{name} {count}" for name, count in sorted(f["served"].items()))
    return (
        f"{f['statuses'][200]} x 200, 0 x 5xx; TTFT p50 {f['ttft_p50']:.2f} s, p99 {f['ttft_p99']:.2f} s; "
        f"all {f['n']} done in {f['wall']:.1f} s ({served}); load average {os.getloadavg()[0]:.1f}"
    )


# ---------------------------------------------------------------- the scenarios


def test_100_concurrent_streams_through_one_web_process(one_web, chaos_report):
    """load: 100 concurrent SSE streams (16 tokens each) through one web process"""
    figures = streams_scenario(one_web, 100)
    chaos_report(
        "every stream 200 and whole: 16 tokens streamed as usage says, text_offset without a gap or "
        "repeat, text and tokens those of the same prompt asked alone; one usage row each; no slot held",
        _figures_text(figures),
    )


def test_500_concurrent_streams_through_two_web_processes(two_webs, chaos_report):
    """load: 500 concurrent SSE streams (16 tokens each) through two web processes on one socket"""
    assert len(web_pids(two_webs)) == 2
    figures = streams_scenario(two_webs, 500)
    # The kernel spread the connections over both processes (their access logs).
    assert set(figures["served"]) == {"web", "web-2"}, figures["served"]
    chaos_report(
        "every stream 200 and whole (as with one web process); both web processes served streams",
        _figures_text(figures),
    )


PARALLEL = 100
RPM_LIMIT = 30
CONCURRENCY_LIMIT = 5
TOKEN_REQUESTS = 30  # how many requests the tokens/day budget has room for
QUOTA_PROMPT = "Quota probe: count the tiles"
QUOTA_MAX_TOKENS = 4


def create_users(stack: RunStack, plans: dict[str, dict]) -> dict[str, dict]:
    """A user with its own Plan and API key for each entry (`manage.py shell` on the stack's database)."""
    script = f"""
import json
from django.contrib.auth import get_user_model
from accounts.services import create_api_key
from quotas.models import Plan, UserPlan
out = {{}}
for name, limits in json.loads({json.dumps(json.dumps(plans))}).items():
    user = get_user_model().objects.create_user(name, name + "@localhost", "unused-" + name)
    UserPlan.objects.create(user=user, plan=Plan.objects.create(name=name, **limits))
    out[name] = {{"id": user.pk, "api_key": create_api_key(user, name="load")[1]}}
print("USERS=" + json.dumps(out))
"""
    env = environ(web_pids(stack)[0])
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "shell", "-c", script],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(re.search(r"^USERS=(.*)$", done.stdout, re.MULTILINE).group(1))


def is_envelope(answer: Answer, code: str) -> bool:
    error = answer.body.get("error")
    return (
        isinstance(error, dict)
        and {"message", "type", "param", "code"} <= set(error)
        and error["code"] == code
        and int(answer.headers.get("retry-after", "0")) >= 1
    )


async def parallel_posts(
    stack: RunStack, api_key: str, body: dict, n: int = PARALLEL, while_running=None
) -> tuple[list[Answer], float]:
    """n copies of body at once, a connection each; while_running(tasks) is awaited meanwhile."""
    started = time.monotonic()
    async with load_client(stack.base_url, api_key, n) as http:
        tasks = [asyncio.ensure_future(post_json(http, "/v1/completions", body)) for _ in range(n)]
        try:
            if while_running is not None:
                await while_running(tasks)
        finally:
            answers = await asyncio.gather(*tasks)
    return list(answers), time.monotonic() - started


def test_quota_admission_is_exact_across_four_web_processes(four_webs, chaos_report):
    """quota: 100 parallel requests against a tight plan, spread over four web processes"""
    stack = four_webs
    assert len(web_pids(stack)) == 4
    _, admin_key = stack.admin_login()
    model = model_id(stack, admin_key)
    body = completion_body(model, QUOTA_PROMPT, QUOTA_MAX_TOKENS, stream=False)
    # The size of one request as the ledger reserves it (prompt + max_tokens) and settles it (with
    # ignore_eos the real usage is the same): asked once, by the admin, whose plan is not tight.
    probe = httpx.post(
        stack.base_url + "/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {admin_key}"}
    )
    assert probe.status_code == 200, probe.text
    size = probe.json()["usage"]["total_tokens"]
    assert probe.json()["usage"]["completion_tokens"] == QUOTA_MAX_TOKENS
    token_budget = TOKEN_REQUESTS * size + size // 2  # room for exactly TOKEN_REQUESTS, not one more
    users = create_users(
        stack,
        {
            "rpm": {"requests_per_minute": RPM_LIMIT},
            "conc": {"concurrent_requests": CONCURRENCY_LIMIT},
            "tokens": {"tokens_per_day": token_budget},
        },
    )
    r = stack_redis(stack)
    mark = stack.mark()

    # 1. requests per minute: the 60 s window holds exactly RPM_LIMIT admissions.
    answers, rpm_wall = asyncio.run(parallel_posts(stack, users["rpm"]["api_key"], body))
    assert rpm_wall < 50, f"the {PARALLEL} requests took {rpm_wall:.0f} s: the 60 s window no longer holds them all"
    rpm = Counter(a.status for a in answers)
    assert rpm == {200: RPM_LIMIT, 429: PARALLEL - RPM_LIMIT}, (rpm, [a for a in answers if a.status != 429][:3])
    assert all(is_envelope(a, "rate_limit_exceeded") for a in answers if a.status == 429), answers[:3]
    assert r.zcard(f"quota:{users['rpm']['id']}:rpm") == RPM_LIMIT

    # 2. concurrency: with the engine frozen, every admitted request holds its slot until it is let go,
    # so the refusals are exactly the requests beyond the limit (whatever the timing).
    engine = stack.pid("manage.py engine")
    conc_key = f"quota:{users['conc']['id']}:conc"
    seen_held = []

    async def freeze_until_refused(tasks):
        os.kill(engine, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 45
            while sum(t.done() for t in tasks) < PARALLEL - CONCURRENCY_LIMIT and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # nothing else may come back while the engine is frozen
            seen_held.append((sum(t.done() for t in tasks), r.zcard(conc_key)))
        finally:
            os.kill(engine, signal.SIGCONT)

    answers, conc_wall = asyncio.run(
        parallel_posts(stack, users["conc"]["api_key"], body, while_running=freeze_until_refused)
    )
    conc = Counter(a.status for a in answers)
    assert seen_held == [(PARALLEL - CONCURRENCY_LIMIT, CONCURRENCY_LIMIT)], seen_held
    assert conc == {200: CONCURRENCY_LIMIT, 429: PARALLEL - CONCURRENCY_LIMIT}, conc
    assert all(is_envelope(a, "rate_limit_exceeded") for a in answers if a.status == 429), answers[:3]

    # 3. tokens per day: reserved prompt + max_tokens each, settled to the same: floor(budget / size) admitted.
    answers, tokens_wall = asyncio.run(parallel_posts(stack, users["tokens"]["api_key"], body))
    tokens = Counter(a.status for a in answers)
    assert tokens == {200: TOKEN_REQUESTS, 429: PARALLEL - TOKEN_REQUESTS}, tokens
    assert all(is_envelope(a, "insufficient_quota") for a in answers if a.status == 429), answers[:3]
    assert all(a.body["usage"]["total_tokens"] == size for a in answers if a.status == 200)
    day_key = next(k for k in r.scan_iter(match=f"quota:{users['tokens']['id']}:d:*"))
    assert int(r.get(day_key)) == TOKEN_REQUESTS * size

    # Every answer was recorded: the admitted ones with their tokens, the refusals as 429 rows.
    with closing(database(stack)) as db:
        recorded = {
            name: Counter(
                db.execute(f"SELECT status_code FROM usage_usagerecord WHERE user_id = {int(user['id'])}").fetchall()
            )
            for name, user in users.items()
        }
    expected = {"rpm": RPM_LIMIT, "conc": CONCURRENCY_LIMIT, "tokens": TOKEN_REQUESTS}
    assert recorded == {name: {(200,): ok, (429,): PARALLEL - ok} for name, ok in expected.items()}, recorded
    assert not (held := held_slots(stack)), ("concurrency slots still held", held)
    served = served_by(stack, mark)
    assert len(served) >= 2, served  # the admissions really were spread over processes
    print(
        f"\nquota over 4 web processes: requests/minute {dict(rpm)} in {rpm_wall:.1f} s; concurrency "
        f"{dict(conc)} in {conc_wall:.1f} s; tokens/day ({token_budget} tokens, {size} a request) {dict(tokens)} in "
        f"{tokens_wall:.1f} s; served by {dict(served)}"
    )
    chaos_report(
        f"exact admission: requests/minute {RPM_LIMIT} -> {RPM_LIMIT} admitted; concurrency "
        f"{CONCURRENCY_LIMIT} (engine frozen) -> {CONCURRENCY_LIMIT}; tokens/day for {TOKEN_REQUESTS} "
        f"requests -> {TOKEN_REQUESTS}; every 429 in the envelope with Retry-After; usage rows exact",
        f"{rpm[200]}+{conc[200]}+{tokens[200]} x 200, {rpm[429]}+{conc[429]}+{tokens[429]} x 429, 0 x 5xx; "
        f"{rpm_wall:.1f} / {conc_wall:.1f} / {tokens_wall:.1f} s per 100; served by "
        + ", ".join(f"{name} {count}" for name, count in sorted(served.items())),
    )


def listening_inode(port: int) -> str:
    """The inode of the one socket listening on 127.0.0.1:port (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            found.append(fields[9])
    assert len(found) == 1, f"{len(found)} sockets listen on port {port}"
    return found[0]


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def test_a_killed_web_process_comes_back_on_the_same_socket(four_webs, chaos_report):
    """one of four web processes `kill -9` (WEB_PROCESSES=4, one shared socket)"""
    stack = four_webs
    _, api_key = stack.admin_login()
    inode = listening_inode(int(stack.env["PORT"]))
    before = web_pids(stack)
    assert len(before) == 4 and all(inode in socket_inodes(pid) for pid in before + [stack.process.pid])
    victim = before[1]
    mark = stack.mark()
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    async def models(n: int) -> list[Answer]:
        async with load_client(stack.base_url, api_key, n) as http:
            return list(await asyncio.gather(*(http_get(http, "/v1/models") for _ in range(n))))

    # Meanwhile the other three go on accepting on the socket (the launcher holds it open: no refusal).
    meanwhile = asyncio.run(models(50))
    assert Counter(a.status for a in meanwhile) == {200: 50}, [a for a in meanwhile if a.status != 200][:3]
    name = stack.wait_for(r"^(web(?:-\d+)?) was killed by signal 9; restarting it in \d+s$", 30, since=mark).group(1)
    stack.wait_for(rf"^{re.escape(name)} restarted \(restart 1\)$", 60, since=mark)
    deadline = time.monotonic() + 120
    while len(after := web_pids(stack)) < 4 or served_by(stack, mark, "GET /health").get(name, 0) == 0:
        assert time.monotonic() < deadline, (after, stack.output()[-3000:])
        httpx.get(stack.base_url + "/health", timeout=30)  # until the restarted one has answered one
        time.sleep(0.05)
    back_at = time.monotonic()
    [restarted] = set(after) - set(before)
    assert victim not in after and inode in socket_inodes(restarted)
    assert listening_inode(int(stack.env["PORT"])) == inode  # still the one socket, nothing bound anew
    again = asyncio.run(models(100))
    assert Counter(a.status for a in again) == {200: 100}
    chaos_report(
        f"the supervisor restarted {name} on the launcher's socket (same inode); the other three answered meanwhile",
        f"50 / 50 answered during the restart; {name} answering again {back_at - killed_at:.1f} s after "
        "the kill; 100 / 100 after",
    )


async def http_get(http, path: str) -> Answer:
    try:
        response = await http.get(path)
    except httpx.HTTPError as exc:
        return Answer(0, {}, {}, f"{type(exc).__name__}: {exc}")
    return Answer(response.status_code, dict(response.headers), {})
