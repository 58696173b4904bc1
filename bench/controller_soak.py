"""The controller's part of ``baton bench chaos --soak``: Kubernetes faults on a seeded schedule
against one ``baton controller``, its memory sampled.

A control plane of its own (``rigs.devcluster``) with two racks of kwok trays (36) and one
ModelDeployment: one cell (a DEP32 decode group over 8 trays, its spare tray, 4 DEP2 prefill
instances), two while a ``scale_cells`` fault lasts. One fault at a time, after a seeded gap
(exponential, mean :data:`MEAN_GAP_S`), until the soak's time is up:

- ``tray_not_ready``: a tray of the decode group stops reporting (kwok no longer plays its
  kubelet) for the fault's duration, then is Ready again; the group restarts onto the spare;
- ``delete_decode_pod``: a decode pod deleted; the group restarts whole;
- ``delete_prefill_pod``: a prefill pod deleted; the controller recreates it;
- ``scale_prefill``: the cell's prefill instances from 4 to 2 for the fault's duration, then back;
- ``scale_cells``: two cells for the fault's duration, then one.

The controller backs off repeated group restarts (5 s, doubling) and stops after 10 within an
hour, by design (``controller.restarts.RestartPolicy``); the soak measures recovery, not that
policy, so the two faults that restart the decode group come at least :data:`GROUP_GAP_S`
apart. Faults go to the trays with the fewest recorded failures, so that no tray reaches
quarantine (3 failures within 24 h) in a soak of half an hour.

Measured: each fault's recovery, from its disruptive action to the deployment Ready (its
generation observed) with every pod Running, which must come within :data:`RECOVERY_BOUND_S`;
decode groups started with members missing (sampled twice a second; there must be none); the
controller's RSS every 30 s. The controller is never killed here: ``tests/chaos`` kills the
leader, and a restarted process would hide its memory's growth.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from baton.core.labels import TRAY_FAILURES_ANNOTATION
from controller.restarts import RestartPolicy, recent_failures
from rigs.devcluster import (
    add_trays,
    binaries_dir,
    condition,
    create_model_deployment,
    install_crd,
    mark_tray_not_ready,
    mark_tray_ready,
    partial_groups,
    patch_model_deployment_spec,
    pods,
    read_model_deployment,
    start_control_plane,
    start_controller,
)
from rigs.processes import eventually, stop_process

__all__ = ["ControllerSoak", "report", "run_controller_soak"]

NAMESPACE = "soak"
DEPLOYMENT = "dsv4"
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
DECODE_PODS = 8  # DEP32 at 4 GPUs a tray
PREFILL_INSTANCES = 4
MEAN_GAP_S = 60.0
GROUP_GAP_S = 360.0
RECOVERY_BOUND_S = 120.0  # wall seconds from a fault's disruptive action to settled again
GROUP_FAULTS = ("tray_not_ready", "delete_decode_pod")
OTHER_FAULTS = ("delete_prefill_pod", "scale_prefill", "scale_cells")


@dataclass(slots=True)
class ClusterFault:
    """One fault as applied: when (seconds into the soak), on what, and how long it took the
    deployment to settle again (None: not within the bound)."""

    at_s: float
    kind: str
    target: str
    duration_s: float
    recovery_s: float | None = None


@dataclass(slots=True)
class ControllerSoak:
    minutes: float
    seed: int
    faults: list[ClusterFault] = field(default_factory=list)
    partial_groups: list[str] = field(default_factory=list)
    controller_exits: int = 0
    group_restarts: int = 0  # decode group restarts the deployment's status records at the end
    tracebacks: int = 0
    memory_mib: list[dict[str, Any]] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return (
            all(f.recovery_s is not None and f.recovery_s <= RECOVERY_BOUND_S for f in self.faults)
            and not self.partial_groups
            and not self.controller_exits
            and not self.tracebacks
        )


def _expected_pods(spec: dict[str, Any]) -> int:
    pods: int = spec["cells"] * (DECODE_PODS + spec["cell"]["prefill"]["instances"])
    return pods


def _settled(api: client.ApiClient, expected: int) -> bool:
    """The deployment Ready at its generation, with ``expected`` pods, every one Running."""
    obj = read_model_deployment(api, NAMESPACE, DEPLOYMENT)
    if condition(obj, "Ready").get("status") != "True":
        return False
    if obj.get("status", {}).get("observedGeneration") != obj["metadata"]["generation"]:
        return False
    live = [p for p in pods(api, NAMESPACE).values() if p.metadata.deletion_timestamp is None]
    return len(live) == expected and all(p.status.phase == "Running" for p in live)


def _poll(check: Callable[[], bool], within: float) -> float | None:
    """Seconds until ``check`` holds (None: not within ``within``); the API server's errors
    count as not yet."""
    started = time.monotonic()
    try:
        eventually(check, timeout=within, interval=0.25)
    except TimeoutError:
        return None
    return time.monotonic() - started


def _recovery(api: client.ApiClient, expected: int) -> float | None:
    """Seconds from now until the deployment settles: first it must be seen disturbed (or 10 s
    pass: a fault the controller absorbs at once), then settled again."""
    started = time.monotonic()
    _poll(lambda: not _settled(api, expected), 10.0)
    left = RECOVERY_BOUND_S - (time.monotonic() - started)
    settled = _poll(lambda: _settled(api, expected), max(left, 0.0) + 60.0)
    return None if settled is None else time.monotonic() - started


def _failures(node: client.V1Node) -> int:
    """The tray's failures within the controller's window, as it counts them for quarantine."""
    annotations = (node.metadata.annotations if node.metadata else None) or {}
    recent = recent_failures(
        annotations.get(TRAY_FAILURES_ANNOTATION, ""), RestartPolicy(), datetime.now(UTC)
    )
    return len(recent)


def _least_failed_pod(api: client.ApiClient, role: str, rng: random.Random) -> Any:
    """A pod of ``role`` in cell 0 on a tray with the fewest recorded failures."""
    nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items if n.metadata}
    candidates = [
        pod
        for pod in pods(api, NAMESPACE, role).values()
        if pod.spec.node_name in nodes and pod.metadata.name.startswith(f"{DEPLOYMENT}-cell-0-")
    ]
    fewest = min(_failures(nodes[p.spec.node_name]) for p in candidates)
    return rng.choice([p for p in candidates if _failures(nodes[p.spec.node_name]) == fewest])


def _apply(
    api: client.ApiClient, spec: dict[str, Any], fault: ClusterFault, rng: random.Random
) -> None:
    """Apply ``fault`` and wait it out; sets its target and recovery."""
    core = client.CoreV1Api(api)
    if fault.kind in ("tray_not_ready", "delete_decode_pod", "delete_prefill_pod"):
        role = "prefill" if fault.kind == "delete_prefill_pod" else "decode"
        pod = _least_failed_pod(api, role, rng)
        if fault.kind == "tray_not_ready":
            fault.target = pod.spec.node_name
            mark_tray_not_ready(api, fault.target)
        else:
            fault.target = pod.metadata.name
            core.delete_namespaced_pod(fault.target, NAMESPACE)
        fault.recovery_s = _recovery(api, _expected_pods(spec))
        if fault.kind == "tray_not_ready":
            time.sleep(max(0.0, fault.duration_s - (fault.recovery_s or 0.0)))
            mark_tray_ready(api, fault.target)
            # the tray back: nothing moves
            _poll(lambda: _settled(api, _expected_pods(spec)), 30.0)
        return
    prefill = fault.kind == "scale_prefill"
    fault.target = "cell.prefill.instances=2" if prefill else "cells=2"

    def scale(value: int) -> float | None:
        if prefill:
            spec["cell"]["prefill"]["instances"] = value
            patch: dict[str, Any] = {"cell": {"prefill": {"instances": value}}}
        else:
            spec["cells"] = value
            patch = {"cells": value}
        patch_model_deployment_spec(api, NAMESPACE, DEPLOYMENT, patch)
        return _recovery(api, _expected_pods(spec))

    recoveries = [scale(2)]
    time.sleep(fault.duration_s)
    recoveries.append(scale(PREFILL_INSTANCES if prefill else 1))
    fault.recovery_s = None if None in recoveries else max(r or 0.0 for r in recoveries)


def _watch(
    api: client.ApiClient,
    controller: psutil.Process,
    started: float,
    stop: threading.Event,
    soak: ControllerSoak,
) -> None:
    next_sample = 0.0
    while not stop.is_set():
        with contextlib.suppress(ApiException, urllib3.exceptions.HTTPError):
            soak.partial_groups.extend(partial_groups(api, NAMESPACE, DECODE_PODS))
        now = time.monotonic() - started
        if now >= next_sample:
            with contextlib.suppress(psutil.Error):
                soak.memory_mib.append(
                    {
                        "t_s": round(now, 1),
                        "controller": controller.memory_info().rss / 2**20,
                        "pids": {"controller": controller.pid},
                    }
                )
            next_sample += 30.0
        stop.wait(0.5)


def run_controller_soak(directory: Path, minutes: float, seed: int) -> ControllerSoak:
    """The soak (module doc) in ``directory``, for ``minutes`` of faults."""
    soak = ControllerSoak(minutes, seed)
    rng = random.Random(seed)
    plane = start_control_plane(directory, binaries_dir())
    controller = None
    stop = threading.Event()
    watcher: threading.Thread | None = None
    try:
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        install_crd(api)
        add_trays(api, 2, name_prefix="soak-", timeout=300)
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
        )
        controller = start_controller(plane, "controller", "baton-controller")
        spec: dict[str, Any] = {
            "model": MODEL,
            "cells": 1,
            "cell": {"prefill": {"instances": PREFILL_INSTANCES}},
        }
        create_model_deployment(api, NAMESPACE, DEPLOYMENT, spec)
        eventually(lambda: _settled(api, _expected_pods(spec)), timeout=120, interval=0.5)
        started = time.monotonic()
        watcher = threading.Thread(
            target=_watch,
            args=(
                config.new_client_from_config(config_file=str(plane.kubeconfig)),
                psutil.Process(controller.pid),
                started,
                stop,
                soak,
            ),
            daemon=True,
        )
        watcher.start()
        last_group = -GROUP_GAP_S
        while True:
            gap = rng.expovariate(1 / MEAN_GAP_S)
            left = minutes * 60 - (time.monotonic() - started)
            time.sleep(min(gap, max(left, 0.0)))
            if gap >= left:
                break
            at = time.monotonic() - started
            kind = rng.choice((*GROUP_FAULTS, *OTHER_FAULTS))
            if kind in GROUP_FAULTS:
                if at - last_group < GROUP_GAP_S:
                    kind = rng.choice(OTHER_FAULTS)
                else:
                    last_group = at
            fault = ClusterFault(round(at, 1), kind, "", round(rng.uniform(20, 40), 1))
            _apply(api, spec, fault, rng)
            soak.faults.append(fault)
            if controller.poll() is not None:
                soak.controller_exits += 1
                break
        cells = read_model_deployment(api, NAMESPACE, DEPLOYMENT)["status"]["cells"]
        soak.group_restarts = sum(len(cell.get("restarts", [])) for cell in cells)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(5)
        if controller is not None:
            stop_process(controller)
        plane.stop()
    soak.tracebacks = plane.log("controller").count("Traceback")
    return soak


def report(soak: ControllerSoak) -> dict[str, Any]:
    """The soak as the benchmark's JSON records it."""
    return asdict(soak) | {"held": soak.held, "recovery_bound_s": RECOVERY_BOUND_S}
