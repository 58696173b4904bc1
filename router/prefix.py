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
import struct
from collections import OrderedDict
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
# Blocks remembered, over every rank: of bytes, about 256M tokens of prefixes (two racks'
# prefill instances hold about as much) in about 50 MB (measured with tracemalloc); of the
# engines' token blocks, with their KV events, 4M tokens at 16 tokens a block in about 75 MB
# (about 280 bytes a block with its ledger entry, measured by RSS): far less than the engines
# hold, so ``--prefix-index-blocks`` raises it.
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


def token_block_keys(packed: bytes, block_size: int, parent: bytes = b"") -> tuple[bytes, ...]:
    """The chained keys of the full blocks of ``packed`` (token ids, 4 little-endian bytes
    each): block i's key hashes block i-1's key (``parent`` before the first) and block i's
    token ids."""
    span = block_size * 4
    keys: list[bytes] = []
    for start in range(0, len(packed) - span + 1, span):
        parent = hashlib.blake2b(parent + packed[start : start + span], digest_size=16).digest()
        keys.append(parent)
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's block keys and the prompt tokens one block stands for."""

    keys: tuple[bytes, ...] = ()
    tokens_per_block: int = BLOCK_TOKENS


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
        """``rank`` was sent a prompt of ``hashes``, or reported it stores them: it holds them
        (most recent now)."""
        for digest in hashes:
            holders = self._holders.pop(digest, ())
            self._holders[digest] = holders if rank in holders else (*holders, rank)
        while len(self._holders) > self.capacity_blocks:
            self._holders.popitem(last=False)

    def removed(self, rank: str, hashes: Collection[bytes]) -> None:
        """``rank`` no longer holds ``hashes`` (its engine evicted them)."""
        for digest in hashes:
            holders = self._holders.get(digest)
            if holders is None or rank not in holders:
                continue
            rest = tuple(h for h in holders if h != rank)
            if rest:
                self._holders[digest] = rest
            else:
                del self._holders[digest]

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


class KVEventLedger:
    """vLLM's KV events applied to a :class:`PrefixIndex`: per DP rank, the engine's block hashes
    and the index keys they stand for, and each publisher's last sequence number.

    A rank is named as the index names it (``<url>#<rank>``). A ``BlockStored`` whose parent the
    ledger never saw (it joined after the parent was stored, or forgot it) is skipped: its keys
    cannot be made, and a prompt cannot reach them past the unknown parent anyway. A gap in a
    publisher's sequence numbers (its socket dropped batches) forgets the rank, since what went
    missing may have evicted anything. Only the GPU tier's first KV cache group counts: a
    hybrid model's other groups (sliding windows) free blocks a prefix hit does not need, and an
    offload tier's removals leave the GPU's copy.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.block_size = 0  # the engines' tokens per block, from their events (0: none yet)
        self._keys: OrderedDict[tuple[str, BlockHash], bytes] = OrderedDict()
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
                    keys = {
                        key
                        for engine_hash in event.block_hashes
                        if (key := self._keys.pop((rank, engine_hash), None)) is not None
                    }
                    self.held[rank] = self.held.get(rank, 0) - len(keys)
                    self.index.removed(rank, keys)
            elif isinstance(event, AllBlocksCleared):
                self.forget({rank})

    def _stored(self, rank: str, event: BlockStored) -> None:
        size = event.block_size
        self.block_size = size
        parent = b""
        if event.parent_block_hash is not None:
            known = self._keys.get((rank, event.parent_block_hash))
            if known is None:
                self.skipped_blocks += len(event.block_hashes)
                return
            parent = known
        # keyed as the gateway keys a prompt: one rule, so the two always meet
        packed = struct.pack(f"<{len(event.token_ids)}I", *event.token_ids)
        keys = token_block_keys(packed, size, parent)[: len(event.block_hashes)]
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            if (rank, engine_hash) not in self._keys:
                self.held[rank] = self.held.get(rank, 0) + 1
            self._keys[(rank, engine_hash)] = key
            self._keys.move_to_end((rank, engine_hash))
        while len(self._keys) > self.index.capacity_blocks:  # the index's bound holds here too
            (oldest, _), _ = self._keys.popitem(last=False)
            self.held[oldest] -= 1
        self.index.routed(rank, keys)

    def forget(self, ranks: set[str]) -> None:
        """What ``ranks`` hold is unknown from now: their blocks leave the index and ledger."""
        for key in [key for key in self._keys if key[0] in ranks]:
            del self._keys[key]
        for rank in ranks:
            self.held.pop(rank, None)
        self.index.forget(ranks)

    def __len__(self) -> int:
        return len(self._keys)


def _counts(medium: str | None, group_idx: int | None) -> bool:
    return (medium is None or medium.upper() == "GPU") and not group_idx
