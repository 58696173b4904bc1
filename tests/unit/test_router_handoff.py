"""What the handoff checks of a prefill's ``kv_transfer_params`` before decode is called."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.handoff import missing_blocks


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
