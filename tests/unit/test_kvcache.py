"""One rank's KV blocks: chained prefix hashes, sharing, LRU eviction, capacity."""

from __future__ import annotations

from baton.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from sim.kvcache import Allocation, PrefixCache, block_hashes


def tokens(n: int, fill: bytes = b"a") -> bytes:
    return fill * (4 * n)


def allocate(cache: PrefixCache, hashes: list[bytes], n: int) -> Allocation:
    """An allocation the test expects to fit."""
    allocation = cache.allocate(hashes, n)
    assert allocation is not None
    return allocation


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    assert len(block_hashes(tokens(47), 16)) == 2
    first = block_hashes(tokens(32, b"a"), 16)
    second = block_hashes(tokens(16, b"b") + tokens(16, b"a"), 16)
    assert first[1] != second[1]  # same block content, different parent


def test_cached_prefix_is_shared_and_counted_as_hits() -> None:
    cache = PrefixCache(capacity_blocks=100, block_size=16)
    data = tokens(40)
    first = allocate(cache, block_hashes(data, 16), 40)
    cache.register(first, block_hashes(data, 16), 40)
    second = allocate(cache, block_hashes(data, 16), 40)
    assert second.cached_tokens == 32
    assert second.block_ids[:2] == first.block_ids[:2]
    assert cache.used_blocks == 3 + 1  # two shared blocks, a partial block each
    assert (cache.queries, cache.hits) == (80, 32)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    cache = PrefixCache(capacity_blocks=100, block_size=16)
    data = tokens(32)
    allocation = allocate(cache, block_hashes(data, 16), 32)
    cache.register(allocation, block_hashes(data, 16), 32)
    again = allocate(cache, block_hashes(data, 16), 32)
    assert again.cached_tokens == 16


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=16)
    old, new = tokens(32, b"o"), tokens(32, b"n")
    for data in (old, new):
        allocation = allocate(cache, block_hashes(data, 16), 32)
        cache.register(allocation, block_hashes(data, 16), 32)
        cache.free(allocation)
    assert cache.usage == 0
    third = tokens(32, b"t")
    cache.allocate(block_hashes(third, 16), 32)  # needs two blocks: evicts "old"
    assert cache.cached_prefix_blocks(block_hashes(old, 16)) == 0
    assert cache.cached_prefix_blocks(block_hashes(new, 16)) == 2


def test_allocation_fails_cleanly_when_referenced_blocks_fill_the_rank() -> None:
    cache = PrefixCache(capacity_blocks=3, block_size=16)
    held = cache.allocate([], 48)
    assert held is not None and cache.usage == 1.0
    assert cache.allocate([], 16) is None
    assert cache.grow(held, 64) is False
    cache.free(held)
    assert cache.allocate([], 16) is not None


def test_block_ids_are_never_reused() -> None:
    cache = PrefixCache(capacity_blocks=2, block_size=16)
    first = allocate(cache, [], 32)
    ids = list(first.block_ids)
    cache.free(first)
    second = allocate(cache, [], 32)
    assert not set(ids) & set(second.block_ids)


def test_reset_forgets_every_cached_block_and_refuses_while_a_request_holds_one() -> None:
    cache = PrefixCache(capacity_blocks=8, block_size=4)
    hashes = block_hashes(tokens(16), 4)
    held = cache.allocate(hashes, 16)
    assert held is not None
    cache.register(held, hashes, 16)
    assert cache.reset() is False  # a request holds its blocks: nothing changes
    assert cache.cached_prefix_blocks(hashes) == 4
    cache.free(held)
    assert cache.reset() is True
    assert cache.cached_prefix_blocks(hashes) == 0
    assert cache.free_blocks == 8


def test_a_journal_reports_new_blocks_in_runs_then_evictions_then_a_reset_in_order() -> None:
    cache = PrefixCache(capacity_blocks=6, block_size=16, journal=True)
    shared = tokens(16, b"s")
    first, second = shared + tokens(32, b"a"), shared + tokens(32, b"b")
    one, two = block_hashes(first, 16), block_hashes(second, 16)
    a = allocate(cache, one, 48)
    cache.register(a, one, 48, first)
    cache.free(a)
    b = allocate(cache, two, 48)  # the shared block is a hit: not stored again
    cache.register(b, two, 48, second)
    cache.free(b)
    allocate(cache, block_hashes(tokens(32, b"c"), 16), 32)  # 5 cached + 2 new > 6: evicts one
    assert cache.reset() is False  # a request holds blocks
    events = cache.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    stored_a, stored_b, removed = events
    assert isinstance(stored_a, BlockStored) and isinstance(stored_b, BlockStored)
    assert stored_a.block_hashes == [external_hash(h) for h in one]
    assert stored_b.block_hashes == [external_hash(h) for h in two[1:]]
    assert stored_b.parent_block_hash == external_hash(two[0])
    assert stored_b.token_ids == [int.from_bytes(b"bbbb", "little")] * 32
    assert isinstance(removed, BlockRemoved)
    # least recently used first: a's own first block (the shared one was used again by b)
    assert removed.block_hashes == [external_hash(one[1])]
    assert cache.take_events() == []
    fresh = PrefixCache(capacity_blocks=6, block_size=16, journal=True)
    assert fresh.reset() and fresh.take_events() == [AllBlocksCleared()]
    assert PrefixCache(capacity_blocks=6, block_size=16).take_events() == []  # no journal
