"""``baton up``'s layout: the files its processes read, in either EPLB mode."""

from __future__ import annotations

from baton.up import layout_stack
from controller.placement import DeploymentShape, Plan, plan_placement
from controller.topology import synthetic_topology


def plan() -> Plan:  # one study cell on one rack
    return plan_placement([DeploymentShape(name="dsv4")], synthetic_topology(1))


def test_agent_mode_gives_every_decode_group_an_agent_the_service_drives() -> None:
    layout = layout_stack(plan(), time_scale=1.0)
    [group] = layout.cluster.decode_groups
    assert group.eplb_agent_port is not None and group.eplb_policy_plugin is None
    [service_group] = layout.eplb.groups
    assert service_group.agents == (f"127.0.0.1:{group.eplb_agent_port}",)
    assert layout.report_port is None


def test_plugin_mode_has_the_engines_rebalance_with_batons_plugin_and_report() -> None:
    layout = layout_stack(plan(), time_scale=1.0, eplb_mode="plugin")
    [group] = layout.cluster.decode_groups
    assert group.eplb_agent_port is None and group.eplb_policy_plugin == "baton"
    assert group.enable_eplb and group.eplb.num_redundant_experts == 32
    assert layout.eplb.groups == ()
    assert layout.report_port is not None
