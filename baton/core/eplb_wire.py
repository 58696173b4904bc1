"""The EPLB agent protocol's payloads as numpy: placements and load reports, both ways.

``phy2log`` travels as little-endian int32 ``[layers, physical experts]``; load counts as
little-endian uint32 ``[steps, layers, slots]`` (``protos/eplb_agent.proto``). Decoding checks
shapes and expert ids and raises ValueError naming the problem; nothing is trusted. Shared by the
EPLB service and the simulator's agent; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.core.experts import Placement
from baton.core.proto import eplb_agent_pb2 as pb

__all__ = ["LoadReport", "decode_placement", "decode_report", "encode_placement"]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One decoded ``LoadReport``: ``counts`` is ``[num_steps, layers, slots]`` of one rank."""

    dp_rank: int
    first_step: int
    counts: np.ndarray
    placement_version: int

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[0])


def encode_placement(name: str, placement: Placement, version: int = 0) -> pb.Placement:
    return pb.Placement(
        model=name,
        layers=placement.num_layers,
        physical_experts=placement.phy2log.shape[1],
        phy2log=placement.phy2log.astype("<i4").tobytes(),
        version=version,
    )


def decode_placement(message: pb.Placement, num_ranks: int, num_logical: int) -> Placement:
    """Rebuild and check a placement; ValueError names what is wrong."""
    expected = message.layers * message.physical_experts * 4
    if len(message.phy2log) != expected:
        raise ValueError(
            f"{message.model}: phy2log has {len(message.phy2log)} bytes, expected "
            f"{expected} for [{message.layers}, {message.physical_experts}] int32"
        )
    phy2log = np.frombuffer(message.phy2log, dtype="<i4").astype(np.int64)
    phy2log = phy2log.reshape(message.layers, message.physical_experts)
    if phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_logical:
        raise ValueError(f"{message.model}: phy2log names an expert outside [0, {num_logical})")
    held = np.zeros((message.layers, num_logical), dtype=bool)
    held[np.arange(message.layers)[:, None], phy2log] = True
    if not held.all():
        layer, expert = np.argwhere(~held)[0]
        raise ValueError(
            f"{message.model}: logical expert {expert} has no replica in layer {layer}"
        )
    return Placement(phy2log, num_ranks, num_logical)


def decode_report(message: pb.LoadReport) -> LoadReport:
    """A ``LoadReport``'s counts as ``[num_steps, layers, slots]``; ValueError on a bad size."""
    shape = (message.num_steps, message.layers, message.slots)
    if len(message.counts) != 4 * message.num_steps * message.layers * message.slots:
        raise ValueError(
            f"rank {message.dp_rank} {message.model}: counts has {len(message.counts)} bytes, "
            f"expected {list(shape)} uint32"
        )
    counts = np.frombuffer(message.counts, dtype="<u4").reshape(shape)
    return LoadReport(message.dp_rank, message.first_step, counts, message.placement_version)
