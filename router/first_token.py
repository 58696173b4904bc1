"""The first token from the prefill leg: when a streamed completion may have it sent at once.

vLLM's prefill leg samples one token (``max_tokens=1``) from the logits of the whole prompt,
the token a single engine would stream first, and the decode engine then computes it again
after pulling the KV. A gateway that has the prompt as the engines' ids can send that token to
the client as soon as the prefill answers, and ask the decode engine to continue after it: the
prompt's ids and the token, one token fewer. The client's first token then no longer waits for
the KV pull and the decode engine's first step.

This is only the same stream a single engine would give where nothing in the request depends
on where the prompt ends and the output begins, and where the decode engine can take the
longer prompt from the same KV blocks. This module decides both, without I/O; the handoff
(``router.handoff``) acts on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from router.metrics import COMPLETIONS_ROUTE

__all__ = [
    "FirstToken",
    "continuation_fields",
    "continued_prompt",
    "first_token",
    "sends_first_token",
]

# Request fields that read the same wherever the output begins. Not here, among others:
# presence and frequency penalties (they count output tokens, and the first would count as
# prompt), logprobs and echo (the first token's would be missing), structured output (the
# grammar would start again after the first token), suffix, best_of.
_POSITION_FREE = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "user",
        "ignore_eos",
        "min_tokens",
        "repetition_penalty",
        "stop_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "priority",
        "n",
        "stop",  # only when empty: a stop string could span the first token and the next
        "logprobs",  # only when null
        "echo",  # only when false
    }
)


def sends_first_token(route: str, body: Mapping[str, object], prompt_as_ids: bool) -> bool:
    """Whether this request's prefill leg should return its token's id, for the client to have
    it at once: a streamed completion of one choice and at least two tokens, with its prompt
    sent as the engines' ids, and only fields that read the same wherever the output begins."""
    if route != COMPLETIONS_ROUTE or body.get("stream") is not True or not prompt_as_ids:
        return False
    if not _POSITION_FREE.issuperset(body):
        return False
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2:
        return False
    return (
        body.get("n") in (None, 1)
        and not body.get("stop")
        and body.get("logprobs") is None
        and not body.get("echo")
    )


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill leg's sampled token: its id, its text, and the SSE event that sends it."""

    token_id: int
    text: str
    event: bytes


def first_token(
    reply: Mapping[str, object],
    kv_transfer_params: Mapping[str, object],
    block_size: int,
    body: Mapping[str, object],
) -> FirstToken | None:
    """The token the prefill ``reply`` sampled, where the decode engine can continue after it,
    else None (the decode engine then makes the first token itself, as without this).

    - The prefill ended at its one token (``length``): a stop or an end of sequence there is
      the whole answer, which the decode leg gives as before.
    - Its text is whole: a token ending inside a UTF-8 character has text only with the next.
    - The prefill engine computed every prompt token (``remote_num_tokens``): an engine that
      leaves the last ones to the decode engine (Mamba state, a sliding window replayed,
      multi-token prediction) sampled no token of the model's.
    - The prefill's last block has room for the token and one more: a decode engine allocates
      blocks for the longer prompt and asserts that the prefill side holds as many
      (``_apply_prefix_caching`` in vLLM's NIXL connector), and a block the token would fill
      would be cached there before the decode engine recomputes the token's KV in it.

    ``body``: the client's request; the event carries usage where it asked for usage in every
    chunk (``stream_options.continuous_usage_stats``)."""
    choices = reply.get("choices")
    usage = reply.get("usage")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(usage, dict):
        return None
    choice = choices[0]
    if not isinstance(choice, dict) or choice.get("finish_reason") != "length":
        return None
    ids, text = choice.get("token_ids"), choice.get("text")
    if not isinstance(ids, list) or len(ids) != 1 or not isinstance(ids[0], int):
        return None
    if not isinstance(text, str) or "\ufffd" in text:
        return None
    prompt_tokens = usage.get("prompt_tokens")
    if not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
        return None
    if kv_transfer_params.get("remote_num_tokens") != prompt_tokens or block_size <= 0:
        return None
    groups = kv_transfer_params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
        return None
    if max(len(group) for group in groups) * block_size < prompt_tokens + 2:
        return None
    event = {
        "id": reply.get("id"),
        "object": "text_completion",
        "created": reply.get("created"),
        "model": reply.get("model"),
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        ],
    }
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        event["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
        }
    return FirstToken(ids[0], text, b"data: " + orjson.dumps(event) + b"\n\n")


def continuation_fields(body: Mapping[str, object]) -> dict[str, object]:
    """The decode leg's fields once the first token is sent: one token fewer to generate (and
    to generate at least)."""
    max_tokens = body["max_tokens"]
    assert isinstance(max_tokens, int)  # sends_first_token admitted only an int
    fields: dict[str, object] = {"max_tokens": max_tokens - 1}
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        fields["min_tokens"] = min_tokens - 1
    return fields


def continued_prompt(prompt: bytes, token_id: int) -> bytes:
    """The ``"prompt": [ids]`` field with the first token's id after the prompt's."""
    return prompt[:-1] + b",%d]" % token_id
