"""router/prefix.py: the prompt's block hashes, the index of what each prefill rank was sent,
and the ledger that applies the engines' KV events to it."""

from __future__ import annotations

import struct

import msgspec
import pytest

from baton.core.kv_events import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from baton.core.sim_tokenizer import count_tokens
from router.policy import prompt_bytes
from router.prefix import (
    BLOCK_BYTES,
    KVEventLedger,
    PrefixIndex,
    block_hashes,
    token_block_keys,
)
from router.tokens import SimTokenizer
from sim.kvcache import PrefixCache
from sim.kvcache import block_hashes as sim_block_hashes

BLOCK_SIZE = 16  # tokens per KV block, the simulator's default and vLLM's

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 400}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def blocks(body: dict[str, object]) -> tuple[int, ...]:
    return block_hashes(prompt_bytes(body))


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Leading blocks two prompts share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_only_full_blocks_are_hashed_and_each_covers_everything_before_it() -> None:
    assert block_hashes(b"x" * (BLOCK_BYTES - 1)) == ()
    one, two = (
        block_hashes(b"x" * (2 * BLOCK_BYTES + 5)),
        block_hashes(b"y" + b"x" * 3 * BLOCK_BYTES),
    )
    assert len(one) == 2 and len(set(one)) == 2
    # the same second block of bytes after a different first one hashes differently
    assert one[1] != block_hashes(b"y" * BLOCK_BYTES + b"x" * BLOCK_BYTES)[1]
    assert not set(one) & set(two)
    assert block_hashes(b"") == ()


def test_a_conversations_next_turn_extends_its_earlier_turns_blocks() -> None:
    first = [SYSTEM, user("fix the bug in pool.py " * 500)]
    second = [*first, {"role": "assistant", "content": "done"}, user("now add a test")]
    a, b = blocks({"messages": first}), blocks({"messages": second})
    assert len(a) > 3 and b[: len(a)] == a


def test_an_edited_history_shares_the_blocks_before_the_edit_only() -> None:
    first = [SYSTEM, user("fix the bug in pool.py " * 500)]
    edited = [SYSTEM, user("fix the bug in app.py " * 500)]
    a, b = blocks({"messages": first}), blocks({"messages": edited})
    system_blocks = len(prompt_bytes({"messages": [SYSTEM]})) // BLOCK_BYTES
    assert system_blocks >= 2 and shared(a, b) == system_blocks


def test_completions_sharing_a_head_share_its_blocks() -> None:
    head = "a shared document " * 1000
    a, b = blocks({"prompt": head + "question one"}), blocks({"prompt": head + "question two"})
    assert shared(a, b) == len(prompt_bytes({"prompt": head})) // BLOCK_BYTES


def test_the_index_finds_each_ranks_longest_leading_run() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 6 * BLOCK_BYTES)
    index.routed("p0#0", prompt[:4])
    index.routed("p1#1", prompt[:2])
    index.routed("p2#0", prompt[2:])  # not a prefix of it: found nowhere else's first block
    assert index.match(prompt) == {"p0#0": 4, "p1#1": 2}
    assert index.match(block_hashes(b"q" * 3 * BLOCK_BYTES)) == {}
    assert index.match(()) == {}


def test_the_least_recently_routed_blocks_are_forgotten_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    old, new = block_hashes(b"o" * 3 * BLOCK_BYTES), block_hashes(b"n" * 3 * BLOCK_BYTES)
    index.routed("p0#0", old)
    index.routed("p0#0", old[:1])  # routed again: the most recent
    index.routed("p1#0", new)
    assert len(index) == 4
    assert index.match(old) == {"p0#0": 1} and index.match(new) == {"p1#0": 3}


def test_a_reset_rank_holds_nothing_and_others_keep_theirs() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 3 * BLOCK_BYTES)
    index.routed("p0#0", prompt)
    index.routed("p1#0", prompt[:1])
    index.forget({"p0#0", "p0#1"})
    assert index.match(prompt) == {"p1#0": 1} and len(index) == 1


def test_a_forgotten_ranks_slot_goes_to_a_new_rank_without_its_blocks() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 3 * BLOCK_BYTES)
    index.routed("old#0", prompt)
    index.routed("kept#0", prompt[:1])
    index.forget({"old#0"})
    index.routed("new#0", block_hashes(b"n" * BLOCK_BYTES))  # takes old#0's slot
    assert index.slot("new#0") == 0
    assert index.match(prompt) == {"kept#0": 1}


def test_a_pool_of_many_ranks_finds_each_ranks_run() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 200 * BLOCK_BYTES)
    for rank in range(150):  # more ranks than a machine word has bits
        index.routed(f"p{rank}#0", prompt[: rank + 1])
    assert index.match(prompt) == {f"p{rank}#0": rank + 1 for rank in range(150)}
    index.removed("p149#0", prompt[100:])
    assert index.match(prompt)["p149#0"] == 100


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


# ---- KV events: the engine's report of what each rank holds, in token blocks


def cache_with(capacity: int = 64) -> PrefixCache:
    return PrefixCache(capacity, BLOCK_SIZE, journal=True)


def cache_prompt(cache: PrefixCache, prompt: bytes) -> None:
    """Prefill ``prompt`` on a simulator rank, as its engine step does, and finish it."""
    hashes = sim_block_hashes(prompt, BLOCK_SIZE)
    allocation = cache.allocate(hashes, count_tokens(prompt))
    assert allocation is not None
    cache.register(allocation, hashes, count_tokens(prompt), prompt)
    cache.free(allocation)


def publish(ledger: KVEventLedger, rank: str, cache: PrefixCache, sequence: int) -> int:
    ledger.apply(rank, sequence, KVEventBatch(ts=0.0, events=cache.take_events()))
    return sequence + 1


def keys_of(prompt: bytes) -> tuple[int, ...]:
    return token_block_keys(prompt, BLOCK_SIZE)  # the simulator's tokens are its bytes


def test_the_ledger_keys_an_engines_stored_blocks_as_the_gateway_keys_the_prompt() -> None:
    index = PrefixIndex()
    ledger = KVEventLedger(index)
    cache = cache_with()
    document = b"The decode group holds thirty-two ranks. " * 20
    first = document + b"First question?"
    cache_prompt(cache, first)
    publish(ledger, "p0#0", cache, 0)
    follow_up = SimTokenizer().packed({"prompt": (document + b"Second question?").decode()})
    assert follow_up is not None
    held = index.match(keys_of(follow_up))
    # every full block the follow-up shares with the cached prompt, and no more
    assert held == {"p0#0": cache.cached_prefix_blocks(sim_block_hashes(follow_up, BLOCK_SIZE))}
    assert held["p0#0"] == len(document) // (4 * BLOCK_SIZE)
    assert ledger.block_size == BLOCK_SIZE and ledger.held == {"p0#0": len(keys_of(first))}


def test_evicted_blocks_leave_the_index_and_a_cleared_cache_leaves_nothing() -> None:
    index = PrefixIndex()
    ledger = KVEventLedger(index)
    cache = cache_with(capacity=8)
    first, second = b"a" * (4 * BLOCK_SIZE * 6), b"b" * (4 * BLOCK_SIZE * 6)
    cache_prompt(cache, first)
    sequence = publish(ledger, "p0#0", cache, 0)
    assert index.match(keys_of(first)) == {"p0#0": 6}
    cache_prompt(cache, second)  # 8 blocks: four of the first prompt's are evicted for it
    sequence = publish(ledger, "p0#0", cache, sequence)
    assert index.match(keys_of(first)).get("p0#0", 0) == cache.cached_prefix_blocks(
        sim_block_hashes(first, BLOCK_SIZE)
    )
    assert index.match(keys_of(second)) == {"p0#0": 6}
    assert cache.reset()
    publish(ledger, "p0#0", cache, sequence)
    assert index.match(keys_of(second)) == {} and ledger.held == {} and len(ledger) == 0


def stored(
    hashes: list[int], parent: int | None, first_token: int, **fields: object
) -> BlockStored:
    ids = list(range(first_token, first_token + BLOCK_SIZE * len(hashes)))
    event = BlockStored(list[BlockHash](hashes), parent, ids, BLOCK_SIZE, None, "GPU", None)
    return msgspec.structs.replace(event, **fields)


def test_a_gap_in_the_sequence_forgets_the_rank_and_an_unknown_parent_is_skipped() -> None:
    index = PrefixIndex()
    ledger = KVEventLedger(index)
    ledger.apply("p0#0", 7, KVEventBatch(0.0, [stored([1, 2], None, 0)]))
    ledger.apply("p0#1", 3, KVEventBatch(0.0, [stored([1], None, 0)]))
    assert ledger.held == {"p0#0": 2, "p0#1": 1}
    ledger.apply("p0#0", 9, KVEventBatch(0.0, [stored([3], 2, 2 * BLOCK_SIZE)]))
    # batch 8 was lost: anything may have been evicted, and block 3's parent is forgotten
    assert ledger.gaps == 1 and ledger.skipped_blocks == 1
    assert "p0#0" not in ledger.held and ledger.held == {"p0#1": 1}


def test_only_the_gpu_tier_of_the_first_cache_group_counts() -> None:
    index = PrefixIndex()
    ledger = KVEventLedger(index)
    ledger.apply("r", 0, KVEventBatch(0.0, [stored([1, 2], None, 0)]))
    ledger.apply(
        "r",
        1,
        KVEventBatch(
            0.0,
            [
                BlockRemoved([1, 2], "CPU"),  # the offload tier's copy goes; the GPU's stays
                BlockRemoved([1, 2], "GPU", group_idx=1),  # a sliding window's group
                stored([9], None, 500, group_idx=1),
            ],
        ),
    )
    assert ledger.held == {"r": 2}
    ledger.apply("r", 2, KVEventBatch(0.0, [BlockRemoved([2], "GPU", group_idx=0)]))
    assert ledger.held == {"r": 1}
    packed = struct.pack(f"<{2 * BLOCK_SIZE}I", *range(2 * BLOCK_SIZE))
    assert index.match(token_block_keys(packed, BLOCK_SIZE)) == {"r": 1}


def test_replicas_fed_the_same_events_hold_the_same_blocks() -> None:
    cache = cache_with(capacity=32)
    ledgers = [KVEventLedger(PrefixIndex()) for _ in range(2)]
    for n, text in enumerate([b"x" * 700, b"y" * 900, b"x" * 500 + b"z" * 600]):
        cache_prompt(cache, text)
        batch = KVEventBatch(0.0, cache.take_events())
        for ledger in ledgers:
            ledger.apply("p#0", n, batch)
    probe = keys_of(b"x" * 700)
    assert ledgers[0].index.match(probe) == ledgers[1].index.match(probe) != {}
    assert ledgers[0].held == ledgers[1].held


def test_the_ledger_remembers_no_more_blocks_than_its_index_and_counts_what_it_forgot() -> None:
    index = PrefixIndex(capacity_blocks=4)
    ledger = KVEventLedger(index)
    ledger.apply("r", 0, KVEventBatch(0.0, [stored([1, 2, 3], None, 0)]))
    ledger.apply("s", 0, KVEventBatch(0.0, [stored([7, 8, 9], None, 900)]))
    assert len(ledger) == 4 and len(index) == 4
    assert ledger.held == {"r": 1, "s": 3}  # the oldest two blocks of r forgotten
    # a block stored after a forgotten parent cannot be keyed: skipped, not guessed
    ledger.apply("r", 1, KVEventBatch(0.0, [stored([4], 1, 3 * BLOCK_SIZE)]))
    assert ledger.skipped_blocks == 1 and ledger.held["r"] == 1
