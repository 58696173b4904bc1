"""A streamed completion's first token from its prefill leg (``router/first_token.py``): the
client has it when the prefill answers, and the decode engine continues after it, its prompt
the prompt's ids and that token."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.helpers import SimHandle, eventually, scrape, usage_of
from tests.integration.test_gateway import LONG, MODEL, Stack, start_engine

FIRST = "baton_gateway_first_tokens_from_prefill_total"
BLOCK = 16  # the simulator's default KV block, in tokens of 4 bytes
PROMPT = LONG + "abcd" * 5  # 565 tokens: room in its last block for the first token


@pytest.fixture
def stack(start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]) -> Stack:
    """A prefill instance and a DP2 decode engine behind a gateway that has the engines'
    tokenizer, so that completion prompts go to them as ids."""
    prefill = start_engine(start_sim)
    decode = start_engine(start_sim, "--data-parallel-size", "2")
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--prefill={prefill.url}",
        f"--decode={decode.url}@0-1",
        "--tokenizer",
        "sim",
        "--pd-threshold-tokens",
        "0",
        "--first-token-timeout",
        "5",
        "--first-token-from-prefill",
    )
    return Stack(gateway, [prefill], decode)


def stream(stack: Stack, prompt: str = PROMPT, **fields: Any) -> tuple[list[str], Any]:
    """A streamed completion's texts, chunk by chunk, and its usage."""
    chunks = list(
        stack.client().completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **{"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}, **fields},
        )
    )
    return [c.choices[0].text for c in chunks if c.choices], usage_of(chunks[-1])


@contextmanager
def raw_stream(stack: Stack, **fields: Any) -> Iterator[Iterator[str]]:
    """A streamed completion of PROMPT read by hand: its data payloads, as they come."""
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, **fields}
    headers = {"Authorization": "Bearer k"}
    url = f"{stack.gateway.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30, headers=headers) as response:
        assert response.status_code == 200
        yield (line[6:] for line in response.iter_lines() if line.startswith("data: "))


def engine_tokens(engine: SimHandle) -> tuple[float, float]:
    return (
        scrape(engine.url, "vllm:prompt_tokens_total"),
        scrape(engine.url, "vllm:generation_tokens_total"),
    )


def test_the_first_token_comes_from_prefill_and_decode_continues_after_it(stack: Stack) -> None:
    prompt_tokens = len(PROMPT.encode()) // 4
    direct = httpx.post(
        f"{stack.prefill[0].url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
        timeout=30,
    ).json()
    decode_before = engine_tokens(stack.decode)
    texts, usage = stream(stack)
    assert stack.gateway_metric(FIRST) == 1
    # the first chunk is the token the prefill engine samples for this prompt
    assert texts[0] == direct["choices"][0]["text"]
    assert len("".join(texts)) == 6 * 4  # six whole tokens, none twice
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 6)
    # the decode engine's prompt was the prompt and that token, and it made the five others
    eventually(
        lambda: (
            engine_tokens(stack.decode)
            == (decode_before[0] + prompt_tokens + 1, decode_before[1] + 5)
        )
    )
    stack.assert_nothing_leaked()


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 0.5},  # counts output tokens: the first would count as prompt
        {"logprobs": 1},
        {"stop": [" zzz"]},
        {"max_tokens": 1},
    ],
    ids=["penalty", "logprobs", "stop", "one_token"],
)
def test_a_request_that_reads_where_its_output_begins_has_its_first_token_from_decode(
    stack: Stack, fields: dict[str, Any]
) -> None:
    texts, usage = stream(stack, **fields)
    assert stack.gateway_metric(FIRST) == 0
    assert len("".join(texts)) == usage.completion_tokens * 4


def test_a_prompt_that_ends_its_last_block_has_its_first_token_from_decode(stack: Stack) -> None:
    # with the token the decode engine's prompt would need a block the prefill does not hold
    for tokens in (4 * BLOCK, 4 * BLOCK - 1):
        texts, usage = stream(stack, prompt="abcd" * tokens)
        assert usage.prompt_tokens == tokens and len("".join(texts)) == 6 * 4
    assert stack.gateway_metric(FIRST) == 0
    assert httpx.get(f"{stack.decode.url}/health", timeout=10).status_code == 200


def test_a_decode_failure_after_the_first_token_is_retried_and_the_stream_goes_on(
    stack: Stack,
) -> None:
    stack.fault(stack.decode, action="fail_requests", count=1, status=500)
    texts, usage = stream(stack)
    assert stack.gateway_metric(FIRST) == 1
    assert len("".join(texts)) == 6 * 4 and usage.completion_tokens == 6
    assert stack.gateway_metric("baton_gateway_retries_total", phase="decode") == 1
    # the failed rank received the handoff, so the retry decodes alone (and the prefill
    # instance holds the blocks until their lease expires)
    assert stack.gateway_metric("baton_gateway_fallbacks_total", reason="decode_retry") == 1
    eventually(lambda: stack.gateway_metric("baton_gateway_in_flight_requests") == 0)


def test_when_every_decode_attempt_fails_the_stream_ends_with_an_error_event(
    stack: Stack,
) -> None:
    stack.fault(stack.decode, action="fail_requests", count=10, status=500)
    with raw_stream(stack, max_tokens=6) as payloads:
        events = list(payloads)
    assert events[-1] == "[DONE]"
    assert len(json.loads(events[0])["choices"][0]["text"]) == 4  # the prefill's token
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    assert stack.gateway_metric("baton_gateway_requests_total", outcome="stream_error") == 1
    eventually(lambda: stack.gateway_metric("baton_gateway_in_flight_requests") == 0)


def test_a_client_gone_after_the_first_token_aborts_the_decode_leg(stack: Stack) -> None:
    with raw_stream(stack, max_tokens=100_000, ignore_eos=True) as payloads:
        assert len(json.loads(next(payloads))["choices"][0]["text"]) == 4
        next(payloads)  # the decode leg's first token: it is streaming
    assert stack.gateway_metric(FIRST) == 1
    eventually(
        lambda: (
            stack.gateway_metric("baton_gateway_requests_total", outcome="client_disconnect") == 1
        )
    )
    stack.assert_nothing_leaked()
