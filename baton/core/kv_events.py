"""vLLM's KV cache events on the wire: what an engine started with ``--kv-events-config``
publishes, and what the gateway reads to know which prefixes each DP rank holds.

vLLM 0.33 (``vllm/distributed/kv_events.py``) publishes, per DP rank, one batch per engine
step on a ZeroMQ PUB socket: a three-frame message (the topic, an 8-byte big-endian sequence
number, the batch as MessagePack). A batch is an array ``[ts, events, data_parallel_rank]``;
each event a map tagged by its class name: ``BlockStored`` (full blocks newly cached or reused:
their hashes, the parent's, their token ids), ``BlockRemoved`` (evicted), ``AllBlocksCleared``
(the prefix cache reset). Block hashes are 64-bit integers by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the hash's last 8 bytes) or the hash's bytes.
Rank r publishes on the configured TCP port plus r. A publisher binds a wildcard endpoint
(``tcp://*:5557``) and connects to any other (``tcp://host:5557``: a subscriber binds there).

The structs below encode and decode exactly that: ``baton sim`` publishes with them, the
gateway decodes real vLLM's and the simulator's with them alike. Fields vLLM adds later are
ignored when decoding; only the ones routing needs are named.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "binds",
    "decode_batch",
    "encode_batch",
    "external_hash",
    "rank_endpoint",
]

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch as vLLM encodes it; ``msgspec.DecodeError`` for anything else."""
    return _DECODER.decode(payload)


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it by default: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint DP rank ``rank`` publishes on, as vLLM offsets it: a TCP port plus the
    rank (port 0 is left to the OS), an inproc name with ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not base.startswith("tcp") or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r}: give tcp://HOST:PORT or inproc://NAME")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


def binds(endpoint: str) -> bool:
    """Whether a publisher binds ``endpoint`` (vLLM's rule: a wildcard host or an ipc or
    inproc name) rather than connecting to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
