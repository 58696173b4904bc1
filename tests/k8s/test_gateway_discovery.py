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

from baton.core.labels import CLIQUE_LABEL, DEPLOYMENT_LABEL
from controller.podspec import EPLB_TOKEN_DIR
from rigs.devcluster import ControlPlane, patch_model_deployment_spec, pods
from rigs.processes import (
    baton_command,
    eventually,
    kv_events_on_free_ports,
    stop_process,
    wait_healthy,
)
from tests.helpers import scrape
from tests.k8s.helpers import apply, read, start_gateway_following, wait_ready

pytestmark = pytest.mark.usefixtures("controller")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_process(*started)


def run_engine_pods(
    api: client.ApiClient,
    namespace: str,
    logs: Path,
    mounted: dict[str, str] | None = None,
    deployment: str | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Each engine pod of ``namespace`` (of one ModelDeployment, or all) run as its own command
    line at its pod IP, a mounted file's path in it replaced as ``mounted`` says; once each
    answers."""
    mounted = mounted or {}
    selector = f"{DEPLOYMENT_LABEL}={deployment}" if deployment else DEPLOYMENT_LABEL
    listed: list[Any] = (
        client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    )
    started: list[subprocess.Popen[bytes]] = []
    try:
        for pod in listed:
            name = pod.metadata.name
            ip = pod.status.pod_ip
            assert ip.startswith("127.64.")  # kwok's loopback pod range: servable here
            container = pod.spec.containers[0]
            env = {e.name: e.value for e in container.env if e.value is not None}
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ip  # what the fieldRef gives a real pod
            log = logs / f"{name}.log"
            argv = [mounted.get(arg, arg) for arg in container.command] + ["--host", ip]
            kv_events_on_free_ports(argv)  # ZeroMQ binds every interface: pods share this host's
            engine = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            started.append(engine)
            wait_healthy(f"http://{ip}:8000", engine, log)
    except BaseException:
        stop_process(*started)
        raise
    return started


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
    processes += run_engine_pods(api, namespace, tmp_path, {f"{EPLB_TOKEN_DIR}/token": str(token)})

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


def test_one_gateway_serves_two_deployments_each_request_by_its_model_and_one_down_spares_the_other(
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    control_plane: ControlPlane,
    processes: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    # Two small models sharing one rack, a cell each on trays of its own, one gateway for both.
    for name in ("alpha", "beta"):
        apply(
            api,
            namespace,
            name,
            {
                "servedModelName": name,
                "engine": {"command": baton_command("sim"), "args": ["--profile", "instant"]},
                "cell": {"decode": {"dep": 4, "spareTrays": 0}, "prefill": {"instances": 1}},
                "eplb": {"enabled": False},
                "topology": {"exclusiveDomain": False},
            },
        )
    engines: dict[str, list[subprocess.Popen[bytes]]] = {}
    for name in ("alpha", "beta"):
        wait_ready(api, namespace, name)
    trays = {
        name: {
            pod.spec.node_name for pod in pods(api, namespace).values() if name in pod.metadata.name
        }
        for name in ("alpha", "beta")
    }
    assert trays["alpha"] and trays["beta"] and not trays["alpha"] & trays["beta"]
    assert {node["metadata"]["labels"][CLIQUE_LABEL] for node in rack} == {
        read(api, namespace, name)["status"]["cells"][0]["domain"] for name in ("alpha", "beta")
    }
    for name in ("alpha", "beta"):
        engines[name] = run_engine_pods(api, namespace, tmp_path, deployment=name)
        processes += engines[name]
    prefill = {
        name: f"http://{pod.status.pod_ip}:8000"
        for pod in pods(api, namespace, "prefill").values()
        for name in [pod.metadata.labels[DEPLOYMENT_LABEL]]
    }
    gateway_log = tmp_path / "gateway.log"
    gateway, url = start_gateway_following(control_plane, namespace, "alpha", gateway_log, "beta")
    processes.append(gateway)
    openai_client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    eventually(lambda: [m.id for m in openai_client.models.list().data] == ["alpha", "beta"], 30)

    def ask(model: str) -> str:
        stream = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"A question for {model}."}],
            max_tokens=8,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    for _ in range(3):
        assert ask("alpha")
    # alpha's requests went to alpha's engines alone
    assert scrape(prefill["alpha"], "vllm:request_success_total") >= 3
    assert scrape(prefill["beta"], "vllm:request_success_total") == 0
    assert ask("beta")
    assert scrape(prefill["beta"], "vllm:request_success_total") >= 1
    ok = {
        deployment: scrape(
            url, "baton_gateway_requests_total", modeldeployment=deployment, outcome="ok"
        )
        for deployment in (f"{namespace}/alpha", f"{namespace}/beta")
    }
    assert ok == {f"{namespace}/alpha": 3, f"{namespace}/beta": 1}

    # beta's engines all gone: its requests get 503 naming it, alpha's are served as before,
    # and only beta's pool is in panic.
    stop_process(*engines["beta"])

    def beta_refused() -> openai.APIStatusError | None:
        try:
            ask("beta")
        except openai.APIStatusError as exc:
            return exc if exc.status_code == 503 else None
        return None

    refused = eventually(beta_refused, timeout=30, interval=0.5)
    assert refused is not None
    assert f"no healthy engine serves model 'beta' now ({namespace}/beta)" in refused.message
    assert ask("alpha")
    ready = httpx.get(f"{url}/ready", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["not_serving"] == f"{namespace}/beta"
    for name, panic in (("beta", 1), ("alpha", 0)):
        deployment = f"{namespace}/{name}"
        assert (
            scrape(url, "baton_gateway_panic", modeldeployment=deployment, role="decode") == panic
        )

    with pytest.raises(openai.NotFoundError, match="model 'gamma' is not served; served: alpha"):
        ask("gamma")
    assert "Traceback" not in gateway_log.read_text()
