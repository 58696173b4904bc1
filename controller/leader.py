"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

A candidate takes the Lease when nobody holds it or when its holder has not renewed it for
``lease_duration`` *as observed on this candidate's own clock* (the record's renewTime is
never compared with the local clock: clocks of two machines differ). The leader renews every
``retry_period``; when it cannot renew within ``renew_deadline`` it stops leading (the process
then exits, as controller-runtime's managers do, so no stale leader acts). On a clean stop the
leader releases the Lease, so a standby takes over within one retry period, not a lease
duration. Writes go through the API server's optimistic concurrency (resourceVersion): two
candidates never both win one round.

The kubernetes client's own ``leaderelection`` package is not used: its ``run`` cannot be
stopped, never releases the Lease and compares the holder's timestamps with the local clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

__all__ = ["LeaseElector"]

log = logging.getLogger("baton.controller.leader")


def _now() -> datetime:
    return datetime.now(UTC)


class LeaseElector:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration_s: int = 15,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
    ) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("need retry period < renew deadline < lease duration")
        self._leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._observed: tuple[str | None, str | None] = (None, None)  # (holder, renewTime)
        self._observed_at = 0.0  # monotonic time the record last changed
        self.is_leader = threading.Event()

    def run(
        self,
        stop: threading.Event,
        on_started: Callable[[], None],
        on_stopped: Callable[[], None],
    ) -> None:
        """Block until leading (then call ``on_started``), renew until ``stop`` or a missed
        deadline (then ``on_stopped``); release the Lease on a clean stop."""
        while not stop.is_set():
            if self._try_acquire_or_renew():
                break
            stop.wait(self.retry_period_s)
        if stop.is_set():
            return
        log.info("%s leads (lease %s/%s)", self.identity, self.namespace, self.name)
        self.is_leader.set()
        on_started()
        last_renew = time.monotonic()
        while not stop.wait(self.retry_period_s):
            if self._try_acquire_or_renew():
                last_renew = time.monotonic()
            elif time.monotonic() - last_renew > self.renew_deadline_s:
                log.error("%s could not renew the lease in time; stops leading", self.identity)
                break
        self.is_leader.clear()
        if stop.is_set():
            self._release()
        on_stopped()

    def _try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = self._leases.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("reading lease: %s", exc.reason)
                return False
            return self._create(now)
        except (Urllib3Error, OSError) as exc:
            log.warning("reading lease: %s", exc)
            return False
        spec = lease.spec
        assert spec is not None  # the API server always answers a spec ({} when nobody holds it)
        holder = spec.holder_identity or None
        renewed = spec.renew_time.isoformat() if spec.renew_time else None
        if (holder, renewed) != self._observed:
            self._observed, self._observed_at = (holder, renewed), time.monotonic()
        duration = spec.lease_duration_seconds or self.lease_duration_s
        held_by_other = (
            holder is not None
            and holder != self.identity
            and time.monotonic() - self._observed_at < duration
        )
        if held_by_other:
            return False
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = self.lease_duration_s
        spec.renew_time = now
        return self._write(
            "updating",
            lambda: self._leases.replace_namespaced_lease(self.name, self.namespace, lease),
        )

    def _create(self, now: datetime) -> bool:
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=self.lease_duration_s,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        return self._write(
            "creating", lambda: self._leases.create_namespaced_lease(self.namespace, lease)
        )

    @staticmethod
    def _write(what: str, call: Callable[[], object]) -> bool:
        """Whether the Lease write landed. A 409 (someone else wrote first) or an unreachable
        API server loses this round; the next period tries again."""
        try:
            call()
        except ApiException as exc:
            if exc.status != 409:
                log.warning("%s lease: %s", what, exc.reason)
            return False
        except (Urllib3Error, OSError) as exc:
            log.warning("%s lease: %s", what, exc)
            return False
        return True

    def _release(self) -> None:
        """Hand the Lease back so a standby need not wait out its duration."""
        try:
            lease = self._leases.read_namespaced_lease(self.name, self.namespace)
            spec = lease.spec
            assert spec is not None  # always answered, as in _try_acquire_or_renew
            if spec.holder_identity != self.identity:
                return
            spec.holder_identity = None
            spec.lease_duration_seconds = 1
            spec.renew_time = _now()
            self._leases.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("%s released the lease", self.identity)
        except (ApiException, Urllib3Error, OSError) as exc:
            log.warning("releasing lease: %s", exc)
