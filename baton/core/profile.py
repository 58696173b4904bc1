"""The performance profile: the constants of the simulator's performance model.

Loaded from YAML (``--profile FILE``); the default profile for DeepSeek-V4.1-Flash on GB300 ships
with the package. Profiles are untrusted input, so they are validated with pydantic and a bad
file is reported with the file, the field and the fix.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from baton.core.files import describe_errors

__all__ = [
    "DEFAULT_PROFILE",
    "DecodeProfile",
    "FrontendProfile",
    "NVLinkProfile",
    "PrefillProfile",
    "Profile",
    "ProfileError",
    "SharedGpuProfile",
    "load_profile",
    "shipped_profiles",
]

DEFAULT_PROFILE = "deepseek-v4.1-flash-gb300.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillProfile(_Strict):
    step_overhead_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    per_token_context_s: float = Field(ge=0)
    # a chunk reads its whole context's KV once, whatever its length: what a short prompt on a
    # long cached prefix pays (memory-bound); 0 where the profile was not measured for it
    context_read_per_token_s: float = Field(0.0, ge=0)
    max_num_batched_tokens: PositiveInt = 8192


class DecodeProfile(_Strict):
    moe_fixed_s: float = Field(ge=0)
    moe_per_token_s: float = Field(ge=0)
    rest_fixed_s: float = Field(ge=0)
    rest_per_token_s: float = Field(ge=0)
    attention_per_context_token_s: float = Field(ge=0)
    reference_balance: float = Field(gt=0, le=1)
    draft_fixed_s: float = Field(ge=0)
    draft_per_token_s: float = Field(ge=0)
    acceptance_rate: float = Field(ge=0, le=1)
    expert_bytes: PositiveFloat


class NVLinkProfile(_Strict):
    bandwidth_bytes_per_s: PositiveFloat
    latency_s: float = Field(ge=0)


class SharedGpuProfile(_Strict):
    """How much an engine's step stretches for each peer stepping beside it on one GPU
    (``baton sim --shared-gpu``): CUDA time-slices the engines' contexts, and not evenly, nor
    over a whole step (the host's part of a step runs beside a peer's kernels). Each figure is
    the stretch one busy peer of that kind adds to a step of this kind, as ``baton bench gpu
    --step share`` measures it (a pair's stretch less 1). 1 each: steps that are GPU work
    throughout, shared evenly."""

    prefill_beside_prefill: float = Field(default=1.0, ge=0)
    prefill_beside_decode: float = Field(default=1.0, ge=0)
    decode_beside_prefill: float = Field(default=1.0, ge=0)
    decode_beside_decode: float = Field(default=1.0, ge=0)


class FrontendProfile(_Strict):
    """An engine's API server, between a request's arrival and its engine core's queue (vLLM
    stamps the arrival first): ``request_s`` for every request, and for a prompt sent as text,
    its tokenizing, ``tokenize_per_token_s`` a token on the server's one tokenizing thread
    (vLLM's ``renderer_num_workers``, 1 by default), so that prompts queue for it. 0: none."""

    request_s: float = Field(default=0.0, ge=0)
    tokenize_per_token_s: float = Field(default=0.0, ge=0)


class Profile(_Strict):
    model: str
    hardware: str
    kv_bytes_per_token: PositiveInt
    kv_cache_bytes_per_gpu: PositiveFloat
    mean_output_tokens: PositiveInt
    prefill: PrefillProfile
    decode: DecodeProfile
    nvlink: NVLinkProfile
    shared_gpu: SharedGpuProfile = SharedGpuProfile()
    frontend: FrontendProfile = FrontendProfile()


class ProfileError(ValueError):
    """A profile file is missing, not YAML, or has a field out of range."""


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with the simulator (``--profile NAME``)."""
    files = resources.files("baton.core.profiles").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_profile(path: str | Path | None = None) -> Profile:
    """Read a profile from ``path``, a shipped profile's name, or the default profile."""
    name = DEFAULT_PROFILE.removesuffix(".yaml") if path is None else str(path)
    if not Path(name).exists() and name in shipped_profiles():
        text = resources.files("baton.core.profiles").joinpath(f"{name}.yaml").read_text()
        source = f"<shipped profile {name}>"
    else:
        source = name
        try:
            text = Path(name).read_text()
        except OSError as exc:
            raise ProfileError(
                f"{source}: cannot read the profile ({exc.strerror}); give a YAML file or one "
                f"of the shipped profiles: {', '.join(shipped_profiles())}"
            ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML ({exc})") from exc
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(
            f"{source}: {describe_errors(exc)}. Fix the field, or start from the default profile "
            f"baton/core/profiles/{DEFAULT_PROFILE}"
        ) from exc
