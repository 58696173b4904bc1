"""controller.decide: one reconcile's actions from observed objects, without an API server.

``World`` plays back each decision the way the API server, scheduler and kubelet would (pods
created gated, ungated pods bound to their planned tray and Ready), so a test can step the
controller through a whole story; tests/k8s runs the same stories on a real control plane.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from baton.core.api import parse_prefill_record
from baton.core.labels import (
    CELL_GATE,
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
    QUARANTINED_ANNOTATION,
    REVISION_LABEL,
    TRAY_FAILURES_ANNOTATION,
)
from controller.actions import Actions
from controller.decide import decide
from controller.observe import Observed, pods_to_ask
from controller.restarts import RestartPolicy
from controller.topology import synthetic_nodes

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NAMESPACE = "serving"


@dataclass
class World:
    nodes: list[dict[str, Any]]
    deployment: dict[str, Any]
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    now: datetime = T0
    next_ip: int = 1
    # what the controller read of the engines' finished requests (None: it did not ask)
    served: dict[str, float] | None = None

    def observe(self) -> Observed:
        return Observed(
            NAMESPACE,
            [self.deployment],
            self.nodes,
            list(self.pods.values()),
            list(self.services.values()),
            self.now,
            served=self.served,
        )

    def step(self, policy: RestartPolicy | None = None) -> Actions:
        decision = decide(self.observe(), policy)
        for name in decision.delete_pods:
            self.pods.pop(name, None)
        for name in decision.delete_services:
            self.services.pop(name, None)
        for manifest in decision.create:
            target = self.services if manifest["kind"] == "Service" else self.pods
            made = copy.deepcopy(manifest)  # as the API server stamps it
            made["metadata"]["creationTimestamp"] = self.now.strftime("%Y-%m-%dT%H:%M:%SZ")
            target.setdefault(manifest["metadata"]["name"], made)
        nodes = {node["metadata"]["name"]: node for node in self.nodes}
        for name in decision.ungate:
            pod = self.pods[name]
            pod["spec"]["schedulingGates"] = []
            tray = pod["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0]
            if nodes[tray]["spec"].get("unschedulable"):  # kube-scheduler binds nothing there
                pod["status"] = {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/18 nodes are available: 1 node(s) were unschedulable.",
                        }
                    ],
                }
                continue
            pod["spec"]["nodeName"] = tray
            pod["status"] = {
                "phase": "Running",
                "podIP": f"127.64.0.{self.next_ip}",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "lastTransitionTime": self.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    }
                ],
            }
            self.next_ip += 1
        for mark in decision.trays:
            annotations = nodes[mark.node]["metadata"]["annotations"]
            annotations[TRAY_FAILURES_ANNOTATION] = ",".join(mark.failures)
            if mark.quarantine:
                annotations[QUARANTINED_ANNOTATION] = mark.quarantine
        if decision.status:
            self.deployment["status"] = decision.status["dsv4"]
        return decision

    def settle(self, steps: int = 5) -> None:
        for _ in range(steps):
            decision = self.step()
            if not (decision.create or decision.delete_pods or decision.ungate):
                return

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.deployment["status"]["conditions"] if c["type"] == kind)

    def fail(self, name: str, at: datetime | None = None) -> None:
        """The pod's engine exits (at ``at``, as the kubelet reports it, when given)."""
        status = self.pods[name]["status"]
        status["phase"] = "Failed"
        if at is not None:
            finished = at.strftime("%Y-%m-%dT%H:%M:%SZ")
            status["containerStatuses"] = [
                {"name": "engine", "state": {"terminated": {"exitCode": 1, "finishedAt": finished}}}
            ]

    def tray_of(self, pod: str) -> str:
        return str(self.pods[pod]["spec"]["nodeName"])

    def annotate(self, tray: str, key: str, value: str) -> None:
        node = next(n for n in self.nodes if n["metadata"]["name"] == tray)
        node["metadata"]["annotations"][key] = value

    def fail_tray(self, name: str) -> None:
        """The tray's kubelet stops reporting: its Ready condition goes False."""
        node = next(n for n in self.nodes if n["metadata"]["name"] == name)
        node["status"]["conditions"] = [{"type": "Ready", "status": "False"}]

    def cordon(self, name: str) -> None:
        """``kubectl cordon``: pods there keep running, new ones are not bound there."""
        node = next(n for n in self.nodes if n["metadata"]["name"] == name)
        node["spec"]["unschedulable"] = True

    def reasons(self, decision: Actions, reason: str) -> list[str]:
        return [e.message for e in decision.events if e.reason == reason]


def world(racks: int = 1, trays_per_rack: int = 18, **spec: Any) -> World:
    deployment = {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {
            "name": "dsv4",
            "namespace": NAMESPACE,
            "uid": "uid-1",
            "generation": 1,
            "creationTimestamp": "2026-11-29T11:00:00Z",
        },
        "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash", **spec},
    }
    return World(synthetic_nodes(racks, trays_per_rack=trays_per_rack), deployment)


def names(prefix: str, count: int) -> set[str]:
    return {f"dsv4-cell-0-{prefix}-{i}" for i in range(count)}


def test_first_reconcile_creates_the_whole_cell_gated_and_records_its_placement() -> None:
    w = world(cell={"prefill": {"instances": 4}})
    decision = w.step()
    kinds = [m["kind"] for m in decision.create]
    assert kinds == ["Service"] + ["Pod"] * 12
    assert all(m["spec"]["schedulingGates"] == [{"name": CELL_GATE}] for m in decision.create[1:])
    assert decision.ungate == ()  # not before every pod of the cell exists
    [cell] = w.deployment["status"]["cells"]
    assert len(cell["decode"]["trays"]) == 8 and len(cell["spareTrays"]) == 1
    assert w.condition("Placed")["status"] == "True"
    assert w.condition("Ready")["status"] == "False"
    assert [e.reason for e in decision.events] == ["Placed"]


def test_gates_of_the_cell_are_lifted_together_once_every_pod_exists() -> None:
    w = world(cell={"prefill": {"instances": 4}})
    w.step()
    decision = w.step()
    assert sorted(decision.ungate) == sorted(names("decode", 8) | names("prefill", 4))
    assert decision.create == ()
    w.step()
    status = w.deployment["status"]
    assert (status["ready"], status["prefillReady"], status["decodeRanks"]) == ("1/1", "4/4", 32)
    assert w.condition("Ready")["status"] == "True"
    assert len(status["endpoints"]["cells"][0]["decode"]) == 8


def test_a_noexecute_taint_restarts_the_group_only_where_it_is_not_tolerated() -> None:
    maintenance = {"key": "example.com/maintenance", "effect": "NoExecute"}
    tolerant = [{"key": "example.com/maintenance", "operator": "Exists"}]
    for engine, restarts in (({}, True), ({"tolerations": tolerant}, False)):
        w = world(cell={"prefill": {"instances": 2}}, engine=engine)
        w.settle()
        tray = w.tray_of("dsv4-cell-0-decode-3")
        node = next(n for n in w.nodes if n["metadata"]["name"] == tray)
        node["spec"]["taints"] = [*node["spec"].get("taints", []), maintenance]
        decision = w.step()
        assert (set(decision.delete_pods) >= names("decode", 8)) is restarts, engine


def test_a_failed_decode_pod_restarts_the_whole_group_and_counts_against_its_tray() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    prefill_before = {n: id(p) for n, p in w.pods.items() if "prefill" in n}
    tray = w.pods["dsv4-cell-0-decode-2"]["spec"]["nodeName"]
    w.fail("dsv4-cell-0-decode-2")
    decision = w.step()
    assert set(decision.delete_pods) == names("decode", 8)
    assert [e.reason for e in decision.events] == ["GroupRestarting"]
    assert [(m.node, m.failures, m.quarantine) for m in decision.trays] == [
        (tray, ("2026-11-29T12:00:00Z",), None)
    ]
    assert w.condition("Degraded")["reason"] == "GroupRestarting"
    w.settle()
    assert {n: id(p) for n, p in w.pods.items() if "prefill" in n} == prefill_before
    assert w.condition("Ready")["status"] == "True"
    assert len(w.deployment["status"]["cells"][0]["restarts"]) == 1


def test_a_second_restart_waits_out_its_backoff() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.fail("dsv4-cell-0-decode-0")
    w.settle()
    w.now += timedelta(seconds=1)
    w.fail("dsv4-cell-0-decode-1")
    decision = w.step()
    assert decision.delete_pods == ()
    assert decision.requeue_after is not None and 3.5 < decision.requeue_after <= 4.0
    assert w.condition("Degraded")["reason"] == "RestartBackoff"
    w.now += timedelta(seconds=5)
    assert set(w.step().delete_pods) == names("decode", 8)


def test_restart_backoff_doubles_and_the_budget_stops_restarts() -> None:
    policy = RestartPolicy(base=timedelta(seconds=5), budget=3)
    restarts = [T0, T0 + timedelta(seconds=10)]
    assert policy.wait([], T0) == timedelta(0)
    assert policy.wait(restarts[:1], T0 + timedelta(seconds=2)) == timedelta(seconds=3)
    assert policy.wait(restarts, T0 + timedelta(seconds=12)) == timedelta(seconds=8)
    assert policy.wait([*restarts, T0 + timedelta(seconds=30)], T0 + timedelta(hours=0.5)) is None


def test_a_tray_failing_repeatedly_is_quarantined_and_avoided() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    tray = w.tray_of("dsv4-cell-0-decode-0")
    earlier = "2026-11-28T15:00:00Z,2026-11-29T09:30:00Z"  # within the last 24 hours
    w.annotate(tray, TRAY_FAILURES_ANNOTATION, earlier)
    w.fail("dsv4-cell-0-decode-0")
    decision = w.step()
    [mark] = decision.trays
    assert mark.failures == (*earlier.split(","), "2026-11-29T12:00:00Z")
    assert (
        mark.quarantine
        == "3 Baton pod failures on this tray within 24h, the last at 2026-11-29T12:00:00Z"
    )
    assert "TrayQuarantined" in [e.reason for e in decision.events]
    w.settle()
    assert tray not in {p["spec"].get("nodeName") for p in w.pods.values()}
    assert w.condition("Degraded")["reason"] == "TrayQuarantined"


def test_a_deployment_serving_every_cell_while_degraded_is_not_shown_ready() -> None:
    # Seen on the dev cluster: kubectl get mdep showed 1/1 AllReady while Degraded was True
    # after a quarantine (the cell had used its spare), so nothing a user watches showed it.
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    tray = w.tray_of("dsv4-cell-0-decode-0")
    w.annotate(tray, QUARANTINED_ANNOTATION, "NVLink errors")
    w.settle()
    assert w.deployment["status"]["ready"] == "1/1"  # every cell serves
    ready = w.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TrayQuarantined")
    assert tray in ready["message"] and "1 of 1 cells serve" in ready["message"]
    assert w.condition("Progressing")["status"] == "False"
    # the tray back in service: Ready again
    node = next(n for n in w.nodes if n["metadata"]["name"] == tray)
    del node["metadata"]["annotations"][QUARANTINED_ANNOTATION]
    w.settle()
    assert (w.condition("Ready")["status"], w.condition("Ready")["reason"]) == ("True", "AllReady")


def test_scaling_prefill_down_deletes_only_the_highest_prefill_instances() -> None:
    w = world(cell={"prefill": {"instances": 4}})
    w.settle()
    w.deployment["spec"]["cell"]["prefill"]["instances"] = 1
    w.deployment["metadata"]["generation"] = 2
    decision = w.step()
    assert sorted(decision.delete_pods) == sorted(names("prefill", 4) - names("prefill", 1))
    assert decision.create == ()
    assert w.deployment["status"]["prefillReady"] == "1/1"


def test_too_little_capacity_creates_nothing_and_says_what_is_missing() -> None:
    w = world(trays_per_rack=8)
    decision = w.step()
    assert decision.create == ()
    placed = w.condition("Placed")
    assert (placed["status"], placed["reason"]) == ("False", "InsufficientCapacity")
    assert "whole trays" in placed["message"]
    assert [e.reason for e in decision.events] == ["InsufficientCapacity"]


def test_nothing_changes_once_the_cell_is_ready() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    decision = w.step()
    assert (decision.create, decision.delete_pods, decision.ungate, decision.status) == (
        (),
        (),
        (),
        {},
    )


def test_where_the_api_is_served_each_cell_gets_its_compute_domain_once() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    observed = w.observe()
    with_api = decide(replace(observed, compute_domains=[]))
    domains = [m for m in with_api.create if m["kind"] == "ComputeDomain"]
    assert [d["metadata"]["name"] for d in domains] == ["dsv4-cell-0-imex"]
    decode = [m for m in with_api.create if "decode" in m["metadata"]["name"]]
    assert all("resourceClaims" in m["spec"] for m in decode if m["kind"] == "Pod")
    existing = decide(replace(observed, compute_domains=domains))
    assert not [m for m in existing.create if m["kind"] == "ComputeDomain"]
    without_api = decide(observed)
    assert not [m for m in without_api.create if m["kind"] == "ComputeDomain"]


def test_each_prefill_tray_gets_one_shared_channel_claim_once_the_domain_has_a_uid() -> None:
    w = world(cell={"prefill": {"instances": 4}})
    observed = w.observe()
    first = decide(replace(observed, compute_domains=[]))
    assert not [m for m in first.create if m["kind"] == "ResourceClaim"]  # no UID to name yet
    [domain] = [m for m in first.create if m["kind"] == "ComputeDomain"]
    domain["metadata"]["uid"] = "cd-uid-1"
    second = decide(replace(observed, compute_domains=[domain]))
    claims = [m for m in second.create if m["kind"] == "ResourceClaim"]
    prefill_pods = [
        m for m in second.create if m["kind"] == "Pod" and "-prefill-" in m["metadata"]["name"]
    ]
    named = {p["spec"]["resourceClaims"][0]["resourceClaimName"] for p in prefill_pods}
    assert {c["metadata"]["name"] for c in claims} == named
    assert len(claims) == 2  # four DEP2 instances on two 4-GPU trays
    for claim in claims:
        parameters = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert parameters["domainID"] == "cd-uid-1"
    third = decide(replace(observed, compute_domains=[domain], resource_claims=claims))
    assert not [m for m in third.create if m["kind"] == "ResourceClaim"]
    assert third.delete_resource_claims == ()


def test_a_channel_claim_no_prefill_instance_needs_is_deleted() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    stale = {
        "metadata": {
            "name": "dsv4-cell-0-prefill-imex-gone-tray",
            "labels": {"baton.dev/deployment": "dsv4", "baton.dev/cell": "dsv4-cell-0"},
        }
    }
    other = {"metadata": {"name": "theirs", "labels": {"baton.dev/deployment": "other"}}}
    decision = decide(replace(w.observe(), compute_domains=[], resource_claims=[stale, other]))
    assert decision.delete_resource_claims == ("dsv4-cell-0-prefill-imex-gone-tray",)


def hashes(w: World, role: str) -> set[str]:
    return {
        p["metadata"]["annotations"]["baton.dev/pod-template-hash"]
        for n, p in w.pods.items()
        if f"-{role}-" in n
    }


def serving(w: World) -> dict[str, set[str | None]]:
    """Per cell in the gateway's endpoints, the revisions of the pods it lists."""
    by_ip = {p["status"]["podIP"]: p for p in w.pods.values() if p.get("status", {}).get("podIP")}
    out: dict[str, set[str | None]] = {}
    for cell in w.deployment["status"]["endpoints"]["cells"]:
        urls = cell["prefill"] + cell["decode"]
        if cell["decode"] and cell["prefill"]:
            pods = [by_ip[url.split("//")[1].split(":")[0]] for url in urls]
            out[cell["name"]] = {p["metadata"]["labels"].get(REVISION_LABEL) for p in pods}
    return out


def change_engine(w: World, args: list[str]) -> None:
    """A new engine spec, a minute after the cells got ready (past minReadySeconds)."""
    w.now += timedelta(seconds=60)
    w.deployment["spec"]["engine"] = {"args": args}
    w.deployment["metadata"]["generation"] += 1


def test_a_changed_spec_rolls_out_cell_by_cell_each_drained_before_it_restarts() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    assert set(serving(w)) == {"dsv4-cell-0", "dsv4-cell-1"}
    old = w.deployment["status"]["revision"]
    change_engine(w, ["--max-num-seqs", "512"])
    first = w.step()
    # cell-0 leaves the rotation first; nothing restarts until its drain is over
    assert w.reasons(first, "CellDraining") and not first.delete_pods
    assert set(serving(w)) == {"dsv4-cell-1"}
    assert w.condition("Progressing")["reason"] == "RollingUpdate"
    assert first.requeue_after == 30
    w.now += timedelta(seconds=10)
    assert not w.step().delete_pods
    w.now += timedelta(seconds=25)
    restart = w.step()
    assert {n for n in restart.delete_pods} == {
        *(f"dsv4-cell-0-decode-{i}" for i in range(8)),
        "dsv4-cell-0-prefill-0",
        "dsv4-cell-0-prefill-1",
    }
    assert w.reasons(restart, "GroupUpdating")
    w.settle()  # cell-0 back, on the new revision
    assert set(serving(w)) == {"dsv4-cell-0", "dsv4-cell-1"}
    # cell-1 drains only once cell-0's pods have been ready for minReadySeconds (10 s): the
    # gateway's time to admit its engines
    assert not w.reasons(w.step(), "CellDraining")
    w.now += timedelta(seconds=10)
    assert w.reasons(w.step(), "CellDraining")
    new = None
    for _ in range(30):
        w.step()
        cells = serving(w)
        # never without a serving cell, and never a cell pairing two revisions
        assert cells and all(len(revisions) == 1 for revisions in cells.values())
        new = w.deployment["status"]["revision"]
        if all(r == {new} for r in cells.values()) and len(cells) == 2:
            break
        w.now += timedelta(seconds=31)  # each drain waits out its 30 s
    assert new != old
    assert w.condition("Ready")["status"] == "True"
    assert w.deployment["status"]["updated"] == "2/2"
    assert [c["restarts"] for c in w.deployment["status"]["cells"]] == [[], []]  # not failures
    assert not any(c.get("drainingSince") for c in w.deployment["status"]["cells"])
    assert all("--max-num-seqs" in p["spec"]["containers"][0]["command"] for p in w.pods.values())


def _updated_first_cell(w: World) -> None:
    """Roll out a change until cell-0 runs it, ready past minReadySeconds."""
    change_engine(w, ["--max-num-seqs", "512"])
    w.step()  # cell-0 drains
    w.now += timedelta(seconds=31)
    w.step()  # and restarts
    w.settle()
    w.now += timedelta(seconds=10)


def test_a_cell_back_from_its_update_serves_a_request_before_the_next_cell_drains() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    w.served = {}  # the controller asks; no engine has finished a request yet
    _updated_first_cell(w)
    waiting = w.step()
    assert not w.reasons(waiting, "CellDraining")
    assert waiting.requeue_after == 2.0  # it asks the engines again soon
    assert "dsv4-cell-0" in serving(w)  # in the rotation, so that requests reach it
    w.served["dsv4-cell-0-decode-3"] = 1.0
    assert w.reasons(w.step(), "CellDraining")  # now cell-1's turn


def test_the_controller_asks_only_the_ready_decode_engines_of_cells_in_their_update() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    assert pods_to_ask([w.deployment], list(w.pods.values())) == []  # no cell updates
    change_engine(w, ["--max-num-seqs", "512"])
    w.step()  # cell-0 drains
    asked = pods_to_ask([w.deployment], list(w.pods.values()))
    assert [name for name, _ in asked] == [f"dsv4-cell-0-decode-{i}" for i in range(8)]
    assert all(ip == w.pods[name]["status"]["podIP"] for name, ip in asked)
    w.now += timedelta(seconds=31)
    w.step()  # its pods go, and come back gated: none ready to ask
    assert pods_to_ask([w.deployment], list(w.pods.values())) == []


@pytest.mark.parametrize(
    ("answers", "said_why"),
    [
        ({f"dsv4-cell-0-decode-{i}": 0.0 for i in range(8)}, "finished no request"),
        ({}, "none of its decode engines answered the controller"),  # unreachable /metrics
    ],
    ids=["no traffic", "no answer"],
)
def test_without_a_served_request_the_rollout_goes_on_after_served_request_seconds_saying_why(
    answers: dict[str, float], said_why: str
) -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    w.served = {}
    _updated_first_cell(w)
    w.served = dict(answers)
    assert not w.reasons(w.step(), "CellDraining")
    w.now += timedelta(seconds=60)  # servedRequestSeconds
    decision = w.step()
    [said] = w.reasons(decision, "NoRequestServed")
    assert "dsv4-cell-0" in said and "70 s" in said and said_why in said
    assert w.reasons(decision, "CellDraining")  # cell-1's turn, in the same reconcile


def test_a_cell_with_no_other_waiting_on_it_does_not_wait_for_a_served_request() -> None:
    # the only cell of a rollout (as a cell moved off a degraded tray): no next cell to protect
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.served = {}  # its engines would answer nothing
    change_engine(w, ["--max-num-seqs", "512"])
    w.step()
    w.now += timedelta(seconds=31)
    w.step()
    w.settle()
    w.now += timedelta(seconds=10)  # minReadySeconds, not servedRequestSeconds
    decision = w.step()
    assert not w.reasons(decision, "NoRequestServed")
    assert w.condition("Ready")["status"] == "True"
    assert not w.deployment["status"]["cells"][0].get("drainingSince")


def test_a_one_cell_deployment_updates_its_only_cell_after_the_drain() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    change_engine(w, ["--max-num-seqs", "512"])
    assert not w.step().delete_pods
    assert serving(w) == {}
    w.now += timedelta(seconds=31)
    assert set(w.step().delete_pods) >= names("decode", 8)
    w.settle()
    assert w.condition("Progressing")["reason"] == "RollingUpdate"  # ready, not yet 10 s
    w.now += timedelta(seconds=10)
    w.step()
    assert w.condition("Ready")["status"] == "True"
    assert w.deployment["status"]["updated"] == "1/1"


def test_with_a_free_domain_a_one_cell_deployment_rolls_out_through_a_surge_cell() -> None:
    w = world(racks=2, cell={"prefill": {"instances": 2}})
    w.settle()
    old = w.deployment["status"]["revision"]
    change_engine(w, ["--max-num-seqs", "512"])
    first = w.step()
    # a surge cell on the free rack, on the new revision; cell-0 keeps serving meanwhile
    [placed] = w.reasons(first, "Placed")
    assert "dsv4-cell-1 placed as the rollout's surge cell" in placed
    assert not first.delete_pods and not w.reasons(first, "CellDraining")
    assert set(serving(w)) == {"dsv4-cell-0"}
    w.settle()
    assert set(serving(w)) == {"dsv4-cell-0", "dsv4-cell-1"}
    assert not w.reasons(w.step(), "CellDraining")  # the surge cell serves 10 s first
    w.now += timedelta(seconds=10)
    assert w.reasons(w.step(), "CellDraining")  # now cell-0's turn
    new = w.deployment["status"]["revision"]
    assert serving(w) == {"dsv4-cell-1": {new}}
    assert w.deployment["status"]["cells"][1]["surge"] is True
    assert "surge cell dsv4-cell-1 serves it" in w.condition("Progressing")["message"]
    removed = None
    for _ in range(30):  # cell-0 drains, restarts, settles; then the surge cell drains, goes
        decision = w.step()
        cells = serving(w)
        assert cells and all(len(revisions) == 1 for revisions in cells.values())
        if w.reasons(decision, "CellRemoved"):
            removed = decision
            break
        w.now += timedelta(seconds=11)
    assert removed is not None
    assert "dsv4-cell-1 (the rollout's surge cell) removed" in w.reasons(removed, "CellRemoved")[0]
    assert set(removed.delete_pods) >= {f"dsv4-cell-1-decode-{i}" for i in range(8)}
    w.step()
    assert new != old and serving(w) == {"dsv4-cell-0": {new}}
    assert [c["name"] for c in w.deployment["status"]["cells"]] == ["dsv4-cell-0"]
    assert w.condition("Ready")["status"] == "True"
    assert w.deployment["status"]["updated"] == "1/1"


def test_a_surge_cell_whose_pods_never_serve_holds_the_rollout_and_the_old_cell_serves() -> None:
    w = world(racks=2, cell={"prefill": {"instances": 2}})
    w.settle()
    change_engine(w, ["--a-flag-the-engine-refuses"])
    for _ in range(5):
        decision = w.step()
        for name in decision.ungate:  # the new revision's engines never get ready
            w.pods[name]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        w.now += timedelta(seconds=31)
    assert set(serving(w)) == {"dsv4-cell-0"}
    assert not any(
        "--a-flag" in p["spec"]["containers"][0]["command"]
        for n, p in w.pods.items()
        if "cell-0" in n
    )
    assert "surge cell dsv4-cell-1 starting on it" in w.condition("Progressing")["message"]
    w.now += timedelta(seconds=1801)  # past progressDeadlineSeconds since it was created
    w.step()
    progressing = w.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutStuck")
    assert "surge cell dsv4-cell-1 (created" in progressing["message"]
    assert set(serving(w)) == {"dsv4-cell-0"}


def test_with_max_surge_zero_a_one_cell_deployment_updates_in_place() -> None:
    w = world(racks=2, cell={"prefill": {"instances": 2}}, rollout={"maxSurge": 0})
    w.settle()
    change_engine(w, ["--max-num-seqs", "512"])
    first = w.step()
    assert not w.reasons(first, "Placed") and w.reasons(first, "CellDraining")


def test_a_rollout_whose_new_pods_never_serve_stops_and_says_why() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}}, rollout={"drainSeconds": 0})
    w.settle()
    change_engine(w, ["--a-flag-the-engine-refuses"])
    w.step()  # cell-0 drained (no drain time) and restarted
    for _ in range(5):
        decision = w.step()
        for name in decision.ungate:  # its engines never get ready
            w.pods[name]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    w.now += timedelta(seconds=1801)
    w.step()
    progressing = w.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutStuck")
    assert "dsv4-cell-0" in progressing["message"]
    # the rollout stops there: cell-1 keeps serving its old revision
    assert set(serving(w)) == {"dsv4-cell-1"}
    assert all(
        "--a-flag" not in p["spec"]["containers"][0]["command"]
        for n, p in w.pods.items()
        if "cell-1" in n
    )


def test_a_failed_prefill_in_a_cell_awaiting_its_turn_is_kept_out_of_its_pairs() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    change_engine(w, ["--max-num-seqs", "512"])
    w.step()  # cell-0 drains; cell-1 waits, serving
    w.fail("dsv4-cell-1-prefill-0")
    w.step()
    w.step()  # recreated on the new revision and started
    [cell] = [c for c in w.deployment["status"]["endpoints"]["cells"] if c["name"] == "dsv4-cell-1"]
    assert len(cell["prefill"]) == 1  # the old-revision instance; the new one waits for its turn
    assert serving(w)["dsv4-cell-1"] == {w.deployment["status"]["cells"][1]["revision"]}


def test_pods_made_before_revision_labels_get_one_without_a_restart() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    for pod in w.pods.values():
        del pod["metadata"]["labels"][REVISION_LABEL]
    decision = w.step()
    assert not decision.delete_pods and not decision.create
    assert {name for name, _ in decision.relabel} == set(w.pods)
    assert {rev for _, rev in decision.relabel} == {w.deployment["status"]["revision"]}


def test_a_spec_the_api_server_accepts_but_baton_cannot_run_is_reported_not_placed() -> None:
    w = world(cell={"decode": {"dep": 30}})  # not a whole number of 4-GPU trays
    decision = w.step()
    assert decision.create == ()
    placed = w.condition("Placed")
    assert (placed["status"], placed["reason"]) == ("False", "InvalidSpec")
    assert "multiple of gpusPerPod" in placed["message"]
    assert w.step().status == {}  # reported once, not rewritten every reconcile


def test_a_refused_change_to_a_serving_deployment_is_not_shown_ready() -> None:
    # Seen on the dev cluster: kubectl get mdep showed 1/1 AllReady for a spec the controller
    # refused (an InvalidSpec event only), so kubectl wait --for=condition=Ready passed.
    w = world()
    w.settle()
    assert w.condition("Ready")["status"] == "True"
    w.deployment["spec"]["cell"] = {"decode": {"dep": 30}}  # not a whole number of trays
    w.deployment["metadata"]["generation"] = 2
    w.step()
    ready = w.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "multiple of gpusPerPod" in ready["message"]


def test_ready_column_and_condition_agree_while_a_prefill_engine_loads() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.pods["dsv4-cell-0-prefill-1"]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    w.step()
    ready = w.condition("Ready")
    assert (w.deployment["status"]["ready"], ready["status"]) == ("0/1", "False")
    assert ready["reason"] == "EnginesStarting"
    assert "dsv4-cell-0-prefill-1" in ready["message"]
    assert (w.condition("Progressing")["status"], w.condition("Progressing")["reason"]) == (
        "True",
        "EnginesStarting",
    )


def test_a_pod_the_scheduler_cannot_place_is_named_not_called_starting() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    pod = w.pods["dsv4-cell-0-decode-3"]
    del pod["spec"]["nodeName"]
    scheduler = "0/18 nodes are available: 1 node(s) were unschedulable."
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": scheduler,
            }
        ],
    }
    w.step()
    ready, progressing = w.condition("Ready"), w.condition("Progressing")
    assert (w.deployment["status"]["ready"], ready["reason"]) == ("0/1", "PodsUnschedulable")
    assert "dsv4-cell-0-decode-3" in ready["message"] and scheduler in ready["message"]
    assert (progressing["status"], progressing["reason"]) == ("False", "PodsUnschedulable")
    degraded = w.condition("Degraded")  # 28 of 32 ranks: the group serves nothing
    assert (degraded["status"], degraded["reason"]) == ("True", "PodsUnschedulable")
    assert "dsv4-cell-0-decode-3" in degraded["message"]


def test_pods_ungated_that_the_scheduler_still_holds_as_gated_are_named_with_the_fix() -> None:
    """Seen after an API server restart in the middle of a group restart: kube-scheduler
    missed the update that lifted the gates and never schedules the pods."""
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    for index in range(8):
        pod = w.pods[f"dsv4-cell-0-decode-{index}"]
        del pod["spec"]["nodeName"]
        pod["status"] = {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                }
            ],
        }
    w.step()
    ready, progressing = w.condition("Ready"), w.condition("Progressing")
    assert ready["reason"] == "SchedulerBehind" and progressing["reason"] == "SchedulerBehind"
    assert "8 pods" in ready["message"] and "restart kube-scheduler" in ready["message"]


def test_a_cell_that_cannot_be_placed_is_the_reason_not_pods_pending() -> None:
    w = world(cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    ready = w.condition("Ready")
    assert (w.deployment["status"]["ready"], ready["status"]) == ("1/2", "False")
    assert ready["reason"] == "InsufficientCapacity"
    assert ready["message"].startswith("1 of 2 cells placed; cell dsv4-cell-1 needs 9 whole trays")


def test_prefill_short_says_how_many_fit_and_why() -> None:
    w = world(trays_per_rack=11, cell={"prefill": {"instances": 4}})
    w.settle()
    assert w.condition("Ready")["status"] == "True"
    tray = w.pods["dsv4-cell-0-prefill-0"]["spec"]["nodeName"]
    w.fail_tray(tray)
    w.settle()
    ready, degraded = w.condition("Ready"), w.condition("Degraded")
    assert (ready["reason"], degraded["reason"]) == ("PrefillShort", "PrefillShort")
    assert w.deployment["status"]["prefillReady"] == "2/4"
    assert "dsv4-cell-0: 2 of 4 prefill instances fit" in ready["message"]
    assert f"1 tray not ready ({tray})" in ready["message"]


def test_prefill_moved_off_a_failed_tray_gets_an_event_naming_both_trays() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    tray = w.pods["dsv4-cell-0-prefill-0"]["spec"]["nodeName"]
    w.fail_tray(tray)
    decision = w.step()
    [moved, _] = w.reasons(decision, "PrefillMoving")
    _, target, _ = parse_prefill_record(w.deployment["status"]["cells"][0]["prefill"][0])
    assert moved == f"prefill dsv4-cell-0-prefill-0 moves from {tray} (not ready) to {target}"


def test_the_spare_moving_off_a_failed_tray_gets_an_event() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    [spare] = w.deployment["status"]["cells"][0]["spareTrays"]
    w.fail_tray(spare)
    decision = w.step()
    [new_spare] = w.deployment["status"]["cells"][0]["spareTrays"]
    assert w.reasons(decision, "SpareMoving") == [
        f"spare tray of dsv4-cell-0 moves from {spare} (not ready) to {new_spare}"
    ]


def test_scaling_cells_in_removes_the_last_cell_with_an_event() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    w.deployment["spec"]["cells"] = 1
    w.deployment["metadata"]["generation"] = 2
    decision = w.step()
    assert decision.delete_pods and all(n.startswith("dsv4-cell-1-") for n in decision.delete_pods)
    assert w.reasons(decision, "CellRemoved") == [
        "dsv4-cell-1 removed (spec.cells is 1): deleting its 10 pods"
    ]


def test_scaling_prefill_in_gets_an_event_naming_the_pods() -> None:
    w = world(cell={"prefill": {"instances": 3}})
    w.settle()
    w.deployment["spec"]["cell"]["prefill"]["instances"] = 1
    w.deployment["metadata"]["generation"] = 2
    decision = w.step()
    assert w.reasons(decision, "PrefillRemoved") == [
        "prefill dsv4-cell-0-prefill-1, dsv4-cell-0-prefill-2 removed (1 instance per cell wanted)"
    ]


def test_a_group_restarting_while_one_of_its_trays_is_cordoned_moves_that_rank_to_the_spare() -> (
    None
):
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    [spare] = w.deployment["status"]["cells"][0]["spareTrays"]
    cordoned = w.pods["dsv4-cell-0-decode-5"]["spec"]["nodeName"]
    w.cordon(cordoned)
    assert w.step().delete_pods == ()  # a cordoned tray keeps its running pods
    del w.pods["dsv4-cell-0-decode-2"]  # any restart of the group
    restart = w.step()
    assert set(restart.delete_pods) == names("decode", 8) - {"dsv4-cell-0-decode-2"}
    recreate = w.step()  # once the old pods are gone: rank 5 cannot come back to its tray
    [new_spare] = w.deployment["status"]["cells"][0]["spareTrays"]
    assert w.reasons(recreate, "SpareMoving") == [
        f"spare tray of dsv4-cell-0 moves from {spare} (now runs decode) to {new_spare}"
    ]
    w.settle()
    assert w.pods["dsv4-cell-0-decode-5"]["spec"]["nodeName"] == spare
    assert cordoned not in {p["spec"].get("nodeName") for p in w.pods.values()}
    assert w.condition("Ready")["status"] == "True"
    assert w.deployment["status"]["decodeRanks"] == 32


def test_a_cell_down_after_a_restart_is_degraded_until_its_group_serves_again() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.fail("dsv4-cell-0-decode-1")
    w.step()  # the restart: every decode pod deleted
    w.step()  # the group created again, gated until all of it exists
    degraded = w.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupRestarting")
    assert "dsv4-cell-0: decode group not serving since its restart" in degraded["message"]
    assert "0 of 32 ranks ready" in degraded["message"]
    w.settle()
    assert (w.condition("Ready")["status"], w.condition("Degraded")["status"]) == ("True", "False")


def test_a_group_brought_down_by_one_rank_blames_only_the_tray_whose_pod_ended_first() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.fail("dsv4-cell-0-decode-4", at=T0 - timedelta(seconds=30))
    for peer in ("dsv4-cell-0-decode-1", "dsv4-cell-0-decode-6"):  # lost their peer
        w.fail(peer, at=T0 - timedelta(seconds=20))
    culprit = w.tray_of("dsv4-cell-0-decode-4")
    decision = w.step()
    assert [(m.node, len(m.failures)) for m in decision.trays] == [(culprit, 1)]
    [restart] = w.reasons(decision, "GroupRestarting")
    assert f"counted against {culprit}, whose pod ended first" in restart


def test_pods_that_ended_together_blame_no_tray() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    for pod in ("dsv4-cell-0-decode-1", "dsv4-cell-0-decode-6"):
        w.fail(pod, at=T0 - timedelta(seconds=5))
    decision = w.step()
    assert set(decision.delete_pods) == names("decode", 8)
    assert decision.trays == ()
    [restart] = w.reasons(decision, "GroupRestarting")
    assert "no tray blamed: dsv4-cell-0-decode-1, dsv4-cell-0-decode-6 ended together" in restart


def test_tray_failures_older_than_a_day_are_forgotten() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    tray = w.tray_of("dsv4-cell-0-decode-0")
    w.annotate(tray, TRAY_FAILURES_ANNOTATION, "2026-11-27T08:00:00Z,2026-11-28T11:59:59Z")
    w.fail("dsv4-cell-0-decode-0")
    [mark] = w.step().trays
    assert (mark.failures, mark.quarantine) == (("2026-11-29T12:00:00Z",), None)


def test_a_count_that_is_not_a_list_of_times_is_read_as_no_recent_failure() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    tray = w.tray_of("dsv4-cell-0-decode-0")
    w.annotate(tray, TRAY_FAILURES_ANNOTATION, "7")  # an earlier Baton's bare count
    w.fail("dsv4-cell-0-decode-0")
    [mark] = w.step().trays
    assert (mark.failures, mark.quarantine) == (("2026-11-29T12:00:00Z",), None)


def mark_degraded(w: World, tray: str, since: datetime | None, slowdown: float | None) -> None:
    """The straggler watch's marks on ``tray`` (only the reason where an operator marks it)."""
    w.annotate(tray, DEGRADED_ANNOTATION, "GPU 1 runs at 70% of its decode group's median SM clock")
    if since is not None and slowdown is not None:
        w.annotate(tray, DEGRADED_SINCE_ANNOTATION, since.strftime("%Y-%m-%dT%H:%M:%SZ"))
        w.annotate(tray, DEGRADED_SLOWDOWN_ANNOTATION, f"{slowdown:.3f}")


def started(w: World, seconds_before_ready: float) -> None:
    """Each pod's kubelet start, ``seconds_before_ready`` before it became Ready."""
    for pod in w.pods.values():
        ready_at = pod["status"]["conditions"][0]["lastTransitionTime"]
        began = datetime.fromisoformat(ready_at) - timedelta(seconds=seconds_before_ready)
        pod["status"]["startTime"] = began.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_degraded_tray_keeps_its_group_until_the_move_pays_then_drains_it_onto_the_spare() -> (
    None
):
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.now += timedelta(seconds=10)  # serving for minReadySeconds
    started(w, 180.0)  # the group took 180 s to load: what a move costs
    [spare] = w.deployment["status"]["cells"][0]["spareTrays"]
    slow = w.tray_of("dsv4-cell-0-decode-5")
    mark_degraded(w, slow, w.now, 1.5)  # a third of the group's capacity lost while it stays
    waiting = w.step()
    assert not waiting.delete_pods and not w.reasons(waiting, "CellDraining")
    [why] = w.reasons(waiting, "TrayDegraded")
    # a 180 s restart is paid for after 540 s at 1.5 times as long a step
    pays_at = (w.now + timedelta(seconds=540)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f"moving pays at {pays_at}" in why
    assert 539 < (waiting.requeue_after or 0) <= 540  # the controller wakes for it
    assert w.condition("Degraded")["reason"] == "TrayDegraded"
    assert w.condition("Ready")["status"] == "False"
    assert set(serving(w)) == {"dsv4-cell-0"}  # still serving, slowly
    w.now += timedelta(seconds=541)
    drain = w.step()
    assert w.reasons(drain, "CellDraining") and not drain.delete_pods
    assert serving(w) == {}  # out of the gateway's rotation before anything restarts
    w.now += timedelta(seconds=31)
    move = w.step()
    assert set(move.delete_pods) == names("decode", 8)
    assert w.reasons(move, "GroupMoving")
    assert move.trays == ()  # a planned move: no failure counted against the tray
    w.settle()
    assert w.pods["dsv4-cell-0-decode-5"]["spec"]["nodeName"] == spare
    assert slow not in {p["spec"].get("nodeName") for p in w.pods.values()}
    w.now += timedelta(seconds=10)  # minReadySeconds
    w.step()
    assert w.condition("Ready")["status"] == "True"
    assert w.condition("Degraded")["status"] == "False"  # the group left the slow tray
    assert w.deployment["status"]["cells"][0]["restarts"] == []
    assert not w.deployment["status"]["cells"][0].get("drainingSince")


def test_a_tray_an_operator_marks_degraded_moves_its_group_on_its_turn() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    w.now += timedelta(seconds=10)  # serving for minReadySeconds
    slow = w.tray_of("dsv4-cell-0-decode-2")
    mark_degraded(w, slow, None, None)
    decision = w.step()
    assert w.reasons(decision, "CellDraining")
    assert w.reasons(decision, "TrayDegraded") == [
        f"dsv4-cell-0: {slow} marked degraded by hand (GPU 1 runs at 70% of its decode group's "
        "median SM clock)"
    ]
    w.now += timedelta(seconds=31)
    assert set(w.step().delete_pods) == names("decode", 8)


def test_cells_on_degraded_trays_move_one_at_a_time_and_never_the_last_serving() -> None:
    w = world(racks=2, cells=2, cell={"prefill": {"instances": 2}})
    w.settle()
    w.now += timedelta(seconds=10)
    for cell in ("dsv4-cell-0", "dsv4-cell-1"):
        mark_degraded(w, w.tray_of(f"{cell}-decode-0"), None, None)
    first = w.step()
    assert len(w.reasons(first, "CellDraining")) == 1
    assert set(serving(w)) == {"dsv4-cell-1"}
    moved: set[str] = set()
    for _ in range(30):
        w.now += timedelta(seconds=31)
        w.step()
        cells = w.deployment["status"]["cells"]
        assert serving(w)  # some cell serves at every step
        assert sum(1 for c in cells if c.get("drainingSince")) <= 1
        moved = {c["name"] for c in cells if not set(c["decode"]["trays"]) & degraded_trays(w)}
        if moved == {"dsv4-cell-0", "dsv4-cell-1"} and len(serving(w)) == 2:
            break
    assert moved == {"dsv4-cell-0", "dsv4-cell-1"}
    assert w.condition("Ready")["status"] == "True"


def degraded_trays(w: World) -> set[str]:
    return {
        n["metadata"]["name"]
        for n in w.nodes
        if DEGRADED_ANNOTATION in n["metadata"].get("annotations", {})
    }


def test_a_mark_cleared_before_the_move_pays_leaves_the_group_where_it_is() -> None:
    w = world(cell={"prefill": {"instances": 2}})
    w.settle()
    slow = w.tray_of("dsv4-cell-0-decode-5")
    mark_degraded(w, slow, w.now, 1.1)
    w.step()
    assert w.condition("Degraded")["status"] == "True"
    node = next(n for n in w.nodes if n["metadata"]["name"] == slow)
    del node["metadata"]["annotations"][DEGRADED_ANNOTATION]  # kubectl annotate ... degraded-
    w.now += timedelta(hours=2)
    decision = w.step()
    assert not decision.delete_pods and not w.reasons(decision, "CellDraining")
    assert w.condition("Degraded")["status"] == "False"
    assert w.tray_of("dsv4-cell-0-decode-5") == slow
