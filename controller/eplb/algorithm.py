"""Expert-parallel load balancing (EPLB): placements, balance and the rebalancing algorithm.

A placement maps the physical expert slots of every MoE layer to logical experts. With
``num_ranks`` EP ranks and ``S`` slots per rank, rank ``r`` owns physical slots
``r*S .. (r+1)*S - 1`` (vLLM's convention); the ``P - E`` slots (``P = num_ranks * S``) beyond
the ``E`` logical experts hold redundant replicas.

Load model (vLLM's): a logical expert's load splits evenly over its replicas. A rank's load is
the sum over its slots; the balance of a step is ``sum over layers of mean rank load / sum over
layers of max rank load`` (1.0 is perfect; a step with no load counts as perfectly balanced).

Rebalancing follows the ideas of DeepSeek's EPLB, vectorised over layers:

1. Hierarchical policy (``num_nodes > 1`` and ``num_groups % num_nodes == 0``): sum the load of
   each expert group and pack the groups onto nodes, ``num_groups / num_nodes`` groups per node,
   so group-limited routing stays inside a node. Otherwise the global policy runs the same steps
   with one group and one node.
2. Replication, per node: every expert of the node gets one slot; each further slot of the node's
   ``P / num_nodes`` goes to the expert with the highest load per replica. This greedily
   minimises the maximum per-replica load and spreads redundancy evenly over nodes.
3. Balanced packing, per node: the node's replicas (weighted by per-replica load) are visited
   heaviest first and each goes to the lightest rank of the node that still has a free slot
   (greedy longest-processing-time with a cardinality cap of ``S`` per rank).
4. Safeguard: the greedy steps can lose to vLLM's contiguous default on small or degenerate
   loads, so a layer whose peak rank load would exceed the contiguous placement's gets that
   layout instead, with its redundant slots holding second copies of the rank's own experts
   (possible whenever ``E % num_ranks == 0``, the condition for a contiguous placement).
5. Keeping experts where they are (when ``previous`` is given). Every expert that arrives on a
   rank is bytes over NVLink during the switch, so the result is the placement with the fewest
   such arrivals among a few candidates whose balance stays within ``tolerance`` of step 4's:

   a. Rank relabelling is free: ranks (and, hierarchically, whole nodes) of the fresh placement
      are renamed onto previous ranks by a greedy maximum-overlap matching (the pair sharing the
      most experts first), kept in a layer only where it moves fewer experts than the fresh
      labels. Balance is unchanged.
   b. Repair of ``previous``: starting from the previous placement (its replica counts) under
      the new load, swap descent, vectorised over layers: each round, in every layer still above
      the fresh layer's peak, swap one slot of the hottest rank with the slot anywhere else that
      gives the lowest peak of the two ranks involved, if that is below the current peak. Every
      round is a candidate: a layer can stop after any number of swaps (two arrivals each at
      most), and the rounds form each layer's trade-off curve of peak against arrivals. Swaps
      keep the previous replica counts; a layer whose hot experts need more replicas stalls
      and falls back to (a). At most ``_MAX_SWAP_ROUNDS`` rounds.
   c. Choice: per layer, only candidates moving no more experts than (a) are allowed, so the
      result never moves more than the from-scratch placement does. Balance is one ratio over
      all layers (sum of means over sum of peaks, the means fixed by the load), so the
      tolerance is a budget on the sum of layer peaks: ``sum of means / (fresh balance -
      tolerance)``, and never more than the contiguous placement's sum (so (4)'s guarantee
      holds). A Lagrangian search (minimise moves + lambda * peak per layer, over the exact
      breakpoints of lambda) picks the cheapest combination inside the budget; (a) in every
      layer is always inside it.
6. Slot preservation (when ``previous`` is given): an expert that stays on a rank keeps its old
   slot index within the rank, so its weights are not copied; the other experts fill the freed
   slots in ascending order. This reorders slots inside ranks only and never changes a rank's
   set of experts, so it does not change balance.

Invariants of every ``Placement`` (checked on construction): every logical expert has at least
one replica, every rank has exactly ``S`` slots, ``phy2log`` holds only valid logical ids.
Invariants of ``rebalance``: with ``E % num_ranks == 0`` its balance is never below the
contiguous placement's (without ``previous`` no layer's peak rank load exceeds the contiguous
one); the output is deterministic, every tie (equal loads, equally loaded ranks) going to the
lowest index. With ``previous``: no more experts move than from scratch, and balance is at least
the from-scratch balance minus ``tolerance``. Nothing prevents two replicas of one expert from
sharing a rank (DeepSeek's algorithm does not either).
"""

from dataclasses import dataclass, field

import numpy as np

# Balance a rebalance may give up to keep experts where they are (see step 5).
DEFAULT_TOLERANCE = 0.005
# Rounds of swap descent (step 5b): one swap per layer and round. Calibrated drift between
# rebalances needs 15-25; a layer still short after this falls back to the fresh placement.
_MAX_SWAP_ROUNDS = 64

__all__ = [
    "DEFAULT_TOLERANCE",
    "Placement",
    "balance",
    "balance_per_step",
    "moves",
    "moves_per_rank",
    "rank_load",
    "rebalance",
]


@dataclass(frozen=True, slots=True, eq=False)
class Placement:
    """Physical-to-logical expert map of every MoE layer, plus its derived inverse maps.

    ``phy2log[layer, slot]`` is the logical expert held by physical slot ``slot``; rank ``r`` owns
    slots ``r*S .. (r+1)*S - 1``. ``log2phy[layer, expert, i]`` is the physical slot of the
    ``i``-th replica (ascending slot order), padded with -1 to the largest replica count;
    ``replica_counts[layer, expert]`` counts the replicas. All arrays are read-only copies.
    """

    phy2log: np.ndarray
    num_ranks: int
    num_logical_experts: int
    log2phy: np.ndarray = field(init=False)
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
        layers, num_physical = phy2log.shape
        offsets = np.arange(layers, dtype=np.int64)[:, None] * num_experts
        counts = np.bincount((phy2log + offsets).ravel(), minlength=layers * num_experts)
        counts = counts.reshape(layers, num_experts)
        if (counts == 0).any():
            raise ValueError("every logical expert needs at least one replica")
        # Stable sort groups each expert's slots together in ascending slot order; a slot's
        # replica index is its position minus where its expert's group starts.
        order = np.argsort(phy2log, axis=1, kind="stable")
        sorted_experts = np.take_along_axis(phy2log, order, axis=1)
        group_start = np.cumsum(counts, axis=1) - counts
        replica = np.arange(num_physical) - np.take_along_axis(group_start, sorted_experts, axis=1)
        log2phy = np.full((layers, num_experts, int(counts.max())), -1, dtype=np.int64)
        log2phy[np.arange(layers)[:, None], sorted_experts, replica] = order
        for array in (phy2log, log2phy, counts):
            array.setflags(write=False)
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "num_ranks", num_ranks)
        object.__setattr__(self, "num_logical_experts", num_experts)
        object.__setattr__(self, "log2phy", log2phy)
        object.__setattr__(self, "replica_counts", counts)

    @classmethod
    def from_phy2log(
        cls, phy2log: np.ndarray, num_ranks: int, num_logical_experts: int | None = None
    ) -> "Placement":
        """Rebuild a placement from ``phy2log`` alone (logical experts default to max id + 1)."""
        phy2log = np.asarray(phy2log)
        if num_logical_experts is None:
            num_logical_experts = int(phy2log.max()) + 1 if phy2log.size else 0
        return cls(phy2log, num_ranks, num_logical_experts)

    @classmethod
    def contiguous(cls, layers: int, logical_experts: int, num_ranks: int) -> "Placement":
        """vLLM's default linear placement: expert ``e`` on rank ``e // (E / R)``, no replicas."""
        if logical_experts % num_ranks != 0:
            raise ValueError(f"{logical_experts} experts do not split over {num_ranks} ranks")
        phy2log = np.tile(np.arange(logical_experts, dtype=np.int64), (layers, 1))
        return cls(phy2log, num_ranks, logical_experts)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks

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
    return per_slot.reshape(shape).sum(axis=-1)


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


def rebalance(
    load: np.ndarray,
    num_ranks: int,
    num_redundant: int = 0,
    num_nodes: int = 1,
    num_groups: int = 1,
    previous: Placement | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Placement:
    """Place ``E + num_redundant`` replicas of ``load``'s ``E`` experts on ``num_ranks`` ranks.

    ``load`` is ``[layers, logical experts]`` (e.g. routed tokens summed over a window). The
    policy is hierarchical when ``num_nodes > 1`` and ``num_groups % num_nodes == 0``, global
    otherwise (see the module docstring). Balance is never below the contiguous default's (when
    ``E % num_ranks == 0``). With ``previous``, experts stay where they are whenever that costs
    at most ``tolerance`` of balance against the from-scratch placement, and experts that stay on
    a rank keep their slot.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] == 0:
        raise ValueError(f"load must be [layers, logical experts], got {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    num_experts = load.shape[1]
    num_physical = num_experts + num_redundant
    if num_redundant < 0 or num_ranks <= 0 or num_physical % num_ranks != 0:
        raise ValueError(f"{num_physical} physical experts do not split over {num_ranks} ranks")
    if num_nodes <= 0 or num_ranks % num_nodes != 0:
        raise ValueError(f"{num_ranks} ranks do not split over {num_nodes} nodes")
    if not (num_nodes > 1 and num_groups % num_nodes == 0):
        num_groups, num_nodes = 1, 1
    if num_experts % num_groups != 0:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    if tolerance < 0:
        raise ValueError(f"tolerance must be non-negative, got {tolerance}")
    phy2log = _hierarchical_phy2log(load, num_physical, num_groups, num_nodes, num_ranks)
    if num_experts % num_ranks == 0:
        phy2log = _no_worse_than_contiguous(load, Placement(phy2log, num_ranks, num_experts))
    placement = Placement(phy2log, num_ranks, num_experts)
    if previous is None:
        return placement
    if (previous.num_layers, previous.phy2log.shape[1], previous.num_ranks) != (
        load.shape[0],
        num_physical,
        num_ranks,
    ) or previous.num_logical_experts != num_experts:
        raise ValueError("previous placement has a different shape")
    phy2log = _keep_previous(load, placement, previous, num_nodes, tolerance)
    return _preserve_slots(Placement(phy2log, num_ranks, num_experts), previous)


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
    arrived = _presence(new) & ~_presence(previous)
    return arrived.sum(axis=-1, dtype=np.int64)


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


def _hierarchical_phy2log(
    load: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> np.ndarray:
    """Steps 1-3 of the module docstring; returns ``phy2log`` ``[layers, num_physical]``."""
    layers, num_experts = load.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks

    # Step 1: groups onto nodes. Number experts node-major ("meta" ids): node n holds meta ids
    # n*E/N .. (n+1)*E/N - 1, its groups in packing order, each group's experts contiguous.
    group_load = load.reshape(layers, num_groups, group_size).sum(axis=-1)
    group_node, group_slot = _balanced_packing(group_load, num_nodes)
    group_position = group_node * groups_per_node + group_slot
    meta_of_expert = (group_position[:, :, None] * group_size + np.arange(group_size)).reshape(
        layers, num_experts
    )
    expert_of_meta = np.argsort(meta_of_expert, axis=1)
    meta_load = np.take_along_axis(load, expert_of_meta, axis=1)

    # Step 2: replicate inside each node; (layer, node) pairs form one batch axis.
    node_load = meta_load.reshape(layers * num_nodes, experts_per_node)
    replica_expert, counts = _replicate(node_load, slots_per_node)

    # Step 3: pack the node's replicas onto its ranks, then lay each rank's slots out contiguously.
    replica_load = np.take_along_axis(node_load / counts, replica_expert, axis=1)
    rank_in_node, slot_in_rank = _balanced_packing(replica_load, num_ranks // num_nodes)
    node_phy2meta = np.empty_like(replica_expert)
    np.put_along_axis(
        node_phy2meta, rank_in_node * slots_per_rank + slot_in_rank, replica_expert, axis=1
    )
    node_offset = np.arange(num_nodes, dtype=np.int64)[None, :, None] * experts_per_node
    meta = (node_phy2meta.reshape(layers, num_nodes, slots_per_node) + node_offset).reshape(
        layers, num_physical
    )
    return np.take_along_axis(expert_of_meta, meta, axis=1)


def _no_worse_than_contiguous(load: np.ndarray, greedy: Placement) -> np.ndarray:
    """Step 4 of the module docstring: ``greedy``'s ``phy2log`` with every layer whose peak rank
    load exceeds the contiguous placement's replaced by the contiguous layout."""
    layers, num_experts = load.shape
    experts_per_rank = num_experts // greedy.num_ranks
    contiguous_peak = load.reshape(layers, greedy.num_ranks, experts_per_rank).sum(-1).max(-1)
    worse = rank_load(load, greedy).max(axis=-1) > contiguous_peak
    phy2log = np.array(greedy.phy2log)
    # Rank r keeps experts r*E/R .. (r+1)*E/R - 1 and fills its extra slots with second copies of
    # them: a replica on the same rank splits load without moving any, so rank loads match the
    # contiguous placement's exactly.
    phy2log[worse] = (
        np.arange(greedy.num_ranks)[:, None] * experts_per_rank
        + np.arange(greedy.slots_per_rank) % experts_per_rank
    ).ravel()
    return phy2log


def _replicate(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Give ``num_slots`` slots to the ``n`` experts of each row of ``weight`` ``[batch, n]``.

    Slot ``i < n`` holds expert ``i``; each further slot goes to the expert with the highest
    load per replica. Returns the expert of every slot ``[batch, num_slots]`` and replica counts.
    """
    batch, num_experts = weight.shape
    rows = np.arange(batch)
    slot_expert = np.empty((batch, num_slots), dtype=np.int64)
    slot_expert[:, :num_experts] = np.arange(num_experts)
    counts = np.ones((batch, num_experts), dtype=np.int64)
    for slot in range(num_experts, num_slots):
        hottest = np.argmax(weight / counts, axis=1)
        slot_expert[:, slot] = hottest
        counts[rows, hottest] += 1
    return slot_expert, counts


def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the ``n`` items of each row of ``weight`` ``[batch, n]`` into ``num_packs`` packs.

    Every pack receives exactly ``n / num_packs`` items: items go heaviest first to the lightest
    pack that is not full. Returns each item's pack and its slot within the pack.
    """
    batch, num_items = weight.shape
    capacity = num_items // num_packs
    rows = np.arange(batch)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_weight = np.zeros((batch, num_packs))
    pack_items = np.zeros((batch, num_packs), dtype=np.int64)
    item_pack = np.empty((batch, num_items), dtype=np.int64)
    item_slot = np.empty((batch, num_items), dtype=np.int64)
    for item in order.T:
        open_weight = np.where(pack_items < capacity, pack_weight, np.inf)
        pack = np.argmin(open_weight, axis=1)
        item_pack[rows, item] = pack
        item_slot[rows, item] = pack_items[rows, pack]
        pack_weight[rows, pack] += weight[rows, item]
        pack_items[rows, pack] += 1
    return item_pack, item_slot


def _keep_previous(
    load: np.ndarray, fresh: Placement, previous: Placement, num_nodes: int, tolerance: float
) -> np.ndarray:
    """Step 5 of the module docstring: the ``phy2log`` that moves fewest experts from
    ``previous`` while its balance stays within ``tolerance`` of ``fresh``'s."""
    layers, num_experts = load.shape
    relabelled = _relabel_ranks(fresh.phy2log, previous, num_nodes)
    fresh_peaks = rank_load(load, fresh).max(axis=-1)
    # Relabelling never loses to the fresh labels: each layer keeps whichever moves fewer.
    both = _arrivals(np.stack([relabelled, fresh.phy2log], axis=1), previous)
    relabelled = np.where((both[:, 0] <= both[:, 1])[:, None], relabelled, fresh.phy2log)
    relabelled_arrivals = both.min(axis=1, keepdims=True)
    repaired, repaired_peaks, repaired_arrivals = _swap_descent(load, previous, fresh_peaks)
    phy2log = np.concatenate([relabelled[:, None, :], repaired], axis=1)
    peaks = np.concatenate([fresh_peaks[:, None], repaired_peaks], axis=1)
    arrivals = np.concatenate([relabelled_arrivals, repaired_arrivals], axis=1)
    means = load.sum() / fresh.num_ranks
    fresh_total = float(fresh_peaks.sum())
    budget = np.inf
    if fresh_total > 0 and means / fresh_total > tolerance:
        budget = means / (means / fresh_total - tolerance)
    if num_experts % fresh.num_ranks == 0:
        contiguous = Placement.contiguous(layers, num_experts, fresh.num_ranks)
        budget = min(budget, float(rank_load(load, contiguous).max(axis=-1).sum()))
    # Rounding must not put the fresh placement itself outside the budget.
    budget = max(budget, fresh_total)
    # Only candidates moving no more than the relabelled fresh placement, layer by layer.
    allowed = arrivals <= arrivals[:, :1]
    choice = _cheapest_within_budget(arrivals, peaks, allowed, budget)
    return phy2log[np.arange(layers), choice]


def _relabel_ranks(phy2log: np.ndarray, previous: Placement, num_nodes: int) -> np.ndarray:
    """Step 5a: rename ranks (nodes first, then ranks inside nodes) onto previous ranks."""
    num_ranks = previous.num_ranks
    slots = phy2log.shape[1] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    old = _presence_of(previous.phy2log, num_ranks, previous.num_logical_experts)
    new = _presence_of(phy2log, num_ranks, previous.num_logical_experts)
    # overlap[layer, new rank, old rank]: experts the two ranks share.
    overlap = np.einsum("lre,lse->lrs", new.astype(np.float32), old.astype(np.float32))
    layers = phy2log.shape[0]
    if num_nodes > 1:
        node_overlap = overlap.reshape(
            layers, num_nodes, ranks_per_node, num_nodes, ranks_per_node
        ).sum(axis=(2, 4))
        node_of = _match(node_overlap)  # [layers, new node] -> old node
        rank_target = (
            node_of[:, :, None] * ranks_per_node + np.arange(ranks_per_node)[None, None, :]
        ).reshape(layers, num_ranks)
        # Reorder rank blocks so new node n sits where old node node_of[n] was.
        overlap = np.take_along_axis(overlap, np.argsort(rank_target, axis=1)[:, :, None], axis=1)
        phy2log = _permute_ranks(phy2log, np.argsort(rank_target, axis=1), slots)
        same_node = (
            np.arange(num_ranks)[:, None] // ranks_per_node
            == np.arange(num_ranks)[None, :] // ranks_per_node
        )
        overlap = np.where(same_node, overlap, -1.0)
    rank_of = _match(overlap)  # [layers, new rank] -> old rank
    return _permute_ranks(phy2log, np.argsort(rank_of, axis=1), slots)


def _match(overlap: np.ndarray) -> np.ndarray:
    """Greedy maximum-weight matching of ``[batch, n, n]`` (ties to the lowest indices), kept
    per row only where its total beats the identity. Returns ``[batch, n]``: new -> old."""
    batch, n, _ = overlap.shape
    rows = np.arange(batch)
    remaining = overlap.astype(np.float64).copy()
    target = np.empty((batch, n), dtype=np.int64)
    for _ in range(n):
        best = np.argmax(remaining.reshape(batch, n * n), axis=1)
        new, old = np.divmod(best, n)
        target[rows, new] = old
        remaining[rows, new, :] = -np.inf
        remaining[rows, :, old] = -np.inf
    greedy = np.take_along_axis(overlap, target[:, :, None], axis=2).sum(axis=(1, 2))
    identity = np.trace(overlap, axis1=1, axis2=2)
    return np.where((greedy > identity)[:, None], target, np.arange(n))


def _permute_ranks(phy2log: np.ndarray, source: np.ndarray, slots: int) -> np.ndarray:
    """``phy2log`` whose rank ``r`` holds what rank ``source[layer, r]`` held."""
    layers, num_physical = phy2log.shape
    blocks = phy2log.reshape(layers, num_physical // slots, slots)
    return np.take_along_axis(blocks, source[:, :, None], axis=1).reshape(layers, num_physical)


def _swap_descent(
    load: np.ndarray, previous: Placement, target_peaks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 5b: swap descent from ``previous`` until each layer's peak is within its target.

    Returns every round's ``phy2log`` ``[layers, rounds + 1, physical]`` (round 0 is
    ``previous``), its peak rank load and its arrivals ``[layers, rounds + 1]``. Arrivals are
    kept exact through per-rank replica counts: an expert arrives on a rank it did not hold in
    ``previous`` and leaves it when its last copy there goes.
    """
    layers, num_physical = previous.phy2log.shape
    num_ranks, slots = previous.num_ranks, previous.slots_per_rank
    rows = np.arange(layers)
    rank_of_slot = np.arange(num_physical) // slots
    phy2log = np.array(previous.phy2log)
    slot_load = np.take_along_axis(load / previous.replica_counts, phy2log, axis=1)
    loads = slot_load.reshape(layers, num_ranks, slots).sum(axis=-1)
    held_before = _presence(previous)
    copies = np.zeros((layers, num_ranks, previous.num_logical_experts), dtype=np.int64)
    np.add.at(copies, (rows[:, None], rank_of_slot[None, :], phy2log), 1)
    arrivals = np.zeros(layers, dtype=np.int64)
    rounds = [phy2log.copy()]
    peak_rounds = [loads.max(axis=1)]
    arrival_rounds = [arrivals.copy()]
    for _ in range(_MAX_SWAP_ROUNDS):
        peak = loads.max(axis=1)
        layer = rows[peak > target_peaks]
        if not layer.size:
            break
        # Only layers still above target are searched: most reach it within a few rounds.
        hot = np.argmax(loads[layer], axis=1)
        hot_slots = hot[:, None] * slots + np.arange(slots)
        give = np.take_along_axis(slot_load[layer], hot_slots, axis=1)
        # Swapping hot slot i with slot j: the hot rank trades give[i] for slot_load[j], and
        # slot j's rank the reverse; the pair's new peak decides.
        take = slot_load[layer][:, None, :]
        hot_after = peak[layer, None, None] - give[:, :, None] + take
        other_after = loads[layer][:, rank_of_slot][:, None, :] + give[:, :, None] - take
        pair_peak = np.maximum(hot_after, other_after)
        pair_peak = np.where(rank_of_slot[None, None, :] == hot[:, None, None], np.inf, pair_peak)
        flat = pair_peak.reshape(len(layer), slots * num_physical)
        best = np.argmin(flat, axis=1)
        improves = flat[np.arange(len(layer)), best] < peak[layer] * (1 - 1e-12)
        if not improves.any():
            break
        layer, best = layer[improves], best[improves]
        hot_slot = hot_slots[improves, best // num_physical]
        other_slot = best % num_physical
        hot_expert, other_expert = phy2log[layer, hot_slot], phy2log[layer, other_slot]
        hot_rank, other_rank = rank_of_slot[hot_slot], rank_of_slot[other_slot]
        for expert, source, destination in (
            (hot_expert, hot_rank, other_rank),
            (other_expert, other_rank, hot_rank),
        ):
            copies[layer, source, expert] -= 1
            arrivals[layer] -= (copies[layer, source, expert] == 0) & ~held_before[
                layer, source, expert
            ]
            copies[layer, destination, expert] += 1
            arrivals[layer] += (copies[layer, destination, expert] == 1) & ~held_before[
                layer, destination, expert
            ]
        phy2log[layer, hot_slot], phy2log[layer, other_slot] = other_expert, hot_expert
        hot_load, other_load = slot_load[layer, hot_slot], slot_load[layer, other_slot]
        slot_load[layer, hot_slot], slot_load[layer, other_slot] = other_load, hot_load
        loads[layer, hot_rank] += other_load - hot_load
        loads[layer, other_rank] += hot_load - other_load
        rounds.append(phy2log.copy())
        peak_rounds.append(loads.max(axis=1))
        arrival_rounds.append(arrivals.copy())
    return np.stack(rounds, axis=1), np.stack(peak_rounds, axis=1), np.stack(arrival_rounds, axis=1)


def _arrivals(phy2log: np.ndarray, previous: Placement) -> np.ndarray:
    """Experts arriving on a rank, ``[layers, candidates]``, for ``phy2log`` ``[layers, c, P]``."""
    layers, count, num_physical = phy2log.shape
    num_experts = previous.num_logical_experts
    old = _presence(previous)
    new = _presence_of(
        phy2log.transpose(1, 0, 2).reshape(count * layers, num_physical),
        previous.num_ranks,
        num_experts,
    ).reshape(count, layers, previous.num_ranks, num_experts)
    return (new & ~old[None]).sum(axis=(2, 3)).T


def _cheapest_within_budget(
    arrivals: np.ndarray, peaks: np.ndarray, allowed: np.ndarray, budget: float
) -> np.ndarray:
    """Step 5c: per layer, the candidate index minimising total arrivals with the sum of the
    chosen peaks within ``budget``. Candidate 0 must be allowed everywhere and within budget.

    For a multiplier ``lam`` every layer takes its minimum of ``arrivals + lam * peak`` (ties to
    fewer arrivals, then the lowest index); the total peak only falls as ``lam`` grows, so the
    smallest feasible ``lam`` among the exact breakpoints (where a layer's choice can change) is
    found by bisection.
    """
    cost_moves = np.where(allowed, arrivals, np.inf)
    d_moves = arrivals[:, :, None] - arrivals[:, None, :]
    d_peaks = peaks[:, None, :] - peaks[:, :, None]
    both = allowed[:, :, None] & allowed[:, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        breakpoints = np.where(both & (d_peaks > 0) & (d_moves > 0), d_moves / d_peaks, np.nan)
    lams = np.unique(np.concatenate([[0.0], breakpoints[np.isfinite(breakpoints)]]))

    def choose(lam: float) -> np.ndarray:
        cost = cost_moves + lam * peaks
        best = cost.min(axis=1, keepdims=True)
        # Among equal costs, fewest arrivals first, then the lowest index.
        tied = np.where(np.isclose(cost, best, rtol=1e-12, atol=0.0), cost_moves, np.inf)
        return np.argmin(tied, axis=1)

    def total_peak(choice: np.ndarray) -> float:
        return float(peaks[np.arange(len(choice)), choice].sum())

    low, high = 0, len(lams) - 1
    if total_peak(choose(lams[high])) > budget:
        return np.zeros(len(peaks), dtype=np.int64)
    while low < high:
        middle = (low + high) // 2
        if total_peak(choose(lams[middle])) <= budget:
            high = middle
        else:
            low = middle + 1
    return choose(lams[low])


def _preserve_slots(new: Placement, previous: Placement) -> Placement:
    """Reorder slots inside each rank of ``new`` so experts that stay keep their old slot."""
    shape = (new.num_layers, new.num_ranks, new.slots_per_rank)
    if (previous.num_layers, previous.num_ranks, previous.slots_per_rank) != shape or (
        previous.num_logical_experts != new.num_logical_experts
    ):
        raise ValueError("previous placement has a different shape")
    new_slots = new.phy2log.reshape(shape)
    old_slots = previous.phy2log.reshape(shape)
    # Pair the k-th copy of an expert on a rank in new with its k-th copy there in previous, so
    # duplicate replicas on one rank match one-to-one.
    same = (new_slots[..., :, None] == old_slots[..., None, :]) & (
        _copy_index(new_slots)[..., :, None] == _copy_index(old_slots)[..., None, :]
    )
    stays = same.any(axis=-1)
    reused = same.any(axis=-2)
    # Old slots not reused, in ascending order, take the arriving experts in their new order.
    free_slots = np.argsort(reused, axis=-1, kind="stable")
    arrival = np.clip(np.cumsum(~stays, axis=-1) - 1, 0, None)
    destination = np.where(
        stays, same.argmax(axis=-1), np.take_along_axis(free_slots, arrival, axis=-1)
    )
    ordered = np.empty_like(new_slots)
    np.put_along_axis(ordered, destination, new_slots, axis=-1)
    return Placement(ordered.reshape(new.phy2log.shape), new.num_ranks, new.num_logical_experts)


def _copy_index(slots: np.ndarray) -> np.ndarray:
    """For ``[..., S]`` expert ids: how many earlier slots on the same rank hold the same id."""
    earlier = np.tri(slots.shape[-1], k=-1, dtype=bool)
    return ((slots[..., :, None] == slots[..., None, :]) & earlier).sum(axis=-1)


def _presence(placement: Placement) -> np.ndarray:
    """``[layers, ranks, experts]``: whether a rank holds at least one replica of an expert."""
    return _presence_of(placement.phy2log, placement.num_ranks, placement.num_logical_experts)


def _presence_of(phy2log: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    layers, num_physical = phy2log.shape
    present = np.zeros((layers, num_ranks, num_experts), dtype=bool)
    rank_of_slot = np.arange(num_physical) // (num_physical // num_ranks)
    present[np.arange(layers)[:, None], rank_of_slot, phy2log] = True
    return present
