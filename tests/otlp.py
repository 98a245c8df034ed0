"""A real OTLP/gRPC trace receiver for tests: what a collector would receive, span by span."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request, context):
        out = []
        for rs in request.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
                "",
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs: dict[str, object] = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = (
                            getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
                        )
                    out.append(
                        ReceivedSpan(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            attrs,
                        )
                    )
        with self.sink.lock:
            self.sink.spans.extend(out)
            self.sink.requests += 1
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``start(host)`` binds port 0 and returns it; spans land in ``spans``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = 0

    def start(self, host: str = "127.0.0.1") -> int:
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return self.port

    def stop(self) -> None:
        self._server.stop(0)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def envoy_and_worker_spans(
    receiver: OtlpReceiver, trace_id: str
) -> tuple[list[ReceivedSpan], list[ReceivedSpan]] | None:
    """Envoy's spans and the worker's request span in ``trace_id``; None until both came."""
    spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    envoy = [s for s in spans if s.service == "adaptermesh-envoy"]
    worker = [s for s in spans if s.name == "worker completion"]
    return (envoy, worker) if envoy and worker else None
