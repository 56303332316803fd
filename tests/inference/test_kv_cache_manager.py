"""Block pool and KV cache manager with fake sequences and no model (like vLLM's tests/v1/core).

A sequence here is a real inference.request.Request; "computing" tokens means what the engine
does after a forward: advance num_computed_tokens and register the newly full blocks.
"""

import itertools

import pytest

from inference.kv_cache_manager import BlockAllocationError, BlockPool, KVCacheManager
from inference.request import Request
from inference.sampling_params import SamplingParams

BS = 4  # block size: small so block boundaries are easy to cross
_ids = itertools.count()


def make_seq(tokens) -> Request:
    return Request(f"r{next(_ids)}", None, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, seq: Request) -> int:
    """Prefix lookup + allocation for a new sequence, as the scheduler admits it; returns cached tokens."""
    hits, num_cached = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    seq.num_computed_tokens = num_cached
    return num_cached


def compute_all(kv: KVCacheManager, seq: Request) -> None:
    """The forward ran: every token of seq now has K/V; full blocks enter the prefix cache."""
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


def run_prompt(kv: KVCacheManager, tokens) -> Request:
    seq = make_seq(tokens)
    admit(kv, seq)
    compute_all(kv, seq)
    return seq


def decode_one(kv: KVCacheManager, seq: Request, token: int = 7) -> bool:
    """Append a sampled token and make room for its K/V (one decode step)."""
    seq.append_token(token)
    if not kv.allocate_slots(seq, 1):
        return False
    compute_all(kv, seq)
    return True


def assert_consistent(kv: KVCacheManager) -> None:
    """Ref counts equal table membership; the free queue is exactly the unreferenced blocks."""
    holders = {b.block_id: 0 for b in kv.pool.blocks}
    for table in kv.tables.values():
        for block in table:
            holders[block.block_id] += 1
    assert {b.block_id: b.ref_cnt for b in kv.pool.blocks} == holders
    assert set(kv.pool.free_queue) == {i for i, n in holders.items() if n == 0}


def assert_no_leak(kv: KVCacheManager) -> None:
    assert not kv.tables
    assert kv.pool.num_free == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


# ---- allocation, growth, freeing ----------------------------------------------------------------


def test_allocation_takes_ceil_blocks_and_distinct_ids():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    seq = make_seq(range(9))  # 9 tokens -> 3 blocks
    assert kv.allocate_slots(seq, 9)
    ids = kv.block_ids(seq)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert kv.pool.num_free == 7
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    assert_consistent(kv)


def test_growth_across_block_boundaries_adds_a_block_only_when_one_fills():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    seq = run_prompt(kv, range(3))  # 3 tokens: one block with a free slot
    sizes = [len(kv.block_ids(seq))]
    for _ in range(6):  # tokens 4..9
        assert decode_one(kv, seq)
        sizes.append(len(kv.block_ids(seq)))
    # tokens: 3 4 5 6 7 8 9 -> blocks 1 1 2 2 2 2 3
    assert sizes == [1, 1, 2, 2, 2, 2, 3]
    first_blocks = kv.block_ids(seq)
    assert decode_one(kv, seq)
    assert kv.block_ids(seq)[:3] == first_blocks  # growing never moves existing blocks
    assert_consistent(kv)


def test_allocation_fails_without_side_effects_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    seq = make_seq(range(9))  # needs 3 blocks
    assert not kv.allocate_slots(seq, 9)
    assert kv.block_ids(seq) == []
    assert kv.pool.num_free == 2
    assert_consistent(kv)


def test_free_returns_every_block_and_no_leak_after_all_finish():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    seqs = [run_prompt(kv, range(100 * i, 100 * i + n)) for i, n in enumerate([1, 4, 5, 11, 16])]
    for seq in seqs[:3]:
        decode_one(kv, seq)
    assert kv.pool.num_free < 16
    for seq in seqs:
        kv.free(seq)
        assert_consistent(kv)
    assert_no_leak(kv)


def test_freeing_twice_is_harmless_at_the_manager_and_rejected_at_the_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    seq = run_prompt(kv, range(6))
    blocks = list(kv.tables[seq])
    kv.free(seq)
    kv.free(seq)  # the table is gone: nothing is freed twice
    assert_no_leak(kv)
    with pytest.raises(BlockAllocationError, match="double free"):
        kv.pool.free(blocks[:1])
    assert kv.pool.num_free == 4


def test_pool_double_free_rejected_and_over_allocation_raises():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(BlockAllocationError):
        pool.free([block])
    with pytest.raises(BlockAllocationError):
        pool.allocate(4)
    assert pool.num_free == 3


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


# ---- prefix cache: hash chain, ref counts ---------------------------------------------------------


def test_second_sequence_reuses_every_full_cached_block_of_its_prefix():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prefix = list(range(20))  # 5 full blocks
    first = run_prompt(kv, prefix + [90, 91])
    second = make_seq(prefix + [50, 51, 52])
    assert admit(kv, second) == 20
    assert kv.block_ids(second)[:5] == kv.block_ids(first)[:5]
    assert kv.block_ids(second)[5] != kv.block_ids(first)[5]  # the partial block is its own
    for block_id in kv.block_ids(first)[:5]:
        assert kv.pool.blocks[block_id].ref_cnt == 2
    assert kv.pool.blocks[kv.block_ids(first)[5]].ref_cnt == 1
    assert_consistent(kv)
    kv.free(first)
    for block_id in kv.block_ids(second)[:5]:
        assert kv.pool.blocks[block_id].ref_cnt == 1
    kv.free(second)
    assert_no_leak(kv)


def test_a_hit_never_covers_the_last_token():
    """At least one token is always computed, so the model has a row to sample from."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    first = run_prompt(kv, range(12))  # 3 full blocks, all cached
    assert len(kv.hashes[first]) == 3
    same = make_seq(range(12))
    hits, num_cached = kv.get_computed_blocks(same)
    assert num_cached == 8 and len(hits) == 2
    assert [b.block_id for b in hits] == kv.block_ids(first)[:2]
    one_more = make_seq(list(range(12)) + [99])
    assert kv.get_computed_blocks(one_more)[1] == 12


def test_prefix_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    run_prompt(kv, list(range(12)) + [1])
    diverging = make_seq(list(range(4)) + [77] + list(range(5, 12)) + [1])  # differs in block 1
    assert kv.get_computed_blocks(diverging)[1] == 4
    # block 2 has the same tokens as before, but a different parent: the chain must not match it
    later_same = make_seq([55, 55, 55, 55] + list(range(4, 12)) + [1])
    assert kv.get_computed_blocks(later_same)[1] == 0


def test_blocks_become_cached_only_once_full_and_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    assert kv.allocate_slots(seq, 10)
    assert kv.get_computed_blocks(make_seq(range(11)))[1] == 0  # allocated, not yet computed
    seq.num_computed_tokens = 6  # a first chunk: only block 0 is full and computed
    kv.cache_full_blocks(seq)
    assert kv.get_computed_blocks(make_seq(range(11)))[1] == 4
    seq.num_computed_tokens = 10
    kv.cache_full_blocks(seq)
    assert kv.get_computed_blocks(make_seq(range(11)))[1] == 8


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    run_prompt(kv, range(12))
    assert kv.get_computed_blocks(make_seq(range(13))) == ([], 0)
    assert kv.stats()["blocks_cached_free"] == 0


def test_hit_blocks_are_not_taken_when_the_rest_does_not_fit():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    kv.free(run_prompt(kv, range(9)))  # 2 full cached blocks + 1 partial, all free now
    seq = make_seq(list(range(8)) + list(range(50, 58)))  # 2 hits + 2 new blocks > 3 - 2
    hits, num_cached = kv.get_computed_blocks(seq)
    assert num_cached == 8
    assert not kv.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    assert all(b.ref_cnt == 0 for b in hits)
    assert kv.pool.num_free == 3
    fits = make_seq(list(range(8)) + [50, 51, 52])  # 2 hits + 1 new block: exactly the pool
    assert admit(kv, fits) == 8
    assert kv.pool.num_free == 0
    assert_consistent(kv)


# ---- hash collisions -------------------------------------------------------------------------------


def test_constant_hash_collision_never_reuses_other_tokens():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    kv.pool.hash_fn = lambda parent, tokens: 42  # every block collides
    first = run_prompt(kv, list(range(12)) + [1])
    other = make_seq(list(range(100, 112)) + [1])
    assert kv.get_computed_blocks(other) == ([], 0)
    admit(kv, other)
    compute_all(kv, other)
    assert set(kv.block_ids(other)).isdisjoint(kv.block_ids(first))
    # the real owner of the colliding hash still hits, and only on its own first block
    again = make_seq(list(range(12)) + [2])
    hits, num_cached = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == kv.block_ids(first)[:1] and num_cached == 4
    assert_consistent(kv)


def test_colliding_parent_hash_never_chains_onto_another_prefix():
    """First blocks [1]*4 and [2]*4 collide; a block computed after [2]*4 must never follow [1]*4."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    kv.pool.hash_fn = lambda parent, tokens: 0 if parent is None else hash((parent, tokens))
    x = run_prompt(kv, [1] * 4 + [3] * 4 + [9])
    y = run_prompt(kv, [2] * 4 + [4] * 4 + [9])
    z = make_seq([1] * 4 + [4] * 4 + [9])  # x's first block, then y's second block's tokens
    hits, num_cached = kv.get_computed_blocks(z)
    assert [b.block_id for b in hits] == kv.block_ids(x)[:1]
    assert num_cached == 4
    assert kv.block_ids(y)[1] not in [b.block_id for b in hits]


# ---- LRU eviction of freed cached blocks ----------------------------------------------------------


def test_freed_blocks_stay_cached_and_are_evicted_only_when_needed():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    first = run_prompt(kv, range(9))  # blocks: 2 full (cached) + 1 partial
    cached_ids = kv.block_ids(first)[:2]
    kv.free(first)
    assert kv.stats()["blocks_cached_free"] == 2
    # a 3-block allocation fits in the 3 never-used blocks plus the uncached partial one
    filler = make_seq(range(200, 212))
    assert kv.allocate_slots(filler, 12)
    assert set(kv.block_ids(filler)).isdisjoint(cached_ids)
    hits, num_cached = kv.get_computed_blocks(make_seq(range(9)))
    assert num_cached == 8 and [b.block_id for b in hits] == cached_ids
    kv.free(filler)
    assert_consistent(kv)


def test_a_freed_requests_last_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = run_prompt(kv, range(16))  # 4 full blocks, all cached
    table = kv.block_ids(first)
    kv.free(first)
    taker = make_seq(range(300, 304))
    assert kv.allocate_slots(taker, 4)
    assert kv.block_ids(taker) == [table[3]]  # the tail block goes first
    assert kv.get_computed_blocks(make_seq(range(17)))[1] == 12  # blocks 0..2 still hit
    taker2 = make_seq(range(400, 404))
    assert kv.allocate_slots(taker2, 4)
    assert kv.block_ids(taker2) == [table[2]]
    assert kv.get_computed_blocks(make_seq(range(17)))[1] == 8


def test_older_frees_are_evicted_before_newer_ones():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    old = run_prompt(kv, range(8))
    new = run_prompt(kv, range(100, 108))
    old_ids = kv.block_ids(old)
    kv.free(old)
    kv.free(new)
    seq = make_seq(range(500, 508))
    assert kv.allocate_slots(seq, 8)
    assert kv.block_ids(seq) == [old_ids[1], old_ids[0]]
    assert kv.get_computed_blocks(make_seq(range(100, 109)))[1] == 8  # the newer request still hits
    assert kv.get_computed_blocks(make_seq(range(9)))[1] == 0


def test_a_hit_refreshes_a_cached_block_in_the_lru_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = run_prompt(kv, range(4))  # one full block, then freed
    b = run_prompt(kv, range(100, 104))
    a_block, b_block = kv.block_ids(a)[0], kv.block_ids(b)[0]
    kv.free(a)
    kv.free(b)
    reuse = make_seq(list(range(4)) + [9])
    admit(kv, reuse)  # touches a's block: it leaves the free queue ...
    assert kv.pool.blocks[a_block].ref_cnt == 1
    kv.free(reuse)  # ... and comes back as the most recently used
    order = list(kv.pool.free_queue)
    assert order.index(b_block) < order.index(a_block)


# ---- copy on write (n > 1 forks) ------------------------------------------------------------------


def test_fork_shares_blocks_and_copy_on_write_of_the_partial_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = run_prompt(kv, range(6))  # block 0 full, block 1 holds 2 of 4 tokens
    child = make_seq(range(6))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    full, partial = kv.block_ids(parent)
    assert kv.block_ids(child) == [full, partial]
    assert kv.pool.blocks[full].ref_cnt == 2 and kv.pool.blocks[partial].ref_cnt == 2
    assert_consistent(kv)

    parent.append_token(11)
    child.append_token(22)
    assert kv.allocate_slots(child, 1)
    copies = kv.take_copies()
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert kv.block_ids(child) == [full, dst]
    assert kv.pool.blocks[partial].ref_cnt == 1  # now the parent's alone
    assert kv.pool.blocks[dst].ref_cnt == 1
    assert kv.pool.blocks[full].ref_cnt == 2  # full blocks stay shared
    assert kv.take_copies() == []  # handed over once

    assert kv.allocate_slots(parent, 1)
    assert kv.take_copies() == []  # the parent writes into its block in place
    assert kv.block_ids(parent) == [full, partial]
    assert_consistent(kv)
    kv.free(parent)
    kv.free(child)
    assert_no_leak(kv)


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = run_prompt(kv, range(8))
    child = make_seq(range(8))
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    for seq, token in ((parent, 1), (child, 2)):
        seq.append_token(token)
        assert kv.allocate_slots(seq, 1)
    assert kv.take_copies() == []
    assert kv.block_ids(parent)[:2] == kv.block_ids(child)[:2]
    assert kv.block_ids(parent)[2] != kv.block_ids(child)[2]
    assert_consistent(kv)


def test_copy_on_write_fails_cleanly_when_no_block_is_free():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    parent = run_prompt(kv, range(6))  # takes both blocks
    child = make_seq(range(6))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.append_token(1)
    assert not kv.allocate_slots(child, 1)
    assert kv.take_copies() == []
    assert kv.block_ids(child) == kv.block_ids(parent)
    assert_consistent(kv)


def test_three_way_fork_copies_for_all_but_the_last_writer():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = run_prompt(kv, range(5))
    children = []
    for _ in range(2):
        child = make_seq(range(5))
        child.num_computed_tokens = 5
        kv.fork(parent, child)
        children.append(child)
    partial = kv.block_ids(parent)[1]
    assert kv.pool.blocks[partial].ref_cnt == 3
    for seq in [*children, parent]:
        seq.append_token(1)
        assert kv.allocate_slots(seq, 1)
    copies = kv.take_copies()
    assert [src for src, _ in copies] == [partial, partial]
    assert kv.block_ids(parent)[1] == partial and kv.pool.blocks[partial].ref_cnt == 1
    assert len({kv.block_ids(s)[1] for s in [parent, *children]}) == 3
    for seq in [parent, *children]:
        kv.free(seq)
    assert_no_leak(kv)


# ---- accounting --------------------------------------------------------------------------------------


def test_stats_account_for_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    seq = run_prompt(kv, range(10))  # 3 blocks: 2 full (cached), 1 partial
    stats = kv.stats()
    assert stats["blocks_total"] == 10
    assert stats["blocks_used"] == 3
    assert stats["blocks_cached_free"] == 0
    assert stats["blocks_free"] == 7
    assert stats["kv_usage"] == pytest.approx(0.3)
    kv.free(seq)
    stats = kv.stats()
    assert (stats["blocks_used"], stats["blocks_cached_free"], stats["blocks_free"]) == (0, 2, 8)
    assert stats["blocks_used"] + stats["blocks_cached_free"] + stats["blocks_free"] == stats["blocks_total"]
    assert stats["kv_usage"] == 0


def test_stats_hit_rate():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    assert kv.stats()["prefix_cache_hit_rate"] == 0.0  # no queries yet: no division by zero
    kv.record_prefix_query(10, 0)
    kv.record_prefix_query(10, 8)
    stats = kv.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (20, 8)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(0.4)


def test_state_codes_show_free_cached_used_and_shared():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    gone = run_prompt(kv, range(100, 104))  # one full block, cached once freed
    kv.free(gone)
    parent = run_prompt(kv, range(6))
    child = make_seq(range(6))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    single = run_prompt(kv, range(50, 52))
    codes = kv.pool.state_codes()
    assert len(codes) == 6
    assert codes.count(3) == 2  # the parent's two blocks, shared with the child
    assert codes[kv.block_ids(single)[0]] == 2
    assert codes.count(1) == 1  # the freed full block, still cached
    assert codes.count(0) == 6 - 2 - 1 - 1


# ---- placement: one sequence's blocks in consecutive memory ------------------------------------------


def runs_of(ids: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(ids, ids[1:]) if b != a + 1)


def test_sequences_decoding_side_by_side_each_grow_into_consecutive_blocks():
    # 8 sequences start at once and then take one block in turn, as a batch of decodes does. In
    # allocation order they would interleave (a run of 1 block each); placed, each is one run.
    kv = KVCacheManager(num_blocks=256, block_size=BS)
    seqs = [run_prompt(kv, range(100 * i, 100 * i + 6)) for i in range(8)]
    for step in range(40):
        for i, seq in enumerate(seqs):
            assert decode_one(kv, seq, token=step)
    for seq in seqs:
        ids = kv.block_ids(seq)
        assert len(ids) == 12 and runs_of(ids) == 1, ids
    assert_consistent(kv)


def test_runs_started_one_after_another_are_spread_over_the_pool():
    kv = KVCacheManager(num_blocks=1000, block_size=BS)
    starts = sorted(kv.block_ids(run_prompt(kv, range(100 * i, 100 * i + 3)))[0] for i in range(10))
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 50  # room for each to grow


def test_placement_never_takes_a_cached_block_out_of_lru_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    grower = run_prompt(kv, range(3))
    (tail,) = kv.block_ids(grower)
    # Make every other block hold a cached prefix, then free them: the LRU queue now holds them.
    cached = run_prompt(kv, range(100, 100 + 7 * BS))
    cached_ids = kv.block_ids(cached)
    kv.free(cached)
    assert tail + 1 in cached_ids or tail + 1 >= 8
    # The grower's next block is the LRU head (the freed request's tail block, evicted first), not
    # the cached block that happens to follow its own.
    assert decode_one(kv, grower) and decode_one(kv, grower)
    assert kv.block_ids(grower)[1] == cached_ids[-1]
    assert kv.get_computed_blocks(make_seq(range(100, 100 + 6 * BS + 1)))[1] == 6 * BS
    assert_consistent(kv)


def test_a_full_pool_still_hands_out_every_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    seqs = [run_prompt(kv, range(100 * i, 100 * i + 2)) for i in range(16)]
    assert kv.pool.num_free == 0
    assert sorted(i for s in seqs for i in kv.block_ids(s)) == list(range(16))
    assert not kv.allocate_slots(make_seq(range(5)), 5)
