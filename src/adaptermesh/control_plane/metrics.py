"""The control plane's own Prometheus series, served on ``--metrics-port`` (0: off).

Counters and histograms are updated by the rebalancer as it works; everything that describes
current state (weights, utilisation, nodes, watchers) is read when Prometheus scrapes, so a
deleted shard or node disappears from the next scrape instead of lingering as a stale series.
That state comes from a reader injected with :meth:`ControlPlaneMetrics.bind` (the rebalancer's
``metrics_state``): this module never reaches into the rebalancer or the store itself.
The series are listed in docs/control-plane.md; a test checks that list against a scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adaptermesh.httpserve import serve_app

__all__ = [
    "DENIED",
    "PREFIX",
    "ControlPlaneMetrics",
    "ControlPlaneState",
    "ShardLoad",
    "StateReader",
    "publish_cause",
    "serve_metrics",
]

PREFIX = "adaptermesh_control_plane_"
# Refused calls, by method and reason (control_plane/auth.py names the reasons: a small fixed
# set, as the methods are). Named as docs/control-plane.md and the dashboards know it.
DENIED = "adaptermesh_cp_denied"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Causes that label adaptermesh_control_plane_publishes_total: a small fixed set, so an
# operator's free-text reason never becomes a label value.
_CAUSES: tuple[tuple[str, str], ...] = (
    ("override expired", "override_expired"),
    ("override ", "override"),
    ("unpin ", "pin"),
    ("pin ", "pin"),
    ("shard set changed", "shard_set"),
    ("shard ", "shard"),
    ("rebalance", "rebalance"),
    ("endpoint set changed", "endpoint_set"),
    ("endpoint weights moved", "endpoint_weights"),
)
CAUSES = tuple(sorted({c for _, c in _CAUSES} | {"other"}))


def publish_cause(reason: str) -> str:
    """The cause label of an Assignment's reason (its first part when there are several)."""
    first = reason.split(";", 1)[0].strip()
    for prefix, cause in _CAUSES:
        if first.startswith(prefix):
            return cause
    return "other"


class ShardLoad(Protocol):
    """One shard's load as a scrape exports it (the rebalancer's ``ShardLoadView``)."""

    @property
    def known(self) -> bool: ...
    @property
    def utilization(self) -> float: ...
    @property
    def workers(self) -> int: ...
    @property
    def workers_known(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ControlPlaneState:
    """The control plane's current state, read once per scrape."""

    # Version of the newest published Assignment (0: none yet).
    assignment_version: int
    # Weights of the newest Assignment (what the nodes are told), DRAINING shards at 0.
    shard_weights: Mapping[str, int]
    rebalance_steps: int
    rebalance_failures: int
    watch_streams: int
    shard_loads: Mapping[str, ShardLoad]
    # (node id, applied version, time of its last ReportLoad, last apply error or "").
    nodes: Sequence[tuple[str, int, float, str]]


StateReader = Callable[[], ControlPlaneState]


class ControlPlaneMetrics:
    """The registry, the rebalancer's histograms, and a collector over live state."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # 1,000 shards x 8 workers decide in ~2-10 ms on 2 cores; small clusters in < 1 ms.
        self.decision_seconds = Histogram(
            PREFIX + "decision_duration_seconds",
            "Time of one policy decision (observation to weights), per rebalance step.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            PREFIX + "rebalance_step_duration_seconds",
            "Time of one rebalance step: scrape, decide, validate, store and publish.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.publishes: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.scrape_errors = 0
        self.denied: dict[tuple[str, str], int] = {}

    def count_denied(self, method: str, reason: str) -> None:
        key = (method, reason)
        self.denied[key] = self.denied.get(key, 0) + 1

    def count_publish(self, reason: str) -> None:
        cause = publish_cause(reason)
        self.publishes[cause] = self.publishes.get(cause, 0) + 1

    def bind(self, read_state: StateReader, clock: Callable[[], float] = time.time) -> None:
        """Export the state ``read_state`` returns at every scrape."""
        self.registry.register(_StateCollector(self, read_state, clock))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(
        self, metrics: ControlPlaneMetrics, read_state: StateReader, clock: Callable[[], float]
    ) -> None:
        self.metrics = metrics
        self.read_state = read_state
        self.clock = clock

    def describe(self) -> list[Metric]:
        # Names only (auto_describe would call collect, which reads the store).
        return []

    def collect(self) -> Iterator[Metric]:
        state, metrics = self.read_state(), self.metrics
        current = state.assignment_version

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))

        version = gauge("assignment_version", "Version of the newest published Assignment.")
        version.add_metric([], float(current))
        yield version

        steps = CounterMetricFamily(PREFIX + "rebalance_steps", "Rebalance steps started.")
        steps.add_metric([], float(state.rebalance_steps))
        yield steps
        failures = CounterMetricFamily(
            PREFIX + "rebalance_failures", "Rebalance steps that failed (retried with backoff)."
        )
        failures.add_metric([], float(state.rebalance_failures))
        yield failures
        publishes = CounterMetricFamily(
            PREFIX + "publishes",
            "Assignments published, by cause (the first part of the Assignment's reason).",
            labels=["reason"],
        )
        for cause, count in sorted(metrics.publishes.items()):
            publishes.add_metric([cause], float(count))
        yield publishes
        scrape = CounterMetricFamily(
            PREFIX + "worker_scrape_errors",
            "Worker /metrics scrapes that failed or returned no known series.",
        )
        scrape.add_metric([], float(metrics.scrape_errors))
        yield scrape
        denied = CounterMetricFamily(
            DENIED,
            "Calls refused for their credentials (UNAUTHENTICATED) or their scope or node "
            "binding (PERMISSION_DENIED), by method and reason.",
            labels=["method", "reason"],
        )
        for (method, reason), count in sorted(metrics.denied.items()):
            denied.add_metric([method, reason], float(count))
        yield denied

        watchers = gauge("watch_streams", "WatchAssignments streams connected now.")
        watchers.add_metric([], float(state.watch_streams))
        yield watchers

        weight = gauge("shard_weight", "Published shard weight in parts per 10,000.", ("shard",))
        for shard_id, shard_weight in sorted(state.shard_weights.items()):
            weight.add_metric([shard_id], float(shard_weight))
        yield weight
        util = gauge(
            "shard_utilization",
            "Smoothed utilisation estimate (1.0: saturated); absent while the shard is unknown.",
            ("shard",),
        )
        known = gauge(
            "shard_known", "1 when at least one of the shard's workers reports metrics.", ("shard",)
        )
        workers = gauge(
            "shard_workers", "Workers of the shard by metrics state.", ("shard", "state")
        )
        for shard_id, load in sorted(state.shard_loads.items()):
            known.add_metric([shard_id], 1.0 if load.known else 0.0)
            if load.known:
                util.add_metric([shard_id], load.utilization)
            workers.add_metric([shard_id, "known"], float(load.workers_known))
            workers.add_metric([shard_id, "unknown"], float(load.workers - load.workers_known))
        yield util
        yield known
        yield workers

        applied = gauge("node_applied_version", "Assignment version the node applied.", ("node",))
        lag = gauge(
            "node_version_lag", "Published version minus the node's applied version.", ("node",)
        )
        age = gauge(
            "node_report_age_seconds", "Seconds since the node's last ReportLoad.", ("node",)
        )
        error = gauge("node_apply_error", "1 when the node's last apply failed.", ("node",))
        now = self.clock()
        for node_id, applied_version, last, err in state.nodes:
            applied.add_metric([node_id], float(applied_version))
            lag.add_metric([node_id], float(max(0, current - applied_version)))
            age.add_metric([node_id], max(0.0, now - last))
            error.add_metric([node_id], 1.0 if err else 0.0)
        yield applied
        yield lag
        yield age
        yield error


async def serve_metrics(metrics: ControlPlaneMetrics, host: str, port: int) -> web.AppRunner:
    """``GET /metrics`` on HOST:PORT; returns the runner (``await runner.cleanup()`` stops it)."""

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    # Header deadlines, header caps and a connection cap (adaptermesh.httpserve).
    runner, _ = await serve_app(app, host, port)
    return runner
