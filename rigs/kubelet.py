"""The dev cluster's kubelet for processes: each pod that kwok reports Running runs here, as a
local process at its pod IP, so that the chart's pods and the engine pods serve.

kwok plays every fake node's kubelet for the API server (status, heartbeats, and with the Logs
and PortForward objects this kubelet writes, ``kubectl logs`` and ``kubectl port-forward``) but
runs no container. This process runs them, as a kubelet would from the pod spec:

- **The program.** A container's ``command`` + ``args``, where Baton's image is Baton's own CLI
  (``baton ...``), ``python`` is this interpreter, and vLLM's image is ``baton sim``, which takes
  ``vllm serve``'s flags (there is no GPU). Any other program cannot run here: the pod gets a
  Warning Event ``NotRun`` saying so.
- **The network.** Every address a program would bind for all interfaces (``0.0.0.0``, or
  vLLM's default) is the pod IP, a loopback address of its own (127.64.0.0/16). Each pod sees an
  ``/etc/hosts`` of its own (a private mount namespace, ``unshare``), rewritten as pods come and
  go: each Service's names (``NAME``, ``NAME.NAMESPACE``, ``NAME.NAMESPACE.svc`` and
  ``.cluster.local``) name one Running pod it selects, and each pod with a hostname and a
  subdomain its own name, as cluster DNS does. A Service's port is its pod's port: there is no
  kube-proxy to translate them. An engine's KV events, which ZeroMQ publishes on every
  interface, go to free ports of their own (the dev cluster's gateway does not read them).
- **Volumes.** emptyDir and hostPath are directories; secret and configMap volumes hold their
  keys as files; mount paths in arguments and environment values name those directories.
- **Credentials.** A pod whose service account token is mounted gets ``KUBECONFIG``, a
  kubeconfig holding a token of its service account (TokenRequest): the chart's RBAC holds here
  as on a real cluster.
- **Lifecycle.** Init containers run first, in order; a container that exits restarts (with
  backoff) unless the pod's restartPolicy is Never, whose pod then ends Succeeded or Failed. A
  pod deleted, or gone, is stopped (SIGTERM, then SIGKILL after its grace period, at most 30 s).
- **Readiness.** kwok calls a pod Ready as soon as it runs; this kubelet sets Ready False at
  start, then follows the containers' HTTP readiness probes (a container without one is ready
  while it runs), so a ModelDeployment is Ready when its engines answer.

Logs are written in the CRI format kwok reads, one file per container.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from baton.core.kube import Json, api_client, raw_json
from rigs import containers
from rigs.containers import (
    SERVICE_ACCOUNT_MOUNT,
    ContainerRefused,
    bound_to,
    container_name,
    image_present,
)
from rigs.processes import baton_command, kv_events_on_free_ports

__all__ = ["Kubelet", "Launch", "NotRunnable", "hosts_entries", "launch_of", "main"]

log = logging.getLogger("baton.dev-cluster.kubelet")

KWOK_GROUP, KWOK_VERSION = "kwok.x-k8s.io", "v1alpha1"
CLUSTER_DOMAIN = "cluster.local"
MAX_GRACE_S = 30
SHUTDOWN_S = 5  # under `baton dev-cluster stop`'s 10 s before it SIGKILLs this kubelet
MAX_BACKOFF_S = 30.0


class NotRunnable(ValueError):
    """The pod names a program or a source this machine cannot provide; the message says which."""


@dataclass(frozen=True, slots=True)
class Launch:
    """One container as a local process: its command line and environment."""

    container: str
    argv: list[str]
    env: dict[str, str]
    podman_name: str | None = None  # run in this podman container (rigs/containers.py)


def _program(command: Sequence[str], ip: str) -> list[str]:
    """The local command line for a container's ``command`` + ``args``, bound to ``ip``."""
    if not command:
        raise NotRunnable("the container has no command (the image's entrypoint is unknown here)")
    program, *rest = command
    if program == "vllm" and rest[:1] == ["serve"]:
        argv = baton_command("sim", *rest[1:])
        if "--host" not in argv and not any(a.startswith("--host=") for a in argv):
            argv += ["--host", ip]  # vLLM's default is every interface
        # ZeroMQ binds its wildcard on every interface, where pods share the host's ports
        kv_events_on_free_ports(argv)
    elif program == "baton":
        argv = baton_command(*rest)
    elif program in ("python", "python3"):
        argv = [sys.executable, *rest]
    elif Path(program).is_absolute() and os.access(program, os.X_OK):
        argv = list(command)
    else:
        raise NotRunnable(
            f"{program}: the dev cluster runs Baton's CLI, python and `vllm serve` (as baton "
            "sim) only"
        )
    return [bound_to(arg, ip) for arg in argv]


def _remounted(value: str, mounts: Mapping[str, Path]) -> str:
    """``value`` (an argument or an environment value) with a mount path made the directory
    that stands for it; the longest mount path wins."""
    flag, equals, path = value.rpartition("=") if value.startswith("-") else ("", "", value)
    for mount in sorted(mounts, key=len, reverse=True):
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            path = str(mounts[mount]) + path[len(mount.rstrip("/")) :]
            return f"{flag}{equals}{path}"
    return value


def _field(pod: Mapping[str, Any], path: str) -> str:
    values: dict[str, str] = {
        "status.podIP": pod["status"].get("podIP", ""),
        "status.hostIP": pod["status"].get("hostIP", ""),
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"].get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
    }
    if path not in values:
        raise NotRunnable(f"fieldRef {path}: not provided here (only {', '.join(values)})")
    return values[path]


Lookup = Callable[[str, str, str], str | None]  # (kind, name, key) -> value; None if absent


def environment(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    mounts: Mapping[str, Path],
    lookup: Lookup,
) -> dict[str, str]:
    """``container``'s environment: values (with a mount path made the directory ``mounts``
    maps it to), Secret and ConfigMap keys, downward API fields."""
    env: dict[str, str] = {"HOSTNAME": pod["metadata"]["name"]}
    for source in container.get("envFrom", []):
        raise NotRunnable(f"envFrom {source}: not provided here; use env")
    for var in container.get("env", []):
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = _remounted(str(var.get("value", "")), mounts)
            continue
        if "fieldRef" in source:
            env[name] = _field(pod, source["fieldRef"]["fieldPath"])
            continue
        kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
        ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
        if ref is None:
            raise NotRunnable(f"env {name}: {next(iter(source))} is not provided here")
        value = lookup(kind, ref["name"], ref["key"])
        if value is None:
            if ref.get("optional"):
                continue
            raise NotRunnable(f"env {name}: {kind} {ref['name']} has no key {ref['key']}")
        env[name] = value
    return env


def launch_of(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    mounts: Mapping[str, Path],
    lookup: Lookup,
    kubeconfig: Path | None = None,
) -> Launch:
    """How ``container`` of ``pod`` runs here: ``mounts`` are its mount paths' directories,
    ``lookup`` reads a Secret's or ConfigMap's key, ``kubeconfig`` holds the pod's service
    account token (None: no token is mounted)."""
    ip = pod["status"]["podIP"]
    env = environment(pod, container, mounts=mounts, lookup=lookup)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    # The pod's own words name mount paths; the program this machine runs them with (this
    # interpreter, which may live under a path a volume mounts over, as /tmp) is not the pod's.
    command = [
        _remounted(arg, mounts)
        for arg in (*container.get("command", []), *container.get("args", []))
    ]
    argv = _program(command, ip)
    if command[:2] == ["vllm", "serve"]:
        # Modules installed for vLLM (Baton's EPLB plugin: a part of Baton's own packages)
        # would shadow the simulator's, which is Baton whole.
        env.pop("PYTHONPATH", None)
    return Launch(container["name"], argv, env)


def _service_pods(
    service: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    selector = service["spec"].get("selector") or {}
    if not selector:
        return []
    return [
        pod
        for pod in pods
        if pod["metadata"]["namespace"] == service["metadata"]["namespace"]
        and selector.items() <= (pod["metadata"].get("labels") or {}).items()
    ]


def hosts_entries(
    services: Iterable[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Cluster DNS as an /etc/hosts: each name to the address it resolves to. ``pods`` are the
    Running pods with an IP; a Service names the oldest Ready pod it selects (an EndpointSlice
    lists ready endpoints only), and none while no pod it selects is Ready."""
    names: dict[str, str] = {}
    for pod in pods:
        spec, meta = pod["spec"], pod["metadata"]
        if spec.get("hostname") and spec.get("subdomain"):
            base = f"{spec['hostname']}.{spec['subdomain']}.{meta['namespace']}.svc"
            for name in (base, f"{base}.{CLUSTER_DOMAIN}"):
                names[name] = pod["status"]["podIP"]
    for service in services:
        chosen = sorted(
            (pod for pod in _service_pods(service, pods) if _pod_ready(pod)),
            key=lambda p: p["metadata"]["creationTimestamp"],
        )
        if not chosen:
            continue
        name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
        for alias in (
            name,
            f"{name}.{namespace}",
            f"{name}.{namespace}.svc",
            f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}",
        ):
            # A short name resolves in the pod's own namespace first; the hosts file is shared
            # by name, so the first namespace listed keeps a short name.
            names.setdefault(alias, chosen[0]["status"]["podIP"])
    return names


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _cri_line(stream: str, line: bytes) -> bytes:
    """One line in the CRI log format kwok (as the kubelet) reads."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"{stamp} {stream} F ".encode() + line.rstrip(b"\n") + b"\n"


@dataclass
class _Container:
    launch: Launch
    log_path: Path
    probe: str | None  # the readiness probe's URL; None: ready once running
    period_s: float = 10.0
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    ready: bool = False
    next_probe: float = 0.0


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    restart_never: bool
    grace_s: float
    directory: Path
    containers: list[_Container] = field(default_factory=list)
    ended: bool = False


class Kubelet:
    """Runs the dev cluster's Running pods as local processes (see the module's docstring)."""

    def __init__(
        self, api: client.ApiClient, directory: Path, server: str, ca: Path, images: bool = False
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.images = images  # run containers whose image podman holds in podman
        self.custom = client.CustomObjectsApi(api)
        self.directory = directory
        self.server, self.ca = server, ca
        self.pods: dict[str, _Pod] = {}
        self.hosts = directory / "hosts"
        self._stop = threading.Event()
        self._isolated = _mount_namespaces_work()
        if not self._isolated:
            log.warning("unshare cannot make a mount namespace: pods share this host's /etc/hosts")

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
                stream = watch.Watch()
                for _ in stream.stream(self.core.list_pod_for_all_namespaces, timeout_seconds=2):
                    self.sync()
                    if self._stop.is_set():
                        stream.stop()
            except (ApiException, OSError) as exc:
                log.warning("the API server did not answer (%s); trying again", exc)
                self._stop.wait(1)
            self._tend()

    def stop(self) -> None:
        """Stop every pod's processes at once, within ``SHUTDOWN_S`` in all: whoever stops
        this kubelet (``baton dev-cluster stop``) waits only so long before SIGKILL."""
        self._stop.set()
        pods = list(self.pods.values())
        self.pods.clear()
        self._stop_pods(pods, grace_s=SHUTDOWN_S, unpublish=False)

    def sync(self) -> None:
        listed = raw_json(self.core.list_pod_for_all_namespaces(_preload_content=False))["items"]
        running = [
            pod
            for pod in listed
            if pod.get("status", {}).get("phase") == "Running"
            and pod["status"].get("podIP")
            and not pod["metadata"].get("deletionTimestamp")
        ]
        live = {pod["metadata"]["uid"] for pod in running}
        gone = [self.pods.pop(uid) for uid in list(self.pods) if uid not in live]
        self._stop_pods(gone)  # stopped first: an IP may come back on a new pod
        self._write_hosts(running)
        for pod in running:
            if pod["metadata"]["uid"] not in self.pods:
                self._start_pod(pod)
        self._tend()

    # -- pods -----------------------------------------------------------------------------

    def _start_pod(self, pod: Json) -> None:
        meta = pod["metadata"]
        directory = self.directory / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        state = _Pod(
            meta["uid"],
            meta["namespace"],
            meta["name"],
            pod["spec"].get("restartPolicy") == "Never",
            min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), MAX_GRACE_S),
            directory,
        )
        self.pods[state.uid] = state
        try:
            directory.mkdir(parents=True, exist_ok=True)
            token = self._token(pod)
            volumes = self._volumes(pod, directory, token)
            kubeconfig = self._kubeconfig(pod, directory, token)
            lookup = self._lookup(meta["namespace"])

            def launch_for(container: Json) -> Launch:
                if self.images and image_present(container.get("image", "")):
                    return self._container_launch(pod, container, directory, volumes, lookup, token)
                mounts = _mounts(container, volumes)
                return launch_of(
                    pod, container, mounts=mounts, lookup=lookup, kubeconfig=kubeconfig
                )

            for init in pod["spec"].get("initContainers", []):
                launch = launch_for(init)
                done = subprocess.run(
                    self._argv(launch),
                    env={**os.environ, **launch.env},
                    cwd=directory,
                    capture_output=True,
                    timeout=300,
                )
                (directory / f"{init['name']}.log").write_bytes(
                    b"".join(_cri_line("stdout", line) for line in done.stdout.splitlines())
                )
                if done.returncode != 0:
                    raise NotRunnable(f"init container {init['name']} exited {done.returncode}")
            for container in pod["spec"]["containers"]:
                launch = launch_for(container)
                probe = container.get("readinessProbe") or {}
                state.containers.append(
                    _Container(
                        launch,
                        directory / f"{launch.container}.log",
                        _probe_url(pod, container),
                        float(probe.get("periodSeconds", 10)),
                    )
                )
        except (
            NotRunnable,
            ContainerRefused,
            subprocess.TimeoutExpired,
            subprocess.CalledProcessError,
            ApiException,
        ) as exc:
            state.ended = True
            self._event(pod, "NotRun", f"the dev cluster cannot run this pod: {exc}")
            return
        self._publish(pod, state)
        self._report_ready(state, False)  # kwok calls a pod Ready at once; it is not yet
        for running in state.containers:
            self._spawn(state, running)
        log.info("started %s/%s at %s", state.namespace, state.name, pod["status"]["podIP"])

    def _container_launch(
        self,
        pod: Json,
        container: Json,
        directory: Path,
        volumes: Mapping[str, Path],
        lookup: Lookup,
        token: str | None,
    ) -> Launch:
        """``container`` in a podman container of its image (rigs/containers.py), the pod's
        ``volumes`` mounted from their directories here (Secrets and ConfigMaps read-only, as
        a kubelet mounts them)."""
        read_only = {
            volume["name"]
            for volume in pod["spec"].get("volumes", [])
            if {"secret", "configMap", "projected", "downwardAPI"} & volume.keys()
        }
        mounts = [
            (
                volumes[mount["name"]] / mount.get("subPath", ""),
                mount["mountPath"],
                bool(mount.get("readOnly")) or mount["name"] in read_only,
            )
            for mount in container.get("volumeMounts", [])
            # the API server's service account volume: this machine's token and CA instead
            if mount["name"] in volumes and mount["mountPath"] != SERVICE_ACCOUNT_MOUNT
        ]
        account = None
        if token is not None:
            meta = pod["metadata"]
            account = directory / "serviceaccount"
            account.mkdir(parents=True, exist_ok=True)
            (account / "token").write_text(token)
            (account / "namespace").write_text(meta["namespace"])
            shutil.copyfile(self.ca, account / "ca.crt")
        argv = containers.podman_argv(
            pod,
            container,
            image_user=containers.image_user(container["image"]),
            env=environment(pod, container, mounts={}, lookup=lookup),
            mounts=mounts,
            hosts=self.hosts,
            service_account=account,
            server=self.server,
        )
        name = container_name(pod, container["name"])
        return Launch(container["name"], argv, containers.podman_env(), podman_name=name)

    def _argv(self, launch: Launch) -> list[str]:
        if not self._isolated or launch.podman_name is not None:
            return launch.argv
        # A mount namespace of its own, where the pods' hosts file is /etc/hosts.
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        return [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            script,
            str(self.hosts),
            *launch.argv,
        ]

    def _spawn(self, pod: _Pod, container: _Container) -> None:
        process = subprocess.Popen(
            self._argv(container.launch),
            env={**os.environ, **container.launch.env},
            cwd=pod.directory,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its children stop with it
        )
        container.process = process
        threading.Thread(target=_copy_log, args=(process, container.log_path), daemon=True).start()

    def _tend(self) -> None:
        """Probe readiness; restart what exited (with backoff), or end a restartPolicy Never
        pod."""
        now = time.monotonic()
        for pod in self.pods.values():
            if pod.ended:
                continue
            self._probe(pod, now)
            exited = [c for c in pod.containers if c.process and c.process.poll() is not None]
            if pod.restart_never and exited and len(exited) == len(pod.containers):
                codes = [c.process.returncode for c in pod.containers if c.process]
                pod.ended = True
                self._end(pod, codes)
                continue
            for container in exited if not pod.restart_never else []:
                if container.next_start == 0.0:
                    container.restarts += 1
                    backoff = min(MAX_BACKOFF_S, 2.0 ** min(container.restarts, 5))
                    container.next_start = now + backoff
                    log.info(
                        "%s/%s: %s exited %s; restarting in %.0f s",
                        pod.namespace,
                        pod.name,
                        container.launch.container,
                        container.process and container.process.returncode,
                        backoff,
                    )
                elif now >= container.next_start:
                    container.next_start = 0.0
                    self._spawn(pod, container)

    def _probe(self, pod: _Pod, now: float) -> None:
        """Each container's readiness probe, on its period; the pod's Ready condition follows
        all of them, as the kubelet reports it."""
        before = all(c.ready for c in pod.containers)
        for container in pod.containers:
            running = container.process is not None and container.process.poll() is None
            if not running:
                container.ready = False
            elif container.probe is None:
                container.ready = True
            elif now >= container.next_probe:
                container.next_probe = now + container.period_s
                try:
                    answer = httpx.get(container.probe, timeout=1)
                    container.ready = 200 <= answer.status_code < 400
                except httpx.HTTPError:
                    container.ready = False
        after = all(c.ready for c in pod.containers)
        if after != before:
            self._report_ready(pod, after)

    def _report_ready(self, pod: _Pod, ready: bool) -> None:
        """The pod's Ready and ContainersReady conditions and its containers' ready flags."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = [
            {
                "type": kind,
                "status": "True" if ready else "False",
                "lastTransitionTime": now,
                "reason": None if ready else "ContainersNotReady",  # None removes it
            }
            for kind in ("Ready", "ContainersReady")
        ]
        flags = {c.launch.container: c.ready for c in pod.containers}
        with suppress(ApiException):
            current = raw_json(
                self.core.read_namespaced_pod_status(
                    pod.name, pod.namespace, _preload_content=False
                )
            )
            # containerStatuses is replaced whole by a patch: the list as it is, flags changed
            statuses = [
                {**status, "ready": flags.get(status["name"], False)}
                for status in current["status"].get("containerStatuses", [])
            ]
            body = {"status": {"conditions": conditions, "containerStatuses": statuses}}
            self.core.patch_namespaced_pod_status(pod.name, pod.namespace, body)

    def _stop_pods(
        self, pods: list[_Pod], grace_s: float = MAX_GRACE_S, unpublish: bool = True
    ) -> None:
        """SIGTERM to every process of ``pods`` at once, SIGKILL to those still running after
        their grace period (at most ``grace_s``); their Logs and PortForward objects go, unless
        the cluster is stopping."""
        processes: list[tuple[subprocess.Popen[bytes], float]] = []
        start = time.monotonic()
        for pod in pods:
            for container in pod.containers:
                process = container.process
                if process is not None and process.poll() is None:
                    with suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGTERM)
                    processes.append((process, start + min(pod.grace_s, grace_s)))
        for process, deadline in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        # a podman container outlives its `podman run` killed
        containers.remove(
            [c.launch.podman_name for p in pods for c in p.containers if c.launch.podman_name]
        )
        for pod in pods:
            for plural in ("logs", "portforwards") if unpublish else ():
                with suppress(ApiException):
                    self.custom.delete_namespaced_custom_object(
                        KWOK_GROUP, KWOK_VERSION, pod.namespace, plural, pod.name
                    )
            log.info("stopped %s/%s", pod.namespace, pod.name)

    def _end(self, pod: _Pod, codes: list[int]) -> None:
        """A restartPolicy Never pod whose containers all exited: Succeeded or Failed."""
        failed = any(code != 0 for code in codes)
        finished = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        statuses = [
            {
                "name": c.launch.container,
                "ready": False,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "finishedAt": finished,
                    }
                },
            }
            for c, code in zip(pod.containers, codes, strict=True)
        ]
        body = {
            "status": {
                "phase": "Failed" if failed else "Succeeded",
                "containerStatuses": statuses,
                "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
            }
        }
        with suppress(ApiException):
            self.core.patch_namespaced_pod_status(pod.name, pod.namespace, body)
        log.info("%s/%s ended: exit codes %s", pod.namespace, pod.name, codes)

    # -- what a pod needs -----------------------------------------------------------------

    def _lookup(self, namespace: str) -> Lookup:
        def lookup(kind: str, name: str, key: str) -> str | None:
            data = self._data(kind, namespace, name)
            return None if data is None else data.get(key)

        return lookup

    def _data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        try:
            if kind == "Secret":
                secret = self.core.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            config_map = self.core.read_namespaced_config_map(name, namespace)
            return dict(config_map.data or {})
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _volumes(self, pod: Json, directory: Path, token: str | None) -> dict[str, Path]:
        """Each volume of the pod as a directory here, secrets, configMaps, the service
        account's token and downward API fields written out as files."""
        paths: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes", []):
            path = directory / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            paths[volume["name"]] = path
            if "projected" in volume:
                sources = volume["projected"].get("sources", [])
            elif {"secret", "configMap"} & volume.keys():
                sources = [volume]
            elif {"emptyDir", "hostPath"} & volume.keys():
                sources = []
                path.chmod(0o777)  # as a kubelet makes an emptyDir: any user may write
            else:
                kinds = ", ".join(k for k in volume if k != "name")
                raise NotRunnable(f"volume {volume['name']} ({kinds}): not provided here")
            for source in sources:
                for name, content in self._files(pod, source, token).items():
                    (path / name).parent.mkdir(parents=True, exist_ok=True)
                    (path / name).write_text(content)
        return paths

    def _files(self, pod: Json, source: Json, token: str | None) -> dict[str, str]:
        """The files one volume source holds, by path."""
        namespace = pod["metadata"]["namespace"]
        if "serviceAccountToken" in source:
            return {source["serviceAccountToken"]["path"]: token or ""}
        if "downwardAPI" in source:
            return {
                item["path"]: _field(pod, item["fieldRef"]["fieldPath"])
                for item in source["downwardAPI"].get("items", [])
            }
        kind, key = ("Secret", "secret") if "secret" in source else ("ConfigMap", "configMap")
        ref = source[key]
        data = self._data(kind, namespace, ref.get("secretName") or ref["name"])
        if data is None:
            if ref.get("optional"):
                return {}
            raise NotRunnable(f"{kind} {ref.get('secretName') or ref['name']}: not found")
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        return {item["path"]: data[item["key"]] for item in items}

    def _token(self, pod: Json) -> str | None:
        """A token of the pod's service account (TokenRequest), unless the pod opts out."""
        if pod["spec"].get("automountServiceAccountToken") is False:
            return None
        account = pod["spec"].get("serviceAccountName") or "default"
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        )
        answer = self.core.create_namespaced_service_account_token(
            account, pod["metadata"]["namespace"], request
        )
        if answer.status is None:
            raise NotRunnable(f"service account {account}: the API server issued no token")
        return str(answer.status.token)

    def _kubeconfig(self, pod: Json, directory: Path, token: str | None) -> Path | None:
        """A kubeconfig that authenticates as the pod's service account."""
        if token is None:
            return None
        account = pod["spec"].get("serviceAccountName") or "default"
        path = directory / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "dev",
                            "cluster": {
                                "server": self.server,
                                "certificate-authority": str(self.ca),
                            },
                        }
                    ],
                    "users": [{"name": account, "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "dev",
                            "context": {
                                "cluster": "dev",
                                "user": account,
                                "namespace": pod["metadata"]["namespace"],
                            },
                        }
                    ],
                    "current-context": "dev",
                }
            )
        )
        return path

    def _publish(self, pod: Json, state: _Pod) -> None:
        """kwok's Logs and PortForward objects for the pod: its log files and its ports."""
        meta = pod["metadata"]
        owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
        base = {"namespace": meta["namespace"], "name": meta["name"], "ownerReferences": [owner]}
        logs = [
            {"containers": [c.launch.container], "logsFile": str(c.log_path), "follow": True}
            for c in state.containers
        ]
        ports = sorted(
            {
                port["containerPort"]
                for container in pod["spec"]["containers"]
                for port in container.get("ports", [])
            }
        )
        forwards = [
            {"ports": [port], "target": {"port": port, "address": pod["status"]["podIP"]}}
            for port in ports
        ]
        for plural, kind, spec in (
            ("logs", "Logs", {"logs": logs}),
            ("portforwards", "PortForward", {"forwards": forwards}),
        ):
            body = {
                "apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}",
                "kind": kind,
                "metadata": base,
                "spec": spec,
            }
            try:
                self.custom.create_namespaced_custom_object(
                    KWOK_GROUP, KWOK_VERSION, meta["namespace"], plural, body
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.custom.replace_namespaced_custom_object(
                    KWOK_GROUP, KWOK_VERSION, meta["namespace"], plural, meta["name"], body
                )

    def _write_hosts(self, running: list[Json]) -> None:
        services = raw_json(self.core.list_service_for_all_namespaces(_preload_content=False))[
            "items"
        ]
        entries = hosts_entries(services, running)
        text = "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in sorted(entries.items())
        )
        # In place (same inode): every pod's bind mount sees the new names.
        with open(self.hosts, "a+") as hosts:
            hosts.seek(0)
            if hosts.read() != text:
                hosts.seek(0)
                hosts.truncate()
                hosts.write(text)

    def _event(self, pod: Json, reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                kind="Pod",
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta["uid"],
                api_version="v1",
            ),
            reason=reason,
            message=message,
            type="Warning",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="baton-dev-cluster-kubelet"),
        )
        with suppress(ApiException):
            self.core.create_namespaced_event(meta["namespace"], event)
        log.warning("%s/%s: %s", meta["namespace"], meta["name"], message)


def _mounts(container: Mapping[str, Any], volumes: Mapping[str, Path]) -> dict[str, Path]:
    mounts = {
        mount["mountPath"]: volumes[mount["name"]] / mount.get("subPath", "")
        for mount in container.get("volumeMounts", [])
        if mount["name"] in volumes
    }
    return {path: Path(str(where).rstrip("/")) for path, where in mounts.items()}


def _probe_url(pod: Mapping[str, Any], container: Mapping[str, Any]) -> str | None:
    """The URL of the container's HTTP readiness probe at the pod IP (None: no probe)."""
    check = (container.get("readinessProbe") or {}).get("httpGet")
    if check is None:
        return None
    port = check["port"]
    if isinstance(port, str):
        named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        if port not in named:
            raise NotRunnable(f"readinessProbe port {port}: no container port of that name")
        port = named[port]
    return f"http://{pod['status']['podIP']}:{port}{check.get('path', '/')}"


def _copy_log(process: subprocess.Popen[bytes], path: Path) -> None:
    assert process.stdout is not None
    with path.open("ab") as out:
        for line in process.stdout:
            out.write(_cri_line("stdout", line))
            out.flush()


def _mount_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    return probe.returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rigs.kubelet", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="pods' directories and logs")
    parser.add_argument("--server", required=True, help="the API server's URL, for the pods")
    parser.add_argument("--ca", type=Path, required=True, help="the API server's certificate")
    parser.add_argument(
        "--images",
        action="store_true",
        help="run a container whose image podman holds in a podman container of that image",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
    kubelet = Kubelet(api_client(args.kubeconfig), args.dir, args.server, args.ca, args.images)
    signal.signal(signal.SIGTERM, lambda *_: kubelet._stop.set())
    try:
        kubelet.run()
    finally:
        kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
