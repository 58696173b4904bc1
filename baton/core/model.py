"""The model Baton is built for: its names and the shape of its routed experts.

DeepSeek-V4.1-Flash with its DSpark draft (an MTP-style model). The resource's defaults, the
simulator, ``baton up``, the EPLB service and the benchmarks read these; nothing else states them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BYTES_PER_TOKEN",
    "DRAFT",
    "EXPERT_BYTES",
    "MODEL",
    "SERVED_MODEL_NAME",
    "SPECULATIVE_METHOD",
    "SPECULATIVE_TOKENS",
    "TARGET",
    "MoEModel",
    "draft_balanced_in_engine",
]

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
SERVED_MODEL_NAME = "deepseek-v4.1-flash"

# UTF-8 bytes of text per token: the gateway's estimate of a prompt's length without the model's
# tokenizer, and the exact rule of the simulator's tokenizer (so against it the estimate is exact).
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class MoEModel:
    """Shape of one model's routed-expert layers."""

    name: str
    layers: int
    experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.layers <= 0 or self.experts <= 0 or not 0 < self.top_k <= self.experts:
            raise ValueError(f"invalid MoE shape {self}")


# DeepSeek-V4.1-Flash: 43 MoE layers, 384 routed experts, top-6.
TARGET = MoEModel("target", layers=43, experts=384, top_k=6)
# DSpark is an MTP-style draft: like DeepSeek's MTP module it is a single transformer block, so
# one MoE layer (128 routed experts, top-3) whose balance is that layer's balance.
DRAFT = MoEModel("draft", layers=1, experts=128, top_k=3)
# How the study serves the draft: vLLM's speculative method "dspark", 5 draft tokens a step
# (1 + 5 tokens a request a step).
SPECULATIVE_METHOD = "dspark"
SPECULATIVE_TOKENS = 5


def draft_balanced_in_engine(
    method: str | None, draft: MoEModel = DRAFT, target: MoEModel = TARGET
) -> bool:
    """Whether vLLM 0.33's in-engine EPLB balances the draft's experts too. It registers every
    MoE draft except a DSpark draft that does not reuse the target's expert layout
    (``draft_model_supports_eplb`` in vllm/v1/worker/gpu/eplb_utils.py; by
    ``dspark_draft_supports_eplb``, only DeepSeek-V4 DSpark drafts share it, V4.1's have fewer
    routed experts and log "EPLB is disabled for the DSpark draft model"). So DeepSeek-V4.1-Flash's
    DSpark draft (128 experts against 384) keeps vLLM's plain layout; an MTP draft is balanced."""
    return method != "dspark" or draft.experts == target.experts


# Weight bytes of one routed expert of one layer, what an EPLB switch copies per expert moved.
# DeepSeek-V4-Flash's published shape (hidden size 4096, expert intermediate size 2048, SwiGLU:
# three 4096 x 2048 matrices) in FP4 with one 8-bit scale per 32 weights (4.25 bits a weight):
# 3 * 4096 * 2048 * 4.25 / 8 bytes, about 13.4 MB. V4.1-Flash is assumed to keep the shape.
EXPERT_BYTES = 3 * 4096 * 2048 * 4.25 / 8
