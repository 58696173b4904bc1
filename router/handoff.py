"""The P/D sequence for one request, as vLLM's NIXL connector expects it, with its fallbacks.

1. Choose a prefill instance (``policy.choose_prefill``) unless the P/D decider sends the prompt
   straight to decode. The chosen DP rank is recorded as holding the prompt's blocks
   (``router/prefix.py``) as soon as it is chosen; while the prefill runs, the request's
   uncached tokens there count as outstanding on the instance.
2. Prefill: the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` when
   present), ``stream=false``, ``stream_options`` and ``min_tokens`` removed and
   ``kv_transfer_params={"do_remote_decode": true, ...}``, under the request's ``X-Request-Id``,
   to the instance's DP rank holding its prefix, else the one for its key
   (``X-data-parallel-rank``), once the instance has reported its ranks.
   - a 4xx goes back to the client as the engine wrote it;
   - a 5xx, a timeout or a connection error falls back to decode alone.
   - an answer whose ``remote_block_ids`` cannot hold its ``remote_num_tokens`` (fewer blocks
     than the engine's block size needs: a decode engine asserts on it and dies) falls back to
     decode alone, and the prefill instance counts a failure.
3. Decode: the client's body, byte for byte, plus prefill's ``kv_transfer_params`` verbatim, to
   the least-loaded DP rank of the same cell (``X-data-parallel-rank``), same ``X-Request-Id``.
   Both legs carry a completion's text prompt as the ids the gateway tokenized it to, where
   its tokenizer is the engines' (``router.tokens.prompt_as_ids``).
   - before the first generated token reaches the client, a failure retries on another rank
     with the same KV only if the failed engine never received the request (no connection):
     an engine that did may have pulled the blocks, and vLLM answers a replayed handoff 200
     with whatever the freed blocks hold; otherwise, and then, on another rank with decode
     alone;
   - after it, a failure ends the stream with an SSE error event and ``[DONE]``: tokens are never
     duplicated or reordered;
   - a client disconnect closes the upstream request, so the engine aborts it and frees its KV
     (a decode aborted before its pull tells the prefill engine to free too).
4. ``usage.prompt_tokens_details.cached_tokens`` comes from the prefill response.

A streamed completion whose prompt goes as ids may have its first token from the prefill leg
(``router.first_token`` decides): the prefill leg then asks for the token's id
(``return_token_ids``), the client gets the token as soon as the prefill answers, and every
decode leg of step 3 (retries too) continues after it: the prompt's ids and the token, one
token fewer; its usage counts the token as output again. Step 3's failures before the decode
leg's first token are retried as before; when every attempt fails, the stream ends with an SSE
error event.

Every in-flight count taken in the pool is returned in a ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from router.errors import (
    GatewayError,
    NoHealthyTarget,
    Saturated,
    UpstreamError,
    UpstreamFailed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnavailable,
    engine_error_body,
)
from router.first_token import (
    FirstToken,
    continuation_fields,
    continued_prompt,
    first_token,
    sends_first_token,
)
from router.metrics import GatewayMetrics
from router.policy import (
    AffinityKey,
    DecodeRankView,
    PrefillChoice,
    PrefillView,
    RoutingPolicy,
    affinity_key,
    choose_decode_rank,
    choose_prefill,
    estimate_prompt_tokens,
    needs_prefill,
    prompt_bytes,
)
from router.prefix import PromptBlocks, block_hashes, token_block_keys
from router.prober import Prober
from router.relay import DecodeRelay, Timing
from router.stream import DONE, DecodeStream, StreamHead, StreamState, error_event
from router.tokens import PromptTokenizer, ShortestFirst, prompt_as_ids
from router.upstream import Sink, UpstreamPool, UpstreamResponse

__all__ = [
    "FirstTokenRelay",
    "Handoff",
    "JsonReply",
    "Timeouts",
    "continuation_body",
    "decode_body",
    "engine_headers",
    "missing_blocks",
    "prefill_body",
]

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
    queue_s: float = 10.0  # for a decode rank below the pool's bound, before 429


@dataclass(frozen=True, slots=True)
class JsonReply:
    status: int
    body: bytes
    request_id: str


@dataclass(frozen=True, slots=True)
class _Prefilled:
    kv_transfer_params: Mapping[str, object]  # forwarded verbatim
    cached_tokens: int | None
    first: FirstToken | None = None  # the prefill's token, for the client at once


@dataclass(slots=True)
class _Request:
    """One validated request as the handoff runs it."""

    route: str
    body: Mapping[str, object]
    raw: bytes  # the client's exact bytes: what decode receives
    request_id: str
    key: AffinityKey
    timing: Timing
    prompt: bytes = b""  # a ``"prompt": [ids]`` field both legs carry over the text's
    admitted: bool = False  # holds a place under the decode bound until its decode begins
    wants_first: bool = False  # the prefill leg returns its token's id (router.first_token)
    first_sent: bool = False  # the client has the prefill's token; decode continues after it

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class Handoff:
    def __init__(
        self,
        prober: Prober,
        upstream: UpstreamPool,
        policy: RoutingPolicy,
        metrics: GatewayMetrics,
        timeouts: Timeouts,
        tokenizer: PromptTokenizer | None = None,
        *,
        first_from_prefill: bool = False,
    ) -> None:
        """``tokenizer``: the engines' (``router/tokens.py``), to key prompts by the token
        blocks the engines cache and report; None keys them by bytes. ``first_from_prefill``:
        send a streamed completion's first token from its prefill leg where
        ``router.first_token`` allows."""
        self.prober = prober
        self.first_from_prefill = first_from_prefill
        self.tokenizer = tokenizer
        self._tokenizing = ShortestFirst(self._tokenize)
        self.pool = prober.pool
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
    ) -> JsonReply | DecodeRelay | FirstTokenRelay:
        """Run the P/D sequence for one validated request body (``raw`` is its exact bytes)."""
        timing = Timing(started=time.perf_counter())
        key = affinity_key(headers, body, request_id)
        blocks, prompt_tokens, prompt = await self._prompt_blocks(body, len(raw))
        if prompt:
            self.metrics.prompts_as_ids.inc()
        request = _Request(route, body, raw, request_id, key, timing, prompt)
        request.wants_first = self.first_from_prefill and sends_first_token(
            route, body, bool(prompt)
        )
        await self._admit()
        request.admitted = self.pool.max_requests_per_rank > 0
        try:
            reply = await self._route(request, blocks, prompt_tokens)
        except BaseException:
            self._unadmit(request)
            raise
        if not isinstance(reply, FirstTokenRelay):  # that one takes its decode leg along
            self._unadmit(request)
        return reply

    def _unadmit(self, request: _Request) -> None:
        """The request ended before a decode rank took it: its place goes back."""
        if request.admitted:
            request.admitted = False
            self.pool.release_admission(placed=False)

    def _placed(self, request: _Request) -> None:
        """The request's decode began: its rank's count now holds the place it was admitted to."""
        if request.admitted:
            request.admitted = False
            self.pool.release_admission(placed=True)

    async def _route(
        self, request: _Request, blocks: PromptBlocks, prompt_tokens: int
    ) -> JsonReply | DecodeRelay | FirstTokenRelay:
        timing, key = request.timing, request.key
        choice = None
        if needs_prefill(prompt_tokens, self.policy):
            snapshot = self.pool.snapshot(blocks)
            choice = choose_prefill(snapshot, key, prompt_tokens, self.policy)
            if choice is not None:
                # recorded now, so that a request sharing the prefix while this one runs
                # follows it to the rank that will hold it
                self.pool.routed(choice.view.name, choice.view.dp_rank, blocks.keys)
                self.metrics.child(
                    self.metrics.affinity, key.source.value, "miss" if choice.spilled else "hit"
                ).inc()
        self.metrics.route_seconds.observe(time.perf_counter() - timing.started)
        prefilled: _Prefilled | None = None
        if choice is not None:
            outcome = await self._prefill(choice, request)
            if isinstance(outcome, JsonReply):
                return outcome  # prefill's 4xx, as the engine wrote it
            prefilled = outcome
        (self.metrics.pd_routes if prefilled else self.metrics.decode_only_routes).inc()
        timing.prefill_done = time.perf_counter()
        cell = choice.view.cell if choice else None
        if prefilled is not None and prefilled.first is not None:
            return self._send_first(request, cell, prefilled, prefilled.first)
        return await self._decode(request, cell, prefilled)

    def _send_first(
        self, request: _Request, cell: str | None, prefilled: _Prefilled, first: FirstToken
    ) -> FirstTokenRelay:
        """The client gets the prefill's token now; every decode leg from here on, retries
        included, continues after it (``router.first_token``)."""
        request.raw = continuation_body(request.raw, request.body)
        request.prompt = continued_prompt(request.prompt, first.token_id)
        request.first_sent = True
        timing = request.timing
        timing.first_token = timing.prefill_done
        self.metrics.ttft.observe(timing.first_token - timing.started)
        self.metrics.first_tokens_from_prefill.inc()
        return FirstTokenRelay(self, request, cell, prefilled, first.event)

    async def _prompt_blocks(
        self, body: Mapping[str, object], size: int
    ) -> tuple[PromptBlocks, int, bytes]:
        """The prompt's block keys, its tokens, and the ``"prompt": [ids]`` field its legs carry
        (empty: the client's prompt goes): counted by the engines' tokenizer where the gateway
        has it (off the loop where that takes long, the smallest of the requests waiting first:
        ``size``, its bytes), else estimated from its bytes."""
        if self.tokenizer is not None:
            if self.tokenizer.blocking:
                packed, field = await self._tokenizing.run(body, size)
            else:
                packed, field = self._tokenize(body)
            if packed is not None:
                size = self.pool.kv_block_size()
                return PromptBlocks(token_block_keys(packed, size), size), len(packed) // 4, field
        prompt = prompt_bytes(body)
        tokens = estimate_prompt_tokens(body, prompt)
        if self.tokenizer is not None:  # keys of another space would match nothing
            return PromptBlocks(), tokens, b""
        return PromptBlocks(block_hashes(prompt)), tokens, b""

    def _tokenize(self, body: Mapping[str, object]) -> tuple[bytes | None, bytes]:
        """The prompt's ids and, where they are the engines' own, the field sending them."""
        assert self.tokenizer is not None  # called only where the gateway has one
        packed = self.tokenizer.packed(body)
        field = prompt_as_ids(body, packed) if self.tokenizer.engines_ids else None
        return packed, field or b""

    async def _admit(self) -> None:
        """Wait for a decode rank below the pool's bound of requests, or refuse with 429."""
        placed = await self.prober.decode_place(self.timeouts.queue_s)
        if placed == "free":
            return
        self.metrics.child(self.metrics.admission_waits, placed).inc()
        if placed == "saturated":
            bound = self.pool.max_requests_per_rank
            raise Saturated(
                f"every decode rank holds {bound} requests and none freed a place within "
                f"{self.timeouts.queue_s:g} s; retry later",
                retry_after_s=math.ceil(self.timeouts.queue_s),
            )

    # ---- prefill

    async def _prefill(
        self, choice: PrefillChoice, request: _Request
    ) -> _Prefilled | JsonReply | None:
        target = choice.view
        self.pool.begin_prefill(target.name, target.dp_rank, choice.uncached_tokens)
        started = time.perf_counter()
        try:
            data, status = await self._call(
                target.name,
                request.route,
                prefill_body(request.raw, request.body, request.prompt, request.wants_first),
                engine_headers(request.request_id, target.dp_rank),
                self.timeouts.prefill_s,
            )
            if status != 200:
                raise UpstreamStatus("prefill", status, data)
            reply = orjson.loads(data)
        except UpstreamStatus as exc:
            if exc.client_error:
                self.pool.succeeded(target.name)  # the engine is fine; the request is not
                return JsonReply(
                    exc.status, engine_error_body(exc.status, exc.body), request.request_id
                )
            self._fall_back(target, exc.reason, exc)
            return None
        except UpstreamError as exc:
            self._fall_back(target, exc.reason, exc)
            return None
        except orjson.JSONDecodeError as exc:
            self._fall_back(target, "malformed", exc)
            return None
        finally:
            self.pool.end_prefill(target.name, target.dp_rank, choice.uncached_tokens)
        self.pool.succeeded(target.name)
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        params = reply.get("kv_transfer_params")
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and isinstance(cached, int):
            self.metrics.cached_tokens.inc(cached)
            self.metrics.indexed_tokens.inc(min(target.cached_tokens, prompt))
            self.metrics.uncached_tokens.inc(prompt - cached)
            # what the index knew a rank held, and the engine computed anyway, by cause
            away = min(choice.routed_away_tokens, prompt)
            absent = max(0, min(target.cached_tokens, prompt) - cached)
            if away:
                self.metrics.routed_away_tokens.inc(away)
            if absent:
                self.metrics.absent_tokens.inc(absent)
        if not isinstance(params, dict):
            log.warning(
                "prefill %s answered without kv_transfer_params; decode prefills alone", target.name
            )
            self.metrics.child(self.metrics.fallbacks, "no_kv_transfer_params").inc()
            return None
        block_size = self.pool.block_size(target.name)
        missing = missing_blocks(params, block_size)
        if missing:
            self._fall_back(
                target,
                "short_block_ids",
                ValueError(f"its kv_transfer_params lack {missing} of the prompt's KV blocks"),
            )
            return None
        first = (
            first_token(reply, params, block_size, request.body) if request.wants_first else None
        )
        return _Prefilled(params, cached if isinstance(cached, int) else None, first)

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

    # ---- decode

    async def _decode(
        self, request: _Request, cell: str | None, prefilled: _Prefilled | None
    ) -> JsonReply | DecodeRelay:
        tried: list[str] = []  # ranks that failed, and every rank of a server that did not
        last: UpstreamError | None = None  # answer (they would look idle and win least loaded)
        alone_on_tried = False
        consumed = False  # an engine received the handoff: it is never sent again
        for attempt in range(_DECODE_ATTEMPTS):
            with_kv = prefilled is not None and not consumed and attempt < _DECODE_ATTEMPTS - 1
            snapshot = self.pool.snapshot()
            rank = choose_decode_rank(
                snapshot, request.key.digest + request.request_id.encode(), cell, exclude=tried
            )
            if rank is None and cell is not None:  # the cell has no rank left: any cell, alone
                rank = choose_decode_rank(snapshot, request.request_id.encode(), None, tried)
                with_kv = False
            if rank is None and prefilled is not None and attempt and not alone_on_tried:
                # Every rank failed with the KV: the pull may be what failed, so decode alone
                # once more, on a rank already tried if it is the only one.
                rank = choose_decode_rank(snapshot, request.request_id.encode(), None)
                with_kv, alone_on_tried = False, True
            if rank is None:
                break
            tried.append(rank.name)
            if attempt:
                self.metrics.child(
                    self.metrics.retries, "decode", last.reason if last else "error"
                ).inc()
                if prefilled is not None and not with_kv:
                    self.metrics.child(self.metrics.fallbacks, "decode_retry").inc()
            kv = prefilled if with_kv else None
            payload = decode_body(
                request.raw, kv.kv_transfer_params if kv else None, request.prompt
            )
            cached = kv.cached_tokens if kv is not None else None
            try:
                if request.stream:
                    return await self._open_stream(rank, request, payload, cached)
                return await self._complete(rank, request, payload, cached)
            except UpstreamStatus as exc:
                if exc.client_error:
                    return JsonReply(
                        exc.status, engine_error_body(exc.status, exc.body), request.request_id
                    )
                last = exc
            except UpstreamError as exc:
                last = exc
                # The server did not answer at all: its other ranks are as gone as this one.
                tried.extend(r.name for r in snapshot.decode if r.url == rank.url)
            consumed = consumed or (kv is not None and last.delivered)
            log.warning("decode on %s failed before the first token (%s)", rank.name, last)
            self.pool.failed(rank.name)
        if last is None:
            raise NoHealthyTarget("no healthy decode rank can take the request; see /ready")
        self.metrics.child(self.metrics.aborts, "decode", "exhausted").inc()
        raise UpstreamFailed(f"every decode attempt failed; last: {last}")

    async def _complete(
        self, rank: DecodeRankView, request: _Request, payload: bytes, cached: int | None
    ) -> JsonReply:
        self.pool.begin_decode(rank.name)
        self._placed(request)
        try:
            data, status = await self._call(
                rank.url,
                request.route,
                payload,
                engine_headers(request.request_id, rank.dp_rank),
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
        self.metrics.e2e.observe(time.perf_counter() - request.timing.started)
        return JsonReply(200, data, request.request_id)

    async def _open_stream(
        self, rank: DecodeRankView, request: _Request, payload: bytes, cached: int | None
    ) -> DecodeRelay:
        """Open the decode stream and read up to its first token; raise if it fails first."""
        self.pool.begin_decode(rank.name)
        self._placed(request)
        response: UpstreamResponse | None = None
        deadline = self._clock() + self.timeouts.first_token_s
        try:
            response = await self.upstream.post(
                rank.url,
                request.route,
                payload,
                engine_headers(request.request_id, rank.dp_rank),
                self._read_timeout,
                deadline,
            )
            if response.status != 200:
                raise UpstreamStatus("decode", response.status, await response.read_all(deadline))
            head = StreamHead()
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
            raise UpstreamTimeout(
                "decode", "no first token in time", delivered=exc.delivered
            ) from exc
        except BaseException:
            if response is not None:
                response.close()
            self.pool.end_decode(rank.name)
            raise
        timing = request.timing
        now = time.perf_counter()
        if not request.first_sent:
            timing.first_token = now
            self.metrics.ttft.observe(now - timing.started)
        self.metrics.handoff_seconds.observe(now - timing.prefill_done)
        self.pool.succeeded(rank.name)
        return DecodeRelay(
            request.route,
            request.request_id,
            timing,
            rank,
            response,
            head.buffered,
            DecodeStream(cached, answered=int(request.first_sent)),
            self.pool,
            self.metrics,
        )


class FirstTokenRelay:
    """A streamed completion whose first token came with its prefill (``router.first_token``):
    that token goes to the client at once, then the decode leg is opened, with the retries it
    has before its own first token, and relayed behind it. A decode leg that fails every
    attempt ends the stream with an SSE error event: the client already has a token."""

    __slots__ = ("_cell", "_event", "_handoff", "_prefilled", "_request")

    def __init__(
        self,
        handoff: Handoff,
        request: _Request,
        cell: str | None,
        prefilled: _Prefilled,
        event: bytes,
    ) -> None:
        self._handoff = handoff
        self._request = request
        self._cell = cell
        self._prefilled = prefilled
        self._event = event

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def pump(self, client: Sink) -> None:
        request, handoff = self._request, self._handoff
        metrics = handoff.metrics
        ended = ""  # how the stream ended before a decode relay took it over
        try:
            client.write(self._event)
            await client.drain()
            try:
                reply = await handoff._decode(request, self._cell, self._prefilled)
            except GatewayError as exc:  # every attempt failed (_decode counted the abort)
                metrics.child(metrics.requests, request.route, "stream_error").inc()
                client.write(error_event(str(exc)))
                await client.drain()
                return
            if isinstance(reply, JsonReply):  # the decode engine refused the request
                ended = "engine_error"
                client.write(b"data: " + reply.body + b"\n\n" + DONE)
                await client.drain()
                return
            ended = "relayed"
            await reply.pump(client)  # it counts the request when its stream ends
        except asyncio.CancelledError:
            ended = ended or "client_disconnect"
            raise
        finally:
            handoff._unadmit(request)
            if ended not in ("", "relayed"):
                timing = request.timing
                metrics.stream_ended(
                    request.route,
                    None,
                    ended,
                    started=timing.started,
                    first_token=timing.first_token,
                    now=time.perf_counter(),
                )


def prefill_body(
    raw: bytes, body: Mapping[str, object], prompt: bytes = b"", token_ids: bool = False
) -> bytes:
    """The prefill leg's body (step 2 of the module docstring): the client's bytes with fields
    that override its own, for one token, not streamed, the KV kept for a remote decode;
    ``prompt``, a serialized ``"prompt"`` field, over the client's (its ids); and with
    ``token_ids``, the sampled token's id asked for (``return_token_ids``)."""
    fields: dict[str, object] = {"max_tokens": 1, "stream": False}
    if token_ids:
        fields["return_token_ids"] = True
    if "max_completion_tokens" in body:
        fields["max_completion_tokens"] = 1
    if "stream_options" in body:
        fields["stream_options"] = None  # vLLM refuses them on a request that does not stream
    if "min_tokens" in body:
        fields["min_tokens"] = 0
    fields["kv_transfer_params"] = _PREFILL_KV
    return _with_fields(raw, fields, prompt)


def decode_body(
    raw: bytes, kv_transfer_params: Mapping[str, object] | None, prompt: bytes = b""
) -> bytes:
    """The decode leg's body: the client's bytes, with prefill's ``kv_transfer_params``
    (verbatim) when the KV is to be pulled, and ``prompt`` as in :func:`prefill_body`."""
    if kv_transfer_params is None and not prompt:
        return raw
    fields = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return _with_fields(raw, fields, prompt)


def continuation_body(raw: bytes, body: Mapping[str, object]) -> bytes:
    """The client's bytes as the decode leg continues them after the prefill's first token
    (``router.first_token.continuation_fields``); the prompt field goes as in
    :func:`decode_body`."""
    return _with_fields(raw, continuation_fields(body))


def missing_blocks(params: Mapping[str, object], block_size: int) -> int:
    """How many KV blocks a prefill's ``kv_transfer_params`` lack for its ``remote_num_tokens``
    at the prefill engine's ``block_size`` (0: not known yet), or 1 for params of a shape vLLM
    never writes.

    vLLM holds the whole prompt for the decode engine, one list of block ids per KV-cache group;
    a decode engine given fewer blocks than it allocates fails an assertion and dies
    (``_apply_prefix_caching`` in vLLM's NIXL connector). A group may have larger blocks than the
    engine's block size (compressed attention) or one state block (Mamba), so the largest group
    must cover the prompt at the block size, and every group must hold a block."""
    groups = params.get("remote_block_ids")
    tokens = params.get("remote_num_tokens")
    if tokens is None:
        return 0  # nothing to check against (an engine that does not say)
    if (
        not isinstance(tokens, int)
        or not isinstance(groups, list)
        or not groups
        or not all(isinstance(group, list) for group in groups)
    ):
        return 1
    if tokens <= 0:
        return 0
    needed = -(-tokens // block_size) if block_size > 0 else 1
    largest = max(len(group) for group in groups)
    return max(needed - largest, 0) or int(any(not group for group in groups))


def engine_headers(request_id: str, dp_rank: int = -1) -> dict[str, str]:
    """Both legs' headers: the request's one id, and the DP rank where the leg names one."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if dp_rank >= 0:
        headers["X-data-parallel-rank"] = str(dp_rank)
    return headers


def _with_fields(raw: bytes, fields: Mapping[str, object], serialized: bytes = b"") -> bytes:
    """The client's body, byte for byte, with ``fields`` and the ``serialized`` members after
    its own: a JSON object's last value of a key is the one read (Python's json, which vLLM's
    server parses with, orjson and pydantic), so the prompt is never serialized again for a
    leg."""
    end = raw.rindex(b"}")
    head = raw[:end].rstrip()
    members = [m for m in (orjson.dumps(fields)[1:-1], serialized) if m]
    separator = b"" if head.endswith(b"{") or not members else b","
    return head + separator + b",".join(members) + b"}"
