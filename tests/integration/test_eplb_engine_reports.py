"""Plugin mode: the engines' window reports reach a running ``baton eplb`` and show in its
metrics, sent by the reporter the plugin uses inside vLLM and by simulated engines running the
plugin in-engine; bad reports get OpenAI error bodies."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from baton.core.eplb_report import (
    INACTIVE_PATH,
    POLICY_ENV,
    REPORT_PATH,
    REPORT_URL_ENV,
    TOKEN_ENV,
    WHERE_ENV,
    PluginInactive,
    WindowReport,
)
from baton.core.model import DRAFT, TARGET
from baton.core.vllm_eplb import vllm_rebalance
from eplb.reporter import Reporter
from eplb.vllm_plugin import rebalance_window
from rigs.processes import EplbReportsService, eplb_reports_service
from sim.cluster import ClusterSpec, DecodeGroupSpec
from sim.config import EplbConfig
from tests.helpers import (
    ROOT,
    baton_command,
    eventually,
    free_port,
    keep_decoding,
    scrape,
    stop_process,
    wait_healthy,
)

TOKEN = "engine-report-secret"
RANKS, REDUNDANT = 32, 32


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EplbReportsService]:
    config = "windowSize: 1000\nstepInterval: 3000\n"
    with eplb_reports_service(tmp_path_factory.mktemp("eplb-reports"), config, TOKEN) as running:
        yield running


def _drifting_load(seed: int, layers: int, experts: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.zipf(1.3, size=(layers, experts)).clip(max=5_000) * 10


def _window(cell: str, load: np.ndarray, old: np.ndarray) -> tuple[WindowReport, np.ndarray]:
    """What EP rank 0 of ``cell`` reports after vLLM called the plugin's policy on ``load``."""
    slots = load.shape[1] + REDUNDANT
    result = rebalance_window(
        load, slots, 1, 1, RANKS, old, lambda: vllm_rebalance(load, RANKS, REDUNDANT).phy2log
    )
    report = WindowReport(
        namespace="serving",
        deployment="dsv4",
        cell=cell,
        layers=load.shape[0],
        experts=load.shape[1],
        num_ranks=RANKS,
        load=load.astype(np.int64).tolist(),
        balance_before=result.balance_before,
        balance_after=result.balance_after,
        experts_moved=result.experts_moved,
        policy=result.policy,
        fallback=result.fallback,
        vllm_version="0.33.0",
    )
    return report, result.phy2log


def _initial(layers: int, experts: int) -> np.ndarray:
    """vLLM's placement before its first rebalance: logical experts in order, then the
    redundant slots on the first experts."""
    slots = np.arange(experts + REDUNDANT) % experts
    return np.tile(slots, (layers, 1))


def test_window_reports_from_the_plugins_reporter_show_in_the_services_metrics(
    service: EplbReportsService,
) -> None:
    reporter = Reporter(service.url, TOKEN)
    placement = _initial(TARGET.layers, TARGET.experts)
    first, placement = _window(
        "cell-0", _drifting_load(1, TARGET.layers, TARGET.experts), placement
    )
    reporter.submit(REPORT_PATH, first)
    labels = {"group": "cell-0", "model": "target"}
    assert eventually(
        lambda: (
            scrape(service.metrics, "baton_eplb_engine_windows_total", **labels, policy="baton")
            == 1
        )
    )
    assert scrape(service.metrics, "baton_eplb_balance", **labels, stage="before") == pytest.approx(
        first.balance_before
    )
    assert scrape(
        service.metrics, "baton_eplb_balance", **labels, stage="predicted"
    ) == pytest.approx(first.balance_after)
    assert scrape(service.metrics, "baton_eplb_experts_moved_total", **labels) == (
        first.experts_moved
    )
    assert scrape(service.metrics, "baton_eplb_bytes_moved_total", **labels) > 0

    # The next window measures what the first one's placement achieved.
    second, _ = _window("cell-0", _drifting_load(2, TARGET.layers, TARGET.experts), placement)
    reporter.submit(REPORT_PATH, second)
    assert eventually(
        lambda: (
            scrape(service.metrics, "baton_eplb_balance", **labels, stage="achieved")
            == pytest.approx(second.balance_before)
        )
    )
    assert second.experts_moved < first.experts_moved
    assert reporter.failed == 0


def test_the_draft_model_is_named_by_its_expert_count(service: EplbReportsService) -> None:
    reporter = Reporter(service.url, TOKEN)
    load = _drifting_load(3, DRAFT.layers, DRAFT.experts)
    report, _ = _window("cell-1", load, _initial(DRAFT.layers, DRAFT.experts))
    reporter.submit(REPORT_PATH, report)
    assert eventually(
        lambda: (
            scrape(
                service.metrics, "baton_eplb_engine_windows_total", group="cell-1", model="draft"
            )
            == 1
        )
    )


def test_an_inactive_plugin_shows_until_its_cell_reports_a_window(
    service: EplbReportsService,
) -> None:
    reporter = Reporter(service.url, TOKEN)
    inactive = PluginInactive(
        namespace="serving",
        deployment="dsv4",
        cell="cell-2",
        vllm_version="0.34.0",
        reason="unsupported_vllm_version",
    )
    reporter.submit(INACTIVE_PATH, inactive)
    assert eventually(
        lambda: (
            scrape(
                service.metrics,
                "baton_eplb_plugin_inactive",
                group="cell-2",
                reason="unsupported_vllm_version",
                vllm_version="0.34.0",
            )
            == 1
        )
    )
    report, _ = _window(
        "cell-2",
        _drifting_load(4, TARGET.layers, TARGET.experts),
        _initial(TARGET.layers, TARGET.experts),
    )
    reporter.submit(REPORT_PATH, report)
    assert eventually(
        lambda: scrape(service.metrics, "baton_eplb_plugin_inactive", group="cell-2") == 0
    )


def _post(service: EplbReportsService, body: object, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(service.url + REPORT_PATH, json=body, headers=headers, timeout=5)


def _report_body(**changes: object) -> dict[str, object]:
    report, _ = _window(
        "cell-9",
        _drifting_load(5, DRAFT.layers, DRAFT.experts),
        _initial(DRAFT.layers, DRAFT.experts),
    )
    return report.model_dump() | changes


@pytest.mark.parametrize(
    ("token", "changes", "status", "kind", "param"),
    [
        (None, {}, 401, "authentication_error", None),
        ("wrong", {}, 401, "authentication_error", None),
        (TOKEN, {"balance_after": 1.5}, 400, "invalid_request_error", "balance_after"),
        (TOKEN, {"layers": 2}, 400, "invalid_request_error", None),
        (TOKEN, {"surprise": 1}, 400, "invalid_request_error", "surprise"),
    ],
    ids=["no-token", "wrong-token", "balance-out-of-range", "load-shape", "unknown-field"],
)
def test_bad_reports_get_an_openai_error_and_change_nothing(
    service: EplbReportsService,
    token: str | None,
    changes: dict[str, object],
    status: int,
    kind: str,
    param: str | None,
) -> None:
    response = _post(service, _report_body(**changes), token)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind
    assert error["param"] == param
    assert error["message"]
    assert scrape(service.metrics, "baton_eplb_engine_windows_total", group="cell-9") == 0


def test_a_model_the_service_does_not_know_is_refused_with_the_fix(
    service: EplbReportsService,
) -> None:
    load = _drifting_load(6, 2, 64)
    report, _ = _window("cell-9", load, _initial(2, 64))
    response = _post(service, report.model_dump())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "experts"
    assert "spec.eplb.models" in error["message"]
    assert "target (384 experts)" in error["message"]


@pytest.mark.parametrize("policy", ["baton", "vllm_default"])
def test_simulated_engines_with_the_plugin_rebalance_the_target_in_engine_and_report_it(
    service: EplbReportsService, tmp_path: Path, policy: str
) -> None:
    # baton sim loads the plugin by its entry point, as vLLM does, and reports as a pod would;
    # the pod's policy says who places (vllm_default: vLLM's own, the plugin measuring it).
    port = free_port()
    cluster = ClusterSpec(
        profile="instant",
        host="127.0.0.1",
        decode_groups=[
            DecodeGroupSpec(
                name=f"cell-sim-{policy}",
                data_parallel_size=32,
                api_servers=1,
                port=port,
                side_channel_port=free_port(),
                eplb_policy_plugin="baton",
                eplb=EplbConfig(window_size=40, step_interval=40, num_redundant_experts=32),
            )
        ],
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster.model_dump(mode="json", exclude_defaults=True)))
    env = {
        **os.environ,
        REPORT_URL_ENV: service.url,
        TOKEN_ENV: TOKEN,
        WHERE_ENV["namespace"]: "serving",
        WHERE_ENV["deployment"]: "dsv4",
        POLICY_ENV: policy,
    }
    log = tmp_path / "sim.log"
    engines = subprocess.Popen(
        baton_command("sim", "--cluster", str(path)),
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, engines, log)
        keep_decoding(url, requests=32)

        def windows(model: str) -> float:
            return scrape(
                service.metrics,
                "baton_eplb_engine_windows_total",
                group=f"cell-sim-{policy}",
                model=model,
                policy=policy,
            )

        assert eventually(lambda: windows("target") >= 2, timeout=60)
        # the cluster's draft is the study's DSpark draft, which vLLM 0.33's EPLB leaves out
        assert windows("draft") == 0
        labels = {"group": f"cell-sim-{policy}", "model": "target"}
        assert 0 < scrape(service.metrics, "baton_eplb_balance", **labels, stage="achieved") <= 1
        assert scrape(service.metrics, "baton_eplb_experts_moved_total", **labels) > 0
    finally:
        stop_process(engines)
