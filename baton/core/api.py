"""The ModelDeployment resource (``baton.dev/v1alpha1``): the single source of its shape.

These pydantic models validate manifests (``baton place``, ``baton up``, the controller) and
generate the CRD in ``helm/baton/files/crds/`` (``baton crd``; a test fails when the checked-in CRD
drifts from them). Field names are the resource's camelCase; Python uses snake_case.

Condition types and reasons are constants here, so the controller, its tests and docs share them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from baton.core.eplb_report import Policy
from baton.core.labels import CLIQUE_LABEL, GPU_RESOURCE
from baton.core.model import DRAFT, SPECULATIVE_METHOD, SPECULATIVE_TOKENS, TARGET
from baton.core.vllm_eplb import VLLM_STEP_INTERVAL, VLLM_WINDOW_SIZE

__all__ = [
    "API_VERSION",
    "BATON_IMAGE",
    "GROUP",
    "KIND",
    "MODEL_DIR",
    "PLURAL",
    "RESERVED_VOLUMES",
    "VLLM_IMAGE",
    "CellEndpoints",
    "CellSpec",
    "CellStatus",
    "Condition",
    "ConditionType",
    "DecodeSpec",
    "Endpoints",
    "EngineSpec",
    "EplbModelSpec",
    "EplbSpec",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "ModelDeploymentStatus",
    "ModelSourceSpec",
    "PrefillSpec",
    "Reason",
    "ResourcesSpec",
    "RolloutSpec",
    "SpeculativeSpec",
    "Toleration",
    "TopologySpec",
    "Volume",
    "VolumeMount",
    "decode_trays_problem",
    "parse_prefill_record",
    "prefill_record",
]

# Final, so the type checker holds these to the Literal fields of ModelDeployment below.
API_VERSION: Final = "baton.dev/v1alpha1"
GROUP, VERSION = API_VERSION.split("/")
KIND: Final = "ModelDeployment"
PLURAL = "modeldeployments"
# Baton's own image at this version (the chart's default): the EPLB plugin's init container.
BATON_IMAGE: Final = "ghcr.io/baton-dev/baton:0.1.0"
# vLLM's official OpenAI-server image of the version Baton is checked against (docs/vllm.md).
VLLM_IMAGE: Final = "vllm/vllm-openai:v0.33.0"
# Where the engine container mounts spec.modelSource's volume; vLLM serves the directory in it.
MODEL_DIR: Final = "/models"
# The engine pods' own volumes (controller/podspec.py): engine.volumes may not reuse the names.
RESERVED_VOLUMES: Final = frozenset(
    {"dshm", "model", "compile-cache", "baton-eplb-plugin", "baton-eplb-token"}
)
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Kubernetes' resource.Quantity and resource names, as the API server checks them.
_QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_RELATIVE_PATH = r"^([^/].*)?$"  # and no ".." segment: _climbs
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class ConditionType(StrEnum):
    PLACED = "Placed"
    READY = "Ready"
    DEGRADED = "Degraded"
    PROGRESSING = "Progressing"


class Reason(StrEnum):
    PLACED = "Placed"
    INVALID_SPEC = "InvalidSpec"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"
    GROUP_RESTARTING = "GroupRestarting"
    TRAY_QUARANTINED = "TrayQuarantined"
    PODS_PENDING = "PodsPending"
    PODS_UNSCHEDULABLE = "PodsUnschedulable"
    SCHEDULER_BEHIND = "SchedulerBehind"
    ENGINES_STARTING = "EnginesStarting"
    PREFILL_RESTARTING = "PrefillRestarting"
    PREFILL_MOVING = "PrefillMoving"
    PREFILL_REMOVED = "PrefillRemoved"
    SPARE_MOVING = "SpareMoving"
    CELL_REMOVED = "CellRemoved"
    GROUP_UPDATING = "GroupUpdating"
    GROUP_MOVING = "GroupMoving"
    TRAY_DEGRADED = "TrayDegraded"
    DECODE_GROUP_SLOW = "DecodeGroupSlow"
    PREFILL_UPDATING = "PrefillUpdating"
    CELL_DRAINING = "CellDraining"
    NO_REQUEST_SERVED = "NoRequestServed"
    ROLLING_UPDATE = "RollingUpdate"
    ROLLOUT_STUCK = "RolloutStuck"
    RESTART_BACKOFF = "RestartBackoff"
    RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
    PREFILL_SHORT = "PrefillShort"
    ALL_READY = "AllReady"
    HEALTHY = "Healthy"


class _Resource(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel)


def _admission(*rules: tuple[str, str]) -> ConfigDict:
    """The CRD's CEL rules (``x-kubernetes-validations``) for the rules a model's validator
    checks that a schema alone cannot: each (rule, CEL message expression) refuses at admission
    what the validator beside it refuses, with the same message. Written next to the validator
    they mirror; tests/k8s/test_admission.py holds the two to the same verdicts and messages."""
    return ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "messageExpression": message} for rule, message in rules
            ]
        }
    )


DEFAULT_GPUS_PER_TRAY: Final = 4  # an NVL72 tray


def decode_trays_problem(dep: int, gpus_per_pod: int) -> str | None:
    """Why a decode group of ``dep`` ranks cannot take whole trays of ``gpus_per_pod``, if so."""
    if dep % gpus_per_pod:
        return (
            f"dep ({dep}) must be a multiple of gpusPerPod ({gpus_per_pod}): each decode pod "
            "takes a whole tray"
        )
    return None


class DecodeSpec(_Resource):
    """One DEP decode group per cell; each pod takes a whole tray."""

    model_config = _admission(
        (
            "self.dep % self.gpusPerPod == 0",
            "'dep (%d) must be a multiple of gpusPerPod (%d): each decode pod takes a whole "
            "tray'.format([self.dep, self.gpusPerPod])",
        )
    )

    dep: int = Field(default=32, ge=1, le=1024, description="DP/EP ranks of the decode group")
    gpus_per_pod: int = Field(
        default=DEFAULT_GPUS_PER_TRAY, ge=1, le=8, description="GPUs (DP ranks) per pod"
    )
    spare_trays: int = Field(default=1, ge=0, le=8, description="trays kept for recovery")

    @model_validator(mode="after")
    def _whole_trays(self) -> DecodeSpec:
        problem = decode_trays_problem(self.dep, self.gpus_per_pod)
        if problem:
            raise ValueError(problem)
        return self


class PrefillSpec(_Resource):
    """DEP prefill instances per cell, on the cell's trays beside the decode group."""

    dep: int = Field(default=2, ge=1, le=8, description="DP/EP ranks of one prefill instance")
    instances: int | None = Field(
        default=None, ge=0, le=1024, description="prefill instances per cell; unset: as many as fit"
    )


class CellSpec(_Resource):
    """The shape of one cell: a decode group and its prefill instances in one NVLink domain."""

    decode: DecodeSpec = Field(default_factory=DecodeSpec)
    prefill: PrefillSpec = Field(default_factory=PrefillSpec)


class TopologySpec(_Resource):
    """How the cluster's nodes describe NVL72 trays."""

    domain_label: str = Field(
        default=CLIQUE_LABEL, min_length=1, description="node label naming the NVLink domain"
    )
    gpu_resource: str = Field(
        default=GPU_RESOURCE, min_length=1, description="extended resource naming a tray's GPUs"
    )
    gpus_per_tray: int = Field(
        default=DEFAULT_GPUS_PER_TRAY, ge=1, le=8, description="GPUs of one tray (node)"
    )
    exclusive_domain: bool = Field(
        default=True,
        description="each cell takes an NVLink domain alone; false: a cell may share one with "
        "cells of deployments that also set false, each on trays of its own (two IMEX "
        "ComputeDomains in one clique can fail at the fabric: NVIDIA/k8s-dra-driver-gpu#892)",
    )


def _climbs(path: str) -> bool:
    """Whether a relative path leaves its volume (a ".." segment)."""
    return ".." in path.split("/")


def _climbs_cel(field: str) -> str:
    """``_climbs`` in CEL, for ``self.<field>``."""
    path = f"self.{field}"
    return (
        f"!has({path}) || !({path} == '..' || {path}.startsWith('../') || "
        f"{path}.endsWith('/..') || {path}.contains('/../'))"
    )


class SecretKey(_Resource):
    """One key of a Secret in the deployment's namespace."""

    name: str = Field(pattern=_DNS_SUBDOMAIN, description="the Secret's name")
    key: str = Field(min_length=1, description="the key within the Secret")


class ConfigMapKey(_Resource):
    """One key of a ConfigMap in the deployment's namespace."""

    name: str = Field(pattern=_DNS_SUBDOMAIN, description="the ConfigMap's name")
    key: str = Field(min_length=1, description="the key within the ConfigMap")


class EnvSource(_Resource):
    """Where a variable's value comes from: a Secret's key or a ConfigMap's."""

    model_config = _admission(
        (
            "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "'valueFrom needs exactly one of secretKeyRef and configMapKeyRef'",
        )
    )

    secret_key_ref: SecretKey | None = Field(default=None, description="a Secret's key")
    config_map_key_ref: ConfigMapKey | None = Field(default=None, description="a ConfigMap's key")

    @model_validator(mode="after")
    def _one_source(self) -> EnvSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("valueFrom needs exactly one of secretKeyRef and configMapKeyRef")
        return self


class EnvVar(_Resource):
    """One environment variable of the engine container."""

    model_config = _admission(
        (
            "!(has(self.valueFrom) && has(self.value) && self.value != '')",
            "'env %s: give value or valueFrom, not both'.format([self.name])",
        )
    )

    name: str = Field(min_length=1, max_length=256, description="the variable's name")
    value: str = Field(default="", max_length=32_768, description="its value")
    value_from: EnvSource | None = Field(
        default=None,
        description="its value from a Secret or ConfigMap (a token stays out of the spec)",
    )

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value_from is not None and self.value:
            raise ValueError(f"env {self.name}: give value or valueFrom, not both")
        return self


class ResourcesSpec(_Resource):
    """What the engine container asks of its node besides GPUs (CPU, memory, hugepages,
    ephemeral storage, NICs), as a container's ``resources``; the GPUs are the controller's."""

    requests: dict[str, Annotated[str, Field(pattern=_QUANTITY)]] = Field(
        default_factory=dict, description="resource name -> quantity the scheduler reserves"
    )
    limits: dict[str, Annotated[str, Field(pattern=_QUANTITY)]] = Field(
        default_factory=dict, description="resource name -> quantity the container may use"
    )

    @model_validator(mode="after")
    def _names(self) -> ResourcesSpec:
        for section, values in (("requests", self.requests), ("limits", self.limits)):
            for name in values:
                if not _RESOURCE_NAME.match(name):
                    raise ValueError(
                        f"engine.resources.{section}: '{name}' is not a resource name (cpu, "
                        "memory, hugepages-2Mi, ephemeral-storage, or DOMAIN/NAME)"
                    )
        return self


class Toleration(_Resource):
    """A taint the engine pods tolerate, as a pod's ``tolerations`` entry; placement uses the
    trays whose taints are all tolerated."""

    model_config = ConfigDict(
        **_admission(
            (
                "!(self.operator == 'Exists' && has(self.value) && self.value != '')",
                "'a toleration with operator Exists takes no value'",
            )
        ),
        frozen=True,  # placement keys its work by a deployment's tolerations
    )

    key: str = Field(
        default="", max_length=317, description="the taint's key (empty: every key, with Exists)"
    )
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal or Exists")
    value: str = Field(default="", max_length=63, description="the taint's value (operator Equal)")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        default="", description="the taint's effect (empty: every effect)"
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="NoExecute: how long the pod stays once tainted"
    )

    @model_validator(mode="after")
    def _exists_takes_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        return self


class Volume(BaseModel):
    """A pod volume as Kubernetes defines it: a name and one source (persistentVolumeClaim,
    hostPath, configMap, ...), given to the engine pods as written."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )

    name: str = Field(pattern=_DNS_LABEL, max_length=63, description="the volume's name")

    @model_validator(mode="after")
    def _has_source(self) -> Volume:
        if not self.model_extra:
            raise ValueError(
                f"volume {self.name} has no source: add one, e.g. persistentVolumeClaim: "
                "{claimName: ...} or hostPath: {path: ...}"
            )
        return self


class VolumeMount(_Resource):
    """Where the engine container mounts one of ``engine.volumes``."""

    model_config = _admission(
        (
            _climbs_cel("subPath"),
            "'engine.volumeMounts: subPath %s leaves the volume'.format([self.subPath])",
        )
    )

    name: str = Field(pattern=_DNS_LABEL, description="the volume's name in engine.volumes")
    mount_path: str = Field(
        pattern=r"^/", max_length=1024, description="the absolute path in the container"
    )
    read_only: bool = Field(default=False, description="mount it read-only")
    sub_path: str = Field(
        default="",
        max_length=1024,
        pattern=_RELATIVE_PATH,
        description="a directory within the volume",
    )

    @model_validator(mode="after")
    def _within_volume(self) -> VolumeMount:
        if _climbs(self.sub_path):
            raise ValueError(f"engine.volumeMounts: subPath {self.sub_path} leaves the volume")
        return self


# The engine's program (its command's first word, less any directory) and its image's
# repository (the image less its tag), in CEL: as EngineSpec._image_runs_command reads them.
_PROGRAM = "(has(self.command) ? self.command[0] : 'vllm')"
_PROGRAM = f"{_PROGRAM}.substring({_PROGRAM}.lastIndexOf('/') + 1)"
_REPOSITORY = (
    "(self.image.lastIndexOf(':') >= 0 ? self.image.substring(0, self.image.lastIndexOf(':')) "
    ": self.image)"
)


class CompileCacheSpec(_Resource):
    """Where the engines keep what they compile at start (torch.compile's graphs, Inductor's
    and Triton's kernels), so that a restart loads it instead: a directory on each tray, or a
    claim every engine pod shares. On one H100, four engines kept it and were ready in 57 s
    instead of 82 s (docs/vllm.md, "Startup")."""

    model_config = _admission(
        (
            "has(self.hostPath) != has(self.pvc)",
            "'engine.compileCache: give hostPath or pvc, one of them'",
        ),
    )

    host_path: str | None = Field(
        default=None,
        pattern=r"^/",
        description="an absolute directory on each tray (created when missing): a restart on "
        "the same tray finds its kernels",
    )
    pvc: PvcModelSource | None = Field(
        default=None,
        description="a ReadWriteMany claim every engine pod of the deployment shares",
    )

    @property
    def volume(self) -> dict[str, object]:
        """The pod volume's source (a Kubernetes VolumeSource)."""
        if self.pvc is not None:
            return {"persistentVolumeClaim": {"claimName": self.pvc.claim_name}}
        return {"hostPath": {"path": self.host_path, "type": "DirectoryOrCreate"}}

    @model_validator(mode="after")
    def _one_source(self) -> CompileCacheSpec:
        if (self.host_path is None) == (self.pvc is None):
            raise ValueError("engine.compileCache: give hostPath or pvc, one of them")
        return self


class EngineSpec(_Resource):
    """What runs in the pods: vLLM in production, ``baton sim`` anywhere else."""

    model_config = _admission(
        (
            f"!({_PROGRAM} == 'baton' && {_REPOSITORY} == '{VLLM_IMAGE.rsplit(':', 1)[0]}')",
            "\"engine.command runs baton (%s) but engine.image is vLLM's (%s), which has no "
            f"baton: set engine.image to {BATON_IMAGE}\".format([self.command.join(' '), "
            "self.image])",
        ),
        (
            f"!({_PROGRAM} == 'vllm' && {_REPOSITORY} == '{BATON_IMAGE.rsplit(':', 1)[0]}')",
            "\"engine.command runs vllm but engine.image is Baton's (%s), which has no vLLM: set "
            f'engine.image to {VLLM_IMAGE}, or engine.command to [baton, sim]".format('
            "[self.image])",
        ),
    )

    command: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=lambda: ["vllm", "serve"],
        min_length=1,
        max_length=64,
        description="the engine's command before the model and Baton's flags "
        "([vllm, serve], or [baton, sim] for the simulator)",
    )
    image: str = Field(
        default=VLLM_IMAGE,
        min_length=1,
        max_length=512,
        description="the engine container's image (default: vLLM's official image of the "
        "version Baton is checked against)",
    )
    args: list[str] = Field(default_factory=list, description="extra engine flags")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=256,
        description="extra environment of the engine container",
    )
    api_key_secret: SecretKey | None = Field(
        default=None,
        description="the engines' API key (vLLM's VLLM_API_KEY): every /v1 call must carry it; "
        "give the gateway the same key (--engine-api-key-file)",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="CPU, memory, hugepages, ephemeral storage and other resources of each "
        "engine container (its GPUs are the controller's)",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="node labels every tray of the deployment must carry (placement uses only "
        "those trays)",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=64,
        description="taints the engine pods tolerate besides nvidia.com/gpu (placement uses "
        "trays whose taints are all tolerated)",
    )
    priority_class_name: str | None = Field(
        default=None, pattern=_DNS_SUBDOMAIN, description="the engine pods' PriorityClass"
    )
    volumes: list[Volume] = Field(
        default_factory=list, max_length=64, description="extra volumes of the engine pods"
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=64,
        description="where the engine container mounts engine.volumes",
    )
    compile_cache: CompileCacheSpec | None = Field(
        default=None,
        description="keep what vLLM compiles at start on a volume, for restarts (none: every "
        "start compiles again)",
    )

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> EngineSpec:
        names = [volume.name for volume in self.volumes]
        taken = sorted(
            {name for name in names if names.count(name) > 1} | set(names) & RESERVED_VOLUMES
        )
        if taken:
            raise ValueError(
                f"engine.volumes: {', '.join(taken)} named twice or taken by Baton's own "
                f"volumes ({', '.join(sorted(RESERVED_VOLUMES))}): rename it"
            )
        for mount in self.volume_mounts:
            if mount.name not in names:
                raise ValueError(
                    f"engine.volumeMounts: {mount.name} is not in engine.volumes: add the "
                    "volume or fix the name"
                )
        return self

    @model_validator(mode="after")
    def _image_runs_command(self) -> EngineSpec:
        # The two images Baton names each lack the other's program: a pod would crash-loop.
        program = self.command[0].rsplit("/", 1)[-1]
        repository = self.image.rsplit(":", 1)[0]
        if program == "baton" and repository == VLLM_IMAGE.rsplit(":", 1)[0]:
            raise ValueError(
                f"engine.command runs baton ({' '.join(self.command)}) but engine.image is "
                f"vLLM's ({self.image}), which has no baton: set engine.image to {BATON_IMAGE}"
            )
        if program == "vllm" and repository == BATON_IMAGE.rsplit(":", 1)[0]:
            raise ValueError(
                f"engine.command runs vllm but engine.image is Baton's ({self.image}), which has "
                f"no vLLM: set engine.image to {VLLM_IMAGE}, or engine.command to [baton, sim]"
            )
        return self


class SpeculativeSpec(_Resource):
    """Speculative decoding (vLLM's --speculative-config), on every engine of the deployment."""

    method: str = Field(
        default=SPECULATIVE_METHOD,
        pattern=r"^[a-z][a-z0-9_]*$",
        max_length=64,
        description="vLLM's speculative method (dspark: DeepSeek-V4.1-Flash's draft, as the "
        "study serves it; mtp, eagle3, ...)",
    )
    num_speculative_tokens: int = Field(
        default=SPECULATIVE_TOKENS, ge=1, le=16, description="draft tokens proposed a step"
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="the draft model, where vLLM does not find it with the target (a Hub id or "
        "a path under /models)",
    )


class RolloutSpec(_Resource):
    """How a changed spec reaches running cells: cell by cell, each out of the gateway's
    rotation while it restarts."""

    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="cells updating at once (never the last serving cell of several)",
    )
    max_surge: int = Field(
        default=1,
        ge=0,
        le=16,
        description="extra cells placed on free trays while a rollout replaces cells, each "
        "serving the new revision before an old cell drains (so a one-cell deployment never "
        "goes dark), drained and removed when the rollout ends; none where no domain is free",
    )
    min_ready_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description="how long an updated cell's pods must all have been ready before it counts "
        "as serving and the next cell drains (time for the gateway to admit its engines)",
    )
    served_request_seconds: int = Field(
        default=60,
        ge=0,
        le=3600,
        description="how long past minReadySeconds an updated cell may take to serve its first "
        "request (its decode engines' finished-request count) before the next cell drains "
        "anyway, as a deployment without traffic needs; 0: do not wait for one",
    )
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="how long a cell's in-flight requests may finish after it leaves the "
        "gateway's rotation, before its pods restart",
    )
    progress_deadline_seconds: int = Field(
        default=1800,
        ge=60,
        le=86_400,
        description="a cell whose updated pods are not all ready this long after its drain "
        "stops the rollout (Progressing=False, RolloutStuck)",
    )


class KVTransferSpec(_Resource):
    """The KV-cache handoff between prefill and decode (vLLM's --kv-transfer-config)."""

    connector: Literal["NixlConnector"] = Field(
        default="NixlConnector", description="vLLM's KV connector: NIXL pulls, decode side"
    )
    load_failure_policy: Literal["fail", "recompute"] = Field(
        default="fail",
        description="when a KV pull fails: fail the request, or recompute the prompt on decode",
    )


class EplbModelSpec(_Resource):
    """One model whose experts are balanced (the target, and the draft of MTP)."""

    name: str = Field(pattern=_DNS_LABEL, description="the model's name in metrics and status")
    experts: int = Field(ge=1, le=4096, description="its routed (logical) experts per layer")
    top_k: int = Field(ge=1, le=64, description="experts each token is routed to")


class EplbSpec(_Resource):
    """Expert-parallel load balancing of the decode groups."""

    model_config = _admission(
        (
            "self.windowSize <= self.stepInterval",
            "'windowSize (%d) must not exceed stepInterval (%d)'.format([self.windowSize, "
            "self.stepInterval])",
        ),
        (
            "!(self.enabled && self.mode == 'agent' && !has(self.tokenSecret))",
            '"mode agent needs tokenSecret: an EPLB agent without a token refuses every switch, '
            "so the service could never rebalance; give the Secret the service's --token-file "
            "holds (the chart's eplb.tokenSecret)\"",
        ),
        (
            "!(self.communicator in ['torch_nccl', 'pynccl'])",
            "\"communicator %s: vLLM's asynchronous EPLB (its default, which Baton's plugin "
            'needs) cannot use it; use torch_gloo, nixl or auto".format([self.communicator])',
        ),
    )

    enabled: bool = Field(default=True, description="rebalance the decode groups' experts")
    mode: Literal["plugin", "agent"] = Field(
        default="plugin",
        description="plugin: vLLM rebalances in-engine with Baton's algorithm (an init container "
        "delivers the plugin) and reports each window to the EPLB service; agent: the EPLB "
        "service decides and switches through an EPLB agent beside each engine (baton sim "
        "serves one; vLLM does not)",
    )
    step_interval: int = Field(
        default=VLLM_STEP_INTERVAL, ge=1, description="rebalance every this many decode steps"
    )
    window_size: int = Field(
        default=VLLM_WINDOW_SIZE, ge=1, description="from the expert load of this many last steps"
    )
    redundant_experts: int = Field(
        default=32, ge=0, le=1024, description="extra expert replicas over the group's GPUs"
    )
    communicator: Literal["auto", "torch_nccl", "torch_gloo", "nixl", "pynccl"] = Field(
        default="auto",
        description="vLLM's expert-weight transfer backend (auto: vLLM chooses)",
    )
    plugin_image: str = Field(
        default=BATON_IMAGE,
        min_length=1,
        description="the image whose init container installs the plugin (plugin mode)",
    )
    policy: Policy = Field(
        default="baton",
        description="who places the experts in plugin mode: baton (Baton's algorithm) or "
        "vllm_default (vLLM's own policy; the plugin only measures and reports each window, "
        "to set a group's balance and moves under it beside Baton's before switching)",
    )
    report_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
        description="the EPLB service's report endpoint, e.g. "
        "http://baton-eplb.baton-system.svc:9091 (plugin mode); unset: the engines rebalance "
        "with Baton's algorithm and report nothing",
    )
    token_secret: SecretKey | None = Field(
        default=None,
        description="bearer token between the engines and the EPLB service: the reports carry "
        "it (plugin mode), the agents require it (agent mode)",
    )
    models: list[EplbModelSpec] = Field(
        description="the balanced models (the engines' reports name a model by its experts)",
        default_factory=lambda: [
            EplbModelSpec(name=model.name, experts=model.experts, top_k=model.top_k)
            for model in (TARGET, DRAFT)
        ],
    )

    @model_validator(mode="after")
    def _window_fits(self) -> EplbSpec:
        if self.window_size > self.step_interval:
            raise ValueError(
                f"windowSize ({self.window_size}) must not exceed stepInterval "
                f"({self.step_interval})"
            )
        if self.enabled and self.mode == "agent" and self.token_secret is None:
            raise ValueError(
                "mode agent needs tokenSecret: an EPLB agent without a token refuses every "
                "switch, so the service could never rebalance; give the Secret the service's "
                "--token-file holds (the chart's eplb.tokenSecret)"
            )
        if self.communicator in ("torch_nccl", "pynccl"):
            raise ValueError(
                f"communicator {self.communicator}: vLLM's asynchronous EPLB (its default, which "
                "Baton's plugin needs) cannot use it; use torch_gloo, nixl or auto"
            )
        return self


class PvcModelSource(_Resource):
    """A PersistentVolumeClaim holding the weights (ReadOnlyMany, or on one tray's disk)."""

    claim_name: str = Field(pattern=_DNS_SUBDOMAIN, description="the claim's name")


class HostPathModelSource(_Resource):
    """A directory on every tray holding the weights (a node-local cache)."""

    path: str = Field(pattern=r"^/", description="the absolute path on the node")


class ImageModelSource(_Resource):
    """An OCI image holding the weights, mounted as an image volume (Kubernetes 1.33+)."""

    reference: str = Field(min_length=1, max_length=512, description="the image")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="when the kubelet pulls it"
    )


_SOURCES = ("pvc", "hostPath", "image")


class ModelSourceSpec(_Resource):
    """Where the engines find the weights: one volume (a claim, a node directory or an image)
    mounted read-only at /models, vLLM given ``/models/<path>``; or, with no volume, vLLM
    downloads ``spec.model`` from the Hugging Face Hub. ``tokenSecret`` gives HF_TOKEN either
    way (gated models, and tokenizer files vLLM may fetch)."""

    model_config = _admission(
        (
            " + ".join(f"(has(self.{source}) ? 1 : 0)" for source in _SOURCES) + " <= 1",
            f"'modelSource: give one of {', '.join(_SOURCES)}, not several'",
        ),
        (
            "!has(self.path) || self.path == '' || "
            + " || ".join(f"has(self.{source})" for source in _SOURCES),
            f"'modelSource.path names a directory in a volume: give one of {', '.join(_SOURCES)}'",
        ),
        (
            _climbs_cel("path"),
            "\"modelSource.path %s leaves the volume: drop the '..'\".format([self.path])",
        ),
    )

    pvc: PvcModelSource | None = Field(default=None, description="weights on a claim")
    host_path: HostPathModelSource | None = Field(
        default=None, description="weights in a directory of every tray"
    )
    image: ImageModelSource | None = Field(default=None, description="weights in an image")
    path: str = Field(
        default="",
        max_length=1024,
        pattern=_RELATIVE_PATH,
        description="the model's directory within the volume (empty: its root)",
    )
    token_secret: SecretKey | None = Field(
        default=None, description="a Secret's key holding a Hugging Face token (HF_TOKEN)"
    )

    @property
    def volume(self) -> dict[str, object] | None:
        """The pod volume's source (a Kubernetes VolumeSource), None for the Hub."""
        if self.pvc is not None:
            return {"persistentVolumeClaim": {"claimName": self.pvc.claim_name, "readOnly": True}}
        if self.host_path is not None:
            return {"hostPath": {"path": self.host_path.path, "type": "Directory"}}
        if self.image is not None:
            return {
                "image": {"reference": self.image.reference, "pullPolicy": self.image.pull_policy}
            }
        return None

    @model_validator(mode="after")
    def _one_volume(self) -> ModelSourceSpec:
        given = [self.pvc, self.host_path, self.image]
        if sum(source is not None for source in given) > 1:
            raise ValueError(f"modelSource: give one of {', '.join(_SOURCES)}, not several")
        if _climbs(self.path):
            raise ValueError(f"modelSource.path {self.path} leaves the volume: drop the '..'")
        if self.path and not any(source is not None for source in given):
            raise ValueError(
                f"modelSource.path names a directory in a volume: give one of {', '.join(_SOURCES)}"
            )
        return self


_DECODE_GPUS = (
    f"(has(self.cell) && has(self.cell.decode) ? self.cell.decode.gpusPerPod : "
    f"{DEFAULT_GPUS_PER_TRAY})"
)
_TRAY_GPUS = f"(has(self.topology) ? self.topology.gpusPerTray : {DEFAULT_GPUS_PER_TRAY})"
_GPU = f"(has(self.topology) ? self.topology.gpuResource : '{GPU_RESOURCE}')"
_EPLB_ON = "(has(self.eplb) && (!has(self.eplb.enabled) || self.eplb.enabled))"
_ENGINE_PROGRAM = "(has(self.engine) && has(self.engine.command) ? self.engine.command[0] : 'vllm')"
_ENGINE_PROGRAM = f"{_ENGINE_PROGRAM}.substring({_ENGINE_PROGRAM}.lastIndexOf('/') + 1)"


class ModelDeploymentSpec(_Resource):
    model_config = _admission(
        (
            f"{_DECODE_GPUS} == {_TRAY_GPUS}",
            "'cell.decode.gpusPerPod (%d) must equal topology.gpusPerTray (%d): a decode pod "
            f"takes a whole tray'.format([{_DECODE_GPUS}, {_TRAY_GPUS}])",
        ),
        (
            f"!(has(self.engine) && has(self.engine.resources) && "
            f"((has(self.engine.resources.requests) && {_GPU} in self.engine.resources.requests)"
            f" || (has(self.engine.resources.limits) && {_GPU} in self.engine.resources.limits)))",
            "'engine.resources names %s: the controller gives each pod the GPUs placement "
            f"chose; remove it'.format([{_GPU}])",
        ),
        (
            f"!({_EPLB_ON} && has(self.eplb.mode) && self.eplb.mode == 'agent' && "
            f"{_ENGINE_PROGRAM} == 'vllm')",
            "'eplb.mode agent needs an EPLB agent beside each engine, which baton sim serves "
            "and vLLM does not (vllm serve refuses --eplb-agent-port): use eplb.mode plugin "
            "with vLLM, or engine.command [baton, sim]'",
        ),
    )

    model: str = Field(
        min_length=1,
        description="the model vLLM serves: a Hugging Face Hub id, or the name clients use for "
        "the weights in modelSource's volume",
    )
    served_model_name: str | None = Field(
        default=None, description="the name clients use (default: model)"
    )
    model_source: ModelSourceSpec = Field(
        default_factory=ModelSourceSpec,
        description="where the weights are (default: the Hub, by model)",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    cells: int = Field(default=1, ge=0, le=10_000, description="cells wanted (one per domain)")
    cell: CellSpec = Field(default_factory=CellSpec)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    speculative: SpeculativeSpec | None = Field(
        default=None,
        description="speculative decoding; unset: none. The study's: {method: dspark, "
        "numSpeculativeTokens: 5}",
    )
    eplb: EplbSpec = Field(default_factory=EplbSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)

    @property
    def model_path(self) -> str:
        """What vLLM is given as its model: the mounted directory, or the Hub id."""
        if self.model_source.volume is None:
            return self.model
        path = self.model_source.path.strip("/")
        return f"{MODEL_DIR}/{path}" if path else MODEL_DIR

    @model_validator(mode="after")
    def _gpus_are_placed(self) -> ModelDeploymentSpec:
        resources = self.engine.resources
        gpu = self.topology.gpu_resource
        if gpu in resources.requests or gpu in resources.limits:
            raise ValueError(
                f"engine.resources names {gpu}: the controller gives each pod the GPUs placement "
                "chose; remove it"
            )
        return self

    @model_validator(mode="after")
    def _agents_need_the_simulator(self) -> ModelDeploymentSpec:
        program = self.engine.command[0].rsplit("/", 1)[-1]
        if self.eplb.enabled and self.eplb.mode == "agent" and program == "vllm":
            raise ValueError(
                "eplb.mode agent needs an EPLB agent beside each engine, which baton sim serves "
                "and vLLM does not (vllm serve refuses --eplb-agent-port): use eplb.mode plugin "
                "with vLLM, or engine.command [baton, sim]"
            )
        return self

    @model_validator(mode="after")
    def _decode_fills_trays(self) -> ModelDeploymentSpec:
        if self.cell.decode.gpus_per_pod != self.topology.gpus_per_tray:
            raise ValueError(
                f"cell.decode.gpusPerPod ({self.cell.decode.gpus_per_pod}) must equal "
                f"topology.gpusPerTray ({self.topology.gpus_per_tray}): a decode pod takes a "
                "whole tray"
            )
        return self


class Condition(_Resource):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339")
    observed_generation: int | None = Field(default=None, ge=0)


class DecodeStatus(_Resource):
    trays: list[str] = Field(
        default_factory=list,
        description="planned tray of each decode pod, in rank order (pod <cell>-decode-<i>)",
    )
    leader: str | None = None
    ready_ranks: int = Field(default=0, ge=0)


PREFILL_RECORD = r"^[0-9]+:[a-z0-9]([-a-z0-9.]*[a-z0-9])?:[0-9]+(,[0-9]+)*$"


def prefill_record(index: int, tray: str, gpus: Sequence[int]) -> str:
    """One prefill instance's line of the placement record: ``index:tray:gpu,gpu``."""
    return f"{index}:{tray}:{','.join(str(gpu) for gpu in gpus)}"


def parse_prefill_record(record: str) -> tuple[int, str, tuple[int, ...]]:
    """``prefill_record``'s inverse: (instance index, tray, GPU indices)."""
    index, tray, gpus = record.split(":")
    return int(index), tray, tuple(int(gpu) for gpu in gpus.split(","))


class CellStatus(_Resource):
    """Where one cell runs (the controller's placement record) and how it is doing.

    One line per pod or tray, so that ``kubectl describe`` stays short.
    """

    name: str
    domain: str
    decode: DecodeStatus = Field(default_factory=DecodeStatus)
    prefill: list[Annotated[str, Field(pattern=PREFILL_RECORD)]] = Field(
        default_factory=list,
        description="each prefill instance as index:tray:GPU indices (pod <cell>-prefill-<index>)",
    )
    spare_trays: list[str] = Field(default_factory=list)
    restarts: list[str] = Field(
        default_factory=list, description="RFC 3339 times of recent decode group restarts"
    )
    revision: str | None = Field(
        default=None, description="the revision the cell's decode group runs (its pods' label)"
    )
    draining_since: str | None = Field(
        default=None,
        description="RFC 3339: when the cell left the gateway's rotation for its update; unset "
        "once it runs the current revision and is ready",
    )
    surge: bool | None = Field(
        default=None,
        description="true: a rollout's surge cell (spec.rollout.maxSurge), drained and removed "
        "when the rollout ends",
    )


class CellEndpoints(_Resource):
    """What the gateway routes to and the EPLB service talks to in one cell (ready pods only).

    A decode URL serves the local DP ranks 0 .. gpusPerPod - 1 of its pod (hybrid LB).
    """

    name: str
    prefill: list[str] = Field(default_factory=list, description="prefill instance URLs")
    decode: list[str] = Field(default_factory=list, description="decode pod URLs, in rank order")
    eplb_agents: list[str] = Field(default_factory=list, description="host:port per decode pod")


class Endpoints(_Resource):
    cells: list[CellEndpoints] = Field(default_factory=list)


class EplbModelStatus(_Resource):
    balance: float | None = Field(default=None, ge=0, le=1)
    last_rebalance_step: int | None = Field(
        default=None, ge=0, description="engine step of the last switch (agent mode)"
    )
    last_rebalance_time: str | None = Field(
        default=None, description="when the engines last reported a rebalance (plugin mode)"
    )


class ModelDeploymentStatus(_Resource):
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)
    cells: list[CellStatus] = Field(default_factory=list)
    endpoints: Endpoints = Field(default_factory=Endpoints)
    eplb: dict[str, EplbModelStatus] = Field(default_factory=dict)
    # Printer columns read these summaries (kubectl cannot count lists).
    ready: str = Field(default="0/0", description="ready cells / wanted cells")
    placed_cells: int = Field(
        default=0, ge=0, description="cells placed on trays (the scale subresource's replicas)"
    )
    prefill_ready: str = Field(default="0/0", description="ready / desired prefill instances")
    decode_ranks: int = Field(default=0, ge=0, description="ready decode ranks")
    balance: str = Field(default="", description="EPLB balance of the target model")
    revision: str = Field(default="", description="the revision the spec makes")
    updated: str = Field(
        default="0/0", description="cells ready on the current revision / wanted cells"
    )


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")  # uid, labels, ...: whatever kubectl adds

    name: Annotated[str, Field(pattern=_DNS_LABEL, max_length=63)] | None = None
    namespace: str | None = None


class ModelDeployment(_Resource):
    api_version: Literal["baton.dev/v1alpha1"] = API_VERSION
    kind: Literal["ModelDeployment"] = KIND
    metadata: Metadata = Field(default_factory=Metadata)
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus | None = None

    @property
    def name(self) -> str:
        """The metadata name, or one derived from the model ("deepseek-ai/X-1.0" -> "x-1-0")."""
        if self.metadata.name is not None:
            return self.metadata.name
        name = re.sub(r"[^a-z0-9]+", "-", self.spec.model.rsplit("/", 1)[-1].lower())
        return name.strip("-") or "model"
