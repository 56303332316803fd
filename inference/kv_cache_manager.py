"""Paged KV cache bookkeeping: a pool of fixed-size blocks, block tables, ref counts, prefix cache.

No tensors live here; the model runner owns the K/V memory and this module hands out block ids.
Design after vLLM v1's BlockPool + KVCacheManager:
- a free queue in LRU order (front = evicted first); freed blocks keep their prefix hash and stay
  reusable until the pool needs them;
- a full block is identified by a hash chain (parent hash + its token ids); a hit is verified
  against the stored tokens so a hash collision can never reuse the wrong K/V;
- blocks are shared by ref count (prefix hits, n > 1 forks); a shared partially filled block is
  copied before a sequence writes into it (copy on write).

Placement: a sequence grows into the block right after its last one when that block is free and
empty (no cached prefix), and new runs start at points spread over the pool, so one sequence's
K/V mostly lies in consecutive memory. The CPU decode kernel reads a sequence's blocks in order,
and on shuffled 4 KiB blocks it waits on memory (docs/kernels.md has the figures). Only empty blocks are placed
this way; freed blocks that hold a cached prefix are still evicted in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class BlockAllocationError(RuntimeError):
    pass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to verify prefix-cache hits


GOLDEN_STEP = 0.6180339887498949  # any n points of the sequence k * GOLDEN_STEP mod 1 are near evenly spread
SPREAD_PROBES = 32  # empty blocks looked for at spread points before falling back to the LRU head


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockPool:
    """All blocks of the cache, the LRU free queue and the hash -> block index."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.hash_fn = chain_hash
        self._spread = 0.0  # where _spread_start looks next, as a fraction of the pool

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no holder, cached or not: what an allocation may take."""
        return len(self.free_queue)

    def allocate(self, count: int, after: int | None = None) -> list[KVBlock]:
        """count blocks, continuing from block id `after` (a sequence's last block) where possible."""
        if count > len(self.free_queue):
            raise BlockAllocationError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = []
        wanted = after + 1 if after is not None else None
        spread = True  # until the probes find no empty block: then not again in this call
        for _ in range(count):
            if wanted is None or not self._empty_and_free(wanted):
                wanted = self._spread_start() if spread else None
                spread = wanted is not None
            if wanted is None:  # no empty block found: the LRU head, evicting its cached prefix
                block_id, _ = self.free_queue.popitem(last=False)
            else:
                block_id = wanted
                del self.free_queue[block_id]
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
            wanted = block_id + 1
        return taken

    def _empty_and_free(self, block_id: int) -> bool:
        if not 0 <= block_id < len(self.blocks):
            return False
        block = self.blocks[block_id]
        return block.ref_cnt == 0 and block.block_hash is None

    def _spread_start(self) -> int | None:
        """An empty free block at the next of a sequence of well-spread points (golden-ratio steps),
        so that runs started one after another lie far apart and each has room to grow."""
        for _ in range(SPREAD_PROBES):
            self._spread = (self._spread + GOLDEN_STEP) % 1.0
            block_id = int(self._spread * len(self.blocks))
            if self._empty_and_free(block_id):
                return block_id
        return None

    def touch(self, blocks) -> None:
        """Add a holder to each block (a prefix hit or a fork); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks) -> None:
        """Drop one holder from each block, in the given order (earlier = evicted sooner)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockAllocationError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def lookup(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVBlock | None:
        block_id = self.cached.get(self.hash_fn(parent_hash, token_ids))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # a hash collision: never reuse K/V of other tokens
        return block

    def cache(self, block: KVBlock, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        """Register a computed full block under its chain hash; returns the hash."""
        block_hash = self.hash_fn(parent_hash, token_ids)
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
            self.cached[block_hash] = block.block_id
        return block_hash

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None

    def state_codes(self) -> list[int]:
        """Per block: 0 free, 1 cached (free but reusable), 2 in use, 3 shared by several."""
        codes = []
        for block in self.blocks:
            if block.ref_cnt > 1:
                codes.append(3)
            elif block.ref_cnt == 1:
                codes.append(2)
            else:
                codes.append(1 if block.block_hash is not None else 0)
        return codes


class KVCacheManager:
    """Block tables per sequence on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[object, list[KVBlock]] = {}
        self.hashes: dict[object, list[int]] = {}  # chain hashes of each sequence's full blocks
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq) -> list[int]:
        return [b.block_id for b in self.tables.get(seq, ())]

    def get_computed_blocks(self, seq) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new sequence (always leaving one token to compute)."""
        # Prompt logprobs need every prompt position's logits: a hit would skip computing them.
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0 or seq.params.prompt_logprobs is not None:
            return [], 0
        hits: list[KVBlock] = []
        parent = None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        tokens = seq.token_ids
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
            parent = block.block_hash
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Make room for num_new_tokens more K/V entries; False (and no change) if the pool is short."""
        table = self.tables.get(seq, [])
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(table) - len(computed_blocks)
        shared = self._shared_blocks_to_write(seq, table)
        reserved_by_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + len(shared) > self.pool.num_free - reserved_by_hits:
            return False
        self.pool.touch(computed_blocks)
        table = self.tables.setdefault(seq, table)
        table.extend(computed_blocks)
        if computed_blocks:
            self.hashes[seq] = [b.block_hash for b in computed_blocks if b.block_hash is not None]  # hits: all hashed
        for index in shared:
            self._copy_on_write(table, index)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks, after=table[-1].block_id if table else None))
        return True

    def _shared_blocks_to_write(self, seq, table: list[KVBlock]) -> list[int]:
        """Indexes of blocks this step writes into that other sequences also hold."""
        first = seq.num_computed_tokens // self.block_size
        return [i for i in range(first, len(table)) if table[i].ref_cnt > 1]

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        src = table[index]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        table[index] = dst
        self.pending_copies.append((src.block_id, dst.block_id))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, seq) -> None:
        """Register every newly computed full block of seq in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq)
        if not table:
            return
        hashes = self.hashes.setdefault(seq, [])
        num_full = seq.num_computed_tokens // self.block_size
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if i and self.pool.cached.get(hashes[i - 1]) != table[i - 1].block_id:
                # The previous block is not the one cached under its hash (a duplicate, or a hash
                # collision with other tokens): caching this block would let a lookup that verified
                # only parent hash + own tokens reuse K/V computed after a different prefix.
                hashes.append(self.pool.hash_fn(parent, chunk))
                continue
            hashes.append(self.pool.cache(table[i], parent, chunk))

    def fork(self, parent, child) -> None:
        """child shares every block of parent (ref counts), e.g. the n sequences of one prompt."""
        table = self.tables.get(parent, [])
        self.pool.touch(table)
        self.tables[child] = list(table)
        self.hashes[child] = list(self.hashes.get(parent, []))

    def trim(self, seq, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens positions: after speculative decoding's
        verification, the blocks that only rejected proposals wrote into."""
        table = self.tables.get(seq)
        keep = self.blocks_needed(num_tokens)
        if table and len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(reversed(extra))

    def free(self, seq) -> None:
        """Release a finished, aborted or preempted sequence's blocks (tail blocks evicted first)."""
        table = self.tables.pop(seq, None)
        self.hashes.pop(seq, None)
        if table:
            self.pool.free(reversed(table))

    def stats(self) -> dict:
        pool = self.pool
        cached_free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        used = pool.num_blocks - pool.num_free
        return {
            "blocks_total": pool.num_blocks,
            "blocks_used": used,
            "blocks_cached_free": cached_free,
            "blocks_free": pool.num_free - cached_free,
            "kv_usage": used / pool.num_blocks,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
        }
