"""Straggler detection on what a real Prometheus scraped from dcgm-exporter's series: a simulated
DEP32 decode group on 8 trays (``baton sim --cluster``, one exporter per tray) under load, and
one GPU throttled to 70% (Prometheus and the simulator on loopback; ``make dev-bin`` builds
Prometheus)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from controller.stragglers import GpuClock, StragglerWatch, clock_queries, clocks_from
from rigs.devcluster import binaries_dir
from rigs.faults import FaultInjection
from rigs.observability import Prometheus, start_prometheus
from tests.helpers import (
    ROOT,
    baton_command,
    eventually,
    free_port,
    free_port_block,
    keep_decoding,
    scrape,
    stop_process,
    wait_healthy,
)

TRAYS = [f"cell-0-tray-{i}" for i in range(8)]
WINDOW_S = 4  # a few 1 s scrapes in each window's median


@dataclass(frozen=True)
class Rack:
    prometheus: Prometheus
    servers: list[str]  # the decode group's 8 API servers, a tray's four ranks each
    faults: FaultInjection


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Rack]:
    faults = FaultInjection(tmp_path)
    decode, dcgm = free_port_block(8), free_port_block(8)
    spec = {
        "served_model_name": "dsv4",
        "fault_injection_token_file": str(faults.token_file),
        "decode_groups": [
            {
                "name": "cell-0",
                "data_parallel_size": 32,
                "api_servers": 8,
                "port": decode,
                "side_channel_port": free_port_block(32),
                "dcgm_port": dcgm,
            }
        ],
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(spec))
    targets = tmp_path / "targets.json"
    targets.write_text(
        json.dumps(
            [{"targets": [f"127.0.0.1:{dcgm + i}" for i in range(8)], "labels": {"job": "dcgm"}}]
        )
    )
    log = tmp_path / "cluster.log"
    process = subprocess.Popen(
        baton_command("sim", "--cluster", str(tmp_path / "cluster.yaml")),
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    servers = [f"http://127.0.0.1:{decode + i}" for i in range(8)]
    try:
        for server in servers:
            wait_healthy(server, process, log, timeout=120)
        for server in servers:  # every GPU busy, as a serving group's are
            keep_decoding(server, requests=8, ranks=4)
        with start_prometheus(
            binaries_dir(), tmp_path, file_sd=targets, controller=f"127.0.0.1:{free_port()}"
        ) as prometheus:
            yield Rack(prometheus, servers, faults)
    finally:
        stop_process(process)


def window(rack: Rack) -> list[GpuClock]:
    """One window of the group's GPUs, as Prometheus holds them now."""
    clocks, reasons = clock_queries(TRAYS, WINDOW_S)
    return clocks_from(rack.prometheus.query(clocks), rack.prometheus.query(reasons))


def test_one_gpu_throttled_to_70_percent_is_found_on_its_tray_and_no_other(rack: Rack) -> None:
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
