"""The gateway's HTTP API: OpenAI-compatible, validated, authenticated; routing is handoff.py's.

``create_app`` builds a FastAPI app whose lifespan creates the engines' client (keep-alive
connections, ``router/upstream.py``), the pool (with an aiohttp session for its health and load
probes) and the handoff, and passes them to the handlers; nothing lives in a global. Requests
are parsed with orjson and validated with pydantic; fields the gateway does not know (vLLM
extensions) pass through untouched, and the decode leg gets the client's exact bytes.
Every error is an OpenAI error body with its status; FastAPI's 422 is answered as 400.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from baton.follow import DeploymentRef
from router.discovery import DeploymentWatch, watch_pool_file
from router.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    Unauthorized,
    error_body,
)
from router.handoff import DecodeRelay, Handoff, JsonReply, Timeouts
from router.metrics import GatewayMetrics
from router.policy import RoutingPolicy
from router.pool import Pool, PoolSpec
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.upstream import UpstreamPool

__all__ = ["Gateway", "GatewayConfig", "create_app", "create_gateway"]

log = logging.getLogger("baton.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    pool: PoolSpec | None  # None: the pool comes from model_deployment's status
    api_keys: tuple[str, ...] = ()
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_body_bytes: int = 32 * 1024 * 1024
    health_interval_s: float = 2.0
    load_sync_interval_s: float = 2.0
    pool_file: Path | None = None  # reloaded when it changes
    model_deployment: DeploymentRef | None = None


class _UvicornWriter:
    """Writes a relay's bytes to uvicorn's transport as it would (HTTP/1.1 chunked), without
    a coroutine per chunk: the engine connection's callback writes to the client at once.
    Used only when uvicorn's response cycle is what sends (``_uvicorn_cycle``)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def write_now(self, data: bytes) -> None:
        cycle = self._cycle
        if not cycle.disconnected:  # the disconnect watcher ends the relay
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def blocked(self) -> bool:
        return self._cycle.flow.write_paused

    async def drain(self) -> None:
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()


class _AsgiWriter:
    """Any other ASGI server (Ray Serve's proxy, test clients): bytes are buffered and sent
    by the relaying task, one ``send`` per received segment."""

    __slots__ = ("_buffer", "_send")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._buffer = bytearray()

    def write_now(self, data: bytes) -> None:
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

    Starlette's StreamingResponse would add an async generator and a task group per request;
    here, under uvicorn, each segment the engine sends is written to the client from the
    engine connection's callback (no task wakes per chunk); elsewhere each becomes one
    ``send``. A watcher ends the relay when the client disconnects, which closes the upstream
    request so the engines abort it.
    """

    media_type = "text/event-stream"

    def __init__(self, relay: DecodeRelay) -> None:
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
        server_send = scope.get(_SERVER_SEND, send)
        pump = asyncio.current_task()
        assert pump is not None
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            pump.cancel()

        cycle = _uvicorn_cycle(server_send)
        client = _UvicornWriter(cycle) if cycle is not None else _AsgiWriter(server_send)
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


_SERVER_SEND = "baton.server_send"


Endpoint = Callable[[Request], Awaitable[Response]]


class Gateway:
    """The ASGI app ``baton gateway`` serves: the FastAPI app, with a short path for generation.

    ``POST /v1/chat/completions`` and ``/v1/completions`` go straight to the same endpoint
    functions FastAPI registers (documented in its OpenAPI), skipping FastAPI's middleware and
    routing layers, which cost as much CPU per request as the P/D sequence itself. Everything
    else, lifespan included, is the FastAPI app's. The relay's body chunks are written with the
    server's own ``send``. Under Ray Serve the FastAPI app serves alone, through the same code.
    """

    def __init__(self, app: FastAPI, endpoints: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http":
            scope[_SERVER_SEND] = send
            if scope["method"] == "POST":
                endpoint = self.endpoints.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive))
        except GatewayError as exc:
            response = _error(exc)
        except Exception:
            log.exception("unexpected error serving %s", scope["path"])
            response = _error(GatewayError("internal error in the gateway; see its log"))
        await response(scope, receive, send)


def _header_map(scope: Scope) -> dict[str, str]:
    """The request's headers as one dict, built once: a handler reads a dozen of them (session
    headers, key, length, request id), and starlette's Headers scans the list per lookup. The
    first of a repeated header wins, as with starlette's ``get``."""
    headers: dict[str, str] = {}
    for name, value in reversed(scope["headers"]):
        headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


def _error(exc: GatewayError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json")


class _Services:
    """What the lifespan builds and the handlers use."""

    pool: Pool
    handoff: Handoff


def create_gateway(config: GatewayConfig) -> Gateway:
    """The app ``baton gateway`` serves (see :class:`Gateway`)."""
    app = create_app(config)
    return Gateway(app, app.state.endpoints)


def create_app(
    config: GatewayConfig, metrics: GatewayMetrics | None = None, pool: Pool | None = None
) -> FastAPI:
    metrics = metrics or GatewayMetrics()
    services = _Services()
    services.pool = pool or Pool(
        config.pool.cells if config.pool is not None else (),
        health_interval_s=config.health_interval_s,
        load_sync_interval_s=config.load_sync_interval_s,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.timeouts.connect_s)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            upstream = UpstreamPool(config.timeouts.connect_s)
            services.handoff = Handoff(
                services.pool, upstream, config.policy, metrics, config.timeouts
            )
            await services.pool.start(session)
            watcher = None
            if config.pool_file is not None:
                watcher = asyncio.get_running_loop().create_task(
                    watch_pool_file(config.pool_file, services.pool)
                )
            deployment = None
            if config.model_deployment is not None:
                deployment = DeploymentWatch(
                    config.model_deployment, services.pool, asyncio.get_running_loop()
                )
                deployment.start()
            try:
                yield
            finally:
                if watcher is not None:
                    watcher.cancel()
                if deployment is not None:
                    deployment.stop()
                await services.pool.stop()
                upstream.close()

    app = FastAPI(
        title="Baton gateway",
        version="0.1.0",
        lifespan=lifespan,
        summary="OpenAI-compatible API with P/D routing over vLLM engines",
    )
    keys = tuple(key.encode() for key in config.api_keys)

    def authenticate(headers: Mapping[str, str]) -> None:
        if not keys:
            return
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare against every key (no early exit) in constant time per key
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>'")

    async def read_body(
        request: Request, headers: Mapping[str, str], model: type[BaseModel]
    ) -> tuple[dict[str, Any], bytes]:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        try:
            model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise InvalidRequest(f"{where}: {first['msg']}", param=where) from exc
        if "kv_transfer_params" in body:
            raise InvalidRequest(
                "kv_transfer_params is set by the gateway, not by clients",
                param="kv_transfer_params",
            )
        served = services.pool.models
        if body["model"] not in served:
            raise ModelNotFound(
                f"model '{body['model']}' is not served; served: "
                f"{', '.join(served) or 'none (no healthy engine)'}",
                param="model",
            )
        return body, raw

    async def generate(request: Request, route: str, model: type[BaseModel]) -> Response:
        headers = _header_map(request.scope)
        authenticate(headers)
        body, raw = await read_body(request, headers, model)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        requests = metrics.requests
        try:
            reply = await services.handoff.serve(route, body, raw, headers, request_id)
        except GatewayError:
            metrics.child(requests, route, "error").inc()
            raise
        if isinstance(reply, JsonReply):
            metrics.child(requests, route, "ok" if reply.status == 200 else "engine_error").inc()
            return Response(
                reply.body,
                status_code=reply.status,
                media_type="application/json",
                headers={"X-Request-Id": reply.request_id},
            )
        metrics.child(requests, route, "ok").inc()
        return RelayResponse(reply)

    @app.post(
        "/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest), responses=_ERRORS
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest), responses=_ERRORS)
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions", CompletionRequest)

    @app.get("/v1/models", responses=_ERRORS)
    async def models(request: Request) -> Response:
        authenticate(request.headers)
        data = [
            {"id": name, "object": "model", "owned_by": "baton"} for name in services.pool.models
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/ready", responses={503: {"description": "no healthy prefill or decode target"}})
    async def ready() -> Response:
        if services.pool.ready():
            return Response(b'{"status":"ready"}', media_type="application/json")
        return _error(
            _NotReady(
                "not ready: needs at least one healthy prefill and one healthy "
                "decode target; check the pool and the engines' /health"
            )
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        # rebuilt per scrape, so targets that left the pool leave the gauges too
        metrics.in_flight.clear()
        metrics.peer_in_flight.clear()
        for name, count in services.pool.in_flight().items():
            role = "prefill" if name in services.pool.prefill else "decode"
            metrics.in_flight.labels(role, name).set(count)
        for name, count in services.pool.peer_in_flight().items():
            metrics.peer_in_flight.labels(name).set(count)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error(InvalidRequest(str(exc.errors()[0].get("msg", exc))))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return Response(
            error_body(str(exc.detail), kind),
            status_code=exc.status_code,
            media_type="application/json",
        )

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # Request bodies are validated by hand (orjson + pydantic); their nested models are
        # registered here so the document's references resolve.
        if app.openapi_schema is None:
            schema = default_openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for operations in schema["paths"].values():
                for operation in operations.values():
                    components.update(operation.pop("x-baton-definitions", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.pool = services.pool  # for tests and the Ray Serve wrapper
    app.state.endpoints = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
    }  # for Gateway's short path
    return app


class _NotReady(GatewayError):
    status = 503
    kind = "service_unavailable"
    code = "not_ready"


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "content": {"application/json": {}}}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or invalid API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (502, "every engine attempt failed"),
        (503, "no healthy target"),
    )
}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "x-baton-definitions": definitions,
    }
