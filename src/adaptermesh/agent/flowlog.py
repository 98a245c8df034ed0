"""The classifier's flow decisions, exported: each new-flow ring-buffer event (source, shard,
reason, Assignment version) as a structured log line, a span, or both, keyed by the flow.

The flow is the classifier's own key, the source address (``am_flows`` is keyed by it). The
log line is one JSON object on the ``adaptermesh.flows`` logger with ``flow`` first. A span
("classifier flow", with a "new flow" span event carrying the same fields) goes into a trace
whose id is derived from the flow (the first 16 bytes of SHA-256 over the source address), so
every decision about one source (first pick, a re-pick after a drain, a pin) lands in the same
trace and a collector finds them by the flow. The sampling ratio applies per flow, by the same
rule as the SDK's ratio sampler (the trace id's low 64 bits against ratio x 2^64): a flow is
traced entirely or not at all.

The ring buffer's timestamps are the kernel's monotonic clock (``bpf_ktime_get_ns``), turned
into the epoch time OTLP wants with one offset per event; an event without one (0) takes now.
Runs on the agent's ring-buffer thread; the span processor batches off it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from adaptermesh.agent.ports import FlowEvent
from adaptermesh.tracing import Tracing

__all__ = ["FLOW_EVENT_MODES", "FlowEventMode", "FlowExporter", "flow_trace_id"]

FlowEventMode = Literal["off", "log", "span", "both"]
FLOW_EVENT_MODES: tuple[FlowEventMode, ...] = ("off", "log", "span", "both")
_flow_log = logging.getLogger("adaptermesh.flows")
_MASK64 = (1 << 64) - 1


def flow_trace_id(source: str) -> int:
    """The trace id of a flow's decisions (never 0, which OTLP reserves)."""
    digest = hashlib.sha256(b"adaptermesh-flow:" + source.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


class FlowExporter:
    """Called with each FlowEvent the ring buffer delivers."""

    def __init__(
        self,
        mode: FlowEventMode,
        tracing: Tracing,
        node_id: str,
        shard_names: Callable[[], Mapping[int, str]],
        *,
        sample_ratio: float = 1.0,
        logger: logging.Logger | None = None,
    ) -> None:
        if mode not in FLOW_EVENT_MODES:
            raise ValueError(f"flow_events: {mode!r} is not one of {', '.join(FLOW_EVENT_MODES)}")
        if mode in ("span", "both") and not tracing.enabled:
            raise ValueError(f"flow_events: {mode!r} needs tracing on (an OTLP endpoint)")
        self._log = mode in ("log", "both")
        self._spans = mode in ("span", "both")
        self.enabled = mode != "off"
        self._tracer = tracing.tracer
        self._node = node_id
        self._names = shard_names
        self._bound = int(sample_ratio * (_MASK64 + 1))
        self._logger = logger or _flow_log
        self.logged = 0
        self.traced = 0

    def __call__(self, event: FlowEvent) -> None:
        if not self.enabled:
            return
        flow = str(event.source)
        fields: dict[str, str | int] = {
            "flow": flow,
            "shard": self._names().get(event.shard, ""),
            "shard_index": event.shard,
            "reason": event.reason,
            "version": event.version,
            "node": self._node,
        }
        when = (
            (event.ts_ns + time.time_ns() - time.monotonic_ns()) if event.ts_ns else time.time_ns()
        )
        if self._log:
            self._logger.info(json.dumps({**fields, "ts_ns": when}, separators=(",", ":")))
            self.logged += 1
        if self._spans:
            trace_id = flow_trace_id(flow)
            if (trace_id & _MASK64) >= self._bound:
                return
            attrs = {f"adaptermesh.{k}": v for k, v in fields.items()}
            # A remote, sampled parent with the flow's trace id: the span joins the flow's
            # trace (ParentBased follows it; the ratio was applied just above, per flow).
            parent = trace.set_span_in_context(
                NonRecordingSpan(
                    SpanContext(
                        trace_id,
                        (trace_id >> 64) or 1,
                        is_remote=True,
                        trace_flags=TraceFlags(TraceFlags.SAMPLED),
                    )
                )
            )
            span = self._tracer.start_span(
                "classifier flow",
                context=parent,
                kind=SpanKind.INTERNAL,
                start_time=when,
                attributes=attrs,
            )
            span.add_event("new flow", attributes=attrs, timestamp=when)
            span.end(when)
            self.traced += 1
