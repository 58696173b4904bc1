"""Chaos under load: every fault a cell's processes meet, several at a time, and nothing lost.

One cell as separate processes (``rigs.chaos``) takes agentic sessions through two gateway
replicas while ``bench.chaos.SHORT`` kills, stops and slows its engines, gateways and EPLB
service. ``baton bench chaos`` runs the same checks on longer seeded schedules and a soak.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.core.proto import eplb_agent_pb2 as pb
from bench.chaos import (
    MEMORY_KILLS,
    RECOVERY_BOUND_S,
    SHORT,
    SPLIT_HEAL_S,
    AppliedFault,
    ChaosReport,
    Fault,
    Split,
    excused_by_commit_kill,
    memory_lives,
    placements_agree,
    random_schedule,
    run_chaos,
)
from rigs.chaos import ChaosStack

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ChaosStack]:
    stack = ChaosStack(tmp_path)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_every_fault_under_load_leaves_every_request_answered_and_nothing_behind(
    stack: ChaosStack,
) -> None:
    report: ChaosReport = asyncio.run(run_chaos(stack, SHORT, lanes=8, load_s=100.0))
    explained = json.dumps(report.faults, indent=1) + "\n" + stack.logs(["eplb"])
    # every fault of the schedule met the phase it was meant for
    assert all("not applied" not in fault["note"] for fault in report.faults), explained
    assert all(fault["ended_s"] is not None for fault in report.faults), explained
    # every request completed with its own tokens, or got a well-formed error; none hung
    assert report.violations == [], report.violations[:5]
    assert report.outcomes.get("ok", 0) > 50, report.outcomes
    # the killed gateway's streams are the only ones cut without an answer
    assert report.outcomes.get("transport_error", 0) == 0
    # the EPLB service rebalanced again after the last fault (the load goes on until it does,
    # however slowly a busy host steps the engines)
    assert report.rebalanced_s is not None, explained
    assert report.eplb_switches["committed_rebalances"] > 0, report.eplb_switches
    # and finished the switch left half committed: committed on the agent left behind, or, if
    # the service was down past the switch's step and the committed agent switched alone, that
    # agent's peers switched after it; no rank ran a placement alone otherwise (what a service
    # killed in Prepare left depends on the moment: a switch staged, aborted by the next; or
    # already committed everywhere, waited for)
    finished = report.eplb_switches["committed"] + report.eplb_switches["reunified"]
    assert finished >= 1, explained
    assert report.ranks_switched_alone == [], explained
    assert report.placements["agreed"], report.placements
    # back to serving, and nothing held
    assert report.recovery_s is not None and report.recovery_s <= RECOVERY_BOUND_S
    assert report.leaks == {}


def test_a_split_is_excused_only_after_a_commit_kill_and_until_it_should_have_healed() -> None:
    kill = AppliedFault(Fault(10, "kill_eplb_commit", 0, 2), started_s=10.0, ended_s=14.0)
    kill.note = "killed with one agent committed and the other not"
    missed = AppliedFault(Fault(50, "kill_eplb_commit", 0, 2), started_s=50.0, ended_s=51.0)
    missed.note = "the first agent was never committed; not applied"
    prepare = AppliedFault(Fault(70, "kill_eplb_prepare", 0, 2), started_s=70.0, ended_s=73.0)
    prepare.note = "killed while its agents staged a switch"
    applied = [kill, missed, prepare]

    def split(t_s: float) -> Split:
        return Split(t_s, "target", [(3, False), (2, False)])

    assert excused_by_commit_kill(split(12.0), applied)
    assert excused_by_commit_kill(split(14.0 + SPLIT_HEAL_S), applied)
    assert not excused_by_commit_kill(split(9.5), applied)
    assert not excused_by_commit_kill(split(14.5 + SPLIT_HEAL_S), applied)
    assert not excused_by_commit_kill(split(50.5), applied)  # nothing was committed
    assert not excused_by_commit_kill(split(71.0), applied)  # a kill in Prepare splits nothing


def _state(version: int, *pending: tuple[str, bool, int]) -> pb.PlacementState:
    return pb.PlacementState(
        placements=[pb.Placement(model="target", phy2log=bytes([version]), version=version)],
        pending=[
            pb.PendingSwitch(model="target", switch_id=s, committed=c, apply_at_step=step)
            for s, c, step in pending
        ],
    )


def test_placements_agree_with_a_laggard_following_a_switch_its_peer_applied() -> None:
    assert placements_agree([_state(1), _state(0, ("s", True, 713))])["agreed"]
    assert placements_agree([_state(1, ("s", True, 9)), _state(1, ("s", True, 9))])["agreed"]
    assert placements_agree([_state(1, ("s", False, 0)), _state(1, ("s", False, 0))])["agreed"]


def test_placements_disagree_where_a_rank_could_switch_alone() -> None:
    cases = {
        "behind, nothing to follow": [_state(1), _state(0)],
        "committed on one, not on its peer on the same version": [
            _state(1, ("s", True, 9)),
            _state(1),
        ],
        "staged on one only": [_state(1, ("s", False, 0)), _state(1)],
        "committed for different steps": [_state(1, ("s", True, 9)), _state(1, ("s", True, 12))],
    }
    for case, states in cases.items():
        verdict = placements_agree(states)
        assert not verdict["agreed"] and verdict["problems"], case


def _samples(sizes: dict[str, list[tuple[int, float]]], every: float = 30) -> list[dict[str, Any]]:
    """RSS samples every ``every`` s: per component, (pid, MiB) at each step (pid 0: down)."""
    steps = len(next(iter(sizes.values())))
    samples = []
    for step in range(steps):
        sample: dict[str, Any] = {"t_s": step * every, "pids": {}}
        for name, series in sizes.items():
            pid, mib = series[step]
            if pid:
                sample[name], sample["pids"][name] = mib, pid
        samples.append(sample)
    return samples


def test_memory_is_judged_on_each_components_longest_life_after_its_warm_up() -> None:
    minutes = 30
    steps = minutes * 2
    flat = [(1, 80.0 if step < 10 else 90.0 + (step % 3)) for step in range(steps)]
    # a replica killed at 5 min and restarted: a new process climbing 1 MiB/min
    climbing = [(2, 80.0)] * 10 + [(3, 80.0 + step / 2) for step in range(steps - 10)]
    lives = memory_lives(_samples({"steady": flat, "leaky": climbing}))
    assert lives["steady"]["pid"] == 1 and lives["steady"]["flat"]
    assert lives["steady"]["after_warm_up_mib"] == 91.0  # the warm-up's climb is not growth
    assert lives["leaky"]["pid"] == 3 and not lives["leaky"]["flat"]
    assert lives["leaky"]["mib_per_min"] == pytest.approx(1.0, abs=0.05)


def test_a_process_too_short_lived_is_not_judged() -> None:
    lives = memory_lives(_samples({"brief": [(4, 50.0)] * 20}))
    assert "flat" not in lives["brief"] and lives["brief"]["lived_s"] == 570


def test_a_soak_schedule_spares_the_judged_processes_at_its_end() -> None:
    whole = random_schedule(7, 1800, mean_gap_s=20.0)
    spared = random_schedule(7, 1800, mean_gap_s=20.0, spare_after_s=900)
    assert [f.at_s for f in spared] == [f.at_s for f in whole]
    assert [f for f in spared if f.at_s < 900] == [f for f in whole if f.at_s < 900]
    assert any(f.kind in MEMORY_KILLS for f in whole if f.at_s >= 900)
    assert not any(f.kind in MEMORY_KILLS for f in spared if f.at_s >= 900)
