"""Cluster files: many simulated engines in one process (``baton sim --cluster FILE``).

A 2-core machine cannot run 50 simulator processes, but one event loop can host a whole rack:
a DEP32 decode group (8 hybrid-LB API servers of 4 local ranks, or one server for all 32) and
18-20 DEP2 prefill instances, each on its own port with its own NIXL side channel.

.. code-block:: yaml

    model: deepseek-ai/DeepSeek-V4.1-Flash
    served_model_name: deepseek-v4.1-flash
    host: 127.0.0.1
    time_scale: 1.0
    decode_groups:
      - {name: cell-0, data_parallel_size: 32, api_servers: 8, port: 8200,
         side_channel_port: 5700, eplb_agent_port: 50100,
         eplb_agent_token_file: /etc/baton/eplb-token/token}
      # or, in place of the agent, vLLM's in-engine EPLB with Baton's plugin:
      #    eplb_policy_plugin: baton
    prefill:
      - {name: cell-0-prefill, instances: 18, data_parallel_size: 2, port: 8100,
         side_channel_port: 5600, kv_events_port: 5557}
      # kv_events_port: instance i's DP rank r publishes its KV events on it + 2i + r
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.core.files import load_yaml_model
from baton.core.model import MODEL, SERVED_MODEL_NAME, SPECULATIVE_METHOD, SPECULATIVE_TOKENS
from baton.core.profile import load_profile
from sim.config import (
    EngineConfig,
    EplbConfig,
    KVEventsConfig,
    KVTransferConfig,
    SpeculativeConfig,
)
from sim.moe import policy_plugins

__all__ = [
    "ClusterSpec",
    "DecodeGroupSpec",
    "PrefillInstancesSpec",
    "engine_configs",
    "load_cluster",
]

_NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecodeGroupSpec(_Spec):
    name: str
    data_parallel_size: int = Field(default=32, ge=1)
    api_servers: int = Field(default=8, ge=1)
    port: int = Field(ge=1, le=65535)
    side_channel_port: int = Field(ge=1, le=65535)
    eplb_agent_port: int | None = Field(default=None, ge=1, le=65535)
    eplb_agent_token_file: str | None = Field(
        default=None,
        description="the bearer token every agent call needs (sim --eplb-agent-token-file)",
    )
    eplb_policy_plugin: str | None = Field(
        default=None, description="the in-engine EPLB policy plugin (sim --eplb-policy-plugin)"
    )
    max_num_seqs: int = Field(default=256, ge=1)
    # dcgm-exporter's series of each API server's tray, from this port up (sim --dcgm-port),
    # each tray named NAME-tray-I
    dcgm_port: int | None = Field(default=None, ge=1, le=65535)
    dcgm_noise: Literal["quiet", "rack"] = "quiet"  # sim --dcgm-noise
    enable_eplb: bool = True
    eplb: EplbConfig = Field(default_factory=EplbConfig)
    speculative: SpeculativeConfig = Field(
        default_factory=lambda: SpeculativeConfig(
            method=SPECULATIVE_METHOD, num_speculative_tokens=SPECULATIVE_TOKENS
        )
    )

    @model_validator(mode="after")
    def _policy_installed(self) -> DecodeGroupSpec:
        plugin = self.eplb_policy_plugin
        if plugin is not None and plugin not in policy_plugins():
            raise ValueError(
                f"eplb_policy_plugin {plugin!r} is not installed; installed: "
                f"{', '.join(policy_plugins()) or 'none'}"
            )
        return self

    @model_validator(mode="after")
    def _servers_divide_ranks(self) -> DecodeGroupSpec:
        if self.data_parallel_size % self.api_servers:
            raise ValueError(
                f"api_servers ({self.api_servers}) must divide data_parallel_size "
                f"({self.data_parallel_size}): each serves the same number of ranks"
            )
        return self


class PrefillInstancesSpec(_Spec):
    name: str
    instances: int = Field(ge=1)
    data_parallel_size: int = Field(default=2, ge=1)
    port: int = Field(ge=1, le=65535)
    side_channel_port: int = Field(ge=1, le=65535)
    max_num_seqs: int = Field(default=256, ge=1)
    # where instance i's DP rank 0 publishes its KV events (rank r: + r); None publishes none
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)


class ClusterSpec(_Spec):
    model: str = MODEL
    served_model_name: str = SERVED_MODEL_NAME
    host: str = "127.0.0.1"
    time_scale: float = Field(default=1.0, gt=0)
    seed: int = 0
    profile: str | None = None
    max_model_len: int = Field(default=1_048_576, ge=16)
    # POST /sim/faults on every engine, for the holders of the token in this file
    fault_injection_token_file: str | None = None
    request_log: str | None = None  # every engine's finished requests, one JSON line each
    decode_groups: list[DecodeGroupSpec] = Field(default_factory=list)
    prefill: list[PrefillInstancesSpec] = Field(default_factory=list)


def load_cluster(path: str | Path) -> ClusterSpec:
    return load_yaml_model(
        path, ClusterSpec, kind="cluster file", fix="see `baton sim --help` and sim/cluster.py"
    )


def engine_configs(spec: ClusterSpec) -> Iterator[tuple[EngineConfig, list[int], int]]:
    """Each DP group's configuration, its API server ports and ranks per server."""
    profile = load_profile(spec.profile)
    common = EngineConfig(
        model=spec.model,
        served_model_names=(spec.served_model_name,),
        profile=profile,
        max_model_len=spec.max_model_len,
        side_channel_host=spec.host,
        time_scale=spec.time_scale,
        fault_injection_token_file=spec.fault_injection_token_file,
        request_log=spec.request_log,
    )
    for index, group in enumerate(spec.decode_groups):
        per_server = group.data_parallel_size // group.api_servers
        config = replace(
            common,
            max_num_seqs=group.max_num_seqs,
            data_parallel_size=group.data_parallel_size,
            data_parallel_size_local=group.data_parallel_size,
            hybrid_lb=group.api_servers > 1,
            enable_expert_parallel=True,
            kv_transfer=KVTransferConfig(**_NIXL, engine_id=f"{group.name}-decode"),
            enable_eplb=group.enable_eplb,
            eplb=group.eplb,
            speculative=group.speculative,
            side_channel_port=group.side_channel_port,
            eplb_agent_port=group.eplb_agent_port,
            eplb_agent_token_file=group.eplb_agent_token_file,
            eplb_policy_plugin=group.eplb_policy_plugin,
            group_name=group.name,
            seed=spec.seed * 7919 + index,
            dcgm_port=group.dcgm_port,
            dcgm_hostname=f"{group.name}-tray",
            dcgm_noise=group.dcgm_noise,
        )
        yield config, [group.port + i for i in range(group.api_servers)], per_server
    for prefill in spec.prefill:
        for i in range(prefill.instances):
            config = replace(
                common,
                max_num_seqs=prefill.max_num_seqs,
                data_parallel_size=prefill.data_parallel_size,
                data_parallel_size_local=prefill.data_parallel_size,
                enable_expert_parallel=True,
                kv_transfer=KVTransferConfig(**_NIXL, engine_id=f"{prefill.name}-{i}"),
                side_channel_port=prefill.side_channel_port + i * prefill.data_parallel_size,
                seed=spec.seed * 7919 + 1000 + i,
                kv_events=KVEventsConfig(
                    enable_kv_cache_events=True,
                    endpoint=f"tcp://*:{prefill.kv_events_port + i * prefill.data_parallel_size}",
                )
                if prefill.kv_events_port is not None
                else KVEventsConfig(),
            )
            yield config, [prefill.port + i], prefill.data_parallel_size
