"""Engines that share one GPU (``baton sim --shared-gpu DIR``).

Several vLLM engines on one GPU (each with its share of the memory, as ``baton bench gpu``
runs two prefill and two decode engines) do not each get the GPU's speed: without MPS, CUDA
time-slices the processes' contexts. Measured on an H200, four such engines saturated at 61,000
tokens/s where a simulator giving each engine a GPU of its own reached 160,000. The slicing is
neither even nor whole-step: on an H100 (``baton bench gpu --step share``), an 8K-token prefill
took 1.72x as long beside another prefill and 1.41x beside a decode engine, while a 64-request
decode step took no longer beside either (its step is mostly the host's work).

Each engine owns a file in DIR holding, as 16 bytes, when (the host's monotonic clock, which
every process's event loop reads) the step it runs is expected to end and that step's prefill
part. A step is the work the performance model gives it alone; it advances in pieces of at most
:data:`PIECE_S`, each stretched by the peers whose step has not ended, by what each adds to a
step of this kind (:func:`step_stretch`: the profile's ``shared_gpu``, measured per pair of
kinds). Peers that exit leave a time in the past: idle.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

from baton.core.perf import StepTime
from baton.core.profile import SharedGpuProfile

__all__ = ["PIECE_S", "STEP_GAP_S", "SharedGpu", "prefill_part", "step_piece", "step_stretch"]

# Wall seconds between looks at the peers during a step: short against a prefill step
# (hundreds of ms), a decode step (a few ms) is one piece.
PIECE_S = 0.01
# How long an engine with more work, between its steps, still counts as stepping: the host's
# time to stream the step's tokens and schedule the next, which simulated time does not see
# (back-to-back steps), bounded so that a killed engine's claim lapses at once.
STEP_GAP_S = 0.05
_REFRESH_S = 1.0  # how often the directory is listed again for engines that joined
_STEP = struct.Struct("<dd")  # when the step is expected to end, its prefill part


def step_piece(work_left_s: float, stretch: float, piece_s: float) -> tuple[float, float]:
    """One piece of a step with ``work_left_s`` seconds of work (as the engine alone would
    take) while the peers stepping beside it stretch it by ``stretch`` (:func:`step_stretch`):
    (the piece's length, the work it does)."""
    share = 1.0 / stretch
    length = min(work_left_s / share, piece_s)
    return length, length * share


def step_stretch(shares: SharedGpuProfile, prefill_part: float, peers: Sequence[float]) -> float:
    """How much a step whose time is ``prefill_part`` prefill (the rest decode) stretches
    beside ``peers``, each a busy peer's prefill part: 1 plus what each peer adds, by the kinds
    of the two steps (the profile's four measured figures, mixed steps weighed by time)."""
    added = 0.0
    for peer in peers:
        beside_prefill = (
            prefill_part * shares.prefill_beside_prefill
            + (1 - prefill_part) * shares.decode_beside_prefill
        )
        beside_decode = (
            prefill_part * shares.prefill_beside_decode
            + (1 - prefill_part) * shares.decode_beside_decode
        )
        added += peer * beside_prefill + (1 - peer) * beside_decode
    return 1.0 + added


def prefill_part(step: StepTime) -> float:
    """The share of ``step``'s time that is prefill."""
    if step.total_s <= 0:
        return 0.0
    return min(step.prefill_s, step.total_s) / step.total_s


class SharedGpu:
    """This engine's place among the engines sharing one GPU: the ends of their steps."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._own, name = tempfile.mkstemp(prefix="engine-", dir=directory)
        self.path = Path(name)
        os.pwrite(self._own, _STEP.pack(0.0, 0.0), 0)
        self._peers: dict[Path, int] = {}
        self._listed = float("-inf")

    def peers_busy(self, now: float) -> list[float]:
        """The prefill part of each engine on this GPU, other than this one, whose current step
        has not ended at ``now`` (the host's monotonic clock, as every event loop reads it)."""
        if now - self._listed > _REFRESH_S:
            self._list(now)
        busy = []
        for fd in self._peers.values():
            data = os.pread(fd, _STEP.size, 0)
            if len(data) < _STEP.size:
                continue  # a peer that has just created its file
            end, prefill = _STEP.unpack(data)
            if end > now:
                busy.append(prefill)
        return busy

    def busy_until(self, when: float, prefill_part: float) -> None:
        """This engine's step, ``prefill_part`` of it prefill, is expected to end at ``when``
        (monotonic clock)."""
        os.pwrite(self._own, _STEP.pack(when, prefill_part), 0)

    def close(self) -> None:
        for fd in self._peers.values():
            os.close(fd)
        self._peers.clear()
        os.close(self._own)
        self.path.unlink(missing_ok=True)

    def _list(self, now: float) -> None:
        self._listed = now
        present = {p for p in self.directory.glob("engine-*") if p != self.path}
        for gone in set(self._peers) - present:
            os.close(self._peers.pop(gone))
        for path in present - set(self._peers):
            try:
                self._peers[path] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # exited between the listing and the open
