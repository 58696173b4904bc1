"""``make demo``'s EPLB rows: what the service did, from its /metrics scraped through the run."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from bench.demo import Samples, eplb_rows, parse_samples
from eplb.metrics import EplbMetrics

GROUP = "dsv4-cell-0"


class Service:
    """An EPLB service's metrics, moved as ``eplb/service.py`` moves them at each decision, and
    the demo's scrapes of them, the first before any decision."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = EplbMetrics(self.registry)
        self.timeline: list[Samples] = []
        self.scrape()

    def scrape(self) -> None:
        self.timeline.append(parse_samples(generate_latest(self.registry).decode()))

    def decide(
        self,
        model: str,
        outcome: str,
        step_balance: float | None = None,
        window: tuple[float, float] | None = None,
        *,
        scrape: bool = True,
    ) -> None:
        """One boundary: the step balance of a window with steps, the window balance before
        and predicted of a rebalance, then the outcome counted (after the switch)."""
        labels = (GROUP, model)
        if step_balance is not None:
            self.metrics.step_balance.labels(*labels).set(step_balance)
        if window is not None:
            self.metrics.balance.labels(*labels, "before").set(window[0])
            self.metrics.balance.labels(*labels, "predicted").set(window[1])
        self.metrics.rebalances.labels(*labels, outcome).inc()
        if scrape:
            self.scrape()

    def achieve(self, model: str, achieved: float) -> None:
        self.metrics.balance.labels(GROUP, model, "achieved").set(achieved)
        self.scrape()


def test_after_a_commit_the_rows_show_the_outcomes_and_the_balance_around_it() -> None:
    service = Service()
    service.decide("target", "incomplete_window")
    service.decide("target", "gain_too_small", 0.38)
    service.decide("target", "committed", 0.41, (0.35, 0.97))
    service.decide("target", "gain_too_small", 0.60)  # its window began before the switch
    service.achieve("target", 0.96)  # the switch's first full window
    service.scrape()
    service.decide("target", "gain_too_small", 0.93)
    rows = dict(eplb_rows(service.timeline))
    assert rows["EPLB target rebalances"] == (
        "1 committed; not rebalanced: 3 gain_too_small, 1 incomplete_window"
    )
    # the committing decision's own window ran before the switch
    assert rows["EPLB target step balance"] == (
        "0.41 before the first rebalance, 0.93 after it (latest window)"
    )
    assert rows["EPLB target first rebalance"] == (
        "window balance 0.350 -> 0.970 predicted, achieved 0.960"
    )
    assert "EPLB target last rebalance" not in rows
    assert rows["EPLB draft rebalances"] == "none yet"


def test_a_window_decided_in_the_report_that_measured_a_switch_is_not_after_it() -> None:
    service = Service()
    service.decide("target", "committed", 0.41, (0.35, 0.97))
    service.achieve("target", 0.96)
    # may have been decided in the same report as the measurement, on a window that began
    # before the switch took effect
    service.decide("target", "gain_too_small", 0.60)
    rows = dict(eplb_rows(service.timeline))
    assert rows["EPLB target step balance"] == (
        "0.41 before the first rebalance, none measured after it yet"
    )


def test_the_first_and_the_last_of_several_commits_each_get_their_own_achieved() -> None:
    service = Service()
    service.decide("draft", "committed", 0.20, (0.21, 0.95))
    # the next boundary rebalances again before the first switch's window was measured
    service.decide("draft", "committed", 0.33, (0.94, 0.95))
    service.achieve("draft", 0.94)
    service.decide("draft", "committed", 0.59, (0.94, 0.96))
    rows = dict(eplb_rows(service.timeline))
    assert rows["EPLB draft rebalances"] == "3 committed"
    assert rows["EPLB draft first rebalance"] == (
        "window balance 0.210 -> 0.950 predicted, achieved not measured before the next rebalance"
    )
    # the achieved balance there when the last was decided is the second's
    assert rows["EPLB draft last rebalance"] == (
        "window balance 0.940 -> 0.960 predicted, achieved not measured yet"
    )
    service.achieve("draft", 0.95)
    rows = dict(eplb_rows(service.timeline))
    assert rows["EPLB draft last rebalance"] == (
        "window balance 0.940 -> 0.960 predicted, achieved 0.950"
    )


def test_with_only_skips_the_rows_give_their_reasons_and_the_latest_step_balance() -> None:
    service = Service()
    for model in ("target", "draft"):
        service.decide(model, "incomplete_window")
        service.decide(model, "gain_too_small", 0.93)
        service.decide(model, "gain_too_small", 0.94)
    rows = dict(eplb_rows(service.timeline))
    for model in ("target", "draft"):
        assert rows[f"EPLB {model} rebalances"] == (
            "0 committed; not rebalanced: 2 gain_too_small, 1 incomplete_window"
        )
        assert rows[f"EPLB {model} step balance"] == "0.94, no rebalance committed"
        assert f"EPLB {model} first rebalance" not in rows


def test_before_any_complete_window_no_row_shows_a_balance_it_does_not_have() -> None:
    service = Service()
    service.scrape()
    rows = dict(eplb_rows(service.timeline))
    service.decide("target", "incomplete_window", 0.50)  # a window with steps, not all of them
    rows_after_a_skip = dict(eplb_rows(service.timeline))
    for found in (rows, rows_after_a_skip):
        assert "0.00" not in "".join(found.values())
        assert found["EPLB draft rebalances"] == "none yet"
        for model in ("target", "draft"):
            assert found[f"EPLB {model} step balance"] == "no complete window yet"
            assert f"EPLB {model} first rebalance" not in found
    assert rows["EPLB target rebalances"] == "none yet"
    assert rows_after_a_skip["EPLB target rebalances"] == (
        "0 committed; not rebalanced: 1 incomplete_window"
    )


def test_gauges_scraped_after_two_decisions_are_given_to_neither() -> None:
    service = Service()
    service.decide("target", "committed", 0.41, (0.35, 0.97), scrape=False)
    service.decide("target", "gain_too_small", 0.90)
    rows = dict(eplb_rows(service.timeline))
    assert rows["EPLB target step balance"] == (
        "not seen before the first rebalance, none measured after it yet"
    )
    assert rows["EPLB target first rebalance"] == (
        "window balance not seen (another decision between the same two scrapes)"
    )
