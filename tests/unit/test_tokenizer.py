"""The simulator's tokenizer: four bytes a token, stable prefixes, a re-tokenizable reply."""

from __future__ import annotations

from baton.core.sim_tokenizer import count_tokens, encode_token_ids, render_chat, word_for


def test_every_four_bytes_make_one_token() -> None:
    assert count_tokens(b"") == 0
    assert count_tokens(b"abcd") == 1
    assert count_tokens(b"abcde") == 2
    assert count_tokens("héllo".encode()) == 2  # six UTF-8 bytes


def test_token_id_prompt_has_one_token_per_id() -> None:
    assert count_tokens(encode_token_ids([1, 2, 3, 2**32 - 1])) == 4


def test_next_turn_prompt_starts_with_previous_prompt_and_reply() -> None:
    turn1 = [{"role": "user", "content": "first question"}]
    reply = "".join(word_for(0, b"d", i) for i in range(5))
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    assert render_chat(turn2).startswith(render_chat(turn1) + reply.encode())


def test_content_parts_render_their_text() -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render_chat(parts) == render_chat([{"role": "user", "content": "ab"}])


def test_generated_words_are_four_bytes_and_deterministic() -> None:
    words = [word_for(7, b"digest", i) for i in range(50)]
    assert all(len(word.encode()) == 4 and word.startswith(" ") for word in words)
    assert words == [word_for(7, b"digest", i) for i in range(50)]
    assert words != [word_for(8, b"digest", i) for i in range(50)]
