"""What one reconcile sees, read into facts: pods, deployments, trays and the current placement.

Input is :class:`Observed`: the namespace's ModelDeployment objects, every Node, every Pod of the
cluster and the namespace's Services, as the API returns them (JSON dicts), and the time. This
module reads them; it decides nothing and does no I/O.

The current placement is read back from the cluster: a live pod's tray is the truth; a cell's
``status.cells`` entry (the placement record written after every reconcile that changed it)
fills in what no live pod says (a deleted pod's tray, the spare trays, prefill GPU indices).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from baton.core.api import ModelDeployment, ModelDeploymentStatus, parse_prefill_record
from baton.core.files import describe_errors
from baton.core.labels import (
    CELL_GATE,
    CELL_LABEL,
    DEPLOYMENT_LABEL,
    HOSTNAME_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
)
from controller.names import decode_pod_name, prefill_pod_name
from controller.placement import CellPlacement, PrefillInstance, TraySelector
from controller.topology import Topology, parse_topology

__all__ = [
    "DeploymentView",
    "InvalidDeployment",
    "Manifest",
    "Observed",
    "cell_of",
    "current_cells",
    "deployments",
    "ended_at",
    "gated",
    "is_terminal",
    "labels",
    "left_behind",
    "outdated",
    "parse_time",
    "planned_tray",
    "ready",
    "recorded_status",
    "revision_of",
    "rfc3339",
    "started_at",
    "terminating",
    "topology",
    "tray_keeps_pods",
    "unbound_pods",
]

Manifest = dict[str, Any]
_TERMINAL = frozenset({"Succeeded", "Failed"})


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
    # The ResourceClaims Baton made in the namespace (prefill pods' IMEX channels).
    resource_claims: Sequence[Mapping[str, Any]] = ()
    # Requests each engine of ``pods_to_ask`` has finished (vLLM's request_success_total), by
    # pod name: a cell back from its update serves one before the rollout goes on. None: not
    # asked (no cell waits on it); a pod missing from it did not answer.
    served: Mapping[str, float] | None = None


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# --- one object ---------------------------------------------------------------------------------


def labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def cell_of(obj: Mapping[str, Any]) -> str | None:
    return labels(obj).get(CELL_LABEL)


def left_behind(obj: Mapping[str, Any], deployment: str, kept: set[str | None]) -> bool:
    """A per-cell object (Service, ComputeDomain) of ``deployment`` whose cell is in none of
    ``kept`` (neither planned nor still running pods)."""
    return labels(obj).get(DEPLOYMENT_LABEL) == deployment and cell_of(obj) not in kept


def revision_of(pod: Mapping[str, Any]) -> str | None:
    """The deployment revision a pod runs (None: made before pods carried one)."""
    return labels(pod).get(REVISION_LABEL)


def claims_of(pod: Mapping[str, Any]) -> set[str]:
    """The ResourceClaims a pod names (not those made for it from a template)."""
    return {
        claim["resourceClaimName"]
        for claim in pod.get("spec", {}).get("resourceClaims") or ()
        if claim.get("resourceClaimName")
    }


def planned_tray(pod: Mapping[str, Any]) -> str | None:
    """The node a pod runs on, or the one its required node affinity names."""
    spec = pod.get("spec", {})
    if spec.get("nodeName"):
        node: str = spec["nodeName"]
        return node
    required = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    for term in required.get("nodeSelectorTerms", []):
        for expression in term.get("matchExpressions", []):
            if expression.get("key") == HOSTNAME_LABEL and expression.get("values"):
                tray: str = expression["values"][0]
                return tray
    return None


def _gpus_requested(pod: Mapping[str, Any], resource: str) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        requests = container.get("resources", {}).get("requests") or {}
        value = str(requests.get(resource, "0"))
        total += int(value) if value.isdigit() else 0
    return total


def terminating(pod: Mapping[str, Any]) -> bool:
    return pod.get("metadata", {}).get("deletionTimestamp") is not None


def _phase(pod: Mapping[str, Any]) -> str:
    phase: str = pod.get("status", {}).get("phase", "Pending")
    return phase


def is_terminal(pod: Mapping[str, Any]) -> bool:
    """The pod ended (Succeeded or Failed): its containers will not run again."""
    return _phase(pod) in _TERMINAL


def ended_at(pod: Mapping[str, Any]) -> datetime | None:
    """When the pod's first container ended, as its kubelet reports it (whole seconds), else
    when it stopped being Ready; None when it says neither."""
    status = pod.get("status", {})
    ends = [
        parse_time(finished)
        for container in status.get("containerStatuses") or []
        if (finished := (container.get("state", {}).get("terminated") or {}).get("finishedAt"))
    ]
    if ends:
        return min(ends)
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") == "False":
            moved = condition.get("lastTransitionTime")
            return parse_time(moved) if moved else None
    return None


def gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == CELL_GATE for g in pod.get("spec", {}).get("schedulingGates") or [])


def ready(pod: Mapping[str, Any]) -> bool:
    if terminating(pod) or _phase(pod) != "Running":
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pods_to_ask(
    deployments: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """(name, pod IP) of each ready decode pod of a cell its status says is in its update:
    whose engines the controller asks how many requests they served."""
    updating = {
        (d["metadata"]["namespace"], cell.get("name"))
        for d in deployments
        for cell in (d.get("status") or {}).get("cells") or []
        if cell.get("drainingSince")
    }
    return [
        (pod["metadata"]["name"], pod["status"]["podIP"])
        for pod in pods
        if labels(pod).get(ROLE_LABEL) == "decode"
        and (pod["metadata"].get("namespace"), cell_of(pod)) in updating
        and ready(pod)
        and pod.get("status", {}).get("podIP")
    ]


def ready_since(pod: Mapping[str, Any]) -> datetime | None:
    """When a ready pod's Ready condition last turned True (None: not ready, or not said)."""
    if not ready(pod):
        return None
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("lastTransitionTime"):
            return parse_time(condition["lastTransitionTime"])
    return None


def started_at(pod: Mapping[str, Any]) -> datetime | None:
    """When the kubelet started the pod (``status.startTime``), if it did."""
    started = pod.get("status", {}).get("startTime")
    return parse_time(started) if started else None


def outdated(pod: Mapping[str, Any], wanted: Manifest) -> bool:
    """The pod was rendered from another spec than the current one."""
    have = (pod.get("metadata", {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)
    want: str = wanted["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    return have != want


def _owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    owners = pod.get("metadata", {}).get("ownerReferences") or []
    return any(owner.get("uid") == uid for owner in owners)


# --- the deployments ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """One valid deployment as this reconcile sees it."""

    model: ModelDeployment
    uid: str
    generation: int
    status: ModelDeploymentStatus
    pods: Mapping[str, Mapping[str, Any]]  # own pods by name

    @property
    def name(self) -> str:
        return self.model.name

    def cell_pods(self, cell: str) -> dict[str, Mapping[str, Any]]:
        return {name: pod for name, pod in self.pods.items() if cell_of(pod) == cell}


@dataclass(frozen=True, slots=True)
class InvalidDeployment:
    """A deployment whose spec only pydantic rejects (a rule the API server cannot express)."""

    name: str
    message: str


def deployments(observed: Observed) -> tuple[list[DeploymentView], list[InvalidDeployment]]:
    """Valid, not-deleting deployments, oldest first (they keep priority for capacity), and the
    ones the controller cannot act on."""
    found: list[tuple[str, str, DeploymentView]] = []
    invalid: list[InvalidDeployment] = []
    for obj in observed.deployments:
        meta = obj.get("metadata", {})
        if meta.get("deletionTimestamp"):
            continue
        try:
            model = ModelDeployment.model_validate(
                {key: obj[key] for key in ("apiVersion", "kind", "metadata", "spec") if key in obj}
            )
        except ValidationError as exc:
            # The API server refuses these at admission (the CRD's schema and CEL rules); this
            # catches objects stored before the CRD had a rule, or with its rules absent.
            invalid.append(InvalidDeployment(meta.get("name", "?"), describe_errors(exc)))
            continue
        uid = meta.get("uid", "")
        pods = {
            pod["metadata"]["name"]: pod
            for pod in observed.pods
            if pod.get("metadata", {}).get("namespace") == observed.namespace
            and labels(pod).get(DEPLOYMENT_LABEL) == model.name
            and _owned_by(pod, uid)
        }
        view = DeploymentView(
            model, uid, int(meta.get("generation", 0)), recorded_status(obj), pods
        )
        found.append((meta.get("creationTimestamp", ""), model.name, view))
    found.sort(key=lambda item: (item[0], item[1]))
    return [view for _, _, view in found], invalid


def recorded_status(obj: Mapping[str, Any]) -> ModelDeploymentStatus:
    """The status as written, or an empty one when its shape is an old record's (rebuilt from
    the pods)."""
    try:
        return ModelDeploymentStatus.model_validate(obj.get("status") or {})
    except ValidationError:
        return ModelDeploymentStatus()


def topology(observed: Observed, views: Sequence[DeploymentView]) -> Topology:
    """Trays, with the GPUs that pods other than these deployments' live pods hold."""
    spec = views[0].model.spec.topology
    own = {name for view in views for name in view.pods}
    held: dict[str, int] = defaultdict(int)
    for pod in observed.pods:
        meta = pod.get("metadata", {})
        if meta.get("namespace") == observed.namespace and meta.get("name") in own:
            continue
        if is_terminal(pod):
            continue
        tray = planned_tray(pod)
        if tray is not None:
            held[tray] += _gpus_requested(pod, spec.gpu_resource)
    return parse_topology(
        {"items": list(observed.nodes)},
        used_by_others=held,
        domain_label=spec.domain_label,
        gpu_resource=spec.gpu_resource,
    )


def current_cells(view: DeploymentView, trays: Topology) -> list[CellPlacement]:
    """Each recorded cell as it stands: live pods' trays over the placement record."""
    cells: list[CellPlacement] = []
    decode = view.model.spec.cell.decode
    decode_pods = decode.dep // decode.gpus_per_pod
    for record in view.status.cells:
        live = {n: p for n, p in view.cell_pods(record.name).items() if not terminating(p)}
        decode_trays: list[str] = []
        for index in range(decode_pods):
            pod = live.get(decode_pod_name(record.name, index))
            tray = planned_tray(pod) if pod else None
            if tray is None and index < len(record.decode.trays):
                tray = record.decode.trays[index]
            if tray is None:
                break
            decode_trays.append(tray)
        if len(decode_trays) != decode_pods:
            continue  # no full record: the cell is admitted afresh
        prefill = [PrefillInstance(*parse_prefill_record(line)) for line in record.prefill]
        cells.append(
            CellPlacement(
                name=record.name,
                deployment=view.name,
                domain=record.domain,
                decode_trays=tuple(decode_trays),
                prefill=tuple(prefill),
                spare_trays=tuple(t for t in record.spare_trays if trays.tray(t) is not None),
                max_prefill_instances=len(prefill),
            )
        )
    return cells


def unbound_pods(view: DeploymentView, cells: Sequence[CellPlacement]) -> set[str]:
    """The pods of ``cells`` that do not run on their tray: not created, on their way out,
    ended, or not yet bound by the scheduler. Each is created anew, or waits for a binding,
    so its tray must still accept new pods."""
    unbound: set[str] = set()
    for cell in cells:
        planned = [decode_pod_name(cell.name, rank) for rank in range(len(cell.decode_trays))]
        planned += [prefill_pod_name(cell.name, instance.index) for instance in cell.prefill]
        for name in planned:
            pod = view.pods.get(name)
            if (
                pod is None
                or terminating(pod)
                or is_terminal(pod)
                or not pod.get("spec", {}).get("nodeName")
            ):
                unbound.add(name)
    return unbound


def tray_keeps_pods(trays: Topology, pod: Mapping[str, Any], selector: TraySelector) -> bool:
    """The pod's tray still runs it, for a deployment of ``selector`` (its tolerations)."""
    name = planned_tray(pod)
    tray = trays.tray(name) if name is not None else None
    return tray is not None and selector.keeps(tray)
