"""dcgm-exporter's ``/metrics`` for the GPUs of one simulated tray.

On a real rack NVIDIA's dcgm-exporter runs on every node and exports per-GPU series from DCGM;
``baton sim --dcgm-port`` serves the same names, types and labels for the DP ranks its API
server holds (one GPU each, a tray's four in hybrid LB), so that straggler detection reads what
it reads on a rack. Names and help texts are dcgm-exporter's default counters
(``etc/default-counters.csv``), plus ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (NVML's clock-event
reasons bitmask, which dcgm-exporter exports once the counters file lists it) and the four
NVLink error counters the file lists commented out (a rack that watches its links enables
them). Labels: ``gpu`` (the index on the node), ``UUID``, ``pci_bus_id``, ``device``,
``modelName``, ``Hostname``.

The values are the simulator's own healthy GPU under load (a round SM clock, temperature and
power, with a little noise per scrape, as boost clocks wander), not measurements; a throttle
fault (``sim/faults.py``) lowers one GPU's clock to its share, raises its temperature and sets
the hardware-thermal reason bit; an NVLink fault makes one GPU's flit CRC and replay counters
climb. Detection compares a GPU with its group, so only the ratios matter. ``noise="rack"``
makes the healthy GPUs look less alike, as a rack's do (the simulator's assumption, not a
measurement): each GPU sits its own 0-3% below the nominal clock for good (silicon and
cooling), and each scrape, one GPU in fifty dips 5-15% for that moment with the software
power-cap reason set (a power-limit event shorter than a scrape interval).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine import DPGroup, DPRank

__all__ = ["HW_THERMAL_SLOWDOWN", "NOMINAL_SM_CLOCK_MHZ", "SW_POWER_CAP", "DcgmExporter"]

NOMINAL_SM_CLOCK_MHZ = 1900.0
_IDLE_SM_CLOCK_MHZ = 345.0
_MEM_CLOCK_MHZ = 3996.0
_IDLE_TEMP_C, _BUSY_TEMP_C, _THROTTLED_TEMP_C = 38.0, 68.0, 88.0
_IDLE_POWER_W, _BUSY_POWER_W = 180.0, 1050.0
_CLOCK_NOISE = 0.004  # relative standard deviation of a healthy GPU's clock between scrapes
_RACK_SPREAD = 0.03  # noise="rack": how far below nominal a healthy GPU may sit, for good
_DIP_CHANCE, _DIP_DEPTH = 0.02, (0.05, 0.15)  # noise="rack": a scrape's momentary power-cap dip
SW_POWER_CAP = 0x4
# NVML clock-event reason bits (nvmlClocksEventReasons)
GPU_IDLE = 0x1
HW_THERMAL_SLOWDOWN = 0x40
_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"]
# NVLink error counters (commented out in dcgm-exporter's default counters file: a rack that
# watches its links enables them). A failing link's flit CRC errors are each replayed.
_LINK_COUNTERS = {
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "Total number of NVLink flow-control CRC "
    "errors.",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": "Total number of NVLink data CRC errors.",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "Total number of NVLink retries.",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "Total number of NVLink recovery errors.",
}


class _TrayCollector(Collector):
    def __init__(
        self, group: DPGroup, ranks: range, hostname: str, seed: int, noise: str = "quiet"
    ) -> None:
        self.group = group
        self.ranks = ranks
        self.hostname = hostname
        self.rng = random.Random(f"{seed}:{hostname}")
        self.model = f"NVIDIA {group.config.profile.hardware}"
        self.rack_noise = noise == "rack"
        # each GPU's own clock under load, as a share of nominal
        self.own = [
            1.0 - self.rng.uniform(0.0, _RACK_SPREAD) if self.rack_noise else 1.0 for _ in ranks
        ]

    def _labels(self, index: int) -> list[str]:
        gpu_uuid = uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.hostname}/{index}")
        return [
            str(index),
            f"GPU-{gpu_uuid}",
            f"00000000:{0x18 + 0x10 * index:02X}:00.0",
            f"nvidia{index}",
            self.model,
            self.hostname,
        ]

    def collect(self) -> Iterator[Metric]:
        now = self.group.clock.now()
        busy = self.group.has_work
        families = {
            name: GaugeMetricFamily(name, doc, labels=_LABELS)
            for name, doc in (
                ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
                ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
                ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
                ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
                ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
                ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
                (
                    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                    "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*).",
                ),
            )
        }
        # dcgm-exporter names its counters as DCGM does, with no _total added
        links = {name: Metric(name, doc, "counter") for name, doc in _LINK_COUNTERS.items()}
        for index, dp_rank in enumerate(self.ranks):
            rank: DPRank = self.group.ranks[dp_rank]
            share = rank.clock_at(now)
            labels = self._labels(index)
            noise = (1.0 - abs(self.rng.gauss(0.0, _CLOCK_NOISE))) * self.own[index]
            dip = (
                self.rng.uniform(*_DIP_DEPTH)
                if self.rack_noise and busy and self.rng.random() < _DIP_CHANCE
                else 0.0
            )
            noise *= 1.0 - dip
            clock = NOMINAL_SM_CLOCK_MHZ * share * noise if busy else _IDLE_SM_CLOCK_MHZ
            reasons = (
                (HW_THERMAL_SLOWDOWN if share < 1.0 else 0)
                | (0 if busy else GPU_IDLE)
                | (SW_POWER_CAP if dip else 0)
            )
            temp = _THROTTLED_TEMP_C if share < 1.0 else _BUSY_TEMP_C if busy else _IDLE_TEMP_C
            power = _BUSY_POWER_W * share * noise if busy else _IDLE_POWER_W
            for name, value in (
                ("DCGM_FI_DEV_SM_CLOCK", round(clock)),
                ("DCGM_FI_DEV_MEM_CLOCK", _MEM_CLOCK_MHZ),
                ("DCGM_FI_DEV_GPU_TEMP", round(temp + self.rng.gauss(0.0, 0.5))),
                ("DCGM_FI_DEV_POWER_USAGE", round(power, 3)),
                ("DCGM_FI_DEV_GPU_UTIL", 100.0 if busy else 0.0),
                ("DCGM_FI_DEV_XID_ERRORS", 0.0),
                ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", float(reasons)),
            ):
                families[name].add_metric(labels, float(value))
            errors = rank.link_errors_at(now)
            for name, value in zip(_LINK_COUNTERS, (errors, 0.0, errors, 0.0), strict=True):
                links[name].add_sample(name, dict(zip(_LABELS, labels, strict=True)), value)
        yield from families.values()
        yield from links.values()


class DcgmExporter:
    """One tray's dcgm-exporter: ``GET /metrics`` on ``host:port``."""

    def __init__(
        self,
        group: DPGroup,
        ranks: range,
        hostname: str,
        host: str,
        port: int,
        seed: int = 0,
        *,
        noise: str = "quiet",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_TrayCollector(group, ranks, hostname, seed, noise))
        self.host, self.port = host, port
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        await self._runner.cleanup()
