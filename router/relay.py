"""The decode stream's bytes, from the engine to the client, once its first token has arrived.

Nothing is retried from here on: a broken upstream ends the client's stream with an SSE error
event and ``[DONE]``, never with duplicated or reordered tokens. Each received segment is
written to the client from the engine connection's protocol callback
(``UpstreamResponse.relay``), no task waking per chunk, looking only for the usage frame
(``router.stream.DecodeStream``). Closing the upstream response on any exit (client disconnect
included) makes the engine abort the request and free its KV.

Where the bytes go is a :class:`~router.upstream.Sink`. Under uvicorn the relay writes to
uvicorn's own transport with its HTTP/1.1 chunk framing (``_UvicornSink``): uvicorn has no public
API for a synchronous write, so this module is the one place that reads its response cycle
(``transport``, ``flow``, ``disconnected``, ``chunked_encoding``), checked at each request and
skipped when they are not there. Any other ASGI server (Ray Serve's proxy, test clients) gets one
``send`` per received segment (``_AsgiSink``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.errors import UpstreamError
from router.metrics import GatewayMetrics
from router.policy import DecodeRankView
from router.pool import Pool
from router.stream import DecodeStream, error_event
from router.upstream import Sink, UpstreamResponse

__all__ = ["SERVER_SEND", "DecodeRelay", "Relay", "RelayResponse", "Timing"]

log = logging.getLogger("baton.gateway.relay")

# The scope key under which the gateway keeps the server's own ``send`` (see router.app).
SERVER_SEND = "baton.server_send"


@dataclass(slots=True)
class Timing:
    """One request's moments on the ``perf_counter`` clock: arrival, the end of its prefill leg
    (arrival when there was none) and its first decode token."""

    started: float
    prefill_done: float = 0.0
    first_token: float = 0.0


class Relay(Protocol):
    """What :class:`RelayResponse` streams: a request's SSE bytes, written to a sink."""

    @property
    def request_id(self) -> str: ...

    async def pump(self, client: Sink) -> None: ...


class DecodeRelay:
    """An open decode stream whose first token has arrived (see the module docstring)."""

    __slots__ = (
        "_head",
        "_metrics",
        "_pool",
        "_rank",
        "_response",
        "_stream",
        "request_id",
        "route",
        "timing",
    )

    def __init__(
        self,
        route: str,
        request_id: str,
        timing: Timing,
        rank: DecodeRankView,
        response: UpstreamResponse,
        head: bytes,
        stream: DecodeStream,
        pool: Pool,
        metrics: GatewayMetrics,
    ) -> None:
        self.route = route
        self.request_id = request_id
        self.timing = timing
        self._rank = rank
        self._response = response
        self._head = head
        self._stream = stream
        self._pool = pool
        self._metrics = metrics

    async def pump(self, client: Sink) -> None:
        """Forward every byte to ``client`` until the stream ends; count how it ended."""
        stream, timing = self._stream, self.timing
        watched = _UsageWatcher(stream, client)
        ended = "ok"
        try:
            watched.write(self._head)
            await self._response.relay(watched)
            tail = stream.finish()
            if tail:
                client.write(tail)
            if not stream.done:
                ended = "truncated"
                client.write(error_event("the decode engine ended the stream early"))
            await client.drain()
        except UpstreamError as exc:
            ended = "upstream"
            log.warning(
                "decode on %s failed mid-stream (%s); ending the stream", self._rank.name, exc
            )
            self._pool.failed(self._rank.name)
            client.write(error_event(f"the decode engine failed mid-stream: {type(exc).__name__}"))
            await client.drain()
        except asyncio.CancelledError:
            # A client that hangs up right after [DONE] got everything: not an abort.
            ended = "ok" if stream.done else "client_disconnect"
            raise
        finally:
            # Back to the pool when read to its end; otherwise the connection is dropped and
            # the engine aborts the request and frees its KV.
            self._response.release()
            self._pool.end_decode(self._rank.name)
            self._metrics.stream_ended(
                self.route,
                stream.usage,
                ended,
                started=timing.started,
                first_token=timing.first_token,
                now=time.perf_counter(),
            )


class _UsageWatcher:
    """Engine bytes -> the usage-frame watcher -> the client, with no task in between."""

    __slots__ = ("_client", "_stream")

    def __init__(self, stream: DecodeStream, client: Sink) -> None:
        self._stream = stream
        self._client = client

    def write(self, data: bytes) -> None:
        out = self._stream.feed(data)
        if out:
            self._client.write(out)

    def blocked(self) -> bool:
        return self._client.blocked()

    async def drain(self) -> None:
        await self._client.drain()


class _UvicornSink:
    """Writes to uvicorn's transport as uvicorn would (HTTP/1.1 chunked), without a coroutine
    per chunk: the engine connection's callback writes to the client at once."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def write(self, data: bytes) -> None:
        cycle = self._cycle
        if not cycle.disconnected:  # the disconnect watcher ends the relay
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def blocked(self) -> bool:
        return bool(self._cycle.flow.write_paused)

    async def drain(self) -> None:
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()


class _AsgiSink:
    """Bytes buffered and sent by the relaying task, one ``send`` per received segment."""

    __slots__ = ("_buffer", "_send")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._buffer = bytearray()

    def write(self, data: bytes) -> None:
        self._buffer += data

    def blocked(self) -> bool:
        return bool(self._buffer)

    async def drain(self) -> None:
        if self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            await self._send({"type": "http.response.body", "body": data, "more_body": True})


def _uvicorn_cycle(send: Send) -> Any | None:
    """uvicorn's response cycle behind ``send``, once it has started a chunked response."""
    cycle = getattr(send, "__self__", None)
    if (
        getattr(cycle, "chunked_encoding", None) is True
        and hasattr(cycle, "transport")
        and hasattr(cycle, "flow")
        and hasattr(cycle, "disconnected")
    ):
        return cycle
    return None


class RelayResponse(Response):
    """The SSE response of a decode relay, written straight to the ASGI server.

    Starlette's StreamingResponse would add an async generator and a task group per request. A
    watcher ends the relay when the client disconnects, which closes the upstream request so
    the engines abort it.
    """

    media_type = "text/event-stream"

    def __init__(self, relay: Relay) -> None:
        # no Content-Length: the body is streamed (chunked)
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", relay.request_id.encode("latin-1")),
        ]
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        server_send = scope.get(SERVER_SEND, send)
        pump = asyncio.current_task()
        assert pump is not None  # a response is always awaited inside a task
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            pump.cancel()

        cycle = _uvicorn_cycle(server_send)
        client: Sink = _UvicornSink(cycle) if cycle is not None else _AsgiSink(server_send)
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.relay.pump(client)
            await server_send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            pump.uncancel()  # the client left: the relay closed its upstream; nothing to send
        finally:
            watcher.cancel()
