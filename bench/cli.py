"""``baton bench NAME``: run a benchmark, print its table and save its JSON.

Each benchmark is a module in ``bench/`` with ``run(quick) -> dict``. A full run's results go
to ``docs/figures/<name>.json``, beside the plots it draws there: the record every figure of
docs/benchmarks.md comes from, committed with it. A quick run (``--quick``, ``make bench``)
goes to ``bench/results/`` (not committed); ``--out`` chooses another directory. The file is
named for the result's ``benchmark`` field, so that a variant of a benchmark (``chaos --soak``
saves ``chaos-soak.json``) does not overwrite its main record. A benchmark with options of its
own (``add_arguments(parser)``) takes them when run by name, and gets them as
``run(quick, args)``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"
QUICK_RESULTS = Path("bench/results")

BENCHMARKS = {
    "sim": "bench.sim_capacity",
    "gateway": "bench.gateway",
    "gateway-workers": "bench.gateway_workers",
    "gateway-prompts": "bench.gateway_prompts",
    "prefix-index": "bench.prefix_index",
    "load-sync": "bench.load_sync",
    "placement": "bench.placement",
    "eplb": "bench.eplb",
    "controller": "bench.controller",
    "observability": "bench.observability",
    "agentx": "bench.agentx",
    "trace": "bench.trace",
    "gpu": "bench.gpu",
    "prefill-dp": "bench.prefill_dp",
    "chaos": "bench.chaos",
    "stragglers": "bench.stragglers",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=[*BENCHMARKS, "all"])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the JSON results (default: docs/figures, quick: bench/results)",
    )
    parser.add_argument("--quick", action="store_true", help="a shorter run, for smoke tests")
    arguments = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in arguments if a in BENCHMARKS), None)
    own = importlib.import_module(BENCHMARKS[chosen]) if chosen else None
    if own is not None and hasattr(own, "add_arguments"):
        own.add_arguments(parser)
    args = parser.parse_args(arguments)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    out: Path = args.out or (QUICK_RESULTS if args.quick else FIGURES)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        if module is own and hasattr(module, "add_arguments"):
            result = module.run(quick=args.quick, args=args)
        else:
            result = module.run(quick=args.quick)
        path = out / f"{result.get('benchmark', name)}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {path}", file=sys.stderr)
    return 0
