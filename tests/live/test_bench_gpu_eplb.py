"""``baton bench gpu --step eplb`` on the CPU build of vLLM: the driver that measures vLLM's
expert rebalancing on several GPUs (a decode group started as the controller renders it, vLLM's
policy against Baton's plugin on the same traffic) exercised on a DP2 group here, so that it
cannot rot before a machine with several GPUs runs it. Its figures come only from GPUs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.eplb_engines import nccl_on_one_gpu
from rigs.vllm_live import cpu_vllm
from tests.helpers import bench_gpu


def test_vllms_policy_and_batons_plugin_each_rebalance_a_live_dp_group_measured_alike(
    tmp_path: Path,
) -> None:
    # one engine of both ranks (the form of a tray's pod), each rank named by its header; a pod
    # per rank runs in test_eplb_live.py
    arguments = (
        *("--step", "eplb", "--gpus-per-pod", "2", "--requests", "24", "--concurrency", "4"),
        *("--budget-s", "1100"),
    )
    result = bench_gpu("cpu", tmp_path, tmp_path, *arguments)
    logs = "".join(
        f"\n--- {log.name}\n{log.read_text()[-3000:]}"
        for log in sorted((tmp_path / "eplb").glob("*.log"))
    )
    assert result.returncode == 0, result.stderr[-4000:] + logs
    record = json.loads((tmp_path / "gpu-eplb.json").read_text())
    assert [arm["policy"] for arm in record["arms"]] == ["vllm_default", "baton"], logs
    for arm in record["arms"]:
        assert (arm["requests"], arm["errors"], arm["cut_short"]) == (24, 0, False)
        assert arm["output_tokens_per_s"] > 0 and arm["tpot_ms"]["p50"] > 0
        # rank 0 rearranged, and the plugin measured and reported each window, as placed by the
        # arm's policy (configured, not a fallback), to the running EPLB service
        assert arm["rearrangements"] >= 2, logs
        assert len(arm["rearrangement_s"]) == arm["rearrangements"]
        assert len(arm["windows"]) >= 1 and not arm["plugin_inactive"]
        assert {(w["policy"], w["fallback"]) for w in arm["windows"]} == {(arm["policy"], None)}
        assert arm["service_windows"][arm["policy"]] >= len(arm["windows"])
        assert 0 < arm["balance_placed"] <= 1
        # every rank's greedy answers, across rearrangements, unchanged
        assert arm["rearrangements_between_greedy"] >= 1
        assert arm["greedy_identical"]
    [row] = record["comparison"]
    assert row["cadence"] == "16/8" and row["experts_moved_per_window_ratio"] is not None


def test_ranks_sharing_a_gpu_are_asked_of_nccl_and_a_machine_without_one_answers_no() -> None:
    # the question the GPU driver asks before ranks share a GPU, run with the CPU build's torch:
    # no CUDA here, so each rank's answer is torch's reason, and the group is not formed
    answer = nccl_on_one_gpu(str(cpu_vllm().python), 2, {"CUDA_VISIBLE_DEVICES": ""})
    assert answer["shares"] is False
    assert [o["rank"] for o in answer["outcomes"]] == [0, 1]
    assert all(o.get("error") for o in answer["outcomes"]), answer
