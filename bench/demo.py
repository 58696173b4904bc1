"""``make demo``: Baton's main job on the embedded default, end to end, in about a minute.

``baton up`` starts a simulated GB300 NVL72 rack: the placement of one cell (DEP32 decode, DEP2
prefill instances), the simulated engines at the placed roles, the EPLB service and the gateway.
A short agentic workload then runs through the official ``openai`` client: sessions of growing
multi-turn conversations, each turn resending the whole history, streamed. The table shows what
the gateway and the engines measured, and what the EPLB service did to each model, from its
/metrics scraped through the run: its decisions by outcome, vLLM's per-step balance before the
first rebalance and on the latest window wholly under a rebalanced placement, and the window
balance before, predicted and achieved of the first and the last rebalance. Then everything is
stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from baton.core.model import SERVED_MODEL_NAME
from rigs.processes import ProcessExited, baton_command, eventually, free_port, stop_process

SESSIONS = 32
TURNS = 6
# Long enough (some 2,500 decode steps) for the EPLB service, deciding every 500 steps, to
# rebalance and then decide on windows wholly under the new placement.
REPLY_TOKENS = 1024
SYSTEM = "You are a coding agent working on a GB300 NVL72 rack. Tools: shell, editor. " * 40
# The EPLB service decides each model every few seconds here: scraped this often, a decision
# is nearly always seen alone, so the step balance scraped after it is its window's.
EPLB_SCRAPE_S = 0.25

# (sample name, its sorted labels) -> value, from a /metrics page
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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


def parse_samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _samples(url: str) -> Samples:
    return parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    """The series' value (the demo runs one decode group), None while it does not exist (a
    gauge never set)."""
    values = [
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    ]
    return values[-1] if values else None


def _outcomes(samples: Samples, model: str) -> dict[str, int]:
    """Decisions so far by outcome (``baton_eplb_rebalances_total``)."""
    counts: dict[str, int] = {}
    for (sample, labels), value in samples.items():
        label = dict(labels)
        if sample == "baton_eplb_rebalances_total" and label.get("model") == model:
            counts[label["outcome"]] = counts.get(label["outcome"], 0) + int(value)
    return counts


def _scrape_eplb(url: str, stop: threading.Event, timeline: list[Samples]) -> None:
    """The EPLB service's /metrics into ``timeline`` every EPLB_SCRAPE_S until ``stop``."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            timeline.append(_samples(url))
        if stop.wait(EPLB_SCRAPE_S):
            return


class _History:
    """One model's decisions as the demo's scrapes of the EPLB service saw them (oldest first,
    the first before any load).

    A gauge carries no time: its value is a decision's only when that decision is the one new
    decision between two scrapes. The service sets a boundary's step balance, and to rebalance
    the window balances before and predicted, before it counts the outcome (after the switch).
    """

    def __init__(self, timeline: Sequence[Samples], model: str) -> None:
        self.timeline, self.model = timeline, model
        self.outcomes = [_outcomes(samples, model) for samples in timeline]

    def committed(self, scrape: int) -> int:
        return self.outcomes[scrape].get("committed", 0)

    def gauge(self, scrape: int, name: str, **labels: str) -> float | None:
        return _value(self.timeline[scrape], name, model=self.model, **labels)

    def alone(self, scrape: int) -> str | None:
        """The outcome of the one decision between this scrape and the one before, if one."""
        if scrape == 0:
            return None
        before, after = self.outcomes[scrape - 1], self.outcomes[scrape]
        if sum(after.values()) - sum(before.values()) != 1:
            return None
        return next(o for o, n in after.items() if n > before.get(o, 0))

    def step_balances(self) -> list[tuple[int, float]]:
        """(scrape, step balance) of every complete window decided alone before that scrape."""
        return [
            (scrape, step)
            for scrape in range(1, len(self.timeline))
            # an incomplete window's step balance is of part of one, or not set by it at all
            if self.alone(scrape) not in (None, "incomplete_window")
            and (step := self.gauge(scrape, "baton_eplb_step_balance")) is not None
        ]

    def first_scrape_with(self, commits: int) -> int:
        return next(k for k in range(len(self.timeline)) if self.committed(k) >= commits)

    def achieved_after(self, scrape: int) -> tuple[int, float] | None:
        """The first later scrape with an achieved window balance not there at ``scrape``, and
        that balance."""
        then = self.gauge(scrape, "baton_eplb_balance", stage="achieved")
        for k in range(scrape + 1, len(self.timeline)):
            achieved = self.gauge(k, "baton_eplb_balance", stage="achieved")
            if achieved is not None and achieved != then:
                return k, achieved
        return None


def eplb_rows(timeline: Sequence[Samples]) -> list[tuple[str, str]]:
    """What the EPLB service did to each model, from its /metrics scraped through the run
    (oldest first, the first before any load). A balance is shown only once measured: a gauge
    never set is no 0."""
    rows = []
    for model in ("target", "draft"):
        history = _History(timeline, model)
        outcomes = dict(history.outcomes[-1])
        committed = outcomes.pop("committed", 0)
        others = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items(), key=_most_first))
        rows += [
            (
                f"EPLB {model} rebalances",
                f"{committed} committed" + (f"; not rebalanced: {others}" if others else "")
                if committed or others
                else "none yet",
            ),
            (f"EPLB {model} step balance", _step_balance(history)),
        ]
        if committed:
            rows.append((f"EPLB {model} first rebalance", _rebalance(history, 1)))
        if committed > 1:
            rows.append((f"EPLB {model} last rebalance", _rebalance(history, committed)))
    return rows


def _most_first(outcome: tuple[str, int]) -> tuple[int, str]:
    return -outcome[1], outcome[0]


def _step_balance(history: _History) -> str:
    """vLLM's per-step balance over the last window decided before the first commit (that
    commit's own included) and over the latest window wholly under a rebalanced placement."""
    committed = history.committed(-1)
    measured = history.step_balances()
    before = [step for k, step in measured if history.committed(k - 1) == 0]
    if not committed:
        if before:
            return f"{before[-1]:.2f}, no rebalance committed"
        complete = set(history.outcomes[-1]) - {"incomplete_window"}
        return "not seen" if complete else "no complete window yet"
    # Once a switch's first full window is measured, every boundary decided after that
    # report is on a window under it; the one decided in that report may not be, and may land
    # after the scrape that shows the measurement, so the next scrape is where "after" starts.
    first = history.achieved_after(history.first_scrape_with(1))
    after = [step for k, step in measured if first is not None and k - 1 > first[0]]
    return (
        (f"{before[-1]:.2f}" if before else "not seen")
        + " before the first rebalance, "
        + (f"{after[-1]:.2f} after it (latest window)" if after else "none measured after it yet")
    )


def _rebalance(history: _History, commit: int) -> str:
    """Window balance before, predicted and achieved (its first full window) of a commit."""
    scrape = history.first_scrape_with(commit)
    before = history.gauge(scrape, "baton_eplb_balance", stage="before")
    predicted = history.gauge(scrape, "baton_eplb_balance", stage="predicted")
    alone = history.alone(scrape) == "committed" and history.committed(scrape) == commit
    if not alone or before is None or predicted is None:
        return "window balance not seen (another decision between the same two scrapes)"
    measured = history.achieved_after(scrape)
    # three decimals: the service commits for a predicted gain of 0.002 (minGain)
    if measured is not None and history.committed(measured[0]) == commit:
        result = f"{measured[1]:.3f}"
    elif commit == history.committed(-1):
        result = "not measured yet"
    else:
        result = "not measured before the next rebalance"
    return f"window balance {before:.3f} -> {predicted:.3f} predicted, achieved {result}"


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> int:
    port, eplb_port = free_port(), free_port()
    up = subprocess.Popen(
        baton_command(
            "up",
            "--port",
            str(port),
            "--eplb-metrics-port",
            str(eplb_port),
        )
    )
    gateway = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if up.poll() is not None:
            raise ProcessExited(f"baton up exited with {up.returncode}")
        return httpx.get(f"{gateway}/ready").status_code == 200

    try:
        eventually(ready, timeout=180, interval=0.5)
        print(
            f"\nRunning {SESSIONS} agentic sessions x {TURNS} turns through {gateway}/v1 ...\n",
            flush=True,
        )
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="demo", max_retries=0)
        eplb = f"http://127.0.0.1:{eplb_port}"
        timeline: list[Samples] = []
        stop = threading.Event()
        scraper = threading.Thread(target=_scrape_eplb, args=(eplb, stop, timeline), daemon=True)
        scraper.start()
        try:
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
                runs = list(pool.map(lambda s: _session(client, s), range(SESSIONS)))
            elapsed = time.perf_counter() - started
        finally:
            stop.set()
            scraper.join()
        timeline.append(_samples(eplb))
        _report([turn for run in runs for turn in run], elapsed, _samples(gateway), timeline)
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


def _report(turns: list[Turn], elapsed: float, gateway: Samples, eplb: Sequence[Samples]) -> None:
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
        *eplb_rows(eplb),
        ("wall time", f"{elapsed:.1f} s (simulated time = wall time at --time-scale 1)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
