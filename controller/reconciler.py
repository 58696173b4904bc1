"""``baton controller``: ModelDeployments to pods on NVL72 trays, kept there.

Level-triggered, as controller-runtime reconcilers are: informers cache ModelDeployments, Nodes,
Pods and Baton's Services; any change queues the namespace it concerns (a Node change queues
every namespace with a ModelDeployment: trays are shared); one worker reconciles one namespace
at a time (the deployments of a namespace share its trays, so one decision covers them all):
observe the caches, ``controller.decide.decide`` purely, act, write status only when it
changed. Only the leader (a coordination.k8s.io Lease) reconciles; a standby keeps its caches
warm and takes over within seconds.

The reconcile unit is a namespace rather than an object because placement is joint: every cell
of a namespace is planned together so an older deployment keeps its trays. Pods of other
namespaces count as GPUs held by others.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import httpx
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from baton.core.api import GROUP, KIND, PLURAL, VERSION, Reason
from baton.core.kube import json_object, raw_json
from baton.core.labels import (
    CELL_GATE,
    CLIQUE_LABEL,
    CONTROLLER_COMPONENT,
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
    DEPLOYMENT_LABEL,
    GPUS_USED_BY_OTHERS_ANNOTATION,
    QUARANTINED_ANNOTATION,
    REVISION_LABEL,
    TRAY_FAILURES_ANNOTATION,
)
from baton.core.profile import Profile, load_profile
from controller.actions import Actions, Event
from controller.decide import decide
from controller.events import EventWrite, Occurrences
from controller.leader import LeaseElector
from controller.observe import Observed, pods_to_ask, rfc3339
from controller.podspec import API_PORT, COMPUTE_DOMAIN_API, RESOURCE_CLAIM_API
from controller.restarts import RestartPolicy
from controller.runtime import Informer, WorkQueue
from controller.tray_health import TrayHealthMonitor

__all__ = ["Controller", "ControllerMetrics", "DegradedTrayCollector", "StatusCollector"]

log = logging.getLogger("baton.controller")
RESYNC_S = 30.0


def _requests_finished(name: str, ip: str) -> float | None:
    """Requests the pod's engine has finished (vLLM's ``request_success_total``, from its
    /metrics, which stays open under --api-key); None if it does not answer."""
    try:
        host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP
        text = httpx.get(f"http://{host}:{API_PORT}/metrics", timeout=2.0).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:request_success_total"
        )
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("%s: its engine's request count is unknown (%s)", name, exc)
        return None


def _served(pods: list[tuple[str, str]]) -> dict[str, float]:
    """Requests each pod's engine has finished, the engines asked at once (so that engines
    that do not answer hold the reconcile up for one timeout, not one each); an engine that
    does not answer is left out."""
    if not pods:
        return {}
    with ThreadPoolExecutor(max_workers=len(pods)) as pool:
        counts = list(pool.map(lambda pod: _requests_finished(*pod), pods))
    return {name: count for (name, _), count in zip(pods, counts, strict=True) if count is not None}


class ControllerMetrics:
    """The controller's own series (``baton_controller_``) and, read from the informer's cache
    at scrape time, every ModelDeployment's conditions and cells (``baton_modeldeployment_``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reconciles = Counter(
            "baton_controller_reconciles",
            "Reconciles by outcome",
            ["outcome"],
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "baton_controller_reconcile_duration_seconds",
            "Time of one reconcile of a namespace",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.api_requests = Counter(
            "baton_controller_api_requests",
            "Writes to the Kubernetes API by verb and resource",
            ["verb", "resource"],
            registry=registry,
        )
        self.leader = Gauge(
            "baton_controller_leader", "1 while this replica leads", registry=registry
        )
        self.queue_depth = Gauge(
            "baton_controller_queue_depth", "Namespaces waiting to be reconciled", registry=registry
        )
        # The actions an operator is paged about, counted from the events that announce them
        # (one event per action; the events name the deployment, cell and tray). Unlabelled, so
        # each exists at 0 from the start: a labelled child would appear with its first action
        # already counted, which no rate or increase can see.
        self.placements = Counter(
            "baton_controller_placements", "Cells placed in an NVLink domain", registry=registry
        )
        self.group_restarts = Counter(
            "baton_controller_group_restarts",
            "Decode groups restarted as a whole after a pod failed or lost its tray",
            registry=registry,
        )
        self.quarantines = Counter(
            "baton_controller_tray_quarantines",
            "Trays quarantined after repeated Baton pod failures",
            registry=registry,
        )
        self.trays_degraded = Counter(
            "baton_controller_trays_degraded",
            "Trays the straggler watch marked degraded (a GPU holding back its decode group)",
            registry=registry,
        )
        self.group_moves = Counter(
            "baton_controller_group_moves",
            "Decode groups restarted off a degraded tray",
            registry=registry,
        )
        self._by_reason: dict[str, Counter] = {
            Reason.PLACED: self.placements,
            Reason.GROUP_RESTARTING: self.group_restarts,
            Reason.TRAY_QUARANTINED: self.quarantines,
            Reason.GROUP_MOVING: self.group_moves,
        }
        for outcome in ("success", "error"):  # both series exist before the first error
            self.reconciles.labels(outcome)

    def count(self, events: Iterable[Event]) -> None:
        """Count the placements, group restarts and quarantines ``events`` announce."""
        for event in events:
            counter = self._by_reason.get(event.reason)
            if counter is not None:
                counter.inc()

    def watch_status(
        self, registry: CollectorRegistry, deployments: Callable[[], list[dict[str, Any]]]
    ) -> None:
        """Export the conditions and cells of ``deployments()`` (the informer's cache) at every
        scrape."""
        registry.register(StatusCollector(deployments))

    def watch_trays(
        self, registry: CollectorRegistry, nodes: Callable[[], list[dict[str, Any]]]
    ) -> None:
        """Export the trays marked degraded in ``nodes()`` (the informer's cache) at every
        scrape."""
        registry.register(DegradedTrayCollector(nodes))


class DegradedTrayCollector(Collector):
    """``baton_tray_degraded{tray}``: 1 for each Node marked ``baton.dev/degraded`` (by the
    straggler watch or by hand), which the alert and the dashboard read; no series for a
    healthy tray."""

    def __init__(self, nodes: Callable[[], list[dict[str, Any]]]) -> None:
        self.nodes = nodes

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "baton_tray_degraded",
            "Trays marked baton.dev/degraded: a GPU holds back the decode group on it",
            labels=["tray", "reason"],
        )
        for node in self.nodes():
            why = (node["metadata"].get("annotations") or {}).get(DEGRADED_ANNOTATION)
            if why is not None and why.strip().lower() != "false":
                family.add_metric([node["metadata"]["name"], why[:200]], 1.0)
        yield family


class DecodeStepCollector(Collector):
    """``baton_decode_group_slowdown{namespace,modeldeployment,cell}``: each placed decode
    group's mean step in the straggler watch's last window over what the performance model
    predicts for its batch; ``baton_decode_group_slow``: 1 while the watch finds it slow."""

    def __init__(self, monitor: TrayHealthMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "modeldeployment", "cell"]
        slowdown = GaugeMetricFamily(
            "baton_decode_group_slowdown",
            "A decode group's mean step over the performance model's prediction for its batch",
            labels=labels,
        )
        slow = GaugeMetricFamily(
            "baton_decode_group_slow",
            "1 while the straggler watch finds a decode group's steps slow, window after window",
            labels=labels,
        )
        for (namespace, name, cell, _), reading in self.monitor.steps.items():
            values = [namespace, f"{namespace}/{name}", cell]
            slowdown.add_metric(values, reading.slowdown)
            slow.add_metric(values, 1.0 if reading.slow else 0.0)
        yield slowdown
        yield slow


class StatusCollector(Collector):
    """``baton_modeldeployment_condition{namespace,name,type,status}``, as kube-state-metrics
    exports a Deployment's conditions: one series per status (true, false, unknown) of each
    condition, 1 for the status it has; and ``baton_modeldeployment_cells{namespace,name,
    state}``, its cells wanted and ready as its status counts them (``status.ready``), which the
    alerts judge each deployment by. A standby replica's cache is as current as the leader's, so
    every replica exports the same series."""

    def __init__(self, deployments: Callable[[], list[dict[str, Any]]]) -> None:
        self.deployments = deployments

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "baton_modeldeployment_condition",
            "The ModelDeployment's status conditions (Placed, Ready, Progressing, Degraded): 1 "
            "for the status each has",
            labels=["namespace", "name", "type", "status"],
        )
        cells = GaugeMetricFamily(
            "baton_modeldeployment_cells",
            "The ModelDeployment's cells: wanted, and ready (decode group and every wanted "
            "prefill instance serving)",
            labels=["namespace", "name", "state"],
        )
        for deployment in self.deployments():
            meta = deployment["metadata"]
            status = deployment.get("status") or {}
            for condition in status.get("conditions") or []:
                for value in ("True", "False", "Unknown"):
                    family.add_metric(
                        [meta["namespace"], meta["name"], condition["type"], value.lower()],
                        float(condition.get("status") == value),
                    )
            ready, _, wanted = str(status.get("ready", "")).partition("/")
            if ready.isdigit() and wanted.isdigit():  # none until the controller has judged it
                cells.add_metric([meta["namespace"], meta["name"], "wanted"], float(wanted))
                cells.add_metric([meta["namespace"], meta["name"], "ready"], float(ready))
        yield family
        yield cells


def _placement_fingerprint(node: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What of a Node placement reads; heartbeats change nothing here."""
    if node is None:
        return None
    meta, spec, status = node.get("metadata", {}), node.get("spec", {}), node.get("status", {})
    annotations = meta.get("annotations") or {}
    return (
        (meta.get("labels") or {}).get(CLIQUE_LABEL),
        spec.get("unschedulable"),
        tuple(sorted((t.get("key"), t.get("effect")) for t in spec.get("taints") or [])),
        tuple(sorted((status.get("allocatable") or {}).items())),
        tuple(sorted((c.get("type"), c.get("status")) for c in status.get("conditions") or [])),
        annotations.get(QUARANTINED_ANNOTATION),
        annotations.get(GPUS_USED_BY_OTHERS_ANNOTATION),
        annotations.get(DEGRADED_ANNOTATION),
        annotations.get(DEGRADED_SINCE_ANNOTATION),
        annotations.get(DEGRADED_SLOWDOWN_ANNOTATION),
    )


class Controller:
    """Caches, queue, worker and leader election around the pure decision."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        lease_namespace: str = "default",
        lease_name: str = "baton-controller",
        identity: str | None = None,
        policy: RestartPolicy | None = None,
        registry: CollectorRegistry | None = None,
        prometheus_url: str | None = None,
        straggler_window_s: int = 60,
        straggler_windows: int = 3,
        straggler_step_slowdown: float = 1.25,
        performance_profile: Profile | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.policy = policy or RestartPolicy()
        registry = registry or CollectorRegistry()
        self.metrics = ControllerMetrics(registry)
        self.identity = identity or f"baton-controller-{uuid.uuid4().hex[:8]}"
        self.elector = LeaseElector(api, lease_namespace, lease_name, self.identity)
        self.queue = WorkQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._occurrences = Occurrences()
        self._no_compute_domains_until = 0.0
        self._cache_changed = threading.Condition()
        self.deployments = Informer(
            PLURAL,
            lambda **kw: self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kw),
            self._on_deployment,
        )
        self.nodes = Informer("nodes", self.core.list_node, self._on_node)
        self.pods = Informer("pods", self.core.list_pod_for_all_namespaces, self._on_pod)
        self.services = Informer(
            "services",
            self.core.list_service_for_all_namespaces,
            self._on_pod,
            label_selector=DEPLOYMENT_LABEL,
        )
        self.metrics.watch_status(registry, self.deployments.items)
        self.metrics.watch_trays(registry, self.nodes.items)
        # The straggler watch, where a Prometheus scrapes dcgm-exporter (leader only).
        self.tray_health = (
            TrayHealthMonitor(
                self.core,
                prometheus_url,
                deployments=self.deployments.items,
                nodes=self.nodes.items,
                profile=performance_profile or load_profile(),
                window_s=straggler_window_s,
                persist=straggler_windows,
                min_slowdown=straggler_step_slowdown,
                identity=self.identity,
            )
            if prometheus_url
            else None
        )
        if self.tray_health is not None:
            registry.register(DecodeStepCollector(self.tray_health))

    # --- events into the queue -----------------------------------------------------------------

    def _on_deployment(
        self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None
    ) -> None:
        obj = new or old
        if obj is not None:
            self.queue.add(obj["metadata"]["namespace"])
        self._notify_seen()

    def _on_pod(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        obj = new or old
        labels = (obj or {}).get("metadata", {}).get("labels") or {}
        if obj is not None and DEPLOYMENT_LABEL in labels:
            self.queue.add(obj["metadata"]["namespace"])
        self._notify_seen()

    def _notify_seen(self) -> None:
        """Wake a reconcile waiting for the caches to show its writes."""
        with self._cache_changed:
            self._cache_changed.notify_all()

    def _on_node(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if _placement_fingerprint(old) != _placement_fingerprint(new):
            self._queue_all()

    def _queue_all(self) -> None:
        for namespace in {d["metadata"]["namespace"] for d in self.deployments.items()}:
            self.queue.add(namespace)

    # --- running ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the informers and the election (the worker starts on winning it)."""
        for informer in (self.deployments, self.nodes, self.pods, self.services):
            self._spawn(f"informer-{informer.name}", informer.run, self._stop)
        self._spawn("leader-election", self.elector.run, self._stop, self._lead, self._follow)

    def _spawn(self, name: str, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _lead(self) -> None:
        self.metrics.leader.set(1)
        self._spawn("worker", self._work)
        self._spawn("resync", self._resync)
        if self.tray_health is not None:
            self._spawn("straggler-watch", self._watch_trays, self.tray_health)

    def _follow(self) -> None:
        self.metrics.leader.set(0)
        if not self._stop.is_set():
            # Lost the lease without being asked to stop: stop acting at once.
            self._stop.set()
            self.queue.close()

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        self._notify_seen()
        for informer in (self.deployments, self.nodes, self.pods, self.services):
            informer.stop()
        for thread in self._threads:
            if not thread.name.startswith("informer-"):  # informers end with the process
                thread.join(timeout=5)

    @property
    def stopped(self) -> threading.Event:
        return self._stop

    def _watch_trays(self, monitor: TrayHealthMonitor) -> None:
        while not self._stop.wait(monitor.window_s):
            try:
                found = monitor.window()
            except (httpx.HTTPError, ApiException, ValueError, KeyError) as exc:
                # Prometheus down, or a window it cannot answer: no verdict, no mark
                log.warning("straggler watch: window skipped: %s", exc)
                continue
            self.metrics.trays_degraded.inc(len(found.degraded))
            for namespace, event in found.slow_groups:
                self._emit(namespace, [event])

    def _resync(self) -> None:
        while not self._stop.wait(RESYNC_S):
            self._queue_all()

    def _work(self) -> None:
        for informer in (self.deployments, self.nodes, self.pods, self.services):
            while not informer.synced.wait(1.0):
                if self._stop.is_set():
                    return
        self._queue_all()
        while not self._stop.is_set():
            self.metrics.queue_depth.set(len(self.queue))
            namespace = self.queue.get()
            if namespace is None:
                continue
            started = time.perf_counter()
            try:
                actions = self.reconcile(str(namespace))
            except Exception:  # a reconcile must not kill the worker; the key is retried
                delay = self.queue.retry(namespace)
                self.metrics.reconciles.labels("error").inc()
                log.exception("reconcile of %s failed; retrying in %.2f s", namespace, delay)
            else:
                self.queue.forget(namespace)
                self.metrics.reconciles.labels("success").inc()
                if actions.requeue_after is not None:
                    self.queue.add_after(namespace, actions.requeue_after)
            finally:
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
                self.queue.done(namespace)

    # --- one reconcile ---------------------------------------------------------------------------

    def _compute_domains(self, namespace: str) -> list[dict[str, Any]] | None:
        """The namespace's ComputeDomains, or None while the cluster does not serve the API
        (checked again every minute: NVIDIA's DRA driver may be installed later)."""
        if time.monotonic() < self._no_compute_domains_until:
            return None
        group, version, plural = COMPUTE_DOMAIN_API
        try:
            response = self.custom.list_namespaced_custom_object(
                group, version, namespace, plural, _preload_content=False
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._no_compute_domains_until = time.monotonic() + 60.0
            return None
        domains: list[dict[str, Any]] = raw_json(response)["items"]
        return domains

    def _resource_claims(self, namespace: str, served: bool) -> list[dict[str, Any]]:
        """The namespace's ResourceClaims that Baton made (prefill pods' IMEX channels), listed
        only where the cluster serves ComputeDomains: no channel claim is made elsewhere."""
        if not served:
            return []
        group, version, plural = RESOURCE_CLAIM_API
        response = self.custom.list_namespaced_custom_object(
            group,
            version,
            namespace,
            plural,
            label_selector=DEPLOYMENT_LABEL,
            _preload_content=False,
        )
        claims: list[dict[str, Any]] = raw_json(response)["items"]
        return claims

    def observe(self, namespace: str) -> Observed:
        domains = self._compute_domains(namespace)
        deployments = [
            d for d in self.deployments.items() if d["metadata"]["namespace"] == namespace
        ]
        pods = self.pods.items()
        return Observed(
            namespace=namespace,
            deployments=deployments,
            nodes=self.nodes.items(),
            pods=pods,
            services=[s for s in self.services.items() if s["metadata"]["namespace"] == namespace],
            now=datetime.now(UTC),
            compute_domains=domains,
            resource_claims=self._resource_claims(namespace, domains is not None),
            served=_served(pods_to_ask(deployments, pods)),
        )

    def reconcile(self, namespace: str) -> Actions:
        actions = decide(self.observe(namespace), self.policy)
        written = self._act(namespace, actions)
        self._await_caches(namespace, actions, written)
        return actions

    def _await_caches(
        self, namespace: str, actions: Actions, status_versions: dict[str, str]
    ) -> None:
        """Wait (bounded) until the caches show this reconcile's writes, so the next one does
        not act twice on what it has not seen yet (client-go's ReplicaSet keeps
        "expectations" for the same reason)."""

        def unseen() -> str | None:
            pods = {
                p["metadata"]["name"]: p
                for p in self.pods.items()
                if p["metadata"]["namespace"] == namespace
            }
            services = {
                s["metadata"]["name"]
                for s in self.services.items()
                if s["metadata"]["namespace"] == namespace
            }
            deployments = {
                d["metadata"]["name"]: d["metadata"]["resourceVersion"]
                for d in self.deployments.items()
                if d["metadata"]["namespace"] == namespace
            }
            for manifest in actions.create:
                name = manifest["metadata"]["name"]
                if manifest["kind"] in ("ComputeDomain", "ResourceClaim"):
                    continue  # not cached: listed afresh by every reconcile
                if name not in (services if manifest["kind"] == "Service" else pods):
                    return f"created {manifest['kind']} {name}"
            for name in actions.delete_pods:
                if name in pods and not pods[name]["metadata"].get("deletionTimestamp"):
                    return f"deleted pod {name}"
            for name in actions.ungate:
                gates = pods.get(name, {}).get("spec", {}).get("schedulingGates") or []
                if any(g["name"] == CELL_GATE for g in gates):
                    return f"ungated pod {name}"
            for name, version in status_versions.items():
                if not _at_least(deployments.get(name, version), version):
                    return f"status of {name}"
            return None

        deadline = time.monotonic() + 5.0
        with self._cache_changed:  # the pod and deployment informers notify on every event
            while (missing := unseen()) is not None and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "%s: the cache has not seen the %s yet; going on", namespace, missing
                    )
                    break
                self._cache_changed.wait(remaining)

    def _count(self, verb: str, resource: str) -> None:
        self.metrics.api_requests.labels(verb, resource).inc()

    def _act(self, namespace: str, actions: Actions) -> dict[str, str]:
        """Perform ``actions``; the resourceVersion of each status written."""
        if actions.create or actions.delete_pods or actions.ungate or actions.trays:
            log.info(
                "%s: create %s; delete %s; ungate %d pods; trays %s",
                namespace,
                [m["metadata"]["name"] for m in actions.create] or "nothing",
                actions.delete_pods + actions.delete_services or "nothing",
                len(actions.ungate),
                [(m.node, len(m.failures), m.quarantine) for m in actions.trays] or "unchanged",
            )
        for mark in actions.trays:
            annotations = {TRAY_FAILURES_ANNOTATION: ",".join(mark.failures)}
            if mark.quarantine is not None:
                annotations[QUARANTINED_ANNOTATION] = mark.quarantine
            self._count("patch", "nodes")
            self.core.patch_node(mark.node, {"metadata": {"annotations": annotations}})
        for name in actions.delete_pods:
            self._count("delete", "pods")
            _ignore(404, self.core.delete_namespaced_pod, name, namespace)
        for name, revision in actions.relabel:
            self._count("patch", "pods")
            body = {"metadata": {"labels": {REVISION_LABEL: revision}}}
            _ignore(404, self.core.patch_namespaced_pod, name, namespace, body)
        for name in actions.delete_services:
            self._count("delete", "services")
            _ignore(404, self.core.delete_namespaced_service, name, namespace)
        # objects of other APIs, by kind: (group, version, plural)
        by_kind = {"ComputeDomain": COMPUTE_DOMAIN_API, "ResourceClaim": RESOURCE_CLAIM_API}
        for api, names in (
            (COMPUTE_DOMAIN_API, actions.delete_compute_domains),
            (RESOURCE_CLAIM_API, actions.delete_resource_claims),
        ):
            group, version, plural = api
            for name in names:
                self._count("delete", plural)
                _ignore(
                    404,
                    self.custom.delete_namespaced_custom_object,
                    group,
                    version,
                    namespace,
                    plural,
                    name,
                )
        for manifest in actions.create:
            kind = manifest["kind"]
            self._count("create", kind.lower() + "s")
            # already there: the cache lagged (409)
            if kind in by_kind:
                group, version, plural = by_kind[kind]
                _ignore(
                    409,
                    self.custom.create_namespaced_custom_object,
                    group,
                    version,
                    namespace,
                    plural,
                    manifest,
                )
            elif kind == "Service":
                _ignore(409, self.core.create_namespaced_service, namespace, manifest)
            else:
                _ignore(409, self.core.create_namespaced_pod, namespace, manifest)
        for name in actions.ungate:
            self._ungate(namespace, name)
        versions: dict[str, str] = {}
        for deployment, status in actions.status.items():
            self._count("patch", "modeldeployments/status")
            try:
                written = self.custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, deployment, {"status": status}
                )
            except ApiException as exc:
                if exc.status != 404:  # deleted meanwhile
                    raise
            else:
                versions[deployment] = json_object(written)["metadata"]["resourceVersion"]
        self.metrics.count(actions.events)
        self._emit(namespace, actions.events)
        return versions

    def _ungate(self, namespace: str, name: str) -> None:
        pod = next(
            (
                p
                for p in self.pods.items()
                if p["metadata"]["namespace"] == namespace and p["metadata"]["name"] == name
            ),
            None,
        )
        if pod is None:
            return
        gates = [g for g in pod["spec"].get("schedulingGates") or [] if g["name"] != CELL_GATE]
        patch = [
            # the test fails the patch if another writer changed the gates meanwhile
            {
                "op": "test",
                "path": "/spec/schedulingGates",
                "value": pod["spec"]["schedulingGates"],
            },
            {"op": "replace", "path": "/spec/schedulingGates", "value": gates},
        ]
        self._count("patch", "pods")
        _ignore((404, 422), self.core.patch_namespaced_pod, name, namespace, patch)

    def _emit(self, namespace: str, events: Iterable[Event]) -> None:
        """Log every event and record it as a Kubernetes Event on its ModelDeployment; the
        same event again bumps the first one's count (``controller.events``)."""
        owners = {
            d["metadata"]["name"]: d
            for d in self.deployments.items()
            if d["metadata"]["namespace"] == namespace
        }
        for event in events:
            log.log(
                logging.WARNING if event.type == "Warning" else logging.INFO,
                "%s/%s: %s: %s",
                namespace,
                event.deployment,
                event.reason,
                event.message,
            )
            owner = owners.get(event.deployment)
            if owner is None:
                continue
            uid = owner["metadata"]["uid"]
            key = (namespace, uid, event.type, event.reason, event.message)
            # Named as client-go names Events: the object's name and the time in hex.
            name = f"{event.deployment}.{time.time_ns():x}"
            write = self._occurrences.record(key, name, rfc3339(datetime.now(UTC)))
            try:
                if write.create:
                    self._create_event(namespace, event, owner, write)
                else:
                    self._count("patch", "events")
                    try:
                        self.core.patch_namespaced_event(
                            write.name,
                            namespace,
                            {"count": write.count, "lastTimestamp": write.last_timestamp},
                        )
                    except ApiException as exc:
                        if exc.status != 404:
                            raise
                        self._occurrences.forget(key)  # expired: record it anew
                        write = self._occurrences.record(key, name, write.last_timestamp)
                        self._create_event(namespace, event, owner, write)
            except ApiException as exc:  # events are best effort
                log.warning("event %s not recorded: %s", event.reason, exc.reason)

    def _create_event(
        self, namespace: str, event: Event, owner: dict[str, Any], write: EventWrite
    ) -> None:
        # The model the client would validate a dict body into: the request is the same.
        body = client.CoreV1Event.model_validate(
            {
                "metadata": {"name": write.name, "namespace": namespace},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": event.deployment,
                    "namespace": namespace,
                    "uid": owner["metadata"]["uid"],
                },
                "type": event.type,
                "reason": event.reason,
                "message": event.message[:1024],
                "source": {"component": "baton-controller"},
                "firstTimestamp": write.first_timestamp,
                "lastTimestamp": write.last_timestamp,
                "count": write.count,
                "reportingComponent": CONTROLLER_COMPONENT,
                "reportingInstance": self.identity,
            }
        )
        self._count("create", "events")
        self.core.create_namespaced_event(namespace, body)


def _at_least(seen: str, written: str) -> bool:
    """resourceVersions are opaque; etcd's are integers, and a newer write supersedes ours."""
    if seen.isdigit() and written.isdigit():
        return int(seen) >= int(written)
    return seen == written


def _ignore(statuses: int | tuple[int, ...], call: Any, *args: Any) -> None:
    allowed = (statuses,) if isinstance(statuses, int) else statuses
    try:
        call(*args)
    except ApiException as exc:
        if exc.status not in allowed:
            raise
