"""The live hazards of a P/D handoff, against real vLLM engines: what the engines do with each,
sent by hand as the gateway's two legs would, and what Baton's gateway does with it.

Run by ``baton bench gpu --step hazards`` on GPU vLLM (a lent GPU) and on the CPU build
(tests/live/test_bench_gpu.py), and case by case by the live tier's tests. Each function
returns what it observed (statuses, counters, seconds) for the caller to judge or record:

- a replayed handoff (the decode leg sent twice with the same ``kv_transfer_params``);
- a handoff naming an engine the decode engine never met;
- fewer block ids than the prompt needs (vLLM's decode engine asserts on it and dies);
- a side channel that cannot be reached (the pull cannot connect);
- a client gone mid-stream (the engine must abort the request);
- the decode engine killed mid-request (SIGKILL), behind the gateway.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.core.eplb_report import INACTIVE_PATH, REPORT_PATH
from rigs.processes import eventually, free_port

__all__ = [
    "ReportRelay",
    "RewritingProxy",
    "aborted_stream",
    "answer_with",
    "decode_killed_mid_request",
    "prompt",
    "replayed_handoff",
    "serve_on_loopback",
    "short_block_ids",
    "unknown_engine",
    "unreachable_side_channel",
    "value",
]

_WORDS = ("engine", "handoff", "balance", "prompt", "token", "cache", "decode", "prefill")
TIMEOUT_S = 300.0


def prompt(tag: str, words: int = 300) -> str:
    """A prompt of its own: ``tag``, then words of the tokenizer's picked by ``tag``'s digest
    (one token each for the benchmark's and the tiny models' tokenizers)."""
    digest = hashlib.sha256(tag.encode()).digest() * (words // 32 + 1)
    return f"{tag}: " + " ".join(_WORDS[byte % len(_WORDS)] for byte in digest[:words])


def value(url: str, name: str, **labels: str) -> float:
    """The sum of an engine's (or the gateway's) samples ``name`` whose labels include
    ``labels``, from its /metrics now."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _completion(url: str, model: str, text: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)


def _prefill(url: str, model: str, text: str) -> dict[str, Any]:
    answer = _completion(url, model, text, 1, kv_transfer_params={"do_remote_decode": True})
    answer.raise_for_status()
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


def replayed_handoff(prefill: str, decode: str, model: str) -> dict[str, Any]:
    """The decode leg sent twice with one prefill's ``kv_transfer_params``: each answer's
    status (vLLM answers both; the second finds the blocks freed and decodes what it finds)."""
    text = prompt("replayed handoff")
    params = _prefill(prefill, model, text)
    statuses = [
        _completion(decode, model, text, 4, kv_transfer_params=params).status_code for _ in range(2)
    ]
    return {"statuses": statuses}


def unknown_engine(prefill: str, decode: str, model: str) -> dict[str, Any]:
    """A handoff naming an engine the decode engine never met: its status."""
    text = prompt("unknown engine")
    params = {**_prefill(prefill, model, text), "remote_engine_id": "no-such-engine"}
    answer = _completion(decode, model, text, 4, kv_transfer_params=params)
    return {"status": answer.status_code, "decode_healthy": _healthy(decode)}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def answer_with(handler: BaseHTTPRequestHandler, answer: httpx.Response) -> None:
    """Write an engine's (or a service's) answer back to the client of a loopback proxy."""
    handler.send_response(answer.status_code)
    handler.send_header("Content-Type", answer.headers.get("content-type", "text/plain"))
    handler.send_header("Content-Length", str(len(answer.content)))
    handler.end_headers()
    handler.wfile.write(answer.content)


def serve_on_loopback(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """``handler`` served on a free loopback port from a daemon thread; the server, its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


class RewritingProxy:
    """A prefill engine as a gateway sees it through ``rewrite``: every call is passed to the
    engine at ``url``, and a prefill answer's ``kv_transfer_params`` are rewritten on the way
    back. ``close()`` when done."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.engine = url
        self.rewrite: Callable[[dict[str, Any]], None] = lambda params: None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer_with(self, httpx.get(proxy.engine + self.path, headers=self._headers()))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                answer = httpx.post(
                    proxy.engine + self.path,
                    content=body,
                    headers=self._headers(),
                    timeout=TIMEOUT_S,
                )
                if answer.status_code == 200 and "kv_transfer_params" in answer.text:
                    reply = answer.json()
                    proxy.rewrite(reply["kv_transfer_params"])
                    answer = httpx.Response(200, json=reply)
                answer_with(self, answer)

            def _headers(self) -> dict[str, str]:
                return {k: v for k, v in self.headers.items() if k.lower() != "host"}

            def log_message(self, *args: object) -> None:
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self.server.shutdown()


def _sources(decode: str) -> dict[str, float]:
    return {
        source: value(decode, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def _through(gateway: str, model: str, tag: str) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    answer = _completion(gateway, model, prompt(tag), 6, ignore_eos=True)
    return answer, time.monotonic() - began


# The gateway's fallbacks these hazards must show (baton_gateway_fallbacks_total's reasons)
SHORT, RETRY = "short_block_ids", "decode_retry"


def _rewritten(
    proxy: RewritingProxy,
    rewrite: Callable[[dict[str, Any]], None],
    gateway: str,
    decode: str,
    model: str,
    tag: str,
) -> dict[str, Any]:
    """One request through ``gateway`` while ``proxy`` rewrites the prefill answer with
    ``rewrite``: the client's status and seconds, whether the decode engine still answers,
    what it computed, and the gateway's fallbacks by reason."""

    def fallbacks() -> dict[str, float]:
        return {
            reason: value(gateway, "baton_gateway_fallbacks_total", reason=reason)
            for reason in (SHORT, RETRY)
        }

    counted, before = fallbacks(), _sources(decode)
    proxy.rewrite = rewrite
    try:
        answer, seconds = _through(gateway, model, tag)
    finally:
        proxy.rewrite = lambda params: None
    after, now = _sources(decode), fallbacks()
    return {
        "status": answer.status_code,
        "seconds": round(seconds, 3),
        "decode_healthy": _healthy(decode),
        "decode_prompt_tokens": {k: after[k] - before[k] for k in after},
        "fallbacks": {reason: now[reason] - counted[reason] for reason in now},
    }


def short_block_ids(proxy: RewritingProxy, gateway: str, decode: str, model: str) -> dict[str, Any]:
    """A prefill answer naming one block where the prompt needs several, through ``gateway``
    (whose prefill instance answers through ``proxy``): the client's status, whether the
    decode engine still answers, what it computed, and the gateway's fallback count."""

    def drop_blocks(params: dict[str, Any]) -> None:
        ids = params["remote_block_ids"]
        params["remote_block_ids"] = (
            [group[:1] for group in ids] if ids and isinstance(ids[0], list) else ids[:1]
        )

    seen = _rewritten(proxy, drop_blocks, gateway, decode, model, "short block ids")
    fallbacks = seen.pop("fallbacks")
    return {**seen, "gateway_fallbacks": fallbacks[SHORT]}


def unreachable_side_channel(
    proxy: RewritingProxy, gateway: str, decode: str, model: str
) -> dict[str, Any]:
    """A prefill answer naming a side channel nothing listens on (and an engine id decode has
    not met, so it cannot reuse a handshake), first straight to the decode engine, then
    through ``gateway``: the engine's status and seconds, then the client's, what decode
    computed, and the gateway's decode retries."""

    def closed_port(params: dict[str, Any]) -> None:
        params["remote_engine_id"] = f"moved-{params['remote_engine_id']}"
        params["remote_port"] = free_port()

    text = prompt("unreachable side channel, by hand")
    params = _prefill(proxy.engine, model, text)
    closed_port(params)
    began = time.monotonic()
    direct = _completion(decode, model, text, 4, kv_transfer_params=params)
    direct_s = time.monotonic() - began
    seen = _rewritten(proxy, closed_port, gateway, decode, model, "unreachable side channel")
    fallbacks = seen.pop("fallbacks")
    return {
        "engine_status": direct.status_code,
        "engine_seconds": round(direct_s, 3),
        **seen,
        "gateway_decode_retries": fallbacks[RETRY],
    }


def aborted_stream(url: str, decode: str, model: str, max_tokens: int) -> dict[str, Any]:
    """A client that reads a few chunks of a long stream from ``url`` (an engine, or a gateway
    in front of ``decode``) and leaves: how many tokens decode made of ``max_tokens``, whether
    its running gauge went back to 0, and whether it finished the request (it must not)."""
    generated = value(decode, "vllm:generation_tokens_total")
    finished = value(decode, "vllm:request_success_total")
    body = {
        "model": model,
        "prompt": prompt("aborted stream", 40),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as answer:
        lines = answer.iter_lines()
        started = [next(lines) for _ in range(6)]
        # the engine's gauges are published on its own beat: after the stream has started
        eventually(lambda: value(decode, "vllm:num_requests_running") >= 1, timeout=60)
    began = time.monotonic()
    eventually(lambda: value(decode, "vllm:num_requests_running") == 0, timeout=TIMEOUT_S)
    return {
        "status": answer.status_code,
        "chunks_read": len(started),
        "max_tokens": max_tokens,
        "generated": value(decode, "vllm:generation_tokens_total") - generated,
        "finished": value(decode, "vllm:request_success_total") - finished,
        "idle_after_s": round(time.monotonic() - began, 3),
        "decode_healthy": _healthy(decode),
    }


def decode_killed_mid_request(
    gateway: str,
    decodes: dict[str, int],
    model: str,
    max_tokens: int,
    after: int = 3,
) -> dict[str, Any]:
    """A long stream through ``gateway`` whose decode engine (of ``decodes``: URL -> process
    group) is killed (SIGKILL) mid-stream: what the client got (status, chunks, the last two,
    whether they carry an error event), and the statuses of ``after`` requests sent next,
    which the surviving decode engines must serve. The killed engine stays dead."""
    body = {
        "model": model,
        "prompt": prompt("killed mid-request", 40),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    chunks: list[str] = []
    killed = ""
    status: int | None = None
    error = None
    began = time.monotonic()
    try:
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=120) as answer:
            status = answer.status_code
            for line in answer.iter_lines():
                if line:
                    chunks.append(line)
                if len(chunks) == 4 and not killed:
                    running = {url: value(url, "vllm:num_requests_running") for url in decodes}
                    killed = max(running, key=lambda url: running[url])
                    os.killpg(decodes[killed], signal.SIGKILL)
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    seconds = time.monotonic() - began
    later = [
        _completion(gateway, model, prompt(f"after the kill {i}"), 6).status_code
        for i in range(after)
    ]
    return {
        "status": status,
        "killed": killed,
        "chunks": len(chunks),
        "last_chunks": [chunk[:300] for chunk in chunks[-2:]],
        # the gateway's word that the stream broke: an SSE error event before [DONE]
        "error_event": any(chunk.startswith('data: {"error"') for chunk in chunks[-2:]),
        "client_error": error,
        "stream_seconds": round(seconds, 3),
        "statuses_after": later,
    }


class ReportRelay:
    """The EPLB service at ``target`` as the engines reach it: every report passes through and
    is kept (the statuses of any the service refused too), or, while ``held``, is taken and
    never answered (a service that hangs). ``close()`` when done."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.held = False
        self.reports: list[dict[str, Any]] = []
        self.inactive: list[dict[str, Any]] = []
        self.refused: list[int] = []
        self._release = threading.Event()
        relay, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if relay.held:
                    relay._release.wait(timeout=600)
                    return
                headers = {"Content-Type": "application/json"}
                if "Authorization" in self.headers:
                    headers["Authorization"] = self.headers["Authorization"]
                answer = httpx.post(
                    relay.target + self.path, content=body, headers=headers, timeout=30
                )
                with lock:
                    if answer.status_code >= 300:
                        relay.refused.append(answer.status_code)
                    elif self.path == REPORT_PATH:
                        relay.reports.append(json.loads(body))
                    elif self.path == INACTIVE_PATH:
                        relay.inactive.append(json.loads(body))
                # an engine stopped meanwhile may have gone before its answer
                with suppress(BrokenPipeError, ConnectionResetError):
                    answer_with(self, answer)

            def log_message(self, *args: object) -> None:
                pass

        self._server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
