"""OpenTelemetry tracing: W3C trace context in, spans out by OTLP/gRPC; off by default.

``Tracing.from_config(endpoint, ratio, service)`` gives a tracer provider that samples
``ratio`` of new traces (a sampled parent is always followed: ``ParentBased``), batches spans
and exports them to an OTLP collector's gRPC endpoint. Without an endpoint it is
``Tracing.off()``: every call is a cheap no-op and nothing is allocated per request.

The exporter is this module's own (OTLP's ``TraceService/Export`` over grpcio with the
standard protobuf encoding), so the mesh needs only the SDK and the OTLP protos.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["TRACEPARENT", "OtlpGrpcExporter", "Tracing", "check_ratio"]

_log = logging.getLogger(__name__)
TRACEPARENT = "traceparent"
_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_PROPAGATOR = TraceContextTextMapPropagator()


def check_ratio(value: float, field: str = "trace_sample_ratio") -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{field}: {value} is not a fraction in 0-1")
    return value


class OtlpGrpcExporter(SpanExporter):
    """Spans to ``host:port`` (OTLP/gRPC, insecure), one Export call per batch."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        target = endpoint.removeprefix("http://")
        self._channel = grpc.insecure_channel(target)
        self._export = self._channel.unary_unary(
            _EXPORT,
            request_serializer=trace_service_pb2.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        self.timeout_s = timeout_s
        self.failures = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self._export(encode_spans(spans), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self.failures += 1
            _log.debug("OTLP export of %d spans failed: %s", len(spans), exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._channel.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class Tracing:
    """A tracer, or nothing (``enabled`` False), for one process."""

    def __init__(self, provider: TracerProvider | None, name: str) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self.tracer: trace.Tracer = (
            provider.get_tracer(name) if provider is not None else trace.NoOpTracer()
        )

    @classmethod
    def off(cls) -> Tracing:
        return cls(None, "adaptermesh")

    @classmethod
    def from_config(
        cls,
        endpoint: str | None,
        ratio: float = 1.0,
        service: str = "adaptermesh",
        exporter: SpanExporter | None = None,
        **batch: Any,
    ) -> Tracing:
        """``endpoint`` (``host:port`` of an OTLP/gRPC collector) None: tracing off."""
        check_ratio(ratio)
        if endpoint is None and exporter is None:
            return cls.off()
        provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(ratio)),
            resource=Resource.create({"service.name": service}),
        )
        provider.add_span_processor(
            BatchSpanProcessor(exporter or OtlpGrpcExporter(str(endpoint)), **batch)
        )
        return cls(provider, service)

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context | None:
        """The W3C trace context (``traceparent``/``tracestate``) the request carries."""
        if TRACEPARENT not in headers:
            return None
        return _PROPAGATOR.extract(headers)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
