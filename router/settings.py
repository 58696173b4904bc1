"""The gateway's tunables, in one model that both front ends read.

``baton gateway`` derives a flag from each field (``prefill_timeout_s`` is ``--prefill-timeout``),
and Ray Serve's application arguments extend the model; either way the names, defaults, bounds
and help live here once, and pydantic checks the values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baton.follow import DeploymentRef
from router.app import GatewayConfig
from router.handoff import Timeouts
from router.policy import PrefillPolicy, RoutingPolicy
from router.pool import PoolSpec

__all__ = ["GatewaySettings"]


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PrefillPolicy = Field(PrefillPolicy.AFFINITY, description="prefill choice")
    pd_threshold_tokens: int = Field(
        256, ge=0, description="prompts estimated below this many tokens skip prefill"
    )
    imbalance_tokens: int = Field(
        8192, ge=0, description="outstanding-token gap at which affinity spills to the 2nd choice"
    )
    prefill_timeout_s: float = Field(300.0, gt=0, description="seconds for the prefill leg")
    first_token_timeout_s: float = Field(
        300.0, gt=0, description="seconds from the decode request to its first token"
    )
    idle_timeout_s: float = Field(
        120.0, gt=0, description="seconds a stream may go without bytes from its engine"
    )
    health_interval_s: float = Field(
        2.0, gt=0, description="seconds between health checks and decode load syncs"
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest request body")

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field: its name in kebab case without the ``_s`` unit suffix."""
        for name, field in cls.model_fields.items():
            flag = "--" + name.removesuffix("_s").replace("_", "-")
            default = field.default
            if isinstance(default, PrefillPolicy):
                parser.add_argument(
                    flag,
                    dest=name,
                    default=default.value,
                    choices=[p.value for p in PrefillPolicy],
                    help=field.description,
                )
            else:
                unit = name.rsplit("_", 1)[-1]
                metavar = "SECONDS" if unit == "s" else unit.upper()
                parser.add_argument(
                    flag,
                    dest=name,
                    type=type(default),
                    default=default,
                    metavar=metavar,
                    help=f"{field.description} (default: {default})",
                )

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> GatewaySettings:
        """The fields :meth:`add_flags` added; ValueError names the flag and what is wrong."""
        try:
            return cls.model_validate({name: getattr(args, name) for name in cls.model_fields})
        except ValidationError as exc:
            raise ValueError(_describe_flags(exc)) from exc

    def gateway_config(
        self,
        pool: PoolSpec | None,
        api_keys: tuple[str, ...],
        *,
        pool_file: Path | None = None,
        model_deployment: DeploymentRef | None = None,
    ) -> GatewayConfig:
        return GatewayConfig(
            pool=pool,
            api_keys=api_keys,
            policy=RoutingPolicy(
                prefill=self.policy,
                imbalance_tokens=self.imbalance_tokens,
                pd_threshold_tokens=self.pd_threshold_tokens,
            ),
            timeouts=Timeouts(
                prefill_s=self.prefill_timeout_s,
                first_token_s=self.first_token_timeout_s,
                idle_s=self.idle_timeout_s,
            ),
            max_body_bytes=self.max_body_bytes,
            health_interval_s=self.health_interval_s,
            load_sync_interval_s=self.health_interval_s,
            pool_file=pool_file,
            model_deployment=model_deployment,
        )


def _describe_flags(exc: ValidationError) -> str:
    return "; ".join(
        f"--{str(error['loc'][0]).removesuffix('_s').replace('_', '-')}: {error['msg']}"
        for error in exc.errors()
    )
