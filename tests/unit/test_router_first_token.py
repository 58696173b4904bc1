"""router/first_token.py: when a streamed completion's first token may come from its prefill
leg, and the decode leg that continues after it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.first_token import (
    continuation_fields,
    continued_prompt,
    first_token,
    sends_first_token,
)
from router.metrics import CHAT_ROUTE, COMPLETIONS_ROUTE

BODY: dict[str, Any] = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0,
    "ignore_eos": True,
}
PARAMS = {"remote_num_tokens": 20, "remote_block_ids": [[3, 4]]}  # 20 tokens in 2 blocks of 16


def reply(**choice: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-r1",
        "created": 7,
        "model": "m",
        "choices": [
            {"index": 0, "text": " the", "token_ids": [279], "finish_reason": "length", **choice}
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 1},
    }


def test_a_streamed_completion_of_plain_sampling_sends_its_first_token_from_prefill() -> None:
    assert sends_first_token(COMPLETIONS_ROUTE, BODY, prompt_as_ids=True)


@pytest.mark.parametrize(
    "change",
    [
        {"stream": False},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"n": 2},
        {"stop": ["\n"]},
        {"logprobs": 0},
        {"echo": True},
        {"presence_penalty": 0.1},
        {"frequency_penalty": 0.1},
        {"response_format": {"type": "json_object"}},
        {"suffix": "x"},
    ],
)
def test_a_request_that_reads_where_its_output_begins_does_not(change: dict[str, Any]) -> None:
    assert not sends_first_token(COMPLETIONS_ROUTE, {**BODY, **change}, prompt_as_ids=True)


def test_nor_a_chat_or_a_prompt_the_engines_tokenize_themselves() -> None:
    assert not sends_first_token(CHAT_ROUTE, BODY, prompt_as_ids=True)
    assert not sends_first_token(COMPLETIONS_ROUTE, BODY, prompt_as_ids=False)


def test_empty_stops_and_null_logprobs_read_the_same_anywhere() -> None:
    body = {**BODY, "stop": [], "logprobs": None, "echo": False, "n": 1}
    assert sends_first_token(COMPLETIONS_ROUTE, body, prompt_as_ids=True)


def test_the_prefills_token_becomes_the_streams_first_event() -> None:
    first = first_token(reply(), PARAMS, 16, BODY)
    assert first is not None and (first.token_id, first.text) == (279, " the")
    assert first.event.startswith(b"data: ") and first.event.endswith(b"\n\n")
    event = orjson.loads(first.event[6:])
    assert event["id"] == "cmpl-r1" and event["object"] == "text_completion"
    assert event["choices"] == [
        {"index": 0, "text": " the", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    assert "usage" not in event
    every_chunk = {**BODY, "stream_options": {"continuous_usage_stats": True}}
    continuous = first_token(reply(), PARAMS, 16, every_chunk)
    assert continuous is not None
    assert orjson.loads(continuous.event[6:])["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("choice", "params", "block_size"),
    [
        ({"finish_reason": "stop"}, PARAMS, 16),  # the end of sequence: decode says so
        ({"token_ids": None}, PARAMS, 16),  # an engine that does not return ids
        ({"text": " \ufffd"}, PARAMS, 16),  # half a UTF-8 character
        ({}, {**PARAMS, "remote_num_tokens": 19}, 16),  # the prefill left the last token
        ({}, {"remote_block_ids": [[3, 4]]}, 16),  # no count of computed tokens
        ({}, PARAMS, 0),  # the block size not known yet
        ({}, PARAMS, 10),  # the prompt fills its last block: no room for the token
        ({}, {**PARAMS, "remote_block_ids": [[3, 4, 5]]}, 7),  # the token would fill it
    ],
)
def test_no_first_token_where_decode_cannot_continue_after_it_exactly(
    choice: dict[str, Any], params: dict[str, Any], block_size: int
) -> None:
    assert first_token(reply(**choice), params, block_size, BODY) is None


def test_the_decode_leg_continues_after_the_token_with_one_fewer_to_make() -> None:
    assert continuation_fields(BODY) == {"max_tokens": 7}
    assert continuation_fields({**BODY, "min_tokens": 3}) == {"max_tokens": 7, "min_tokens": 2}
    assert continued_prompt(b'"prompt":[1,2,3]', 279) == b'"prompt":[1,2,3,279]'
