"""The names of everything the controller creates, and the way back from a name.

Names are deterministic, so the API server catches a duplicate create and a reconcile finds
its own objects by name alone: a deployment's cells, each cell's decode pods (one per tray of
the group, by rank order), prefill pods (by instance index), the decode group's headless
Service and the cell's IMEX ComputeDomain. Labels and annotations are ``baton.core.labels``'.
"""

from __future__ import annotations

__all__ = [
    "cell_name",
    "channel_template_name",
    "compute_domain_name",
    "decode_pod_name",
    "decode_service",
    "leader_host",
    "prefill_channel_claim_name",
    "prefill_index",
    "prefill_pod_name",
]


def cell_name(deployment: str, index: int) -> str:
    return f"{deployment}-cell-{index}"


def decode_pod_name(cell: str, index: int) -> str:
    """The decode pod on the cell's ``index``-th decode tray (ranks ``index * gpusPerPod ..``)."""
    return f"{cell}-decode-{index}"


def prefill_pod_name(cell: str, index: int) -> str:
    return f"{cell}-prefill-{index}"


def prefill_index(pod: str) -> int:
    """The instance index of a prefill pod's name (``prefill_pod_name``'s inverse)."""
    return int(pod.rsplit("-", 1)[1])


def decode_service(cell: str) -> str:
    """The decode group's headless Service: rank 0's pod is reached through it."""
    return f"{cell}-decode"


def leader_host(cell: str, namespace: str | None = None) -> str:
    """The DNS name of the decode group's leader (rank 0's pod), within the namespace when it is
    not given, fully qualified when it is."""
    host = f"{decode_pod_name(cell, 0)}.{decode_service(cell)}"
    return host if namespace is None else f"{host}.{namespace}.svc"


def compute_domain_name(cell: str) -> str:
    return f"{cell}-imex"


def channel_template_name(cell: str) -> str:
    """The ResourceClaimTemplate NVIDIA's ComputeDomain controller creates for the domain."""
    return f"{cell}-imex-channel"


def prefill_channel_claim_name(cell: str, tray: str) -> str:
    """The ResourceClaim the cell's prefill pods on ``tray`` share for its IMEX channel."""
    return f"{cell}-prefill-imex-{tray}"
