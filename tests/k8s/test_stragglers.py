"""Straggler detection on what a real Prometheus scraped from dcgm-exporter's series: a simulated
DEP32 decode group on 8 trays (``baton sim --cluster``, one exporter per tray) under load, and
one GPU throttled to 70% (Prometheus and the simulator on loopback; ``make dev-bin`` builds
Prometheus)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.stragglers import GpuClock, StragglerWatch, clock_queries, clocks_from
from rigs.stragglers import SimulatedGroup, simulated_group
from tests.helpers import eventually, free_port, scrape

TRAYS = [f"cell-0-tray-{i}" for i in range(8)]
WINDOW_S = 4  # a few 1 s scrapes in each window's median


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[SimulatedGroup]:
    with simulated_group(tmp_path, "cell-0", controller=f"127.0.0.1:{free_port()}") as group:
        yield group


def window(rack: SimulatedGroup) -> list[GpuClock]:
    """One window of the group's GPUs, as Prometheus holds them now."""
    clocks, reasons = clock_queries(TRAYS, WINDOW_S)
    return clocks_from(rack.prometheus.query(clocks), rack.prometheus.query(reasons))


def test_one_gpu_throttled_to_70_percent_is_found_on_its_tray_and_no_other(
    rack: SimulatedGroup,
) -> None:
    watch = StragglerWatch(persist=3)
    # every GPU of the 8 trays scraped, busy, for a whole window
    eventually(
        lambda: (
            len(window(rack)) == 32
            and all(scrape(s, "vllm:num_requests_running") == 8 for s in rack.servers)
        ),
        timeout=120,
        interval=0.5,
    )
    eventually(lambda: min(gpu.sm_clock_mhz for gpu in window(rack)) > 1000, timeout=60)
    for index in range(4):  # healthy: nothing, window after window
        assert watch.observe(float(index), window(rack)) == []
    # rank 13: the second GPU of the fourth tray
    rack.faults.inject(rack.servers[3], action="throttle", rank=13, share=0.7, seconds=3600)
    eventually(lambda: min(gpu.sm_clock_mhz for gpu in window(rack)) < 0.75 * 1900, timeout=60)
    verdicts = [watch.observe(float(4 + index), window(rack)) for index in range(3)]
    assert verdicts[:2] == [[], []]  # an outlier, but not yet for three windows
    [degraded] = verdicts[2]
    assert (degraded.tray, degraded.gpu) == ("cell-0-tray-3", "1")
    assert degraded.reasons == ("hw_thermal_slowdown",)
    assert 0.65 < degraded.clock_share < 0.75
    assert degraded.since == 4.0
