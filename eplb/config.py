"""The EPLB service's configuration file (YAML, untrusted input, checked with pydantic).

.. code-block:: yaml

    windowSize: 500             # steps of load per decision
    stepInterval: 500           # decide every N engine steps (boundaries k * N)
    minGain: 0.002              # skip a rebalance predicted to gain less window balance
    tolerance: 0.005            # balance given up to keep experts where they are
    numNodes: 1                 # >1 with numGroups % numNodes == 0: hierarchical policy
    numGroups: 1
    stepsPerReport: 100         # steps per LoadReport asked from the agents
    applyMarginSteps: 50        # Commit at (engine step after Prepare) + margin
    prepareTimeoutSeconds: 10   # all Prepare acks within this, or Abort everywhere
    commitTimeoutSeconds: 2
    reconnectSeconds: 1         # wait before reconnecting to a group's agents
    expertBytes: {target: 13369344, draft: 13369344}   # weight bytes of one expert of one layer
    models:                     # plugin mode: the models the engines' reports name by experts
      - {name: target, experts: 384, topK: 6}
      - {name: draft, experts: 128, topK: 6}
    perLayerMetrics: false      # baton_eplb_layer_balance series (layers x groups x models)
    groups:
      - name: cell-0
        agents: ["10.0.0.5:50100"]   # every agent of the decode group (host:port)

With ``baton eplb --model-deployment NAMESPACE/NAME`` the groups come from that
ModelDeployment's status instead (every cell's decode group and its agents), and ``groups`` is
left out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from baton.core.api import EplbModelSpec, EplbSpec
from baton.core.files import load_yaml_model
from baton.core.model import DRAFT, EXPERT_BYTES, TARGET
from eplb.algorithm import DEFAULT_TOLERANCE
from eplb.decide import DEFAULT_MIN_GAIN, Policy

__all__ = ["EplbServiceConfig", "GroupSource", "GroupSpec", "StaticGroups", "load_config"]


class _Spec(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class GroupSpec(_Spec):
    name: str = Field(min_length=1)
    agents: tuple[str, ...] = Field(min_length=1)
    # The group's own cadence (a ModelDeployment's spec.eplb); unset: the service's.
    window_size: int | None = Field(default=None, gt=0)
    step_interval: int | None = Field(default=None, gt=0)


class EplbServiceConfig(_Spec):
    window_size: int = Field(default=500, gt=0)
    step_interval: int = Field(default=500, gt=0)
    min_gain: float = Field(default=DEFAULT_MIN_GAIN, ge=0)
    tolerance: float = Field(default=DEFAULT_TOLERANCE, ge=0, lt=1)
    num_nodes: int = Field(default=1, ge=1)
    num_groups: int = Field(default=1, ge=1)
    steps_per_report: int = Field(default=100, gt=0)
    apply_margin_steps: int = Field(default=50, ge=1)
    prepare_timeout_seconds: float = Field(default=10.0, gt=0)
    commit_timeout_seconds: float = Field(default=2.0, gt=0)
    reconnect_seconds: float = Field(default=1.0, gt=0)
    expert_bytes: dict[str, float] = Field(
        default_factory=lambda: {TARGET.name: EXPERT_BYTES, DRAFT.name: EXPERT_BYTES}
    )
    per_layer_metrics: bool = False
    # What a ModelDeployment's spec.eplb.models says, for a service that follows none.
    models: tuple[EplbModelSpec, ...] = Field(
        default_factory=lambda: tuple(EplbSpec().models), min_length=1
    )
    groups: tuple[GroupSpec, ...] = Field(default=(), min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> EplbServiceConfig:
        if self.window_size > self.step_interval:
            raise ValueError(
                f"windowSize ({self.window_size}) must not exceed stepInterval "
                f"({self.step_interval})"
            )
        if self.apply_margin_steps >= self.step_interval:
            raise ValueError(
                f"applyMarginSteps ({self.apply_margin_steps}) must be below stepInterval "
                f"({self.step_interval}): a switch must land before the next decision"
            )
        names = [group.name for group in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        experts = [model.experts for model in self.models]
        if len(set(experts)) != len(experts):
            raise ValueError(
                f"models: a report names its model by its expert count, so each model needs its "
                f"own, got {experts}"
            )
        return self

    def model_names(self) -> dict[int, str]:
        """Each model by its logical expert count, as the engines' reports name it."""
        return {model.experts: model.name for model in self.models}

    @property
    def policy(self) -> Policy:
        return Policy(
            window_size=self.window_size,
            step_interval=self.step_interval,
            min_gain=self.min_gain,
            tolerance=self.tolerance,
            num_nodes=self.num_nodes,
            num_groups=self.num_groups,
        )

    def for_group(self, group: GroupSpec) -> EplbServiceConfig:
        """This configuration with the group's own cadence, checked again."""
        cadence = {
            "window_size": group.window_size or self.window_size,
            "step_interval": group.step_interval or self.step_interval,
        }
        if cadence == {"window_size": self.window_size, "step_interval": self.step_interval}:
            return self
        return EplbServiceConfig.model_validate(self.model_dump(exclude={"groups"}) | cadence)

    def expert_bytes_of(self, model: str) -> float:
        return self.expert_bytes.get(model, EXPERT_BYTES)


def load_config(path: str | Path) -> EplbServiceConfig:
    """Read and check the file; ValueError names the file, the field and the problem."""
    return load_yaml_model(path, EplbServiceConfig, kind="config file", fix="see docs/eplb.md")


class GroupSource(Protocol):
    """Where the decode groups come from: the configuration file, or a ModelDeployment's
    status (``eplb/discovery.py``)."""

    def decode_groups(self) -> tuple[GroupSpec, ...]: ...

    async def changed(self) -> None:
        """Return once the groups may have changed."""
        ...


class StaticGroups:
    def __init__(self, groups: tuple[GroupSpec, ...]) -> None:
        self._groups = groups

    def decode_groups(self) -> tuple[GroupSpec, ...]:
        return self._groups

    async def changed(self) -> None:
        await asyncio.Event().wait()  # a file's groups never change while running
