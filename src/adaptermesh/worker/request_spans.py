"""OpenTelemetry spans of one generation request (docs/tracing.md), built after it finished
from the times already taken, so tracing adds nothing to the request's own path."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context

from adaptermesh.assignment_rules import VERSION_SEPARATOR
from adaptermesh.tracing import Tracing
from adaptermesh.worker.fair_queue import Ticket
from adaptermesh.worker.generation_job import GenerationJob
from adaptermesh.worker.request_translation import SHARD_HEADER
from adaptermesh.worker.types import AdapterResolution

__all__ = ["record_request_spans", "trace_fields"]


def trace_fields(headers: Mapping[str, str], model: str, tenant: str) -> dict[str, Any]:
    """The job's ``trace_context`` (the W3C context the request carried) and ``trace_attrs``."""
    attrs = {
        "adaptermesh.model": model,
        "adaptermesh.tenant": tenant,
        "adaptermesh.adapter": model.split(VERSION_SEPARATOR, 1)[0],
        "adaptermesh.adapter_version": model.partition(VERSION_SEPARATOR)[2],
    }
    if shard := headers.get(SHARD_HEADER):
        attrs["adaptermesh.shard"] = shard
    return {"trace_context": Tracing.extract(headers), "trace_attrs": attrs}


def record_request_spans(
    tracer: Tracer,
    job: GenerationJob,
    ticket: Ticket,
    first: float | None,
    last: float | None,
    outcome: str,
    resolution: AdapterResolution | None = None,
) -> None:
    """The request's spans, from the times already taken (monotonic, turned into the
    epoch nanoseconds OTLP wants): the request, its queueing, adapter resolution (the
    engine's first lookup to its lease: the tier that served it and the load it waited
    for), prefill (admission to the first token) and decode (first to last token)."""
    now = time.monotonic()
    shift = time.time_ns() - int(now * 1e9)

    def epoch_ns(monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + shift

    attrs = dict(job.trace_attrs or {})
    attrs["adaptermesh.outcome"] = outcome
    root = tracer.start_span(
        "worker " + job.kind,
        context=job.trace_context,
        kind=SpanKind.SERVER,
        start_time=epoch_ns(job.arrived),
        attributes=attrs,
    )
    context = set_span_in_context(root)
    admitted = ticket.admitted_at
    if admitted is not None:
        tracer.start_span(
            "queue",
            context=context,
            start_time=epoch_ns(ticket.enqueued_at),
            attributes={"adaptermesh.tenant": job.tenant},
        ).end(epoch_ns(admitted))
        if first is not None:
            tracer.start_span(
                "prefill",
                context=context,
                start_time=epoch_ns(admitted),
                attributes={
                    "adaptermesh.prompt_tokens": len(job.prompt_ids),
                    "adaptermesh.adapter": job.adapter or "",
                },
            ).end(epoch_ns(first))
            if last is not None and last > first:
                tracer.start_span("decode", context=context, start_time=epoch_ns(first)).end(
                    epoch_ns(last)
                )
    if resolution is not None:
        tracer.start_span(
            "adapter resolution",
            context=context,
            start_time=epoch_ns(resolution.started),
            attributes={
                "adaptermesh.adapter": job.adapter or "",
                "adaptermesh.adapter.tier": resolution.tier,
                "adaptermesh.adapter.cache_hit": resolution.tier == "gpu",
                "adaptermesh.adapter.load_ms": resolution.load_s * 1e3,
                "adaptermesh.adapter.slot_version": resolution.version,
            },
        ).end(epoch_ns(max(resolution.resolved, resolution.started)))
    if outcome not in ("stop", "length"):
        root.set_status(Status(StatusCode.ERROR, outcome))
    root.end(epoch_ns(now))
