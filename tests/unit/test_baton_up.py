"""``baton up``'s layout: the files its processes read, in each EPLB mode."""

from __future__ import annotations

from typing import Any

from baton.up import layout_stack, prometheus_targets, unsynced_groups
from controller.placement import DeploymentShape, Plan, plan_placement
from controller.topology import synthetic_topology


def plan() -> Plan:  # one study cell on one rack
    return plan_placement([DeploymentShape(name="dsv4")], synthetic_topology(1))


def test_agent_mode_gives_every_decode_group_an_agent_the_service_drives() -> None:
    layout = layout_stack(plan(), time_scale=1.0)
    [group] = layout.cluster.decode_groups
    assert group.eplb_agent_port is not None and group.eplb_policy_plugin is None
    assert layout.eplb is not None
    [service_group] = layout.eplb.groups
    assert service_group.agents == (f"127.0.0.1:{group.eplb_agent_port}",)
    assert layout.report_port is None


def test_plugin_mode_has_the_engines_rebalance_with_batons_plugin_and_report() -> None:
    layout = layout_stack(plan(), time_scale=1.0, eplb_mode="plugin")
    [group] = layout.cluster.decode_groups
    assert group.eplb_agent_port is None and group.eplb_policy_plugin == "baton"
    assert group.enable_eplb and group.eplb.num_redundant_experts == 32
    assert layout.eplb is not None and layout.eplb.groups == ()
    assert layout.report_port is not None


def test_vllm_mode_has_the_engines_rebalance_with_vllms_own_policy_and_no_service() -> None:
    layout = layout_stack(plan(), time_scale=1.0, eplb_mode="vllm", eplb_steps=400)
    [group] = layout.cluster.decode_groups
    assert group.eplb_agent_port is None and group.eplb_policy_plugin is None
    assert group.enable_eplb and group.eplb.num_redundant_experts == 32
    assert (group.eplb.window_size, group.eplb.step_interval) == (400, 400)
    assert layout.eplb is None and layout.report_port is None


def test_off_mode_runs_no_eplb_at_all() -> None:
    layout = layout_stack(plan(), time_scale=1.0, eplb_mode="off")
    [group] = layout.cluster.decode_groups
    assert not group.enable_eplb and group.eplb_agent_port is None
    assert layout.eplb is None
    groups = prometheus_targets(layout.pool, "http://127.0.0.1:8000", None, "dsv4")
    jobs = {g["labels"]["job"] for g in groups}
    assert jobs == {"baton-gateway", "baton-engines"}


def test_prometheus_targets_list_every_metrics_endpoint_with_the_engines_cell_and_role() -> None:
    layout = layout_stack(plan(), time_scale=1.0, fault_injection_token_file="/run/token")
    assert layout.cluster.fault_injection_token_file == "/run/token"
    groups = prometheus_targets(
        layout.pool,
        "http://127.0.0.1:8000",
        "http://127.0.0.1:9090/metrics",
        "dsv4",
        cluster=layout.cluster,
    )
    by_job: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        by_job.setdefault(group["labels"]["job"], []).append(group)
    assert by_job["baton-gateway"] == [
        {
            "targets": ["127.0.0.1:8000"],
            "labels": {"job": "baton-gateway", "modeldeployment": "default/dsv4"},
        }
    ]
    # every series of the stack says which ModelDeployment it serves, as the chart's monitors
    # label them; the trays' dcgm-exporters serve the node's GPUs, whoever runs there
    [exporters] = by_job.pop("dcgm-exporter")
    [decode] = layout.cluster.decode_groups
    assert decode.dcgm_port is not None and exporters == {
        "targets": [f"127.0.0.1:{decode.dcgm_port + s}" for s in range(decode.api_servers)],
        "labels": {"job": "dcgm-exporter"},
    }
    served = [g for jobs in by_job.values() for g in jobs]
    assert {g["labels"]["modeldeployment"] for g in served} == {"default/dsv4"}
    assert by_job["baton-eplb"][0]["targets"] == ["127.0.0.1:9090"]
    [cell] = layout.pool.cells
    engines = {
        (g["labels"]["role"], g["labels"]["cell"]): g["targets"] for g in by_job["baton-engines"]
    }
    assert engines == {
        ("prefill", cell.name): [url.removeprefix("http://") for url in cell.prefill],
        ("decode", cell.name): [s.url.removeprefix("http://") for s in cell.decode],
    }


def test_a_group_is_unsynced_until_the_eplb_service_exports_it_synced() -> None:
    metrics = (
        "# HELP baton_eplb_group_synced 1 while the service follows every agent of a group\n"
        "# TYPE baton_eplb_group_synced gauge\n"
        'baton_eplb_group_synced{group="cell-0"} 1.0\n'
        'baton_eplb_group_synced{group="cell-1"} 0.0\n'
    )
    # cell-2: the service has no runner for it yet
    assert unsynced_groups(metrics, ["cell-0", "cell-1", "cell-2"]) == ["cell-1", "cell-2"]
    assert unsynced_groups(metrics, ["cell-0"]) == []
    assert unsynced_groups("", []) == []  # plugin mode: no groups to follow
