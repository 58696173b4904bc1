"""The gateway's errors: what the client sees, and what an upstream failure means for a request.

::

    GatewayError                      rendered to the client as an OpenAI error body
    ├── InvalidRequest        400     the body or a parameter is wrong
    ├── Unauthorized          401     missing or wrong API key
    ├── ModelNotFound         404     the model is not served by the pool
    ├── RequestTimeout        408     the client sent its body too slowly
    ├── PayloadTooLarge       413     the body exceeds the gateway's limit
    ├── Saturated             429     every decode rank is at its bound, and none freed in time
    ├── ClientClosedRequest   499     the client went away; nothing reaches it (nginx's code)
    ├── NoHealthyTarget       503     no healthy engine, or no healthy decode target
    └── UpstreamFailed        502/504 the engines failed and every fallback was spent

    UpstreamError                     raised by calls to engines; handoff.py decides what follows
    ├── UpstreamStatus                the engine answered with a non-2xx status (body kept)
    ├── UpstreamTimeout               a phase's timeout passed
    └── UpstreamUnavailable           connection refused, reset, or the stream broke

``router/upstream.py``, the engines' client, raises the upstream errors itself.
"""

from __future__ import annotations

import orjson

__all__ = [
    "ClientClosedRequest",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "NoHealthyTarget",
    "PayloadTooLarge",
    "RequestTimeout",
    "Saturated",
    "Unauthorized",
    "UpstreamError",
    "UpstreamFailed",
    "UpstreamStatus",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "engine_error_body",
    "error_body",
]


def error_body(
    message: str, kind: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    """An OpenAI error body."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def engine_error_body(status: int, body: bytes) -> bytes:
    """An engine's error body as the client gets it: as written when it is an OpenAI error
    object, else (a proxy's or server's plain text) wrapped into one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return body
    text = body.decode("utf-8", "replace").strip()[:1024] or f"the engine answered {status}"
    return error_body(text, "invalid_request_error" if status < 500 else "server_error", status)


class GatewayError(Exception):
    """An error the client sees, with its HTTP status and OpenAI error fields."""

    status = 500
    kind = "server_error"
    code: str | None = None
    # The request's bytes left on the connection cannot be framed: answer and close it.
    closes_connection = False

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.kind, self.code, self.param)

    def headers(self) -> dict[str, str]:
        """Response headers the error's status calls for."""
        return {"Connection": "close"} if self.closes_connection else {}


class InvalidRequest(GatewayError):
    """The request body or a parameter is invalid."""

    status = 400
    kind = "invalid_request_error"


class Unauthorized(GatewayError):
    """The API key is missing or not one of the configured keys."""

    status = 401
    kind = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    """The requested model is not served by any engine in the pool."""

    status = 404
    kind = "invalid_request_error"
    code = "model_not_found"


class RequestTimeout(GatewayError):
    """The client stopped sending its body: the connection is not held for it."""

    status = 408
    kind = "invalid_request_error"
    code = "request_timeout"
    closes_connection = True  # the rest of the body may yet come, and is no next request


class ClientClosedRequest(GatewayError):
    """The client disconnected before its answer; the upstream work was abandoned."""

    status = 499
    kind = "invalid_request_error"
    code = "client_closed_request"


class PayloadTooLarge(GatewayError):
    """The request body is larger than the gateway accepts."""

    status = 413
    kind = "invalid_request_error"
    code = "request_too_large"


class Saturated(GatewayError):
    """Every decode rank the request could go to holds its bound of requests, and none freed a
    place within the wait: come back later (the OpenAI clients retry a 429 after
    ``Retry-After``)."""

    status = 429
    kind = "requests"  # OpenAI's type for a request-rate limit
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NoHealthyTarget(GatewayError):
    """No healthy prefill or decode target could take the request."""

    status = 503
    kind = "service_unavailable"
    code = "no_healthy_target"


class UpstreamFailed(GatewayError):
    """Every target and fallback failed before the first byte reached the client."""

    status = 502
    kind = "server_error"
    code = "upstream_failed"


class UpstreamError(Exception):
    """A call to an engine failed; ``phase`` names the leg (prefill or decode). ``delivered``
    is false only when no connection to the engine was made, so it received nothing."""

    reason = "error"

    def __init__(self, phase: str, detail: str, *, delivered: bool = True) -> None:
        super().__init__(f"{phase}: {detail}")
        self.phase = phase
        self.detail = detail
        self.delivered = delivered


class UpstreamStatus(UpstreamError):
    """The engine answered with a non-2xx status; ``body`` is its error body, verbatim."""

    reason = "status"

    def __init__(self, phase: str, status: int, body: bytes) -> None:
        super().__init__(phase, f"HTTP {status}")
        self.status = status
        self.body = body

    @property
    def client_error(self) -> bool:
        return 400 <= self.status < 500


class UpstreamTimeout(UpstreamError):
    """The phase's timeout passed before the engine answered."""

    reason = "timeout"


class UpstreamUnavailable(UpstreamError):
    """The connection was refused or reset, or the stream broke."""

    reason = "connection"
