"""Baton's EPLB algorithm: vLLM's fresh placement, then as few expert moves as balance allows.

Placements, load and balance are the core's (``baton.core.experts``): rank ``r`` owns physical
slots ``r*S .. (r+1)*S - 1``, an expert's load splits evenly over its replicas, and balance is
the sum over layers of mean rank load over the sum of max rank load, as vLLM logs it.

``rebalance``, from the ``[layers, logical experts]`` load of a window:

1-3. The fresh placement of vLLM's default policy (DeepSeek's algorithm,
   ``baton.core.vllm_eplb.pack_hierarchically``): groups packed onto nodes when
   ``num_groups % num_nodes == 0`` (hierarchical, else global), experts replicated per node to
   the highest load per replica, replicas packed heaviest first onto the lightest open rank.
4. Safeguard: the greedy steps can lose to vLLM's contiguous default on small or degenerate
   loads, so a layer whose peak rank load would exceed the contiguous placement's gets that
   layout instead, with its redundant slots holding second copies of the rank's own experts
   (possible whenever ``E % num_ranks == 0``, the condition for a contiguous placement).
5. Keeping experts where they are (when ``previous`` is given), which vLLM's policy does not do
   beyond step 6. Every expert that arrives on a rank is bytes over NVLink during the switch, so
   the result is the placement with the fewest such arrivals among a few candidates whose
   balance stays within ``tolerance`` of step 4's:

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
6. Slot preservation (when ``previous`` is given; vLLM's step too,
   ``baton.core.vllm_eplb.preserve_slots``): an expert that stays on a rank keeps its old slot
   index within the rank, so its weights are not copied; the other experts fill the freed
   slots in ascending order. This never changes a rank's set of experts, so not balance either.

Invariants of ``rebalance``: with ``E % num_ranks == 0`` its balance is never below the
contiguous placement's (without ``previous`` no layer's peak rank load exceeds the contiguous
one); the output is deterministic (ties are broken as vLLM's policy breaks them). With
``previous``: no more experts move than from scratch, and balance is at least the from-scratch
balance minus ``tolerance``. Nothing prevents two replicas of one expert from sharing a rank
(DeepSeek's algorithm does not either). Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from baton.core.experts import Placement, experts_on_ranks, experts_on_ranks_of, rank_load
from baton.core.vllm_eplb import pack_hierarchically, policy_groups, preserve_slots

# Balance a rebalance may give up to keep experts where they are (see step 5).
DEFAULT_TOLERANCE = 0.005
# Rounds of swap descent (step 5b): one swap per layer and round. Calibrated drift between
# rebalances needs 15-25; a layer still short after this falls back to the fresh placement.
_MAX_SWAP_ROUNDS = 64

__all__ = ["DEFAULT_TOLERANCE", "rebalance"]


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
    policy is hierarchical when ``num_groups % num_nodes == 0``, global otherwise (see the
    module docstring). Balance is never below the contiguous default's (when
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
    if tolerance < 0:
        raise ValueError(f"tolerance must be non-negative, got {tolerance}")
    if num_nodes <= 0:
        raise ValueError(f"{num_ranks} ranks do not split over {num_nodes} nodes")
    num_groups, num_nodes = policy_groups(num_groups, num_nodes)
    phy2log = pack_hierarchically(load, num_physical, num_groups, num_nodes, num_ranks)
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
    return preserve_slots(Placement(phy2log, num_ranks, num_experts), previous)


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
    chosen: np.ndarray = phy2log[np.arange(layers), choice]
    return chosen


def _relabel_ranks(phy2log: np.ndarray, previous: Placement, num_nodes: int) -> np.ndarray:
    """Step 5a: rename ranks (nodes first, then ranks inside nodes) onto previous ranks."""
    num_ranks = previous.num_ranks
    slots = phy2log.shape[1] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    old = experts_on_ranks_of(previous.phy2log, num_ranks, previous.num_logical_experts)
    new = experts_on_ranks_of(phy2log, num_ranks, previous.num_logical_experts)
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
    held_before = experts_on_ranks(previous)
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
        # Two [layers, slots, physical] buffers, updated in place: this is the costly part.
        take = slot_load[layer][:, None, :]
        pair_peak = (peak[layer, None] - give)[:, :, None] + take
        other = loads[layer][:, rank_of_slot]
        other[rank_of_slot[None, :] == hot[:, None]] = np.inf  # no swap within the hot rank
        other_after = other[:, None, :] + give[:, :, None]
        other_after -= take
        np.maximum(pair_peak, other_after, out=pair_peak)
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
    old = experts_on_ranks(previous)
    new = experts_on_ranks_of(
        phy2log.transpose(1, 0, 2).reshape(count * layers, num_physical),
        previous.num_ranks,
        num_experts,
    ).reshape(count, layers, previous.num_ranks, num_experts)
    arrivals: np.ndarray = (new & ~old[None]).sum(axis=(2, 3)).T
    return arrivals


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
        cheapest: np.ndarray = np.argmin(tied, axis=1)
        return cheapest

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
