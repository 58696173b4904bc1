"""``make demo``: Baton's main job on the embedded default, end to end, in about a minute.

``baton up`` starts a simulated GB300 NVL72 rack: the placement of one cell (DEP32 decode, DEP2
prefill instances), the simulated engines at the placed roles, the EPLB service and the gateway.
A short agentic workload then runs through the official ``openai`` client: sessions of growing
multi-turn conversations, each turn resending the whole history, streamed. The table shows what
the gateway and the engines measured; then everything is stopped.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from baton.core.model import SERVED_MODEL_NAME
from rigs.processes import eventually, free_port, stop_process

SESSIONS = 32
TURNS = 6
REPLY_TOKENS = 384  # long enough for the EPLB service to see full windows and rebalance
SYSTEM = "You are a coding agent working on a GB300 NVL72 rack. Tools: shell, editor. " * 40


# (sample name, its sorted labels) -> value, from a /metrics page
_Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True, slots=True)
class Turn:
    ttft_s: float
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


def _session(client: openai.OpenAI, session: int) -> list[Turn]:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {session}: the tests fail; find out why."},
    ]
    turns = []
    for turn in range(TURNS):
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=messages,
            max_tokens=REPLY_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-ID": f"demo-{session}"},
        )
        first = None
        text = []
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert first is not None and usage is not None
        # The simulated engines, and so the gateway, always report cached prompt tokens.
        details = usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        turns.append(
            Turn(
                first - started,
                time.perf_counter() - started,
                usage.completion_tokens,
                usage.prompt_tokens,
                details.cached_tokens,
            )
        )
        tool_output = f"$ pytest -x\n... test_{turn} failed: {'E ' * 200}\n"
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": tool_output},
        ]
    return turns


def _samples(url: str) -> _Samples:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sum(samples: _Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def _eplb_rows(eplb: _Samples) -> list[tuple[str, str]]:
    rows = []
    for model in ("target", "draft"):
        committed = _sum(eplb, "baton_eplb_rebalances_total", model=model, outcome="committed")
        before = _sum(eplb, "baton_eplb_balance", model=model, stage="before")
        predicted = _sum(eplb, "baton_eplb_balance", model=model, stage="predicted")
        achieved = _sum(eplb, "baton_eplb_balance", model=model, stage="achieved")
        seen = f", achieved {achieved:.2f}" if achieved else ""
        rows.append(
            (
                f"EPLB {model} experts",
                f"{committed:.0f} rebalances committed; last window "
                f"balance {before:.2f}, predicted {predicted:.2f}{seen}",
            )
        )
    return rows


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> int:
    port, eplb_port = free_port(), free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton.cli",
            "up",
            "--port",
            str(port),
            "--eplb-metrics-port",
            str(eplb_port),
        ]
    )
    gateway = f"http://127.0.0.1:{port}"
    try:
        eventually(
            lambda: up.poll() is None and httpx.get(f"{gateway}/ready").status_code == 200,
            timeout=180,
            interval=0.5,
        )
        print(
            f"\nRunning {SESSIONS} agentic sessions x {TURNS} turns through {gateway}/v1 ...\n",
            flush=True,
        )
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="demo", max_retries=0)
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
            runs = list(pool.map(lambda s: _session(client, s), range(SESSIONS)))
        elapsed = time.perf_counter() - started
        _report(
            [turn for run in runs for turn in run],
            elapsed,
            _samples(gateway),
            _samples(f"http://127.0.0.1:{eplb_port}"),
        )
        # What went wrong, by reason: the counts only (each series' _created sample is a time).
        troubles = {
            (name, labels): value
            for (name, labels), value in sorted(_samples(gateway).items())
            if value
            and name.endswith("_total")
            and name.startswith(
                ("baton_gateway_retries", "baton_gateway_fallbacks", "baton_gateway_aborts")
            )
        }
        for (name, labels), value in troubles.items():
            print(f"    {name}{dict(labels)} = {value:.0f}")
        return 0
    finally:
        stop_process(up)
        print(f"\nbaton up stopped (exit {up.returncode}).")


def _report(turns: list[Turn], elapsed: float, gateway: _Samples, eplb: _Samples) -> None:
    ttft = [t.ttft_s * 1000 for t in turns]
    itl = [(t.seconds - t.ttft_s) / (t.output_tokens - 1) * 1000 for t in turns]
    output = sum(t.output_tokens for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    later = [t for i, t in enumerate(turns) if i % TURNS]
    later_hit = sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later)
    pd = _sum(gateway, "baton_gateway_routing_decisions_total", path="pd")
    alone = _sum(gateway, "baton_gateway_routing_decisions_total", path="decode_only")
    troubles = " / ".join(
        f"{_sum(gateway, name):.0f}"
        for name in (
            "baton_gateway_retries_total",
            "baton_gateway_fallbacks_total",
            "baton_gateway_aborts_total",
        )
    )
    rows = [
        ("requests", f"{len(turns)} ({pd:.0f} P/D handoffs, {alone:.0f} decode alone)"),
        ("TTFT p50 / p90", f"{_pct(ttft, 50):.0f} / {_pct(ttft, 90):.0f} ms"),
        ("inter-token latency p50", f"{_pct(itl, 50):.1f} ms"),
        ("output tokens", f"{output} ({output / elapsed:.0f} tokens/s)"),
        (
            "prompt tokens cached (prefill)",
            f"{cached} of {prompt} ({cached / prompt:.0%}); turns 2+: {later_hit:.0%}",
        ),
        ("retries / fallbacks / aborts", troubles),
        *_eplb_rows(eplb),
        ("wall time", f"{elapsed:.1f} s (simulated time = wall time at --time-scale 1)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
