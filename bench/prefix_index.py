"""``baton bench prefix-index``: what the gateway's prefix index costs per block it remembers.

With the engines' KV events the index should cover what the prefill engines hold, millions of
blocks, so its bytes a block decide how much of that a gateway can remember. One process,
one index (``router/prefix.py``) with its KV-event ledger, filled as the engines' events fill
it: ``BLOCKS`` blocks over ``RANKS`` prefill DP ranks, 16 tokens a block, each ``BlockStored``
a chain of 16 blocks after the previous one's last, the engine's hashes 64-bit ints (the
simulator's; vLLM's 32-byte ones cost more in the old layout, the same in the new). Reported:
the growth of the process's resident memory per block, the microseconds to apply one block's
event, and to match a prompt of ``MATCH_BLOCKS`` blocks, every rank holding its first half.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from baton.core.kv_events import BlockHash, BlockStored, KVEventBatch
from router.prefix import KVEventLedger, PrefixIndex, token_block_keys

__all__ = ["run"]

BLOCKS, RANKS, BLOCK_SIZE, EVENT_BLOCKS = 1_048_576, 36, 16, 16
MATCH_BLOCKS, MATCHES = 640, 500


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(quick: bool = False) -> dict[str, object]:
    blocks = BLOCKS // 8 if quick else BLOCKS
    index = PrefixIndex(blocks)
    ledger = KVEventLedger(index)
    gc.collect()
    before = _resident_bytes()
    began = time.perf_counter()
    span = BLOCK_SIZE * EVENT_BLOCKS
    for rank in range(RANKS):
        name, parent = f"http://10.0.{rank}.1:8000#0", None
        for event in range(blocks // RANKS // EVENT_BLOCKS):
            hashes: list[BlockHash] = [
                (rank << 40) + event * EVENT_BLOCKS + i for i in range(EVENT_BLOCKS)
            ]
            first = rank * 10**8 + event * span
            stored = BlockStored(
                hashes, parent, list(range(first, first + span)), BLOCK_SIZE, None, "GPU", None
            )
            ledger.apply(name, event, KVEventBatch(0.0, [stored]))
            parent = hashes[-1]
    applied = time.perf_counter() - began
    grown = _resident_bytes() - before
    prompt = token_block_keys(np.arange(MATCH_BLOCKS * BLOCK_SIZE, dtype="<u4").tobytes(), 16)
    for rank in range(RANKS):
        index.routed(f"http://10.0.{rank}.1:8000#0", prompt[: MATCH_BLOCKS // 2])
    began = time.perf_counter()
    for _ in range(MATCHES):
        index.match(prompt)
    matched = time.perf_counter() - began
    figures = {
        "blocks": len(ledger),
        "ranks": RANKS,
        "resident_bytes_per_block": grown / len(ledger),
        "apply_us_per_block": applied / len(ledger) * 1e6,
        "match_us_per_prompt": matched / MATCHES * 1e6,
        "match_prompt_blocks": MATCH_BLOCKS,
    }
    print(
        f"prefix index, {figures['blocks']:,} blocks over {RANKS} ranks: "
        f"{figures['resident_bytes_per_block']:.0f} resident bytes a block, "
        f"{figures['apply_us_per_block']:.1f} us to apply one, "
        f"{figures['match_us_per_prompt']:.0f} us to match a {MATCH_BLOCKS}-block prompt"
    )
    return {"benchmark": "prefix-index", **figures}
