"""The prefill engines' KV events, read as they are published (vLLM's ``--kv-events-config``):
one ZeroMQ SUB socket per DP rank's publisher, each batch decoded (``baton/core/kv_events.py``)
and handed to the pool, whose ledger updates the prefix index (``router/prefix.py``).

The sockets follow the pool's targets: every ``refresh_s`` the subscriber connects to the
endpoints the pool names and closes those it no longer does. ZeroMQ reconnects on its own to a
publisher that restarts; a SUB socket sees only what is published after it joined, and what
went missing shows as a gap in the sequence numbers, which the ledger handles. A batch that is
not vLLM's format is counted and skipped, and its publisher told of in the log once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from baton.core.kv_events import decode_batch
from router.pool import Pool

__all__ = ["KVEventSubscriber"]

log = logging.getLogger("baton.gateway.kv_events")


class KVEventSubscriber:
    def __init__(
        self,
        pool: Pool,
        *,
        refresh_s: float,
        on_batch: Callable[[str], None] = lambda outcome: None,
        on_gap: Callable[[], None] = lambda: None,
    ) -> None:
        """``refresh_s``: seconds between looks at the pool's endpoints; ``on_batch``: told
        each batch's outcome (``applied``, ``undecodable``); ``on_gap``: told of each gap."""
        self.pool = pool
        self.refresh_s = refresh_s
        self._on_batch = on_batch
        self._on_gap = on_gap
        self._context = zmq.asyncio.Context()
        # (endpoint, the rank as the index names it) -> its reader
        self._readers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._odd: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._readers.values()) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._readers.clear()
        self._context.term()

    async def _follow(self) -> None:
        while True:
            wanted = set(self.pool.kv_event_endpoints().items())
            for gone in [reader for reader in self._readers if reader not in wanted]:
                self._readers.pop(gone).cancel()
            for endpoint, rank in wanted:
                reader = self._readers.get((endpoint, rank))
                if reader is None or reader.done():
                    self._readers[(endpoint, rank)] = asyncio.create_task(
                        self._read(endpoint, rank)
                    )
            await asyncio.sleep(self.refresh_s)

    async def _read(self, endpoint: str, rank: str) -> None:
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            while True:
                frames = await socket.recv_multipart()
                self._take(endpoint, rank, frames)
        finally:
            socket.close(linger=0)

    def _take(self, endpoint: str, rank: str, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"{len(frames)} frames, not topic, sequence and batch")
            batch = decode_batch(frames[2])
        except (ValueError, msgspec.DecodeError) as exc:
            self._on_batch("undecodable")
            if endpoint not in self._odd:
                self._odd.add(endpoint)
                log.warning("KV events from %s are not vLLM's format (%s); skipped", endpoint, exc)
            return
        gaps = self.pool.ledger.gaps
        self.pool.kv_events(rank, int.from_bytes(frames[1], "big"), batch)
        self._on_batch("applied")
        if self.pool.ledger.gaps != gaps:
            self._on_gap()
