"""``baton gateway`` in front of real ``baton sim`` engines, driven by the openai client."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers import (
    NIXL,
    SimHandle,
    cached_tokens_of,
    eventually,
    fault_injection,
    free_port_block,
    scrape,
    scrape_by,
    usage_of,
)

MODEL = "dsv4"
LONG = "The cell keeps prefill and decode in one NVLink domain. " * 40  # ~560 tokens
NO_EOS = {"ignore_eos": True}  # the simulator ends a reply early now and then, as a model does
TWO_TOKENS: dict[str, Any] = {"max_tokens": 2, "extra_body": NO_EOS}


@dataclass
class Stack:
    gateway: SimHandle
    prefill: list[SimHandle]
    decode: SimHandle

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key="k", max_retries=0, **kwargs
        )

    def fault(self, engine: SimHandle, **fault: object) -> None:
        fault_injection().inject(engine.url, **fault)

    def gateway_metric(self, name: str, **labels: str) -> float:
        return scrape(self.gateway.url, name, **labels)

    def assert_nothing_leaked(self) -> None:
        eventually(lambda: self.gateway_metric("baton_gateway_in_flight_requests") == 0)
        for engine in self.prefill:

            def kv_freed(url: str = engine.url) -> bool:
                return scrape(url, "vllm:kv_cache_usage_perc") == 0

            eventually(kv_freed)
        eventually(lambda: scrape(self.decode.url, "vllm:num_requests_running") == 0)


def start_engine(
    start_sim: Callable[..., SimHandle], *flags: str, env: dict[str, str] | None = None
) -> SimHandle:
    return start_sim(
        "--served-model-name",
        MODEL,
        "--kv-transfer-config",
        NIXL,
        *fault_injection().flags,
        *flags,
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(4)), **(env or {})},
    )


def decode_only(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle], engines: int
) -> tuple[list[SimHandle], Stack]:
    """``engines`` decode engines behind one gateway, no prefill instance."""
    started = [start_engine(start_sim) for _ in range(engines)]
    gateway = start_gateway("--api-key", "k", *(f"--decode={e.url}" for e in started))
    return started, Stack(gateway, [], started[-1])


def start_stack(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> Stack:
    """Two prefill instances and a DP4 decode engine behind a gateway with API key ``k``."""
    prefill = [start_engine(start_sim) for _ in range(2)]
    decode = start_engine(start_sim, "--data-parallel-size", "4")
    gateway = start_gateway(
        "--api-key",
        "k",
        *(f"--prefill={p.url}" for p in prefill),
        f"--decode={decode.url}@0-3",
        "--prefill-timeout",
        "2",
        "--first-token-timeout",
        "5",
    )
    return Stack(gateway, prefill, decode)


@pytest.fixture
def stack(start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]) -> Stack:
    return start_stack(start_sim, start_gateway)


@pytest.fixture(scope="module")
def read_only_stack(
    module_launchers: tuple[Callable[..., SimHandle], Callable[..., SimHandle]],
) -> Stack:
    """One stack for the module's tests that send what no engine serves: nothing changes it."""
    return start_stack(*module_launchers)


def cached_prefix(prompt_tokens: int) -> int:
    """Whole 16-token blocks a repeated prompt finds cached (its last token is always computed)."""
    return ((prompt_tokens - 1) // 16) * 16


def chat(stack: Stack, content: str = LONG, **kwargs: Any) -> Any:
    """A ChatCompletion, or its Stream with ``stream=True``: the overload follows ``kwargs``."""
    return stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


# ---- the API


def test_chat_goes_through_prefill_then_decode(stack: Stack) -> None:
    response = chat(stack, max_tokens=8, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 8
    prefilled = sum(scrape(p.url, "vllm:prompt_tokens_total") for p in stack.prefill)
    assert prefilled == response.usage.prompt_tokens
    assert (
        scrape(
            stack.decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        == response.usage.prompt_tokens
    )
    assert stack.gateway_metric("baton_gateway_routing_decisions_total", path="pd") == 1
    stack.assert_nothing_leaked()


def test_a_handoffs_time_is_split_into_its_phases_from_arrival_to_first_token(
    stack: Stack,
) -> None:
    stream = stack.client().completions.create(
        model=MODEL, prompt=LONG, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    assert len(list(stream)) >= 4

    def phases() -> dict[str, float]:
        return {
            phase: stack.gateway_metric("baton_gateway_phase_seconds_count", phase=phase)
            for phase in ("route", "prefill", "handoff", "decode")
        }

    # the decode phase ends with the stream's last byte, which the client may read first
    eventually(lambda: phases()["decode"] == 1)
    assert phases() == {"route": 1, "prefill": 1, "handoff": 1, "decode": 1}
    to_first_token = sum(
        stack.gateway_metric("baton_gateway_phase_seconds_sum", phase=phase)
        for phase in ("route", "prefill", "handoff")
    )
    ttft = stack.gateway_metric("baton_gateway_time_to_first_token_seconds_sum")
    assert 0 < to_first_token <= ttft


def test_streamed_completion_with_usage_reports_prefill_cached_tokens(stack: Stack) -> None:
    client = stack.client()
    for turn in range(2):
        stream = client.completions.create(
            model=MODEL,
            prompt=LONG,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(text) == 6 * 4
        # decode alone would report every prompt token cached; the gateway reports prefill's
        expected = 0 if turn == 0 else cached_prefix(usage_of(chunks[-1]).prompt_tokens)
        assert cached_tokens_of(chunks[-1]) == expected
    stack.assert_nothing_leaked()


def test_non_streamed_usage_reports_prefill_cached_tokens(stack: Stack) -> None:
    first = chat(stack, max_tokens=2)
    second = chat(stack, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == cached_prefix(
        first.usage.prompt_tokens
    )


def test_short_prompt_skips_prefill(stack: Stack) -> None:
    response = chat(stack, content="hi", max_tokens=3)
    assert response.usage.completion_tokens >= 1
    assert sum(scrape(p.url, "vllm:prompt_tokens_total") for p in stack.prefill) == 0
    assert stack.gateway_metric("baton_gateway_routing_decisions_total", path="decode_only") == 1


def test_unknown_fields_pass_through_to_the_engines(stack: Stack) -> None:
    response = chat(
        stack,
        max_tokens=50,
        extra_body={"min_tokens": 50, "ignore_eos": False, "chat_template_kwargs": {"x": 1}},
        seed=9,
    )
    assert response.usage.completion_tokens == 50


def test_models_come_from_the_engines(read_only_stack: Stack) -> None:
    assert [m.id for m in read_only_stack.client().models.list()] == [MODEL]


def test_ready_needs_a_healthy_decode_target_and_says_when_decode_serves_alone(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    decode = start_engine(start_sim)
    gateway = start_gateway(f"--decode={decode.url}", "--prefill=http://127.0.0.1:9")
    # No prefill instance is healthy, yet decode alone serves every request: still Ready, or
    # a readiness probe would take every gateway pod out of its Service.
    ready = httpx.get(f"{gateway.url}/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "prefill": "0 of 1 healthy; decode serves alone"}
    # the cell's prefill shows as 0 healthy targets, not as a missing series
    healthy = scrape_by(gateway.url, "baton_gateway_healthy_targets", "role")
    assert healthy == {"prefill": 0, "decode": 1}
    decode.process.kill()
    eventually(lambda: httpx.get(f"{gateway.url}/ready").status_code == 503)
    assert httpx.get(f"{gateway.url}/health").status_code == 200


def test_with_no_healthy_engine_a_request_gets_503_not_an_unknown_model(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    decode = start_engine(start_sim)
    gateway = start_gateway("--api-key", "k", f"--decode={decode.url}")
    stack = Stack(gateway, [], decode)
    decode.process.kill()
    eventually(lambda: httpx.get(f"{gateway.url}/ready").status_code == 503)
    with pytest.raises(openai.InternalServerError) as failed:
        chat(stack, max_tokens=2)
    assert failed.value.status_code == 503  # the OpenAI SDK retries a 503, never a 404
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "no_healthy_target"


def test_a_dead_decode_servers_other_ranks_are_not_tried_after_it_fails(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    dead = start_engine(start_sim, "--data-parallel-size", "4")
    alive = start_engine(start_sim)
    # Health checks far apart: the dead server stays in the pool while the requests run.
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--decode={dead.url}@0-3",
        f"--decode={alive.url}",
        "--health-interval",
        "60",
    )
    stack = Stack(gateway, [], alive)
    dead.process.kill()
    dead.process.wait()
    for turn in range(12):
        before = stack.gateway_metric("baton_gateway_retries_total", phase="decode")
        response = chat(stack, content=f"turn {turn}", max_tokens=2)
        assert response.usage.completion_tokens == 2
        # At most the one attempt that found the server dead: never its other ranks after it.
        assert stack.gateway_metric("baton_gateway_retries_total", phase="decode") - before <= 1


def test_an_engine_too_busy_to_answer_one_health_check_stays_in_the_pool(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    # Seen in baton bench agentx: the simulator's API servers, busy for a moment, missed one
    # health check together; the gateway ejected every target at once and answered 503.
    decode = start_engine(start_sim)
    gateway = start_gateway("--api-key", "k", f"--decode={decode.url}")
    stack = Stack(gateway, [], decode)
    assert chat(stack, max_tokens=2).usage.completion_tokens == 2
    missed_before = stack.gateway_metric("baton_gateway_health_checks_missed_total")
    stack.fault(decode, action="freeze", seconds=1.6)  # one probe (1 s timeout) goes unanswered
    eventually(
        lambda: stack.gateway_metric("baton_gateway_health_checks_missed_total") > missed_before,
        timeout=10,
    )
    assert chat(stack, max_tokens=2).usage.completion_tokens == 2
    assert "ejected" not in gateway.log()


def test_an_engine_that_stays_silent_is_ejected_after_three_missed_health_checks(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    (silent, _), stack = decode_only(start_sim, start_gateway, 2)
    gateway = stack.gateway
    stack.fault(silent, action="freeze", seconds=6)
    eventually(lambda: "ejected" in gateway.log(), timeout=15)
    assert stack.gateway_metric("baton_gateway_health_checks_missed_total") >= 3
    assert (
        stack.gateway_metric("baton_gateway_ejections_total", reason="unanswered_health_checks")
        == 1
    )
    # one of two targets out is no panic: the other takes every request meanwhile
    assert "panic" not in gateway.log()
    assert chat(stack, max_tokens=2).usage.completion_tokens == 2


def test_requests_waiting_on_a_frozen_engine_go_elsewhere_once_it_is_ejected(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    # A frozen engine (SIGSTOP, a hung API server) accepts connections and answers nothing:
    # its requests used to wait for their own timeouts, minutes, after it was ejected.
    (frozen, *_), stack = decode_only(start_sim, start_gateway, 3)
    gateway = stack.gateway
    stack.fault(frozen, action="freeze", seconds=30)

    def waiting_on_frozen() -> float:
        return scrape(gateway.url, "baton_gateway_in_flight_requests", target=frozen.url)

    with concurrent.futures.ThreadPoolExecutor(40) as threads:
        answers = []
        # A request at a time until one waits on the frozen engine: each idle rank is as
        # likely as the others (rendezvous hashing of the request), so one in three lands there.
        for turn in range(40):
            answers.append(threads.submit(chat, stack, f"frozen {turn}", **TWO_TOKENS))

            def settled() -> bool:
                return answers[-1].done() or waiting_on_frozen() >= 1

            eventually(settled, timeout=30)
            if waiting_on_frozen() >= 1:
                break
        assert waiting_on_frozen() >= 1
        assert all(a.result(timeout=120).usage.completion_tokens == 2 for a in answers)
    # every request answered while the engine it waited on is still frozen
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{frozen.url}/health", timeout=1)
    assert "sent elsewhere" in gateway.log()
    assert stack.gateway_metric("baton_gateway_retries_total", reason="connection") >= 1


def test_past_the_bound_of_requests_a_rank_holds_a_request_waits_then_gets_429(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    decode = start_engine(start_sim, "--time-scale", "100")  # a held request lasts minutes
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--decode={decode.url}",
        "--max-requests-per-rank",
        "1",
        "--queue-timeout",
        "10",
    )
    stack = Stack(gateway, [], decode)
    body = {"model": MODEL, "prompt": "hold the rank", "max_tokens": 5000, "ignore_eos": True}
    headers = {"Authorization": "Bearer k"}
    with (
        httpx.Client(base_url=gateway.url, headers=headers, timeout=120) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as held,
    ):
        assert held.status_code == 200
        lines = held.iter_lines()  # one iterator: a dropped one closes the stream
        assert next(lines)  # the rank now holds its one request
        refused = client.post("/v1/completions", json={**body, "max_tokens": 2})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "10"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            queued = thread.submit(client.post, "/v1/completions", json={**body, "max_tokens": 2})
            eventually(lambda: stack.gateway_metric("baton_gateway_waiting_requests") == 1)
            held.close()  # the first request ends: its place goes to the waiting one
            assert queued.result(timeout=120).status_code == 200
    waits = scrape_by(gateway.url, "baton_gateway_admission_waits_total", "result")
    assert waits == {"waited": 1, "saturated": 1}


def test_requests_admitted_together_hold_their_places_through_prefill_and_queue_in_turn(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    # Admission is judged before the prefill leg and the decode rank taken after it: requests
    # admitted while the rank had room must not all find it free once their prefills end, and
    # a freed place goes to one waiting request, not to every one of them.
    prefill = start_engine(start_sim, "--time-scale", "100")  # a prefill leg of about a second
    decode = start_engine(start_sim, "--time-scale", "100")  # a held request lasts minutes
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--prefill={prefill.url}",
        f"--decode={decode.url}",
        "--max-requests-per-rank",
        "1",
        "--queue-timeout",
        "300",
    )
    stack = Stack(gateway, [prefill], decode)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 5000, "ignore_eos": True}
    released = [threading.Event() for _ in range(3)]
    most_on_the_rank = 0.0

    def decode_in_flight() -> float:
        nonlocal most_on_the_rank
        held = stack.gateway_metric("baton_gateway_in_flight_requests", role="decode")
        most_on_the_rank = max(most_on_the_rank, held)
        return held

    def hold(release: threading.Event) -> bool:
        with (
            httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer k"}) as client,
            client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, timeout=300
            ) as response,
        ):
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")  # on the rank
            return release.wait(timeout=300)

    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        held = [threads.submit(hold, release) for release in released]
        try:
            # one on the rank, two waiting, the rank's first request long in decode
            eventually(
                lambda: (
                    stack.gateway_metric("baton_gateway_waiting_requests") == 2
                    and decode_in_flight() == 1
                    and scrape(decode.url, "vllm:num_requests_running") == 1
                ),
                timeout=120,
            )
        finally:
            for release in released:  # each place freed goes to the next waiting request
                release.set()
        eventually(lambda: decode_in_flight() <= 1 and all(h.done() for h in held), timeout=120)
        assert all(h.result() for h in held)
    assert most_on_the_rank == 1
    waits = scrape_by(gateway.url, "baton_gateway_admission_waits_total", "result")
    assert waits.get("waited") == 2 and not waits.get("saturated")
    stack.assert_nothing_leaked()


def test_engines_that_answer_health_late_but_keep_serving_stay_in_the_pool(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    # A loaded host: every engine's health checks time out for a while, and the engines keep
    # streaming and answering /metrics. vllm-router lost nothing here; the gateway ejected all.
    engines, stack = decode_only(start_sim, start_gateway, 2)
    gateway = stack.gateway
    for engine in engines:
        stack.fault(engine, action="late_health", delay=3, seconds=10)

    def missed_enough() -> bool:
        return all(
            stack.gateway_metric("baton_gateway_health_checks_missed_total", server=e.url) >= 4
            for e in engines
        )

    # requests all along, each answered, until both missed 4 checks (a quiet host answers
    # thousands meanwhile, a busy one a few; bounded both ways)
    deadline = time.monotonic() + 120
    for turn in range(20_000):
        answer = chat(stack, content=f"busy {turn}", max_tokens=2, extra_body=NO_EOS)
        assert answer.usage.completion_tokens == 2
        if missed_enough() or time.monotonic() > deadline:
            break
    assert missed_enough()
    assert "ejected" not in gateway.log()
    assert stack.gateway_metric("baton_gateway_ejections_total") == 0


def test_a_pool_whose_every_engine_goes_silent_panics_and_waits_for_them_but_not_for_the_dead(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    (dead, *frozen), stack = decode_only(start_sim, start_gateway, 3)
    gateway = stack.gateway
    dead.process.kill()
    dead.process.wait()
    eventually(
        lambda: (
            stack.gateway_metric("baton_gateway_ejections_total", reason="failed_health_check") == 1
        )
    )
    for engine in frozen:
        stack.fault(engine, action="freeze", seconds=8)
    eventually(lambda: "panic: 0 of 3 decode targets healthy" in gateway.log(), timeout=20)
    # the frozen engines are waited for (they are busy, perhaps); the dead one is never tried
    answer = chat(stack, content="in panic", max_tokens=2, extra_body=NO_EOS)
    assert answer.usage.completion_tokens == 2
    assert stack.gateway_metric("baton_gateway_retries_total") == 0
    eventually(lambda: "panic over" in gateway.log(), timeout=20)


def test_with_one_decode_target_a_lost_kv_is_decoded_alone_on_it(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    prefill, decode = start_engine(start_sim), start_engine(start_sim)
    gateway = start_gateway("--api-key", "k", f"--prefill={prefill.url}", f"--decode={decode.url}")
    stack = Stack(gateway, [prefill], decode)
    stack.fault(prefill, action="drop_kv", count=1)
    response = chat(stack, max_tokens=4)
    assert response.usage.completion_tokens == 4
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="decode_retry") == 1
    stack.assert_nothing_leaked()


# ---- routing


def test_conversation_turns_stick_to_one_prefill_instance(stack: Stack) -> None:
    client = stack.client()
    for session in range(4):
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": LONG},
            {"role": "user", "content": f"session {session} opens"},
        ]
        for turn in range(3):
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, extra_body={"ignore_eos": True}
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"turn {turn} " + LONG[:400]},
            ]
    hits = sum(scrape(p.url, "vllm:prefix_cache_hits_total") for p in stack.prefill)
    queries = sum(scrape(p.url, "vllm:prefix_cache_queries_total") for p in stack.prefill)
    # every later turn finds its whole history cached on the instance that served the first
    assert hits / queries > 0.55
    assert (
        stack.gateway_metric("baton_gateway_affinity_total", source="conversation", result="hit")
        == 12
    )


def test_session_header_pins_prefill(stack: Stack) -> None:
    client = stack.client()
    for i in range(6):
        client.completions.create(
            model=MODEL,
            prompt=f"{i} " + LONG,
            max_tokens=1,
            extra_headers={"X-Session-ID": "agent-7"},
        )
    served = [scrape(p.url, "vllm:request_success_total") for p in stack.prefill]
    assert sorted(served) == [0, 6]


def test_subagents_prefill_beside_their_parent_and_find_its_system_prompt_cached(
    stack: Stack,
) -> None:
    """OpenCode's subagents send their own X-Session-ID and the parent's X-Parent-Session-ID:
    keyed on the parent, each prefills where the parent's system prompt is cached. Keyed on their
    own sessions, they scattered over both instances and computed it again."""
    client = stack.client()
    system: ChatCompletionMessageParam = {"role": "system", "content": LONG}
    parent = client.chat.completions.create(
        model=MODEL,
        messages=[system, {"role": "user", "content": "fix the failing test"}],
        max_tokens=1,
        extra_headers={"X-Session-ID": "agent-7"},
    )
    assert parent.usage is not None and parent.usage.prompt_tokens > 500
    for i in range(6):
        sub = client.chat.completions.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": f"subtask {i}: read module {i}"}],
            max_tokens=1,
            extra_headers={"X-Session-ID": f"agent-7-sub{i}", "X-Parent-Session-ID": "agent-7"},
        )
        # the system prompt, in whole blocks, found cached
        assert sub.usage is not None
        assert cached_tokens_of(sub) >= cached_prefix(len(LONG) // 4), i
    served = [scrape(p.url, "vllm:request_success_total") for p in stack.prefill]
    assert sorted(served) == [0, 7]


def _stream_until(
    client: openai.OpenAI, stop: threading.Event, prompt: str, max_tokens: int = 300
) -> None:
    while not stop.is_set():
        for _ in client.completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        ):
            pass


def _decode_in_flight(gateway: SimHandle, decode: SimHandle) -> list[float]:
    """A gateway's own in-flight requests per decode rank, from one scrape (one consistent view)."""
    in_flight = scrape_by(gateway.url, "baton_gateway_in_flight_requests", "target")
    return [v for name, v in in_flight.items() if name.startswith(decode.url)]


def test_decode_ranks_stay_balanced_under_steady_load(stack: Stack) -> None:
    client = stack.client()
    stop = threading.Event()

    def all_in_decode() -> list[float]:
        """In flight per rank at a moment when all 16 streams are in their decode leg: between
        those moments a stream is in prefill and the rank it left is short until it comes back.
        Empty (falsy: poll again) at any other moment."""
        ranks = _decode_in_flight(stack.gateway, stack.decode)
        return ranks if sum(ranks) == 16 else []

    # Long decodes, so that moments when no stream is in its prefill leg come often: with 300
    # tokens a busy machine went 20 s without one (the streams' prefills spread out).
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_stream_until, client, stop, f"{i} {LONG}", 1500) for i in range(16)]
        samples: list[float] = []
        try:
            for _ in range(20):
                ranks = eventually(all_in_decode, timeout=60)
                assert len(ranks) == 4
                samples.append(max(ranks) - min(ranks))
        finally:
            stop.set()
        for future in futures:
            future.result()
    assert max(samples) <= 1, samples


def test_a_second_gateway_routes_around_the_first_ones_load(
    stack: Stack, start_gateway: Callable[..., SimHandle]
) -> None:
    """Replicas share no state: each learns the others' load from the engines' metrics."""
    other = start_gateway(
        "--api-key", "k", f"--decode={stack.decode.url}@0-3", "--health-interval", "0.2"
    )

    def open_stream(
        client: openai.OpenAI, prompt: str, max_tokens: int
    ) -> openai.Stream[Completion]:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        return stream

    # the first gateway holds three streams, longer than the test, on three of the four ranks
    held = [open_stream(stack.client(), f"{i} x", 100_000) for i in range(3)]
    try:
        loads = _decode_in_flight(stack.gateway, stack.decode)
        assert sorted(loads) == [0, 1, 1, 1]
        idle = loads.index(0)

        # the second gateway learns that load from the engine ...
        def peers() -> dict[str, float]:
            return scrape_by(other.url, "baton_gateway_peer_in_flight_requests", "target")

        eventually(lambda: sum(peers().values()) == 3)
        assert list(peers().values())[idle] == 0
        # ... and sends each of its own requests to the one idle rank
        second = openai.OpenAI(base_url=f"{other.url}/v1", api_key="k", max_retries=0)
        for i in range(4):
            stream = open_stream(second, f"y{i}", 100_000)  # still running when scraped
            assert _decode_in_flight(other, stack.decode)[idle] == 1
            stream.close()
            # the engine drops it; wait until a sync has seen that (the estimate lags a sync)
            eventually(lambda: scrape(stack.decode.url, "vllm:num_requests_running") == 3)
            eventually(lambda: sum(peers().values()) == 3 and list(peers().values())[idle] == 0)
    finally:
        for stream in held:
            stream.close()
    # its own count stayed exact throughout: nothing left in flight
    eventually(lambda: sum(_decode_in_flight(other, stack.decode)) == 0)
    stack.assert_nothing_leaked()


def test_an_edited_pool_file_moves_traffic_and_a_bad_edit_keeps_the_last_good_pool(
    start_sim: Callable[..., SimHandle],
    start_gateway: Callable[..., SimHandle],
    tmp_path: Path,
) -> None:
    first, second = start_engine(start_sim), start_engine(start_sim)
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"cells:\n  - name: c0\n    decode: [{{url: {first.url}}}]\n")
    gateway = start_gateway("--pool", str(pool))
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)

    def served_by(engine: SimHandle) -> float:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        return scrape(engine.url, "vllm:request_success_total")

    assert served_by(first) == 1
    pool.write_text(f"cells:\n  - name: c0\n    decode: [{{url: {second.url}}}]\n")
    eventually(
        lambda: (
            first.url not in scrape_by(gateway.url, "baton_gateway_in_flight_requests", "target")
        )
    )
    assert served_by(second) == 1
    assert scrape(first.url, "vllm:request_success_total") == 1
    # a broken edit is refused (logged) and the gateway keeps routing to the last good pool
    pool.write_text("cells:\n  - name: c0\n    decode: []\n")
    eventually(lambda: "pool file not reloaded" in gateway.log())
    assert served_by(second) == 2


# ---- fault paths: afterwards nothing is left in flight and no prefill KV is held


def test_prefill_5xx_falls_back_to_decode_only(stack: Stack) -> None:
    for engine in stack.prefill:
        stack.fault(engine, action="fail_requests", count=1, status=503)
    response = chat(stack, max_tokens=4)
    assert response.usage.completion_tokens >= 1
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="status") == 1
    assert (
        scrape(stack.decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute") > 0
    )
    stack.assert_nothing_leaked()


def test_prefill_4xx_goes_back_to_the_client(stack: Stack) -> None:
    for engine in stack.prefill:
        stack.fault(engine, action="fail_requests", count=1, status=400)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(stack, max_tokens=4)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == "injected failure (baton sim fault injection)"
    assert scrape(stack.decode.url, "vllm:request_success_total") == 0
    stack.assert_nothing_leaked()


def test_prefill_timeout_falls_back_to_decode_only(stack: Stack) -> None:
    for engine in stack.prefill:
        stack.fault(engine, action="stall", seconds=30)
    response = chat(stack, max_tokens=4)
    assert response.usage.completion_tokens >= 1
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="timeout") == 1


def test_decode_failure_before_first_token_retries_another_rank_alone(stack: Stack) -> None:
    stack.fault(stack.decode, action="fail_requests", count=1, status=500)
    stream = chat(stack, max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 5 * 4
    assert stack.gateway_metric("baton_gateway_retries_total", phase="decode") == 1
    # the failed rank received the handoff, so the retry never sends it again; the prefill
    # instance holds the blocks until their lease expires
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="decode_retry") == 1
    eventually(lambda: stack.gateway_metric("baton_gateway_in_flight_requests") == 0)
    eventually(lambda: scrape(stack.decode.url, "vllm:num_requests_running") == 0)


def test_a_handoff_a_decode_rank_received_is_never_sent_again(stack: Stack) -> None:
    # The first rank's pull fails; it may have read blocks already, and live vLLM answers a
    # replayed handoff 200 with whatever the freed blocks hold: the retry decodes alone.
    for engine in stack.prefill:
        stack.fault(engine, action="drop_kv", count=2)
    stream = chat(stack, max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 5 * 4
    assert stack.gateway_metric("baton_gateway_retries_total", phase="decode") == 1
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="decode_retry") == 1
    assert scrape(stack.decode.url, "vllm:nixl_num_failed_transfers_total") == 1
    stack.assert_nothing_leaked()


def stream_until_failure(stack: Stack, fail: Callable[[], object]) -> list[str]:
    """Stream a long completion, call ``fail`` after five events, return every data payload."""
    body = {
        "model": MODEL,
        "prompt": LONG,
        "max_tokens": 100_000,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{stack.gateway.url}/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": "Bearer k"},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 5:
                    fail()
    return events


def assert_whole_tokens_then_error(events: list[str]) -> dict[str, object]:
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2] if '"choices"' in e]
    assert texts and all(len(t) % 4 == 0 for t in texts)  # whole tokens, none repeated
    error: dict[str, object] = json.loads(events[-2])["error"]
    return error


def test_engine_failure_mid_stream_is_forwarded_and_the_stream_ends(stack: Stack) -> None:
    events = stream_until_failure(stack, lambda: stack.fault(stack.decode, action="kill"))
    assert assert_whole_tokens_then_error(events)["code"] == 500
    assert stack.gateway_metric("baton_gateway_in_flight_requests") == 0


def test_broken_decode_connection_mid_stream_ends_with_an_sse_error_event(stack: Stack) -> None:
    events = stream_until_failure(stack, stack.decode.process.kill)
    error = assert_whole_tokens_then_error(events)
    assert error["type"] == "server_error" and error["code"] == "upstream_failed"
    assert stack.gateway_metric("baton_gateway_aborts_total", phase="decode") == 1
    assert stack.gateway_metric("baton_gateway_in_flight_requests") == 0


def test_client_disconnect_aborts_both_legs(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": LONG,
        "max_tokens": 100_000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        f"{stack.gateway.url}/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": "Bearer k"},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    eventually(lambda: scrape(stack.decode.url, "vllm:num_requests_running") == 0)
    assert scrape(stack.decode.url, "vllm:generation_tokens_total") < 100_000
    assert stack.gateway_metric("baton_gateway_aborts_total", reason="client_disconnect") == 1
    stack.assert_nothing_leaked()


# ---- bad input: the right status and an OpenAI error body, never a 5xx


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        (b"{nope", {}, 400, "not valid JSON"),
        (b'{"model": "dsv4", "messages": "hi"}', {}, 400, "messages"),
        (
            b'{"model": "dsv4", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            {},
            400,
            "max_tokens",
        ),
        (
            b'{"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}',
            {},
            404,
            "served: dsv4",
        ),
        (
            b'{"model": "dsv4", "messages": [{"role": "user", "content": "x"}]}',
            {"Authorization": "Bearer wrong"},
            401,
            "API key",
        ),
        (
            b'{"model": "dsv4", "messages": [{"role": "user", "content": "x"}]}',
            {"Authorization": ""},
            401,
            "API key",
        ),
        (
            b'{"model": "dsv4", "messages": [{"role": "user", "content": "x"}], '
            b'"kv_transfer_params": {}}',
            {},
            400,
            "kv_transfer_params",
        ),
    ],
    ids=[
        "malformed",
        "messages-type",
        "max-tokens-type",
        "unknown-model",
        "wrong-key",
        "missing-key",
        "client-kv-params",
    ],
)
def test_bad_request_gets_openai_error(
    read_only_stack: Stack, body: bytes, headers: dict[str, str], status: int, needle: str
) -> None:
    response = httpx.post(
        f"{read_only_stack.gateway.url}/v1/chat/completions",
        content=body,
        headers={"Authorization": "Bearer k", **headers},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]


def test_body_over_the_limit_is_413(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    decode = start_engine(start_sim)
    gateway = start_gateway(f"--decode={decode.url}", "--max-body-bytes", "1000")
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 2000}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_api_keys_from_file_and_environment(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle], tmp_path: Path
) -> None:
    decode = start_engine(start_sim)
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfrom-file\n")
    gateway = start_gateway(
        f"--decode={decode.url}", "--api-key-file", str(keys), env={"BATON_API_KEYS": "from-env"}
    )
    for key, status in (("from-file", 200), ("from-env", 200), ("other", 401)):
        response = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == status
    assert "from-file" not in gateway.log() and "from-env" not in gateway.log()


def test_engines_behind_an_api_key_are_served_with_the_engine_key_file(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle], tmp_path: Path
) -> None:
    # vLLM's --api-key guards /v1 on the engines; the gateway sends the key on every call.
    prefill = start_engine(start_sim, "--api-key", "engine-secret")
    decode = start_engine(start_sim, "--api-key", "engine-secret")
    assert httpx.get(f"{decode.url}/v1/models").status_code == 401
    key = tmp_path / "engine-key"
    key.write_text("engine-secret\n")
    flags = (f"--prefill={prefill.url}", f"--decode={decode.url}")
    gateway = start_gateway(*flags, "--engine-api-key-file", str(key))
    eventually(lambda: httpx.get(f"{gateway.url}/ready").status_code == 200)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 4}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert scrape(prefill.url, "vllm:prompt_tokens_total") > 0  # the P/D path, both legs
    assert "engine-secret" not in gateway.log()
    # The engines refuse a gateway without the key: its startup probe learnt no model.
    keyless = start_gateway(*flags)
    refused = httpx.post(f"{keyless.url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 503 and "no healthy engine" in refused.json()["error"]["message"]
    assert "answers /v1/models with 401" in keyless.log()


def test_unknown_route_is_an_openai_404(read_only_stack: Stack) -> None:
    response = httpx.get(f"{read_only_stack.gateway.url}/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
