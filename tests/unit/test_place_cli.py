"""``baton place``: outputs, exit status, and errors that name the file, the field and the fix."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton.cli import main as baton_main
from baton.place import PlaceError, load_deployment, main, render_text
from controller.placement import DecodeShape, DeploymentShape, PrefillShape, plan_placement
from controller.topology import synthetic_nodes, synthetic_topology, tray_name

MINIMAL = (
    "apiVersion: baton.dev/v1alpha1\n"
    "kind: ModelDeployment\n"
    "spec:\n"
    "  model: deepseek-ai/DeepSeek-V4.1-Flash\n"
)


def write_nodes(path: Path, racks: int = 1, **kwargs: Any) -> Path:
    """``synthetic_nodes(racks, **kwargs)`` as a NodeList file."""
    items = synthetic_nodes(racks, **kwargs)
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "NodeList", "items": items}))
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def nodes(tmp_path: Path) -> Path:
    return write_nodes(tmp_path / "nodes.json")


@pytest.fixture
def deployment(tmp_path: Path) -> Path:
    return write(tmp_path / "mdep.yaml", MINIMAL)


def test_minimal_deployment_gets_the_studys_cell_on_a_rack_map(
    capsys: pytest.CaptureFixture[str], nodes: Path, deployment: Path
) -> None:
    code, out, _ = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 0
    assert out.startswith("1 of 1 cells placed; GPUs: 72 total, 32 decode, 36 prefill, 4 spare")
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "tray-" in line]
    assert [row[2] for row in rows] == ["DDDD"] * 8 + ["SSSS"] + ["PPPP"] * 9
    assert rows[3][3:] == ["deepseek-v4-1-flash-cell-0", "decode", "3", "(ranks", "12-15)"]
    assert rows[8][3:] == ["deepseek-v4-1-flash-cell-0", "spare"]
    assert "legend: D decode  P prefill  S spare" in out


def test_rack_map_marks_failed_quarantined_and_other_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Path
) -> None:
    nodes = write_nodes(
        tmp_path / "n.json",
        failed=[tray_name(0, 0)],
        quarantined=[tray_name(0, 1)],
        partly_used={tray_name(0, 2): 2},
    )
    code, out, _ = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 0
    marks = {line.split()[1]: line.split()[2] for line in out.splitlines() if "tray-" in line}
    assert marks[tray_name(0, 0)] == "XXXX"
    assert marks[tray_name(0, 1)] == "QQQQ"
    assert marks[tray_name(0, 2)] == "PPoo"


def test_json_plan_lists_cells_pods_gpus_and_ranks(
    capsys: pytest.CaptureFixture[str], nodes: Path, deployment: Path
) -> None:
    code, out, _ = run(
        capsys, "--nodes", str(nodes), "--deployment", str(deployment), "--format", "json"
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["feasible"] is True
    (cell,) = plan["cells"]
    assert cell["decode"][3] == {
        "pod": "deepseek-v4-1-flash-cell-0-decode-3",
        "tray": tray_name(0, 3),
        "gpus": [0, 1, 2, 3],
        "ranks": [12, 13, 14, 15],
    }
    assert cell["prefill"][1] == {
        "pod": "deepseek-v4-1-flash-cell-0-prefill-1",
        "instance": 1,
        "tray": tray_name(0, 9),
        "gpus": [2, 3],
    }
    assert cell["spareTrays"] == [tray_name(0, 8)]
    assert cell["maxPrefillInstances"] == 18
    assert plan["gpus"] == {
        "gpus": 72,
        "decode": 32,
        "prefill": 36,
        "spare": 4,
        "other": 0,
        "free": 0,
        "unavailable": 0,
    }
    assert [tray["gpus"] for tray in plan["trays"]][7:10] == ["DDDD", "SSSS", "PPPP"]


def test_json_plan_replays_as_current_after_a_tray_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, nodes: Path, deployment: Path
) -> None:
    code, out, _ = run(
        capsys, "--nodes", str(nodes), "--deployment", str(deployment), "--format", "json"
    )
    current = write(tmp_path / "plan.json", out)
    failed = write_nodes(tmp_path / "failed.json", failed=[tray_name(0, 5)])
    code, out, _ = run(
        capsys,
        *("--nodes", str(failed), "--deployment", str(deployment)),
        *("--current", str(current), "--format", "json"),
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["moved"] == [
        {
            "pod": "deepseek-v4-1-flash-cell-0-decode-5",
            "from": tray_name(0, 5),
            "to": tray_name(0, 8),
        }
    ]
    assert plan["restarted"] == ["deepseek-v4-1-flash-cell-0"]
    assert plan["cells"][0]["spareTrays"] == []


def test_infeasible_placement_exits_1_and_prints_the_reason(
    capsys: pytest.CaptureFixture[str], nodes: Path, tmp_path: Path
) -> None:
    deployment = write(tmp_path / "two.yaml", MINIMAL + "  cells: 2\n")
    code, out, _ = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 1
    assert (
        "deepseek-v4-1-flash-cell-1: InsufficientCapacity: cell deepseek-v4-1-flash-cell-1 " in out
    )
    assert "the only NVLink domain hosts a cell" in out
    code, out, err = run(
        capsys, "--nodes", str(nodes), "--deployment", str(deployment), "--format", "json"
    )
    assert code == 1
    assert json.loads(out)["unplaced"][0]["reason"] == "InsufficientCapacity"
    assert "InsufficientCapacity" in err


def test_what_a_domain_lacked_is_printed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Path
) -> None:
    nodes = write_nodes(tmp_path / "n.json", failed=[tray_name(0, slot) for slot in range(11)])
    code, out, _ = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 1
    assert "7 of 9 whole trays free (8 decode + 1 spare), 0 prefill slots" in out


def test_svg_draws_every_gpu_of_every_rack(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Path
) -> None:
    nodes = write_nodes(tmp_path / "n.json", racks=2, split_cliques=1)
    code, out, _ = run(
        capsys, "--nodes", str(nodes), "--deployment", str(deployment), "--format", "svg"
    )
    assert code == 0
    svg = ET.fromstring(out)
    squares = [
        rect for rect in svg.iter("{http://www.w3.org/2000/svg}rect") if rect.find("*") is not None
    ]
    assert len(squares) == 144 + 8  # every GPU, plus the legend
    texts = [text.text for text in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "deepseek-v4-1-flash-cell-0" in texts


def test_yaml_node_list_and_full_manifest_are_accepted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": synthetic_nodes(1)})
    )
    manifest = {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "flash", "namespace": "serving", "uid": "1f"},
        "spec": {
            "model": "deepseek-ai/DeepSeek-V4.1-Flash",
            "servedModelName": "deepseek-v4.1-flash",
            "engine": {"command": ["vllm", "serve"], "image": "vllm/vllm-openai"},
            "cells": 1,
            "cell": {
                "decode": {"dep": 32, "gpusPerPod": 4, "spareTrays": 0},
                "prefill": {"dep": 2, "instances": 20},
            },
            "topology": {
                "domainLabel": "nvidia.com/gpu.clique",
                "gpuResource": "nvidia.com/gpu",
                "gpusPerTray": 4,
            },
            "kvTransfer": {"connector": "NixlConnector"},
            "eplb": {"enabled": True},
        },
    }
    deployment = write(tmp_path / "flash.yaml", yaml.safe_dump(manifest))
    code, out, _ = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 0
    assert "flash-cell-0" in out and "prefill 20 of 20 DEP2 (max 20)  spare 0 of 0" in out


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            MINIMAL.replace("  model: deepseek-ai/DeepSeek-V4.1-Flash\n", "  cells: 1\n"),
            ["mdep.yaml: field 'spec.model': Field required", "fix: see the ModelDeployment"],
        ),
        (MINIMAL.replace("ModelDeployment", "Deployment"), ["field 'kind'", "'ModelDeployment'"]),
        (
            MINIMAL + "  cell: {decode: {dep: 30}}\n",
            ["field 'spec.cell.decode'", "dep (30) must be a multiple of gpusPerPod (4)"],
        ),
        (
            MINIMAL + "  cell: {decode: {spares: 2}}\n",
            ["field 'spec.cell.decode.spares': Extra inputs are not permitted"],
        ),
        (
            MINIMAL + "  cell: {decode: {gpusPerPod: 2, dep: 32}}\n",
            ["gpusPerPod (2) must equal topology.gpusPerTray (4)"],
        ),
        ("spec: [oops\n", ["mdep.yaml: not valid YAML or JSON"]),
        ("", ["mdep.yaml: no ModelDeployment in the file"]),
    ],
    ids=["no-model", "wrong-kind", "dep", "typo", "gpus-per-pod", "yaml", "empty"],
)
def test_bad_deployment_exits_2_naming_file_field_and_fix(
    capsys: pytest.CaptureFixture[str], nodes: Path, tmp_path: Path, text: str, needles: list[str]
) -> None:
    deployment = write(tmp_path / "mdep.yaml", text)
    code, out, err = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 2 and out == ""
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            '{"kind": "NodeList", "items": [{"kind": "Node", "metadata": {"name": "t0"}, '
            '"status": {"allocatable": {"nvidia.com/gpu": "four"}}}]}',
            [
                "nodes.json: item 0 (node 't0'): field 'status.allocatable.nvidia.com/gpu'",
                "fix: pass the output of `kubectl get nodes -o yaml`",
            ],
        ),
        ('{"kind": "PodList", "items": {}}', ["nodes.json: not a node list"]),
        ("[{metadata: {}}]", ["nodes.json: item 0: field 'metadata.name': Field required"]),
    ],
    ids=["allocatable", "not-nodes", "no-name"],
)
def test_bad_node_list_exits_2_naming_file_field_and_fix(
    capsys: pytest.CaptureFixture[str],
    deployment: Path,
    tmp_path: Path,
    text: str,
    needles: list[str],
) -> None:
    nodes = write(tmp_path / "nodes.json", text)
    code, out, err = run(capsys, "--nodes", str(nodes), "--deployment", str(deployment))
    assert code == 2 and out == ""
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize(
    ("cell", "needle"),
    [
        ({"name": "c", "deployment": "d"}, "field 'cells.0.domain': Field required"),
        (
            {
                "name": "c",
                "deployment": "d",
                "domain": "r.1",
                "decode": [],
                "spareTrays": [],
                "prefill": [{"instance": 1, "tray": "t", "gpus": [0, 1]}] * 2,
            },
            "field 'cells.0': Value error, a prefill instance index appears twice",
        ),
    ],
    ids=["missing-field", "instance-twice"],
)
def test_bad_current_plan_names_the_field(
    capsys: pytest.CaptureFixture[str],
    nodes: Path,
    deployment: Path,
    tmp_path: Path,
    cell: dict[str, object],
    needle: str,
) -> None:
    current = write(tmp_path / "plan.json", json.dumps({"cells": [cell]}))
    code, _, err = run(
        capsys, "--nodes", str(nodes), "--deployment", str(deployment), "--current", str(current)
    )
    assert code == 2
    assert f"{current}: {needle}" in err
    assert "fix: pass a plan written by `baton place --format json`" in err


def test_missing_file_and_missing_flag_exit_2(
    capsys: pytest.CaptureFixture[str], nodes: Path, tmp_path: Path
) -> None:
    code, _, err = run(capsys, "--nodes", str(nodes), "--deployment", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml: cannot read the ModelDeployment file" in err
    code, _, err = run(capsys, "--nodes", str(nodes))
    assert code == 2 and "--deployment" in err


def test_baton_place_is_a_baton_subcommand(
    capsys: pytest.CaptureFixture[str], nodes: Path, deployment: Path
) -> None:
    assert baton_main(["place", "--nodes", str(nodes), "--deployment", str(deployment)]) == 0
    assert "1 of 1 cells placed" in capsys.readouterr().out


def test_load_deployment_gives_the_studys_shape_by_default(
    deployment: Path, tmp_path: Path
) -> None:
    assert load_deployment(deployment) == DeploymentShape(
        "deepseek-v4-1-flash", 1, DecodeShape(32, 4, 1), PrefillShape(2, None)
    )
    two = write(tmp_path / "two.yaml", MINIMAL + "---\n" + MINIMAL.replace("V4.1", "V5"))
    with pytest.raises(PlaceError, match="expected one ModelDeployment, found 2"):
        load_deployment(two)


def test_rack_map_without_shapes_reads_sizes_from_the_plan() -> None:
    topology = synthetic_topology(1)
    out = render_text(plan_placement([DeploymentShape("flash")], topology), topology)
    domain = topology.domains[0].name
    assert (
        f"flash-cell-0  domain {domain}  decode DEP32 on 8 trays  prefill 18 DEP2 (max 18)  spare 1"
        in out
    )
