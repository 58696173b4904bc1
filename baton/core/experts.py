"""Expert placements of a wide-EP group: the vocabulary every Baton process shares.

A placement maps the physical expert slots of every MoE layer to logical experts. With
``num_ranks`` EP ranks and ``S`` slots per rank, rank ``r`` owns physical slots
``r*S .. (r+1)*S - 1`` (vLLM's convention); the ``P - E`` slots (``P = num_ranks * S``) beyond
the ``E`` logical experts hold redundant replicas.

Load model (vLLM's): a logical expert's load splits evenly over its replicas. A rank's load is
the sum over its slots; the balance of a step is ``sum over layers of mean rank load / sum over
layers of max rank load`` (1.0 is perfect; a step with no load counts as perfectly balanced), as
vLLM logs it. A switch from one placement to another copies, to each rank, the experts it holds
in the new placement and did not hold before (``moves_per_rank``).
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Placement",
    "balance",
    "balance_per_step",
    "experts_on_ranks",
    "experts_on_ranks_of",
    "moves",
    "moves_per_rank",
    "rank_load",
]


@dataclass(frozen=True, slots=True, eq=False)
class Placement:
    """Physical-to-logical expert map of every MoE layer, plus its replica counts.

    ``phy2log[layer, slot]`` is the logical expert held by physical slot ``slot``; rank ``r`` owns
    slots ``r*S .. (r+1)*S - 1``. ``replica_counts[layer, expert]`` counts the replicas. Both
    are read-only copies. The inverse map ``log2phy`` is derived when asked, not kept: it is
    padded to the largest replica count, so one hot expert would make every kept placement big.
    """

    phy2log: np.ndarray
    num_ranks: int
    num_logical_experts: int
    replica_counts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        phy2log = np.asarray(self.phy2log)
        if phy2log.size and not np.issubdtype(phy2log.dtype, np.integer):
            raise ValueError(f"phy2log must hold integer expert ids, got {phy2log.dtype}")
        phy2log = np.array(phy2log, dtype=np.int64, copy=True)
        num_ranks, num_experts = int(self.num_ranks), int(self.num_logical_experts)
        if phy2log.ndim != 2 or phy2log.shape[1] == 0:
            raise ValueError(f"phy2log must be [layers, physical slots], got {phy2log.shape}")
        if num_ranks <= 0 or phy2log.shape[1] % num_ranks != 0:
            raise ValueError(
                f"{phy2log.shape[1]} physical slots do not split over {num_ranks} ranks"
            )
        if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_experts):
            raise ValueError(f"phy2log holds ids outside 0..{num_experts - 1}")
        layers = phy2log.shape[0]
        offsets = np.arange(layers, dtype=np.int64)[:, None] * num_experts
        counts = np.bincount((phy2log + offsets).ravel(), minlength=layers * num_experts)
        counts = counts.reshape(layers, num_experts)
        if (counts == 0).any():
            raise ValueError("every logical expert needs at least one replica")
        for array in (phy2log, counts):
            array.setflags(write=False)
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "num_ranks", num_ranks)
        object.__setattr__(self, "num_logical_experts", num_experts)
        object.__setattr__(self, "replica_counts", counts)

    @classmethod
    def from_phy2log(
        cls, phy2log: np.ndarray, num_ranks: int, num_logical_experts: int | None = None
    ) -> Placement:
        """Rebuild a placement from ``phy2log`` alone (logical experts default to max id + 1)."""
        phy2log = np.asarray(phy2log)
        if num_logical_experts is None:
            num_logical_experts = int(phy2log.max()) + 1 if phy2log.size else 0
        return cls(phy2log, num_ranks, num_logical_experts)

    @classmethod
    def contiguous(cls, layers: int, logical_experts: int, num_ranks: int) -> Placement:
        """vLLM's default linear placement: expert ``e`` on rank ``e // (E / R)``, no replicas."""
        if logical_experts % num_ranks != 0:
            raise ValueError(f"{logical_experts} experts do not split over {num_ranks} ranks")
        phy2log = np.tile(np.arange(logical_experts, dtype=np.int64), (layers, 1))
        return cls(phy2log, num_ranks, logical_experts)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self.phy2log.shape[1]) // self.num_ranks

    @property
    def log2phy(self) -> np.ndarray:
        """``[layer, expert, i]``: the physical slot of the ``i``-th replica (ascending slot
        order), padded with -1 to the largest replica count."""
        layers, num_physical = self.phy2log.shape
        counts = self.replica_counts
        # Stable sort groups each expert's slots together in ascending slot order; a slot's
        # replica index is its position minus where its expert's group starts.
        order = np.argsort(self.phy2log, axis=1, kind="stable")
        sorted_experts = np.take_along_axis(self.phy2log, order, axis=1)
        group_start = np.cumsum(counts, axis=1) - counts
        replica = np.arange(num_physical) - np.take_along_axis(group_start, sorted_experts, axis=1)
        log2phy = np.full((layers, self.num_logical_experts, int(counts.max())), -1, np.int64)
        log2phy[np.arange(layers)[:, None], sorted_experts, replica] = order
        return log2phy

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_ranks == other.num_ranks
            and self.num_logical_experts == other.num_logical_experts
            and np.array_equal(self.phy2log, other.phy2log)
        )


def rank_load(load: np.ndarray, placement: Placement) -> np.ndarray:
    """Load per rank, ``[..., layers, ranks]``, from logical load ``[..., layers, experts]``.

    Each expert's load splits evenly over its replicas; leading axes (e.g. steps) broadcast.
    """
    load = _check_load(load, placement)
    per_replica = load / placement.replica_counts
    layer_index = np.arange(placement.num_layers)[:, None]
    per_slot = per_replica[..., layer_index, placement.phy2log]
    shape = (*per_slot.shape[:-1], placement.num_ranks, placement.slots_per_rank)
    per_rank: np.ndarray = per_slot.reshape(shape).sum(axis=-1)
    return per_rank


def balance(load: np.ndarray, placement: Placement) -> float:
    """vLLM's balancedness of one step's ``[layers, experts]`` load (1.0 when there is no load)."""
    load = np.asarray(load)
    if load.ndim != 2:
        raise ValueError(f"balance takes one step's [layers, experts] load, got {load.shape}")
    return float(_balancedness(rank_load(load, placement)))


def balance_per_step(load: np.ndarray, placement: Placement) -> np.ndarray:
    """Balancedness of each step of ``[steps, layers, experts]`` load, shape ``[steps]``."""
    load = np.asarray(load)
    if load.ndim != 3:
        raise ValueError(f"expected [steps, layers, experts] load, got {load.shape}")
    return _balancedness(rank_load(load, placement))


def moves_per_rank(previous: Placement, new: Placement) -> np.ndarray:
    """Expert weights each rank must receive, ``[layers, ranks]``.

    Counts the logical experts present on a rank in ``new`` and absent from it in ``previous``;
    a second replica of an expert on the same rank is a local copy and is not counted.
    """
    if (previous.num_layers, previous.num_ranks, previous.num_logical_experts) != (
        new.num_layers,
        new.num_ranks,
        new.num_logical_experts,
    ):
        raise ValueError("placements differ in layers, ranks or logical experts")
    arrived = experts_on_ranks(new) & ~experts_on_ranks(previous)
    moves: np.ndarray = arrived.sum(axis=-1, dtype=np.int64)
    return moves


def moves(previous: Placement, new: Placement) -> int:
    """Total expert weights copied between ranks to go from ``previous`` to ``new``."""
    return int(moves_per_rank(previous, new).sum())


def _check_load(load: np.ndarray, placement: Placement) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    expected = (placement.num_layers, placement.num_logical_experts)
    if load.ndim < 2 or load.shape[-2:] != expected:
        raise ValueError(f"load must end in [layers, experts] = {expected}, got {load.shape}")
    return load


def _balancedness(rank_loads: np.ndarray) -> np.ndarray:
    mean = rank_loads.mean(axis=-1).sum(axis=-1)
    peak = rank_loads.max(axis=-1).sum(axis=-1)
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def experts_on_ranks(placement: Placement) -> np.ndarray:
    """``[layers, ranks, experts]``: whether a rank holds at least one replica of an expert."""
    return experts_on_ranks_of(
        placement.phy2log, placement.num_ranks, placement.num_logical_experts
    )


def experts_on_ranks_of(phy2log: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """``experts_on_ranks`` of a bare ``[layers, physical slots]`` map."""
    layers, num_physical = phy2log.shape
    present = np.zeros((layers, num_ranks, num_experts), dtype=bool)
    rank_of_slot = np.arange(num_physical) // (num_physical // num_ranks)
    present[np.arange(layers)[:, None], rank_of_slot, phy2log] = True
    return present
