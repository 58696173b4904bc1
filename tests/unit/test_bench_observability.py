"""``baton bench observability``'s pictures: each panel's axis in a reader's words."""

from __future__ import annotations

from bench.observability import axis_label
from deploy.grafana.dashboards import DASHBOARDS


def test_every_unit_the_dashboards_use_is_drawn_in_a_readers_words_not_grafanas_id() -> None:
    units = {panel.unit for spec in DASHBOARDS for panel in spec.panels}
    assert units  # the dashboards' own units, whatever they become
    for unit in units:
        label = axis_label(unit)
        assert label != unit or unit == "", unit  # never Grafana's id itself
    assert axis_label("currencyUSD") == "USD"
    assert axis_label("suffix: tok/s/GPU") == "tok/s/GPU"
    assert axis_label("short") == ""  # a plain number: the title says what it counts
