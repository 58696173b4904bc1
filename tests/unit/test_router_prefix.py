"""router/prefix.py: the prompt's block hashes and the index of what each prefill rank was sent."""

from __future__ import annotations

import pytest

from router.policy import prompt_bytes
from router.prefix import BLOCK_BYTES, PrefixIndex, block_hashes

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 400}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def blocks(body: dict[str, object]) -> tuple[bytes, ...]:
    return block_hashes(prompt_bytes(body))


def shared(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    """Leading blocks two prompts share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_only_full_blocks_are_hashed_and_each_covers_everything_before_it() -> None:
    assert block_hashes(b"x" * (BLOCK_BYTES - 1)) == ()
    one, two = (
        block_hashes(b"x" * (2 * BLOCK_BYTES + 5)),
        block_hashes(b"y" + b"x" * 3 * BLOCK_BYTES),
    )
    assert len(one) == 2 and len(set(one)) == 2
    # the same second block of bytes after a different first one hashes differently
    assert one[1] != block_hashes(b"y" * BLOCK_BYTES + b"x" * BLOCK_BYTES)[1]
    assert not set(one) & set(two)
    assert block_hashes(b"") == ()


def test_a_conversations_next_turn_extends_its_earlier_turns_blocks() -> None:
    first = [SYSTEM, user("fix the bug in pool.py " * 500)]
    second = [*first, {"role": "assistant", "content": "done"}, user("now add a test")]
    a, b = blocks({"messages": first}), blocks({"messages": second})
    assert len(a) > 3 and b[: len(a)] == a


def test_an_edited_history_shares_the_blocks_before_the_edit_only() -> None:
    first = [SYSTEM, user("fix the bug in pool.py " * 500)]
    edited = [SYSTEM, user("fix the bug in app.py " * 500)]
    a, b = blocks({"messages": first}), blocks({"messages": edited})
    system_blocks = len(prompt_bytes({"messages": [SYSTEM]})) // BLOCK_BYTES
    assert system_blocks >= 2 and shared(a, b) == system_blocks


def test_completions_sharing_a_head_share_its_blocks() -> None:
    head = "a shared document " * 1000
    a, b = blocks({"prompt": head + "question one"}), blocks({"prompt": head + "question two"})
    assert shared(a, b) == len(prompt_bytes({"prompt": head})) // BLOCK_BYTES


def test_the_index_finds_each_ranks_longest_leading_run() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 6 * BLOCK_BYTES)
    index.routed("p0#0", prompt[:4])
    index.routed("p1#1", prompt[:2])
    index.routed("p2#0", prompt[2:])  # not a prefix of it: found nowhere else's first block
    assert index.match(prompt) == {"p0#0": 4, "p1#1": 2}
    assert index.match(block_hashes(b"q" * 3 * BLOCK_BYTES)) == {}
    assert index.match(()) == {}


def test_the_least_recently_routed_blocks_are_forgotten_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    old, new = block_hashes(b"o" * 3 * BLOCK_BYTES), block_hashes(b"n" * 3 * BLOCK_BYTES)
    index.routed("p0#0", old)
    index.routed("p0#0", old[:1])  # routed again: the most recent
    index.routed("p1#0", new)
    assert len(index) == 4
    assert index.match(old) == {"p0#0": 1} and index.match(new) == {"p1#0": 3}


def test_a_reset_rank_holds_nothing_and_others_keep_theirs() -> None:
    index = PrefixIndex()
    prompt = block_hashes(b"p" * 3 * BLOCK_BYTES)
    index.routed("p0#0", prompt)
    index.routed("p1#0", prompt[:1])
    index.forget({"p0#0", "p0#1"})
    assert index.match(prompt) == {"p1#0": 1} and len(index) == 1


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)
