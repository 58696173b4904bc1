"""``baton bench stragglers``' reading of the EPLB service's log and the move rule it reports."""

from __future__ import annotations

import pytest

from bench.stragglers import _eplb_recovery, _pays_after

# Lines as eplb/service.py logs them, from a group's start, a restart and its restore.
LOG = """\
INFO baton.eplb: group g: 32 ranks over 1 agents, models ['draft', 'target'], step 387
INFO baton.eplb: group g target: no rebalance at step 600 (incomplete_window; window balance 1.0000 -> 1.0000 predicted)
INFO baton.eplb: group g target: switch g-target-900-ab committed for step 960: window [600, 900) balance 0.7012 -> 0.9655 predicted (0.9700 on the window), 812 experts moved, round trip 4.0 ms
INFO baton.eplb: group g target: no rebalance at step 1200 (gain_too_small; window balance 0.9641 -> 0.9650 predicted)
WARNING baton.eplb: group g: agent 127.0.0.1:1: UNAVAILABLE: Socket closed; its windows restart (agent_lost)
INFO baton.eplb: group g: 32 ranks over 1 agents, models ['draft', 'target'], step 10
WARNING baton.eplb: group g target: its engines came back on placement version 0 of their own, not the one in force before they restarted (version 1 then); restoring it (g-target-restore-cd)
INFO baton.eplb: group g target: no rebalance at step 300 (switch_pending; window balance 1.0000 -> 1.0000 predicted)
INFO baton.eplb: group g target: no rebalance at step 600 (gain_too_small; window balance 0.9630 -> 0.9644 predicted)
"""  # noqa: E501


def test_the_balance_before_the_fault_and_after_the_restore_come_from_complete_windows() -> None:
    recovery = _eplb_recovery(LOG)
    assert recovery["syncs"] == [387, 10]
    assert recovery["restored"] == 1
    assert recovery["cold_balance"] == 0.7012  # the first complete window, on the cold placement
    assert recovery["balance_before_fault"] == 0.9641
    assert recovery["balance_after_restart"] == [0.963]
    assert recovery["steps_to_first_decision_after_restart"] == 590


def test_the_move_pays_after_a_restart_over_the_share_of_capacity_lost() -> None:
    assert _pays_after(1 / 0.7, 180.0) == pytest.approx(600.0)
    assert _pays_after(1.0, 180.0) is None
