"""A cheap deterministic tokenizer and chat template for the simulator.

The rule: text is UTF-8 encoded and every 4 bytes make one token (the last token may be short).
A prompt given as token ids is the same thing backwards: each id is packed as 4 little-endian
bytes. So a byte-identical prefix always yields identical leading tokens and identical KV
blocks, the property prefix caching and P/D handoff depend on, and token counts are stable
for every caller (gateway, benchmarks, tests) without a vocabulary file.

Generated tokens are 4-byte words (a space and three letters), so the text of a reply,
rendered back into the next turn's prompt, tokenizes into the same tokens again.

The chat template renders every message as ``<|role|>content<|end|>`` and ends with
``<|assistant|>``; turn k+1's prompt therefore starts with turn k's prompt plus its reply.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence

from baton.core.model import BYTES_PER_TOKEN

__all__ = [
    "BYTES_PER_TOKEN",
    "count_tokens",
    "decode_token_ids",
    "encode_token_ids",
    "render_chat",
    "word_for",
]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def count_tokens(data: bytes) -> int:
    """Tokens in ``data`` under the 4-bytes-per-token rule."""
    return -(-len(data) // BYTES_PER_TOKEN)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """The byte string whose tokens are ``token_ids`` (ids must fit in 32 bits)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def decode_token_ids(data: bytes) -> list[int]:
    """The token ids of ``data`` (whole tokens only): ``encode_token_ids`` backwards."""
    return list(
        struct.unpack(
            f"<{len(data) // BYTES_PER_TOKEN}I",
            data[: len(data) // BYTES_PER_TOKEN * BYTES_PER_TOKEN],
        )
    )


def _content_text(content: object) -> str:
    # OpenAI content is a string or a list of parts; only text parts carry tokens here.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def render_chat(
    messages: Iterable[Mapping[str, object]], add_generation_prompt: bool = True
) -> bytes:
    """Render chat messages with the simulator's template, as UTF-8 bytes."""
    parts = [
        f"<|{message.get('role', 'user')}|>{_content_text(message.get('content'))}<|end|>"
        for message in messages
    ]
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts).encode()


def word_for(seed: int, prompt_digest: bytes, index: int) -> str:
    """The ``index``-th generated word for a prompt and a sampling seed: deterministic."""
    digest = hashlib.blake2b(
        prompt_digest + struct.pack("<qq", seed, index), digest_size=8
    ).digest()
    value = int.from_bytes(digest, "little")
    return " " + "".join(_LETTERS[(value >> (5 * i)) % 26] for i in range(3))
