"""Fair share between tenants (the `fair` scheduling policy, inference/fairness.py) with fake requests.

The service of a tenant is measured here from what the scheduler did, independently of its counters:
every prompt position computed for the first time counts 1, every sampled token 2 (the paper's
weighted tokens). Prompts never share a prefix, so no position is served by the prefix cache.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_scheduler import Sim, first_scheduled_order

from inference.fairness import (
    OUTPUT_TOKEN_COST,
    PROMPT_TOKEN_COST,
    ServiceWindow,
    VirtualTokenCounters,
    check_weight,
    seat_slack,
    service_bound,
)
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams


class FairSim(Sim):
    """Sim with tenants, weights and a service ledger of its own."""

    def __init__(self, policy="fair", **config):
        super().__init__(scheduling_policy=policy, **config)
        self.requests: list[Request] = []
        self.prompt_done: dict[Request, int] = {}

    def add(self, prompt_len=4, max_tokens=4, tenant=None, weight=1.0, priority=0) -> Request:
        prompt = [next(self.tokens) for _ in range(prompt_len)]
        request = Request(
            f"r{next(self.ids)}",
            None,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            priority,
            tenant=tenant,
            weight=weight,
        )
        self.sched.add_request(request)
        self.requests.append(request)
        return request

    def step(self):
        out = super().step()
        for request in out.scheduled:
            done = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.prompt_done[request] = max(self.prompt_done.get(request, 0), done)
        return out

    def service(self, tenant) -> float:
        return sum(
            PROMPT_TOKEN_COST * self.prompt_done.get(r, 0) + OUTPUT_TOKEN_COST * r.num_output_tokens
            for r in self.requests
            if r.tenant == tenant
        )

    def backlogged(self) -> set:
        return {request.tenant for _, request in self.sched.waiting}

    def bound(self, max_prompt: int, weights) -> float:
        return service_bound(max_prompt, self.kv.pool.num_blocks * self.kv.block_size) / min(weights)


# ---- counters -----------------------------------------------------------------------------------------


def seq(tenant=None, weight=1.0, prompt_len=10, request_id="x"):
    return Request(
        request_id, None, list(range(prompt_len)), SamplingParams(max_tokens=4), tenant=tenant, weight=weight
    )


def test_service_is_divided_by_the_weight_and_output_costs_twice():
    counters = VirtualTokenCounters()
    light, heavy = seq("a"), seq("b", weight=4.0)
    counters.enter(light)
    counters.enter(heavy)
    counters.charge(light, prompt_tokens=10, output_tokens=3)
    counters.charge(heavy, prompt_tokens=10, output_tokens=3)
    assert counters.value("a") == 16.0 and counters.value("b") == 4.0


def test_a_returning_tenant_is_lifted_to_the_smallest_active_counter_and_never_lowered():
    counters = VirtualTokenCounters()
    a, b, c = seq("a"), seq("b"), seq("c")
    counters.enter(a)
    counters.charge(a, prompt_tokens=100)
    counters.enter(b)  # b has been idle: it starts level with a, not 100 behind
    assert counters.value("b") == 100.0
    counters.charge(b, prompt_tokens=500)
    counters.leave(b)
    counters.charge(a, prompt_tokens=50)
    counters.enter(b)  # b comes back ahead of a: it keeps its own, larger counter
    assert counters.value("b") == 600.0
    counters.leave(a)
    counters.leave(b)
    counters.enter(c)  # nobody active: the floor is the counter of the tenant that left last
    assert counters.value("c") == 600.0


def test_a_request_without_a_tenant_is_its_own_tenant_and_is_forgotten_when_it_leaves():
    counters = VirtualTokenCounters()
    first, second = seq(request_id="1"), seq(request_id="2")
    counters.enter(first)
    counters.enter(second)
    counters.charge(first, prompt_tokens=8)
    assert counters.value(first.tenant_key) == 8.0 and counters.value(second.tenant_key) == 0.0
    counters.leave(first)
    counters.leave(second)
    assert counters.counters == {} and counters.active == {}


def test_leave_of_a_request_that_never_entered_is_ignored():
    counters = VirtualTokenCounters()
    counters.leave(seq("a"))  # e.g. aborted while its grammar compiled
    assert counters.active == {}


def test_the_seat_slack_is_the_prompt_charge_still_to_come():
    light, heavy = seq("a", prompt_len=10), seq("b", weight=4.0, prompt_len=10)
    assert seat_slack(light) == 10.0 and seat_slack(heavy) == 2.5  # in counter units: divided by the weight
    light.served_prompt_tokens = 10  # preempted after its prefill: its recompute is not charged again
    assert seat_slack(light) == 0.0


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, "1", None, True])
def test_a_weight_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="weight must be a positive number"):
        check_weight(bad)


def test_share_window_shows_top_tenants_and_sums_the_rest():
    now = [1000.0]
    window = ServiceWindow(seconds=60, clock=lambda: now[0])
    for i, tokens in enumerate([50, 30, 10, 5, 5]):
        window.add(f"t{i}", tokens, weight=float(i + 1))
    window.add(None, 100, weight=1.0)  # requests without a tenant are never a row of their own
    shares = window.shares(top=2)
    assert [(row["tenant"], row["tokens"], row["weight"]) for row in shares["tenants"]] == [
        ("t0", 50, 1.0),
        ("t1", 30, 2.0),
    ]
    assert shares["tenants"][0]["share"] == 0.25
    assert shares["others"] == {"tenants": 4, "tokens": 120, "share": 0.6}
    now[0] += 61  # a minute later it is all gone
    assert window.shares()["total_tokens"] == 0 and window.shares()["tenants"] == []


# ---- the policy in the scheduler -------------------------------------------------------------------------


def flood_then_late_arrival(policy):
    sim = FairSim(policy, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    flood = [sim.add(4, max_tokens=6, tenant="a") for _ in range(10)]
    sim.step()
    late = [sim.add(4, max_tokens=6, tenant="b") for _ in range(2)]
    order = [rid for rid in first_scheduled_order(sim.run()) if rid not in ("r0", "r1")]  # admitted before b came
    sim.assert_no_leak()
    return [r.request_id for r in flood], [r.request_id for r in late], order


def test_fair_admits_a_late_tenant_first_instead_of_behind_a_flood():
    flood, late, order = flood_then_late_arrival("fair")
    assert order[0] == late[0]  # the first admission after the flood's first two
    assert order.index(late[1]) < order.index(flood[5])


def full_batch_then_newcomer(policy):
    """Tenant a fills both seats with long answers; b's one request comes while they decode."""
    sim = FairSim(policy, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    flood = [sim.add(4, max_tokens=30, tenant="a") for _ in range(4)]
    for _ in range(3):
        sim.step()
    newcomer = sim.add(4, max_tokens=4, tenant="b")
    return sim, flood, newcomer, sim.step()


def test_a_tenant_with_nothing_running_gets_the_next_step_not_the_next_seat_that_frees():
    sim, flood, newcomer, out = full_batch_then_newcomer("fair")
    assert newcomer in out.scheduled
    assert out.preempted == [flood[1]]  # the latest running request of the tenant ahead
    sim.run()
    assert all(r.num_output_tokens == 30 for r in flood) and newcomer.num_output_tokens == 4
    sim.assert_no_leak()


def test_fcfs_and_priority_make_the_newcomer_wait_for_a_free_seat():
    for policy in ("fcfs", "priority"):
        _, _, newcomer, out = full_batch_then_newcomer(policy)
        assert newcomer not in out.scheduled and not out.preempted


def test_a_tenant_keeps_its_last_seat_and_tenants_that_hold_one_never_preempt_each_other():
    sim = FairSim(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    for _ in range(40):
        sim.add(4, max_tokens=8, tenant="a")
    sim.step()  # a holds both seats; b, c and d come one request each
    late = [sim.add(4, max_tokens=8, tenant=tenant) for tenant in "bcd"]
    outs = sim.run()
    assert sim.sched.num_preemptions == 1  # b takes one of a's two seats; a's last and b's are never taken
    assert late[0] in outs[0].scheduled and late[1] not in outs[0].scheduled  # c waits for a seat to free
    sim.assert_no_leak()


def test_a_tenant_two_seats_behind_takes_the_next_step_and_seats_even_out_without_swinging_back():
    """An interactive user's second request while its first still runs: a flood holds the other seats."""
    sim = FairSim(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
    flood = [sim.add(4, max_tokens=30, tenant="a") for _ in range(20)]
    sim.step()  # a holds all four seats
    first = sim.add(4, max_tokens=30, tenant="b")
    assert first in sim.step().scheduled  # a 3, b 1
    second = sim.add(4, max_tokens=30, tenant="b")
    out = sim.step()
    assert second in out.scheduled and out.preempted == [flood[2]]  # a 2, b 2: a's latest running request
    third = sim.add(4, max_tokens=30, tenant="b")
    assert third not in sim.step().scheduled  # 2 against 2: it waits for a seat to free
    while sim.sched.running or sim.sched.waiting:
        out = sim.step()
        seats = Counter(r.tenant for r in sim.sched.running)
        assert all(victim.tenant == "a" for victim in out.preempted)  # b, behind, never loses a seat
        assert not out.preempted or seats["b"] <= seats["a"]  # a move narrows the gap, never swings it
    assert all(r.num_output_tokens == 30 for r in [*flood, first, second, third])
    sim.assert_no_leak()


def flood_holds_seven_of_eight_seats() -> FairSim:
    """Another tenant's flood fills an eight-seat batch with the benchmark's request sizes."""
    sim = FairSim(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    for _ in range(60):
        sim.add(64, max_tokens=32, tenant="flood")
    for _ in range(10):
        sim.step()
    return sim


def test_an_interactive_users_next_request_runs_in_the_next_step_though_its_first_put_it_ahead():
    """Lifted level with the flood and charged its first prompt, the user is ahead when its second request
    comes while the first still streams; within that request's prompt charge it still takes a seat."""
    sim = flood_holds_seven_of_eight_seats()
    first = sim.add(64, max_tokens=32, tenant="user")
    assert first in sim.step().scheduled  # the flood 7, the user 1
    sim.step()
    counters = sim.sched.counters
    assert counters.value("flood") < counters.value("user") < counters.value("flood") + 64
    latest = max((r for r in sim.sched.running if r.tenant == "flood"), key=lambda r: r.arrival_order)
    second = sim.add(64, max_tokens=32, tenant="user")
    out = sim.step()
    assert second in out.scheduled and out.preempted == [latest]  # the flood 6, the user 2
    third = sim.add(64, max_tokens=32, tenant="user")  # now ahead by more than its prompt charge: it waits
    assert third not in sim.step().scheduled
    sim.run()
    assert all(r.num_output_tokens == r.params.max_tokens for r in sim.requests)
    sim.assert_no_leak()


def test_a_recompute_takes_no_seat_ahead_of_its_tenants_counter():
    """A preempted request has no prompt charge to come, so it moves only when its tenant is behind."""
    sim = flood_holds_seven_of_eight_seats()
    first = sim.add(64, max_tokens=32, tenant="user")
    sim.step()
    sim.step()
    first.served_prompt_tokens = first.num_prompt_tokens  # as if its prefill was charged before a preemption
    second = sim.add(64, max_tokens=32, tenant="user")
    second.served_prompt_tokens = second.num_prompt_tokens
    assert sim.sched.counters.value("user") > sim.sched.counters.value("flood")
    assert second not in sim.step().scheduled


def test_seat_moves_between_backlogged_tenants_never_swing_back_and_keep_the_bound():
    """Two backlogged tenants, one sending twice the other's rate, with the benchmark's request sizes: every
    preemption moves a seat from a tenant holding at least two more, so the mover then holds no more than
    the victim's tenant and no seat goes back until requests end; service stays within 2U."""
    sim = FairSim(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    seats_at_moves = []
    preempt = sim.sched._preempt

    def spy(victim, out):
        seats_at_moves.append((victim.tenant, Counter(r.tenant for r in sim.sched.running)))
        preempt(victim, out)

    sim.sched._preempt = spy
    for step in range(1500):
        if step % 6 == 0:
            for tenant, count in (("a", 1), ("b", 2)):
                for _ in range(count):
                    sim.add(64, max_tokens=32, tenant=tenant)
        sim.step()
        if step >= 100:
            assert sim.backlogged() == {"a", "b"}
    assert len(seats_at_moves) > 20  # the rule was exercised
    for victim, seats in seats_at_moves:
        mover = "b" if victim == "a" else "a"
        assert seats[mover] + 2 <= seats[victim]
    assert abs(sim.service("a") - sim.service("b")) <= sim.bound(64, [1.0])
    assert sim.service("a") > 0.45 * (sim.service("a") + sim.service("b"))


def test_fcfs_and_priority_serve_the_flood_first():
    for policy in ("fcfs", "priority"):
        flood, late, order = flood_then_late_arrival(policy)
        assert order == flood[2:] + late


def test_priority_stays_the_outer_key_under_fair():
    sim = FairSim(max_num_seqs=1, num_blocks=64, max_num_batched_tokens=64)
    ahead = sim.add(40, max_tokens=2, tenant="a")
    sim.step()
    behind = sim.add(4, max_tokens=2, tenant="b", priority=1)
    urgent = sim.add(4, max_tokens=2, tenant="a", priority=0)  # a is far ahead, but more urgent
    order = first_scheduled_order(sim.run())
    assert order == [ahead.request_id, urgent.request_id, behind.request_id]
    assert ahead.is_finished


def test_fcfs_ignores_priority():
    sim = FairSim("fcfs", max_num_seqs=1)
    early = sim.add(4, max_tokens=2, priority=5)
    late = sim.add(4, max_tokens=2, priority=0)
    assert first_scheduled_order(sim.run()) == [early.request_id, late.request_id]


def backlogged_shares(sim, tenants, per_weight, steps, prompt_len, max_tokens):
    for tenant, weight in tenants.items():
        for _ in range(int(per_weight * weight)):
            sim.add(prompt_len, max_tokens=max_tokens, tenant=tenant, weight=weight)
    for _ in range(steps):
        assert sim.backlogged() == set(tenants)  # everyone stays backlogged over the whole measurement
        sim.step()
    served = {tenant: sim.service(tenant) for tenant in tenants}
    return {tenant: served[tenant] / sum(served.values()) for tenant in tenants}, served


def test_weights_divide_service_in_proportion():
    sim = FairSim(num_blocks=32, max_num_seqs=8, max_num_batched_tokens=32)
    weights = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}
    shares, served = backlogged_shares(sim, weights, per_weight=250, steps=1200, prompt_len=6, max_tokens=6)
    for tenant, weight in weights.items():
        assert shares[tenant] == pytest.approx(weight / 10, abs=0.02), shares
    normalized = [served[t] / w for t, w in weights.items()]
    assert max(normalized) - min(normalized) <= sim.bound(6, weights.values())


def test_equal_weights_share_equally_whoever_sends_more():
    sim = FairSim(num_blocks=32, max_num_seqs=8, max_num_batched_tokens=32)
    for _ in range(250):
        sim.add(6, max_tokens=6, tenant="a")
    for _ in range(750):  # b sends three times as much
        sim.add(6, max_tokens=6, tenant="b")
    for _ in range(300):
        assert sim.backlogged() == {"a", "b"}
        sim.step()
    assert abs(sim.service("a") - sim.service("b")) <= sim.bound(6, [1.0])
    assert sim.service("a") > 2000


def test_an_idle_tenant_cannot_bank_credit():
    sim = FairSim(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
    for _ in range(400):
        sim.add(6, max_tokens=6, tenant="busy")
    for _ in range(300):  # "idle" sends nothing while busy is served alone
        sim.step()
    before = sim.service("busy")
    assert before > 1000
    for _ in range(200):
        sim.add(6, max_tokens=6, tenant="idle")
    for _ in range(200):
        assert sim.backlogged() == {"busy", "idle"}
        sim.step()
    gained_busy, gained_idle = sim.service("busy") - before, sim.service("idle")
    # without the lift idle would take everything until it caught up with busy's 1000+
    assert abs(gained_busy - gained_idle) <= sim.bound(6, [1.0])
    assert gained_busy > 0.4 * (gained_busy + gained_idle)


def test_preemption_victim_comes_from_the_tenant_furthest_ahead():
    victims = {}
    for policy in ("fair", "priority"):
        sim = FairSim(policy, num_blocks=20, max_num_batched_tokens=64)
        ahead = sim.add(30, max_tokens=40, tenant="a")  # 30 prompt tokens put a ahead from the start
        behind = sim.add(4, max_tokens=40, tenant="b")  # arrived last
        while not victims.get(policy):
            victims[policy] = sim.step().preempted
        sim.run()
        assert ahead.num_output_tokens == 40 and behind.num_output_tokens == 40
        sim.assert_no_leak()
        victims[policy] = [v.tenant for v in victims[policy]]
    assert victims == {"fair": ["a"], "priority": ["b"]}


def test_a_preempted_tenant_is_readmitted_before_a_tenant_further_ahead():
    sim = FairSim(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)
    sim.add(40, max_tokens=1, tenant="c")  # c's long prompt puts it far ahead
    c_waiting = [sim.add(4, max_tokens=2, tenant="c") for _ in range(2)]  # they arrive before a's
    first = sim.add(4, max_tokens=30, tenant="a", weight=4.0)
    second = sim.add(4, max_tokens=30, tenant="a", weight=4.0)
    outs = []
    while second.metrics.num_preemptions == 0:
        outs.append(sim.step())
    assert second.status is RequestStatus.PREEMPTED
    assert all(r.status is RequestStatus.WAITING for r in c_waiting)  # c is further ahead and still waits
    assert sim.sched.counters.value("c") > sim.sched.counters.value("a")
    outs += sim.run()
    readmitted = next(i for i, o in enumerate(outs) if second in o.scheduled and i > 0 and second.num_computed_tokens)
    first_c = min(i for i, o in enumerate(outs) for r in c_waiting if r in o.scheduled)
    assert readmitted < first_c
    assert first.num_output_tokens == second.num_output_tokens == 30
    sim.assert_no_leak()


# ---- random arrivals: the service bound between continuously backlogged tenants -------------------------

MAX_PROMPT = 24


class FairShareMachine(RuleBasedStateMachine):
    """Random arrivals of three tenants with random weights over a small pool; after every step, any two
    tenants backlogged over the same run of steps got service within the 2U bound (normalized by weight)."""

    @initialize(
        num_blocks=st.integers(8, 24),
        budget=st.integers(4, 32),
        max_seqs=st.integers(1, 6),
        threshold=st.sampled_from([None, 4]),
        weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=3, max_size=3),
    )
    def start(self, num_blocks, budget, max_seqs, threshold, weights):
        self.sim = FairSim(
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            long_prefill_token_threshold=threshold,
        )
        self.weights = dict(zip("abc", weights))
        self.since: dict[tuple[str, str], tuple[float, float]] = {}  # a pair's service when both became backlogged

    @rule(
        tenant=st.sampled_from("abc"),
        count=st.integers(1, 6),
        length=st.integers(1, MAX_PROMPT),
        max_tokens=st.integers(1, 8),
    )
    def arrive(self, tenant, count, length, max_tokens):
        for _ in range(count):
            self.sim.add(length, max_tokens=max_tokens, tenant=tenant, weight=self.weights[tenant])

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            backlogged = self.sim.backlogged()
            pairs = {(f, g) for f in backlogged for g in backlogged if f < g}
            self.since = {pair: self.since.get(pair) or self.normalized(pair) for pair in pairs}
            self.sim.step()
            self.check_bound()

    def normalized(self, pair) -> tuple[float, float]:
        return tuple(self.sim.service(t) / self.weights[t] for t in pair)

    def check_bound(self):
        bound = self.sim.bound(MAX_PROMPT, self.weights.values())
        for pair, (f0, g0) in self.since.items():
            f1, g1 = self.normalized(pair)
            assert abs((f1 - f0) - (g1 - g0)) <= bound, (pair, f1 - f0, g1 - g0, bound)

    @invariant()
    def only_running_sequences_hold_blocks(self):
        assert all(seq.status is RequestStatus.RUNNING for seq in self.sim.kv.tables)

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.run(max_steps=5000)
            self.sim.assert_no_leak()
            assert self.sim.sched.counters.active == {} and not self.sim.sched.counters.members


FairShareMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
TestFairShareRandomArrivals = FairShareMachine.TestCase
