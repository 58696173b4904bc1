"""What a syncing service does about the switches an earlier one left (``eplb.recovery``)."""

from __future__ import annotations

from eplb.recovery import AgentState, Pending, Recovery, plan_recovery

OLD, NEW = (b"old", 3), (b"new", 4)


def agent(address: str, placement: tuple[bytes, int] = OLD, *pending: Pending) -> AgentState:
    return AgentState(address, {"target": placement}, pending)


def staged(committed: bool = False, step: int = 900) -> Pending:
    return Pending("target", "s1", committed, step)


def test_a_group_in_agreement_with_nothing_pending_needs_nothing() -> None:
    assert plan_recovery([agent("a"), agent("b")]).clean


def test_a_switch_staged_and_committed_nowhere_is_aborted_everywhere() -> None:
    recovery = plan_recovery([agent("a", OLD, staged()), agent("b", OLD, staged()), agent("c")])
    assert recovery == Recovery(abort=("s1",))


def test_a_switch_committed_on_some_agents_is_committed_on_the_rest_at_the_same_step() -> None:
    recovery = plan_recovery(
        [
            agent("a", OLD, staged(committed=True, step=900)),
            agent("b", OLD, staged()),
            agent("c", OLD, staged()),
        ]
    )
    assert recovery.commit == (("b", "s1", 900), ("c", "s1", 900))
    assert recovery.wait_for == (("s1", 900),) and not recovery.abort


def test_a_switch_committed_on_every_holder_is_waited_for_not_touched() -> None:
    recovery = plan_recovery([agent("a", OLD, staged(True)), agent("b", OLD, staged(True))])
    assert recovery == Recovery(wait_for=(("s1", 900),))


def test_placements_are_compared_only_once_nothing_is_pending() -> None:
    recovery = plan_recovery([agent("a", NEW, staged(True)), agent("b", OLD)])
    assert not recovery.behind and recovery.wait_for


def test_agents_left_on_an_older_placement_take_the_newest() -> None:
    recovery = plan_recovery([agent("a", NEW), agent("b", OLD), agent("c", OLD)])
    assert recovery == Recovery(behind={"target": (("b", "c"), "a")})


def test_same_placement_at_another_version_is_still_behind() -> None:
    # versions must agree too (the service's windows follow them): the laggard's own switch
    # to the placement brings its version level
    recovery = plan_recovery([agent("a", (b"new", 5)), agent("b", (b"new", 4))])
    assert recovery.behind == {"target": (("b",), "a")}
