"""``baton sim --kv-events-config``: the prefix cache's KV events on ZeroMQ, as vLLM publishes
them, read by a subscriber as the gateway would read them (baton/core/kv_events.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import zmq

from baton.core.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    external_hash,
)
from rigs.processes import free_port_block
from sim.kvcache import block_hashes
from tests.helpers import SimHandle

BLOCK = 16


class Subscriber:
    """A SUB socket on one rank's endpoint (connected to it, or bound there for a publisher
    that connects): every batch published after the two met."""

    def __init__(self, endpoint: str, *, bind: bool = False) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.sequences: list[int] = []

    def batches_until(
        self, done: Callable[[list[KVEventBatch]], bool], within_s: float = 30
    ) -> list[KVEventBatch]:
        batches: list[KVEventBatch] = []
        deadline = time.monotonic() + within_s
        while not done(batches):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"no such batches within {within_s} s; got {batches}"
            if self.socket.poll(left_ms):
                topic, sequence, payload = self.socket.recv_multipart()
                assert topic == b"kv"
                self.sequences.append(int.from_bytes(sequence, "big"))
                batches.append(decode_batch(payload))
        return batches

    def close(self) -> None:
        self.socket.close(linger=0)


def _stored(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


@pytest.fixture
def engine(start_sim: Callable[..., SimHandle]) -> Iterator[tuple[SimHandle, list[Subscriber]]]:
    port = free_port_block(2)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    sim = start_sim(
        "--data-parallel-size",
        "2",
        "--block-size",
        str(BLOCK),
        "--kv-events-config",
        json.dumps(config),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    subscribers = [Subscriber(f"tcp://127.0.0.1:{port + rank}") for rank in (0, 1)]
    for rank, subscriber in enumerate(subscribers):
        _until_subscribed(sim, subscriber, rank)
    yield sim, subscribers
    for subscriber in subscribers:
        subscriber.close()


def _until_subscribed(sim: SimHandle, subscriber: Subscriber, rank: int) -> None:
    """A SUB socket misses what is published before its subscription reaches the publisher:
    probe prompts on ``rank`` until one's events arrive, then drop what came."""
    deadline = time.monotonic() + 30
    for probe in range(1000):
        assert time.monotonic() < deadline, f"rank {rank}'s events never reached the subscriber"
        _complete(sim, f"probe {probe} of rank {rank} " * 8, rank)
        if subscriber.socket.poll(500):
            break
    while subscriber.socket.poll(200):
        subscriber.socket.recv_multipart()
    subscriber.sequences.clear()


def _complete(sim: SimHandle, prompt: str, rank: int) -> dict[str, object]:
    response = httpx.post(
        f"{sim.url}/v1/completions",
        json={"model": "deepseek-ai/DeepSeek-V4.1-Flash", "prompt": prompt, "max_tokens": 1},
        headers={"X-data-parallel-rank": str(rank)},
        timeout=60,
    )
    response.raise_for_status()
    result: dict[str, object] = response.json()
    return result


def test_a_prompt_computed_on_a_rank_is_published_by_that_rank_with_its_tokens(
    engine: tuple[SimHandle, list[Subscriber]],
) -> None:
    sim, (rank0, rank1) = engine
    prompt = "kv events carry the tokens of every block " * 20  # 840 bytes: 13 full blocks
    _complete(sim, prompt, rank=1)
    batches = rank1.batches_until(lambda got: len(_stored(got)) > 0)
    assert all(b.data_parallel_rank == 1 for b in batches)
    stored = _stored(batches)
    hashes = block_hashes(prompt.encode(), BLOCK)
    assert [h for e in stored for h in e.block_hashes] == [external_hash(h) for h in hashes]
    assert stored[0].parent_block_hash is None
    tokens = [t for e in stored for t in e.token_ids]
    assert len(tokens) == len(hashes) * BLOCK
    assert b"".join(t.to_bytes(4, "little") for t in tokens) == prompt.encode()[: len(tokens) * 4]
    assert rank1.sequences == list(range(rank1.sequences[0], rank1.sequences[-1] + 1))
    # rank 0 computed nothing: it published nothing
    assert not rank0.socket.poll(200)


def test_a_reset_prefix_cache_publishes_all_blocks_cleared_on_every_rank(
    engine: tuple[SimHandle, list[Subscriber]],
) -> None:
    sim, subscribers = engine
    assert httpx.post(f"{sim.url}/reset_prefix_cache", timeout=10).json() == {"success": True}
    for subscriber in subscribers:
        subscriber.batches_until(
            lambda got: any(isinstance(e, AllBlocksCleared) for b in got for e in b.events)
        )


def test_a_publisher_given_a_host_connects_to_a_subscriber_bound_there(
    start_sim: Callable[..., SimHandle],
) -> None:
    port = free_port_block(1)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", bind=True)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
    sim = start_sim("--block-size", str(BLOCK), "--kv-events-config", json.dumps(config))
    try:
        _until_subscribed(sim, subscriber, 0)
    finally:
        subscriber.close()
