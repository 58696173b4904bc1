"""Which prefill DP ranks hold which prompt prefixes: an index of chained block hashes. Pure.

vLLM's prefix cache keys each full block of KV by a hash chained to the block before it, and a
request reuses the leading blocks it finds. The index keys a prompt the same way, in one of two
key spaces:

- **Token blocks**, where the gateway knows the engine's tokenizer (``router/tokens.py``):
  blocks of the engine's block size of the prompt's token ids, each key chained to the one
  before (:func:`token_block_keys`). These are the blocks the engine caches, so the engine's KV
  events (vLLM's ``--kv-events-config``) can say which of them each rank holds:
  :class:`KVEventLedger` turns each ``BlockStored`` into the same keys from its token ids and
  parent (the engine's own hashes depend on its seed and version; the gateway needs neither),
  and drops what ``BlockRemoved`` and ``AllBlocksCleared`` report gone. Gateway replicas that
  read the same events hold the same blocks, without talking to each other.
- **Byte blocks** otherwise: the prompt's bytes (``policy.prompt_bytes``, which a prompt
  continuing it starts with) in blocks of :data:`BLOCK_BYTES`, each hash covering every byte up
  to the block's end; no engine reports these.

Either way a prompt finds, on each rank, the longest run of leading blocks that rank holds,
whatever else the prompts share: a conversation's earlier turn, a system prompt, a document. The
gateway also records a prompt's blocks on the rank it routes the prompt to, when it routes it
(so that a request sharing the prefix and arriving while it runs follows it there). Without
events, what the engine evicts the index does not see; it forgets the least recently used blocks
past :data:`INDEX_BLOCKS`, and a rank's blocks when its engine is reset
(:meth:`PrefixIndex.forget`).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from baton.core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from baton.core.model import BYTES_PER_TOKEN

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_TOKENS",
    "INDEX_BLOCKS",
    "KVEventLedger",
    "PrefixIndex",
    "PromptBlocks",
    "block_hashes",
    "token_block_keys",
]

# About 1,024 tokens a block: fine enough that a turn's new text costs at most one block of
# estimate, coarse enough that a 500 KB prompt hashes in about a hundred steps.
BLOCK_BYTES = 4096
BLOCK_TOKENS = BLOCK_BYTES // BYTES_PER_TOKEN
# Blocks remembered, over every rank: with the engines' KV events, 16M tokens at 16 tokens a
# block in about 180 MB (176 resident bytes a block with its ledger entry: ``baton bench
# prefix-index``); of bytes, far more tokens (a block is about 1,024). The engines hold more
# still (a DEP2 prefill instance of the study's model, about 135M tokens), so
# ``--prefix-index-blocks`` raises it where the gateway has the memory.
INDEX_BLOCKS = 1_048_576


def block_hashes(prompt: bytes, block_bytes: int = BLOCK_BYTES) -> tuple[int, ...]:
    """The chained keys of ``prompt``'s full blocks: block i's covers bytes 0 to its end."""
    hasher = hashlib.blake2b(digest_size=8)
    view = memoryview(prompt)
    keys = []
    for end in range(block_bytes, len(prompt) + 1, block_bytes):
        hasher.update(view[end - block_bytes : end])
        keys.append(int.from_bytes(hasher.copy().digest(), "little"))
    return tuple(keys)


def token_block_keys(packed: bytes, block_size: int, parent: int | None = None) -> tuple[int, ...]:
    """The chained keys of the full blocks of ``packed`` (token ids, 4 little-endian bytes
    each): block i's key hashes block i-1's key (``parent`` before the first) and block i's
    token ids."""
    span = block_size * 4
    keys: list[int] = []
    link = b"" if parent is None else parent.to_bytes(8, "little")
    for start in range(0, len(packed) - span + 1, span):
        link = hashlib.blake2b(link + packed[start : start + span], digest_size=8).digest()
        keys.append(int.from_bytes(link, "little"))
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's block keys and the prompt tokens one block stands for."""

    keys: tuple[int, ...] = ()
    tokens_per_block: int = BLOCK_TOKENS


class PrefixIndex:
    """Block key -> the ranks (any names) holding a prompt with that prefix; least recently
    routed blocks forgotten first.

    Kept small, since it should cover what the engines hold (millions of blocks): a key is a
    64-bit int, and its holders are a bit mask over rank slots, one object per distinct mask; a
    plain dict's insertion order is the recency (a touched block is re-inserted), and past the
    capacity the oldest 1/64 goes at once, so that finding them costs one pass now and then.
    """

    def __init__(self, capacity_blocks: int = INDEX_BLOCKS) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, int] = {}
        self._slots: dict[str, int] = {}  # rank -> its bit's position
        self._ranks: dict[int, str] = {}  # and back
        self._masks: dict[int, int] = {}  # one int object per mask in use

    def __len__(self) -> int:
        return len(self._holders)

    def slot(self, rank: str) -> int:
        """``rank``'s bit position, given it on first sight (the lowest free one)."""
        position = self._slots.get(rank)
        if position is None:
            position = next(i for i in range(len(self._ranks) + 1) if i not in self._ranks)
            self._slots[rank] = position
            self._ranks[position] = rank
        return position

    def rank(self, position: int) -> str:
        return self._ranks[position]

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Per rank holding the first block, how many leading blocks of ``keys`` it holds."""
        matched: dict[str, int] = {}
        alive = 0
        for depth, key in enumerate(keys):
            mask = self._holders.get(key, 0)
            if depth == 0:
                alive = mask
            elif lost := alive & ~mask:
                self._record(matched, lost, depth)
                alive &= mask
            if not alive:
                return matched
        self._record(matched, alive, len(keys))
        return matched

    def _record(self, matched: dict[str, int], bits: int, depth: int) -> None:
        while bits:
            low = bits & -bits
            matched[self._ranks[low.bit_length() - 1]] = depth
            bits ^= low

    def routed(self, rank: str, keys: Sequence[int]) -> None:
        """``rank`` was sent a prompt of ``keys``, or reported it stores them: it holds them
        (most recent now)."""
        bit = 1 << self.slot(rank)
        holders, masks = self._holders, self._masks
        for key in keys:
            mask = holders.pop(key, 0) | bit
            holders[key] = masks.setdefault(mask, mask)
        if len(holders) > self.capacity_blocks:
            excess = len(holders) - self.capacity_blocks + self.capacity_blocks // 64
            for key in list(itertools.islice(holders, excess)):
                del holders[key]
        if len(masks) > _MASKS_KEPT:  # masks of ranks long gone; the live ones return
            masks.clear()

    def removed(self, rank: str, keys: Collection[int]) -> None:
        """``rank`` no longer holds ``keys`` (its engine evicted them)."""
        position = self._slots.get(rank)
        if position is None:
            return
        bit = 1 << position
        for key in keys:
            mask = self._holders.get(key, 0)
            if mask & bit:
                if rest := mask & ~bit:
                    self._holders[key] = self._masks.setdefault(rest, rest)  # keeps its place
                else:
                    del self._holders[key]

    def forget(self, ranks: set[str]) -> None:
        """``ranks`` hold nothing any more (their engine restarted, or left the pool); their
        slots are free for others."""
        positions = [self._slots.pop(rank) for rank in ranks if rank in self._slots]
        if not positions:
            return
        bits = sum(1 << position for position in positions)
        changed = {key: mask & ~bits for key, mask in self._holders.items() if mask & bits}
        for key, mask in changed.items():
            if mask:
                self._holders[key] = self._masks.setdefault(mask, mask)
            else:
                del self._holders[key]
        for position in positions:
            del self._ranks[position]
        self._masks.clear()


# Distinct holder masks interned before the table is dropped and rebuilt as blocks are touched.
_MASKS_KEPT = 65_536


class KVEventLedger:
    """vLLM's KV events applied to a :class:`PrefixIndex`: per DP rank, the engine's block hashes
    and the index keys they stand for, and each publisher's last sequence number.

    A rank is named as the index names it (``<url>#<rank>``). A ``BlockStored`` whose parent the
    ledger never saw (it joined after the parent was stored, or forgot it) is skipped: its keys
    cannot be made, and a prompt cannot reach them past the unknown parent anyway. A gap in a
    publisher's sequence numbers (its socket dropped batches) forgets the rank, since what went
    missing may have evicted anything. Only the GPU tier's first KV cache group counts: a
    hybrid model's other groups (sliding windows) free blocks a prefix hit does not need, and an
    offload tier's removals leave the GPU's copy. An engine's hash is kept as 64 bits of it
    beside the rank's slot in the index, in one int.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.block_size = 0  # the engines' tokens per KV block, from their events (0: none yet)
        # (rank slot, engine hash) -> index key, in the order stored
        self._keys: dict[int, int] = {}
        self._sequence: dict[str, int] = {}
        self.held: dict[str, int] = {}  # per rank, the blocks it reports holding
        self.gaps = 0  # publishers' sequence gaps seen
        self.skipped_blocks = 0  # stored blocks whose parent was unknown

    def apply(self, rank: str, sequence: int, batch: KVEventBatch) -> None:
        """One batch as DP rank ``rank``'s publisher numbered it."""
        last = self._sequence.get(rank)
        if last is not None and sequence != last + 1:
            self.gaps += 1
            self.forget({rank})
        self._sequence[rank] = sequence
        for event in batch.events:
            if isinstance(event, BlockStored):
                if _counts(event.medium, event.group_idx):
                    self._stored(rank, event)
            elif isinstance(event, BlockRemoved):
                if _counts(event.medium, event.group_idx):
                    slot = self.index.slot(rank)
                    keys = {
                        key
                        for engine_hash in event.block_hashes
                        if (key := self._keys.pop(_entry(slot, engine_hash), None)) is not None
                    }
                    if keys:
                        self.held[rank] -= len(keys)
                        self.index.removed(rank, keys)
            elif isinstance(event, AllBlocksCleared):
                self.forget({rank})

    def _stored(self, rank: str, event: BlockStored) -> None:
        size = event.block_size
        self.block_size = size
        slot = self.index.slot(rank)
        parent = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(_entry(slot, event.parent_block_hash))
            if parent is None:
                self.skipped_blocks += len(event.block_hashes)
                return
        # keyed as the gateway keys a prompt: one rule, so the two always meet
        packed = struct.pack(f"<{len(event.token_ids)}I", *event.token_ids)
        keys = token_block_keys(packed, size, parent)[: len(event.block_hashes)]
        added = 0
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            entry = _entry(slot, engine_hash)
            if self._keys.pop(entry, None) is None:
                added += 1
            self._keys[entry] = key
        self.held[rank] = self.held.get(rank, 0) + added
        if len(self._keys) > self.index.capacity_blocks:  # the index's bound holds here too
            excess = len(self._keys) - self.index.capacity_blocks
            for entry in list(itertools.islice(self._keys, excess)):
                del self._keys[entry]
                self.held[self.index.rank(entry >> 64)] -= 1
        self.index.routed(rank, keys)

    def forget(self, ranks: set[str]) -> None:
        """What ``ranks`` hold is unknown from now: their blocks leave the index and ledger."""
        slots = {self.index.slot(rank) for rank in ranks if rank in self.held}
        if slots:
            self._keys = {e: key for e, key in self._keys.items() if e >> 64 not in slots}
        for rank in ranks:
            self.held.pop(rank, None)
        self.index.forget(ranks)

    def __len__(self) -> int:
        return len(self._keys)


def _entry(slot: int, engine_hash: BlockHash) -> int:
    """A rank's slot and 64 bits of an engine's block hash (an int, or bytes) in one int."""
    if isinstance(engine_hash, bytes):
        engine_hash = int.from_bytes(engine_hash[:8], "little")
    return slot << 64 | engine_hash & _LOW_64


_LOW_64 = (1 << 64) - 1


def _counts(medium: str | None, group_idx: int | None) -> bool:
    return (medium is None or medium.upper() == "GPU") and not group_idx
