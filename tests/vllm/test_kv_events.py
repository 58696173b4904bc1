"""The KV events codec (baton/core/kv_events.py) against vLLM 0.33's own: what the simulator's
prefix cache publishes decodes with vLLM's structs, what vLLM publishes decodes with Baton's,
and each DP rank's endpoint is the one vLLM's publisher binds or connects to."""

from __future__ import annotations

import base64
import struct

from baton.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    binds,
    decode_batch,
    encode_batch,
    external_hash,
    rank_endpoint,
)
from sim.kvcache import PrefixCache, block_hashes
from tests.vllm.conftest import Vllm

BLOCK = 16


def _journaled_batch() -> tuple[KVEventBatch, list[bytes], bytes]:
    """A prompt of three full blocks computed on a two-block cache: stored, one evicted by the
    next prompt, then the cache cleared."""
    cache = PrefixCache(capacity_blocks=4, block_size=BLOCK, journal=True)
    prompt = bytes(range(3 * BLOCK * 4))  # three blocks of 16 four-byte tokens
    hashes = block_hashes(prompt, BLOCK)
    allocation = cache.allocate(hashes, 3 * BLOCK)
    assert allocation is not None
    cache.register(allocation, hashes, 3 * BLOCK, prompt)
    cache.free(allocation)
    other = b"x" * (2 * BLOCK * 4)
    assert cache.allocate(block_hashes(other, BLOCK), 2 * BLOCK) is not None  # evicts one
    events = cache.take_events()
    return KVEventBatch(ts=12.5, events=events, data_parallel_rank=1), hashes, prompt


def test_vllm_decodes_what_the_simulators_prefix_cache_publishes(vllm: Vllm) -> None:
    batch, hashes, prompt = _journaled_batch()
    payload = base64.b64encode(encode_batch(batch)).decode()
    answer = vllm.ask("kv_events", payload=payload)
    assert answer["ok"], answer
    decoded = answer["decoded"]
    assert decoded["ts"] == 12.5 and decoded["data_parallel_rank"] == 1
    stored, removed = decoded["events"]
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [external_hash(h) for h in hashes]
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(struct.unpack(f"<{len(prompt) // 4}I", prompt))
    assert stored["block_size"] == BLOCK and stored["medium"] == "GPU"
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [external_hash(hashes[0])],
        "medium": "GPU",
        "group_idx": 0,
        "locality": None,
        "ownership": None,
    }


def test_baton_decodes_what_vllm_publishes(vllm: Vllm) -> None:
    answer = vllm.ask("kv_events", sample=True)
    assert answer["ok"], answer
    batch = decode_batch(base64.b64decode(answer["sample"]))
    expected = answer["sample_fields"]
    assert batch.ts == expected["ts"]
    assert batch.data_parallel_rank == expected["data_parallel_rank"]
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    want = expected["events"][0]
    assert stored.block_hashes == want["block_hashes"]
    assert stored.parent_block_hash == want["parent_block_hash"]
    assert stored.token_ids == want["token_ids"]
    assert stored.block_size == want["block_size"]
    assert removed.block_hashes == expected["events"][1]["block_hashes"]


def test_each_dp_rank_publishes_on_the_endpoint_vllm_binds(vllm: Vllm) -> None:
    cases = [
        ("tcp://*:5557", 0),
        ("tcp://*:5557", 3),
        ("tcp://127.0.0.1:6000", 1),
        ("tcp://*:0", 2),
        ("inproc://cache", 2),
    ]
    answer = vllm.ask("kv_events", endpoints=cases)
    assert answer["endpoints"] == [rank_endpoint(endpoint, rank) for endpoint, rank in cases]
    assert answer["binds"] == [binds(endpoint) for endpoint, _ in cases]
    assert answer["binds"] == [True, True, False, True, True]
