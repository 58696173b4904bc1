"""Baton's EPLB plugin for vLLM, outside vLLM: its placement, each fallback path, its report and
its reporter (the plugin inside vLLM 0.33 itself: tests/vllm/test_eplb_plugin.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from baton.core.eplb_report import POLICY_ENV, REPORT_PATH
from baton.core.experts import balance, moves
from baton.core.vllm_eplb import vllm_rebalance
from eplb.algorithm import rebalance
from eplb.plugin_install import install, plugin_modules
from eplb.reporter import Reporter
from eplb.vllm_plugin import (
    ENTRY_POINT_NAME,
    ENTRY_POINT_VALUE,
    SIMULATOR_ENTRY_POINT_GROUP,
    configured_policy,
    place_and_report,
    rebalance_window,
    register,
    simulated_engine_policy,
    supported,
    window_report,
)
from tests.helpers import eventually, free_port

RANKS, EXPERTS, REDUNDANT = 4, 16, 4


def load(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=(3, EXPERTS))


def unneeded() -> np.ndarray:
    raise AssertionError("vLLM's policy was not needed")


def test_a_window_is_placed_by_baton_keeping_experts_where_they_are() -> None:
    old = rebalance(load(1), RANKS, REDUNDANT)
    result = rebalance_window(load(2), EXPERTS + REDUNDANT, 1, 1, RANKS, old.phy2log, unneeded)
    expected = rebalance(load(2), RANKS, REDUNDANT, previous=old)
    assert np.array_equal(result.phy2log, expected.phy2log)
    assert (result.policy, result.fallback) == ("baton", None)
    assert result.balance_before is not None and result.balance_after >= result.balance_before


def test_an_error_in_batons_placement_leaves_the_window_to_vllms_policy() -> None:
    bad = load(3).astype(np.float64)
    bad[0, 0] = -5  # Baton's algorithm refuses negative load; vLLM's places it anyway
    theirs = vllm_rebalance(bad, RANKS, REDUNDANT).phy2log
    result = rebalance_window(bad, EXPERTS + REDUNDANT, 1, 1, RANKS, None, lambda: theirs)
    assert np.array_equal(result.phy2log, theirs)
    assert (result.policy, result.fallback) == ("vllm_default", "ValueError")


def test_a_window_vllms_policy_places_as_configured_is_measured_as_batons_would_be() -> None:
    old = vllm_rebalance(load(1), RANKS, REDUNDANT)
    theirs = vllm_rebalance(load(2), RANKS, REDUNDANT, previous=old)
    result = rebalance_window(
        load(2),
        EXPERTS + REDUNDANT,
        1,
        1,
        RANKS,
        old.phy2log,
        lambda: theirs.phy2log,
        "vllm_default",
    )
    assert np.array_equal(result.phy2log, theirs.phy2log)
    assert (result.policy, result.fallback) == ("vllm_default", None)  # chosen, not a fallback
    assert result.balance_before == balance(load(2).astype(np.float64), old)
    assert result.balance_after == balance(load(2).astype(np.float64), theirs)
    assert result.experts_moved == moves(old, theirs) > 0


def test_the_pods_policy_decides_who_places_and_an_unknown_one_leaves_batons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    theirs = vllm_rebalance(load(3), RANKS, REDUNDANT).phy2log
    ours = rebalance(load(3), RANKS, REDUNDANT).phy2log

    def placed() -> np.ndarray:
        return place_and_report(
            load(3),
            EXPERTS + REDUNDANT,
            1,
            1,
            RANKS,
            None,
            lambda: theirs,
            reports=lambda: False,
            version="0.33.0",
        )

    assert configured_policy() == "baton" and np.array_equal(placed(), ours)
    monkeypatch.setenv(POLICY_ENV, "vllm_default")
    assert np.array_equal(placed(), theirs)
    monkeypatch.setenv(POLICY_ENV, "round_robin")
    assert configured_policy() == "baton" and np.array_equal(placed(), ours)


def test_a_placement_with_empty_slots_is_no_previous_one() -> None:
    # vLLM's elastic EP marks slots it dropped with -1: nothing to keep experts near.
    old = rebalance(load(4), RANKS, REDUNDANT).phy2log.copy()
    old[0, 0] = -1
    result = rebalance_window(load(5), EXPERTS + REDUNDANT, 1, 1, RANKS, old, unneeded)
    assert np.array_equal(result.phy2log, rebalance(load(5), RANKS, REDUNDANT).phy2log)
    assert result.balance_before is None and result.experts_moved == 0


def test_only_the_vllm_releases_it_was_written_for_activate_it() -> None:
    assert supported("0.33.0") and supported("0.33.1") and supported("0.32.0+cpu")
    assert supported("0.26.0")  # the lent GPUs' release
    assert not supported("0.34.0") and not supported("0.3.3") and not supported("0.31.1")
    assert not supported("0.27.0")


def test_outside_vllm_registering_changes_nothing_and_raises_nothing() -> None:
    register()  # .venv has no vLLM: the plugin stays inactive and says so


def test_a_report_needs_the_pods_group_and_carries_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = rebalance_window(load(6), EXPERTS + REDUNDANT, 1, 1, RANKS, None, unneeded)
    assert window_report(result, load(6), RANKS, "0.33.0") is None
    for key, value in (("NAMESPACE", "serving"), ("DEPLOYMENT", "dsv4"), ("CELL", "dsv4-cell-0")):
        monkeypatch.setenv(f"BATON_{key}", value)
    report = window_report(result, load(6), RANKS, "0.33.0")
    assert report is not None and report.cell == "dsv4-cell-0"
    assert np.array_equal(np.array(report.load), load(6)) and report.experts == EXPERTS


def test_the_reporter_neither_blocks_nor_raises_when_the_service_is_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in (("NAMESPACE", "serving"), ("DEPLOYMENT", "dsv4"), ("CELL", "dsv4-cell-0")):
        monkeypatch.setenv(f"BATON_{key}", value)
    reporter = Reporter(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    result = rebalance_window(load(7), EXPERTS + REDUNDANT, 1, 1, RANKS, None, unneeded)
    report = window_report(result, load(7), RANKS, "0.33.0")
    assert report is not None
    for _ in range(10):  # more than the queue holds: the oldest go, and submit returns
        reporter.submit(REPORT_PATH, report)
    eventually(lambda: reporter.failed >= 1, timeout=20)
    assert reporter.dropped >= 1 and reporter.sent == 0


def test_the_install_directory_holds_the_plugin_and_its_entry_point(tmp_path: Path) -> None:
    install(tmp_path)
    for module in plugin_modules():
        path = tmp_path / Path(*module.split("."))
        assert (path / "__init__.py").exists() or path.with_suffix(".py").exists(), module
    assert not any(m.split(".")[0] in ("sim", "router", "controller") for m in plugin_modules())
    [entry_points] = tmp_path.glob("*.dist-info/entry_points.txt")
    assert entry_points.read_text() == (
        f"[vllm.general_plugins]\n{ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE}\n"
    )


def test_an_install_of_baton_declares_the_same_entry_point() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {ENTRY_POINT_NAME: ENTRY_POINT_VALUE}


def test_a_window_vllms_policy_placed_after_an_error_is_answered_and_still_reported() -> None:
    bad = load(8).astype(np.float64)
    bad[1, 2] = -1  # Baton's algorithm refuses negative load
    theirs = vllm_rebalance(bad, RANKS, REDUNDANT).phy2log
    asked: list[bool] = []

    def reports() -> bool:
        asked.append(True)
        return False

    answer = place_and_report(
        bad,
        EXPERTS + REDUNDANT,
        1,
        1,
        RANKS,
        None,
        lambda: theirs,
        reports=reports,
        version="0.33.0",
    )
    assert np.array_equal(answer, theirs)
    assert asked == [True]  # the service counts fallbacks (policy vllm_default)


def test_the_simulator_finds_the_same_policy_by_its_entry_point() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"][SIMULATOR_ENTRY_POINT_GROUP]
    assert declared == {"baton": "eplb.vllm_plugin:simulated_engine_policy"}
    old = rebalance(load(1), RANKS, REDUNDANT)
    policy = simulated_engine_policy("cell-0")
    placed = policy(load(2), EXPERTS + REDUNDANT, 1, 1, RANKS, old.phy2log)
    expected = rebalance(load(2), RANKS, REDUNDANT, previous=old)
    assert np.array_equal(placed, expected.phy2log)
