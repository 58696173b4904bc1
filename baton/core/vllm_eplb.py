"""vLLM 0.33's default EPLB policy (DeepSeek's EPLB algorithm), as its engines run it.

Written here from the documented behaviour of ``vllm/distributed/eplb/policy/default.py``
(``DefaultEplbPolicy.rebalance_experts``), vectorised over layers; its outputs are vLLM's,
ties included. Two callers share it: the simulator's in-engine EPLB, which is what a vLLM engine
started with ``--enable-eplb`` does, and Baton's own algorithm (``eplb.algorithm``), which
starts from the same fresh placement and then keeps experts where they are.

``vllm_rebalance(load, ...)``, from the ``[layers, logical experts]`` load of a window:

1. Groups onto nodes (hierarchical policy, when ``num_groups % num_nodes == 0``; otherwise the
   same steps with one group and one node): the load of each expert group is packed onto the
   nodes, ``num_groups / num_nodes`` groups a node, so group-limited routing stays in a node.
2. Replication, per node: every expert of the node gets one slot; each further slot goes to the
   expert with the highest load per replica.
3. Packing, per node: the node's replicas, heaviest first (vLLM's sort, whose order of equal
   loads is numpy's default sort's), each to the lightest rank that still has a free slot; with
   one item per pack, item ``i`` goes to pack ``i``.
4. With the placement in force (``previous``): an expert that stays on a GPU keeps its slot
   there, and arriving experts fill the freed slots in ascending order. Nothing else of the
   previous placement is kept: ranks are not relabelled, so an expert that the fresh packing puts
   on another GPU moves even where a relabelling would have kept it. Every switch is close to a
   from-scratch one in bytes moved.

vLLM casts the load to float32 before step 1; so does ``vllm_rebalance``. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from baton.core.experts import Placement

# vLLM's EPLB cadence (``EPLBConfig`` in vllm/config/parallel.py): rebalance every 3,000 steps
# from the expert load of the last 1,000. The simulator's engines, the ModelDeployment's
# spec.eplb and ``baton up`` default to it.
VLLM_STEP_INTERVAL = 3000
VLLM_WINDOW_SIZE = 1000

__all__ = [
    "VLLM_STEP_INTERVAL",
    "VLLM_WINDOW_SIZE",
    "balanced_packing",
    "pack_hierarchically",
    "policy_groups",
    "preserve_slots",
    "replicate_experts",
    "vllm_rebalance",
]


def policy_groups(num_groups: int, num_nodes: int) -> tuple[int, int]:
    """The (groups, nodes) the policy packs with: hierarchical when the groups split over the
    nodes, else global (one group, one node)."""
    return (num_groups, num_nodes) if num_groups % num_nodes == 0 else (1, 1)


def vllm_rebalance(
    load: np.ndarray,
    num_ranks: int,
    num_redundant: int = 0,
    num_nodes: int = 1,
    num_groups: int = 1,
    previous: Placement | None = None,
) -> Placement:
    """vLLM's default policy: steps 1-4 of the module docstring."""
    weight = np.asarray(load, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] == 0:
        raise ValueError(f"load must be [layers, logical experts], got {weight.shape}")
    num_experts = weight.shape[1]
    groups, nodes = policy_groups(num_groups, num_nodes)
    phy2log = pack_hierarchically(weight, num_experts + num_redundant, groups, nodes, num_ranks)
    placement = Placement(phy2log, num_ranks, num_experts)
    return placement if previous is None else preserve_slots(placement, previous)


def pack_hierarchically(
    load: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> np.ndarray:
    """Steps 1-3: ``phy2log`` ``[layers, num_physical]`` for ``load`` ``[layers, experts]``."""
    layers, num_experts = load.shape
    if num_physical < num_experts or num_ranks <= 0 or num_physical % num_ranks != 0:
        raise ValueError(f"{num_physical} physical experts do not split over {num_ranks} ranks")
    if num_nodes <= 0 or num_ranks % num_nodes != 0:
        raise ValueError(f"{num_ranks} ranks do not split over {num_nodes} nodes")
    if num_groups <= 0 or num_experts % num_groups != 0 or num_groups % num_nodes != 0:
        raise ValueError(
            f"{num_experts} experts do not split into {num_groups} groups over {num_nodes} nodes"
        )
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks

    # Step 1: groups onto nodes. Number experts node-major ("meta" ids): node n holds meta ids
    # n*E/N .. (n+1)*E/N - 1, its groups in packing order, each group's experts contiguous.
    group_load = load.reshape(layers, num_groups, group_size).sum(axis=-1)
    group_node, group_slot = balanced_packing(group_load, num_nodes)
    group_position = group_node * groups_per_node + group_slot
    meta_of_expert = (group_position[:, :, None] * group_size + np.arange(group_size)).reshape(
        layers, num_experts
    )
    expert_of_meta = np.argsort(meta_of_expert, axis=1)
    meta_load = np.take_along_axis(load, expert_of_meta, axis=1)

    # Step 2: replicate inside each node; (layer, node) pairs form one batch axis.
    node_load = meta_load.reshape(layers * num_nodes, experts_per_node)
    replica_expert, counts = replicate_experts(node_load, slots_per_node)

    # Step 3: pack the node's replicas onto its ranks, then lay each rank's slots out contiguously.
    replica_load = np.take_along_axis(node_load / counts, replica_expert, axis=1)
    rank_in_node, slot_in_rank = balanced_packing(replica_load, num_ranks // num_nodes)
    node_phy2meta = np.empty_like(replica_expert)
    np.put_along_axis(
        node_phy2meta, rank_in_node * slots_per_rank + slot_in_rank, replica_expert, axis=1
    )
    node_offset = np.arange(num_nodes, dtype=np.int64)[None, :, None] * experts_per_node
    meta = (node_phy2meta.reshape(layers, num_nodes, slots_per_node) + node_offset).reshape(
        layers, num_physical
    )
    return np.take_along_axis(expert_of_meta, meta, axis=1)


def replicate_experts(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
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


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the ``n`` items of each row of ``weight`` ``[batch, n]`` into ``num_packs`` packs.

    Every pack receives exactly ``n / num_packs`` items: items go heaviest first to the lightest
    pack that is not full. Returns each item's pack and its slot within the pack.
    """
    batch, num_items = weight.shape
    capacity = num_items // num_packs
    if capacity == 1:
        items = np.tile(np.arange(num_items, dtype=np.int64), (batch, 1))
        return items, np.zeros_like(items)
    rows = np.arange(batch)
    order = np.argsort(-weight, axis=1)  # vLLM's sort, so equal loads come in its order
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


def preserve_slots(new: Placement, previous: Placement) -> Placement:
    """Step 4: reorder slots inside each rank of ``new`` so experts that stay keep their old
    slot. A rank's set of experts is unchanged, so balance and moves are too."""
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
    copies: np.ndarray = ((slots[..., :, None] == slots[..., None, :]) & earlier).sum(axis=-1)
    return copies
