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
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from router.discovery import DeploymentWatch, watch_pool_file
from router.errors import (
    ClientClosedRequest,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyTarget,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    error_body,
)
from router.handoff import Handoff, JsonReply
from router.kv_subscriber import KVEventSubscriber
from router.metrics import CHAT_ROUTE, COMPLETIONS_ROUTE, GatewayMetrics
from router.pool import Pool
from router.prober import Prober
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.relay import SERVER_SEND, RelayResponse
from router.settings import GatewayConfig, GatewaySettings
from router.targets import PoolCell
from router.tokens import load_tokenizer
from router.upstream import UpstreamPool

__all__ = ["Gateway", "create_app", "create_gateway"]

log = logging.getLogger("baton.gateway")

Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


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
            scope[SERVER_SEND] = send
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


def create_gateway(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> Gateway:
    """The app ``baton gateway`` serves (see :class:`Gateway`)."""
    api = _Api(config, metrics or GatewayMetrics())
    return Gateway(
        _fastapi(api), {CHAT_ROUTE: api.chat_completions, COMPLETIONS_ROUTE: api.completions}
    )


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    """The FastAPI app alone (Ray Serve's ingress, tests)."""
    return _fastapi(_Api(config, metrics or GatewayMetrics()))


# --- one request's steps, as functions -----------------------------------------------------------


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers as one dict, built once: a handler reads a dozen of them (session
    headers, key, length, request id), and starlette's Headers scans the list per lookup. The
    first of a repeated header wins, as with starlette's ``get``."""
    headers: dict[str, str] = {}
    for name, value in reversed(scope["headers"]):
        headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


def authenticate(keys: tuple[bytes, ...], headers: Mapping[str, str]) -> None:
    """Unauthorized unless ``headers`` carry one of ``keys`` as a bearer token (no keys: open)."""
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


def runnable(body: Mapping[str, Any], context_length: int | None) -> None:
    """InvalidRequest for what every engine would refuse, found before a prefill is spent on it
    (and its KV held for the decode that never comes): more output tokens asked for than the
    model's context holds, whatever the prompt."""
    if context_length is None:
        return
    for field in ("max_completion_tokens", "max_tokens"):
        requested = body.get(field)
        if isinstance(requested, int) and requested >= context_length:
            raise InvalidRequest(
                f"'{field}' is too large: {requested}. This model's maximum context length is "
                f"{context_length} tokens, prompt included",
                param=field,
            )


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` when it is one an engine takes (1-256 visible ASCII
    characters: it is forwarded, and one an engine cannot parse would fail there and count
    against a healthy engine), else a new one."""
    given = headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise InvalidRequest(
            "X-Request-Id must be 1 to 256 visible ASCII characters (letters, digits, "
            "punctuation); leave it out and the gateway makes one",
            param="X-Request-Id",
        )
    return given


async def read_body(
    request: Request,
    headers: Mapping[str, str],
    model: type[BaseModel],
    settings: GatewaySettings,
) -> tuple[dict[str, Any], bytes]:
    """The body as a dict and as the client's exact bytes, validated against ``model``; every
    problem is a GatewayError (InvalidRequest, PayloadTooLarge, RequestTimeout,
    ClientClosedRequest)."""
    max_bytes = settings.max_body_bytes
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {settings.body_timeout_s:g} s"
        ) from None
    except ClientDisconnect:
        raise ClientClosedRequest("the client disconnected while sending its body") from None
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
            "kv_transfer_params is set by the gateway, not by clients", param="kv_transfer_params"
        )
    return body, raw


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (every
    engine call it has open is closed, so the engines abort the request and free its KV) and
    ClientClosedRequest is raised. Called once the body is read, when the next message the
    server has for the request is its disconnect."""
    serving = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((serving, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        serving.cancel()
        raise
    finally:
        gone.cancel()
    if not serving.done():
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError, GatewayError):
            await serving
        raise ClientClosedRequest("the client disconnected before its answer")
    return serving.result()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _outcome(exc: GatewayError) -> str:
    """A refused request (bad input, key, model: the client's to fix) is not a gateway error."""
    return "error" if exc.status >= 500 else "rejected"


def _error(exc: GatewayError) -> Response:
    return Response(
        exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers()
    )


# --- the endpoints -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Route:
    """One source of engines and what routes over it: a ModelDeployment's (``deployment``,
    NAMESPACE/NAME) or the flags' and pool file's (``deployment`` empty). Each has a pool of
    its own, so one model's engines in trouble (panic, the admission bound) never touch
    another's."""

    deployment: str
    pool: Pool
    prober: Prober
    metrics: GatewayMetrics
    handoff: Handoff | None = None  # built in the lifespan, on the loop


class _Api:
    """The gateway's collaborators and its endpoints. The pools exist from the start (targets
    and health); the engines' client and the handoffs are built in the lifespan, on the loop."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.keys = tuple(key.encode() for key in config.api_keys)
        if not self.keys:
            log.warning(
                "no API keys: every client is served without authentication (give --api-key, "
                "--api-key-file or BATON_API_KEYS)"
            )
        if config.model_deployments:
            self.routes = [self._route(ref.key, ()) for ref in config.model_deployments]
        else:
            self.routes = [self._route("", config.pool.cells if config.pool is not None else ())]
        self._shared: set[str] = set()  # models served by several routes, told once each
        settings = config.settings
        self.tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
        if self.tokenizer is None and any(
            cell.kv_events for cell in (config.pool.cells if config.pool else ())
        ):
            log.warning(
                "the pool names KV event publishers, but without --tokenizer they cannot be "
                "read: prompts are keyed by their bytes"
            )

    def _route(self, deployment: str, cells: Sequence[PoolCell]) -> _Route:
        settings = self.config.settings
        metrics = self.metrics.for_deployment(deployment)
        pool = Pool(
            cells,
            clock=time.monotonic,
            stall_after_s=settings.stall_after_s,
            max_requests_per_rank=settings.max_requests_per_rank,
            kv_events_port=settings.kv_events_port,
            prefix_index_blocks=settings.prefix_index_blocks,
        )

        def ejected(url: str, reason: str, panic: bool) -> None:
            self._ejected(route, url, reason, panic)

        prober = Prober(
            pool,
            probe_interval_s=settings.health_interval_s,
            on_missed_probe=lambda url: metrics.child(metrics.missed_health_checks, url).inc(),
            on_ejected=ejected,
        )
        route = _Route(deployment, pool, prober, metrics)
        return route

    def _subscriber(self, route: _Route) -> KVEventSubscriber:
        metrics = route.metrics
        return KVEventSubscriber(
            route.pool,
            refresh_s=self.config.settings.health_interval_s,
            on_batch=lambda outcome: metrics.child(metrics.kv_event_batches, outcome).inc(),
            on_gap=lambda: metrics.child(metrics.kv_event_gaps).inc(),
        )

    def _ejected(self, route: _Route, url: str, reason: str, panic: bool) -> None:
        """An engine server left a pool: count it, and send the requests that wait on it for
        an answer elsewhere now (a frozen engine would hold them to their timeouts), unless
        its pool is in panic, where every other target looks no better."""
        route.metrics.child(route.metrics.ejections, reason).inc()
        if route.handoff is not None and not panic:
            given_up = route.handoff.upstream.abandon(url, reason.replace("_", " "))
            if given_up:
                log.warning("%d requests waiting on %s sent elsewhere", given_up, url)

    def served(self) -> tuple[str, ...]:
        """Every model a healthy engine serves, in the order of the routes."""
        names: dict[str, None] = {}
        for route in self.routes:
            names.update(dict.fromkeys(route.pool.models))
        return tuple(names)

    def route_for(self, model: str) -> _Route:
        """The route whose pool serves ``model``: the first, when several do (a model is one
        deployment's; two serving one name is a configuration to fix, told once).
        ModelNotFound when none does; NoHealthyTarget when its engines are all down, or no
        engine answers at all yet."""
        found = [route for route in self.routes if route.pool.serves(model)]
        if not found:
            served = self.served()
            if not served:  # engines are configured but none is healthy: come back later
                raise NoHealthyTarget("no healthy engine serves any model; see /ready")
            raise ModelNotFound(
                f"model '{model}' is not served; served: {', '.join(served)}", param="model"
            )
        if len(found) > 1 and model not in self._shared:
            self._shared.add(model)
            log.error(
                "model %s is served by %s; routing it to %s alone: give each ModelDeployment "
                "a servedModelName of its own",
                model,
                " and ".join(route.deployment or "the pool" for route in found),
                found[0].deployment,
            )
        if model not in found[0].pool.models:
            raise NoHealthyTarget(
                f"no healthy engine serves model '{model}' now ({found[0].deployment}); see /ready"
            )
        return found[0]

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        settings = self.config.settings
        timeouts = settings.timeouts()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s)
        credentials = self.config.engine_headers
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, headers=credentials
        ) as session:
            upstream = UpstreamPool(timeouts.connect_s, credentials)
            policy = settings.routing_policy()
            for route in self.routes:
                route.handoff = Handoff(
                    route.prober,
                    upstream,
                    policy,
                    route.metrics,
                    timeouts,
                    self.tokenizer,
                    first_from_prefill=settings.first_token_from_prefill,
                )
            await asyncio.gather(*(route.prober.start(session) for route in self.routes))
            loop = asyncio.get_running_loop()
            tasks = []
            subscribers = [
                self._subscriber(route) for route in self.routes if self.tokenizer is not None
            ]
            for subscriber in subscribers:
                subscriber.start()
            if self.config.pool_file is not None:
                prober = self.routes[0].prober
                tasks.append(loop.create_task(watch_pool_file(self.config.pool_file, prober)))
            watches = [
                DeploymentWatch(ref, route.prober, loop)
                for ref, route in zip(self.config.model_deployments, self.routes, strict=False)
            ]
            for watch in watches:
                watch.start()
            if self.metrics.multiprocess:
                # A scrape reaches one worker: each keeps its pools' gauges current in its file.
                tasks.append(loop.create_task(self._publish_pool_gauges()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                for watch in watches:
                    watch.stop()
                for route in self.routes:
                    await route.prober.stop()
                for subscriber in subscribers:
                    await subscriber.stop()
                upstream.close()

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT_ROUTE, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS_ROUTE, CompletionRequest)

    async def _generate(self, request: Request, path: str, model: type[BaseModel]) -> Response:
        headers = header_map(request.scope)
        authenticate(self.keys, headers)
        metrics = self.metrics  # until the request's model names its deployment
        try:
            request_id = request_id_of(headers)
            body, raw = await read_body(request, headers, model, self.config.settings)
            route = self.route_for(body["model"])
            metrics = route.metrics
            runnable(body, route.pool.context_length(body["model"]))
        except ClientClosedRequest:
            metrics.child(metrics.aborts, "upload", "client_disconnect").inc()
            metrics.child(metrics.requests, path, "client_disconnect").inc()
            raise
        except GatewayError as exc:
            metrics.child(metrics.requests, path, _outcome(exc)).inc()
            raise
        assert route.handoff is not None  # built before the server takes requests
        try:
            reply = await _unless_disconnected(
                request.receive, route.handoff.serve(path, body, raw, headers, request_id)
            )
        except ClientClosedRequest:
            metrics.child(metrics.aborts, "before_first_token", "client_disconnect").inc()
            metrics.child(metrics.requests, path, "client_disconnect").inc()
            raise
        except GatewayError as exc:
            metrics.child(metrics.requests, path, _outcome(exc)).inc()
            raise
        if isinstance(reply, JsonReply):
            outcome = "ok" if reply.status == 200 else "engine_error"
            metrics.child(metrics.requests, path, outcome).inc()
            return Response(
                reply.body,
                status_code=reply.status,
                media_type="application/json",
                headers={"X-Request-Id": reply.request_id},
            )
        return RelayResponse(reply)  # the relay counts the request when its stream ends

    async def models(self, request: Request) -> Response:
        authenticate(self.keys, request.headers)
        data = [{"id": name, "object": "model", "owned_by": "baton"} for name in self.served()]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    async def health(self) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def ready(self) -> Response:
        """Ready while a healthy decode target serves known models, in any pool: one model's
        engines down must not take the others' out of the gateway Service. With no healthy
        prefill instance decode serves alone, so the gateway still takes requests (and says
        so); pools that cannot serve are named."""
        ready = [route for route in self.routes if route.pool.ready()]
        if not ready:
            return _error(
                _NotReady(
                    "not ready: no healthy decode target serves a known model; check the pool "
                    "and the engines' /health"
                )
            )
        status: dict[str, str] = {"status": "ready"}
        healthy = total = 0
        for route in ready:
            up, configured = route.pool.prefill_health()
            healthy, total = healthy + up, total + configured
        if total and not healthy:
            status["prefill"] = f"0 of {total} healthy; decode serves alone"
        down = [route.deployment for route in self.routes if route not in ready]
        if down:
            status["not_serving"] = ", ".join(down)
        return Response(orjson.dumps(status), media_type="application/json")

    def _set_pool_gauges(self) -> None:
        self.metrics.set_pool_gauges({route.deployment: route.pool for route in self.routes})

    async def _publish_pool_gauges(self) -> None:
        while True:
            self._set_pool_gauges()
            await asyncio.sleep(self.config.settings.health_interval_s)

    async def prometheus(self) -> Response:
        # set per scrape, so targets that left a pool leave the gauges too
        self._set_pool_gauges()
        return Response(generate_latest(self.metrics.exposed), media_type=CONTENT_TYPE_LATEST)


async def _gateway_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _error(exc)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _error(InvalidRequest(str(exc.errors()[0].get("msg", exc))))


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return Response(
        error_body(str(exc.detail), kind),
        status_code=exc.status_code,
        media_type="application/json",
    )


def _fastapi(api: _Api) -> FastAPI:
    """The FastAPI app serving ``api``'s endpoints, with OpenAI error bodies for every error."""
    app = FastAPI(
        title="Baton gateway",
        version="0.1.0",
        lifespan=api.lifespan,
        summary="OpenAI-compatible API with P/D routing over vLLM engines",
    )
    app.post(CHAT_ROUTE, openapi_extra=_body_schema(ChatCompletionRequest), responses=_ERRORS)(
        api.chat_completions
    )
    app.post(COMPLETIONS_ROUTE, openapi_extra=_body_schema(CompletionRequest), responses=_ERRORS)(
        api.completions
    )
    app.get("/v1/models", responses=_ERRORS)(api.models)
    app.get("/health")(api.health)
    app.get("/ready", responses={503: {"description": "no healthy decode target"}})(api.ready)
    app.get("/metrics")(api.prometheus)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
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

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented customisation
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
        (408, "the body did not arrive within the body timeout"),
        (413, "body too large"),
        (502, "every engine attempt failed"),
        (503, "no healthy engine, or no healthy decode target"),
    )
}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "x-baton-definitions": definitions,
    }
