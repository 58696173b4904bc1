"""Bad input gets vLLM's status and error body from the simulator, and nothing is lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rigs.faults import FaultInjection
from tests.helpers import SimHandle, scrape


@pytest.fixture
def sim(start_sim: Callable[..., SimHandle], faults: FaultInjection) -> SimHandle:
    return start_sim(
        "--served-model-name",
        "dsv4",
        "--max-model-len",
        "4096",
        "--data-parallel-size",
        "4",
        *faults.flags,
    )


def post(url: str, path: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` of ``path`` on ``url``; ``kwargs`` (json=, content=, headers=) go to it."""
    return httpx.post(f"{url}{path}", timeout=10, **kwargs)


def assert_vllm_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error: dict[str, object] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b'{"prompt": 7}', 400, "prompt"),
        (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "x", "n": 0}', 400, "n"),
        (b'{"prompt": "x", "n": 2}', 400, "n=2 is not supported"),
        (b'{"model": "gpt-4", "prompt": "x"}', 404, "gpt-4"),
        (b'{"prompt": ["a", "b"]}', 400, "batched prompts"),
        (b'{"prompt": "x", "max_tokens": 5000}', 400, "maximum context length"),
        (b'{"messages": []}', 400, "messages"),
    ],
    ids=[
        "malformed-json",
        "prompt-type",
        "max-tokens-type",
        "max-tokens-zero",
        "n-zero",
        "n-two",
        "unknown-model",
        "batch-prompt",
        "over-context",
        "empty-chat",
    ],
)
def test_bad_request_gets_vllm_error_body(
    sim: SimHandle, body: bytes, status: int, needle: str
) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    error = assert_vllm_error(
        post(sim.url, path, content=body, headers={"Content-Type": "application/json"}), status
    )
    assert needle in str(error["message"])


def test_prompt_longer_than_max_model_len_is_rejected(sim: SimHandle) -> None:
    error = assert_vllm_error(
        post(sim.url, "/v1/completions", json={"prompt": "abcd" * 5000, "max_tokens": 1}), 400
    )
    assert "5000 input tokens" in str(error["message"])


def test_dp_rank_header_targets_that_rank(sim: SimHandle) -> None:
    response = post(
        sim.url,
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-data-parallel-rank": "3"},
    )
    assert response.status_code == 200
    assert scrape(sim.url, "vllm:request_success_total", engine="3") == 1
    assert scrape(sim.url, "vllm:request_success_total", engine="0") == 0


def test_dp_rank_out_of_range_is_a_400(sim: SimHandle) -> None:
    error = assert_vllm_error(
        post(
            sim.url, "/v1/completions", json={"prompt": "x"}, headers={"X-data-parallel-rank": "4"}
        ),
        400,
    )
    assert error["message"] == "data_parallel_rank 4 is out of range [0, 4)."


def test_dp_rank_header_that_is_not_an_integer_is_ignored(sim: SimHandle) -> None:
    response = post(
        sim.url,
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-data-parallel-rank": "two"},
    )
    assert response.status_code == 200


def test_hybrid_lb_header_is_a_local_rank_index(start_sim: Callable[..., SimHandle]) -> None:
    sim = start_sim(
        "--data-parallel-size",
        "8",
        "--data-parallel-size-local",
        "4",
        "--data-parallel-start-rank",
        "4",
        "--data-parallel-hybrid-lb",
    )
    response = post(
        sim.url,
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-data-parallel-rank": "1"},
    )
    assert response.status_code == 200
    assert scrape(sim.url, "vllm:request_success_total", engine="5") == 1
    assert_vllm_error(
        post(
            sim.url, "/v1/completions", json={"prompt": "x"}, headers={"X-data-parallel-rank": "4"}
        ),
        400,
    )


def test_without_header_requests_spread_over_ranks_least_loaded_first(sim: SimHandle) -> None:
    import concurrent.futures

    # Long enough (about 7 s) that each request still runs when the last one arrives, even on a
    # busy machine: one that ended first would leave its rank the least loaded again.
    body = {"prompt": "spread", "max_tokens": 3500, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda _: httpx.post(f"{sim.url}/v1/completions", json=body, timeout=120), range(8)
            )
        )
    per_rank = [scrape(sim.url, "vllm:request_success_total", engine=str(r)) for r in range(4)]
    assert per_rank == [2, 2, 2, 2]


def test_injected_failures_answer_with_the_requested_status(
    sim: SimHandle, faults: FaultInjection
) -> None:
    faults.inject(sim.url, action="fail_requests", count=2, status=503)
    assert_vllm_error(post(sim.url, "/v1/completions", json={"prompt": "x"}), 503)
    assert_vllm_error(post(sim.url, "/v1/completions", json={"prompt": "x"}), 503)
    assert (
        post(sim.url, "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    )


def test_killed_rank_takes_the_group_down_and_health_says_503(
    sim: SimHandle, faults: FaultInjection
) -> None:
    assert httpx.get(f"{sim.url}/health").status_code == 200
    faults.inject(sim.url, action="kill", rank=2)
    assert httpx.get(f"{sim.url}/health").status_code == 503
    assert_vllm_error(post(sim.url, "/v1/completions", json={"prompt": "x"}), 500)


def test_fault_endpoint_is_absent_without_the_flag(start_sim: Callable[..., SimHandle]) -> None:
    sim = start_sim()
    assert post(sim.url, "/sim/faults", json={"action": "kill"}).status_code in (404, 405)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic x"])
def test_fault_endpoint_refuses_callers_without_its_token(
    sim: SimHandle, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = post(sim.url, "/sim/faults", json={"action": "kill"}, headers=headers)
    assert "fault-injection-token-file" in str(assert_vllm_error(response, 401)["message"])
    assert httpx.get(f"{sim.url}/health").status_code == 200  # nothing was applied


def test_slowed_engine_takes_longer_per_step_until_the_fault_ends(
    sim: SimHandle, faults: FaultInjection
) -> None:
    def latency() -> float:
        """The simulated seconds one 40-token request takes."""
        before = scrape(sim.url, "vllm:e2e_request_latency_seconds_sum")
        body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
        assert post(sim.url, "/v1/completions", json=body).status_code == 200
        return scrape(sim.url, "vllm:e2e_request_latency_seconds_sum") - before

    normal = latency()
    faults.inject(sim.url, action="slow", factor=10, seconds=1.5)
    assert latency() > 5 * normal
    time.sleep(1.5)  # the fault's simulated seconds at time scale 1
    assert latency() < 3 * normal
