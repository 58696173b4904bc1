"""Pods of a placed cell: vLLM's wide-EP and DEP2 command lines, gates, affinity, ownership."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from baton.core.api import BATON_IMAGE, ModelDeployment, ModelDeploymentSpec
from baton.core.eplb_report import POLICY_ENV, REPORT_URL_ENV, TOKEN_ENV, WHERE_ENV
from baton.core.labels import CELL_GATE, CELL_LABEL, DEPLOYMENT_LABEL, RANK_LABEL, ROLE_LABEL
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import (
    COMPILE_CACHE_DIR,
    COMPILE_CACHE_ENV,
    PLUGIN_DIR,
    compute_domain,
    decode_command,
    render_cell,
)
from controller.topology import synthetic_topology
from sim.cli import build_parser, config_from_args, split_unknown_flags

ROOT = Path(__file__).resolve().parents[2]


def rendered(**spec: object) -> tuple[list[dict[str, Any]], ModelDeployment]:
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash", **spec}}
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    manifests = render_cell(
        deployment.spec, plan.cells[0], deployment="dsv4", uid="u-1", namespace="serving"
    )
    return manifests, deployment


def pods(manifests: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [
        m for m in manifests if m["kind"] == "Pod" and m["metadata"]["labels"][ROLE_LABEL] == role
    ]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_decode_pod_i_runs_its_four_ranks_of_the_dep32_group() -> None:
    manifests, _ = rendered()
    decode = pods(manifests, "decode")
    assert len(decode) == 8
    for index, pod in enumerate(decode):
        command = pod["spec"]["containers"][0]["command"]
        assert command[:3] == ["vllm", "serve", "deepseek-ai/DeepSeek-V4.1-Flash"]
        assert flag(command, "--data-parallel-size") == "32"
        assert flag(command, "--data-parallel-size-local") == "4"
        assert flag(command, "--data-parallel-start-rank") == str(4 * index)
        assert flag(command, "--data-parallel-address") == (
            "dsv4-cell-0-decode-0.dsv4-cell-0-decode.serving.svc"
        )
        assert {"--data-parallel-hybrid-lb", "--enable-expert-parallel"} <= set(command)
        assert json.loads(flag(command, "--kv-transfer-config"))["kv_connector"] == "NixlConnector"
        assert json.loads(flag(command, "--eplb-config")) == {
            "window_size": 1000,
            "step_interval": 3000,
            "num_redundant_experts": 32,
        }
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"] == {"nvidia.com/gpu": "4"}


def test_a_one_rank_decode_group_renders_no_data_parallel_flags() -> None:
    # vLLM takes a start rank with one local rank as external load balancing, which it refuses
    # for a group of one: "data_parallel_external_lb can only be set when data_parallel_size > 1"
    # (seen on a live engine, vLLM 0.32 CPU)
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": "m",
            "cell": {"decode": {"dep": 1, "gpusPerPod": 1, "spareTrays": 0}},
            "topology": {"gpusPerTray": 1},
        }
    )
    command = decode_command(spec, "m-cell-0", 0, "serving")
    assert not [arg for arg in command if arg.startswith("--data-parallel")]
    assert "--enable-expert-parallel" in command


def test_prefill_instances_run_dep2_with_two_gpus() -> None:
    manifests, _ = rendered(cell={"prefill": {"instances": 18}})
    prefill = pods(manifests, "prefill")
    assert len(prefill) == 18
    command = prefill[0]["spec"]["containers"][0]["command"]
    assert flag(command, "--data-parallel-size") == "2"
    assert "--data-parallel-hybrid-lb" not in command
    assert prefill[0]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}


def test_every_pod_is_gated_pinned_to_its_tray_labelled_and_owned() -> None:
    manifests, deployment = rendered()
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    trays = {f"dsv4-cell-0-decode-{i}": t for i, t in enumerate(plan.cells[0].decode_trays)}
    trays |= {f"dsv4-cell-0-prefill-{p.index}": p.tray for p in plan.cells[0].prefill}
    for pod in (m for m in manifests if m["kind"] == "Pod"):
        name = pod["metadata"]["name"]
        assert pod["spec"]["schedulingGates"] == [{"name": CELL_GATE}]
        term = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]
        assert term["matchExpressions"][0]["values"] == [trays[name]]
        labels = pod["metadata"]["labels"]
        assert labels[DEPLOYMENT_LABEL] == "dsv4" and labels[CELL_LABEL] == "dsv4-cell-0"
        assert labels[RANK_LABEL].isdigit()
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "ModelDeployment",
            "u-1",
            True,
        )
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )


def test_decode_pods_reach_rank_zero_through_the_cells_headless_service() -> None:
    manifests, _ = rendered()
    service = manifests[0]
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    leader = pods(manifests, "decode")[0]["spec"]
    assert (leader["hostname"], leader["subdomain"]) == (
        "dsv4-cell-0-decode-0",
        service["metadata"]["name"],
    )


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_the_same_pods_run_baton_sim_when_engine_command_says_so(role: str) -> None:
    manifests, _ = rendered(engine={"command": ["baton", "sim"], "image": "baton:dev"})
    command = pods(manifests, role)[1]["spec"]["containers"][0]["command"]
    assert command[:2] == ["baton", "sim"]
    parser = build_parser()
    kept, unknown = split_unknown_flags(parser, command[2:])
    assert unknown == []  # every flag the controller renders is one the simulator models
    config = config_from_args(parser.parse_args(kept))
    if role == "decode":
        assert list(config.local_ranks) == [4, 5, 6, 7] and config.hybrid_lb
        assert config.enable_eplb and config.eplb.num_redundant_experts == 32
    else:
        assert config.data_parallel_size == 2 and list(config.local_ranks) == [0, 1]
    assert config.kv_transfer.nixl


def test_with_compute_domains_every_pod_joins_the_cells_imex_domain() -> None:
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}}
    )
    cell = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1)).cells[0]
    manifests = render_cell(
        deployment.spec,
        cell,
        deployment="dsv4",
        uid="u-1",
        namespace="serving",
        compute_domain=True,
    )
    for pod in pods(manifests, "decode"):
        assert pod["spec"]["resourceClaims"] == [
            {"name": "imex-channel", "resourceClaimTemplateName": "dsv4-cell-0-imex-channel"}
        ]
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "imex-channel"}]
    by_tray: dict[str, set[str]] = {}
    for pod in pods(manifests, "prefill"):  # two share a tray: one channel claim per node
        [claim] = pod["spec"]["resourceClaims"]
        tray = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0]
        by_tray.setdefault(tray, set()).add(claim["resourceClaimName"])
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]
    assert by_tray == {tray: {f"dsv4-cell-0-prefill-imex-{tray}"} for tray in by_tray}
    assert len(by_tray) < len(pods(manifests, "prefill"))  # pods of one tray share its claim
    domain = compute_domain("dsv4-cell-0", deployment="dsv4", uid="u-1", namespace="serving")
    assert domain["spec"]["channel"] == {
        "resourceClaimTemplate": {"name": "dsv4-cell-0-imex-channel"},
        "allocationMode": "Single",
    }
    assert domain["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_every_engine_reports_its_prefix_cache_hits_in_usage() -> None:
    # without the flag vLLM leaves usage.prompt_tokens_details out, and the gateway and its
    # clients never learn a cached token (seen on live engines behind the gateway)
    manifests, _ = rendered()
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        assert "--enable-prompt-tokens-details" in pod["spec"]["containers"][0]["command"]


def test_engine_pods_get_shared_memory_probes_and_a_tight_security_context() -> None:
    manifests, _ = rendered()
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        container = pod["spec"]["containers"][0]
        assert pod["spec"]["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
        assert container["volumeMounts"][0] == {"name": "dshm", "mountPath": "/dev/shm"}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}
        # liveness waits out the weights' loading behind the startup probe (30 minutes)
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        names = {e["name"]: e for e in container["env"]}
        assert names["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"] == {
            "fieldPath": "status.podIP"
        }
        assert "VLLM_API_KEY" not in names  # no Secret given: the engines are open


def test_the_engines_api_key_comes_from_its_secret_never_the_command_line() -> None:
    manifests, _ = rendered(engine={"apiKeySecret": {"name": "engine-key", "key": "token"}})
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "engine-key", "key": "token"}
        }
        assert "--api-key" not in container["command"]


def test_plugin_mode_installs_the_plugin_from_batons_image_onto_the_engines_python_path() -> None:
    manifests, _ = rendered(
        eplb={
            "reportUrl": "http://baton-eplb.serving.svc:9091",
            "tokenSecret": {"name": "eplb-token", "key": "token"},
        }
    )
    for pod in pods(manifests, "decode"):
        [init] = pod["spec"]["initContainers"]
        assert init["image"] == BATON_IMAGE
        assert init["command"] == ["baton", "vllm-plugin", "install", PLUGIN_DIR]
        assert init["securityContext"]["runAsNonRoot"] is True
        engine = pod["spec"]["containers"][0]
        [volume] = [v for v in pod["spec"]["volumes"] if "emptyDir" in v and v["name"] != "dshm"]
        assert {"name": volume["name"], "mountPath": PLUGIN_DIR} in init["volumeMounts"]
        assert {"name": volume["name"], "mountPath": PLUGIN_DIR, "readOnly": True} in engine[
            "volumeMounts"
        ]
        env = {e["name"]: e for e in engine["env"]}
        assert env["PYTHONPATH"]["value"] == PLUGIN_DIR
        cell = pod["metadata"]["labels"][CELL_LABEL]
        where = {key: env[variable]["value"] for key, variable in WHERE_ENV.items()}
        assert where == {"namespace": "serving", "deployment": "dsv4", "cell": cell}
        assert env[REPORT_URL_ENV]["value"] == "http://baton-eplb.serving.svc:9091"
        assert env[TOKEN_ENV]["valueFrom"] == {
            "secretKeyRef": {"name": "eplb-token", "key": "token"}
        }
        command = engine["command"]
        assert "--eplb-agent-port" not in command  # vLLM has no such flag
    for pod in pods(manifests, "prefill"):  # prefill instances run no EPLB
        assert "initContainers" not in pod["spec"]
        assert "--enable-eplb" not in pod["spec"]["containers"][0]["command"]


def test_a_plugin_placing_with_vllms_policy_is_told_so_and_the_default_renders_nothing() -> None:
    def policy_env(eplb: dict[str, object]) -> set[str | None]:
        manifests, _ = rendered(eplb=eplb)
        return {
            next((e["value"] for e in env if e["name"] == POLICY_ENV), None)
            for env in (p["spec"]["containers"][0]["env"] for p in pods(manifests, "decode"))
        }

    assert policy_env({"policy": "vllm_default"}) == {"vllm_default"}
    # unset as before the field existed: running pods keep their template hash
    assert policy_env({"policy": "baton"}) == policy_env({}) == {None}


def test_agent_mode_serves_the_simulators_agent_with_its_token_as_a_file() -> None:
    manifests, _ = rendered(
        engine={"command": ["baton", "sim"], "image": BATON_IMAGE},
        eplb={"mode": "agent", "tokenSecret": {"name": "eplb-token", "key": "token"}},
    )
    for pod in pods(manifests, "decode"):
        assert "initContainers" not in pod["spec"]
        engine = pod["spec"]["containers"][0]
        command = engine["command"]
        assert flag(command, "--eplb-agent-port") == "50100"
        path = flag(command, "--eplb-agent-token-file")
        [mount] = [m for m in engine["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "eplb-token"
        assert mount["readOnly"] is True
        assert TOKEN_ENV not in {e["name"] for e in engine["env"]}


def test_agent_mode_with_vllm_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=re.escape("use eplb.mode plugin with vLLM, or engine.command")
    ):
        rendered(eplb={"mode": "agent", "tokenSecret": {"name": "t", "key": "t"}})


@pytest.mark.parametrize(
    ("source", "volume"),
    [
        (
            {"pvc": {"claimName": "dsv4"}},
            {"persistentVolumeClaim": {"claimName": "dsv4", "readOnly": True}},
        ),
        (
            {"hostPath": {"path": "/mnt/models"}},
            {"hostPath": {"path": "/mnt/models", "type": "Directory"}},
        ),
        (
            {"image": {"reference": "registry.example/dsv4-weights:1"}},
            {
                "image": {
                    "reference": "registry.example/dsv4-weights:1",
                    "pullPolicy": "IfNotPresent",
                }
            },
        ),
    ],
    ids=["pvc", "host-path", "image"],
)
def test_the_model_volume_is_mounted_read_only_and_vllm_serves_its_directory(
    source: dict[str, Any], volume: dict[str, Any]
) -> None:
    manifests, _ = rendered(modelSource={**source, "path": "deepseek-ai/DeepSeek-V4.1-Flash"})
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        engine = pod["spec"]["containers"][0]
        assert engine["command"][2] == "/models/deepseek-ai/DeepSeek-V4.1-Flash"
        # clients keep the model's name
        assert flag(engine["command"], "--served-model-name") == "deepseek-ai/DeepSeek-V4.1-Flash"
        [mount] = [m for m in engine["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True
        [model] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert {k: v for k, v in model.items() if k != "name"} == volume


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        (
            {"hostPath": "/var/lib/baton/compile"},
            {"hostPath": {"path": "/var/lib/baton/compile", "type": "DirectoryOrCreate"}},
        ),
        ({"pvc": {"claimName": "compiled"}}, {"persistentVolumeClaim": {"claimName": "compiled"}}),
    ],
    ids=["host-path", "pvc"],
)
def test_the_compile_cache_keeps_vllms_inductors_and_tritons_kernels_on_its_volume(
    cache: dict[str, Any], volume: dict[str, Any]
) -> None:
    # the user's own env comes after Baton's, so it can point one cache elsewhere
    mine = {"name": "TRITON_CACHE_DIR", "value": "/elsewhere"}
    manifests, _ = rendered(engine={"compileCache": cache, "env": [mine]})
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        engine = pod["spec"]["containers"][0]
        [mount] = [m for m in engine["volumeMounts"] if m["name"] == "compile-cache"]
        assert mount == {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR}
        [kept] = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-cache"]
        assert {k: v for k, v in kept.items() if k != "name"} == volume
        env = [e for e in engine["env"] if e["name"] in COMPILE_CACHE_ENV]
        assert env == [
            *(
                {"name": name, "value": f"{COMPILE_CACHE_DIR}/{directory}"}
                for name, directory in COMPILE_CACHE_ENV.items()
            ),
            mine,
        ]
    plain, _ = rendered()
    for pod in pods(plain, "decode"):
        assert all(v["name"] != "compile-cache" for v in pod["spec"]["volumes"])


@pytest.mark.parametrize("cache", [{}, {"hostPath": "/c", "pvc": {"claimName": "c"}}])
def test_a_compile_cache_names_one_place(cache: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"engine\.compileCache: give hostPath or pvc"):
        rendered(engine={"compileCache": cache})


def test_without_a_volume_vllm_downloads_the_model_by_its_hub_id_with_the_token() -> None:
    manifests, _ = rendered(modelSource={"tokenSecret": {"name": "hf", "key": "token"}})
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        engine = pod["spec"]["containers"][0]
        assert engine["command"][2] == "deepseek-ai/DeepSeek-V4.1-Flash"
        [token] = [e for e in engine["env"] if e["name"] == "HF_TOKEN"]
        assert token == {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
        }
        assert "hf" not in " ".join(engine["command"])


def test_resources_scheduling_env_and_volumes_reach_every_engine_pod() -> None:
    manifests, _ = rendered(
        engine={
            "resources": {
                "requests": {"cpu": "32", "memory": "512Gi", "hugepages-2Mi": "8Gi"},
                "limits": {"memory": "600Gi", "hugepages-2Mi": "8Gi", "rdma/ib": "1"},
            },
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-GB300"},
            "tolerations": [{"key": "example.com/reserved", "operator": "Exists"}],
            "priorityClassName": "inference-critical",
            "env": [
                {"name": "PLAIN", "value": "1"},
                {"name": "FROM_MAP", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
            ],
            "volumes": [{"name": "hf-cache", "hostPath": {"path": "/var/cache/hf"}}],
            "volumeMounts": [{"name": "hf-cache", "mountPath": "/root/.cache/huggingface"}],
        }
    )
    for pod in pods(manifests, "decode") + pods(manifests, "prefill"):
        spec = pod["spec"]
        engine = spec["containers"][0]
        gpus = engine["resources"]["limits"]["nvidia.com/gpu"]
        assert engine["resources"]["requests"] == {
            "cpu": "32",
            "memory": "512Gi",
            "hugepages-2Mi": "8Gi",
            "nvidia.com/gpu": gpus,
        }
        assert engine["resources"]["limits"]["rdma/ib"] == "1"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-GB300"}
        assert {"key": "example.com/reserved", "operator": "Exists"} in spec["tolerations"]
        assert spec["priorityClassName"] == "inference-critical"
        assert {"name": "PLAIN", "value": "1"} in engine["env"]
        assert {
            "name": "FROM_MAP",
            "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
        } in engine["env"]
        assert {"name": "hf-cache", "hostPath": {"path": "/var/cache/hf"}} in spec["volumes"]
        assert {"name": "hf-cache", "mountPath": "/root/.cache/huggingface"} in engine[
            "volumeMounts"
        ]
    gpus_per_role = {
        role: {
            p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            for p in pods(manifests, role)
        }
        for role in ("decode", "prefill")
    }
    assert gpus_per_role == {"decode": {"4"}, "prefill": {"2"}}  # the controller's, always


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            {"resources": {"limits": {"nvidia.com/gpu": "4"}}},
            "engine.resources names nvidia.com/gpu",
        ),
        ({"resources": {"requests": {"cpu": "lots"}}}, "String should match pattern"),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "taken by Baton's own volumes"),
        ({"volumes": [{"name": "cache"}]}, "volume cache has no source"),
        (
            {"volumeMounts": [{"name": "cache", "mountPath": "/c"}]},
            "cache is not in engine.volumes",
        ),
        (
            {
                "env": [
                    {
                        "name": "A",
                        "value": "1",
                        "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
                    }
                ]
            },
            "give value or valueFrom, not both",
        ),
        ({"tolerations": [{"operator": "Exists", "value": "x"}]}, "operator Exists takes no value"),
    ],
)
def test_engine_options_a_pod_cannot_carry_are_refused_with_the_fix(
    engine: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        rendered(engine=engine)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"pvc": {"claimName": "a"}, "hostPath": {"path": "/m"}},
            "give one of pvc, hostPath, image, not several",
        ),
        ({"path": "dsv4"}, "names a directory in a volume"),
        ({"pvc": {"claimName": "a"}, "path": "../etc"}, "leaves the volume"),
    ],
)
def test_a_model_source_that_names_no_one_directory_is_refused(
    source: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        rendered(modelSource=source)


@pytest.mark.parametrize(
    ("communicator", "rendered_as"),
    [("auto", None), ("nixl", "nixl"), ("torch_gloo", "torch_gloo")],
)
def test_the_eplb_communicator_is_rendered_unless_vllm_chooses(
    communicator: str, rendered_as: str | None
) -> None:
    manifests, _ = rendered(eplb={"communicator": communicator})
    command = pods(manifests, "decode")[0]["spec"]["containers"][0]["command"]
    assert json.loads(flag(command, "--eplb-config")).get("communicator") == rendered_as


@pytest.mark.parametrize("communicator", ["torch_nccl", "pynccl"])
def test_communicators_vllms_async_eplb_refuses_are_refused_with_the_fix(communicator: str) -> None:
    with pytest.raises(ValueError, match="use torch_gloo, nixl or auto"):
        rendered(eplb={"communicator": communicator})


def test_batons_image_default_is_the_charts_and_what_make_image_builds() -> None:
    chart = yaml.safe_load((ROOT / "helm/baton/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm/baton/values.yaml").read_text())
    assert f"{values['image']['repository']}:{chart['appVersion']}" == BATON_IMAGE
    makefile = (ROOT / "Makefile").read_text()
    assert f"IMAGE ?= {BATON_IMAGE}\n" in makefile  # what `make image` builds
