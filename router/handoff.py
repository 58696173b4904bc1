"""The P/D sequence for one request, as vLLM's NIXL connector expects it, with its fallbacks.

1. Choose a prefill instance (``policy.choose_prefill``) unless the P/D decider sends the prompt
   straight to decode.
2. Prefill: the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` when
   present), ``stream=false``, ``stream_options`` and ``min_tokens`` removed and
   ``kv_transfer_params={"do_remote_decode": true, ...}``, under the request's ``X-Request-Id``.
   - a 4xx goes back to the client as the engine wrote it;
   - a 5xx, a timeout or a connection error falls back to decode alone.
3. Decode: the client's body, byte for byte, plus prefill's ``kv_transfer_params`` verbatim, to
   the least-loaded DP rank of the same cell (``X-data-parallel-rank``), same ``X-Request-Id``.
   - before the first generated token reaches the client, a failure retries on another rank
     with the same KV, then on another rank with decode alone;
   - after it, a failure ends the stream with an SSE error event and ``[DONE]``: tokens are never
     duplicated or reordered;
   - a client disconnect closes the upstream request, so the engine aborts it and frees its KV
     (a decode aborted before its pull tells the prefill engine to free too).
4. ``usage.prompt_tokens_details.cached_tokens`` comes from the prefill response.

Every in-flight count taken in the pool is returned in a ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson

from router.errors import (
    NoHealthyTarget,
    UpstreamError,
    UpstreamFailed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from router.metrics import GatewayMetrics
from router.policy import (
    AffinityKey,
    DecodeRankView,
    PrefillView,
    RoutingPolicy,
    affinity_key,
    choose_decode_rank,
    choose_prefill,
    estimate_prompt_tokens,
    needs_prefill,
)
from router.pool import Pool
from router.stream import DecodeStream, FirstToken, StreamState, error_event
from router.upstream import UpstreamPool, UpstreamResponse

__all__ = ["ClientWriter", "DecodeRelay", "Handoff", "JsonReply", "Timeouts"]

log = logging.getLogger("baton.gateway.handoff")

# The fields vLLM's toy proxy sends; only do_remote_decode matters to the prefill engine.
_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_DECODE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    prefill_s: float = 300.0  # a long prompt may queue behind others
    first_token_s: float = 300.0  # decode: until the first generated token
    idle_s: float = 120.0  # decode: between two chunks once streaming


@dataclass(frozen=True, slots=True)
class JsonReply:
    status: int
    body: bytes
    request_id: str


class ClientWriter(Protocol):
    """The client's side of a relay: a synchronous write (called from the engine connection's
    protocol callback), whether the client is keeping up, and a wait until it has."""

    def write_now(self, data: bytes) -> None: ...

    def blocked(self) -> bool: ...

    async def drain(self) -> None: ...


class _StreamSink:
    """Engine bytes -> the usage-frame watcher -> the client, with no task in between."""

    __slots__ = ("_client", "_stream")

    def __init__(self, stream: DecodeStream, client: ClientWriter) -> None:
        self._stream = stream
        self._client = client

    def write(self, data: bytes) -> None:
        out = self._stream.feed(data)
        if out:
            self._client.write_now(out)

    def blocked(self) -> bool:
        return self._client.blocked()


class DecodeRelay:
    """An open decode stream whose first token has arrived; nothing is retried from here on.

    ``pump`` forwards the engine's bytes as they arrive (each received segment in one write,
    from the connection's callback: ``UpstreamResponse.relay``), looking only for the usage
    frame; a broken upstream ends the client's stream with an SSE error event and ``[DONE]``.
    Closing the upstream response on any exit (client disconnect included) makes the engine
    abort the request and free its KV.
    """

    __slots__ = (
        "_first_token",
        "_handoff",
        "_head",
        "_rank",
        "_response",
        "_started",
        "_stream",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        handoff: Handoff,
        rank: DecodeRankView,
        response: UpstreamResponse,
        head: bytes,
        stream: DecodeStream,
        first_token: float,
        started: float,
    ) -> None:
        self.request_id = request_id
        self._handoff = handoff
        self._rank = rank
        self._response = response
        self._head = head
        self._stream = stream
        self._first_token = first_token
        self._started = started

    async def pump(self, client: ClientWriter) -> None:
        stream = self._stream
        sink = _StreamSink(stream, client)
        ended = "ok"
        try:
            sink.write(self._head)
            await self._response.relay(sink, client.drain)
            tail = stream.finish()
            if tail:
                client.write_now(tail)
            if not stream.done:
                ended = "truncated"
                client.write_now(error_event("the decode engine ended the stream early"))
            await client.drain()
        except UpstreamError as exc:
            ended = "upstream"
            log.warning(
                "decode on %s failed mid-stream (%s); ending the stream", self._rank.name, exc
            )
            self._handoff.pool.failed(self._rank.name)
            client.write_now(
                error_event(f"the decode engine failed mid-stream: {type(exc).__name__}")
            )
            await client.drain()
        except asyncio.CancelledError:
            # A client that hangs up right after [DONE] got everything: not an abort.
            ended = "ok" if stream.done else "client_disconnect"
            raise
        finally:
            # Back to the pool when read to its end; otherwise the connection is dropped and
            # the engine aborts the request and frees its KV.
            self._response.release()
            self._handoff.pool.end_decode(self._rank.name)
            self._handoff.finish_stream(stream, ended, self._first_token, self._started)


@dataclass(frozen=True, slots=True)
class _Prefilled:
    kv_transfer_params: Mapping[str, object]  # forwarded verbatim
    cached_tokens: int | None


class Handoff:
    def __init__(
        self,
        pool: Pool,
        upstream: UpstreamPool,
        policy: RoutingPolicy,
        metrics: GatewayMetrics,
        timeouts: Timeouts,
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self.policy = policy
        self.metrics = metrics
        self.timeouts = timeouts
        # Every wait for bytes is bounded; before the first token the (longer) first-token
        # bound applies to the whole wait as well.
        self._read_timeout = max(timeouts.idle_s, timeouts.first_token_s)
        # Deadlines are on the event loop's clock, the one its timers run on; built in the
        # app's lifespan, where the loop runs.
        self._clock = asyncio.get_running_loop().time

    async def serve(
        self,
        route: str,
        body: dict[str, object],
        raw: bytes,
        headers: Mapping[str, str],
        request_id: str,
    ) -> JsonReply | DecodeRelay:
        """Run the P/D sequence for one validated request body (``raw`` is its exact bytes)."""
        started = time.perf_counter()
        key = affinity_key(headers, body, request_id)
        snapshot = self.pool.snapshot()
        prompt_tokens = estimate_prompt_tokens(body)
        prefilled: _Prefilled | None = None
        cell: str | None = None
        prefill = None
        if needs_prefill(prompt_tokens, self.policy):
            choice = choose_prefill(snapshot, key, self.policy)
            if choice is not None:
                prefill = choice.view
                self.metrics.child(
                    self.metrics.affinity, key.source.value, "miss" if choice.spilled else "hit"
                ).inc()
        if prefill is not None:
            cell = prefill.cell
            outcome = await self._prefill(prefill, route, body, request_id, prompt_tokens)
            if isinstance(outcome, JsonReply):
                return outcome  # prefill's 4xx, as the engine wrote it
            prefilled = outcome
        (self.metrics.pd_routes if prefilled else self.metrics.decode_only_routes).inc()
        prefill_done = time.perf_counter()
        return await self._decode(
            route, body, raw, request_id, key, cell, prefilled, started, prefill_done
        )

    # ---- prefill

    async def _prefill(
        self, target: PrefillView, route: str, body: dict[str, object], request_id: str, tokens: int
    ) -> _Prefilled | JsonReply | None:
        payload = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        payload.update(max_tokens=1, stream=False, kv_transfer_params=_PREFILL_KV)
        if "max_completion_tokens" in body:
            payload["max_completion_tokens"] = 1
        self.pool.begin_prefill(target.name, tokens)
        started = time.perf_counter()
        try:
            data, status = await self._call(
                target.name,
                route,
                orjson.dumps(payload),
                _headers(request_id),
                self.timeouts.prefill_s,
            )
            if status != 200:
                raise UpstreamStatus("prefill", status, data)
            reply = orjson.loads(data)
        except UpstreamStatus as exc:
            if exc.client_error:
                self.pool.succeeded(target.name)  # the engine is fine; the request is not
                return JsonReply(exc.status, exc.body, request_id)
            return self._fall_back(target, exc.reason, exc)
        except UpstreamError as exc:
            return self._fall_back(target, exc.reason, exc)
        except orjson.JSONDecodeError as exc:
            return self._fall_back(target, "malformed", exc)
        finally:
            self.pool.end_prefill(target.name, tokens)
        self.pool.succeeded(target.name)
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        params = reply.get("kv_transfer_params")
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and isinstance(usage.get("prompt_tokens"), int):
            self.metrics.cached_tokens.inc(cached)
            self.metrics.uncached_tokens.inc(usage["prompt_tokens"] - cached)
        if not isinstance(params, dict):
            log.warning(
                "prefill %s answered without kv_transfer_params; decode prefills alone", target.name
            )
            self.metrics.child(self.metrics.fallbacks, "no_kv_transfer_params").inc()
            return None
        return _Prefilled(params, cached if isinstance(cached, int) else None)

    async def _call(
        self, url: str, route: str, payload: bytes, headers: dict[str, str], within_s: float
    ) -> tuple[bytes, int]:
        """One non-streamed call: the whole answer within ``within_s``, or UpstreamError."""
        response: UpstreamResponse | None = None
        deadline = self._clock() + within_s
        try:
            response = await self.upstream.post(url, route, payload, headers, within_s, deadline)
            data = await response.read_all(deadline)
        except BaseException:
            if response is not None:
                response.close()  # the engine sees the request go away and aborts it
            raise
        response.release()
        return data, response.status

    def _fall_back(self, target: PrefillView, reason: str, exc: Exception) -> None:
        log.warning("prefill on %s failed (%s); falling back to decode alone", target.name, exc)
        self.pool.failed(target.name)
        self.metrics.child(self.metrics.fallbacks, reason).inc()
        return None

    # ---- decode

    async def _decode(
        self,
        route: str,
        body: dict[str, object],
        raw: bytes,
        request_id: str,
        key: AffinityKey,
        cell: str | None,
        prefilled: _Prefilled | None,
        started: float,
        prefill_done: float,
    ) -> JsonReply | DecodeRelay:
        stream = bool(body.get("stream"))
        tried: list[str] = []
        last: UpstreamError | None = None
        for attempt in range(_DECODE_ATTEMPTS):
            with_kv = prefilled is not None and attempt < _DECODE_ATTEMPTS - 1
            rank = choose_decode_rank(
                self.pool.snapshot(), key.digest + request_id.encode(), cell, exclude=tried
            )
            if rank is None and cell is not None:  # the cell has no rank left: any cell, alone
                rank = choose_decode_rank(self.pool.snapshot(), request_id.encode(), None, tried)
                with_kv = False
            if rank is None:
                break
            tried.append(rank.name)
            if attempt:
                self.metrics.child(
                    self.metrics.retries, "decode", last.reason if last else "error"
                ).inc()
                if prefilled is not None and not with_kv:
                    self.metrics.child(self.metrics.fallbacks, "decode_retry").inc()
            payload = _with_kv(raw, prefilled.kv_transfer_params) if with_kv and prefilled else raw
            cached = prefilled.cached_tokens if with_kv and prefilled else None
            try:
                if stream:
                    return await self._open_stream(
                        rank, route, payload, request_id, cached, started, prefill_done
                    )
                return await self._complete(rank, route, payload, request_id, cached, started)
            except UpstreamStatus as exc:
                if exc.client_error:
                    return JsonReply(exc.status, exc.body, request_id)
                last = exc
            except UpstreamError as exc:
                last = exc
            log.warning("decode on %s failed before the first token (%s)", rank.name, last)
            self.pool.failed(rank.name)
        if last is None:
            raise NoHealthyTarget("no healthy decode rank can take the request; see /ready")
        self.metrics.child(self.metrics.aborts, "decode", "exhausted").inc()
        raise UpstreamFailed(f"every decode attempt failed; last: {last}")

    async def _complete(
        self,
        rank: DecodeRankView,
        route: str,
        payload: bytes,
        request_id: str,
        cached: int | None,
        started: float,
    ) -> JsonReply:
        self.pool.begin_decode(rank.name)
        try:
            data, status = await self._call(
                rank.url,
                route,
                payload,
                _headers(request_id, rank.dp_rank),
                self.timeouts.first_token_s,
            )
            if status != 200:
                raise UpstreamStatus("decode", status, data)
        finally:
            self.pool.end_decode(rank.name)
        self.pool.succeeded(rank.name)
        reply = orjson.loads(data)
        usage = reply.get("usage")
        if isinstance(usage, dict):
            if cached is not None:
                usage["prompt_tokens_details"] = {
                    **(usage.get("prompt_tokens_details") or {}),
                    "cached_tokens": cached,
                }
                data = orjson.dumps(reply)
            self.metrics.output_tokens.inc(usage.get("completion_tokens") or 0)
        elapsed = time.perf_counter() - started
        self.metrics.e2e.observe(elapsed)
        return JsonReply(200, data, request_id)

    async def _open_stream(
        self,
        rank: DecodeRankView,
        route: str,
        payload: bytes,
        request_id: str,
        cached: int | None,
        started: float,
        prefill_done: float,
    ) -> DecodeRelay:
        """Open the decode stream and read up to its first token; raise if it fails first."""
        self.pool.begin_decode(rank.name)
        response: UpstreamResponse | None = None
        deadline = self._clock() + self.timeouts.first_token_s
        try:
            response = await self.upstream.post(
                rank.url,
                route,
                payload,
                _headers(request_id, rank.dp_rank),
                self._read_timeout,
                deadline,
            )
            if response.status != 200:
                raise UpstreamStatus("decode", response.status, await response.read_all(deadline))
            head = FirstToken()
            while head.state is StreamState.PENDING:
                chunk = await response.read_some(deadline)
                if not chunk:
                    raise UpstreamUnavailable("decode", "stream ended before a token")
                head.feed(chunk)
            if head.state is StreamState.ERROR:
                raise UpstreamStatus("decode", 500, head.error)
        except UpstreamTimeout as exc:
            if response is not None:
                response.close()
            self.pool.end_decode(rank.name)
            raise UpstreamTimeout("decode", "no first token in time") from exc
        except BaseException:
            if response is not None:
                response.close()
            self.pool.end_decode(rank.name)
            raise
        first_token = time.perf_counter()
        self.metrics.ttft.observe(first_token - started)
        self.metrics.handoff_seconds.observe(first_token - prefill_done)
        self.pool.succeeded(rank.name)
        return DecodeRelay(
            request_id,
            self,
            rank,
            response,
            head.buffered,
            DecodeStream(cached),
            first_token,
            started,
        )

    def finish_stream(
        self, stream: DecodeStream, ended: str, first_token: float, started: float
    ) -> None:
        """Record a finished relay: how it ended, its timings, its tokens."""
        now = time.perf_counter()
        if ended != "ok":
            self.metrics.child(self.metrics.aborts, "decode", ended).inc()
        self.metrics.e2e.observe(now - started)
        self.metrics.decode_seconds.observe(now - first_token)
        usage = stream.usage
        if usage is not None:
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int) and tokens:
                self.metrics.output_tokens.inc(tokens)
                if tokens > 1:
                    self.metrics.itl.observe((now - first_token) / (tokens - 1))


def _headers(request_id: str, dp_rank: int = -1) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if dp_rank >= 0:
        headers["X-data-parallel-rank"] = str(dp_rank)
    return headers


def _with_kv(raw: bytes, params: Mapping[str, object]) -> bytes:
    """The client's body, byte for byte, with ``kv_transfer_params`` added as its first field."""
    start = raw.index(b"{") + 1
    rest = raw[start:].lstrip()
    separator = b"" if rest.startswith(b"}") else b","
    return raw[:start] + b'"kv_transfer_params":' + orjson.dumps(params) + separator + rest
