"""Engine configuration: what ``baton sim`` takes from vLLM's flags, validated once.

The JSON flags (``--kv-transfer-config``, ``--eplb-config``, ``--speculative-config``) are
untrusted input parsed with pydantic, with vLLM's field names and defaults.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from baton.core.kv_events import rank_endpoint
from baton.core.profile import Profile
from baton.core.vllm_eplb import VLLM_STEP_INTERVAL, VLLM_WINDOW_SIZE

__all__ = ["EngineConfig", "EplbConfig", "KVEventsConfig", "KVTransferConfig", "SpeculativeConfig"]


class KVTransferConfig(BaseModel):
    """vLLM's ``KVTransferConfig`` fields the simulator honours (NixlConnector, pull mode)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kv_connector: str | None = None
    engine_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    kv_role: str | None = None
    kv_load_failure_policy: str = Field(default="fail", pattern="^(fail|recompute)$")
    kv_connector_extra_config: dict[str, object] = Field(default_factory=dict)

    @property
    def nixl(self) -> bool:
        return self.kv_connector in ("NixlConnector", "NixlPullConnector")

    @property
    def lease_duration_s(self) -> float:
        lease = self.kv_connector_extra_config.get("kv_lease_duration", 30)
        return float(lease) if isinstance(lease, int | float | str) else 30.0


class KVEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` fields a publisher uses (``--kv-events-config``); the publisher
    is ``zmq`` when events are enabled and none is named, as vLLM defaults it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    replay_endpoint: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str) -> str:
        rank_endpoint(endpoint, 1)  # the shape vLLM offsets per rank
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            # vLLM binds the node's IP on a port the OS picks and says which in its log only
            raise ValueError("port 0: give a port, e.g. tcp://*:5557")
        return endpoint

    @field_validator("replay_endpoint")
    @classmethod
    def _no_replay(cls, replay_endpoint: str | None) -> None:
        if replay_endpoint is not None:
            raise ValueError("the simulator keeps no replay buffer: leave replay_endpoint out")
        return None

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher in ("zmq", None)


class EplbConfig(BaseModel):
    """vLLM's ``EPLBConfig`` (0.33 names and defaults)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    window_size: int = Field(default=VLLM_WINDOW_SIZE, gt=0)
    step_interval: int = Field(default=VLLM_STEP_INTERVAL, gt=0)
    num_redundant_experts: int = Field(default=0, ge=0)
    log_balancedness: bool = False
    log_balancedness_interval: int = Field(default=1, gt=0)


class SpeculativeConfig(BaseModel):
    """The part of vLLM's speculative config that changes step shape: draft tokens per step."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    method: str | None = None
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    acceptance_rate: float | None = Field(default=None, ge=0, le=1)  # simulator-only knob


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One API server's view of its engines (local DP ranks of a DP group)."""

    model: str
    served_model_names: tuple[str, ...]
    profile: Profile
    max_model_len: int = 1_048_576
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    data_parallel_size: int = 1
    data_parallel_size_local: int = 1
    data_parallel_start_rank: int = 0
    hybrid_lb: bool = False
    enable_expert_parallel: bool = False
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    enable_eplb: bool = False
    eplb: EplbConfig = field(default_factory=EplbConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    # vLLM's --api-key (or VLLM_API_KEY): bearer tokens every /v1 route requires; () = open.
    api_keys: tuple[str, ...] = ()
    # vLLM's --shutdown-timeout: on SIGTERM, 0 aborts the requests in flight, N > 0 lets them
    # finish for up to N seconds
    shutdown_timeout: int = 0
    eplb_agent_port: int | None = None
    # --eplb-policy-plugin: the in-engine policy from an installed plugin (None: vLLM's default)
    eplb_policy_plugin: str | None = None
    group_name: str | None = None  # the decode group's name, from a cluster file
    eplb_agent_token_file: str | None = None  # the bearer token every agent call needs
    # No token: take Prepare/Commit/Abort from anyone (else refused); local tests only.
    eplb_agent_insecure: bool = False
    eplb_agent_tls_cert: str | None = None  # PEM files; both or neither
    eplb_agent_tls_key: str | None = None
    time_scale: float = 1.0
    seed: int = 0
    # --kv-events-config: publish the prefix cache's KV events as vLLM does (None: none)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    # --shared-gpu: a directory every engine on the same GPU names (sim/shared_gpu.py)
    shared_gpu: str | None = None
    # dcgm-exporter's series for each API server's GPUs (its tray) on this port, the next
    # server's on the next port (None: no exporter); their Hostname label is the tray's name
    dcgm_port: int | None = None
    dcgm_hostname: str = "tray"
    # "quiet": identical GPUs, 0.4% jitter a scrape; "rack": as a rack's GPUs look (sim/dcgm.py)
    dcgm_noise: Literal["quiet", "rack"] = "quiet"
    # POST /sim/faults, for the holders of the token in this file (None: no such route)
    fault_injection_token_file: str | None = None
    # VLLM_SERVER_DEV_MODE=1: vLLM's development endpoints (POST /reset_prefix_cache)
    dev_mode: bool = False
    # One JSON line per finished request appended here (None: no log): where it ran, what its
    # prefix cache held; benchmarks read it to say where prompt reuse was lost
    request_log: str | None = None

    @property
    def local_ranks(self) -> range:
        return range(
            self.data_parallel_start_rank,
            self.data_parallel_start_rank + self.data_parallel_size_local,
        )

    @property
    def acceptance_rate(self) -> float:
        if self.speculative.acceptance_rate is not None:
            return self.speculative.acceptance_rate
        return self.profile.decode.acceptance_rate

    @property
    def kv_capacity_blocks(self) -> int:
        tokens = self.profile.kv_cache_bytes_per_gpu / self.profile.kv_bytes_per_token
        return max(1, int(tokens // self.block_size))
