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
5. Slot preservation (when ``previous`` is given): an expert that stays on a rank keeps its old
   slot index within the rank, so its weights are not copied; the other experts fill the freed
   slots in ascending order. This reorders slots inside ranks only and never changes a rank's
   set of experts, so it does not change balance.

Invariants of every ``Placement`` (checked on construction): every logical expert has at least
one replica, every rank has exactly ``S`` slots, ``phy2log`` holds only valid logical ids.
Invariants of ``rebalance``: with ``E % num_ranks == 0`` no layer's peak rank load exceeds the
contiguous placement's, so its balance is never lower; the output is deterministic, every tie
(equal loads, equally loaded ranks) going to the lowest index. Nothing prevents two replicas of
one expert from sharing a rank (DeepSeek's algorithm does not either).
"""

from dataclasses import dataclass, field

import numpy as np

__all__ = [
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
) -> Placement:
    """Place ``E + num_redundant`` replicas of ``load``'s ``E`` experts on ``num_ranks`` ranks.

    ``load`` is ``[layers, logical experts]`` (e.g. routed tokens summed over a window). The
    policy is hierarchical when ``num_nodes > 1`` and ``num_groups % num_nodes == 0``, global
    otherwise (see the module docstring). No layer ends up worse balanced than under the
    contiguous default (when ``E % num_ranks == 0``). With ``previous``, experts that stay on a
    rank keep their slot.
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
    phy2log = _hierarchical_phy2log(load, num_physical, num_groups, num_nodes, num_ranks)
    if num_experts % num_ranks == 0:
        phy2log = _no_worse_than_contiguous(load, Placement(phy2log, num_ranks, num_experts))
    placement = Placement(phy2log, num_ranks, num_experts)
    if previous is not None:
        placement = _preserve_slots(placement, previous)
    return placement


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
    present = np.zeros(
        (placement.num_layers, placement.num_ranks, placement.num_logical_experts), dtype=bool
    )
    rank_of_slot = np.arange(placement.phy2log.shape[1]) // placement.slots_per_rank
    present[np.arange(placement.num_layers)[:, None], rank_of_slot, placement.phy2log] = True
    return present
