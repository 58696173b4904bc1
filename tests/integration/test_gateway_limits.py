"""``baton gateway`` against clients that misbehave or leave: bounded headers, bodies and idle
connections, request ids it will not forward, and upstream work abandoned the moment a client
goes. Real ``baton sim`` engines and raw sockets on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import SimHandle, eventually, scrape
from tests.integration.test_gateway import LONG, MODEL, Stack, chat, start_engine

CHAT = b'{"model": "dsv4", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}'


@pytest.fixture
def stack(start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]) -> Stack:
    prefill, decode = start_engine(start_sim), start_engine(start_sim)
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--prefill={prefill.url}",
        f"--decode={decode.url}",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    )
    return Stack(gateway, [prefill], decode)


def raw(stack: Stack, data: bytes, *, then_wait: bool = True) -> bytes:
    """Send ``data`` on a fresh connection and read until the gateway closes it (bounded: a
    request the gateway answers normally must ask for the close, ``Connection: close``)."""
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=15) as connection:
        # Refused before it all went: the answer is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            connection.sendall(data)
        received = b""
        while then_wait:
            chunk = connection.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def one_answer(connection: socket.socket) -> bytes:
    """One whole HTTP answer with a Content-Length from a kept-alive connection, however the
    bytes arrive (a busy host splits the head from the body)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed mid-answer: {received!r}"
        received += chunk
    head_part, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head_part.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = connection.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return head_part + b"\r\n\r\n" + body


def head(path: str = "/v1/chat/completions", length: int = len(CHAT), **extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Authorization: Bearer k"]
    lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def leave_after_a_second(stack: Stack, body: dict[str, object]) -> None:
    """POST a completion and hang up when no answer has come within a second."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{stack.gateway.url}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer k"},
            timeout=httpx.Timeout(30, read=1),
        )


def test_a_huge_header_is_refused_with_431_and_the_gateway_keeps_serving(stack: Stack) -> None:
    answer = raw(stack, head(X_Padding="x" * (4 * 1024 * 1024)) + CHAT)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b'"type":"invalid_request_error"' in answer
    assert chat(stack, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        (b"", None),  # connected, never a byte: closed with nothing said
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n", b"408"),  # half a head
    ],
    ids=["silent", "half-head"],
)
def test_a_connection_that_stalls_before_its_head_ends_is_closed(
    stack: Stack, sent: bytes, status: bytes | None
) -> None:
    answer = raw(stack, sent)
    if status is None:
        assert answer == b""
    else:
        assert answer.startswith(b"HTTP/1.1 " + status)


def test_a_body_that_stops_coming_gets_408(stack: Stack) -> None:
    answer = raw(stack, head(length=1000) + CHAT[:10])
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in answer


def test_a_client_gone_while_uploading_is_counted_and_logged_quietly(stack: Stack) -> None:
    raw(stack, head(length=100_000) + CHAT[:10], then_wait=False)
    eventually(
        lambda: stack.gateway_metric("baton_gateway_aborts_total", phase="upload") == 1,
        timeout=30,
    )
    assert "Traceback" not in stack.gateway.log() and " ERROR " not in stack.gateway.log()


@pytest.mark.parametrize(
    "request_id",
    [b"\xff\xfe-not-utf8", b"x" * 10_000],
    ids=["not-utf8", "over-long"],
)
def test_a_request_id_the_engines_cannot_take_is_refused_and_never_ejects_an_engine(
    stack: Stack, request_id: bytes
) -> None:
    for _ in range(5):  # more than the circuit breaker's three
        request = head(X_Request_Id=request_id.decode("latin-1"), Connection="close")
        answer = raw(stack, request + CHAT)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b'"param":"X-Request-Id"' in answer
    assert chat(stack, content=LONG, max_tokens=2).usage.completion_tokens == 2
    assert stack.gateway_metric("baton_gateway_fallbacks_total") == 0  # prefill still served
    assert stack.gateway_metric("baton_gateway_retries_total") == 0


def test_a_client_gone_during_prefill_aborts_prefill_and_decode_never_starts(
    stack: Stack,
) -> None:
    # A long prompt on a stalled prefill engine: the request waits in its prefill leg.
    stack.fault(stack.prefill[0], action="stall", seconds=60)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 50, "stream": True}
    leave_after_a_second(stack, body)
    eventually(
        lambda: (
            stack.gateway_metric("baton_gateway_requests_total", outcome="client_disconnect") == 1
        ),
        timeout=30,
    )
    eventually(lambda: scrape(stack.prefill[0].url, "vllm:num_requests_waiting") == 0, timeout=30)
    assert scrape(stack.decode.url, "vllm:prompt_tokens_total") == 0  # decode never saw it
    assert stack.gateway_metric("baton_gateway_in_flight_requests") == 0


def test_a_client_gone_from_a_non_streamed_request_aborts_its_decode(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 100_000, "ignore_eos": True}
    leave_after_a_second(stack, body)
    eventually(lambda: scrape(stack.decode.url, "vllm:generation_tokens_total") > 0, timeout=30)
    eventually(lambda: scrape(stack.decode.url, "vllm:num_requests_running") == 0, timeout=30)
    assert scrape(stack.decode.url, "vllm:generation_tokens_total") < 100_000
    assert stack.gateway_metric("baton_gateway_aborts_total", reason="client_disconnect") == 1


def test_many_silent_connections_do_not_stop_real_requests(stack: Stack) -> None:
    sockets = [socket.create_connection(("127.0.0.1", stack.gateway.port)) for _ in range(200)]
    try:
        done = threading.Event()

        def all_closed() -> bool:
            for s in sockets:
                s.settimeout(0.01)
                try:
                    if s.recv(1) != b"":
                        return False
                except TimeoutError:
                    return False
            done.set()
            return True

        assert chat(stack, max_tokens=2).usage.completion_tokens == 2
        eventually(all_closed, timeout=60, interval=0.5)
        assert done.is_set()
    finally:
        for s in sockets:
            s.close()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_request_no_engine_can_run_is_refused_before_it_costs_a_prefill(
    stack: Stack, field: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], field: 10**9}
    response = httpx.post(
        f"{stack.gateway.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer k"},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and "maximum context length" in error["message"]
    assert scrape(stack.prefill[0].url, "vllm:prompt_tokens_total") == 0  # no prefill ran


def test_a_stalled_decode_server_is_routed_around_while_its_health_says_ok(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    stalled, other = start_engine(start_sim), start_engine(start_sim)
    gateway = start_gateway(
        "--api-key", "k", f"--decode={stalled.url}", f"--decode={other.url}", "--stall-after", "2"
    )
    stack = Stack(gateway, [], other)
    # Work on the engine, then its steps stop; /health still answers 200.
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 100_000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{stalled.url}/v1/completions", json=body, timeout=30) as held:
        lines = held.iter_lines()  # kept: a dropped line iterator closes the stream
        next(lines)
        stack.fault(stalled, action="stall", seconds=600)
        assert httpx.get(f"{stalled.url}/health").status_code == 200
        eventually(
            lambda: stack.gateway_metric("baton_gateway_healthy_targets", role="decode") == 1,
            timeout=30,
        )
        for turn in range(6):  # by hashing about half would have gone to the stalled server
            answer = stack.client(timeout=20).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=2
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 2
        assert "made no progress" in gateway.log()


def test_a_kept_alive_connection_idle_for_longer_than_clients_pool_it_still_serves(
    stack: Stack,
) -> None:
    """A server that closes idle connections as soon as clients reuse them races them: the
    client's next POST meets the close (aiohttp keeps an idle connection 15 s, httpx 5 s).
    Seen under the rack benchmark as clients' ServerDisconnectedError."""
    with httpx.Client(base_url=stack.gateway.url, headers={"Authorization": "Bearer k"}) as http:
        http.post(
            "/v1/chat/completions", content=CHAT, headers={"Content-Type": "application/json"}
        )
        with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=15) as connection:
            connection.sendall(head() + CHAT)
            assert one_answer(connection).startswith(b"HTTP/1.1 200")
            threading.Event().wait(16)  # idle past every common client's pool timeout
            connection.sendall(head() + CHAT)
            assert one_answer(connection).startswith(b"HTTP/1.1 200")
