"""``baton bench gpu``'s carry: wheels packed into folders the device tool carries one a call,
from a pinned list; the model fitted to the card that is lent; the steps' command-line
errors."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from baton.core.profile import Profile, load_profile
from bench.gpu import FOLDER_BYTES, REQUIREMENTS, Part, fit, fitted_profile, pack
from tests.helpers import ROOT, baton_command


def test_every_folder_fits_and_every_byte_is_carried_once() -> None:
    files = {"vllm.whl": 290 * 2**20, "nixl.whl": 56 * 2**20, "a.whl": 30 * 2**20, "b.whl": 9}
    folders = pack(files, limit=FOLDER_BYTES)
    assert all(sum(p.length for p in folder) <= FOLDER_BYTES for folder in folders)
    carried: dict[str, list[Part]] = {}
    for folder in folders:
        for part in folder:
            carried.setdefault(part.file, []).append(part)
    for name, size in files.items():
        parts = sorted(carried[name], key=lambda p: p.offset)
        assert [p.offset for p in parts] == [
            sum(q.length for q in parts[:i]) for i in range(len(parts))
        ]
        assert sum(p.length for p in parts) == size


def test_a_wheel_larger_than_a_folder_travels_in_numbered_parts_of_its_own() -> None:
    folders = pack({"vllm.whl": 130, "small.whl": 10}, limit=50)
    parts = [p for folder in folders for p in folder if p.file == "vllm.whl"]
    assert [p.name for p in parts] == ["vllm.whl.part00", "vllm.whl.part01", "vllm.whl.part02"]
    assert [p.length for p in parts] == [50, 50, 30]
    # the small wheel fills the room the last part left, not a folder of its own
    assert len(folders) == 3


def test_small_wheels_share_folders_largest_first() -> None:
    folders = pack({"a": 30, "b": 25, "c": 20, "d": 15}, limit=50)
    assert [[p.name for p in folder] for folder in folders] == [["a", "c"], ["b", "d"]]


def test_every_carried_wheel_is_pinned_by_version_and_sha256() -> None:
    lines = [
        line for line in REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")
    ]
    pattern = r"([a-z0-9-]+)==(\S+) --hash=sha256:([0-9a-f]{64})"
    pinned = [re.fullmatch(pattern, line) for line in lines]
    assert all(pinned), [line for line, m in zip(lines, pinned, strict=True) if m is None]
    names = [m.group(1) for m in pinned if m]
    assert len(names) == len(set(names))
    versions = {m.group(1): m.group(2) for m in pinned if m}
    # the GPU engine: the newest vLLM whose wheel pins the lent machine's torch 2.11.0
    assert versions["vllm"] == "0.26.0"
    assert {"nixl", "nixl-cu13", "vllm-router"} <= set(versions)
    # the machine's image has these: a second copy would shadow it
    assert not {"torch", "transformers", "tokenizers", "numpy"} & set(versions)


H200_MIB, H100_MIB = 143_771, 81_559  # memory.total as nvidia-smi reports each


def test_four_engines_fit_either_card_with_the_same_tokens_of_kv_cache() -> None:
    h200, h100 = fit(H200_MIB * 2**20), fit(H100_MIB * 2**20)
    assert (h200.shape, h100.shape) == ("deepseek-v2-lite-12l", "deepseek-v2-lite-6l")
    # a token's MLA cache is per layer: half the layers, half the bytes, as many tokens
    assert h200.kv_cache_bytes == 2 * h100.kv_cache_bytes
    # four engines' weights (13 and 7 GiB) and caches leave room for activations and graphs
    assert 4 * (13 * 2**30 + h200.kv_cache_bytes) < 0.9 * H200_MIB * 2**20
    assert 4 * (7 * 2**30 + h100.kv_cache_bytes) < 0.9 * H100_MIB * 2**20


def test_a_card_too_small_for_four_engines_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="a card of 40 GiB"):
        fit(40 * 2**30)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            (),
            "give --step prepare|start|startup|points|agentx|overhead|profile|fit|hazards|"
            "share|frontend|eplb|stop",
        ),
        (("--step", "eplb", "--engines", "sim"), "--engines cpu or gpu"),
        (("--step", "eplb", "--engines", "cpu", "--dp", "1"), "--dp must be at least 2"),
        (("--step", "eplb", "--engines", "cpu", "--cadences", "16"), "give STEPS/WINDOW"),
        (("--step", "eplb", "--engines", "cpu", "--cadences", "8/16"), "the window (1 to"),
        (("--step", "eplb", "--engines", "cpu", "--policies", "x"), "--policies: unknown ['x']"),
        (("--step", "fit"), "give --samples gpu-profile.json"),
        (("--step", "fit", "--samples", "missing.json"), "missing.json"),
        (("--step", "points", "--engines", "cpu"), "--trace FILE is required"),
        (
            ("--step", "points", "--engines", "cpu", "--trace", "t.jsonl", "--window", "x"),
            "give START:SECONDS",
        ),
        (
            ("--step", "points", "--engines", "cpu", "--trace", "t.jsonl", "--trace-routers", "x"),
            "unknown ['x']",
        ),
        (
            ("--step", "start", "--engines", "sim", "--gateway-tokenizer", "nowhere"),
            "--gateway-tokenizer: no tokenizer.json in nowhere",
        ),
        (
            ("--step", "start", "--engines", "cpu", "--gateway-tokenizer", "nowhere"),
            "--gateway-tokenizer is for --engines sim",
        ),
    ],
)
def test_a_bad_command_line_says_what_to_give(
    tmp_path: Path, arguments: tuple[str, ...], message: str
) -> None:
    result = subprocess.run(
        baton_command("bench", "gpu", "--out", str(tmp_path), "--state", str(tmp_path), *arguments),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_points_without_engines_say_to_start_them(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
    )
    result = subprocess.run(
        baton_command(
            "bench",
            "gpu",
            "--step",
            "points",
            "--engines",
            "cpu",
            "--trace",
            str(trace),
            "--state",
            str(tmp_path),
            "--out",
            str(tmp_path),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "the engines are not up; run --step start first" in result.stderr


def test_the_shipped_h200_profile_is_the_fit_of_the_committed_measurements(
    tmp_path: Path,
) -> None:
    # docs/figures/gpu-h200-profile.json holds what --step profile measured on the H200; the
    # shipped profile must be what --step fit makes of it today
    record = json.loads((ROOT / "docs" / "figures" / "gpu-h200-profile.json").read_text())
    fitted = fitted_profile(record, tmp_path)
    shipped = _leaves(load_profile("deepseek-v2-lite-12l-h200").model_dump())
    # equal to the last few bits a NumPy/SciPy release may round differently (seen: ...446
    # against ...448 in the 16th digit on a fresh install)
    for made in (
        Profile.model_validate(fitted["profile"]),
        load_profile(tmp_path / "gpu-profile.yaml"),
    ):
        leaves = _leaves(made.model_dump())
        assert leaves.keys() == shipped.keys()
        for path, value in leaves.items():
            if isinstance(value, float):
                assert value == pytest.approx(shipped[path], rel=1e-9), path
            else:
                assert value == shipped[path], path


def _leaves(tree: object, path: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}.{key}").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}[{i}]").items()}
    return {path: tree}


def test_measurements_the_model_cannot_fit_are_said_and_no_profile_is_written(
    tmp_path: Path,
) -> None:
    record = json.loads((ROOT / "docs" / "figures" / "gpu-h200-profile.json").read_text())
    pulls = record["samples"]["handoff"]
    for pull in pulls:  # larger pulls faster: no bandwidth (a busy CPU host's pulls do this)
        pull["seconds"] = 1 / pull["bytes"]
    fitted = fitted_profile(record, tmp_path)
    assert fitted["profile"] is None
    assert "handoff" in fitted["fit_error"]
    assert not (tmp_path / "gpu-profile.yaml").exists()
