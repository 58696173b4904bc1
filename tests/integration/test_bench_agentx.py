"""``baton bench agentx`` end to end: a fresh simulated rack per router, the real routers in
front of it, the sessions through them, and the figures saved."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, baton_command

pytestmark = pytest.mark.timeout(600)


def test_every_router_serves_the_same_sessions_and_affinity_keeps_the_cache(
    tmp_path: Path,
) -> None:
    command = baton_command(
        "bench",
        "agentx",
        "--quick",
        "--concurrency",
        "4",
        "--warmup",
        "1",
        "--duration",
        "6",
        "--eplb-modes",
        "vllm",
        "--eplb-duration",
        "4",
        "--out",
        str(tmp_path),
    )
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "agentx.json").read_text())
    points = {p["router"]: p for p in result["points"]}
    assert set(points) == {"baton", "vllm-router", "round-robin"}
    for point in points.values():
        assert point["requests"] > 0 and point["errors"] == 0, point
        assert point["gpus"] == 68  # 18 DEP2 prefill instances and a DEP32 decode group
        assert point["tokens_per_s_per_gpu"] > point["output_per_s_per_gpu"] > 0
    # Round robin scatters each session's turns over 18 prefill instances; Baton's affinity
    # sends them back to the one holding their prefix.
    assert (
        points["baton"]["prefix_reuse_achieved"]
        > 2 * points["round-robin"]["prefix_reuse_achieved"]
    )
    # Baton's own count of its prefill choices: each followed the key or spilled
    assert points["baton"]["affinity"]["hit"] > 0 and points["round-robin"]["affinity"] is None
    # and where it computed again what the sessions let it reuse, by cause
    lost = points["baton"]["reuse_lost"]
    assert set(lost) == {
        "subagent_first_turn",
        "history_during_warmup",
        "history_after_warmup",
        "other",
    }
    assert all(0 <= share < 1 for share in lost.values())
    assert points["vllm-router"]["reuse_lost"] is None
    assert "| baton | 4 |" in done.stdout and "Baton / vllm-router" in done.stdout
    # the EPLB comparison's point: the engines' own EPLB, its balance followed over time
    [eplb] = result["eplb"]
    assert eplb["eplb"] == "vllm" and eplb["errors"] == 0
    assert 0 < eplb["balance"]["target"] <= 1
    assert eplb["balance_timeline"][-1]["steps"] > 0
