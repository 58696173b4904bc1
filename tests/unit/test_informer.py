"""controller/runtime.py's informer against the watch protocol's wire format: the real
``kubernetes`` client reading a list and a chunked watch stream from a loopback HTTP server.

The API server's watch stream can carry an empty line between events (the client then yields
``None``) and ends an expired version with an ERROR event (the client raises it); a fresh-clone CI
saw the first kill the controller's node informer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from controller.runtime import Informer
from rigs.processes import eventually


def _node(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}}


class ApiServer(ThreadingHTTPServer):
    """Serves ``/api/v1/nodes``: each list returns ``listing``, each watch writes ``watch`` (lines,
    empty ones included) as one chunk each and ends."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.listing: list[dict[str, Any]] = [_node("tray-0", "1")]
        self.watch: list[str] = []
        self.lists = 0
        self.watches = 0


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)
        if query.get("watch") == ["true"]:
            self.server.watches += 1
            lines = self.server.watch if self.server.watches == 1 else []
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in lines:
                data = (line + "\n").encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.server.lists += 1
        body = json.dumps(
            {"kind": "NodeList", "metadata": {"resourceVersion": "1"}, "items": self.server.listing}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = ApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _informer(server: ApiServer, events: list[tuple[str, str]]) -> tuple[Informer, threading.Event]:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    core = client.CoreV1Api(client.ApiClient(configuration))

    def on_event(kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        events.append((kind, (new or old or {}).get("metadata", {}).get("name", "")))

    informer = Informer("nodes", core.list_node, on_event)
    stop = threading.Event()
    threading.Thread(target=informer.run, args=(stop,), daemon=True).start()
    return informer, stop


def test_an_empty_line_in_the_watch_stream_is_skipped_and_the_next_event_arrives(
    api: ApiServer,
) -> None:
    api.watch = ["", json.dumps({"type": "ADDED", "object": _node("tray-1", "2")})]
    events: list[tuple[str, str]] = []
    informer, stop = _informer(api, events)
    try:
        eventually(lambda: ("ADDED", "tray-1") in events, 30)
        assert sorted(item["metadata"]["name"] for item in informer.items()) == ["tray-0", "tray-1"]
        assert api.lists == 1, "the informer relisted: the empty line broke its watch"
    finally:
        stop.set()


def test_an_expired_version_relists_and_reports_what_changed_meanwhile(api: ApiServer) -> None:
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    api.watch = [json.dumps({"type": "ERROR", "object": gone})]
    events: list[tuple[str, str]] = []
    informer, stop = _informer(api, events)
    try:
        eventually(lambda: informer.synced.is_set(), 30)
        api.listing = [_node("tray-1", "3")]  # tray-0 went while the watch was expired
        eventually(lambda: api.lists >= 2, 30)
        eventually(lambda: ("DELETED", "tray-0") in events, 30)
        assert ("ADDED", "tray-1") in events
    finally:
        stop.set()
