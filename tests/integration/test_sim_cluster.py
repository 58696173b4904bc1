"""``baton sim --cluster``: a whole rack's engines in one process on separate ports."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.helpers import (
    ROOT,
    baton_command,
    eventually,
    free_port_block,
    scrape,
    scrape_by,
    stop_process,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """One rack's engines for the module: each test uses ranks no other test touches."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    ports = {
        "decode": free_port_block(8),
        "prefill": free_port_block(3),
        "decode_nixl": free_port_block(32),
        "prefill_nixl": free_port_block(6),
        "dcgm": free_port_block(8),
    }
    spec = {
        "served_model_name": "dsv4",
        "decode_groups": [
            {
                "name": "cell-0",
                "data_parallel_size": 32,
                "api_servers": 8,
                "port": ports["decode"],
                "side_channel_port": ports["decode_nixl"],
                "dcgm_port": ports["dcgm"],
            }
        ],
        "prefill": [
            {
                "name": "cell-0-prefill",
                "instances": 3,
                "port": ports["prefill"],
                "side_channel_port": ports["prefill_nixl"],
            }
        ],
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = (tmp_path / "cluster.log").open("wb")
    process = subprocess.Popen(
        baton_command("sim", "--cluster", str(path)),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        for port in [
            *range(ports["decode"], ports["decode"] + 8),
            *range(ports["prefill"], ports["prefill"] + 3),
        ]:

            def healthy(p: int = port) -> bool:
                return (
                    process.poll() is None
                    and httpx.get(f"http://127.0.0.1:{p}/health").status_code == 200
                )

            eventually(healthy, timeout=60)
        assert process.poll() is None, (tmp_path / "cluster.log").read_text()
        yield ports
    finally:
        stop_process(process)
    assert process.returncode == 0, (tmp_path / "cluster.log").read_text()


def test_every_hybrid_lb_server_exposes_its_four_global_ranks(cluster: dict[str, int]) -> None:
    text = httpx.get(f"http://127.0.0.1:{cluster['decode'] + 3}/metrics").text
    engines = {
        line.split('engine="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    }
    assert engines == {"12", "13", "14", "15"}


def test_each_tray_of_a_decode_group_has_its_dcgm_exporter_for_its_four_gpus(
    cluster: dict[str, int],
) -> None:
    for tray in range(8):
        url = f"http://127.0.0.1:{cluster['dcgm'] + tray}"
        gpus = scrape_by(url, "DCGM_FI_DEV_SM_CLOCK", "gpu")
        assert set(gpus) == {"0", "1", "2", "3"}
        assert set(scrape_by(url, "DCGM_FI_DEV_SM_CLOCK", "Hostname")) == {f"cell-0-tray-{tray}"}


def test_pd_handoff_between_cluster_engines_lands_on_the_named_rank(
    cluster: dict[str, int],
) -> None:
    prefill_url = f"http://127.0.0.1:{cluster['prefill'] + 1}"
    decode_url = f"http://127.0.0.1:{cluster['decode'] + 3}"
    prompt = "cluster handoff " * 100
    first = httpx.post(
        f"{prefill_url}/v1/completions",
        timeout=30,
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = first.json()["kv_transfer_params"]
    assert params["remote_port"] == cluster["prefill_nixl"] + 2 + params[
        "remote_engine_id"
    ].endswith("_dp1")
    second = httpx.post(
        f"{decode_url}/v1/completions",
        timeout=30,
        headers={"X-data-parallel-rank": "2"},
        json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "kv_transfer_params": params},
    )
    assert second.status_code == 200, second.text
    assert scrape(decode_url, "vllm:request_success_total", engine="14") == 1
    assert scrape(prefill_url, "vllm:kv_cache_usage_perc") == 0


def test_decode_group_steps_in_lockstep_across_its_api_servers(cluster: dict[str, int]) -> None:
    """A busy rank behind one server slows a request on another server of the same group.

    Judged by the group's steps while rank 0 serves its request, as the performance model times
    them (simulated time), so a busy host cannot pass or fail it.
    """
    import concurrent.futures

    server = f"http://127.0.0.1:{cluster['decode']}"

    def mean_step_of_one_request() -> float:
        modelled = scrape(server, "baton:sim_step_seconds_total")
        steps = scrape(server, "baton:sim_steps_total")
        response = httpx.post(
            f"{server}/v1/completions",
            timeout=120,
            headers={"X-data-parallel-rank": "0"},
            json={"prompt": "x", "max_tokens": 64, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        taken = scrape(server, "baton:sim_steps_total") - steps
        return (scrape(server, "baton:sim_step_seconds_total") - modelled) / taken

    def crowd_request() -> int:
        return httpx.post(
            f"http://127.0.0.1:{cluster['decode'] + 7}/v1/completions",
            timeout=300,
            headers={"X-data-parallel-rank": "3"},
            json={"prompt": "x", "max_tokens": 4096, "ignore_eos": True},
        ).status_code

    alone = mean_step_of_one_request()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        crowd = [pool.submit(crowd_request) for _ in range(64)]
        # the eighth server's rank 3 (global rank 31) decodes all 64 while rank 0 serves one
        crowded = f"http://127.0.0.1:{cluster['decode'] + 7}"
        eventually(
            lambda: scrape(crowded, "vllm:num_requests_running", engine="31") == 64, timeout=120
        )
        beside = mean_step_of_one_request()
        assert scrape(crowded, "vllm:num_requests_running", engine="31") == 64
        assert [future.result() for future in crowd] == [200] * 64
    assert beside > alone * 1.3, (alone, beside)
