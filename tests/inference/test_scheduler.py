"""The scheduler with fake requests and no model (like vLLM's tests/v1/core).

`Sim.step` plays the model and the sampler only: each request that caught up samples the next
value of a counter (so prefixes never repeat by accident), and the scheduler's own
`update_from_output` advances, forks and finishes it.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference.kv_cache_manager import KVCacheManager
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams
from inference.scheduler import SampledToken, Scheduler, SchedulerConfig

BS = 4


class Sim:
    def __init__(self, num_blocks=64, block_size=BS, prefix_caching=True, **config):
        config.setdefault("max_model_len", 100_000)
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(**config), self.kv)
        self.tokens = itertools.count(1000)
        self.ids = itertools.count()
        self.finished: list[Request] = []

    def add(self, prompt_len=None, max_tokens=4, priority=0, prompt=None, n=1, seed=None) -> Request:
        prompt = list(prompt) if prompt is not None else [next(self.tokens) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, n=n, seed=seed)
        request = Request(f"r{next(self.ids)}", None, prompt, params, priority)
        self.sched.add_request(request)
        return request

    def step(self):
        """One step with a fake model: every request that caught up samples the next counter value."""
        out = self.sched.schedule()
        for request, num_new in out.scheduled.items():
            assert request.num_computed_tokens + num_new <= request.num_tokens
        sampled = []
        for request, num_new in out.scheduled.items():
            if request.num_computed_tokens + num_new == request.num_tokens:
                group = request.fork() if request.needs_fork else [request]
                sampled.extend(SampledToken(seq, next(self.tokens)) for seq in group)
        self.sched.update_from_output(out, sampled)
        self.finished.extend(out.finished)
        self.finished.extend(item.seq for item in sampled if item.seq.is_finished)
        return out

    def run(self, max_steps=1000):
        outs = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return outs
            outs.append(self.step())
        raise AssertionError(f"still unfinished after {max_steps} steps: {self.sched.running} {self.sched.waiting}")

    def waiting_order(self) -> list[Request]:
        return [r for _, r in sorted(self.sched.waiting, key=lambda item: item[0])]

    def assert_no_leak(self):
        assert not self.kv.tables
        assert self.kv.pool.num_free == self.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


def first_scheduled_order(outs) -> list[str]:
    seen: list[str] = []
    for out in outs:
        for request in out.scheduled:
            if request.request_id not in seen:
                seen.append(request.request_id)
    return seen


# ---- token budget, chunked prefill, max_num_seqs ------------------------------------------------------


def test_token_budget_is_never_exceeded():
    sim = Sim(max_num_batched_tokens=10)
    for n in (8, 8, 3, 15):
        sim.add(n, max_tokens=5)
    outs = sim.run()
    assert all(0 < out.num_tokens <= 10 for out in outs)
    assert outs[0].num_tokens == 10  # the budget is used fully when there is work
    sim.assert_no_leak()


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_going():
    sim = Sim(max_num_batched_tokens=16)
    short = [sim.add(4, max_tokens=50) for _ in range(2)]
    sim.step()  # both short prompts prefilled (8 tokens), each sampled its first token
    long = sim.add(100, max_tokens=2)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = [s.num_output_tokens for s in short]
        out = sim.step()
        assert [out.scheduled[s] for s in short] == [1, 1]  # every running decode got its token
        assert [s.num_output_tokens for s in short] == [b + 1 for b in before]
        chunks.append(out.scheduled[long])
        assert out.num_tokens <= 16
    assert chunks == [14] * 7 + [2]
    assert long.num_output_tokens == 1  # sampled once its prompt was complete, not before


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sim = Sim(max_num_batched_tokens=16, enable_chunked_prefill=False)
    decoding = sim.add(4, max_tokens=50)
    sim.step()
    long = sim.add(16, max_tokens=2)
    out = sim.step()
    assert long not in out.scheduled  # 1 decode token leaves 15 < 16
    assert out.scheduled == {decoding: 1}


def test_long_prefill_token_threshold_caps_one_prefill():
    sim = Sim(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a, b = sim.add(30, max_tokens=3), sim.add(30, max_tokens=3)
    out = sim.step()
    assert out.scheduled == {a: 8, b: 8}
    outs = [out] + sim.run()
    assert [o.scheduled.get(a) for o in outs[:4]] == [8, 8, 8, 6]
    assert all(o.scheduled.get(a, 1) == 1 for o in outs[4:])  # decodes are never capped below 1
    sim.assert_no_leak()


def test_max_num_seqs_is_respected_and_a_finished_request_frees_its_seat():
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=100)
    requests = [sim.add(4, max_tokens=3 + i) for i in range(4)]
    first = sim.step()
    assert set(first.scheduled) == set(requests[:2])
    outs = [first] + sim.run()
    assert all(len(out.scheduled) <= 2 for out in outs)
    # requests[0] finishes after step 3; requests[2] joins at the very next step
    assert requests[2] in outs[3].scheduled and requests[2] not in outs[2].scheduled
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    sim.assert_no_leak()


# ---- priority --------------------------------------------------------------------------------------


def test_lower_priority_value_first_and_fcfs_within_a_priority():
    sim = Sim(max_num_seqs=1)
    for name_priority in (2, 0, 1, 0, 2, 1):
        sim.add(3, max_tokens=1, priority=name_priority)
    order = first_scheduled_order(sim.run())
    # arrival ids r0..r5 with priorities 2,0,1,0,2,1
    assert order == ["r1", "r3", "r2", "r5", "r0", "r4"]


def test_waiting_heap_keeps_priority_then_arrival_order():
    sim = Sim(max_num_seqs=1)
    blocker = sim.add(3, max_tokens=50, priority=-1)
    sim.step()
    late = [sim.add(2, priority=p) for p in (3, 1, 3, 1)]
    assert sim.waiting_order() == [late[1], late[3], late[0], late[2]]
    assert sim.sched.running == [blocker]


# ---- preemption by recompute -------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_picks_the_latest_arrival_and_requeues_it_first():
    # 6 blocks of 4 tokens; two 8-token prompts take 2 blocks each, so growth soon runs out
    sim = Sim(num_blocks=6, max_num_batched_tokens=64)
    early = sim.add(8, max_tokens=14)  # 22 tokens at the end: each fits the pool alone
    late = sim.add(8, max_tokens=14)
    sim.step()
    assert sim.sched.running == [early, late]
    queued = sim.add(12, max_tokens=1)  # a later same-priority arrival that cannot fit yet
    preempted_out = None
    for _ in range(10):
        out = sim.step()
        if out.preempted:
            preempted_out = out
            break
    assert preempted_out is not None
    assert preempted_out.preempted == [late]
    assert late not in preempted_out.scheduled
    assert late.status is RequestStatus.PREEMPTED
    assert late.num_computed_tokens == 0
    assert late not in sim.kv.tables  # its blocks are freed at once
    assert late.metrics.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert sim.waiting_order() == [late, queued]  # ahead of later arrivals of its priority
    assert early.status is RequestStatus.RUNNING
    outputs_so_far = late.output_token_ids
    sim.run()
    assert late.output_token_ids[: len(outputs_so_far)] == outputs_so_far  # nothing is lost
    assert late.num_output_tokens == 14 and early.num_output_tokens == 14
    sim.assert_no_leak()


def test_preemption_victim_is_the_lowest_priority_running_request():
    sim = Sim(num_blocks=6, max_num_batched_tokens=64)
    low = sim.add(8, max_tokens=12, priority=5)  # arrived first, but least important
    high = sim.add(8, max_tokens=12, priority=0)
    mid = sim.add(4, max_tokens=12, priority=1)
    sim.step()
    assert set(sim.sched.running) == {low, high, mid}
    victims = []
    for _ in range(40):
        out = sim.step()
        victims.extend(out.preempted)
        if victims:
            break
    assert victims[0] is low
    assert high.status is RequestStatus.RUNNING and mid.status is RequestStatus.RUNNING
    sim.run()
    assert [r.num_output_tokens for r in (low, high, mid)] == [12, 12, 12]
    sim.assert_no_leak()


def test_higher_priority_arrival_preempts_for_a_seat():
    sim = Sim(max_num_seqs=1)
    low = sim.add(4, max_tokens=10, priority=5)
    sim.step()
    high = sim.add(4, max_tokens=2, priority=0)
    out = sim.step()
    assert out.preempted == [low] and high in out.scheduled and low not in out.scheduled
    assert low.status is RequestStatus.PREEMPTED
    outs = sim.run()
    finish_step = {r: next(i for i, o in enumerate(outs) if r in o.scheduled and r.is_finished) for r in (low, high)}
    assert finish_step[high] < finish_step[low]
    assert low.num_output_tokens == 10
    sim.assert_no_leak()


def test_a_preempted_request_recomputes_only_what_the_prefix_cache_lost():
    sim = Sim(num_blocks=32, max_num_seqs=1)
    low = sim.add(10, max_tokens=6, priority=5)
    for _ in range(3):
        sim.step()  # 10 prompt + 3 sampled tokens; 12 of them have K/V in 3 full blocks
    high = sim.add(4, max_tokens=1, priority=0)
    out = sim.step()
    assert out.preempted == [low]
    assert sim.kv.stats()["blocks_cached_free"] >= 3  # its full blocks stay reusable
    assert high.is_finished
    length = low.num_tokens  # 13: the 13th token never got its K/V
    out = sim.step()  # low comes back
    assert out.scheduled[low] == length - 12 and low.num_cached_tokens == 0
    sim.run()
    assert low.num_output_tokens == 6
    sim.assert_no_leak()


def test_higher_priority_arrival_preempts_for_blocks():
    sim = Sim(num_blocks=4, max_num_batched_tokens=64)
    low = sim.add(12, max_tokens=4, priority=3)  # 3 of the 4 blocks; 16 tokens at the end
    sim.step()
    high = sim.add(8, max_tokens=2, priority=0)  # needs 2 blocks
    out = sim.step()
    assert out.preempted == [low]
    assert out.scheduled.get(high) == 8
    assert low not in sim.kv.tables
    sim.run()
    assert high.num_output_tokens == 2 and low.num_output_tokens == 4
    sim.assert_no_leak()


def test_same_priority_arrival_waits_instead_of_preempting():
    sim = Sim(max_num_seqs=1)
    first = sim.add(4, max_tokens=5)
    sim.step()
    second = sim.add(4, max_tokens=2)
    out = sim.step()
    assert out.preempted == [] and out.scheduled == {first: 1}
    assert second.status is RequestStatus.WAITING


def test_a_request_preempted_in_a_step_is_not_readmitted_in_that_step():
    sim = Sim(num_blocks=5, max_num_batched_tokens=64)
    a = sim.add(8, max_tokens=20)
    b = sim.add(8, max_tokens=20)
    sim.step()
    for _ in range(10):
        out = sim.step()
        if out.preempted:
            assert b in out.preempted and b not in out.scheduled
            break
    else:
        raise AssertionError("expected a preemption")
    sim.run()
    assert a.is_finished and b.is_finished
    sim.assert_no_leak()


# ---- requests that can never fit, aborts ---------------------------------------------------------------


def test_a_prompt_longer_than_the_pool_finishes_with_length_instead_of_hanging():
    sim = Sim(num_blocks=4, max_num_batched_tokens=64)  # the pool holds 16 tokens
    too_long = sim.add(20, max_tokens=4)
    behind = sim.add(4, max_tokens=2)
    out = sim.step()
    assert out.finished == [too_long]
    assert too_long.status is RequestStatus.FINISHED_LENGTH
    assert behind in out.scheduled  # the queue behind it is not blocked
    sim.run()
    assert behind.num_output_tokens == 2
    sim.assert_no_leak()


def test_a_chunked_prompt_longer_than_the_pool_finishes_with_length():
    sim = Sim(num_blocks=4, max_num_batched_tokens=8)  # chunks of 8 fit; the whole never does
    too_long = sim.add(20, max_tokens=4)
    sim.run(max_steps=20)
    assert too_long.status is RequestStatus.FINISHED_LENGTH
    assert too_long in sim.finished
    sim.assert_no_leak()


def test_a_sequence_outgrowing_the_pool_while_decoding_finishes_with_length():
    sim = Sim(num_blocks=4, max_num_batched_tokens=64)
    grower = sim.add(14, max_tokens=50)
    sim.run(max_steps=20)
    assert grower.status is RequestStatus.FINISHED_LENGTH
    assert grower.num_tokens == 17  # 16 tokens have K/V; the 17th would need a fifth block
    sim.assert_no_leak()


def test_abort_frees_a_running_requests_blocks_at_once():
    sim = Sim(num_blocks=8)
    running = sim.add(10, max_tokens=10)
    sim.step()
    assert sim.kv.pool.num_free == 8 - 3
    sim.sched.finish(running, RequestStatus.FINISHED_ABORTED)
    assert running.status is RequestStatus.FINISHED_ABORTED
    assert running.metrics.finished_time is not None
    assert not sim.sched.has_unfinished()
    sim.assert_no_leak()


def test_abort_of_a_waiting_request_removes_it_from_the_queue():
    sim = Sim(max_num_seqs=1)
    running = sim.add(4, max_tokens=3)
    waiting = [sim.add(4, max_tokens=1) for _ in range(3)]
    sim.step()
    sim.sched.finish(waiting[1], RequestStatus.FINISHED_ABORTED)
    assert sim.waiting_order() == [waiting[0], waiting[2]]
    order = first_scheduled_order(sim.run())
    assert waiting[1].request_id not in order
    assert running.is_finished and waiting[0].is_finished and waiting[2].is_finished
    sim.assert_no_leak()


# ---- prefix caching and n > 1 through the scheduler ------------------------------------------------------


def test_prefix_hit_is_computed_only_from_the_suffix_and_counted():
    sim = Sim(num_blocks=32, max_num_batched_tokens=64)
    prefix = list(range(20))
    first = sim.add(prompt=prefix + [1, 2], max_tokens=1)
    sim.run()
    second = sim.add(prompt=prefix + [3, 4, 5], max_tokens=1)
    out = sim.step()
    assert out.scheduled[second] == 3
    assert second.num_cached_tokens == 20
    stats = sim.kv.stats()
    assert stats["prefix_cache_queries"] == first.num_prompt_tokens + second.num_prompt_tokens
    assert stats["prefix_cache_hits"] == 20
    sim.run()
    sim.assert_no_leak()


def test_parallel_sampling_children_share_the_prompt_and_never_leak():
    sim = Sim(num_blocks=16, max_num_batched_tokens=64)
    parent = sim.add(6, max_tokens=5, n=3, seed=1)
    sim.step()  # prefill, then the fork: three sequences, one prompt's blocks
    assert len(parent.group) == 3
    shared = sim.kv.block_ids(parent)[0]
    assert sim.kv.pool.blocks[shared].ref_cnt == 3
    out = sim.step()  # each writes its second token into the shared partial block: copy on write
    assert len(out.block_copies) == 2
    sim.run()
    assert all(seq.num_output_tokens == 5 for seq in parent.group)
    sim.assert_no_leak()


# ---- random operations never leak blocks or overfill the pool -------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / finish over a small pool (with prefix sharing and forks)."""

    @initialize(
        num_blocks=st.integers(4, 12),
        budget=st.integers(4, 24),
        max_seqs=st.integers(1, 4),
        threshold=st.sampled_from([None, 3, 8]),
    )
    def start(self, num_blocks, budget, max_seqs, threshold):
        self.sim = Sim(
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            long_prefill_token_threshold=threshold,
        )
        self.shared_prefix = list(range(8))  # two full blocks many prompts share

    @rule(
        length=st.integers(1, 40),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 2),
        shared=st.booleans(),
        n=st.sampled_from([1, 1, 2, 3]),
    )
    def add(self, length, max_tokens, priority, shared, n):
        prompt = [next(self.sim.tokens) for _ in range(length)]
        if shared:
            prompt = self.shared_prefix + prompt
        self.sim.add(prompt=prompt, max_tokens=max_tokens, priority=priority, n=n, seed=0)

    @rule()
    def step(self):
        self.sim.step()

    @precondition(lambda self: self.unfinished())
    @rule(data=st.data(), aborted=st.booleans())
    def end_one(self, data, aborted):
        """Abort a whole request (all its sequences) or stop one running sequence."""
        seq = data.draw(st.sampled_from(self.unfinished()))
        if aborted:
            for member in seq.group:
                if not member.is_finished:
                    self.sim.sched.finish(member, RequestStatus.FINISHED_ABORTED)
        elif seq.status is RequestStatus.RUNNING:
            self.sim.sched.finish(seq, RequestStatus.FINISHED_STOPPED)

    def unfinished(self) -> list[Request]:
        sched = self.sim.sched
        return sorted(sched.running + [r for _, r in sched.waiting], key=lambda r: r.sort_key)

    @invariant()
    def blocks_are_consistent(self):
        kv = self.sim.kv
        holders = [0] * kv.pool.num_blocks
        for table in kv.tables.values():
            for block in table:
                holders[block.block_id] += 1
        assert [b.ref_cnt for b in kv.pool.blocks] == holders
        assert set(kv.pool.free_queue) == {i for i, n in enumerate(holders) if n == 0}
        assert 0 <= kv.pool.num_free <= kv.pool.num_blocks
        for seq, table in kv.tables.items():
            assert seq.status is RequestStatus.RUNNING  # only running sequences hold blocks
            assert len(table) * kv.block_size >= seq.num_computed_tokens
        assert len(self.sim.sched.running) <= self.sim.kv.pool.num_blocks

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.run(max_steps=2000)
            self.sim.assert_no_leak()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
TestSchedulerRandomOperations = SchedulerMachine.TestCase


# ---- update_from_output and fail ----------------------------------------------------------------------


def test_update_from_output_advances_caches_and_finishes_at_max_tokens():
    sim = Sim(prefix_caching=True)
    request = sim.add(8, max_tokens=2)
    out = sim.sched.schedule()
    updated = sim.sched.update_from_output(out, [SampledToken(request, 7)])
    assert updated == [request] and request.num_computed_tokens == 8 and request.output_token_ids == [7]
    assert len(sim.kv.hashes[request]) == 2  # both full prompt blocks are in the prefix cache now
    assert sim.sched.metrics.prompt_tokens_total == 8 and sim.sched.metrics.generation_tokens_total == 1
    out = sim.sched.schedule()
    sim.sched.update_from_output(out, [SampledToken(request, 8)])
    assert request.status is RequestStatus.FINISHED_LENGTH and not sim.kv.tables
    assert sim.sched.metrics.requests_finished_total == 1


def test_forks_join_their_parent_before_a_parent_that_stops_frees_its_blocks():
    sim = Sim(eos_token_ids=(0,))
    parent = sim.add(6, max_tokens=5, n=2)
    out = sim.sched.schedule()
    group = parent.fork()
    sim.sched.update_from_output(out, [SampledToken(group[0], 0), SampledToken(group[1], 5)])  # 0 is EOS
    assert parent.status is RequestStatus.FINISHED_STOPPED
    child = group[1]
    assert child.status is RequestStatus.RUNNING and child.num_computed_tokens == 6
    assert len(sim.kv.tables[child]) == 2  # it kept the prompt's blocks the parent gave back


def test_fail_ends_the_whole_group_and_frees_every_block():
    sim = Sim()
    parent = sim.add(6, max_tokens=5, n=3)
    sim.step()  # prefill, fork, first tokens
    other = sim.add(4, max_tokens=5)
    sim.step()
    out = sim.sched.schedule()
    sim.sched.fail(parent.group[2], "detokenization", UnicodeDecodeError("utf-8", b"", 0, 1, "bad"), out)
    assert all(seq.status is RequestStatus.FINISHED_ERROR for seq in parent.group)
    assert parent.error.startswith("detokenization failed: UnicodeDecodeError")
    assert out.finished == [parent]
    assert set(sim.kv.tables) == {other} and sim.sched.running == [other]
    sim.run()
    sim.assert_no_leak()
