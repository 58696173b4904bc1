"""What the handoff sends each leg, and checks of a prefill's ``kv_transfer_params`` before
decode is called."""

from __future__ import annotations

import json

import orjson
from hypothesis import given
from hypothesis import strategies as st

from router.handoff import decode_body, missing_blocks, prefill_body


def params(groups: object, tokens: object) -> dict[str, object]:
    return {"remote_block_ids": groups, "remote_num_tokens": tokens, "do_remote_prefill": True}


def test_a_prompt_of_362_tokens_needs_three_blocks_of_128() -> None:
    # vLLM CPU's block size; one block short makes a decode engine assert and die
    assert missing_blocks(params([[1, 2, 3]], 362), 128) == 0
    assert missing_blocks(params([[1, 2]], 362), 128) == 1
    assert missing_blocks(params([[1]], 362), 128) == 2


def test_groups_with_larger_blocks_or_one_state_block_beside_the_full_group_pass() -> None:
    assert missing_blocks(params([[1, 2, 3], [9]], 362), 128) == 0
    assert missing_blocks(params([[1, 2, 3], []], 362), 128) == 1  # a group with no block


def test_before_the_block_size_is_known_only_an_empty_handoff_is_short() -> None:
    assert missing_blocks(params([[1]], 5000), 0) == 0
    assert missing_blocks(params([[]], 5000), 0) == 1


def test_params_of_a_shape_vllm_never_writes_are_short_and_silence_is_not() -> None:
    assert missing_blocks(params(None, 10), 16) == 1
    assert missing_blocks(params([], 10), 16) == 1
    assert missing_blocks(params([1, 2], 10), 16) == 1
    assert missing_blocks(params([[1]], "10"), 16) == 1
    assert missing_blocks({"remote_block_ids": [[1]]}, 16) == 0  # no token count to check


@given(st.integers(1, 100_000), st.integers(1, 512))
def test_exactly_the_blocks_the_prompt_fills_are_enough(tokens: int, block_size: int) -> None:
    needed = -(-tokens // block_size)
    assert missing_blocks(params([list(range(needed))], tokens), block_size) == 0
    assert missing_blocks(params([list(range(needed - 1))], tokens), block_size) == 1


def test_the_prefill_leg_is_the_clients_bytes_with_its_own_fields_read_last() -> None:
    # The prompt is never serialized again for a leg: a 500 KB system prompt cost the gateway
    # a second serialization per request. JSON readers keep a key's last value.
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief " * 1000}],
        "max_completion_tokens": 64,
        "min_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = json.dumps(body, indent=2).encode()
    leg = prefill_body(raw, body)
    assert leg.startswith(raw.rstrip()[:-1].rstrip())  # the client's bytes, as sent
    read = json.loads(leg)
    assert read["messages"] == body["messages"]
    assert (read["max_completion_tokens"], read["max_tokens"], read["min_tokens"]) == (1, 1, 0)
    assert read["stream"] is False and read["stream_options"] is None
    assert read["kv_transfer_params"]["do_remote_decode"] is True
    assert orjson.loads(leg) == read
    assert json.loads(prefill_body(b"{}", {}))["max_tokens"] == 1  # an empty body stays JSON


def test_both_legs_carry_the_prompts_ids_over_the_clients_text() -> None:
    body = {"model": "m", "prompt": "which rank", "max_tokens": 8}
    raw = json.dumps(body).encode()
    ids = b'"prompt":[1,2,3]'
    params = {"remote_engine_id": "e"}
    for leg in (
        prefill_body(raw, body, ids),
        decode_body(raw, params, ids),
        decode_body(raw, None, ids),
    ):
        assert leg.startswith(raw[:-1])  # the client's bytes, as sent
        assert json.loads(leg)["prompt"] == [1, 2, 3] == orjson.loads(leg)["prompt"]
    assert json.loads(decode_body(raw, params, ids))["kv_transfer_params"] == params
    assert decode_body(raw, None) == raw  # no ids, no KV: the client's bytes, untouched
