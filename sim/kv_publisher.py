"""KV events published as vLLM publishes them (``--kv-events-config``): one ZeroMQ PUB socket
per DP rank, on the configured endpoint offset by the rank (bound where the host is a wildcard,
connected to otherwise, as vLLM does), each batch a three-frame message (topic, 8-byte
big-endian sequence number, the MessagePack batch; baton/core/kv_events.py).

A PUB socket never blocks its sender: past its high-water mark it drops, as vLLM's does, and a
subscriber that joins late misses what came before (vLLM's replay socket is not simulated).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import zmq

from baton.core.kv_events import (
    KVEvent,
    KVEventBatch,
    binds,
    encode_batch,
    rank_endpoint,
)
from sim.config import KVEventsConfig

__all__ = ["KVEventPublisher"]

_HWM = 100_000  # vLLM's default


class KVEventPublisher:
    """One DP rank's publisher."""

    def __init__(self, config: KVEventsConfig, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.endpoint = rank_endpoint(config.endpoint, dp_rank)
        self._topic = config.topic.encode()
        self._sequence = 0
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(_HWM)
        if binds(self.endpoint):
            self._socket.bind(self.endpoint)
        else:
            self._socket.connect(self.endpoint)

    def publish(self, events: Sequence[KVEvent]) -> None:
        """One step's events as one batch (nothing for no events, as vLLM sends none)."""
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.dp_rank)
        frames = (self._topic, self._sequence.to_bytes(8, "big"), encode_batch(batch))
        # past the high-water mark the batch is dropped, as vLLM's PUB socket drops it
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        self._sequence += 1

    def close(self) -> None:
        self._socket.close(linger=0)
