"""One reconcile of a namespace's ModelDeployments, decided purely from what was observed.

Input: the namespace's ModelDeployment objects, every Node, every Pod of the cluster and the
namespace's Services, as the API returns them (JSON dicts), and the time. Output: a
:class:`Decision`: what to create, delete and ungate, which trays to mark, what status to write
and which Events to emit. ``controller/reconciler.py`` performs it; nothing here does I/O.

The current placement is read back from the cluster: a live pod's tray is the truth; a cell's
``status.cells`` entry (the placement record written after every reconcile that changed it)
fills in what no live pod says (a deleted pod's tray, the spare trays, prefill GPU indices).
``controller/placement.py`` then repairs or admits every wanted cell, and this module turns the
plan into actions:

- A cell's pods are created behind the ``baton.dev/cell`` gate; once every planned pod of the
  cell exists (and none is terminating) the gates still held are lifted together, so
  kube-scheduler binds the cell at once.
- A decode group restarts as a whole (a wide-EP group cannot lose a rank): when one of its pods
  failed, was deleted after launch or lost its tray, every live decode pod of the cell is
  deleted, and the group is created afresh once they are gone (on the spare tray for a rank
  whose tray failed). Restarts back off (``RestartPolicy``); past the budget the cell waits,
  Degraded, until old restarts age out of the window.
- A prefill instance restarts alone; changing the prefill count creates or deletes prefill pods
  and never touches the decode group.
- Every pod carries a hash of the spec it was rendered from. When the ModelDeployment's spec
  changes what a pod would be (image, flags, env), the decode group is restarted as a whole on
  the new spec (a planned restart: no backoff, no budget) and prefill instances are replaced one
  at a time while the others serve.
- A tray on which Baton pods failed ``quarantine_after`` times is quarantined (annotation); the
  topology then keeps placement off it.
- Pods of cells no longer wanted or no longer placeable are deleted: no partial cell stays.
- Where the cluster serves NVIDIA's ComputeDomain API, each cell gets its ComputeDomain and its
  decode pods claim the domain's IMEX channel (``controller/podspec.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from baton.api import (
    CellEndpoints,
    CellStatus,
    Condition,
    ConditionType,
    DecodeServerEndpoint,
    DecodeStatus,
    Endpoints,
    ModelDeployment,
    ModelDeploymentStatus,
    PrefillInstanceStatus,
    Reason,
)
from baton.files import describe_errors
from baton.labels import (
    CELL_GATE,
    CELL_LABEL,
    DEPLOYMENT_LABEL,
    HOSTNAME_LABEL,
    QUARANTINED_ANNOTATION,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    TRAY_FAILURES_ANNOTATION,
)
from baton.topology import Topology, parse_topology
from controller.placement import (
    CellPlacement,
    Plan,
    PrefillInstance,
    decode_pod_name,
    plan_placement,
    prefill_pod_name,
)
from controller.podspec import (
    API_PORT,
    EPLB_AGENT_PORT,
    compute_domain,
    compute_domain_name,
    decode_service,
    render_cell,
)
from controller.status import placement_conditions, set_condition

__all__ = [
    "Decision",
    "Event",
    "Observed",
    "RestartPolicy",
    "TrayMark",
    "decide",
    "rfc3339",
]

Manifest = dict[str, Any]
_TERMINAL = frozenset({"Succeeded", "Failed"})


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How decode group restarts back off, and when a tray is quarantined.

    The ``n``-th restart within ``window`` waits ``base * 2**(n-2)`` (capped) after the previous
    one (the first is immediate); ``budget`` restarts within ``window`` stop further restarts.
    """

    base: timedelta = timedelta(seconds=5)
    cap: timedelta = timedelta(minutes=5)
    window: timedelta = timedelta(hours=1)
    budget: int = 10
    quarantine_after: int = 3

    def wait(self, recent: Sequence[datetime], now: datetime) -> timedelta | None:
        """Time left before the next restart may start; None when the budget is spent."""
        if len(recent) >= self.budget:
            return None
        if not recent:
            return timedelta(0)
        delay = min(self.base * 2 ** (len(recent) - 1), self.cap)
        return max(max(recent) + delay - now, timedelta(0))


@dataclass(frozen=True, slots=True)
class Observed:
    namespace: str
    deployments: Sequence[Mapping[str, Any]]
    nodes: Sequence[Mapping[str, Any]]
    pods: Sequence[Mapping[str, Any]]  # every pod of the cluster: GPUs held by others count
    services: Sequence[Mapping[str, Any]]  # the namespace's services
    now: datetime
    # The namespace's ComputeDomains; None when the cluster does not serve the API.
    compute_domains: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Event:
    deployment: str
    type: str  # "Normal" or "Warning"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class TrayMark:
    """Annotations to set on a tray: its failure count and, past the limit, quarantine."""

    node: str
    failures: int
    quarantine: str | None = None


@dataclass
class Decision:
    create: list[Manifest] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    delete_services: list[str] = field(default_factory=list)
    delete_compute_domains: list[str] = field(default_factory=list)
    ungate: list[str] = field(default_factory=list)
    trays: list[TrayMark] = field(default_factory=list)
    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # deployment -> new status
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # seconds; a backoff to wait out

    def wake_in(self, seconds: float) -> None:
        if self.requeue_after is None or seconds < self.requeue_after:
            self.requeue_after = seconds


# --- reading pods ------------------------------------------------------------------------------


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _left_behind(obj: Mapping[str, Any], deployment: str, kept: set[str | None]) -> bool:
    """A per-cell object (Service, ComputeDomain) of ``deployment`` whose cell is in none of
    ``kept`` (neither planned nor still running pods)."""
    labels = _labels(obj)
    return labels.get(DEPLOYMENT_LABEL) == deployment and labels.get(CELL_LABEL) not in kept


def _planned_tray(pod: Mapping[str, Any]) -> str | None:
    """The node a pod runs on, or the one its required node affinity names."""
    spec = pod.get("spec", {})
    if spec.get("nodeName"):
        return spec["nodeName"]
    required = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    for term in required.get("nodeSelectorTerms", []):
        for expression in term.get("matchExpressions", []):
            if expression.get("key") == HOSTNAME_LABEL and expression.get("values"):
                return expression["values"][0]
    return None


def _gpus_requested(pod: Mapping[str, Any], resource: str) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        requests = container.get("resources", {}).get("requests") or {}
        value = str(requests.get(resource, "0"))
        total += int(value) if value.isdigit() else 0
    return total


def _terminating(pod: Mapping[str, Any]) -> bool:
    return pod.get("metadata", {}).get("deletionTimestamp") is not None


def _phase(pod: Mapping[str, Any]) -> str:
    return pod.get("status", {}).get("phase", "Pending")


def _gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == CELL_GATE for g in pod.get("spec", {}).get("schedulingGates") or [])


def _ready(pod: Mapping[str, Any]) -> bool:
    if _terminating(pod) or _phase(pod) != "Running":
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _outdated(pod: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """The pod was rendered from another spec than the current one."""
    have = (pod.get("metadata", {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)
    return have != wanted["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]


def _owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    owners = pod.get("metadata", {}).get("ownerReferences") or []
    return any(owner.get("uid") == uid for owner in owners)


# --- the deployments ----------------------------------------------------------------------------


@dataclass
class _Deployment:
    model: ModelDeployment
    uid: str
    generation: int
    status: ModelDeploymentStatus
    pods: dict[str, Mapping[str, Any]]  # own pods by name


def _deployments(observed: Observed) -> tuple[list[_Deployment], list[Event]]:
    """Valid, not-deleting deployments, oldest first (they keep priority for capacity)."""
    found: list[tuple[str, str, _Deployment]] = []
    events: list[Event] = []
    for obj in observed.deployments:
        meta = obj.get("metadata", {})
        if meta.get("deletionTimestamp"):
            continue
        try:
            model = ModelDeployment.model_validate(
                {key: obj[key] for key in ("apiVersion", "kind", "metadata", "spec") if key in obj}
            )
        except ValidationError as exc:
            # The API server validates the schema; this catches rules it cannot express
            # (dep a multiple of gpusPerPod, windowSize <= stepInterval, ...).
            events.append(
                Event(meta.get("name", "?"), "Warning", Reason.INVALID_SPEC, describe_errors(exc))
            )
            continue
        try:
            status = ModelDeploymentStatus.model_validate(obj.get("status") or {})
        except ValidationError:
            status = ModelDeploymentStatus()  # an old record's shape: rebuilt from the pods
        uid = meta.get("uid", "")
        pods = {
            pod["metadata"]["name"]: pod
            for pod in observed.pods
            if pod.get("metadata", {}).get("namespace") == observed.namespace
            and _labels(pod).get(DEPLOYMENT_LABEL) == model.name
            and _owned_by(pod, uid)
        }
        deployment = _Deployment(model, uid, int(meta.get("generation", 0)), status, pods)
        found.append((meta.get("creationTimestamp", ""), model.name, deployment))
    found.sort(key=lambda item: (item[0], item[1]))
    return [deployment for _, _, deployment in found], events


def _topology(observed: Observed, deployments: Sequence[_Deployment]) -> Topology:
    """Trays, with the GPUs that pods other than these deployments' live pods hold."""
    spec = deployments[0].model.spec.topology
    own = {name for d in deployments for name in d.pods}
    held: dict[str, int] = defaultdict(int)
    for pod in observed.pods:
        meta = pod.get("metadata", {})
        if meta.get("namespace") == observed.namespace and meta.get("name") in own:
            continue
        if _phase(pod) in _TERMINAL:
            continue
        tray = _planned_tray(pod)
        if tray is not None:
            held[tray] += _gpus_requested(pod, spec.gpu_resource)
    return parse_topology(
        {"items": list(observed.nodes)},
        used_by_others=held,
        domain_label=spec.domain_label,
        gpu_resource=spec.gpu_resource,
    )


def _current_cells(deployment: _Deployment, topology: Topology) -> list[CellPlacement]:
    """Each recorded cell as it stands: live pods' trays over the placement record."""
    cells: list[CellPlacement] = []
    decode_pods = (
        deployment.model.spec.cell.decode.dep // deployment.model.spec.cell.decode.gpus_per_pod
    )
    for record in deployment.status.cells:
        live = {
            name: pod
            for name, pod in deployment.pods.items()
            if _labels(pod).get(CELL_LABEL) == record.name and not _terminating(pod)
        }
        decode_trays: list[str] = []
        for index in range(decode_pods):
            pod = live.get(decode_pod_name(record.name, index))
            tray = _planned_tray(pod) if pod else None
            if tray is None and index < len(record.decode.trays):
                tray = record.decode.trays[index]
            if tray is None:
                break
            decode_trays.append(tray)
        if len(decode_trays) != decode_pods:
            continue  # no full record: the cell is admitted afresh
        prefill = [
            PrefillInstance(int(name.rsplit("-", 1)[1]), instance.tray, tuple(instance.gpus))
            for instance in record.prefill
            for name in [instance.pod]
        ]
        domain = record.domain
        cells.append(
            CellPlacement(
                name=record.name,
                deployment=deployment.model.name,
                domain=domain,
                decode_trays=tuple(decode_trays),
                prefill=tuple(prefill),
                spare_trays=tuple(t for t in record.spare_trays if topology.tray(t) is not None),
                max_prefill_instances=len(prefill),
            )
        )
    return cells


def _tray_keeps_pods(topology: Topology, pod: Mapping[str, Any]) -> bool:
    name = _planned_tray(pod)
    tray = topology.tray(name) if name is not None else None
    return tray is not None and tray.keeps_pods


# --- acting on one cell --------------------------------------------------------------------------


@dataclass
class _CellOutcome:
    ready_decode_pods: int = 0
    decode_ready: bool = False
    prefill_ready: int = 0
    restarting: bool = False
    updating: bool = False
    backoff: bool = False
    exhausted: bool = False
    pending: bool = False
    restarts: list[str] = field(default_factory=list)


def _cell_actions(
    deployment: _Deployment,
    cell: CellPlacement,
    restarted: bool,
    topology: Topology,
    observed: Observed,
    policy: RestartPolicy,
    decision: Decision,
    failures: dict[str, tuple[int, str]],
) -> _CellOutcome:
    name = deployment.model.name
    imex = observed.compute_domains is not None
    manifests = render_cell(
        deployment.model.spec,
        cell,
        deployment=name,
        uid=deployment.uid,
        namespace=observed.namespace,
        compute_domain=imex,
    )
    service, wanted = manifests[0], {m["metadata"]["name"]: m for m in manifests[1:]}
    services = {s["metadata"]["name"] for s in observed.services}
    if service["metadata"]["name"] not in services:
        decision.create.append(service)
    domains = {d["metadata"]["name"] for d in observed.compute_domains or ()}
    if imex and compute_domain_name(cell.name) not in domains:
        decision.create.append(
            compute_domain(
                cell.name, deployment=name, uid=deployment.uid, namespace=observed.namespace
            )
        )
    record = next((c for c in deployment.status.cells if c.name == cell.name), None)
    outcome = _CellOutcome(restarts=list(record.restarts) if record else [])
    now = observed.now
    outcome.restarts = [t for t in outcome.restarts if now - _parse_time(t) < policy.window]
    pods = {
        pod_name: pod
        for pod_name, pod in deployment.pods.items()
        if _labels(pod).get(CELL_LABEL) == cell.name
    }
    live = {n: p for n, p in pods.items() if not _terminating(p)}

    # Decode: whole group or nothing.
    decode_names = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    live_decode = {n: live[n] for n in decode_names if n in live}
    failed = [n for n, p in live_decode.items() if _phase(p) in _TERMINAL]
    lost = [n for n, p in live_decode.items() if not _tray_keeps_pods(topology, p)]
    launched = any(not _gated(p) for p in live_decode.values())
    missing = len(live_decode) < len(decode_names)
    broken = bool(failed or lost or restarted or (launched and missing))
    if broken and live_decode:
        wait = policy.wait([_parse_time(t) for t in outcome.restarts], now)
        if wait is None:
            outcome.exhausted = True
        elif wait > timedelta(0):
            outcome.backoff = True
            decision.wake_in(wait.total_seconds())
        else:
            outcome.restarting = True
            outcome.restarts.append(rfc3339(now))
            decision.delete_pods.extend(sorted(live_decode))
            why = []
            for pod_name in sorted(set(failed) | set(lost)):
                tray = _planned_tray(live_decode[pod_name])
                why.append(
                    f"{pod_name} on {tray} {'failed' if pod_name in failed else 'lost its tray'}"
                )
                if tray is not None:
                    _count_failure(failures, tray, name)
            if not why:
                why.append("a decode pod was deleted" if missing else "its placement changed")
            decision.events.append(
                Event(
                    name,
                    "Warning",
                    Reason.GROUP_RESTARTING,
                    f"decode group of {cell.name} restarts as a whole: {'; '.join(why)}; "
                    f"trays {', '.join(cell.decode_trays)}",
                )
            )
    elif (
        live_decode and not broken and any(_outdated(p, wanted[n]) for n, p in live_decode.items())
    ):
        # The spec changed (image, flags, shape): a planned restart of the whole group on the
        # new pods, outside the failure backoff and budget.
        outcome.updating = True
        decision.delete_pods.extend(sorted(live_decode))
        decision.events.append(
            Event(
                name,
                "Normal",
                Reason.GROUP_UPDATING,
                f"decode group of {cell.name} restarts as a whole on the updated pod spec",
            )
        )
    elif (not live_decode or not launched) and not any(
        n in pods and _terminating(pods[n]) for n in decode_names
    ):
        # Not launched yet, or every old pod gone (new pods reuse the names): create the rest.
        decision.create.extend(wanted[n] for n in decode_names if n not in live)
    outcome.ready_decode_pods = sum(
        1
        for n in decode_names
        if n in live and _ready(live[n]) and not (outcome.restarting or outcome.updating)
    )
    outcome.decode_ready = outcome.ready_decode_pods == len(decode_names)

    # Prefill: each instance alone.
    prefill_names = [prefill_pod_name(cell.name, i.index) for i in cell.prefill]
    planned_trays = {prefill_pod_name(cell.name, i.index): i.tray for i in cell.prefill}
    for pod_name, pod in sorted(live.items()):
        if _labels(pod).get(ROLE_LABEL) != "prefill":
            continue
        if pod_name not in planned_trays:
            decision.delete_pods.append(pod_name)  # scaled down or moved off a claimed tray
        elif _phase(pod) in _TERMINAL or _planned_tray(pod) != planned_trays[pod_name]:
            decision.delete_pods.append(pod_name)
            tray = _planned_tray(pod)
            if _phase(pod) in _TERMINAL and tray is not None:
                _count_failure(failures, tray, name)
            decision.events.append(
                Event(
                    name,
                    "Warning",
                    Reason.PREFILL_RESTARTING,
                    f"prefill {pod_name} on {tray} restarts",
                )
            )
    # Prefill on an updated spec: one instance at a time while every other one serves; an
    # outdated instance that is not ready serves nothing and goes at once.
    deleting = set(decision.delete_pods)
    outdated = [
        n
        for n in prefill_names
        if n in live and n not in deleting and _outdated(live[n], wanted[n])
    ]
    serving = all(n in live and _ready(live[n]) for n in prefill_names)
    replace = [n for n in outdated if not _ready(live[n])] or (outdated[:1] if serving else [])
    for pod_name in replace:
        decision.delete_pods.append(pod_name)
        decision.events.append(
            Event(
                name,
                "Normal",
                Reason.PREFILL_UPDATING,
                f"prefill {pod_name} replaced on the updated pod spec",
            )
        )
    outcome.updating = outcome.updating or bool(outdated)
    for pod_name in prefill_names:
        if pod_name not in pods:
            decision.create.append(wanted[pod_name])
    outcome.prefill_ready = sum(1 for n in prefill_names if n in live and _ready(live[n]))

    # Lift the cell's gates together, once every planned pod exists and none is on its way out.
    deleting = set(decision.delete_pods)
    complete = all(
        n in live and n not in deleting and _planned_tray(live[n]) == _planned_tray(wanted[n])
        for n in wanted
    )
    if complete:
        decision.ungate.extend(sorted(n for n in wanted if _gated(live[n])))
    outcome.pending = not complete or any(_gated(live[n]) for n in wanted if n in live)
    return outcome


def _count_failure(failures: dict[str, tuple[int, str]], tray: str, deployment: str) -> None:
    count, _ = failures.get(tray, (0, deployment))
    failures[tray] = (count + 1, deployment)


def _cell_status(
    cell: CellPlacement, deployment: _Deployment, outcome: _CellOutcome, gpus_per_pod: int
) -> tuple[CellStatus, CellEndpoints]:
    pods = deployment.pods
    decode_names = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    prefill = []
    endpoints = CellEndpoints(name=cell.name)
    for instance in cell.prefill:
        pod_name = prefill_pod_name(cell.name, instance.index)
        pod = pods.get(pod_name)
        ready = pod is not None and _ready(pod)
        prefill.append(
            PrefillInstanceStatus(
                pod=pod_name, tray=instance.tray, gpus=list(instance.gpus), ready=ready
            )
        )
        if ready and pod is not None and pod.get("status", {}).get("podIP"):
            endpoints.prefill.append(f"http://{pod['status']['podIP']}:{API_PORT}")
    if outcome.decode_ready:
        for pod_name in decode_names:
            ip = pods[pod_name].get("status", {}).get("podIP")
            if ip:
                endpoints.decode.append(
                    DecodeServerEndpoint(
                        url=f"http://{ip}:{API_PORT}", ranks=list(range(gpus_per_pod))
                    )
                )
                endpoints.eplb_agents.append(f"{ip}:{EPLB_AGENT_PORT}")
    status = CellStatus(
        name=cell.name,
        domain=cell.domain,
        decode=DecodeStatus(
            pods=decode_names,
            trays=list(cell.decode_trays),
            leader=f"{decode_names[0]}.{decode_service(cell.name)}" if decode_names else None,
            ready_ranks=outcome.ready_decode_pods * gpus_per_pod,
        ),
        prefill=prefill,
        spare_trays=list(cell.spare_trays),
        restarts=outcome.restarts,
    )
    return status, endpoints


def _conditions(
    status: ModelDeploymentStatus,
    plan: Plan,
    deployment: _Deployment,
    outcomes: Mapping[str, _CellOutcome],
    prefill_wanted: int,
    quarantined: Sequence[str],
    now: str,
) -> None:
    generation = deployment.generation
    name = deployment.model.name

    def put(kind: ConditionType, state: bool, reason: str, message: str) -> None:
        set_condition(
            status.conditions,
            Condition(
                type=kind,
                status="True" if state else "False",
                reason=reason,
                message=message,
                last_transition_time=now,
                observed_generation=generation,
            ),
        )

    for condition in placement_conditions(plan, name, generation, now):
        set_condition(status.conditions, condition)
    wanted = deployment.model.spec.cells
    placed = [c for c in plan.cells if c.deployment == name]
    ready_cells = [c.name for c in placed if outcomes[c.name].decode_ready]
    prefill_ready = sum(o.prefill_ready for o in outcomes.values())
    restarting = [c for c, o in outcomes.items() if o.restarting]
    updating = [c for c, o in outcomes.items() if o.updating]
    backoff = [c for c, o in outcomes.items() if o.backoff]
    exhausted = [c for c, o in outcomes.items() if o.exhausted]
    pending = [c for c, o in outcomes.items() if o.pending or not o.decode_ready]
    all_ready = (
        len(ready_cells) == wanted and prefill_ready == prefill_wanted and not pending
    ) and not updating
    if all_ready:
        put(ConditionType.READY, True, Reason.ALL_READY, f"{wanted} cells ready")
    else:
        put(
            ConditionType.READY,
            False,
            Reason.PODS_PENDING,
            f"{len(ready_cells)} of {wanted} cells ready; {prefill_ready} of "
            f"{prefill_wanted} prefill instances ready",
        )
    if not any(c.deployment == name for c in plan.unplaced):
        if restarting or backoff:
            put(
                ConditionType.PROGRESSING,
                True,
                Reason.GROUP_RESTARTING,
                f"decode group restarting: {', '.join(restarting + backoff)}",
            )
        elif updating:
            put(
                ConditionType.PROGRESSING,
                True,
                Reason.UPDATING,
                f"pods replaced on the updated spec: {', '.join(updating)}",
            )
        elif all_ready:
            put(ConditionType.PROGRESSING, False, Reason.ALL_READY, "every pod is ready")
        else:
            put(ConditionType.PROGRESSING, True, Reason.PODS_PENDING, "pods starting")
    problems: list[tuple[str, str]] = []
    if exhausted:
        problems.append(
            (
                Reason.RESTART_BUDGET_EXHAUSTED,
                f"{', '.join(exhausted)}: restart budget spent; "
                "waiting for old restarts to age out",
            )
        )
    if backoff:
        problems.append((Reason.RESTART_BACKOFF, f"{', '.join(backoff)}: restart backing off"))
    if restarting:
        problems.append(
            (Reason.GROUP_RESTARTING, f"{', '.join(restarting)}: decode group restarting")
        )
    short = sum(len(c.prefill) for c in placed) < prefill_wanted
    if short and placed:
        problems.append((Reason.PREFILL_SHORT, "fewer prefill instances fit than wanted"))
    if quarantined:
        problems.append((Reason.TRAY_QUARANTINED, f"quarantined trays: {', '.join(quarantined)}"))
    if problems:
        put(ConditionType.DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems))
    else:
        put(ConditionType.DEGRADED, False, Reason.HEALTHY, "")
    status.ready = f"{len(ready_cells)}/{wanted}"
    status.prefill_ready = f"{prefill_ready}/{prefill_wanted}"


def _report_invalid(observed: Observed, invalid: Sequence[Event], decision: Decision) -> None:
    """Placed=False, InvalidSpec, on each deployment the controller cannot act on."""
    objects = {d.get("metadata", {}).get("name"): d for d in observed.deployments}
    now = rfc3339(observed.now)
    for event in invalid:
        obj = objects.get(event.deployment) or {}
        try:
            status = ModelDeploymentStatus.model_validate(obj.get("status") or {})
        except ValidationError:
            status = ModelDeploymentStatus()
        generation = int(obj.get("metadata", {}).get("generation", 0))
        changed = set_condition(
            status.conditions,
            Condition(
                type=ConditionType.PLACED,
                status="False",
                reason=Reason.INVALID_SPEC,
                message=event.message,
                last_transition_time=now,
                observed_generation=generation,
            ),
        )
        if changed or status.observed_generation != generation:
            status.observed_generation = generation
            decision.status[event.deployment] = status.model_dump(
                by_alias=True, exclude_none=True, exclude={"eplb", "balance"}
            )


def decide(observed: Observed, policy: RestartPolicy | None = None) -> Decision:
    """Everything one reconcile of ``observed.namespace`` should do."""
    policy = policy or RestartPolicy()
    decision = Decision()
    deployments, events = _deployments(observed)
    decision.events.extend(events)
    _report_invalid(observed, events, decision)
    live_cells = {_labels(pod).get(CELL_LABEL) for d in deployments for pod in d.pods.values()}
    if not deployments:
        return decision
    topology = _topology(observed, deployments)
    current = Plan(tuple(c for d in deployments for c in _current_cells(d, topology)))
    plan = plan_placement([d.model.shape() for d in deployments], topology, current)
    now = rfc3339(observed.now)
    failures: dict[str, tuple[int, str]] = {}
    planned = {cell.name for cell in plan.cells}
    kept = planned | live_cells  # cells whose Service and ComputeDomain stay
    for deployment in deployments:
        name = deployment.model.name
        spec = deployment.model.spec
        outcomes: dict[str, _CellOutcome] = {}
        cells: list[CellStatus] = []
        endpoints = Endpoints()
        for cell in plan.cells:
            if cell.deployment != name:
                continue
            if cell.name not in {c.name for c in current.cells}:
                decision.events.append(
                    Event(
                        name,
                        "Normal",
                        Reason.PLACED,
                        f"{cell.name} placed in NVLink domain {cell.domain}: decode on "
                        f"{', '.join(cell.decode_trays)}; {len(cell.prefill)} prefill instances; "
                        f"spare {', '.join(cell.spare_trays) or 'none'}",
                    )
                )
            outcome = _cell_actions(
                deployment,
                cell,
                cell.name in plan.restarted,
                topology,
                observed,
                policy,
                decision,
                failures,
            )
            outcomes[cell.name] = outcome
            cell_status, cell_endpoints = _cell_status(
                cell, deployment, outcome, spec.cell.decode.gpus_per_pod
            )
            cells.append(cell_status)
            endpoints.cells.append(cell_endpoints)
        for unplaced in plan.unplaced:
            if unplaced.deployment == name:
                decision.events.append(
                    Event(name, "Warning", Reason.INSUFFICIENT_CAPACITY, unplaced.message)
                )
        # Pods and services of cells that are no longer placed: nothing partial stays.
        for pod_name, pod in sorted(deployment.pods.items()):
            if _labels(pod).get(CELL_LABEL) not in planned and not _terminating(pod):
                decision.delete_pods.append(pod_name)
        decision.delete_services += [
            s["metadata"]["name"] for s in observed.services if _left_behind(s, name, kept)
        ]
        decision.delete_compute_domains += [
            d["metadata"]["name"]
            for d in observed.compute_domains or ()
            if _left_behind(d, name, kept)
        ]
        if spec.cell.prefill.instances is None:  # as many as fit
            prefill_wanted = sum(len(c.prefill) for c in plan.cells if c.deployment == name)
        else:
            prefill_wanted = spec.cell.prefill.instances * spec.cells
        status = deployment.status.model_copy(deep=True)
        status.cells = cells
        status.endpoints = endpoints
        status.decode_ranks = sum(c.decode.ready_ranks for c in cells)
        # Quarantined trays in this deployment's domains: the ones that cost it a spare.
        domains = {c.domain for c in plan.cells if c.deployment == name}
        quarantined = sorted(
            t.name for t in topology.trays if t.quarantined and t.domain in domains
        )
        _conditions(status, plan, deployment, outcomes, prefill_wanted, quarantined, now)
        status.observed_generation = deployment.generation
        if status != deployment.status:
            # eplb and balance belong to the EPLB service: a merge patch without them keeps them.
            decision.status[name] = status.model_dump(
                by_alias=True, exclude_none=True, exclude={"eplb", "balance"}
            )
    nodes = {node["metadata"]["name"]: node for node in observed.nodes}
    for tray, (count, culprit) in sorted(failures.items()):
        node = nodes.get(tray)
        if node is None:
            continue
        annotations = node["metadata"].get("annotations") or {}
        previous = annotations.get(TRAY_FAILURES_ANNOTATION, "0")
        total = (int(previous) if previous.isdigit() else 0) + count
        quarantine = None
        if total >= policy.quarantine_after and QUARANTINED_ANNOTATION not in annotations:
            quarantine = f"{total} Baton pod failures on this tray by {now}"
            decision.events.append(
                Event(culprit, "Warning", Reason.TRAY_QUARANTINED, f"{tray}: {quarantine}")
            )
        decision.trays.append(TrayMark(tray, total, quarantine))
    return decision
