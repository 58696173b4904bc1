"""One cell of Baton as separate processes on loopback, each one killable, freezable and
restartable: what the chaos suite (``bench/chaos.py``, ``tests/chaos``) injects faults into.

Unlike ``baton up`` (every engine in one ``baton sim --cluster`` process), each engine here is a
process of its own, so one can be killed with SIGKILL or stopped with SIGSTOP as a crashed or
hung pod would be:

- prefill instances: one ``baton sim`` DEP2 each (NIXL, a short KV lease so that KV left by a
  decode side that died is freed within a run);
- one decode group: ``servers`` hybrid-LB ``baton sim`` servers of 4 ranks each, as the
  controller renders a decode pod per tray, each with its EPLB agent behind a token;
- the EPLB service, agent mode, on a short cadence so that switches happen within a run; it
  reaches each decode server's agent through an :class:`AgentLink`, a link that can be cut;
- ``gateways`` replicas of ``baton gateway`` on one pool file, with deadlines short enough
  that a stalled engine is given up on within a run.

Every engine takes ``POST /sim/faults`` (``slow``, ``stall``, ...) from :attr:`ChaosStack.faults`.
A decode server that dies takes its group with it (a wide-EP group cannot lose a rank), so
:meth:`ChaosStack.restart_decode_group` stops every server of the group and starts them all
again, as the controller's group restart does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import yaml

from baton.core.proto import eplb_agent_pb2 as pb
from rigs.faults import FaultInjection
from rigs.processes import (
    baton_command,
    eventually,
    free_port,
    free_port_block,
    stop_process,
    wait_healthy,
)

__all__ = ["AgentLink", "ChaosStack", "Component", "Deadlines"]

RANKS_PER_SERVER = 4
PREFILL_DP = 2
KV_LEASE_S = 10  # simulated seconds prefill holds KV for a decode side that never pulls it
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


@dataclass(frozen=True, slots=True)
class Deadlines:
    """The gateway's deadlines in the chaos stack, short enough that a run outlives them."""

    prefill_s: float = 20.0
    first_token_s: float = 20.0
    idle_s: float = 8.0
    stall_after_s: float = 3.0
    health_interval_s: float = 0.5

    def flags(self) -> list[str]:
        return [
            *("--prefill-timeout", str(self.prefill_s)),
            *("--first-token-timeout", str(self.first_token_s)),
            *("--idle-timeout", str(self.idle_s)),
            *("--stall-after", str(self.stall_after_s)),
            *("--health-interval", str(self.health_interval_s)),
        ]


@dataclass(slots=True)
class Component:
    """One process of the stack: how to start it, and what it is doing now."""

    name: str
    role: str  # prefill, decode, eplb, gateway
    command: list[str]
    log_path: Path
    health_url: str | None = None  # /health answers 200 once it serves
    url: str | None = None  # what clients and the gateways call
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    frozen: bool = False
    starts: int = 0

    def start(self) -> None:
        """Start the process, unless it runs already: of faults that overlap on one component,
        the first to end restarts it and the others find it up."""
        if self.alive:
            return
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        log.close()
        self.frozen = False
        self.starts += 1

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.process is not None
        if self.health_url is not None:
            wait_healthy(self.health_url, self.process, self.log_path, timeout=timeout)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed pod or an OOM kill: no cleanup, connections reset."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP, as a hung process or a tray off the network: connections stay open and
        nothing answers."""
        if self.alive and not self.frozen:
            assert self.process is not None
            self.process.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.alive and self.frozen:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        self.thaw()
        if self.process is not None:
            stop_process(self.process)


Context = grpc.aio.ServicerContext[bytes, bytes]


def _as_is(data: bytes) -> bytes:
    """The relay's (de)serializer: messages pass as the bytes they came as."""
    return data


class AgentLink:
    """A gRPC relay from a free loopback port to the EPLB agent at ``upstream``, on an event
    loop of its own thread: every call goes through as it is (metadata and deadline too), so the
    link can watch the two-phase switch and cut it at its one racy point. :meth:`hold_commits`
    makes each Commit wait in the relay, as over a link cut just before it; :meth:`drop` fails
    the held Commits unsent (UNAVAILABLE, as a partition that heals with its connections reset)
    and lets Commits through again. :meth:`committed` names the switches whose Commit the agent
    accepted through the link."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.address = f"127.0.0.1:{free_port()}"
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._committed: set[str] = set()
        self._drops = 0
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"link-{upstream}", daemon=True
        )
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError(f"the link to {upstream} did not start within 30 s")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._open = asyncio.Event()
        self._open.set()
        self._channel = grpc.aio.insecure_channel(self.upstream)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers([_Relay(self)])
        self._server.add_insecure_port(self.address)
        self._loop.run_until_complete(self._server.start())
        started.set()
        self._loop.run_forever()

    def hold_commits(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def drop(self) -> None:
        def cut() -> None:
            self._drops += 1
            self._open.set()

        self._loop.call_soon_threadsafe(cut)

    def held(self) -> set[str]:
        """The switch ids of the Commits waiting in the link."""
        with self._lock:
            return set(self._held)

    def committed(self) -> set[str]:
        with self._lock:
            return set(self._committed)

    async def _commit(self, method: str, request: bytes, context: Context) -> bytes:
        switch_id = pb.CommitRequest.FromString(request).switch_id
        if not self._open.is_set():
            drops = self._drops
            with self._lock:
                self._held.add(switch_id)
            try:
                await self._open.wait()
            finally:
                with self._lock:
                    self._held.discard(switch_id)
            if self._drops != drops:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the link was cut")
        reply = await self._unary(method, request, context)
        if pb.CommitResponse.FromString(reply).ok:
            with self._lock:
                self._committed.add(switch_id)
        return reply

    async def _unary(self, method: str, request: bytes, context: Context) -> bytes:
        try:
            reply: bytes = await self._channel.unary_unary(method, _as_is, _as_is)(
                request, metadata=_forwarded(context), timeout=context.time_remaining()
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        return reply

    async def _stream(self, method: str, request: bytes, context: Context) -> AsyncIterator[bytes]:
        call = self._channel.unary_stream(method, _as_is, _as_is)(
            request, metadata=_forwarded(context), timeout=context.time_remaining()
        )
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        finally:
            call.cancel()

    def close(self) -> None:
        async def stop() -> None:
            await self._server.stop(0)
            await self._channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class _Relay(grpc.GenericRpcHandler):
    """Every method of the EPLB agent's service, forwarded by an :class:`AgentLink` as bytes."""

    def __init__(self, link: AgentLink) -> None:
        self._link = link

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method: str = handler_call_details.method
        link = self._link
        if method.endswith("/StreamLoad"):
            return grpc.unary_stream_rpc_method_handler(functools.partial(link._stream, method))
        if method.endswith("/Commit"):
            return grpc.unary_unary_rpc_method_handler(functools.partial(link._commit, method))
        return grpc.unary_unary_rpc_method_handler(functools.partial(link._unary, method))


def _forwarded(context: Context) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata (its bearer token), less what gRPC sets on every call itself."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith((":", "grpc-")) and key != "user-agent"
    )


class ChaosStack:
    """The processes of one cell on loopback (see the module doc), started by :meth:`start`."""

    def __init__(
        self,
        directory: Path,
        *,
        prefill: int = 2,
        decode_servers: int = 2,
        gateways: int = 2,
        time_scale: float = 2.0,
        eplb_steps: int = 200,
        deadlines: Deadlines = Deadlines(),
    ) -> None:
        self.directory = directory
        self.time_scale = time_scale
        self.deadlines = deadlines
        self.faults = FaultInjection(directory)
        self.agent_token = directory / "eplb-agent-token"
        self.agent_token.touch(mode=0o600)
        self.agent_token.write_text(secrets.token_urlsafe(24))
        scale = ("--time-scale", str(time_scale))
        kv_prefill = NIXL | {"kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}}
        self.prefill: list[Component] = []
        for index in range(prefill):
            port = free_port()
            self.prefill.append(
                Component(
                    f"prefill-{index}",
                    "prefill",
                    baton_command(
                        "sim",
                        *("--port", str(port), "--data-parallel-size", str(PREFILL_DP)),
                        *("--kv-transfer-config", json.dumps(kv_prefill)),
                        *self.faults.flags,
                        *scale,
                        *("--log-level", "warning"),
                    ),
                    directory / f"prefill-{index}.log",
                    health_url=f"http://127.0.0.1:{port}",
                    url=f"http://127.0.0.1:{port}",
                    env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(PREFILL_DP))},
                )
            )
        ranks = decode_servers * RANKS_PER_SERVER
        self.decode: list[Component] = []
        self.agents: list[str] = []
        for index in range(decode_servers):
            port, agent = free_port(), free_port()
            self.agents.append(f"127.0.0.1:{agent}")
            self.decode.append(
                Component(
                    f"decode-{index}",
                    "decode",
                    baton_command(
                        "sim",
                        *("--port", str(port), "--data-parallel-size", str(ranks)),
                        *("--data-parallel-size-local", str(RANKS_PER_SERVER)),
                        *("--data-parallel-start-rank", str(index * RANKS_PER_SERVER)),
                        *("--data-parallel-hybrid-lb", "--enable-expert-parallel"),
                        *("--kv-transfer-config", json.dumps(NIXL)),
                        *("--enable-eplb", "--eplb-config", '{"num_redundant_experts":32}'),
                        *("--speculative-config", '{"method":"mtp","num_speculative_tokens":3}'),
                        *("--eplb-agent-port", str(agent)),
                        *("--eplb-agent-token-file", str(self.agent_token)),
                        *self.faults.flags,
                        *scale,
                        *("--log-level", "warning"),
                    ),
                    directory / f"decode-{index}.log",
                    health_url=f"http://127.0.0.1:{port}",
                    url=f"http://127.0.0.1:{port}",
                    env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(RANKS_PER_SERVER))},
                )
            )
        # The EPLB service reaches each agent through a link that the chaos suite can cut.
        self.links = [AgentLink(agent) for agent in self.agents]
        eplb_config = directory / "eplb.yaml"
        eplb_config.write_text(
            yaml.safe_dump(
                {
                    "windowSize": eplb_steps,
                    "stepInterval": eplb_steps,
                    # a Commit deadline whose horizon outlasts a restart of the service
                    "commitTimeoutSeconds": 5,
                    "groups": [{"name": "cell-0", "agents": [link.address for link in self.links]}],
                }
            )
        )
        self.eplb_metrics = f"http://127.0.0.1:{free_port()}"
        self.eplb = Component(
            "eplb",
            "eplb",
            baton_command(
                "eplb",
                *("--config", str(eplb_config)),
                *("--metrics-port", self.eplb_metrics.rsplit(":", 1)[1]),
                *("--token-file", str(self.agent_token)),
                *("--log-level", "info"),
            ),
            directory / "eplb.log",
        )
        pool = directory / "pool.yaml"
        pool.write_text(
            yaml.safe_dump(
                {
                    "cells": [
                        {
                            "name": "cell-0",
                            "prefill": [c.url for c in self.prefill],
                            "decode": [
                                {"url": c.url, "ranks": list(range(RANKS_PER_SERVER))}
                                for c in self.decode
                            ],
                        }
                    ]
                }
            )
        )
        self.gateways: list[Component] = []
        for index in range(gateways):
            port = free_port()
            self.gateways.append(
                Component(
                    f"gateway-{index}",
                    "gateway",
                    baton_command(
                        "gateway",
                        *("--port", str(port), "--pool", str(pool)),
                        *deadlines.flags(),
                        *("--log-level", "warning"),
                    ),
                    directory / f"gateway-{index}.log",
                    health_url=f"http://127.0.0.1:{port}",
                    url=f"http://127.0.0.1:{port}",
                )
            )

    @property
    def components(self) -> list[Component]:
        return [*self.prefill, *self.decode, self.eplb, *self.gateways]

    @property
    def engines(self) -> list[Component]:
        return [*self.prefill, *self.decode]

    def start(self) -> None:
        """Engines first, then the EPLB service and the gateways; every one ready."""
        for component in self.engines:
            component.start()
        for component in self.engines:
            component.wait_ready(timeout=120)
        self.eplb.start()
        for component in self.gateways:
            component.start()
        for component in self.gateways:
            component.wait_ready(timeout=60)
        eventually(self.gateways_ready, timeout=60, interval=0.2)

    def gateways_ready(self) -> bool:
        return all(
            httpx.get(f"{gateway.url}/ready", timeout=2).status_code == 200
            for gateway in self.gateways
            if gateway.alive
        )

    def restart(self, component: Component) -> None:
        """Start ``component`` again after it was killed (a pod restarted on its node)."""
        component.kill()
        component.start()

    def restart_decode_group(self) -> None:
        """Every server of the decode group stopped and started again (the group restart)."""
        for component in self.decode:
            component.kill()
        for component in self.decode:
            component.start()

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        for link in self.links:
            link.close()

    def logs(self, names: Sequence[str] = ()) -> str:
        """The tail of each component's log (all, or those named)."""
        parts = []
        for component in self.components:
            if names and component.name not in names:
                continue
            text = (
                component.log_path.read_text(errors="replace")
                if component.log_path.exists()
                else ""
            )
            parts.append(f"--- {component.name} ---\n{text[-3000:]}")
        return "\n".join(parts)
