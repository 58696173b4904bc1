"""Which prefill DP ranks hold which prompt prefixes: an index of chained block hashes. Pure.

vLLM's prefix cache keys each full block of KV by a hash chained to the block before it, and a
request reuses the leading blocks it finds. The gateway does not tokenize, so it indexes the
prompt's bytes the same way (``policy.prompt_bytes``, which a prompt continuing it starts with):
blocks of :data:`BLOCK_BYTES`, each hash covering every byte up to the block's end. A prompt
then finds, on each rank, the longest run of leading blocks that rank was sent, whatever else
the prompts share: a conversation's earlier turn, a system prompt, a document.

The gateway records a prompt's blocks on the rank it routes the prompt to, when it routes it
(so that a request sharing the prefix and arriving while it runs follows it there). What the
engine evicts later the index does not see; it forgets the least recently routed blocks past
:data:`INDEX_BLOCKS`, and a rank's blocks when its engine is reset (:meth:`PrefixIndex.forget`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from baton.core.model import BYTES_PER_TOKEN

__all__ = ["BLOCK_BYTES", "BLOCK_TOKENS", "INDEX_BLOCKS", "PrefixIndex", "block_hashes"]

# About 1,024 tokens a block: fine enough that a turn's new text costs at most one block of
# estimate, coarse enough that a 500 KB prompt hashes in about a hundred steps.
BLOCK_BYTES = 4096
BLOCK_TOKENS = BLOCK_BYTES // BYTES_PER_TOKEN
# Blocks remembered, over every rank: about 256M tokens of prefixes (two racks' prefill
# instances hold about as much) in about 50 MB (measured with tracemalloc).
INDEX_BLOCKS = 262_144


def block_hashes(prompt: bytes, block_bytes: int = BLOCK_BYTES) -> tuple[bytes, ...]:
    """The chained hashes of ``prompt``'s full blocks: block i's covers bytes 0 to its end."""
    hasher = hashlib.blake2b(digest_size=16)
    view = memoryview(prompt)
    hashes = []
    for end in range(block_bytes, len(prompt) + 1, block_bytes):
        hasher.update(view[end - block_bytes : end])
        hashes.append(hasher.copy().digest())
    return tuple(hashes)


class PrefixIndex:
    """Block hash -> the ranks (any names) sent a prompt with that prefix; least recently
    routed blocks forgotten first."""

    def __init__(self, capacity_blocks: int = INDEX_BLOCKS) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        # a tuple, not a set, of holders: a block has one or two, and a set costs 200 bytes
        self._holders: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per rank holding the first block, how many leading blocks of ``hashes`` it holds."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, digest in enumerate(hashes, 1):
            holders = self._holders.get(digest, ())
            if alive is None:
                alive = set(holders)
            else:
                alive.intersection_update(holders)
            if not alive:
                break
            for rank in alive:
                matched[rank] = depth
        return matched

    def routed(self, rank: str, hashes: Sequence[bytes]) -> None:
        """``rank`` was sent a prompt of ``hashes``: it holds them (most recent now)."""
        for digest in hashes:
            holders = self._holders.pop(digest, ())
            self._holders[digest] = holders if rank in holders else (*holders, rank)
        while len(self._holders) > self.capacity_blocks:
            self._holders.popitem(last=False)

    def forget(self, ranks: set[str]) -> None:
        """``ranks`` hold nothing any more (their engine restarted, or left the pool)."""
        changed = {
            digest: tuple(h for h in holders if h not in ranks)
            for digest, holders in self._holders.items()
            if not ranks.isdisjoint(holders)
        }
        for digest, holders in changed.items():
            if holders:
                self._holders[digest] = holders  # an existing key keeps its place
            else:
                del self._holders[digest]
