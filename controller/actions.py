"""What one reconcile decides to do: the output of ``controller.decide``, performed by the
reconciler. Data only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.observe import Manifest

__all__ = ["Actions", "Event", "EventType", "TrayMark"]

EventType = str  # "Normal" or "Warning", as Kubernetes Events have it


@dataclass(frozen=True, slots=True)
class Event:
    deployment: str
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class TrayMark:
    """Annotations to set on a tray: the times of its recent failures and, past the limit,
    quarantine."""

    node: str
    failures: tuple[str, ...]  # RFC 3339, oldest first
    quarantine: str | None = None


@dataclass(frozen=True, slots=True)
class Actions:
    create: tuple[Manifest, ...] = ()
    delete_pods: tuple[str, ...] = ()
    delete_services: tuple[str, ...] = ()
    delete_compute_domains: tuple[str, ...] = ()
    delete_resource_claims: tuple[str, ...] = ()
    ungate: tuple[str, ...] = ()
    relabel: tuple[tuple[str, str], ...] = ()  # (pod, revision): its revision label set
    trays: tuple[TrayMark, ...] = ()
    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # deployment -> new status
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None  # seconds; a backoff to wait out
