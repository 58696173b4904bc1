"""The pods of a placed cell, as Kubernetes manifests: pure rendering, no API calls.

Decode pod ``i`` of a cell runs ranks ``i*g .. i*g+g-1`` of the DEP group on its planned tray,
with vLLM's wide-EP command line as llm-d runs DeepSeek on GB200 (hybrid LB: one API server per
pod over its local ranks; rank 0's pod leads, reached through the cell's headless Service):

    <command> <model> --port 8000 --served-model-name S --data-parallel-size N
      --data-parallel-size-local g --data-parallel-start-rank i*g
      --data-parallel-address <cell>-decode-0.<cell>-decode.<namespace>.svc
      --data-parallel-rpc-port 5555 --data-parallel-hybrid-lb --enable-expert-parallel
      --kv-transfer-config {NixlConnector} [--enable-eplb --eplb-config {...}] <args>

When the cluster serves NVIDIA's ComputeDomain API, each cell gets one ComputeDomain (its IMEX
domain) and every pod of the cell joins it: the DEP32 group's all-to-all crosses trays over the
NVLink fabric, and so does the P->D KV handoff (NIXL over UCX cuda_ipc between trays), both of
which need IMEX on each side. NVIDIA's driver publishes one channel per node and allocates it to
one claim (k8s-dra-driver-gpu#309), so a decode pod (alone on its tray) claims it through the
domain's ResourceClaimTemplate, and the prefill pods of one tray share one ResourceClaim the
controller makes for that tray (``prefill_channel_claim``).

Prefill instances run their DEP2 line on their planned GPUs of a tray. Every pod is created
behind the ``baton.dev/cell`` scheduling gate with a required node affinity to its tray, carries
the deployment, cell, role and rank labels and an owner reference, asks for its GPUs, and learns
its NIXL side-channel host from its pod IP. The same pods run ``baton sim`` when
``engine.command`` says so: the simulator takes the same flags.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from baton.core.api import API_VERSION, KIND, MODEL_DIR, EnvVar, ModelDeploymentSpec
from baton.core.eplb_report import POLICY_ENV, REPORT_URL_ENV, TOKEN_ENV, WHERE_ENV
from baton.core.labels import (
    CELL_GATE,
    CELL_LABEL,
    DEPLOYMENT_LABEL,
    GPU_TAINT_KEY,
    HOSTNAME_LABEL,
    RANK_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
)
from controller.names import (
    channel_template_name,
    compute_domain_name,
    decode_pod_name,
    decode_service,
    leader_host,
    prefill_channel_claim_name,
    prefill_pod_name,
)
from controller.placement import CellPlacement

__all__ = [
    "API_PORT",
    "COMPILE_CACHE_DIR",
    "COMPILE_CACHE_ENV",
    "COMPUTE_DOMAIN_API",
    "DP_RPC_PORT",
    "EPLB_AGENT_PORT",
    "EPLB_TOKEN_DIR",
    "KV_EVENTS_PORT",
    "NIXL_PORT",
    "PLUGIN_DIR",
    "RESOURCE_CLAIM_API",
    "compute_domain",
    "decode_command",
    "prefill_channel_claim",
    "prefill_command",
    "render_cell",
    "revision",
]

API_PORT = 8000
NIXL_PORT = 5600
DP_RPC_PORT = 5555
EPLB_AGENT_PORT = 50100  # Baton's EPLB agent beside a decode engine (docs/eplb-protocol.md)
KV_EVENTS_PORT = 5557  # vLLM's default: a prefill DP rank r publishes its KV events on + r
_KV_EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}"},
    separators=(",", ":"),
)
Manifest = dict[str, Any]
COMPUTE_DOMAIN_API = ("resource.nvidia.com", "v1beta1", "computedomains")
RESOURCE_CLAIM_API = ("resource.k8s.io", "v1", "resourceclaims")
_CHANNEL_CLAIM = "imex-channel"
_SHM = "dshm"
_MODEL_VOLUME = "model"  # spec.modelSource's volume, at MODEL_DIR
_COMPILE_CACHE = "compile-cache"  # spec.engine.compileCache's volume, at COMPILE_CACHE_DIR
COMPILE_CACHE_DIR = "/var/cache/baton-compile"
# Each compile cache's directory in that volume: vLLM's own (torch.compile's graphs) keeps too
# little alone, Inductor's and Triton's kernels must be kept too (docs/vllm.md, "Startup").
COMPILE_CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}
PLUGIN_DIR = "/opt/baton/vllm-plugin"
_PLUGIN_VOLUME = "baton-eplb-plugin"
_EPLB_TOKEN_VOLUME = "baton-eplb-token"
EPLB_TOKEN_DIR = "/etc/baton/eplb-token"  # where a decode pod mounts spec.eplb.tokenSecret
# What the init container may use of the node: it copies a few hundred kB of Python.
_PLUGIN_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


def revision(spec: ModelDeploymentSpec) -> str:
    """The deployment revision: a hash of the spec that makes its pods, which the number of
    cells and the rollout's own settings do not change."""
    making = spec.model_dump(mode="json", exclude={"cells", "rollout"})
    rendered = json.dumps(making, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(rendered.encode()).hexdigest()[:10]


def _kv_transfer(spec: ModelDeploymentSpec) -> str:
    return json.dumps(
        {
            "kv_connector": spec.kv_transfer.connector,
            "kv_role": "kv_both",
            "kv_load_failure_policy": spec.kv_transfer.load_failure_policy,
        },
        separators=(",", ":"),
    )


def _common_flags(spec: ModelDeploymentSpec) -> list[str]:
    # vLLM reports usage.prompt_tokens_details.cached_tokens only when asked: the gateway reads
    # the prefix-cache hit from the prefill answer, and clients read it from usage.
    flags = [
        "--port",
        str(API_PORT),
        "--served-model-name",
        spec.served_model_name or spec.model,
        "--enable-prompt-tokens-details",
    ]
    speculative = spec.speculative
    if speculative is not None:  # on both sides of the handoff: one KV layout, draft included
        config = speculative.model_dump(exclude_none=True)
        flags += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return flags


def _owner(deployment: str, uid: str) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": deployment,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def compute_domain(cell: str, *, deployment: str, uid: str, namespace: str) -> Manifest:
    """The cell's ComputeDomain: its IMEX domain, living as long as the cell."""
    group, version, _ = COMPUTE_DOMAIN_API
    return {
        "apiVersion": f"{group}/{version}",
        "kind": "ComputeDomain",
        "metadata": {
            "name": compute_domain_name(cell),
            "namespace": namespace,
            "labels": {DEPLOYMENT_LABEL: deployment, CELL_LABEL: cell},
            "ownerReferences": [_owner(deployment, uid)],
        },
        "spec": {
            "numNodes": 0,  # deprecated by the driver; IMEX daemons start as pods arrive
            "channel": {
                "resourceClaimTemplate": {"name": channel_template_name(cell)},
                "allocationMode": "Single",
            },
        },
    }


# What NVIDIA's ComputeDomain controller puts in the domain's ResourceClaimTemplate: the driver's
# channel device class and the domain's UID in the driver's channel config.
_CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
_CD_DRIVER = "compute-domain.nvidia.com"


def prefill_channel_claim(
    cell: str, tray: str, *, domain_uid: str, deployment: str, uid: str, namespace: str
) -> Manifest:
    """The IMEX channel claim the prefill pods of ``cell`` on ``tray`` share (the channel of
    the cell's ComputeDomain, whose UID is ``domain_uid``)."""
    return {
        "apiVersion": "/".join(RESOURCE_CLAIM_API[:2]),
        "kind": "ResourceClaim",
        "metadata": {
            "name": prefill_channel_claim_name(cell, tray),
            "namespace": namespace,
            "labels": {DEPLOYMENT_LABEL: deployment, CELL_LABEL: cell, ROLE_LABEL: "prefill"},
            "ownerReferences": [_owner(deployment, uid)],
        },
        "spec": {
            "devices": {
                "requests": [{"name": "channel", "exactly": {"deviceClassName": _CHANNEL_CLASS}}],
                "config": [
                    {
                        "requests": ["channel"],
                        "opaque": {
                            "driver": _CD_DRIVER,
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "ComputeDomainChannelConfig",
                                "domainID": domain_uid,
                                "allocationMode": "Single",
                            },
                        },
                    }
                ],
            }
        },
    }


def decode_command(spec: ModelDeploymentSpec, cell: str, index: int, namespace: str) -> list[str]:
    """The engine's command line for decode pod ``index`` of ``cell``."""
    decode = spec.cell.decode
    leader = leader_host(cell, namespace)
    command = [*spec.engine.command, spec.model_path, *_common_flags(spec)]
    # A group of one is a plain engine: vLLM reads a start rank with one local rank as external
    # load balancing, which it refuses for a single rank.
    if decode.dep > 1:
        command += [
            "--data-parallel-size",
            str(decode.dep),
            "--data-parallel-size-local",
            str(decode.gpus_per_pod),
            "--data-parallel-start-rank",
            str(index * decode.gpus_per_pod),
            "--data-parallel-address",
            leader,
            "--data-parallel-rpc-port",
            str(DP_RPC_PORT),
            "--data-parallel-hybrid-lb",
        ]
    command += ["--enable-expert-parallel", "--kv-transfer-config", _kv_transfer(spec)]
    eplb = spec.eplb
    if eplb.enabled:
        config: dict[str, int | str] = {
            "window_size": eplb.window_size,
            "step_interval": eplb.step_interval,
            "num_redundant_experts": eplb.redundant_experts,
        }
        if eplb.communicator != "auto":  # vLLM's own default otherwise
            config["communicator"] = eplb.communicator
        command += ["--enable-eplb", "--eplb-config", json.dumps(config, separators=(",", ":"))]
        if eplb.mode == "agent":
            command += ["--eplb-agent-port", str(EPLB_AGENT_PORT)]
            if eplb.token_secret is not None:
                command += ["--eplb-agent-token-file", f"{EPLB_TOKEN_DIR}/{eplb.token_secret.key}"]
    return [*command, *spec.engine.args]


def prefill_command(spec: ModelDeploymentSpec) -> list[str]:
    """The engine's command line for one DEP prefill instance: it publishes its KV events
    (DP rank r on :data:`KV_EVENTS_PORT` + r), from which the gateway knows what each rank
    holds."""
    dep = spec.cell.prefill.dep
    return [
        *spec.engine.command,
        spec.model_path,
        *_common_flags(spec),
        "--data-parallel-size",
        str(dep),
        "--data-parallel-size-local",
        str(dep),
        "--enable-expert-parallel",
        "--kv-transfer-config",
        _kv_transfer(spec),
        "--kv-events-config",
        _KV_EVENTS,
        *spec.engine.args,
    ]


def _pod(
    name: str,
    *,
    deployment: str,
    uid: str,
    namespace: str,
    cell: str,
    role: str,
    rank: int,
    tray: str,
    gpus: int,
    command: list[str],
    spec: ModelDeploymentSpec,
    gpu_resource: str,
    made_by: str,
) -> Manifest:
    env = [
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_PORT)},
    ]
    if spec.engine.compile_cache is not None:
        env += [
            {"name": name, "value": f"{COMPILE_CACHE_DIR}/{directory}"}
            for name, directory in COMPILE_CACHE_ENV.items()
        ]
    env += [_env_var(e) for e in spec.engine.env]
    # Secrets as env vars from their keys: a command line shows in `ps` and events.
    secret = spec.engine.api_key_secret
    if secret is not None:
        env.append(_from_secret("VLLM_API_KEY", secret.name, secret.key))
    token = spec.model_source.token_secret
    if token is not None:
        env.append(_from_secret("HF_TOKEN", token.name, token.key))
    engine = spec.engine
    volumes: list[Manifest] = [{"name": _SHM, "emptyDir": {"medium": "Memory"}}]
    mounts: list[Manifest] = [{"name": _SHM, "mountPath": "/dev/shm"}]
    source = spec.model_source.volume
    if source is not None:
        volumes.append({"name": _MODEL_VOLUME, **source})
        mounts.append({"name": _MODEL_VOLUME, "mountPath": MODEL_DIR, "readOnly": True})
    if engine.compile_cache is not None:
        volumes.append({"name": _COMPILE_CACHE, **engine.compile_cache.volume})
        mounts.append({"name": _COMPILE_CACHE, "mountPath": COMPILE_CACHE_DIR})
    volumes += [volume.model_dump(by_alias=True) for volume in engine.volumes]
    mounts += [
        mount.model_dump(by_alias=True, exclude_defaults=True) for mount in engine.volume_mounts
    ]
    pod_spec: Manifest = {
        "schedulingGates": [{"name": CELL_GATE}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": HOSTNAME_LABEL, "operator": "In", "values": [tray]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [
            {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            *(t.model_dump(by_alias=True, exclude_defaults=True) for t in engine.tolerations),
        ],
        "restartPolicy": "Never",  # a group restarts as a whole, by the controller
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        # vLLM's workers share tensors through /dev/shm, which a container gets 64 MiB of.
        "volumes": volumes,
        "containers": [
            {
                "name": "engine",
                "image": engine.image,
                "command": command,
                "env": env,
                "ports": [
                    {"name": "http", "containerPort": API_PORT},
                    {"name": "nixl", "containerPort": NIXL_PORT},
                    *(
                        [{"name": "kv-events", "containerPort": KV_EVENTS_PORT}]
                        if role == "prefill"
                        else []
                    ),
                ],
                "resources": {
                    "requests": {**engine.resources.requests, gpu_resource: str(gpus)},
                    "limits": {**engine.resources.limits, gpu_resource: str(gpus)},
                },
                "volumeMounts": mounts,
                # Loading the weights takes minutes: liveness counts only once /health
                # has answered (the startup probe allows 30 minutes).
                "startupProbe": _health_probe(period_s=10, failures=180),
                "livenessProbe": _health_probe(period_s=10, failures=6),
                "readinessProbe": _health_probe(period_s=5, failures=2),
                # All a GPU container can drop: the device plugin hands the GPUs in and
                # NVLink needs no capability. The vLLM image runs as root, so runAsNonRoot
                # would refuse to start it; the pod meets Pod Security's "baseline" level.
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
    }
    if engine.node_selector:
        pod_spec["nodeSelector"] = dict(engine.node_selector)
    if engine.priority_class_name is not None:
        pod_spec["priorityClassName"] = engine.priority_class_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                DEPLOYMENT_LABEL: deployment,
                CELL_LABEL: cell,
                ROLE_LABEL: role,
                RANK_LABEL: str(rank),
                REVISION_LABEL: made_by,
            },
            "ownerReferences": [_owner(deployment, uid)],
        },
        "spec": pod_spec,
    }


def _env_var(var: EnvVar) -> Manifest:
    source = var.value_from
    if source is None:
        return {"name": var.name, "value": var.value}
    ref = source.secret_key_ref or source.config_map_key_ref
    assert ref is not None  # EnvSource holds exactly one
    kind = "secretKeyRef" if source.secret_key_ref is not None else "configMapKeyRef"
    return {"name": var.name, "valueFrom": {kind: {"name": ref.name, "key": ref.key}}}


def _from_secret(name: str, secret: str, key: str) -> Manifest:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _with_eplb(
    pod: Manifest, spec: ModelDeploymentSpec, *, namespace: str, deployment: str, cell: str
) -> None:
    """Give a decode pod what its EPLB mode needs.

    Plugin mode: an init container from Baton's image installs the plugin into a volume on the
    engine's ``PYTHONPATH`` (vLLM finds it by its entry point; no custom vLLM image), and the
    engine's environment says where to report and for which group. Agent mode: the agent's
    token as a file (the agent's flags are on the command line).
    """
    eplb = spec.eplb
    if not eplb.enabled:
        return
    pod_spec = pod["spec"]
    engine = pod_spec["containers"][0]
    token = eplb.token_secret
    if eplb.mode == "agent":
        if token is not None:
            pod_spec["volumes"].append(
                {
                    "name": _EPLB_TOKEN_VOLUME,
                    "secret": {
                        "secretName": token.name,
                        "items": [{"key": token.key, "path": token.key}],
                    },
                }
            )
            engine["volumeMounts"].append(
                {"name": _EPLB_TOKEN_VOLUME, "mountPath": EPLB_TOKEN_DIR, "readOnly": True}
            )
        return
    pod_spec["volumes"].append({"name": _PLUGIN_VOLUME, "emptyDir": {}})
    pod_spec["initContainers"] = [
        {
            "name": "eplb-plugin",
            "image": eplb.plugin_image,
            "command": ["baton", "vllm-plugin", "install", PLUGIN_DIR],
            "volumeMounts": [{"name": _PLUGIN_VOLUME, "mountPath": PLUGIN_DIR}],
            "resources": _PLUGIN_RESOURCES,
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
        }
    ]
    engine["volumeMounts"].append(
        {"name": _PLUGIN_VOLUME, "mountPath": PLUGIN_DIR, "readOnly": True}
    )
    where = {"namespace": namespace, "deployment": deployment, "cell": cell}
    env: list[Manifest] = [
        {"name": "PYTHONPATH", "value": PLUGIN_DIR},
        *({"name": variable, "value": where[key]} for key, variable in WHERE_ENV.items()),
    ]
    if eplb.policy != "baton":  # rendered only then: a pod of the default keeps its hash
        env.append({"name": POLICY_ENV, "value": eplb.policy})
    if eplb.report_url is not None:
        env.append({"name": REPORT_URL_ENV, "value": eplb.report_url})
    if token is not None:
        env.append(
            {
                "name": TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    engine["env"].extend(env)


def _health_probe(*, period_s: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": "/health", "port": API_PORT},
        "periodSeconds": period_s,
        "failureThreshold": failures,
    }


def _stamp(pod: Manifest) -> Manifest:
    """Annotate ``pod`` with the hash of what was rendered for it (the gate aside)."""
    spec = {key: value for key, value in pod["spec"].items() if key != "schedulingGates"}
    # the revision label names the spec the hash covers; left out, pods made before it existed
    # keep their hash and run on
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k != REVISION_LABEL}
    rendered = json.dumps({"labels": labels, "spec": spec}, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(rendered.encode()).hexdigest()[:16]
    pod["metadata"].setdefault("annotations", {})[TEMPLATE_HASH_ANNOTATION] = digest
    return pod


def render_cell(
    spec: ModelDeploymentSpec,
    cell: CellPlacement,
    *,
    deployment: str,
    uid: str,
    namespace: str,
    compute_domain: bool = False,
) -> list[Manifest]:
    """The headless Service and every pod of ``cell``, in creation order; with
    ``compute_domain`` (the cluster serves the API), every pod claims the cell's IMEX channel
    (decode pods from the domain's template, prefill pods their tray's shared claim)."""
    gpu_resource = spec.topology.gpu_resource
    made_by = revision(spec)  # one hash for all of the cell's pods
    decode = spec.cell.decode
    service: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": decode_service(cell.name),
            "namespace": namespace,
            "labels": {DEPLOYMENT_LABEL: deployment, CELL_LABEL: cell.name},
            "ownerReferences": [_owner(deployment, uid)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {CELL_LABEL: cell.name, ROLE_LABEL: "decode"},
            "ports": [{"name": "dp-rpc", "port": DP_RPC_PORT}],
        },
    }
    manifests = [service]
    for index, tray in enumerate(cell.decode_trays):
        pod = _pod(
            decode_pod_name(cell.name, index),
            deployment=deployment,
            uid=uid,
            namespace=namespace,
            cell=cell.name,
            role="decode",
            rank=index,
            tray=tray,
            gpus=decode.gpus_per_pod,
            command=decode_command(spec, cell.name, index, namespace),
            spec=spec,
            gpu_resource=gpu_resource,
            made_by=made_by,
        )
        # hostname + subdomain give rank 0's pod the DNS name the others dial
        pod["spec"]["hostname"] = decode_pod_name(cell.name, index)
        pod["spec"]["subdomain"] = decode_service(cell.name)
        _with_eplb(pod, spec, namespace=namespace, deployment=deployment, cell=cell.name)
        if compute_domain:
            _claim_channel(pod, {"resourceClaimTemplateName": channel_template_name(cell.name)})
        manifests.append(_stamp(pod))
    for instance in cell.prefill:
        pod = _pod(
            prefill_pod_name(cell.name, instance.index),
            deployment=deployment,
            uid=uid,
            namespace=namespace,
            cell=cell.name,
            role="prefill",
            rank=instance.index,
            tray=instance.tray,
            gpus=len(instance.gpus),
            command=prefill_command(spec),
            spec=spec,
            gpu_resource=gpu_resource,
            made_by=made_by,
        )
        if compute_domain:
            claim = prefill_channel_claim_name(cell.name, instance.tray)
            _claim_channel(pod, {"resourceClaimName": claim})
        manifests.append(_stamp(pod))
    return manifests


def _claim_channel(pod: Manifest, source: Manifest) -> None:
    pod["spec"]["resourceClaims"] = [{"name": _CHANNEL_CLAIM, **source}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": _CHANNEL_CLAIM}]
