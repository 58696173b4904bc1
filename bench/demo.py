"""``make demo``: Baton's main job on the embedded default, end to end, in under a minute.

For now: a prefill and a decode ``baton sim`` (DEP2 each, NIXL pull mode), and a short agentic
workload through the official ``openai`` client that performs vLLM's P/D handoff (prefill with
``do_remote_decode``, decode with the returned ``kv_transfer_params``), then a table of what it
measured. The gateway issue moves the handoff into ``baton gateway``; the local-stack issue turns
this into ``baton up``.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from bench.processes import free_port, free_port_block, stop_process, wait_healthy

MODEL = "deepseek-v4.1-flash"
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def _start_engine(role: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    side_channel = free_port_block(2)  # one side-channel port per DP rank
    command = [
        sys.executable,
        "-m",
        "baton.cli",
        "sim",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--kv-transfer-config",
        NIXL,
        "--speculative-config",
        '{"method":"mtp","num_speculative_tokens":3}',
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel)}
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    print(f"  {role:<8} engine  {url}  (DEP2, NIXL side channel :{side_channel})")
    return process, url


@dataclass
class Turn:
    ttft_s: float
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_on_prefill: int


def _session(prefill: openai.OpenAI, decode: openai.OpenAI, session: int, turns: int) -> list[Turn]:
    messages = [{"role": "system", "content": "You are a coding agent on an NVL72 rack. " * 60}]
    results = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"session {session} step {turn}: run the tests"}
        )
        started = time.perf_counter()
        handoff = prefill.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
            extra_headers={"X-Request-Id": f"demo-{session}-{turn}"},
        )
        stream = decode.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kv_transfer_params": handoff.kv_transfer_params},
            extra_headers={"X-Request-Id": f"demo-{session}-{turn}"},
        )
        first = None
        text = []
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        finished = time.perf_counter()
        messages.append({"role": "assistant", "content": "".join(text)})
        results.append(
            Turn(
                first - started,
                finished - started,
                usage.completion_tokens,
                usage.prompt_tokens,
                handoff.usage.prompt_tokens_details.cached_tokens,
            )
        )
    return results


def _nixl_transfers(url: str) -> tuple[float, float]:
    """(transfers, bytes) the engine at ``url`` pulled, from its vllm:nixl_* metrics."""
    count = moved = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:nixl_bytes_transferred_count":
                count += sample.value
            elif sample.name == "vllm:nixl_bytes_transferred_sum":
                moved += sample.value
    return count, moved


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    print("Baton demo: P/D handoff between two simulated DEP2 engines\n")
    processes = []
    try:
        prefill_process, prefill_url = _start_engine("prefill")
        processes.append(prefill_process)
        decode_process, decode_url = _start_engine("decode")
        processes.append(decode_process)
        prefill = openai.OpenAI(base_url=f"{prefill_url}/v1", api_key="demo", max_retries=0)
        decode = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="demo", max_retries=0)
        sessions, turns = 8, 4
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
            runs = list(pool.map(lambda s: _session(prefill, decode, s, turns), range(sessions)))
        elapsed = time.perf_counter() - started
        all_turns = [turn for run in runs for turn in run]
        ttft = [t.ttft_s * 1000 for t in all_turns]
        output = sum(t.output_tokens for t in all_turns)
        prompt = sum(t.prompt_tokens for t in all_turns)
        cached = sum(t.cached_on_prefill for t in all_turns)
        transfers, moved = _nixl_transfers(decode_url)
        rows = [
            ("sessions x turns", f"{sessions} x {turns}"),
            ("requests (P/D handoffs)", f"{len(all_turns)}"),
            ("TTFT p50 / p90", f"{_percentile(ttft, 50):.1f} / {_percentile(ttft, 90):.1f} ms"),
            ("output tokens", f"{output}  ({output / elapsed:.0f} tok/s)"),
            ("prompt tokens / cached on prefill", f"{prompt} / {cached} ({cached / prompt:.0%})"),
            ("KV pulled by decode over NIXL", f"{transfers:.0f} transfers, {moved / 1e6:.1f} MB"),
            ("wall time", f"{elapsed:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        print()
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")
        print("\nTimes are simulated at time scale 1 (one simulated second per wall second).")
        return 0
    finally:
        for process in processes:
            stop_process(process)


if __name__ == "__main__":
    sys.exit(main())
