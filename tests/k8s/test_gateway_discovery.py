"""The gateway and the EPLB service find their engines in a ModelDeployment's status: the
controller places a small cell on kwok trays, the test runs each pod's own command line
(``baton sim``, as ``engine.command`` says) at the pod's loopback IP, the real ``openai`` client
streams through ``baton gateway --model-deployment``, and ``baton eplb --model-deployment``
balances the decode group and writes its balance back into the status."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kubernetes import client

from controller.podspec import EPLB_TOKEN_DIR
from rigs.devcluster import ControlPlane, patch_model_deployment_spec, pods
from rigs.processes import baton_command, eventually, stop_process, wait_healthy
from tests.k8s.helpers import apply, read, start_gateway_following, wait_ready

pytestmark = pytest.mark.usefixtures("controller")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_process(*started)


def test_gateway_and_eplb_service_follow_the_endpoints_the_deployment_publishes(
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    control_plane: ControlPlane,
    processes: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    apply(
        api,
        namespace,
        "dsv4",
        {
            "servedModelName": "dsv4",
            "engine": {
                "command": baton_command("sim"),
                "args": ["--profile", "instant"],
            },
            "cell": {"decode": {"dep": 4, "spareTrays": 0}, "prefill": {"instances": 1}},
            # the simulator's agents; decisions within seconds here
            "eplb": {
                "mode": "agent",
                "stepInterval": 40,
                "windowSize": 40,
                "tokenSecret": {"name": "eplb-token", "key": "token"},
            },
        },
    )
    wait_ready(api, namespace, "dsv4")
    # what the Secret would hold, where each engine and the service read it here
    token = tmp_path / "eplb-token"
    token.write_text("agent-secret")
    mounted = f"{EPLB_TOKEN_DIR}/token"
    for name, pod in pods(api, namespace).items():
        ip = pod.status.pod_ip
        assert ip.startswith("127.64.")  # kwok's loopback pod range: servable here
        container = pod.spec.containers[0]
        env = {e.name: e.value for e in container.env if e.value is not None}
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ip  # what the fieldRef gives a real pod
        log = tmp_path / f"{name}.log"
        engine = subprocess.Popen(
            [str(token) if arg == mounted else arg for arg in container.command] + ["--host", ip],
            env={**os.environ, **env},
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        processes.append(engine)
        wait_healthy(f"http://{ip}:8000", engine, log)

    gateway_log = tmp_path / "gateway.log"
    gateway, url = start_gateway_following(control_plane, namespace, "dsv4", gateway_log)
    processes.append(gateway)
    eventually(lambda: httpx.get(f"{url}/ready", timeout=1).status_code == 200, timeout=30)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["dsv4"]
    stream = client.chat.completions.create(
        model="dsv4",
        messages=[{"role": "user", "content": "Plan the rollout of the new cell."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    # Both legs ran: the prefill engine served a KV handoff.
    prefill_ip = pods(api, namespace, "prefill")["dsv4-cell-0-prefill-0"].status.pod_ip
    metrics = httpx.get(f"http://{prefill_ip}:8000/metrics", timeout=5).text
    assert "pool from ModelDeployment" in gateway_log.read_text()
    served = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:request_success_total") and not line.endswith(" 0.0")
    ]
    assert served, metrics[:2000]

    # The EPLB service: its group from status.endpoints, its balance back into status.
    config = tmp_path / "eplb.yaml"
    config.write_text("stepsPerReport: 10\napplyMarginSteps: 5\n")  # cadence: the spec's
    eplb_log = tmp_path / "eplb.log"
    processes.append(
        subprocess.Popen(
            baton_command(
                "eplb",
                f"--config={config}",
                f"--token-file={token}",
                "--model-deployment",
                f"{namespace}/dsv4",
                f"--kubeconfig={control_plane.kubeconfig}",
            ),
            stdout=eplb_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
    )
    eventually(lambda: "group dsv4-cell-0: 4 ranks" in eplb_log.read_text(), timeout=30)

    def balanced() -> bool:
        client.completions.create(model="dsv4", prompt="Rebalance the experts.", max_tokens=120)
        status = read(api, namespace, "dsv4")["status"]
        return "target" in status.get("eplb", {}) and bool(status.get("balance"))

    eventually(balanced, timeout=60, interval=0.5)
    status = read(api, namespace, "dsv4")["status"]
    assert 0 < status["eplb"]["target"]["balance"] <= 1
    assert status["balance"] == f"{status['eplb']['target']['balance']:.3f}"
    # The controller's status writes leave the EPLB service's figures alone.
    patch_model_deployment_spec(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    eventually(
        lambda: read(api, namespace, "dsv4")["status"].get("observedGeneration") == 2, timeout=30
    )
    after = read(api, namespace, "dsv4")["status"]
    assert "target" in after["eplb"] and after["balance"]
    assert after["prefillReady"].endswith("/2")
