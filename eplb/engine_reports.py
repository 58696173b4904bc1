"""Windows that vLLM engines rebalanced themselves, as Baton's EPLB plugin reports them.

With the plugin (``eplb.vllm_plugin``) the engines decide and switch in-engine; EP rank 0 of
each decode group posts a :class:`~baton.core.eplb_report.WindowReport` after every rebalance.
:class:`EngineReports` turns those into the same ``baton_eplb_*`` series and status figures the
agent mode produces, and :func:`create_report_app` is the HTTP endpoint the engines post to
(``Authorization: Bearer <token>`` when the service has one; every error an OpenAI-style body).

Figures, per group (cell) and model:

- ``baton_eplb_balance{stage="before"}``: the window under the placement in force: measured.
- ``stage="predicted"``: the same window under the placement the engine switched to.
- ``stage="achieved"``: the next window's ``before``, the placement's first measured window.
- ``baton_eplb_engine_windows{policy}``: rebalances by who placed (``baton``, or
  ``vllm_default`` after a fallback); experts and bytes moved as in agent mode.
- ``baton_eplb_plugin_inactive{group, reason, vllm_version}``: 1 when an engine's plugin left
  vLLM's policy in charge.

The status figure of a cell is its latest measured window balance, as in agent mode.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import orjson
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.core.eplb_report import INACTIVE_PATH, REPORT_PATH, PluginInactive, WindowReport
from baton.core.follow import DeploymentRef
from eplb.metrics import EplbMetrics

__all__ = ["CellFigures", "EngineReports", "ReportRejected", "create_report_app"]

log = logging.getLogger("baton.eplb")


class ReportRejected(Exception):
    """A report this service does not take: HTTP ``status``, the field at fault as ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class CellFigures:
    """What the engines of one cell reported last, per model."""

    balance: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    last_rebalance_time: dict[str, str] = field(default_factory=dict)
    windows: int = 0


class EngineReports:
    """The reports of one deployment's engines (``deployment`` None: of any deployment).

    ``model_names`` maps a model's logical expert count to its name (``spec.eplb.models``): the
    engine knows the shape of the load it rebalanced, not which model it belongs to.
    """

    def __init__(
        self,
        metrics: EplbMetrics,
        model_names: Callable[[], Mapping[int, str]],
        expert_bytes: Callable[[str], float],
        deployment: DeploymentRef | None = None,
    ) -> None:
        self.metrics = metrics
        self.model_names = model_names
        self.expert_bytes = expert_bytes
        self.deployment = deployment
        self.cells: dict[str, CellFigures] = {}
        self.inactive: dict[str, PluginInactive] = {}

    def window(self, report: WindowReport) -> str:
        """Take one rebalanced window; the model's name, or ReportRejected."""
        self._check_deployment(report.namespace, report.deployment)
        names = self.model_names()
        model = names.get(report.experts)
        if model is None:
            known = ", ".join(f"{name} ({n} experts)" for n, name in sorted(names.items()))
            raise ReportRejected(
                400,
                f"no model with {report.experts} logical experts in spec.eplb.models "
                f"(known: {known}); list the engine's model there",
                "experts",
            )
        cell = self.cells.setdefault(report.cell, CellFigures())
        labels = (report.cell, model)
        if report.balance_before is not None:
            if model in cell.predicted:
                self.metrics.balance.labels(*labels, "achieved").set(report.balance_before)
            self.metrics.balance.labels(*labels, "before").set(report.balance_before)
            cell.balance[model] = report.balance_before
        self.metrics.balance.labels(*labels, "predicted").set(report.balance_after)
        cell.predicted[model] = report.balance_after
        cell.last_rebalance_time[model] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cell.windows += 1
        self.metrics.engine_windows.labels(*labels, report.policy).inc()
        self.metrics.experts_moved.labels(*labels).inc(report.experts_moved)
        self.metrics.bytes_moved.labels(*labels).inc(
            report.experts_moved * self.expert_bytes(model)
        )
        self._active(report.cell)
        if report.fallback is not None:
            log.warning(
                "group %s %s: vLLM's policy placed this window (%s)",
                report.cell,
                model,
                report.fallback,
            )
        log.info(
            "group %s %s: engine rebalanced (%s), window balance %s -> %.4f, %d experts moved",
            report.cell,
            model,
            report.policy,
            "?" if report.balance_before is None else f"{report.balance_before:.4f}",
            report.balance_after,
            report.experts_moved,
        )
        return model

    def plugin_inactive(self, report: PluginInactive) -> None:
        self._check_deployment(report.namespace, report.deployment)
        self._active(report.cell)
        self.inactive[report.cell] = report
        self.metrics.plugin_inactive.labels(report.cell, report.reason, report.vllm_version).set(1)
        log.warning(
            "group %s: Baton's EPLB plugin is not active (%s, vLLM %s); vLLM's policy places",
            report.cell,
            report.reason,
            report.vllm_version,
        )

    def keep_cells(self, cells: set[str]) -> None:
        """Forget the figures of cells the deployment no longer has."""
        for name in set(self.cells) - cells:
            del self.cells[name]
        for name in set(self.inactive) - cells:
            self._active(name)

    def _active(self, cell: str) -> None:
        """The cell's engines are no longer reported inactive (a window came, or a new report)."""
        gone = self.inactive.pop(cell, None)
        if gone is not None:
            self.metrics.plugin_inactive.remove(gone.cell, gone.reason, gone.vllm_version)

    def _check_deployment(self, namespace: str, name: str) -> None:
        ref = self.deployment
        if ref is not None and (namespace, name) != (ref.namespace, ref.name):
            raise ReportRejected(
                404,
                f"this EPLB service serves ModelDeployment {ref.namespace}/{ref.name}, "
                f"not {namespace}/{name}; set the engine's BATON_EPLB_REPORT_URL to that "
                "deployment's service",
                "deployment",
            )


def create_report_app(reports: EngineReports, token: str | None) -> FastAPI:
    """``POST /v1/windows`` and ``POST /v1/inactive`` (204 on success) for ``reports``, and
    ``GET /health``."""
    expected = f"Bearer {token}".encode() if token else None
    app = FastAPI(title="Baton EPLB service: engine reports", version="0.1.0")

    def authorize(request: Request) -> None:  # a dependency: runs before the body is checked
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ReportRejected(
                401, "missing or invalid token; send 'Authorization: Bearer <EPLB token>'"
            )

    authorized = [Depends(authorize)]

    @app.post(REPORT_PATH, status_code=204, dependencies=authorized)
    async def window(report: WindowReport) -> Response:
        reports.window(report)
        return Response(status_code=204)

    @app.post(INACTIVE_PATH, status_code=204, dependencies=authorized)
    async def inactive(report: PluginInactive) -> Response:
        reports.plugin_inactive(report)
        return Response(status_code=204)

    async def rejected(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ReportRejected)
        kind = "authentication_error" if exc.status == 401 else "invalid_request_error"
        return _error(exc.status, exc.message, kind, exc.param)

    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"][1:]) or None
        message = f"{where or 'body'}: {first['msg']}"
        return _error(400, message, "invalid_request_error", where)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind, None)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    app.add_exception_handler(ReportRejected, rejected)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    return app


def _error(status: int, message: str, kind: str, param: str | None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
