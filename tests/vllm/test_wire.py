"""The gateway's two legs, and the simulator's verdicts, checked by vLLM 0.33's request models
and the sampling parameters its serving layer derives from them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from router.first_token import continued_prompt
from router.handoff import continuation_body, decode_body, engine_headers, prefill_body
from tests.vllm.conftest import Vllm

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
# What a vLLM 0.33 prefill engine answers in kv_transfer_params, forwarded to decode verbatim.
PREFILL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "0e2a-prefill_dp1",
    "remote_request_id": "req-1-8d1f",
    "remote_host": "10.0.3.7",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 40,
    "remote_blocks_expiry_time": 1764600000.5,
}
CLIENT_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": (COMPLETIONS, {"prompt": "hello " * 20, "max_tokens": 64, "min_tokens": 8}),
    "completion-streamed": (
        COMPLETIONS,
        {
            "prompt": [1, 2, 3, 4],
            "max_tokens": 32,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    ),
    "chat": (CHAT, {"messages": MESSAGES, "max_completion_tokens": 128, "min_tokens": 16}),
    "chat-streamed": (
        CHAT,
        {
            "messages": MESSAGES,
            "max_tokens": 256,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.6,
        },
    ),
}


def verdict(vllm: Vllm, route: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = vllm.ask("request", route=route, body=body)
    assert answer["ok"], f"vLLM refuses {body}: {answer['error']}"
    return answer


@pytest.mark.parametrize("name", list(CLIENT_BODIES))
def test_the_prefill_leg_asks_vllm_for_one_token_unstreamed_keeping_the_kv(
    vllm: Vllm, name: str
) -> None:
    route, body = CLIENT_BODIES[name]
    body = {"model": "dsv4", **body}
    raw = json.dumps(body, indent=1).encode()  # spacing survives as sent
    # the leg's fields follow the client's own; vLLM's server reads the body with json.loads
    prefill = verdict(vllm, route, json.loads(prefill_body(raw, body)))
    assert prefill["sampling"]["max_tokens"] == 1
    assert prefill["sampling"]["min_tokens"] == 0  # a kept min_tokens > 1 would be refused
    assert prefill["stream"] is False and prefill["stream_options"] is None
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["sampling"]["extra_args"]["kv_transfer_params"] == prefill["kv_transfer_params"]


@pytest.mark.parametrize("name", list(CLIENT_BODIES))
def test_the_decode_leg_is_the_clients_request_with_prefills_kv_verbatim(
    vllm: Vllm, name: str
) -> None:
    route, body = CLIENT_BODIES[name]
    raw = json.dumps({"model": "dsv4", **body}, indent=1).encode()  # spacing survives as sent
    client = verdict(vllm, route, json.loads(raw))
    decode = verdict(vllm, route, json.loads(decode_body(raw, PREFILL_KV)))
    assert decode["kv_transfer_params"] == PREFILL_KV
    assert decode["sampling"]["extra_args"] == {"kv_transfer_params": PREFILL_KV}
    for key in ("max_tokens", "min_tokens", "ignore_eos"):
        assert decode["sampling"][key] == client["sampling"][key]
    assert (decode["stream"], decode["stream_options"]) == (
        client["stream"],
        client["stream_options"],
    )
    assert decode_body(raw, None) == raw  # decode alone: the client's bytes, untouched


def test_with_the_first_token_from_prefill_vllm_returns_its_id_and_continues_after_it(
    vllm: Vllm,
) -> None:
    body = {"model": "dsv4", "prompt": "hello " * 20, "max_tokens": 32, "min_tokens": 4}
    body |= {"stream": True, "ignore_eos": True}
    raw = json.dumps(body).encode()
    ids = b'"prompt":[11,12,13]'
    prefill = verdict(vllm, COMPLETIONS, json.loads(prefill_body(raw, body, ids, True)))
    assert prefill["return_token_ids"] is True and prefill["prompt"] == [11, 12, 13]
    continued = continuation_body(raw, body)
    decode = verdict(
        vllm, COMPLETIONS, json.loads(decode_body(continued, PREFILL_KV, continued_prompt(ids, 7)))
    )
    assert decode["prompt"] == [11, 12, 13, 7]
    assert (decode["sampling"]["max_tokens"], decode["sampling"]["min_tokens"]) == (31, 3)
    assert decode["return_token_ids"] in (None, False) and decode["stream"] is True


def test_both_legs_carry_the_one_request_id_and_only_decode_a_rank() -> None:
    prefill, decode = engine_headers("req-7"), engine_headers("req-7", dp_rank=3)
    assert prefill["X-Request-Id"] == decode["X-Request-Id"] == "req-7"
    assert "X-data-parallel-rank" not in prefill and decode["X-data-parallel-rank"] == "3"


# Bodies whose verdicts the simulator must share with vLLM: (route, body).
VERDICTS: dict[str, tuple[str, dict[str, Any]]] = {
    "valid completion": (COMPLETIONS, {"prompt": "hi", "max_tokens": 4}),
    "valid chat": (CHAT, {"messages": MESSAGES, "max_completion_tokens": 4}),
    "min_tokens above max_tokens": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
    ),
    "chat min_tokens above max": (
        CHAT,
        {"messages": MESSAGES, "max_completion_tokens": 2, "min_tokens": 5},
    ),
    "stream_options without stream": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}},
    ),
    "negative max_tokens": (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}),
    "negative temperature": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "temperature": -1}),
    "top_p above one": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "top_p": 1.5}),
    "unknown field": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "frobnicate": True}),
    "token id prompt": (COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 2}),
    "no prompt": (COMPLETIONS, {"max_tokens": 2}),
    "chat without messages": (CHAT, {"max_completion_tokens": 2}),
}


@pytest.fixture(scope="module")
def sim(start_sim_module: Any) -> Any:
    return start_sim_module("--served-model-name", "dsv4")


@pytest.mark.parametrize("name", list(VERDICTS))
def test_the_simulator_accepts_and_refuses_what_vllm_does(vllm: Vllm, sim: Any, name: str) -> None:
    route, body = VERDICTS[name]
    body = {"model": "dsv4", **body}
    theirs = vllm.ask("request", route=route, body=body)
    ours = httpx.post(f"{sim.url}{route}", json=body, timeout=30)
    assert (ours.status_code == 200) == theirs["ok"], (
        f"vLLM says {'ok' if theirs['ok'] else theirs['error']}; baton sim answered "
        f"{ours.status_code} {ours.text[:200]}"
    )
    if not theirs["ok"]:
        assert ours.status_code == theirs["status"]
        error = ours.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
