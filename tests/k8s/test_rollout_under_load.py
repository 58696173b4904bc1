"""A changed spec rolls out while the deployment serves: cells on kwok trays, each pod's own
command line (``baton sim``) run at its pod IP as a kubelet would run it, the real ``openai``
client streaming through ``baton gateway --model-deployment`` the whole time. No request fails,
at every look at the status some cell serves, no cell's endpoints mix two revisions, and by the
engines' own logs no decode engine pulls KV from a prefill engine of another revision."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kubernetes import client, watch

from baton.core.kube import raw_json
from baton.core.labels import DEPLOYMENT_LABEL, REVISION_LABEL
from rigs.devcluster import ControlPlane, add_trays, patch_model_deployment_spec, remove_nodes
from rigs.processes import baton_command, eventually, kv_events_on_free_ports, stop_process
from tests.k8s.helpers import apply, read, start_gateway_following, wait_ready

pytestmark = pytest.mark.usefixtures("controller")

ENGINE_ARGS = ("--profile", "instant", "--log-level", "debug")


class Kubelet:
    """Runs each Running pod's command at its pod IP (one process per pod UID) and stops it when
    the pod goes, watching the API server from a thread."""

    def __init__(self, api: client.ApiClient, namespace: str, logs: Path) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace, self.logs = namespace, logs
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.revision_at: dict[str, str] = {}  # pod IP -> its revision label, while it runs
        self.revision_of_log: dict[Path, str] = {}  # each pod's log -> its revision label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        stop_process(*self.running.values())

    def _loop(self) -> None:
        # on every pod event: a deleted pod's process must be gone before the gateway can probe
        # its IP, which kwok gives the next pod at once
        pods = watch.Watch()
        while not self._stop.is_set():
            for _ in pods.stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=DEPLOYMENT_LABEL,
                timeout_seconds=1,
            ):
                self.sync()
                if self._stop.is_set():
                    pods.stop()
            self.sync()

    def sync(self) -> None:
        listed = self.core.list_namespaced_pod(
            self.namespace, label_selector=DEPLOYMENT_LABEL, _preload_content=False
        )
        live = {
            pod["metadata"]["uid"]: pod
            for pod in raw_json(listed)["items"]
            if pod.get("status", {}).get("phase") == "Running"
            and pod["status"].get("podIP")
            and not pod["metadata"].get("deletionTimestamp")
        }
        for uid in list(self.running):
            if uid not in live:  # stopped first: its IP may come back on a new pod
                stop_process(self.running.pop(uid))
        for uid, pod in live.items():
            if uid in self.running:
                continue
            ip: str = pod["status"]["podIP"]
            container = pod["spec"]["containers"][0]
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ip  # what the fieldRef gives a real pod
            log = self.logs / f"{pod['metadata']['name']}-{uid[:8]}.log"
            argv = [*container["command"], "--host", ip]
            kv_events_on_free_ports(argv)  # ZeroMQ binds every interface: pods share this host's
            self.running[uid] = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            self.revision_at[ip] = pod["metadata"]["labels"][REVISION_LABEL]
            self.revision_of_log[log] = pod["metadata"]["labels"][REVISION_LABEL]

    def pulls_across_revisions(self) -> tuple[int, list[str]]:
        """From the engines' own logs: how many KV pulls the decode engines logged, and each
        one whose prefill engine (named by its NIXL engine id) ran another revision."""
        revision_of_engine: dict[str, str] = {}
        pulls: list[tuple[Path, str, str]] = []
        for log, revision in self.revision_of_log.items():
            text = log.read_text(errors="replace")
            for engine in re.findall(r"NIXL side channel of engine (\S+) ", text):
                revision_of_engine[engine] = revision
            for request, engine in re.findall(
                r"KV of request (\S+) pulled from engine (\S+)_dp\d+:", text
            ):
                pulls.append((log, request, engine))
        crossed = [
            f"{log.name}: {request} from {engine} ({revision_of_engine.get(engine, '?')})"
            for log, request, engine in pulls
            if revision_of_engine.get(engine) != self.revision_of_log[log]
        ]
        return len(pulls), crossed


@pytest.fixture
def two_racks(api: client.ApiClient, namespace: str) -> Iterator[list[dict[str, Any]]]:
    nodes = add_trays(api, 2, trays_per_rack=2, name_prefix=f"{namespace}-")
    yield nodes
    custom = client.CustomObjectsApi(api)
    custom.delete_collection_namespaced_custom_object(
        "baton.dev", "v1alpha1", namespace, "modeldeployments"
    )
    core = client.CoreV1Api(api)
    core.delete_collection_namespaced_pod(namespace, label_selector=DEPLOYMENT_LABEL)
    eventually(
        lambda: not core.list_namespaced_pod(namespace, label_selector=DEPLOYMENT_LABEL).items,
        timeout=60,
    )
    remove_nodes(api, nodes)


@pytest.mark.parametrize("cells", [2, 1], ids=["two-cells-in-place", "one-cell-with-a-surge"])
def test_a_rollout_under_load_fails_no_request_and_never_leaves_no_cell_serving(
    api: client.ApiClient,
    namespace: str,
    two_racks: list[dict[str, Any]],
    control_plane: ControlPlane,
    tmp_path: Path,
    cells: int,
) -> None:
    """Two cells fill both racks and update one at a time; one cell leaves a rack free, where
    a surge cell serves the new revision while the old cell updates, then drains and goes."""
    apply(
        api,
        namespace,
        "dsv4",
        {
            "servedModelName": "dsv4",
            "cells": cells,
            # debug: each decode engine logs the prefill engine of every KV pull
            "engine": {"command": baton_command("sim"), "args": [*ENGINE_ARGS]},
            "cell": {"decode": {"dep": 4, "spareTrays": 0}, "prefill": {"instances": 1}},
            "eplb": {"enabled": False},
            "rollout": {"drainSeconds": 3},
        },
    )
    wait_ready(api, namespace, "dsv4")
    with Kubelet(api, namespace, tmp_path) as kubelet:
        gateway, url = start_gateway_following(
            control_plane, namespace, "dsv4", tmp_path / "gateway.log"
        )
        try:

            def every_cell_served() -> bool:
                return (
                    httpx.get(f"{url}/ready", timeout=1).status_code == 200
                    and len(_serving(read(api, namespace, "dsv4")["status"], kubelet.revision_at))
                    == cells
                )

            eventually(every_cell_served, timeout=60, interval=0.5)
            looks: list[dict[str, set[str]]] = []
            outcome = _serve_while(url, lambda: _roll_out(api, namespace, kubelet, cells, looks))
        finally:
            stop_process(gateway)
    answered, failures = outcome
    assert failures == [], failures[:5]
    assert answered >= 20  # load ran through the whole rollout
    # the engines' own word: no decode engine pulled KV from a prefill of another revision
    pulls, crossed = kubelet.pulls_across_revisions()
    assert pulls > 0 and crossed == [], crossed[:5]
    if cells == 2:  # it drained cell by cell
        assert any(len(look) == 1 for look in looks)
    else:  # the surge cell served beside the old one, and alone while it updated
        assert any(set(look) == {"dsv4-cell-0", "dsv4-cell-1"} for look in looks)
        assert any(set(look) == {"dsv4-cell-1"} for look in looks)
        assert set(looks[-1]) == {"dsv4-cell-0"}


def _serving(status: dict[str, Any], revision_at: dict[str, str]) -> dict[str, set[str]]:
    """The cells with both roles in the endpoints, and the revisions of the pods they list."""
    cells: dict[str, set[str]] = {}
    for cell in status.get("endpoints", {}).get("cells", []):
        if cell["prefill"] and cell["decode"]:
            hosts = [u.split("//")[1].split(":")[0] for u in cell["prefill"] + cell["decode"]]
            cells[cell["name"]] = {revision_at.get(host, "?") for host in hosts}
    return cells


def _roll_out(
    api: client.ApiClient,
    namespace: str,
    kubelet: Kubelet,
    cells: int,
    looks: list[dict[str, set[str]]],
) -> None:
    """Change the engine's flags, then watch the status until every cell runs the new
    revision and no other (a surge cell) is left: at every look some cell serves, on one
    revision. Each look's serving cells go into ``looks``."""
    before = read(api, namespace, "dsv4")["status"]["revision"]
    patch_model_deployment_spec(
        api,
        namespace,
        "dsv4",
        {"engine": {"args": [*ENGINE_ARGS, "--max-num-seqs", "128"]}},
    )

    def rolled_out() -> bool:
        status = read(api, namespace, "dsv4")["status"]
        serving = _serving(status, kubelet.revision_at)
        looks.append(serving)
        assert serving, f"no cell serving: {status.get('conditions')}"
        assert all(len(revisions) == 1 for revisions in serving.values()), serving
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        return (
            status["revision"] != before
            and status.get("updated") == f"{cells}/{cells}"
            and ready["status"] == "True"
            and len(serving) == cells
            and len(status["cells"]) == cells
        )

    eventually(rolled_out, timeout=240, interval=0.25)


def _serve_while(url: str, action: Any) -> tuple[int, list[str]]:
    """Stream chat completions through the gateway from three clients while ``action`` runs;
    how many were answered and every failure."""
    stop = threading.Event()
    answered = [0]
    failures: list[str] = []
    lock = threading.Lock()

    def client_loop() -> None:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        while not stop.is_set():
            try:
                stream = api.chat.completions.create(
                    model="dsv4",
                    messages=[{"role": "user", "content": "Roll the cells one at a time."}],
                    max_tokens=8,
                    stream=True,
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                with lock:
                    if text:
                        answered[0] += 1
                    else:
                        failures.append("an empty answer")
            except openai.OpenAIError as exc:
                with lock:
                    failures.append(repr(exc))

    clients = [threading.Thread(target=client_loop, daemon=True) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        action()
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
    return answered[0], failures
