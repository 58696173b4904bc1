"""One DP rank's KV cache: blocks, a prefix cache of chained block hashes, LRU eviction.

Pure bookkeeping, no I/O. Capacity is counted in blocks of ``block_size`` tokens; the profile's
KV bytes per GPU and bytes per token set it. A block is in one of three states:

- referenced by one or more requests (in use, never evicted);
- cached and unreferenced (its hash can still be hit; evicted least recently used first);
- free.

Only full blocks are hashed, and each hash chains its parent's, as vLLM does, so a hit on block
i implies hits on blocks 0..i-1. Block ids are never reused, so a stale id handed out under a
P/D lease can never alias a newer block.

A cache made with ``journal=True`` also keeps, in order, what vLLM's KV events report
(``--kv-events-config``): blocks newly cached with their token ids, blocks evicted, the cache
cleared; :meth:`PrefixCache.take_events` hands them over.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from baton.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)
from baton.core.sim_tokenizer import BYTES_PER_TOKEN, decode_token_ids

__all__ = ["Allocation", "PrefixCache", "block_hashes", "chain_hash"]


_ROOT_HASH = b"baton-none-hash"


def chain_hash(parent: bytes | None, block: bytes) -> bytes:
    """The hash of one full block, chained to its parent's (None for the first block)."""
    return hashlib.blake2b((parent or _ROOT_HASH) + block, digest_size=16).digest()


def block_hashes(data: bytes, block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``data`` (4 bytes a token)."""
    span = block_size * BYTES_PER_TOKEN
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(data) - span + 1, span):
        parent = chain_hash(parent, data[start : start + span])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Allocation:
    """The blocks one request holds, in order, and how many leading tokens were cache hits."""

    block_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    registered: int = 0  # leading blocks whose hash is known to the cache


class PrefixCache:
    """Block accounting and prefix caching for one DP rank."""

    def __init__(self, capacity_blocks: int, block_size: int, *, journal: bool = False) -> None:
        if capacity_blocks <= 0 or block_size <= 0:
            raise ValueError("capacity_blocks and block_size must be positive")
        self._events: list[KVEvent] | None = [] if journal else None
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._next_id = 0
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # tokens looked up, vLLM's prefix_cache_queries
        self.hits = 0  # tokens found, vLLM's prefix_cache_hits

    @property
    def journaling(self) -> bool:
        return self._events is not None

    @property
    def used_blocks(self) -> int:
        return len(self._refs)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return len(self._refs) / self.capacity_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation may take, counting evictable cached blocks."""
        return self.capacity_blocks - len(self._refs)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` present in the cache (no side effects)."""
        count = 0
        for digest in hashes:
            if digest not in self._by_hash:
                break
            count += 1
        return count

    def allocate(
        self, hashes: list[bytes], tokens: int, *, count_query: bool = True
    ) -> Allocation | None:
        """Blocks for a sequence of ``tokens`` whose full blocks hash to ``hashes``.

        Cached leading blocks are shared; the rest are new. Returns None, changing nothing, when
        the rank lacks room. At least one token is always left to compute, as in vLLM.
        """
        hit_blocks = self.cached_prefix_blocks(hashes)
        if hit_blocks * self.block_size >= tokens:
            hit_blocks = max(0, (tokens - 1) // self.block_size)
        needed = self.blocks_for(tokens) - hit_blocks
        if needed > self.free_blocks - self._evictable_among(hashes[:hit_blocks]):
            return None
        if count_query:
            self.queries += tokens
            self.hits += hit_blocks * self.block_size
        allocation = Allocation(cached_tokens=hit_blocks * self.block_size, registered=hit_blocks)
        for digest in hashes[:hit_blocks]:
            block_id = self._by_hash[digest]
            self._acquire(block_id)
            allocation.block_ids.append(block_id)
        self._take_new(allocation, needed)
        return allocation

    def grow(self, allocation: Allocation, tokens: int) -> bool:
        """Make room for ``tokens`` in total; False (changing nothing) when the rank is full."""
        needed = self.blocks_for(tokens) - len(allocation.block_ids)
        if needed <= 0:
            return True
        if needed > self.free_blocks:
            return False
        self._take_new(allocation, needed)
        return True

    def register(
        self, allocation: Allocation, hashes: list[bytes], computed_tokens: int, prompt: bytes = b""
    ) -> None:
        """Publish the hashes of the full blocks computed so far, so later requests hit them;
        a journal records them with their tokens, read from ``prompt``."""
        full = min(len(hashes), computed_tokens // self.block_size, len(allocation.block_ids))
        stored: list[int] = []
        for index in range(allocation.registered, full):
            digest = hashes[index]
            block_id = allocation.block_ids[index]
            if digest not in self._by_hash:
                self._by_hash[digest] = block_id
                self._hash_of[block_id] = digest
                stored.append(index)
        allocation.registered = max(allocation.registered, full)
        if self._events is not None and stored:
            self._journal_stored(hashes, stored, prompt)

    def _journal_stored(self, hashes: list[bytes], stored: list[int], prompt: bytes) -> None:
        """One BlockStored per run of consecutive blocks, as vLLM reports a request's newly
        cached blocks: their hashes, the hash of the block before, their token ids."""
        assert self._events is not None
        span = self.block_size * BYTES_PER_TOKEN
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            data = prompt[run[0] * span : (run[-1] + 1) * span]
            self._events.append(
                BlockStored(
                    block_hashes=[external_hash(hashes[i]) for i in run],
                    parent_block_hash=external_hash(hashes[run[0] - 1]) if run[0] else None,
                    token_ids=decode_token_ids(data),
                    block_size=self.block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                )
            )

    def take_events(self) -> list[KVEvent]:
        """What the journal recorded since the last call (nothing without a journal)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def free(self, allocation: Allocation) -> None:
        """Drop a request's references; hashed blocks stay cached until evicted."""
        for block_id in allocation.block_ids:
            refs = self._refs[block_id] - 1
            if refs:
                self._refs[block_id] = refs
                continue
            del self._refs[block_id]
            if block_id in self._hash_of:
                self._evictable[block_id] = None
        allocation.block_ids.clear()

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache`` does; False, changing
        nothing, while a request holds blocks."""
        if self._refs:
            return False
        self._by_hash.clear()
        self._hash_of.clear()
        self._evictable.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def _evictable_among(self, hashes: list[bytes]) -> int:
        # Hits on unreferenced cached blocks move them back into use: they stop being free.
        return sum(1 for digest in hashes if self._by_hash[digest] in self._evictable)

    def _acquire(self, block_id: int) -> None:
        if block_id in self._evictable:
            del self._evictable[block_id]
        self._refs[block_id] = self._refs.get(block_id, 0) + 1

    def _take_new(self, allocation: Allocation, count: int) -> None:
        overflow = len(self._refs) + len(self._evictable) + count - self.capacity_blocks
        for _ in range(max(0, overflow)):
            victim, _ = self._evictable.popitem(last=False)
            evicted = self._hash_of.pop(victim)
            del self._by_hash[evicted]
            if self._events is not None:
                self._events.append(
                    BlockRemoved(block_hashes=[external_hash(evicted)], medium="GPU", group_idx=0)
                )
        for _ in range(count):
            block_id = self._next_id
            self._next_id += 1
            self._refs[block_id] = 1
            allocation.block_ids.append(block_id)
