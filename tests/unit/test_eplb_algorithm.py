"""Properties of the EPLB placement algorithm (eplb.algorithm)."""

import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from baton.core.experts import (
    Placement,
    balance,
    balance_per_step,
    moves,
    moves_per_rank,
    rank_load,
)
from eplb.algorithm import DEFAULT_TOLERANCE, rebalance

PROPERTY = settings(max_examples=50, deadline=None)


@dataclass(frozen=True)
class Case:
    """A small EP layout and a load to rebalance."""

    load: np.ndarray
    num_ranks: int
    num_redundant: int
    num_nodes: int
    num_groups: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_ranks = draw(st.integers(1, 6))
    num_experts = num_ranks * draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    num_nodes = draw(st.sampled_from([n for n in range(1, num_ranks + 1) if num_ranks % n == 0]))
    num_groups = draw(
        st.sampled_from([g for g in range(1, num_experts + 1) if num_experts % g == 0])
    )
    # Small integers give many ties; large ones heavy skew. Both are what rebalance must handle.
    high = draw(st.sampled_from([2, 1000]))
    load = draw(arrays(np.int64, (layers, num_experts), elements=st.integers(0, high)))
    return Case(load, num_ranks, num_ranks * draw(st.integers(0, 2)), num_nodes, num_groups)


def rebalanced(case: Case, previous: Placement | None = None) -> Placement:
    return rebalance(
        case.load, case.num_ranks, case.num_redundant, case.num_nodes, case.num_groups, previous
    )


@PROPERTY
@given(cases())
def test_rebalance_keeps_at_least_one_replica_of_every_logical_expert(case: Case) -> None:
    placement = rebalanced(case)
    experts = case.load.shape[1]
    for row in placement.phy2log:
        assert set(row.tolist()) == set(range(experts))
    assert (placement.replica_counts >= 1).all()


@PROPERTY
@given(cases())
def test_rebalance_fills_every_rank_with_exactly_its_slots(case: Case) -> None:
    placement = rebalanced(case)
    layers, experts = case.load.shape
    physical = experts + case.num_redundant
    assert placement.phy2log.shape == (layers, physical)
    assert placement.slots_per_rank * case.num_ranks == physical
    assert (placement.replica_counts.sum(axis=1) == physical).all()
    # log2phy names every physical slot exactly once.
    for held in placement.log2phy:
        assert sorted(held[held >= 0].tolist()) == list(range(physical))


@PROPERTY
@given(cases())
def test_rebalance_never_balances_worse_than_the_contiguous_placement(case: Case) -> None:
    layers, experts = case.load.shape
    contiguous = Placement.contiguous(layers, experts, case.num_ranks)
    assert balance(case.load, rebalanced(case)) >= balance(case.load, contiguous) - 1e-12


@PROPERTY
@given(cases())
def test_rebalance_is_deterministic(case: Case) -> None:
    first = rebalanced(case)
    assert rebalanced(case) == first
    assert np.array_equal(rebalanced(case).phy2log, first.phy2log)


@PROPERTY
@given(cases())
def test_from_phy2log_rebuilds_the_same_placement(case: Case) -> None:
    placement = rebalanced(case)
    rebuilt = Placement.from_phy2log(placement.phy2log, case.num_ranks, case.load.shape[1])
    assert rebuilt == placement
    assert np.array_equal(rebuilt.log2phy, placement.log2phy)
    assert np.array_equal(rebuilt.replica_counts, placement.replica_counts)
    for layer, table in enumerate(placement.log2phy):
        for expert, slots in enumerate(table):
            held = slots[slots >= 0]
            assert len(held) == placement.replica_counts[layer, expert]
            assert (placement.phy2log[layer, held] == expert).all()


@PROPERTY
@given(cases(), st.data())
def test_slot_preservation_keeps_unmoved_experts_in_their_old_slots(
    case: Case, data: st.DataObject
) -> None:
    previous = rebalanced(case)
    new_load = data.draw(arrays(np.int64, case.load.shape, elements=st.integers(0, 1000)))
    later = Case(new_load, case.num_ranks, case.num_redundant, case.num_nodes, case.num_groups)
    preserved = rebalanced(later, previous=previous)
    shape = (case.load.shape[0], case.num_ranks, previous.slots_per_rank)
    old_slots, new_slots = (p.phy2log.reshape(shape) for p in (previous, preserved))
    for layer in range(shape[0]):
        for rank in range(shape[1]):
            old, new = old_slots[layer, rank], new_slots[layer, rank]
            for expert in set(old.tolist()) & set(new.tolist()):
                kept = min((old == expert).sum(), (new == expert).sum())
                assert ((old == expert) & (new == expert)).sum() == kept


def test_deepseek_readme_example_gives_a_valid_hierarchical_placement() -> None:
    # deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
    load = np.array(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    placement = rebalance(load, num_ranks=8, num_redundant=4, num_nodes=2, num_groups=4)
    assert placement.phy2log.shape == (2, 16)
    assert placement.slots_per_rank == 2
    assert (placement.replica_counts >= 1).all()
    assert placement.replica_counts.sum(axis=1).tolist() == [16, 16]
    # Each node (4 ranks = 8 slots) holds whole groups of 3 experts and no other node's groups.
    for row in placement.phy2log:
        node_groups = [set((row[n * 8 : (n + 1) * 8] // 3).tolist()) for n in range(2)]
        assert len(node_groups[0]) == len(node_groups[1]) == 2
        assert not node_groups[0] & node_groups[1]
        for n, groups in enumerate(node_groups):
            node_experts = set(row[n * 8 : (n + 1) * 8].tolist())
            assert node_experts == {3 * g + i for g in groups for i in range(3)}
    # Same algorithm, same ties: the README's published first layer.
    assert placement.phy2log[0].tolist() == [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]


def test_contiguous_placement_puts_expert_e_on_rank_e_over_experts_per_rank() -> None:
    placement = Placement.contiguous(layers=2, logical_experts=8, num_ranks=4)
    assert placement.slots_per_rank == 2
    assert placement.phy2log.tolist() == [list(range(8))] * 2
    assert (placement.replica_counts == 1).all()
    assert placement.log2phy.shape == (2, 8, 1)


def test_rank_load_splits_an_expert_evenly_over_its_replicas() -> None:
    # Two ranks of two slots; expert 0 has a replica on each rank.
    placement = Placement.from_phy2log(np.array([[0, 1, 0, 2]]), num_ranks=2)
    load = np.array([[10.0, 3.0, 5.0]])
    assert rank_load(load, placement).tolist() == [[8.0, 10.0]]
    assert balance(load, placement) == pytest.approx(9.0 / 10.0)


def test_balance_is_one_for_uniform_and_for_empty_load() -> None:
    placement = Placement.contiguous(layers=3, logical_experts=8, num_ranks=4)
    assert balance(np.ones((3, 8)), placement) == 1.0
    assert balance(np.zeros((3, 8)), placement) == 1.0


def test_balance_sums_over_layers_before_dividing() -> None:
    placement = Placement.contiguous(layers=2, logical_experts=2, num_ranks=2)
    load = np.array([[1.0, 0.0], [5.0, 5.0]])
    # Layer ratios 0.5 and 1.0; vLLM's figure is (0.5 + 5) / (1 + 5).
    assert balance(load, placement) == pytest.approx(5.5 / 6.0)
    steps = np.stack([load, np.ones((2, 2))])
    assert balance_per_step(steps, placement) == pytest.approx([5.5 / 6.0, 1.0])


def test_placement_rejects_a_logical_expert_without_replica() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        Placement(np.array([[0, 0, 1, 1]]), num_ranks=2, num_logical_experts=3)


def test_moves_count_each_expert_new_on_a_rank_once() -> None:
    previous = Placement.from_phy2log(np.array([[0, 1, 2, 3, 3, 3]]), num_ranks=2)
    # Rank 0 gains expert 3; rank 1 gains expert 0, twice, which is one copy over the network.
    new = Placement.from_phy2log(np.array([[2, 3, 1, 0, 0, 3]]), num_ranks=2)
    assert moves_per_rank(previous, new).tolist() == [[1, 1]]
    assert moves(previous, new) == 2
    assert moves(new, new) == 0


def test_rebalance_places_the_target_model_at_dep32_with_its_balance() -> None:
    # Its time is a benchmark figure (`baton bench eplb`), not a test's.
    rng = np.random.default_rng(0)
    load = rng.lognormal(0.0, 1.5, size=(43, 384))
    placement = rebalance(load, num_ranks=32, num_redundant=32)
    drifted = load * rng.lognormal(0.0, 0.3, size=load.shape)
    kept = rebalance(drifted, 32, 32, previous=placement)
    assert placement.phy2log.shape == kept.phy2log.shape == (43, 416)
    assert balance(load, placement) > 0.95
    assert balance(drifted, kept) >= balance(drifted, rebalance(drifted, 32, 32)) - 0.005


@st.composite
def drifted(draw: st.DrawFn) -> tuple[Case, np.ndarray]:
    """A case and a later load: each expert's load scaled by a random factor (drift)."""
    case = draw(cases())
    factors = draw(
        arrays(np.float64, case.load.shape, elements=st.floats(0.5, 2.0, allow_nan=False))
    )
    return case, np.rint(case.load * factors).astype(np.int64)


def with_load(case: Case, load: np.ndarray) -> Case:
    return Case(load, case.num_ranks, case.num_redundant, case.num_nodes, case.num_groups)


@PROPERTY
@given(drifted())
def test_keeping_previous_never_moves_more_than_from_scratch(
    sample: tuple[Case, np.ndarray],
) -> None:
    case, later = sample
    previous = rebalanced(case)
    fresh = rebalanced(with_load(case, later))
    kept = rebalanced(with_load(case, later), previous=previous)
    assert moves(previous, kept) <= moves(previous, fresh)


@PROPERTY
@given(drifted())
def test_keeping_previous_stays_within_tolerance_of_from_scratch_balance(
    sample: tuple[Case, np.ndarray],
) -> None:
    case, later = sample
    previous = rebalanced(case)
    fresh = rebalanced(with_load(case, later))
    kept = rebalanced(with_load(case, later), previous=previous)
    assert balance(later, kept) >= balance(later, fresh) - DEFAULT_TOLERANCE - 1e-12


@PROPERTY
@given(drifted())
def test_keeping_previous_keeps_every_invariant_and_is_deterministic(
    sample: tuple[Case, np.ndarray],
) -> None:
    case, later = sample
    previous = rebalanced(case)
    kept = rebalanced(with_load(case, later), previous=previous)
    assert kept == rebalanced(with_load(case, later), previous=previous)
    assert (kept.replica_counts >= 1).all()
    assert kept.phy2log.shape == previous.phy2log.shape
    layers, experts = later.shape
    contiguous = Placement.contiguous(layers, experts, case.num_ranks)
    assert balance(later, kept) >= balance(later, contiguous) - 1e-12


@PROPERTY
@given(cases())
def test_an_unchanged_load_moves_nothing(case: Case) -> None:
    previous = rebalanced(case)
    assert moves(previous, rebalanced(case, previous=previous)) == 0


def test_zero_tolerance_still_moves_fewer_experts_than_from_scratch_at_equal_balance() -> None:
    rng = np.random.default_rng(1)
    load = rng.lognormal(0.0, 1.0, size=(4, 64))
    previous = rebalance(load, 16, 16)
    later = load * rng.lognormal(0.0, 0.1, size=load.shape)
    fresh = rebalance(later, 16, 16)
    kept = rebalance(later, 16, 16, previous=previous, tolerance=0.0)
    assert balance(later, kept) >= balance(later, fresh) - 1e-12
    assert moves(previous, kept) <= moves(previous, fresh)


def test_drift_at_dep32_moves_a_small_share_of_what_from_scratch_moves() -> None:
    rng = np.random.default_rng(0)
    load = rng.lognormal(0.0, 1.0, size=(43, 384)) * 1e5
    previous = rebalance(load, 32, 32)
    later = load * rng.lognormal(0.0, 0.1, size=load.shape)
    kept = rebalance(later, 32, 32, previous=previous)
    fresh = rebalance(later, 32, 32)
    assert moves(previous, kept) <= 0.25 * moves(previous, fresh)
    assert balance(later, kept) >= balance(later, fresh) - DEFAULT_TOLERANCE


def test_previous_of_another_shape_is_refused() -> None:
    previous = rebalance(np.ones((2, 8)), 4, 0)
    with pytest.raises(ValueError, match="different shape"):
        rebalance(np.ones((2, 8)), 4, 4, previous=previous)


def test_a_placement_keeps_its_slots_not_a_table_padded_to_its_hottest_expert() -> None:
    # log2phy pads every expert to the largest replica count: one hot expert with hundreds of
    # replicas made each kept placement megabytes; the service keeps dozens of them.
    layers, experts, ranks = 43, 32, 32
    one_layer = np.concatenate([np.arange(experts), np.zeros(992, dtype=np.int64)])
    phy2log = np.tile(one_layer, (layers, 1))
    tracemalloc.start()
    try:
        placement = Placement(phy2log, ranks, experts)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert placement.replica_counts[0, 0] == 993
    assert held < 2 * phy2log.nbytes, f"{held} bytes held for {phy2log.nbytes} of slots"
    assert placement.log2phy.shape == (layers, experts, 993)
