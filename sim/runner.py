"""Starting and stopping simulated engines inside one event loop.

A :class:`SimProcess` owns DP groups, their API servers and EPLB agents; ``start_single`` builds
what one ``baton sim`` command line describes and ``start_cluster`` what a cluster file does
(a DEP32 decode group and its DEP2 prefill instances on separate ports, for the local stack).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from baton.core.secrets import read_token
from sim.agent import EplbAgentServer
from sim.cluster import ClusterSpec, engine_configs
from sim.config import EngineConfig
from sim.dcgm import DcgmExporter
from sim.engine import DPGroup, SimClock
from sim.server import ApiServer

__all__ = ["SimProcess", "start_cluster", "start_single"]

log = logging.getLogger("baton.sim")


@dataclass(slots=True)
class SimProcess:
    groups: list[DPGroup] = field(default_factory=list)
    servers: list[ApiServer] = field(default_factory=list)
    agents: list[EplbAgentServer] = field(default_factory=list)
    exporters: list[DcgmExporter] = field(default_factory=list)

    async def stop(self) -> None:
        for exporter in self.exporters:
            await exporter.stop()
        for agent in self.agents:
            await agent.stop()
        for server in self.servers:
            await server.stop()
        for group in self.groups:
            await group.stop()


async def start_group(
    process: SimProcess,
    clock: SimClock,
    config: EngineConfig,
    host: str,
    ports: list[int],
    ranks_per_server: int,
) -> DPGroup:
    """One DP group of ``config`` served by ``len(ports)`` API servers of consecutive ranks."""
    group = DPGroup(config, clock, config.local_ranks)
    group.start()
    process.groups.append(group)
    for index, port in enumerate(ports):
        first = config.data_parallel_start_rank + index * ranks_per_server
        server_config = config
        if len(ports) > 1:  # each API server's side channel: base port + its local index
            server_config = _with_side_channel(
                config, config.side_channel_port + index * ranks_per_server
            )
        server = ApiServer(
            server_config, group, range(first, first + ranks_per_server), host=host, port=port
        )
        await server.start()
        process.servers.append(server)
        if config.dcgm_port is not None:  # one exporter per tray, as dcgm-exporter per node
            hostname = (
                config.dcgm_hostname if len(ports) == 1 else f"{config.dcgm_hostname}-{index}"
            )
            exporter = DcgmExporter(
                group,
                range(first, first + ranks_per_server),
                hostname,
                host,
                config.dcgm_port + index,
                config.seed,
                noise=config.dcgm_noise,
            )
            await exporter.start()
            process.exporters.append(exporter)
    if config.eplb_agent_port is not None and group.moe is not None:
        agent = EplbAgentServer(
            group,
            host,
            config.eplb_agent_port,
            token=read_token(config.eplb_agent_token_file)
            if config.eplb_agent_token_file
            else None,
            insecure=config.eplb_agent_insecure,
            tls_cert=_read_pem(config.eplb_agent_tls_cert),
            tls_key=_read_pem(config.eplb_agent_tls_key),
        )
        await agent.start()
        process.agents.append(agent)
    return group


def _read_pem(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _with_side_channel(config: EngineConfig, port: int) -> EngineConfig:
    return replace(config, side_channel_port=port)


async def start_single(config: EngineConfig, host: str, port: int) -> SimProcess:
    process = SimProcess()
    clock = SimClock(config.time_scale)
    await start_group(process, clock, config, host, [port], config.data_parallel_size_local)
    log.info(
        "baton sim serving %s on http://%s:%d (DP ranks %d-%d of %d, time scale %g)",
        config.served_model_names[0],
        host,
        port,
        config.local_ranks.start,
        config.local_ranks.stop - 1,
        config.data_parallel_size,
        config.time_scale,
    )
    return process


async def start_cluster(spec: ClusterSpec) -> SimProcess:

    assert isinstance(spec, ClusterSpec)
    process = SimProcess()
    clock = SimClock(spec.time_scale)
    try:
        for config, ports, ranks_per_server in engine_configs(spec):
            await start_group(process, clock, config, spec.host, ports, ranks_per_server)
    except BaseException:
        await process.stop()
        raise
    log.info(
        "baton sim cluster: %d DP groups, %d API servers on %s",
        len(process.groups),
        len(process.servers),
        spec.host,
    )
    return process
