"""``baton sim``: argument parsing with vLLM's flag names, and the process around the engines.

vLLM flags that shape the simulation are parsed with vLLM's names and meaning; any other flag a
real ``vllm serve`` line carries is accepted with a warning, because the controller renders one
command line for both. Errors name the flag and the fix and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from baton.core.files import describe_errors
from baton.core.model import MODEL
from baton.core.profile import ProfileError, load_profile
from baton.core.secrets import read_token
from sim.cluster import load_cluster
from sim.config import (
    EngineConfig,
    EplbConfig,
    KVEventsConfig,
    KVTransferConfig,
    SpeculativeConfig,
)
from sim.moe import policy_plugins
from sim.runner import SimProcess, start_cluster, start_single

__all__ = ["build_parser", "config_from_args", "main"]

log = logging.getLogger("baton.sim")


class CliError(ValueError):
    """A flag value is invalid; the message names the flag and the fix."""


M = TypeVar("M", bound=BaseModel)


def _flag(parser: argparse._ActionsContainer, name: str, *extra: str, **kwargs: Any) -> None:
    # vLLM accepts both --data-parallel-size and --data_parallel_size.
    underscored = "--" + name[2:].replace("-", "_")
    names = [name, *extra] + ([underscored] if underscored != name else [])
    parser.add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton sim",
        description="A vLLM-compatible engine simulator: vLLM's flags and wire protocol, "
        "timed by a performance model calibrated to the DeepSeek-V4.1-Flash study.",
    )
    parser.add_argument(
        "model", nargs="?", default=MODEL, help="model name (no weights are loaded)"
    )
    _flag(parser, "--host", default="127.0.0.1")
    _flag(parser, "--port", type=int, default=8000)
    _flag(parser, "--served-model-name", nargs="+", default=None)
    _flag(
        parser,
        "--api-key",
        nargs="+",
        default=None,
        help="bearer tokens every /v1 route requires (default: $VLLM_API_KEY; none: open)",
    )
    _flag(parser, "--data-parallel-size", "-dp", type=int, default=1)
    _flag(parser, "--data-parallel-size-local", "-dpl", type=int, default=None)
    _flag(parser, "--data-parallel-start-rank", "-dpr", type=int, default=0)
    _flag(parser, "--data-parallel-rank", "-dpn", type=int, default=None)
    _flag(parser, "--data-parallel-address", "-dpa", default=None)
    _flag(parser, "--data-parallel-rpc-port", "-dpp", type=int, default=29550)
    _flag(parser, "--data-parallel-hybrid-lb", "-dph", action="store_true")
    _flag(parser, "--enable-expert-parallel", "-ep", action="store_true")
    _flag(parser, "--kv-transfer-config", default=None, help="JSON, vLLM's KVTransferConfig")
    _flag(
        parser,
        "--kv-events-config",
        default=None,
        help="JSON, vLLM's KVEventsConfig: publish the prefix cache's KV events on ZeroMQ "
        '(e.g. {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}; rank r on port+r)',
    )
    _flag(parser, "--enable-eplb", action="store_true")
    _flag(parser, "--eplb-config", default=None, help="JSON, vLLM's EPLBConfig")
    _flag(parser, "--max-num-seqs", type=int, default=256)
    _flag(parser, "--max-num-batched-tokens", type=int, default=None)
    _flag(parser, "--max-model-len", type=int, default=1_048_576)
    _flag(parser, "--block-size", type=int, default=16)
    # The simulator always reports usage.prompt_tokens_details, as vLLM does with this flag
    # (which the controller renders): accepted so that a rendered command line runs unchanged.
    _flag(parser, "--enable-prompt-tokens-details", action="store_true")
    _flag(
        parser,
        "--shutdown-timeout",
        type=int,
        default=0,
        help="on SIGTERM: 0 aborts the requests in flight, N > 0 lets them finish for N seconds",
    )
    _flag(
        parser,
        "--speculative-config",
        default=None,
        help='JSON, e.g. {"method":"dspark","num_speculative_tokens":5} (the study\'s)',
    )
    sim = parser.add_argument_group("simulator-only flags")
    _flag(
        sim,
        "--profile",
        default=None,
        help="performance-model constants: a YAML file or a shipped profile name "
        "(deepseek-v4.1-flash-gb300, the default; instant)",
    )
    _flag(
        sim,
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (>1 stretches time for big clusters)",
    )
    _flag(sim, "--seed", type=int, default=0)
    _flag(
        sim,
        "--shared-gpu",
        default=None,
        help="a directory: engines naming the same one share one GPU's time, as vLLM engines "
        "on one GPU do (each at 1/k of its speed while k step at once); default: a GPU each",
    )
    _flag(
        sim,
        "--dcgm-port",
        type=int,
        default=None,
        help="serve dcgm-exporter's per-GPU series (SM clock, clock-event reasons, temperature, "
        "power) for this server's DP ranks on this port, as dcgm-exporter does per node",
    )
    _flag(
        sim,
        "--dcgm-hostname",
        default="tray",
        help="the Hostname label of the DCGM series: the node (tray) the GPUs are on",
    )
    _flag(
        sim,
        "--dcgm-noise",
        choices=["quiet", "rack"],
        default="quiet",
        help="quiet: identical GPUs with a little jitter; rack: each GPU a few percent off "
        "nominal for good, and momentary power-cap dips (sim/dcgm.py)",
    )
    _flag(sim, "--eplb-agent-port", type=int, default=None)
    _flag(
        sim,
        "--eplb-policy-plugin",
        default=None,
        help="in-engine EPLB with the policy an installed plugin provides under this name "
        "(baton: Baton's vLLM plugin, reporting as $BATON_EPLB_REPORT_URL says) in place of "
        "vLLM's default",
    )
    _flag(
        sim,
        "--eplb-agent-token-file",
        default=None,
        help="file holding the bearer token the EPLB service must send (a mounted Secret)",
    )
    _flag(
        sim,
        "--eplb-agent-insecure",
        action="store_true",
        help="without --eplb-agent-token-file, take Prepare/Commit/Abort from anyone (local tests)",
    )
    _flag(sim, "--eplb-agent-tls-cert", default=None, help="PEM certificate: serve on TLS")
    _flag(sim, "--eplb-agent-tls-key", default=None, help="PEM key of --eplb-agent-tls-cert")
    _flag(
        sim,
        "--enable-fault-injection",
        action="store_true",
        help="serve POST /sim/faults (kill, stall, slow, freeze, fail_requests, drop_kv) to "
        "callers with the token of --fault-injection-token-file: tests and failure drills only",
    )
    _flag(
        sim,
        "--fault-injection-token-file",
        default=None,
        help="file holding the bearer token POST /sim/faults requires",
    )
    _flag(
        sim,
        "--request-log",
        default=None,
        help="append one JSON line per finished request to this file: the API server, DP "
        "rank, arrival and first-token times, prompt and cached tokens, a digest of the prompt "
        "(benchmarks read it to say where prompt reuse was lost)",
    )
    _flag(sim, "--cluster", default=None, help="YAML: many engines in this one process")
    _flag(sim, "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _json_flag(flag: str, text: str | None, model: type[M]) -> M:
    if text is None:
        return model()
    try:
        return model.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag}: not valid JSON ({exc}); pass a JSON object, e.g. '{{}}'") from exc
    except ValidationError as exc:
        raise CliError(f"{flag}: {describe_errors(exc)}") from exc


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Check the flags as vLLM does and build the engine configuration."""
    dp = args.data_parallel_size
    if dp < 1:
        raise CliError("--data-parallel-size: must be at least 1")
    local = args.data_parallel_size_local
    start = args.data_parallel_start_rank
    if args.data_parallel_rank is not None:  # external LB: this server is exactly one rank
        local, start = 1, args.data_parallel_rank
    if local is None:
        local = dp - start
    if local < 1 or start < 0 or start + local > dp:
        raise CliError(
            f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} "
            f"does not fit in --data-parallel-size {dp}; ranks must be within [0, {dp})"
        )
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        raise CliError(f"--profile: {exc}") from exc
    if args.time_scale <= 0:
        raise CliError("--time-scale: must be positive (1 = real time, 10 = ten times slower)")
    kv = _json_flag("--kv-transfer-config", args.kv_transfer_config, KVTransferConfig)
    eplb = _json_flag("--eplb-config", args.eplb_config, EplbConfig)
    spec = _json_flag("--speculative-config", args.speculative_config, SpeculativeConfig)
    kv_events = _json_flag("--kv-events-config", args.kv_events_config, KVEventsConfig)
    _check_secrets(args)
    plugin = args.eplb_policy_plugin
    if plugin is not None and plugin not in policy_plugins():
        raise CliError(
            f"--eplb-policy-plugin {plugin}: not installed; installed: "
            f"{', '.join(policy_plugins()) or 'none'}"
        )
    return EngineConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name or [args.model]),
        profile=profile,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens
        or profile.prefill.max_num_batched_tokens,
        block_size=args.block_size,
        data_parallel_size=dp,
        data_parallel_size_local=local,
        data_parallel_start_rank=start,
        hybrid_lb=args.data_parallel_hybrid_lb,
        enable_expert_parallel=args.enable_expert_parallel,
        kv_transfer=kv,
        kv_events=kv_events,
        enable_eplb=args.enable_eplb,
        eplb=eplb,
        speculative=spec,
        side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", args.host),
        side_channel_port=int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
        eplb_agent_port=args.eplb_agent_port,
        eplb_policy_plugin=args.eplb_policy_plugin,
        eplb_agent_token_file=args.eplb_agent_token_file,
        eplb_agent_insecure=args.eplb_agent_insecure,
        eplb_agent_tls_cert=args.eplb_agent_tls_cert,
        eplb_agent_tls_key=args.eplb_agent_tls_key,
        # vLLM's precedence: --api-key, else VLLM_API_KEY.
        api_keys=tuple(k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k),
        shutdown_timeout=args.shutdown_timeout,
        time_scale=args.time_scale,
        shared_gpu=args.shared_gpu,
        seed=args.seed,
        dcgm_port=args.dcgm_port,
        dcgm_hostname=args.dcgm_hostname,
        dcgm_noise=args.dcgm_noise,
        fault_injection_token_file=args.fault_injection_token_file
        if args.enable_fault_injection
        else None,
        request_log=args.request_log,
        dev_mode=bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0") or "0")),
    )


def _check_secrets(args: argparse.Namespace) -> None:
    if (args.eplb_agent_tls_cert is None) != (args.eplb_agent_tls_key is None):
        raise CliError(
            "--eplb-agent-tls-cert and --eplb-agent-tls-key go together; pass both or neither"
        )
    if args.eplb_agent_token_file is not None and args.eplb_agent_insecure:
        raise CliError(
            "--eplb-agent-insecure and --eplb-agent-token-file contradict each other; pass one"
        )
    if args.eplb_agent_token_file is not None:
        try:
            read_token(args.eplb_agent_token_file)
        except ValueError as exc:
            raise CliError(f"--eplb-agent-token-file: {exc}") from exc
    if args.enable_fault_injection != (args.fault_injection_token_file is not None):
        raise CliError(
            "--enable-fault-injection and --fault-injection-token-file go together: POST "
            "/sim/faults answers only callers with the token in that file; pass both or neither"
        )
    if args.fault_injection_token_file is not None:
        try:
            read_token(args.fault_injection_token_file)
        except ValueError as exc:
            raise CliError(f"--fault-injection-token-file: {exc}") from exc
    for flag, path in (
        ("--eplb-agent-tls-cert", args.eplb_agent_tls_cert),
        ("--eplb-agent-tls-key", args.eplb_agent_tls_key),
    ):
        if path is not None and not os.access(path, os.R_OK):
            raise CliError(f"{flag}: cannot read {path}; pass a readable PEM file")


async def _serve_until_signal(start: Callable[[], Awaitable[SimProcess]]) -> None:
    process = await start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await process.stop()


def split_unknown_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Separate vLLM flags the simulator does not model (with their values) from the rest.

    A flag the parser does not know takes the next word as its value unless that word is a flag
    itself, as ``vllm serve`` lines are written (``--all2all-backend deepep_low_latency``).
    """
    known = set(parser._option_string_actions)
    kept: list[str] = []
    unknown: list[str] = []
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        name = word.split("=", 1)[0]
        if word.startswith("--") and name not in known:
            unknown.append(word)
            if "=" not in word and index + 1 < len(words) and not words[index + 1].startswith("-"):
                unknown.append(words[index + 1])
                index += 1
        else:
            kept.append(word)
        index += 1
    return kept, unknown


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    kept, unknown = split_unknown_flags(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(kept)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if unknown:
        log.warning("ignoring vLLM flags the simulator does not model: %s", " ".join(unknown))
    try:
        if args.cluster:
            spec = load_cluster(args.cluster)
            start = functools.partial(start_cluster, spec)
        else:
            config = config_from_args(args)
            start = functools.partial(start_single, config, args.host, args.port)
    except (CliError, ValueError) as exc:
        print(f"baton sim: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(_serve_until_signal(start))
    except OSError as exc:
        print(f"baton sim: error: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0
