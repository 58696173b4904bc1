"""What ``baton gateway`` adds to uvicorn's HTTP/1.1 protocol before a request reaches the app.

uvicorn's httptools protocol bounds neither a request's header bytes nor the time a client may
take to send them: one 64 MiB header blocked the event loop for seconds (the parser joins a
header's pieces as they come), and a connection that sends nothing, or half a header, was held
forever. :func:`gateway_http_protocol` returns the protocol with both bounds, the way servers in
front of the internet have them (nginx, Go's ``ReadHeaderTimeout``):

- more than ``max_header_bytes`` before the headers end: 431, and the connection is closed;
- headers not complete ``header_timeout_s`` after the connection opened or the request's first
  byte: 408 (nothing if not a byte came), and the connection is closed.

A slow body is the app's to bound (``--body-timeout``, ``router/app.py``); an idle kept-alive
connection is uvicorn's (``timeout_keep_alive``, from ``--keep-alive-timeout``).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import error_body
from router.settings import GatewaySettings

__all__ = ["gateway_http_protocol"]

log = logging.getLogger("baton.gateway.server")

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_LINGER_S = 2.0


class _BoundedHeaders(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._awaiting_headers = True
        self._began = False  # a request's first byte has come
        self._refused = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the close, so the client can read the refusal
        super().data_received(data)
        # Counted once the parser has seen the bytes: a chunk that completes the headers (and
        # may carry a large body after them) is not a header's.
        if self._awaiting_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._refuse(431, f"request headers exceed {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = self._began = True
        self._header_bytes = 0
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self.transport.is_closing():
            return
        if self._began:
            self._refuse(408, f"request headers not complete within {self.header_timeout_s:g} s")
        else:
            self.transport.close()  # a connection that never sent a byte gets none back

    def _refuse(self, status: int, message: str) -> None:
        log.warning("%s: %s; connection closed", self._peer(), message)
        self._disarm_header_timer()
        body = error_body(message, "invalid_request_error", f"http_{status}")
        self.transport.write(
            b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (status, _REASONS[status], len(body), body)
        )
        # A close with the client's bytes unread resets the connection, and the client may
        # lose the answer with it: end the writing side, drop what still comes, close later.
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def gateway_http_protocol(settings: GatewaySettings) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``settings``' header bounds (see the module)."""
    return type(
        "GatewayHttpProtocol",
        (_BoundedHeaders,),
        {
            "max_header_bytes": settings.max_header_bytes,
            "header_timeout_s": settings.header_timeout_s,
        },
    )
