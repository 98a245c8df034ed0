"""The agent's Prometheus series, on a registry of its own (several agents can share a process
in tests without clashing).

Every series is listed in ``docs/metrics.md``; keep the two in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adaptermesh.agent.load import ShardRates

__all__ = ["AgentMetrics"]


class _ShardCollector(Collector):
    """Exports the latest per-shard rates and the classifier's own cumulative counters."""

    def __init__(
        self,
        rates: Callable[[], dict[int, ShardRates]],
        names: Callable[[], dict[int, tuple[str, int]]],
        counters: Callable[[], dict[str, int]],
    ) -> None:
        self._rates = rates
        self._names = names
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        names = self._names()
        packets = CounterMetricFamily(
            "adaptermesh_agent_shard_packets",
            "Packets the classifier steered to the shard (am_stats, summed over CPUs).",
            labels=["shard"],
        )
        nbytes = CounterMetricFamily(
            "adaptermesh_agent_shard_bytes",
            "Bytes the classifier steered to the shard (am_stats).",
            labels=["shard"],
        )
        flows = CounterMetricFamily(
            "adaptermesh_agent_shard_new_flows",
            "New flows the classifier assigned to the shard (am_stats).",
            labels=["shard"],
        )
        pps = GaugeMetricFamily(
            "adaptermesh_agent_shard_packets_per_second",
            "Packet rate to the shard over the last report interval.",
            labels=["shard"],
        )
        bps = GaugeMetricFamily(
            "adaptermesh_agent_shard_bytes_per_second",
            "Byte rate to the shard over the last report interval.",
            labels=["shard"],
        )
        nfs = GaugeMetricFamily(
            "adaptermesh_agent_shard_new_flows_per_second",
            "New-flow rate to the shard over the last report interval.",
            labels=["shard"],
        )
        active = GaugeMetricFamily(
            "adaptermesh_agent_shard_active_flows",
            "Sources whose flow started or was re-picked onto the shard within the active window.",
            labels=["shard"],
        )
        weight = GaugeMetricFamily(
            "adaptermesh_agent_shard_weight",
            "The shard's weight in parts per 10,000 in the applied Assignment.",
            labels=["shard"],
        )
        for _index, (shard_id, w) in sorted(names.items()):
            weight.add_metric([shard_id], float(w))
        for index, r in sorted(self._rates().items()):
            label = [names.get(index, (f"index-{index}", 0))[0]]
            packets.add_metric(label, float(r.packets_total))
            nbytes.add_metric(label, float(r.bytes_total))
            flows.add_metric(label, float(r.new_flows_total))
            pps.add_metric(label, r.packets_per_s)
            bps.add_metric(label, r.bytes_per_s)
            nfs.add_metric(label, r.new_flows_per_s)
            active.add_metric(label, float(r.active_flows))
        counters = self._counters()
        lost = CounterMetricFamily(
            "adaptermesh_agent_ringbuf_lost_events",
            "New-flow events the classifier could not reserve ring-buffer space for.",
        )
        passed = CounterMetricFamily(
            "adaptermesh_agent_classifier_passed_packets",
            "Packets the classifier passed on untouched, by reason.",
            labels=["reason"],
        )
        if counters:
            lost.add_metric([], float(counters.get("ringbuf_failed", 0)))
            for reason in (
                "non_ip",
                "malformed",
                "vlan",
                "no_shard",
                "steer_failed",
                "link_local",
                "martian_source",
            ):
                passed.add_metric([reason], float(counters.get(reason, 0)))
        yield from (packets, nbytes, flows, pps, bps, nfs, active, weight, lost, passed)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.applied_version = Gauge(
            "adaptermesh_agent_applied_version",
            "Version of the Assignment applied to both the BPF maps and the xDS snapshot.",
            registry=r,
        )
        self.received_version = Gauge(
            "adaptermesh_agent_received_version",
            "Highest Assignment version received from the control plane.",
            registry=r,
        )
        self.applies = Counter(
            "adaptermesh_agent_applies",
            "Assignments the agent tried to apply, by result (ok, error, stale, held: the "
            "datapath was gone, applied when it is back).",
            ["result"],
            registry=r,
        )
        self.apply_seconds = Histogram(
            "adaptermesh_agent_apply_seconds",
            "Time to apply one Assignment to the BPF maps and the xDS snapshot.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.last_apply_timestamp = Gauge(
            "adaptermesh_agent_last_apply_timestamp_seconds",
            "Unix time of the last successful apply.",
            registry=r,
        )
        self.apply_error = Gauge(
            "adaptermesh_agent_apply_error",
            "1 while the latest received Assignment was rejected (the last good one serves).",
            registry=r,
        )
        self.connected = Gauge(
            "adaptermesh_agent_control_plane_connected",
            "1 while the WatchAssignments stream to the control plane is open.",
            registry=r,
        )
        self.reconnects = Counter(
            "adaptermesh_agent_watch_reconnects",
            "Times the WatchAssignments stream was (re)opened after a failure.",
            registry=r,
        )
        self.watch_errors = Counter(
            "adaptermesh_agent_watch_errors",
            "WatchAssignments failures, by gRPC status code.",
            ["code"],
            registry=r,
        )
        self.reports = Counter(
            "adaptermesh_agent_load_reports",
            "ReportLoad calls, by result (ok, error).",
            ["result"],
            registry=r,
        )
        self.events = Counter(
            "adaptermesh_agent_flow_events",
            "New-flow events read from the am_events ring buffer, by reason.",
            ["reason"],
            registry=r,
        )
        self.datapath_attached = Gauge(
            "adaptermesh_agent_datapath_attached",
            "1 while the classifier is loaded and attached to the node interface.",
            registry=r,
        )
        self.datapath_detaches = Counter(
            "adaptermesh_agent_datapath_detaches",
            "Times the datapath was found gone: the interface, the filter or a pinned map.",
            registry=r,
        )
        self.datapath_reattaches = Counter(
            "adaptermesh_agent_datapath_reattaches",
            "Times the datapath was attached again (and the current Assignment replayed).",
            registry=r,
        )
        self._shard_names: dict[int, tuple[str, int]] = {}
        self._rates: Callable[[], dict[int, ShardRates]] = dict
        self._counters: Callable[[], dict[str, int]] = dict
        r.register(
            _ShardCollector(
                lambda: self._rates(), lambda: dict(self._shard_names), lambda: self._counters()
            )
        )

    def bind_rates(
        self,
        rates: Callable[[], dict[int, ShardRates]],
        counters: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self._rates = rates
        self._counters = counters

    def set_shards(self, shards: dict[int, tuple[str, int]]) -> None:
        """Index -> (shard id, weight) of the applied Assignment, for labels."""
        self._shard_names = dict(shards)
