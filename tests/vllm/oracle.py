"""vLLM's own verdicts on what Baton sends it, answered from inside vLLM's virtualenv.

Run with the python of ``deploy/vllm/env.sh`` (vLLM 0.33 and torch, which vLLM imports at its
top; no GPU needed). It reads one JSON request per line on stdin and writes one JSON answer per
line on stdout, after a first ``{"ready": ..., "vllm": VERSION}`` line. It imports nothing of
Baton: the tests in this folder send it what Baton renders and compare.

Requests (``op``):

- ``serve``: ``argv`` is a command line after ``vllm serve``; parsed by vLLM's own ``serve``
  subcommand parser and checked by ``validate_parsed_serve_args``, then turned into engine
  arguments (``AsyncEngineArgs.from_cli_args``), which validates the JSON options with vLLM's
  config classes. Answers the engine arguments Baton cares about, or the parser's error.
- ``config``: ``kind`` (``eplb``, ``kv_transfer``, ``speculative``) and ``value``: built with
  vLLM's config class (``EPLBConfig``, ``KVTransferConfig``); a speculative config needs the
  target model's configuration to be built whole, so each of its fields is validated against
  the field's type and the method against vLLM's methods.
- ``request``: ``route`` and ``body``: validated with vLLM's request model, then turned into
  sampling parameters as vLLM's serving layer does (the max tokens it would allow, then
  ``to_sampling_params``).
- ``draft_eplb``: ``method`` and the draft's ``model_type``: whether vLLM registers an MoE draft
  with its in-engine EPLB (``draft_model_supports_eplb``, with vLLM's own DSpark rule).
- ``kv_events``: vLLM's KV events codec (``vllm.distributed.kv_events``): ``payload`` (base64
  of a batch Baton encoded) decoded with vLLM's ``KVEventBatch``, answered as plain fields;
  ``sample``: a batch vLLM's block pool would publish, encoded by vLLM (base64), with its
  fields; ``endpoints``: each endpoint and rank offset as vLLM's publisher offsets it, and
  whether it binds the endpoint or connects to it.
- ``metrics``: every ``vllm:*`` metric vLLM defines (its stat logger and the NIXL connector's),
  with type and label names, read from vLLM's installed source; the CacheConfig info gauge's
  labels from ``CacheConfig.metrics_info``.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.disable(logging.WARNING)

import vllm  # noqa: E402
from pydantic import TypeAdapter, ValidationError  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    EPLBConfig,
    KVTransferConfig,
    SpeculativeConfig,
)
from vllm.config.speculative import SpeculativeMethod  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.entrypoints.common.cli_args import validate_parsed_serve_args  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

MAX_MODEL_LEN = 1_048_576  # what the controller renders (vLLM's default comes from the model)
_ENGINE_FIELDS = (
    "data_parallel_size",
    "data_parallel_size_local",
    "data_parallel_start_rank",
    "data_parallel_address",
    "data_parallel_rpc_port",
    "data_parallel_hybrid_lb",
    "enable_expert_parallel",
    "enable_eplb",
    "served_model_name",
    "max_num_seqs",
    "max_model_len",
)


def _plain(value: Any) -> Any:
    """JSON-ready: dataclasses and pydantic dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def serve(argv: list[str]) -> dict[str, Any]:
    top = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = top.parse_args(["serve", *argv])
            validate_parsed_serve_args(args)
    except SystemExit:
        return {"ok": False, "error": errors.getvalue().strip().splitlines()[-1]}
    except (TypeError, ValueError) as exc:
        return {"ok": False, "error": str(exc)}
    args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    fields = {name: _plain(getattr(engine, name)) for name in _ENGINE_FIELDS}
    fields["model"] = engine.model
    fields["port"] = args.port
    fields["api_key"] = args.api_key
    fields["eplb_config"] = _plain(engine.eplb_config)
    fields["kv_transfer_config"] = _plain(engine.kv_transfer_config)
    fields["kv_events_config"] = _plain(engine.kv_events_config)
    fields["speculative_config"] = _plain(engine.speculative_config)
    return {"ok": True, "args": fields}


def config(kind: str, value: dict[str, Any]) -> dict[str, Any]:
    try:
        if kind == "eplb":
            return {"ok": True, "config": _plain(EPLBConfig(**value))}
        if kind == "kv_transfer":
            # The buffer device defaults to the platform's, which a GPU-less host lacks.
            return {
                "ok": True,
                "config": _plain(KVTransferConfig(kv_buffer_device="cuda", **value)),
            }
        if kind == "speculative":
            types = typing.get_type_hints(SpeculativeConfig)
            fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
            unknown = sorted(set(value) - fields)
            if unknown:
                return {"ok": False, "error": f"unknown speculative config fields {unknown}"}
            for name, field_value in value.items():
                TypeAdapter(types[name]).validate_python(field_value)
            methods = typing.get_args(SpeculativeMethod)
            if value.get("method") not in methods:
                return {"ok": False, "error": f"method {value.get('method')!r} not in {methods}"}
            return {"ok": True, "config": value}
    except (ValidationError, ValueError, TypeError) as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": False, "error": f"unknown config kind {kind!r}"}


def request(route: str, body: dict[str, Any]) -> dict[str, Any]:
    model = ChatCompletionRequest if route == "/v1/chat/completions" else CompletionRequest
    try:
        parsed = model.model_validate(body)
        if isinstance(parsed, ChatCompletionRequest):
            wanted = parsed.max_completion_tokens or parsed.max_tokens
        else:
            wanted = parsed.max_tokens
        # vLLM's serving layer allows at most what is left of the context (the prompt is short).
        max_tokens = min(wanted, MAX_MODEL_LEN) if wanted is not None else MAX_MODEL_LEN
        sampling = parsed.to_sampling_params(max_tokens, {})
    except (ValidationError, VLLMValidationError, ValueError) as exc:
        return {"ok": False, "status": 400, "error": str(exc)}
    return {
        "ok": True,
        "stream": bool(parsed.stream),
        "stream_options": _plain(parsed.stream_options),
        "kv_transfer_params": _plain(parsed.kv_transfer_params),
        "return_token_ids": getattr(parsed, "return_token_ids", None),
        "prompt": _plain(getattr(parsed, "prompt", None)),
        "sampling": {
            "max_tokens": sampling.max_tokens,
            "min_tokens": sampling.min_tokens,
            "ignore_eos": sampling.ignore_eos,
            "extra_args": _plain(sampling.extra_args),
        },
    }


def _labels(node: ast.expr) -> list[str] | None:
    """A ``labelnames=`` expression: the stat loggers' ``labelnames`` (model_name, engine),
    list literals, and their sums."""
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return ["model_name", "engine"]
    if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) for e in node.elts):
        return [str(e.value) for e in node.elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _labels(node.left), _labels(node.right)
        return left + right if left is not None and right is not None else None
    return None


def metrics() -> dict[str, Any]:
    root = Path(vllm.__file__).parent
    sources = [
        root / "v1/metrics/loggers.py",
        root / "distributed/kv_transfer/kv_connector/v1/nixl/stats.py",
    ]
    found: dict[str, dict[str, Any]] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            name = keywords.get("name")
            if not (isinstance(name, ast.Constant) and str(name.value).startswith("vllm:")):
                continue
            callee = ast.unparse(node.func).lower()
            kind = next((k for k in ("gauge", "counter", "histogram") if k in callee), None)
            labels = _labels(keywords["labelnames"]) if "labelnames" in keywords else None
            found[str(name.value)] = {"type": kind, "labels": labels}
    # An info gauge, named at run time: every CacheConfig field a label, and the engine
    # (log_metrics_info in v1/metrics/loggers.py).
    found["vllm:cache_config_info"] = {
        "type": "gauge",
        "labels": [*CacheConfig().metrics_info(), "engine"],
        "info": True,
    }
    return {"ok": True, "metrics": found}


def draft_eplb(method: str, model_type: str) -> dict[str, Any]:
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.eplb_utils import draft_model_supports_eplb

    speculative = SimpleNamespace(
        method=method,
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)),
    )
    moe_draft = object()  # any MoE draft: vLLM asks only whether there is one
    return {"ok": True, "balanced": draft_model_supports_eplb(speculative, moe_draft)}


def kv_events(
    payload: str | None, sample: bool, endpoints: list[tuple[str, int]]
) -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    answer: dict[str, Any] = {"ok": True}
    if payload is not None:
        try:
            batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(base64.b64decode(payload))
        except msgspec.DecodeError as exc:
            return {"ok": False, "error": str(exc)}
        answer["decoded"] = {
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": [
                {"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events
            ],
        }
    if sample:
        stored = BlockStored(
            block_hashes=[2**63 + 5, 17],
            parent_block_hash=9,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            session_id="chat-7",
        )
        removed = BlockRemoved(block_hashes=[9], medium="GPU", group_idx=0)
        batch = KVEventBatch(ts=1.5, events=[stored, removed, AllBlocksCleared()])
        batch.data_parallel_rank = 3  # as the publisher stamps it
        answer["sample"] = base64.b64encode(msgspec.msgpack.Encoder().encode(batch)).decode()
        answer["sample_fields"] = {
            "ts": 1.5,
            "data_parallel_rank": 3,
            "events": [
                {"type": "BlockStored", **msgspec.structs.asdict(stored)},
                {"type": "BlockRemoved", **msgspec.structs.asdict(removed)},
                {"type": "AllBlocksCleared"},
            ],
        }
    answer["endpoints"] = [
        ZmqEventPublisher.offset_endpoint_port(endpoint, rank) for endpoint, rank in endpoints
    ]
    answer["binds"] = [ZmqEventPublisher._is_bind_endpoint(endpoint) for endpoint, _ in endpoints]
    return answer


def answer(query: dict[str, Any]) -> dict[str, Any]:
    op = query.get("op")
    if op == "serve":
        return serve(query["argv"])
    if op == "config":
        return config(query["kind"], query["value"])
    if op == "request":
        return request(query["route"], query["body"])
    if op == "metrics":
        return metrics()
    if op == "draft_eplb":
        return draft_eplb(query["method"], query["model_type"])
    if op == "kv_events":
        return kv_events(
            query.get("payload"), query.get("sample", False), query.get("endpoints", [])
        )
    return {"ok": False, "error": f"unknown op {op!r}"}


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything vLLM prints must not break the protocol
    out.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(answer(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
