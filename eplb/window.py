"""Expert-load windows of one decode group and model: load reports in, per-step load out.

Agents report, per DP rank and batch of consecutive steps, the tokens routed to each of that
rank's physical expert slots (``protos/eplb_agent.proto``, ``LoadReport``). A step is complete
once every rank of the group has reported it; its load is then turned into logical-expert load
(the replicas of an expert summed, under the placement the counts were measured with) and its
vLLM balancedness (sum over layers of mean rank load / sum over layers of max rank load).

A :class:`LoadWindow` keeps the last ``capacity`` complete steps in a ring and answers
:meth:`LoadWindow.window` for any range inside it. It decides nothing about when to rebalance
(``eplb.decide``) and does no I/O: the service feeds it decoded reports.

Rules (each report gets a :class:`Verdict`):

- A report of a placement version the window does not know is dropped (``unknown_version``):
  the service registers a version before its switch can take effect (:meth:`expect`); a
  version is forgotten once a step of a newer one is complete.
- Reports of one rank must move forward: one starting before the end of that rank's previous
  report is stale or out of order and dropped (``stale``). A later start is accepted; the
  missing steps are simply absent from the window (``Window.steps`` tells).
- A report of the wrong shape is dropped (``wrong_shape``).
- A step that some rank never reports is dropped once a newer step is complete, so a lost
  report cannot hold memory forever.

Restarts (an agent's incarnation changing, a rank disappearing) are the service's to detect; it
calls :meth:`LoadWindow.restart`, which forgets every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from baton.core.eplb_wire import LoadReport
from baton.core.experts import Placement

__all__ = ["LoadWindow", "Verdict", "Window"]


class Verdict(StrEnum):
    ACCEPTED = "accepted"
    STALE = "stale"
    UNKNOWN_VERSION = "unknown_version"
    WRONG_SHAPE = "wrong_shape"


@dataclass(frozen=True, slots=True)
class Window:
    """Load of the complete steps in ``[first_step, end_step)``.

    ``load`` is logical-expert load summed over those steps, ``[layers, experts]``;
    ``steps`` counts the steps present (fewer than ``end_step - first_step`` after a gap);
    ``step_balance`` is the mean per-step balance measured under the placements in force, the
    versions of which are ``versions``.
    """

    first_step: int
    end_step: int
    steps: int
    load: np.ndarray
    step_balance: float
    versions: frozenset[int] = frozenset()

    @property
    def complete(self) -> bool:
        return self.steps == self.end_step - self.first_step


class LoadWindow:
    """The last ``capacity`` complete steps of one group and model (see the module docstring)."""

    def __init__(self, placement: Placement, version: int, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._reset(placement, version)

    def _reset(self, placement: Placement, version: int) -> None:
        self.num_ranks = placement.num_ranks
        self.layers = placement.num_layers
        self.experts = placement.num_logical_experts
        self.slots = placement.slots_per_rank
        self._placements: dict[int, Placement] = {version: placement}
        self._load = np.zeros((self.capacity, self.layers, self.experts), dtype=np.int64)
        self._balance = np.zeros(self.capacity)
        self._step = np.full(self.capacity, -1, dtype=np.int64)  # step held by each ring row
        self._version = np.zeros(self.capacity, dtype=np.int64)  # its placement version
        self._next_step: dict[int, int] = {}  # per rank: end of its last accepted report
        # Reports of one batch waiting for the other ranks:
        # (first step, steps, version) -> rank -> counts.
        self._pending: dict[tuple[int, int, int], dict[int, np.ndarray]] = {}
        self.completed_end = -1  # one past the newest complete step

    def expect(self, version: int, placement: Placement) -> None:
        """Register a placement the engine may switch to, so its reports are understood."""
        self._placements[version] = placement

    def restart(self, placement: Placement, version: int) -> None:
        """Forget every step and report: the engine restarted or a rank was replaced."""
        self._reset(placement, version)

    def add(self, report: LoadReport) -> Verdict:
        counts = np.asarray(report.counts)
        if counts.ndim != 3 or counts.shape[1:] != (self.layers, self.slots):
            return Verdict.WRONG_SHAPE
        if not 0 <= report.dp_rank < self.num_ranks:
            return Verdict.WRONG_SHAPE
        if report.placement_version not in self._placements:
            return Verdict.UNKNOWN_VERSION
        if report.first_step < self._next_step.get(report.dp_rank, -1):
            return Verdict.STALE
        if report.first_step + report.num_steps <= self.completed_end:
            return Verdict.STALE  # its steps were completed or given up already
        self._next_step[report.dp_rank] = report.first_step + report.num_steps
        key = (report.first_step, report.num_steps, report.placement_version)
        batch = self._pending.setdefault(key, {})
        batch[report.dp_rank] = counts
        if len(batch) == self.num_ranks:
            del self._pending[key]
            self._complete(key, batch)
        return Verdict.ACCEPTED

    def window(self, first_step: int, end_step: int) -> Window:
        """The complete steps in ``[first_step, end_step)`` that the ring still holds."""
        held = (self._step >= first_step) & (self._step < end_step)
        # Sum runs of consecutive ring rows as views: indexing the rows would copy every step.
        edges = np.flatnonzero(np.diff(held, prepend=False, append=False))
        load = np.zeros((self.layers, self.experts), dtype=np.int64)
        for start, stop in edges.reshape(-1, 2):
            load += self._load[start:stop].sum(axis=0)
        steps = int(held.sum())
        balance = float(self._balance[held].mean()) if steps else 1.0
        versions = frozenset(np.unique(self._version[held]).tolist())
        return Window(first_step, end_step, steps, load, balance, versions)

    def _complete(self, key: tuple[int, int, int], batch: dict[int, np.ndarray]) -> None:
        first, num_steps, version = key
        placement = self._placements[version]
        # [steps, layers, physical slots]: rank r's slots are r*S .. (r+1)*S - 1.
        physical = np.concatenate(
            [batch[rank].astype(np.int64) for rank in range(self.num_ranks)], axis=2
        )
        rank_load = physical.reshape(num_steps, self.layers, self.num_ranks, self.slots).sum(-1)
        mean = rank_load.mean(axis=-1).sum(axis=-1)
        peak = rank_load.max(axis=-1).sum(axis=-1)
        balance = np.where(peak > 0, mean / np.maximum(peak, 1), 1.0)
        offsets = (np.arange(num_steps * self.layers) * self.experts).reshape(
            num_steps, self.layers, 1
        )
        logical = np.bincount(
            (placement.phy2log[None] + offsets).ravel(),
            weights=physical.ravel(),
            minlength=num_steps * self.layers * self.experts,
        ).reshape(num_steps, self.layers, self.experts)
        steps = np.arange(first, first + num_steps)
        rows = steps % self.capacity
        self._load[rows] = logical.astype(np.int64)
        self._balance[rows] = balance
        self._step[rows] = steps
        self._version[rows] = version
        self.completed_end = max(self.completed_end, first + num_steps)
        # Versions only grow and every rank reports in order: older placements are done with.
        self._placements = {v: p for v, p in self._placements.items() if v >= version}
        # Batches that ended before this one will never complete now: a rank lost its report.
        for stale in [k for k in self._pending if k[0] + k[1] <= first]:
            del self._pending[stale]
