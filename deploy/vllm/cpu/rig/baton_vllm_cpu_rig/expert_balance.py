"""What vLLM's EPLB needs on a CPU, and what the EPLB plugin's live tests watch it through.

vLLM 0.32's EPLB is written for GPUs; four shims let its synchronous mode run on the CPU build
(the live tests also set ``"use_async": false``: the asynchronous worker thread needs a device
index, which a CPU has not). Each stands in for what the GPU build does as shipped:

- ``ParallelConfig`` refuses ``--enable-eplb`` unless the platform is CUDA-like or XPU; the shim
  answers that check (and only that one) as a CUDA platform would.
- The EPLB modules time and order their transfers with ``torch.Event``, ``torch.Stream`` and
  ``torch.accelerator``; the PyPI torch reports CUDA as its accelerator, so the first
  ``Event.record()`` fails for want of a driver. On a CPU every copy is done when it returns:
  the shim's events and streams do nothing (an event keeps the wall time, for vLLM's log line).
- Only the GPU model runner builds the ``EplbState`` in ``load_model``; the shim builds it the same
  way in the CPU runner, which the GPU runner's stepping then drives.
- The router maps each token's logical expert to a physical replica and counts the load in one
  Triton kernel on CUDA and XPU, and does neither on other platforms (a silent no-op: no load, and
  tokens sent to the wrong slots after the first rearrangement). The shim does the kernel's work
  in torch: the same replica choice (a Knuth multiplicative hash of the token index) and the same
  counting (unpadded tokens, only while recording).

Two test hooks, off unless their variable is set:

- ``BATON_RIG_EPLB_PLACEMENTS=DIR``: after every rearrangement each EP rank appends one JSON line
  to ``DIR/ep-rank-<rank>.jsonl`` with, per model, the load the policy was given and the
  placement before and after (``[layer][physical slot]`` logical experts).
- ``BATON_RIG_EPLB_FAULT=FILE``: while FILE exists, Baton's algorithm raises inside the plugin
  (a stand-in for any bug of Baton's), so a test sees vLLM's own policy take that window; an
  engine without the plugin ignores it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import types
from pathlib import Path
from typing import Any

PLACEMENTS_ENV = "BATON_RIG_EPLB_PLACEMENTS"
FAULT_ENV = "BATON_RIG_EPLB_FAULT"
# floor(2**32 / golden ratio): the replica hash of vLLM's Triton kernel
KNUTH_MULTIPLIER = 2654435769


class _CudaAlikePlatform:
    """vLLM's CPU platform, answering ``is_cuda_alike`` as the GPU build does."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def is_cuda_alike(self) -> bool:
        return True


class _Event:
    """A device event on a device whose work is done when the call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._at = time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self._at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end._at - self._at) * 1000.0


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _Accelerator:
    """``torch.accelerator`` for a host with none: one stream, always done."""

    def __init__(self, torch: Any) -> None:
        self._device = torch.device("cpu")
        self._stream = _Stream()

    def is_available(self) -> bool:
        return False

    def current_accelerator(self) -> Any:
        return self._device

    def current_device_index(self) -> int:
        return 0

    def set_device_index(self, index: int) -> None:
        pass

    def current_stream(self, device: Any = None) -> _Stream:
        return self._stream

    def set_stream(self, stream: Any) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass


class _CpuTorch(types.ModuleType):
    """``torch`` as the EPLB modules see it: itself, but for events, streams and accelerator."""

    def __init__(self, torch: Any) -> None:
        super().__init__("torch")
        self._torch = torch
        self.Event = _Event
        self.Stream = _Stream
        self.accelerator = _Accelerator(torch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _map_to_physical_and_record(
    topk_ids: Any,
    expert_load_view: Any,
    logical_to_physical_map: Any,
    logical_replica_count: Any,
    record_enabled: Any,
    num_unpadded_tokens: Any = None,
) -> Any:
    """vLLM's ``_eplb_map_and_record_i32_kernel`` in torch, element for element."""
    import torch

    if topk_ids.numel() == 0:
        return topk_ids
    num_active = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < logical_replica_count.shape[0])
    safe = torch.where(valid, ids, 0)
    replicas = torch.where(valid, logical_replica_count[safe].to(torch.int64), 1).clamp(min=1)
    position = torch.arange(ids.numel(), dtype=torch.int64)
    hashed = ((position // num_active) * KNUTH_MULTIPLIER) & 0xFFFFFFFF
    physical = logical_to_physical_map[safe, hashed % replicas].to(torch.int64)
    physical = torch.where(valid, physical, -1)
    if bool(record_enabled.reshape(-1)[0]):
        counted = (physical >= 0) & (physical < expert_load_view.shape[0])
        if num_unpadded_tokens is not None:
            counted &= position < int(num_unpadded_tokens.reshape(-1)[0]) * num_active
        expert_load_view.index_add_(
            0,
            physical[counted],
            torch.ones(int(counted.sum()), dtype=expert_load_view.dtype),
        )
    return physical.to(topk_ids.dtype).reshape(topk_ids.shape)


def _with_eplb_state(load_model: Any) -> Any:
    def load_model_with_eplb_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

        result = load_model(self, *args, **kwargs)
        if self.parallel_config.enable_eplb:
            self.eplb_state = EplbState(self.parallel_config, self.device)
            self._moe_model = get_mixture_of_experts_model(self.model)
            if self._moe_model is not None:
                self.eplb_state.add_model(self._moe_model, self.model_config)
        return result

    load_model_with_eplb_state.baton_rig = True  # type: ignore[attr-defined]
    return load_model_with_eplb_state


def _recording_placements(rearrange: Any, directory: Path) -> Any:
    def rearrange_and_record(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.distributed.parallel_state import get_ep_group

        if kwargs.get("is_profile", args[0] if args else False):
            return rearrange(self, *args, **kwargs)
        before = {
            name: state.physical_to_logical_map.tolist()
            for name, state in self.model_states.items()
        }
        result = rearrange(self, *args, **kwargs)
        line = {
            name: {
                "load": state.last_expert_load.tolist(),
                "before": before[name],
                "after": state.physical_to_logical_map.tolist(),
                "num_replicas": state.model.num_physical_experts,
                "num_groups": state.model.num_expert_groups,
            }
            for name, state in self.model_states.items()
        }
        rank = get_ep_group().rank_in_group
        with (directory / f"ep-rank-{rank}.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        return result

    rearrange_and_record.baton_rig = True  # type: ignore[attr-defined]
    return rearrange_and_record


def _failing_while(rebalance: Any, fault: Path) -> Any:
    def rebalance_unless_faulted(*args: Any, **kwargs: Any) -> Any:
        if fault.exists():
            raise RuntimeError(f"fault injected by the test rig ({fault} exists)")
        return rebalance(*args, **kwargs)

    rebalance_unless_faulted.baton_rig = True  # type: ignore[attr-defined]
    return rebalance_unless_faulted


def register() -> None:
    import torch
    import vllm.config.parallel as parallel
    from vllm.distributed.eplb import eplb_communicator, eplb_state, eplb_utils
    from vllm.model_executor.layers.fused_moe.router import base_router
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if not isinstance(parallel.current_platform, _CudaAlikePlatform):
        parallel.current_platform = _CudaAlikePlatform(parallel.current_platform)
    cpu_torch = _CpuTorch(torch)
    for module in (eplb_state, eplb_communicator, eplb_utils):
        module.torch = cpu_torch
    base_router.eplb_map_to_physical_and_record = _map_to_physical_and_record
    if not getattr(CPUModelRunner.load_model, "baton_rig", False):
        CPUModelRunner.load_model = _with_eplb_state(CPUModelRunner.load_model)

    placements = os.environ.get(PLACEMENTS_ENV)
    if placements and not getattr(eplb_state.EplbState.rearrange, "baton_rig", False):
        eplb_state.EplbState.rearrange = _recording_placements(
            eplb_state.EplbState.rearrange, Path(placements)
        )
    fault = os.environ.get(FAULT_ENV)
    if fault and importlib.util.find_spec("eplb") is not None:
        from eplb import vllm_plugin  # Baton's plugin, on the EPLB engines' PYTHONPATH

        if not getattr(vllm_plugin.rebalance, "baton_rig", False):
            vllm_plugin.rebalance = _failing_while(vllm_plugin.rebalance, Path(fault))
