"""Every Kubernetes label, annotation, taint and resource name Baton reads or writes.

Names only: what a name means for placement is decided in ``controller/topology.py`` and
``controller/placement.py``. Names under ``baton.dev/`` are Baton's own; the others are set by
NVIDIA's GPU feature discovery and device plugin, or by Kubernetes itself.
"""

from __future__ import annotations

__all__ = [
    "CELL_GATE",
    "CELL_LABEL",
    "CLIQUE_LABEL",
    "CONTROLLER_COMPONENT",
    "DEGRADED_ANNOTATION",
    "DEGRADED_SINCE_ANNOTATION",
    "DEGRADED_SLOWDOWN_ANNOTATION",
    "DEPLOYMENT_LABEL",
    "GPUS_USED_BY_OTHERS_ANNOTATION",
    "GPU_COUNT_LABEL",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "GPU_TAINT_KEY",
    "HOSTNAME_LABEL",
    "MODELDEPLOYMENT_SERIES_LABEL",
    "NODE_ARCH_LABEL",
    "NODE_OS_LABEL",
    "QUARANTINED_ANNOTATION",
    "RANK_LABEL",
    "REVISION_LABEL",
    "ROLE_LABEL",
    "TEMPLATE_HASH_ANNOTATION",
    "TRAY_FAILURES_ANNOTATION",
]

# Node label: the NVLink domain of a tray, "<ClusterUUID>.<CliqueID>" (GPU feature discovery).
# The ClusterUUID names the physical rack; the CliqueID a Fabric Manager partition inside it.
CLIQUE_LABEL = "nvidia.com/gpu.clique"

# Node labels from GPU feature discovery, written on synthetic trays so they look real.
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# Node labels set by the kubelet; the OS and architecture ones are written on synthetic CPU
# nodes so they look real.
HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_ARCH_LABEL = "kubernetes.io/arch"
NODE_OS_LABEL = "kubernetes.io/os"

# Extended resource of the NVIDIA device plugin, in status.allocatable.
GPU_RESOURCE = "nvidia.com/gpu"

# Taint key GPU nodes commonly carry to keep non-GPU pods away; Baton's pods tolerate it.
GPU_TAINT_KEY = "nvidia.com/gpu"

# Node annotation: the tray is taken out of placement (any value but "false"); its value says why.
QUARANTINED_ANNOTATION = "baton.dev/quarantined"

# Node annotations: the tray holds back the decode group on it (a GPU slower than the group's
# others). Its value says why; Baton takes the tray out of placement and moves the group off it
# through a drained restart once the move pays. The controller's straggler watch writes all three;
# an operator may write the first alone (the group moves on its turn) and clears a tray by
# removing it. Since: RFC 3339; slowdown: how many times as long the group's steps take.
DEGRADED_ANNOTATION = "baton.dev/degraded"
DEGRADED_SINCE_ANNOTATION = "baton.dev/degraded-since"
DEGRADED_SLOWDOWN_ANNOTATION = "baton.dev/degraded-slowdown"

# Node annotation: how many times Baton pods failed on the tray; at a limit it is quarantined.
TRAY_FAILURES_ANNOTATION = "baton.dev/tray-failures"

# Node annotation: how many of the tray's GPUs pods Baton does not own hold (a whole number).
GPUS_USED_BY_OTHERS_ANNOTATION = "baton.dev/gpus-used-by-others"

# Pod labels Baton sets on every pod it owns.
DEPLOYMENT_LABEL = "baton.dev/deployment"
CELL_LABEL = "baton.dev/cell"
ROLE_LABEL = "baton.dev/role"  # "decode" or "prefill"
RANK_LABEL = "baton.dev/rank"  # decode: the pod's index in its group; prefill: the instance
# The deployment revision a pod was rendered from (a hash of the spec that makes its pods): the
# gateway's endpoints pair a cell's prefill and decode pods of one revision only.
REVISION_LABEL = "baton.dev/revision"

# Prometheus label on every series of a ModelDeployment's engines, gateway and EPLB service:
# "NAMESPACE/NAME" (the chart's monitors and `baton up` set it; the dashboards select by it).
MODELDEPLOYMENT_SERIES_LABEL = "modeldeployment"

# Pod annotation: a hash of what the controller rendered for the pod (its spec without the
# scheduling gate, and its labels); a pod whose hash differs from the current one is replaced.
TEMPLATE_HASH_ANNOTATION = "baton.dev/pod-template-hash"

# Pod scheduling gate: held until every pod of the cell exists, then lifted for the whole cell.
CELL_GATE = "baton.dev/cell"

# The controller's name on the Events it records (reportingComponent).
CONTROLLER_COMPONENT = "baton.dev/controller"
