"""Prometheus metrics of the xDS cache and server (``adaptermesh_xds_*``).

One :class:`XdsMetrics` is shared by every cache and server in a process unless a caller
passes its own (with its own registry), because prometheus_client refuses to register the
same series twice in one registry.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["XdsMetrics", "default_metrics"]


class XdsMetrics:
    """The series; label ``type`` is the short resource type (Cluster, Listener, ...)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.pushes = Counter(
            "adaptermesh_xds_pushes",
            "xDS responses sent to Envoy",
            ["type", "mode"],
            registry=registry,
        )
        self.acks = Counter(
            "adaptermesh_xds_acks",
            "xDS responses acknowledged by Envoy",
            ["type"],
            registry=registry,
        )
        self.nacks = Counter(
            "adaptermesh_xds_nacks",
            "xDS responses rejected by Envoy",
            ["type", "node"],
            registry=registry,
        )
        self.stale_nonces = Counter(
            "adaptermesh_xds_stale_nonces",
            "requests ignored for a stale or unknown nonce",
            registry=registry,
        )
        self.unknown_types = Counter(
            "adaptermesh_xds_unknown_type_requests",
            "requests for a type URL we do not serve",
            registry=registry,
        )
        self.protocol_errors = Counter(
            "adaptermesh_xds_protocol_errors",
            "streams closed for a protocol violation",
            ["reason"],
            registry=registry,
        )
        self.streams = Gauge(
            "adaptermesh_xds_streams", "open xDS streams", ["mode"], registry=registry
        )
        self.publishes = Counter(
            "adaptermesh_xds_snapshot_publishes",
            "snapshots offered to the cache",
            ["result"],
            registry=registry,
        )
        self.update_to_ack = Histogram(
            "adaptermesh_xds_update_to_ack_seconds",
            "time from publishing a snapshot to the ACK of a changed type",
            ["type"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=registry,
        )


_default: XdsMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> XdsMetrics:
    """The process-wide metrics on prometheus_client's default registry."""
    global _default
    with _default_lock:
        if _default is None:
            _default = XdsMetrics()
        return _default
