"""Engines that share one GPU (``baton sim --shared-gpu DIR``).

Several vLLM engines on one GPU (each with its share of the memory, as ``baton bench gpu``
runs two prefill and two decode engines) do not each get the GPU's speed: without MPS, CUDA
time-slices the processes' contexts, so while k engines have kernels to run each progresses at
about 1/k of its speed alone. Measured on an H200, four such engines saturated at 61,000 tokens/s
where a simulator giving each engine a GPU of its own reached 160,000.

Each engine owns a file in DIR holding, as 8 bytes, when (the host's monotonic clock,
which every process's event loop reads) the step it runs is expected to end. A step is the work the
performance model gives it alone; it advances in pieces of at most :data:`PIECE_S`, each at
the share of one engine over itself and the peers whose step has not ended
(:func:`step_piece`, the rule), for the part of the step that is GPU work (the profile's
``shared_gpu``; the host's part runs beside the peers). Peers that exit leave a time in the
past: idle.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

from baton.core.perf import StepTime
from baton.core.profile import SharedGpuProfile

__all__ = ["PIECE_S", "STEP_GAP_S", "SharedGpu", "step_gpu_part", "step_piece"]

# Wall seconds between looks at the peers during a step: short against a prefill step
# (hundreds of ms), a decode step (a few ms) is one piece.
PIECE_S = 0.01
# How long an engine with more work, between its steps, still counts as stepping: the host's
# time to stream the step's tokens and schedule the next, which simulated time does not see
# (back-to-back steps), bounded so that a killed engine's claim lapses at once.
STEP_GAP_S = 0.05
_REFRESH_S = 1.0  # how often the directory is listed again for engines that joined
_WHEN = struct.Struct("<d")


def step_piece(
    work_left_s: float, peers_busy: int, piece_s: float, gpu_part: float = 1.0
) -> tuple[float, float]:
    """One piece of a step with ``work_left_s`` seconds of work (as the engine alone would
    take) while ``peers_busy`` other engines run steps: (the piece's length, the work it
    does). The step's ``gpu_part`` is GPU work, shared evenly among the engines with work; the
    rest runs on the host beside the peers' kernels. So two engines stepping at once each
    take ``1 + gpu_part`` times as long as alone, k engines ``1 + (k - 1) * gpu_part``."""
    share = 1.0 / (1 + peers_busy * gpu_part)
    length = min(work_left_s / share, piece_s)
    return length, length * share


def step_gpu_part(shares: SharedGpuProfile, step: StepTime) -> float:
    """The GPU part of ``step``: its prefill's and its decode's parts, weighted by their time."""
    if step.total_s <= 0:
        return 1.0
    prefill = min(step.prefill_s, step.total_s)
    return (
        prefill * shares.prefill_gpu_part + (step.total_s - prefill) * shares.decode_gpu_part
    ) / step.total_s


class SharedGpu:
    """This engine's place among the engines sharing one GPU: the ends of their steps."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._own, name = tempfile.mkstemp(prefix="engine-", dir=directory)
        self.path = Path(name)
        os.pwrite(self._own, _WHEN.pack(0.0), 0)
        self._peers: dict[Path, int] = {}
        self._listed = float("-inf")

    def peers_busy(self, now: float) -> int:
        """Engines on this GPU, other than this one, whose current step has not ended at
        ``now`` (the host's monotonic clock, as every engine's event loop reads it)."""
        if now - self._listed > _REFRESH_S:
            self._list(now)
        busy = 0
        for fd in self._peers.values():
            data = os.pread(fd, _WHEN.size, 0)
            if len(data) < _WHEN.size:
                continue  # a peer that has just created its file
            if _WHEN.unpack(data)[0] > now:
                busy += 1
        return busy

    def busy_until(self, when: float) -> None:
        """This engine's step is expected to end at ``when`` (monotonic clock)."""
        os.pwrite(self._own, _WHEN.pack(when), 0)

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
