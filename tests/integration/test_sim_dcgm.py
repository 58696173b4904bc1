"""``baton sim --dcgm-port``: dcgm-exporter's per-GPU series for a tray, and a throttled GPU
or a GPU's failing NVLinks that every rank of its lockstep group pays for."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rigs.faults import FaultInjection
from sim.dcgm import HW_THERMAL_SLOWDOWN, NOMINAL_SM_CLOCK_MHZ, SW_POWER_CAP
from tests.helpers import SimHandle, eventually, free_port, keep_decoding, scrape


def dcgm(port: int) -> dict[str, dict[str, float]]:
    """Each DCGM field's value per ``gpu`` label, with every series' labels checked."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    fields: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            assert set(labels) == {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"}
            assert labels["Hostname"] == "gb300-tray-7" and labels["modelName"] == "NVIDIA GB300"
            assert labels["device"] == f"nvidia{labels['gpu']}"
            fields.setdefault(sample.name, {})[labels["gpu"]] = sample.value
    return fields


def mean_step(url: str, steps: int) -> float:
    """The group's mean step (simulated seconds, by the performance model, so a busy host does
    not stretch it) over its next ``steps`` steps."""
    total = scrape(url, "baton:sim_step_seconds_total")
    count = scrape(url, "baton:sim_steps_total")
    eventually(lambda: scrape(url, "baton:sim_steps_total") >= count + steps, timeout=120)
    done = scrape(url, "baton:sim_steps_total") - count
    return (scrape(url, "baton:sim_step_seconds_total") - total) / done


def decoding_tray(
    start_sim: Callable[..., SimHandle], faults: FaultInjection
) -> tuple[SimHandle, int]:
    """A tray's four ranks of a DP group, every one decoding, and its exporter's port."""
    port = free_port()
    sim = start_sim(
        *("--data-parallel-size", "4", "--enable-expert-parallel"),
        *("--dcgm-port", str(port), "--dcgm-hostname", "gb300-tray-7"),
        *faults.flags,
    )
    keep_decoding(sim.url, requests=16, ranks=4)
    eventually(lambda: scrape(sim.url, "vllm:num_requests_running") == 16, timeout=60)
    return sim, port


def test_a_throttled_gpu_shows_in_dcgm_and_slows_every_rank_of_its_group(
    start_sim: Callable[..., SimHandle], faults: FaultInjection
) -> None:
    sim, port = decoding_tray(start_sim, faults)
    healthy = dcgm(port)
    assert set(healthy["DCGM_FI_DEV_SM_CLOCK"]) == {"0", "1", "2", "3"}
    assert all(v > 0.97 * NOMINAL_SM_CLOCK_MHZ for v in healthy["DCGM_FI_DEV_SM_CLOCK"].values())
    assert set(healthy["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"].values()) == {0}
    mean_step(sim.url, 100)  # the requests' prefills behind, every rank decoding
    before = mean_step(sim.url, 300)

    faults.inject(sim.url, action="throttle", rank=2, share=0.7, seconds=3600)
    throttled = dcgm(port)
    clocks = throttled["DCGM_FI_DEV_SM_CLOCK"]
    assert 0.66 * NOMINAL_SM_CLOCK_MHZ < clocks["2"] <= 0.7 * NOMINAL_SM_CLOCK_MHZ
    assert all(clocks[gpu] > 0.97 * NOMINAL_SM_CLOCK_MHZ for gpu in ("0", "1", "3"))
    reasons = throttled["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]
    assert int(reasons["2"]) & HW_THERMAL_SLOWDOWN
    assert not any(int(reasons[gpu]) & HW_THERMAL_SLOWDOWN for gpu in ("0", "1", "3"))
    temps = throttled["DCGM_FI_DEV_GPU_TEMP"]
    assert temps["2"] > max(temps[gpu] for gpu in ("0", "1", "3")) + 10
    # ranks 0, 1 and 3 are healthy, yet every step of the group waits for rank 2's GPU
    # (1/0.7 for the same batches; the batches' own mix moves it by some percent)
    assert mean_step(sim.url, 300) > 1.2 * before


def test_failing_nvlinks_climb_their_gpus_error_counters_and_slow_the_group_clocks_untouched(
    start_sim: Callable[..., SimHandle], faults: FaultInjection
) -> None:
    sim, port = decoding_tray(start_sim, faults)
    replays = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
    healthy = dcgm(port)
    for counter in (replays, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"):
        assert healthy[counter] == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0}
    mean_step(sim.url, 100)
    before = mean_step(sim.url, 300)

    faults.inject(sim.url, action="nvlink_errors", rank=1, rate=50, factor=1.3, seconds=3600)
    first = dcgm(port)[replays]["1"]
    after = mean_step(sim.url, 300)
    failing = dcgm(port)
    assert failing[replays]["1"] > first  # a counter: it climbs while the fault lasts
    assert failing["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"]["1"] == failing[replays]["1"]
    assert all(failing[replays][gpu] == 0.0 for gpu in ("0", "2", "3"))
    clocks = failing["DCGM_FI_DEV_SM_CLOCK"]
    assert all(clock > 0.97 * NOMINAL_SM_CLOCK_MHZ for clock in clocks.values())
    assert after > 1.2 * before


def test_rack_noise_keeps_each_gpu_a_few_percent_below_nominal_and_dips_a_few_scrapes(
    start_sim: Callable[..., SimHandle],
) -> None:
    port = free_port()
    sim = start_sim(
        *("--data-parallel-size", "4", "--enable-expert-parallel"),
        *("--dcgm-port", str(port), "--dcgm-hostname", "gb300-tray-7", "--dcgm-noise", "rack"),
    )
    keep_decoding(sim.url, requests=16, ranks=4)
    eventually(lambda: scrape(sim.url, "vllm:num_requests_running") == 16, timeout=60)
    scrapes = [dcgm(port) for _ in range(400)]
    for gpu in ("0", "1", "2", "3"):
        clocks = sorted(s["DCGM_FI_DEV_SM_CLOCK"][gpu] for s in scrapes)
        # its own clock: up to 3% below nominal, less the scrape's jitter
        assert 0.955 * NOMINAL_SM_CLOCK_MHZ < clocks[len(clocks) // 2] <= NOMINAL_SM_CLOCK_MHZ
    dips = [
        (s["DCGM_FI_DEV_SM_CLOCK"][gpu], int(s["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"][gpu]))
        for s in scrapes
        for gpu in ("0", "1", "2", "3")
        if int(s["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"][gpu]) & SW_POWER_CAP
    ]
    # one GPU-scrape in fifty: about 32 of 1,600, each 5-15% down
    assert 5 <= len(dips) <= 80
    assert all(
        0.8 * NOMINAL_SM_CLOCK_MHZ < clock < 0.96 * NOMINAL_SM_CLOCK_MHZ for clock, _ in dips
    )
    assert not any(reasons & HW_THERMAL_SLOWDOWN for _, reasons in dips)
