"""Every command line the controller renders, parsed by vLLM 0.33's own ``vllm serve`` parser,
and its JSON options built by vLLM's own config classes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from baton.core.api import ModelDeployment
from baton.core.labels import ROLE_LABEL
from baton.core.model import DRAFT, TARGET, MoEModel, draft_balanced_in_engine
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import render_cell
from controller.topology import synthetic_topology
from tests.vllm.conftest import Vllm

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
MTP = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']


def commands(role: str, **spec: Any) -> list[list[str]]:
    """The engine command of every ``role`` pod of one placed cell."""
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": MODEL, **spec}}
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    manifests = render_cell(
        deployment.spec, plan.cells[0], deployment="dsv4", uid="u-1", namespace="serving"
    )
    return [
        m["spec"]["containers"][0]["command"]
        for m in manifests
        if m["kind"] == "Pod" and m["metadata"]["labels"][ROLE_LABEL] == role
    ]


def serve(vllm: Vllm, command: list[str]) -> dict[str, Any]:
    assert command[:2] == ["vllm", "serve"]
    answer = vllm.ask("serve", argv=command[2:])
    assert answer["ok"], f"vLLM refuses {' '.join(command)}: {answer['error']}"
    args: dict[str, Any] = answer["args"]
    return args


@pytest.mark.parametrize(
    ("eplb", "args"),
    [(True, []), (True, MTP), (False, []), (False, MTP)],
    ids=["eplb", "eplb-and-mtp", "no-eplb", "mtp-alone"],
)
def test_every_decode_line_parses_as_the_wide_ep_rank_it_is_meant_to_be(
    vllm: Vllm, eplb: bool, args: list[str]
) -> None:
    lines = commands("decode", eplb={"enabled": eplb}, engine={"args": args})
    assert len(lines) == 8
    for index, command in enumerate(lines):
        parsed = serve(vllm, command)
        assert parsed["model"] == MODEL and parsed["served_model_name"] == [MODEL]
        assert (parsed["data_parallel_size"], parsed["data_parallel_size_local"]) == (32, 4)
        assert parsed["data_parallel_start_rank"] == 4 * index
        assert parsed["data_parallel_address"] == (
            "dsv4-cell-0-decode-0.dsv4-cell-0-decode.serving.svc"
        )
        assert parsed["data_parallel_hybrid_lb"] and parsed["enable_expert_parallel"]
        kv = parsed["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_role"], kv["kv_load_failure_policy"]) == (
            "NixlConnector",
            "kv_both",
            "fail",
        )
        assert parsed["enable_eplb"] is eplb
        if eplb:
            config = parsed["eplb_config"]
            assert (config["window_size"], config["step_interval"]) == (1000, 3000)
            assert config["num_redundant_experts"] == 32
        speculative = parsed["speculative_config"]
        assert speculative == (json.loads(MTP[1]) if args else None)


def test_a_mounted_model_is_served_from_its_directory_under_the_hub_name(vllm: Vllm) -> None:
    source = {"pvc": {"claimName": "weights"}, "path": "deepseek-ai/DeepSeek-V4.1-Flash"}
    for role in ("decode", "prefill"):
        for command in commands(role, modelSource=source):
            parsed = serve(vllm, command)
            assert parsed["model"] == "/models/deepseek-ai/DeepSeek-V4.1-Flash"
            assert parsed["served_model_name"] == [MODEL]


def test_every_prefill_line_parses_as_a_dep2_instance(vllm: Vllm) -> None:
    lines = commands("prefill", cell={"prefill": {"instances": 4}})
    assert len(lines) == 4
    for command in lines:
        parsed = serve(vllm, command)
        assert (parsed["data_parallel_size"], parsed["data_parallel_size_local"]) == (2, 2)
        assert parsed["enable_expert_parallel"] and not parsed["enable_eplb"]
        assert parsed["kv_transfer_config"]["kv_connector"] == "NixlConnector"
        # its KV events, published where the gateway reads them (rank r on port 5557 + r)
        events = parsed["kv_events_config"]
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        assert events["endpoint"] == "tcp://*:5557"


@pytest.mark.parametrize(
    ("kind", "eplb"),
    [
        ("eplb", {}),
        ("eplb", {"communicator": "nixl"}),
        ("eplb", {"communicator": "torch_gloo"}),
        ("kv_transfer", {}),
    ],
    ids=["eplb", "eplb-nixl", "eplb-torch-gloo", "kv_transfer"],
)
def test_the_json_options_build_vllms_own_config_classes(
    vllm: Vllm, kind: str, eplb: dict[str, str]
) -> None:
    flag = {"eplb": "--eplb-config", "kv_transfer": "--kv-transfer-config"}[kind]
    command = commands("decode", eplb=eplb)[0]
    value = json.loads(command[command.index(flag) + 1])
    answer = vllm.ask("config", kind=kind, value=value)
    assert answer["ok"], answer["error"]
    assert {key: answer["config"][key] for key in value} == value
    if kind == "eplb":  # asynchronous (vLLM's default), which the plugin's hook needs
        assert answer["config"]["use_async"] is True
        assert answer["config"]["communicator"] == eplb.get("communicator")


@pytest.mark.parametrize("communicator", ["torch_nccl", "pynccl"])
def test_the_communicators_baton_refuses_are_the_ones_vllms_async_eplb_refuses(
    vllm: Vllm, communicator: str
) -> None:
    answer = vllm.ask("config", kind="eplb", value={"communicator": communicator})
    assert not answer["ok"] and communicator in answer["error"]
    with pytest.raises(ValueError, match=communicator):
        commands("decode", eplb={"communicator": communicator})


def test_the_speculative_config_users_pass_has_vllms_fields_and_method(vllm: Vllm) -> None:
    assert vllm.ask("config", kind="speculative", value=json.loads(MTP[1]))["ok"]
    typo = vllm.ask("config", kind="speculative", value={"method": "mtp", "num_spec_tokens": 3})
    assert not typo["ok"] and "num_spec_tokens" in typo["error"]


def test_the_study_s_dspark_draft_is_rendered_on_both_sides_of_the_handoff(vllm: Vllm) -> None:
    for role in ("decode", "prefill"):
        for command in commands(role, speculative={}):
            config = serve(vllm, command)["speculative_config"]
            assert config == {"method": "dspark", "num_speculative_tokens": 5}
            assert vllm.ask("config", kind="speculative", value=config)["ok"]


@pytest.mark.parametrize(
    ("method", "model_type", "same_layout"),
    [
        ("dspark", "deepseek_v4", True),  # a DeepSeek-V4 DSpark draft shares the target's experts
        ("dspark", "deepseek_v41_dspark", False),  # V4.1's has 128 routed experts against 384
        ("mtp", "deepseek_v4", True),
        ("mtp", "deepseek_mtp", False),  # any other MoE draft is balanced whatever its layout
        ("eagle3", "llama", False),
    ],
)
def test_the_simulator_balances_a_draft_in_engine_exactly_when_vllm_does(
    vllm: Vllm, method: str, model_type: str, same_layout: bool
) -> None:
    draft = DRAFT if not same_layout else MoEModel("draft", 1, TARGET.experts, DRAFT.top_k)
    answer = vllm.ask("draft_eplb", method=method, model_type=model_type)
    assert answer["ok"]
    assert draft_balanced_in_engine(method, draft, TARGET) is answer["balanced"]


def test_a_misspelt_engine_flag_is_refused_by_vllms_parser(vllm: Vllm) -> None:
    command = commands("decode", engine={"args": ["--max-num-seqss", "64"]})[0]
    answer = vllm.ask("serve", argv=command[2:])
    assert not answer["ok"] and "--max-num-seqss" in answer["error"]


def test_a_bad_eplb_config_is_refused_by_vllms_config_class(vllm: Vllm) -> None:
    answer = vllm.ask("config", kind="eplb", value={"window_size": 0})
    assert not answer["ok"] and "window_size" in answer["error"]
