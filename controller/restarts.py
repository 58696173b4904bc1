"""When a decode group may restart again, and when a tray that keeps failing is quarantined.

A wide-EP decode group restarts as a whole; restarts back off exponentially and a budget per
window stops a crash loop from restarting forever. A failure counts against one tray: a prefill
pod's own, or for a decode group the tray that was lost or whose pod ended first (the other
ranks of a wide-EP group die with it, and are not to blame). A tray's failures are the times in
its annotation ``baton.dev/tray-failures`` (RFC 3339, comma-separated, oldest first); those
older than ``failure_window`` are forgotten, so a tray that failed once a week is never
quarantined. At ``quarantine_after`` failures within the window the tray is quarantined
(``baton.dev/quarantined``) and placement keeps off it. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from baton.core.api import Reason
from baton.core.labels import QUARANTINED_ANNOTATION, TRAY_FAILURES_ANNOTATION
from controller.actions import Event, TrayMark
from controller.observe import rfc3339

__all__ = ["RestartPolicy", "TrayFailure", "tray_marks"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How decode group restarts back off, and when a tray is quarantined.

    The ``n``-th restart within ``window`` waits ``base * 2**(n-2)`` (capped) after the previous
    one (the first is immediate); ``budget`` restarts within ``window`` stop further restarts.
    ``quarantine_after`` failures of one tray within ``failure_window`` quarantine it.
    """

    base: timedelta = timedelta(seconds=5)
    cap: timedelta = timedelta(minutes=5)
    window: timedelta = timedelta(hours=1)
    budget: int = 10
    quarantine_after: int = 3
    failure_window: timedelta = timedelta(hours=24)

    def wait(self, recent: Sequence[datetime], now: datetime) -> timedelta | None:
        """Time left before the next restart may start; None when the budget is spent."""
        if len(recent) >= self.budget:
            return None
        if not recent:
            return timedelta(0)
        delay: timedelta = min(self.base * 2 ** (len(recent) - 1), self.cap)
        return max(max(recent) + delay - now, timedelta(0))


@dataclass(frozen=True, slots=True)
class TrayFailure:
    """A Baton pod of ``deployment`` failed on ``tray``."""

    tray: str
    deployment: str


def recent_failures(annotation: str, policy: RestartPolicy, now: datetime) -> list[str]:
    """The failure times in a ``baton.dev/tray-failures`` value that are within the window.

    Anything else in it (a bare count written by an earlier Baton, a typo) is no failure."""
    recent = []
    for entry in annotation.split(","):
        try:
            moment = datetime.fromisoformat(entry.strip().replace("Z", "+00:00"))
        except ValueError:
            continue
        if moment.tzinfo is not None and now - moment < policy.failure_window:
            recent.append(rfc3339(moment))
    return sorted(recent)


def tray_marks(
    failures: Sequence[TrayFailure],
    nodes: Sequence[Mapping[str, Any]],
    policy: RestartPolicy,
    now: datetime,
) -> tuple[list[TrayMark], list[Event]]:
    """The recent failures of the trays in ``failures``, with these added, and the quarantines
    they reach; the quarantine event goes to the deployment whose pod failed there last."""
    counts = Counter(failure.tray for failure in failures)
    culprits = {failure.tray: failure.deployment for failure in failures}
    by_name = {node["metadata"]["name"]: node for node in nodes}
    stamp = rfc3339(now)
    window = f"{policy.failure_window / timedelta(hours=1):g}h"
    marks: list[TrayMark] = []
    events: list[Event] = []
    for tray, count in sorted(counts.items()):
        node = by_name.get(tray)
        if node is None:
            continue
        annotations = node["metadata"].get("annotations") or {}
        previous = annotations.get(TRAY_FAILURES_ANNOTATION, "")
        recent = (*recent_failures(previous, policy, now), *[stamp] * count)
        quarantine = None
        if len(recent) >= policy.quarantine_after and QUARANTINED_ANNOTATION not in annotations:
            quarantine = (
                f"{len(recent)} Baton pod failures on this tray within {window}, the last at "
                f"{stamp}"
            )
            events.append(
                Event(culprits[tray], "Warning", Reason.TRAY_QUARANTINED, f"{tray}: {quarantine}")
            )
        marks.append(TrayMark(tray, recent, quarantine))
    return marks, events
