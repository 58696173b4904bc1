"""vLLM 0.33's default EPLB policy as the core writes it (baton.core.vllm_eplb), and how it
differs from Baton's minimal-move algorithm (eplb.algorithm) on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from baton.core.experts import Placement, balance, experts_on_ranks, moves
from baton.core.vllm_eplb import balanced_packing, preserve_slots, vllm_rebalance
from eplb.algorithm import rebalance

README_LOAD = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)


def test_the_deepseek_readme_example_gives_its_published_first_layer() -> None:
    # deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
    placement = vllm_rebalance(README_LOAD, num_ranks=8, num_redundant=4, num_nodes=2, num_groups=4)
    assert placement.phy2log[0].tolist() == [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]


def test_packing_with_one_item_per_pack_keeps_item_i_in_pack_i() -> None:
    pack, slot = balanced_packing(np.array([[1.0, 9.0, 5.0]]), num_packs=3)
    assert pack.tolist() == [[0, 1, 2]] and slot.tolist() == [[0, 0, 0]]


def test_packing_fills_every_pack_to_the_same_count_heaviest_first() -> None:
    pack, _ = balanced_packing(np.array([[8.0, 7.0, 2.0, 1.0]]), num_packs=2)
    # 8 -> pack 0, 7 -> pack 1, 2 -> pack 1 (lighter), 1 -> pack 0 (the only one not full)
    assert pack.tolist() == [[0, 1, 1, 0]]


def test_an_expert_that_stays_on_a_gpu_keeps_its_slot_there() -> None:
    rng = np.random.default_rng(3)
    previous = vllm_rebalance(rng.integers(1, 50, size=(4, 24)), num_ranks=4, num_redundant=8)
    new = vllm_rebalance(rng.integers(1, 50, size=(4, 24)), 4, 8, previous=previous)
    old_slots, new_slots = previous.phy2log.reshape(4, 4, 8), new.phy2log.reshape(4, 4, 8)
    for layer in range(4):
        for rank in range(4):
            for expert in set(old_slots[layer, rank]) & set(new_slots[layer, rank]):
                old_at = set(np.flatnonzero(old_slots[layer, rank] == expert))
                new_at = set(np.flatnonzero(new_slots[layer, rank] == expert))
                assert old_at & new_at, "a staying expert moved to another slot of its GPU"


def test_slot_preservation_never_changes_what_a_rank_holds() -> None:
    rng = np.random.default_rng(4)
    previous = vllm_rebalance(rng.integers(1, 50, size=(3, 16)), num_ranks=4, num_redundant=4)
    fresh = vllm_rebalance(rng.integers(1, 50, size=(3, 16)), num_ranks=4, num_redundant=4)
    kept = preserve_slots(fresh, previous)
    assert (experts_on_ranks(kept) == experts_on_ranks(fresh)).all()
    assert moves(previous, kept) == moves(previous, fresh)


def test_ranks_are_not_relabelled_so_a_shuffled_placement_moves_almost_everything() -> None:
    # The same load, its fresh placement with the ranks' contents rotated by one: vLLM's policy
    # rebuilds the fresh placement and moves nearly every expert; Baton's relabels ranks and
    # moves none, at the same balance.
    load = np.random.default_rng(5).lognormal(0.0, 1.0, size=(4, 64)) * 1000
    fresh = vllm_rebalance(load, num_ranks=8, num_redundant=8)
    rotated = Placement(np.roll(fresh.phy2log, 9, axis=1), 8, 64)
    vllm = vllm_rebalance(load, 8, 8, previous=rotated)
    baton = rebalance(load, 8, 8, previous=rotated)
    assert moves(rotated, vllm) > 0.8 * fresh.phy2log.size
    assert moves(rotated, baton) == 0
    assert balance(load, baton) == pytest.approx(balance(load, vllm))


def test_the_load_is_taken_as_float32_as_vllm_casts_it() -> None:
    load = np.random.default_rng(6).integers(0, 2**26, size=(2, 16))
    assert vllm_rebalance(load, 4, 4) == vllm_rebalance(load.astype(np.float32), 4, 4)
