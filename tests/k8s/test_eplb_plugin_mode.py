"""Plugin mode on the API server: the controller gives vLLM decode pods the plugin and where to
report, publishes no agents, and the window EP rank 0 reports from that pod's environment reaches
``baton eplb --model-deployment`` and becomes the deployment's BALANCE."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kubernetes import client

from baton.core.eplb_report import REPORT_PATH, REPORT_URL_ENV, TOKEN_ENV, WHERE_ENV
from baton.core.labels import CELL_LABEL
from baton.core.model import TARGET
from baton.core.vllm_eplb import vllm_rebalance
from eplb.reporter import Reporter
from eplb.vllm_plugin import rebalance_window, window_report
from rigs.devcluster import ControlPlane, pods
from rigs.processes import baton_command, eventually, free_port, stop_process, wait_healthy
from tests.k8s.helpers import apply, read, wait_ready

pytestmark = pytest.mark.usefixtures("controller")

TOKEN = "plugin-report-token"
RANKS, REDUNDANT = 4, 32


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_process(*started)


def _secret_value(api: client.ApiClient, namespace: str, ref: client.V1SecretKeySelector) -> str:
    """What the kubelet puts in a secretKeyRef variable."""
    assert ref.name is not None  # the controller renders the Secret's name
    data = client.CoreV1Api(api).read_namespaced_secret(ref.name, namespace).data
    assert data is not None
    return base64.b64decode(data[ref.key]).decode()


def test_in_plugin_mode_the_engines_reports_become_the_deployments_balance(
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    control_plane: ControlPlane,
    processes: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client.CoreV1Api(api).create_namespaced_secret(
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name="eplb-token"), string_data={"t": TOKEN}),
    )
    port = free_port()
    apply(
        api,
        namespace,
        "dsv4",
        {
            "cell": {"decode": {"dep": RANKS, "spareTrays": 0}, "prefill": {"instances": 1}},
            "eplb": {
                "reportUrl": f"http://127.0.0.1:{port}",
                "tokenSecret": {"name": "eplb-token", "key": "t"},
            },
        },
    )
    status = wait_ready(api, namespace, "dsv4")["status"]
    assert all(not cell.get("eplbAgents") for cell in status["endpoints"]["cells"])

    config = tmp_path / "eplb.yaml"
    config.write_text("minGain: 0.002\n")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    log = tmp_path / "eplb.log"
    service = subprocess.Popen(
        [
            *baton_command("eplb", f"--config={config}"),
            *("--model-deployment", f"{namespace}/dsv4"),
            f"--kubeconfig={control_plane.kubeconfig}",
            *(f"--report-port={port}", f"--token-file={token_file}"),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    processes.append(service)
    wait_healthy(f"http://127.0.0.1:{port}", service, log)

    # EP rank 0 of the decode group, as the plugin runs it in the pod's engine process.
    [pod] = pods(api, namespace, "decode").values()
    [init] = pod.spec.init_containers
    assert init.command[:3] == ["baton", "vllm-plugin", "install"]
    env = {e.name: e for e in pod.spec.containers[0].env}
    for variable in (REPORT_URL_ENV, *WHERE_ENV.values()):
        monkeypatch.setenv(variable, env[variable].value)
    token = _secret_value(api, namespace, env[TOKEN_ENV].value_from.secret_key_ref)
    rng = np.random.default_rng(5)
    load = rng.zipf(1.3, size=(TARGET.layers, TARGET.experts)).clip(max=5_000) * 10
    old = vllm_rebalance(load[::-1], RANKS, REDUNDANT).phy2log
    result = rebalance_window(
        load,
        TARGET.experts + REDUNDANT,
        1,
        1,
        RANKS,
        old,
        lambda: old,  # fallback unused
    )
    report = window_report(result, load, RANKS, "0.33.0")
    assert report is not None and report.cell == pod.metadata.labels[CELL_LABEL]
    reporter = Reporter(env[REPORT_URL_ENV].value, token)
    reporter.submit(REPORT_PATH, report)

    def published() -> dict[str, Any]:
        status = read(api, namespace, "dsv4")["status"]
        return status if status.get("balance") else {}

    status = eventually(published, timeout=60, interval=0.5)
    assert result.balance_before is not None
    assert status["balance"] == f"{result.balance_before:.3f}"
    assert status["eplb"]["target"]["lastRebalanceTime"].endswith("Z")
    assert reporter.failed == 0
