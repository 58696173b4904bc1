"""Posting window reports from inside an engine to the EPLB service, without ever blocking or
raising into the engine.

A bounded queue (the newest reports win: the oldest is dropped when it is full) and one daemon
thread that posts each report as JSON with the standard library's HTTP client, so the plugin
needs nothing vLLM's environment lacks. Failures are logged, the first at once and then at most
once a minute, and counted; the engine never waits for the service.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from pydantic import BaseModel

__all__ = ["Reporter"]

log = logging.getLogger("baton.eplb.reporter")
_QUEUE = 4
_TIMEOUT_S = 5.0
_LOG_EVERY_S = 60.0


class Reporter:
    """Posts reports to ``url`` + their path (``Authorization: Bearer token`` when given)."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._headers: Mapping[str, str] = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {token}"} if token else {}
        )
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(_QUEUE)
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._last_logged = -_LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name="baton-eplb-reporter", daemon=True)
        self._thread.start()

    def submit(self, path: str, report: BaseModel) -> None:
        """Queue ``report`` for ``path``; never blocks, never raises."""
        try:
            item = (path, report.model_dump_json().encode())
            while True:
                try:
                    self._queue.put_nowait(item)
                    return
                except queue.Full:
                    try:
                        self._queue.get_nowait()
                        self.dropped += 1
                    except queue.Empty:
                        pass
        except Exception:  # a report must never take the engine down
            log.exception("EPLB report not queued")

    def _run(self) -> None:
        while True:
            path, body = self._queue.get()
            request = urllib.request.Request(
                self.url + path, data=body, headers=dict(self._headers), method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
                    response.read()
                self.sent += 1
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self.failed += 1
                now = time.monotonic()
                if now - self._last_logged >= _LOG_EVERY_S:
                    self._last_logged = now
                    log.warning(
                        "EPLB report to %s failed (%s); %d failed so far",
                        self.url,
                        exc,
                        self.failed,
                    )
