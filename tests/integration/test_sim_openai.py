"""The official ``openai`` client against a real ``baton sim`` process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from baton.core.profile import load_profile
from baton.core.sim_tokenizer import decode_token_ids
from tests.helpers import SimHandle, cached_tokens_of, usage_of

MODEL = "dsv4-flash"


@pytest.fixture(scope="module")
def client(
    module_launchers: tuple[Callable[..., SimHandle], Callable[..., SimHandle]],
) -> openai.OpenAI:
    """One engine for the module: each test's prompts are its own, so none finds another's
    cached."""
    start_sim, _ = module_launchers
    sim = start_sim("--served-model-name", MODEL, "--seed", "7")
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_returns_text_usage_and_vllm_id(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Plan the rack layout."}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "abc123"},
    )
    assert response.id == "chatcmpl-abc123"
    assert response.choices[0].finish_reason == "length"
    usage = usage_of(response)
    assert usage.completion_tokens == 12
    content = response.choices[0].message.content
    assert content is not None and len(content) == 12 * 4  # one 4-byte word per token
    assert usage.prompt_tokens == usage.total_tokens - 12


def test_completion_streams_chunks_then_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="The baton passes from prefill to decode",
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text) == 20 * 4
    assert usage_of(chunks[-1]).completion_tokens == 20
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_chat_stream_starts_with_assistant_role(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_same_seed_and_prompt_give_same_text(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        response = client.completions.create(
            model=MODEL,
            prompt="determinism",
            max_tokens=16,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text

    assert ask(42) == ask(42)
    assert ask(42) != ask(43)


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "shared system prompt " * 200  # 1,000 tokens, many full 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(
        model=MODEL, prompt=prompt + "and a new question", max_tokens=1
    )
    assert cached_tokens_of(first) == 0
    assert cached_tokens_of(second) == (usage_of(first).prompt_tokens // 16) * 16


def test_multi_turn_chat_hits_the_cache_for_the_whole_history(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a careful rack planner. " * 30},
        {"role": "user", "content": "Where does decode go?"},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, extra_body={"ignore_eos": True}
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And prefill?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    prompt_and_reply = usage_of(first).prompt_tokens + usage_of(first).completion_tokens
    # Everything up to the last full block of turn one's prompt plus reply is reused.
    assert cached_tokens_of(second) == (prompt_and_reply // 16) * 16


def test_stop_string_ends_generation_without_the_stop_text(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model=MODEL, prompt="stops", max_tokens=30, seed=1, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[41:47]  # somewhere inside the 11th-12th word
    cut = client.completions.create(
        model=MODEL,
        prompt="stops",
        max_tokens=30,
        seed=1,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


def test_min_tokens_holds_off_eos(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="short", max_tokens=500, seed=5, extra_body={"min_tokens": 300}
    )
    assert usage_of(response).completion_tokens >= 300


def test_reset_prefix_cache_in_dev_mode_forgets_what_the_engine_cached(
    start_sim: Callable[..., SimHandle],
) -> None:
    # vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1, answering
    # {"success": bool}; benchmarks reset engines between points with it
    plain = start_sim("--served-model-name", MODEL)
    assert httpx.post(f"{plain.url}/reset_prefix_cache", timeout=10).status_code == 404
    sim = start_sim("--served-model-name", MODEL, env={"VLLM_SERVER_DEV_MODE": "1"})
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    prompt = "shared system prompt " * 200
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cached_tokens_of(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1))
    reset = httpx.post(f"{sim.url}/reset_prefix_cache", timeout=10)
    assert reset.json() == {"success": True}
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cached_tokens_of(again) == 0


def test_the_api_server_tokenizes_a_text_prompt_before_the_queue_and_not_ids(
    start_sim: Callable[..., SimHandle], tmp_path: Path
) -> None:
    """A profile's ``frontend``: every request's API-server time, and a text prompt's
    tokenizing on top, between its arrival and its engine core's queue, as vLLM stamps them."""
    profile = load_profile().model_dump()
    profile["frontend"] = {"request_s": 0.2, "tokenize_per_token_s": 0.002}
    profile_file = tmp_path / "profile.yaml"
    profile_file.write_text(yaml.safe_dump(profile))
    log = tmp_path / "requests.jsonl"
    sim = start_sim(
        "--served-model-name", MODEL, "--profile", str(profile_file), "--request-log", str(log)
    )
    text = "tray" * 200  # 200 tokens of the simulator's 4 bytes each: 0.4 s to tokenize
    for request_id, prompt in (("text", text), ("ids", decode_token_ids(text.encode()))):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        answer = httpx.post(
            f"{sim.url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=60
        )
        assert answer.status_code == 200, answer.text
    lines = {line["request_id"]: line for line in map(json.loads, log.read_text().splitlines())}
    early = 0.001  # asyncio runs a timer up to its clock's resolution early
    assert lines["text"]["scheduled"] - lines["text"]["arrival"] >= 0.2 + 0.4 - early
    assert lines["ids"]["scheduled"] - lines["ids"]["arrival"] >= 0.2 - early
    assert lines["text"]["prompt"] == lines["ids"]["prompt"]  # the same prompt either way
