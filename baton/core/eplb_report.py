"""What a vLLM engine running Baton's EPLB plugin reports after each rebalance window.

One rank of each decode group (EP rank 0) posts a :class:`WindowReport` as JSON to the EPLB
service's ``POST /v1/windows`` (``Authorization: Bearer <token>`` when the service has one). The
service exports the figures as ``baton_eplb_*`` metrics and writes the balance into the
ModelDeployment's status. The report is informative: the engine decided and switched already.
An engine whose vLLM the plugin was not written for posts :class:`PluginInactive` instead, once
per process, to ``POST /v1/inactive``.

The engine learns where to report from its pod's environment, which the controller renders:
``REPORT_URL_ENV``, ``TOKEN_ENV``, and ``WHERE_ENV`` naming the report's namespace, deployment
and cell; ``POLICY_ENV`` (``spec.eplb.policy``) says who places, ``baton`` when unset.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "INACTIVE_PATH",
    "POLICY_ENV",
    "REPORT_PATH",
    "REPORT_URL_ENV",
    "TOKEN_ENV",
    "WHERE_ENV",
    "PluginInactive",
    "Policy",
    "WindowReport",
]

REPORT_PATH = "/v1/windows"
INACTIVE_PATH = "/v1/inactive"
REPORT_URL_ENV = "BATON_EPLB_REPORT_URL"
TOKEN_ENV = "BATON_EPLB_TOKEN"
POLICY_ENV = "BATON_EPLB_POLICY"
WHERE_ENV = {"namespace": "BATON_NAMESPACE", "deployment": "BATON_DEPLOYMENT", "cell": "BATON_CELL"}

Policy = Literal["baton", "vllm_default"]


class WindowReport(BaseModel):
    """One rebalance of one model of one decode group, as the engine made it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(min_length=1)
    deployment: str = Field(min_length=1)
    cell: str = Field(min_length=1, description="the decode group: one per cell")
    layers: int = Field(ge=1)
    experts: int = Field(ge=1, description="logical experts: tells target from draft")
    num_ranks: int = Field(ge=1)
    load: list[list[int]] = Field(description="the window's tokens per [layer][logical expert]")
    balance_before: float | None = Field(
        default=None, ge=0, le=1, description="the window under the old placement, if known"
    )
    balance_after: float = Field(ge=0, le=1, description="the window under the new placement")
    experts_moved: int = Field(ge=0, description="experts arriving on a rank")
    policy: Policy = Field(
        description="who placed: Baton's algorithm, or vLLM's (as configured, or after a fallback)"
    )
    fallback: str | None = Field(default=None, description="why vLLM's policy placed, if it did")
    vllm_version: str

    @model_validator(mode="after")
    def _load_shape(self) -> WindowReport:
        if len(self.load) != self.layers or any(len(row) != self.experts for row in self.load):
            raise ValueError(f"load must be [{self.layers}][{self.experts}]")
        return self


class PluginInactive(BaseModel):
    """The plugin left vLLM's own policy in charge of a group's engine, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(min_length=1)
    deployment: str = Field(min_length=1)
    cell: str = Field(min_length=1)
    vllm_version: str
    reason: str = Field(min_length=1)
