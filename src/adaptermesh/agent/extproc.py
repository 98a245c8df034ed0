"""The agent's Envoy external processor (``ext_proc``): adapter by body, and a GIE endpoint picker.

One gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` answers two kinds of Envoy:

- **a shard's Envoy** (its listener's ext_proc filter, built by ``mesh/snapshot.py``, names the
  shard in the gRPC initial metadata ``x-adaptermesh-shard``). The processor reads the OpenAI
  ``model`` field from the buffered body and sets ``x-adapter-id`` to it, which the shard's
  adapter-subset routes match; a base-model request (``model`` equal to the base model) loses
  any ``x-adapter-id`` the client sent. It also names its pick (below). When it cannot pick it
  forwards the request unchanged, and Envoy's ``failure_mode_allow`` covers a processor that is
  down: both fail open to the shard's catch-all route.
- **a Gateway API Inference Extension gateway** (no shard metadata): the processor is the
  pool's endpoint picker (GIE ``004-endpoint-picker-protocol``). It picks among every serving
  worker, or among the ``x-gateway-destination-endpoint-subset`` list when the gateway sends one
  in ``envoy.lb.subset_hint`` metadata, and returns the pick in the
  ``x-gateway-destination-endpoint`` request header and in dynamic metadata
  ``envoy.lb/x-gateway-destination-endpoint`` (the same value in both, as the protocol
  demands). With nothing eligible it answers an ImmediateResponse 503.

Body handling. A ``BUFFERED`` body arrives in one message after the headers were answered,
so the header changes ride on the body response. ``FULL_DUPLEX_STREAMED`` (what GIE's Envoy
setup and llm-d-router use, the only mode llm-d-router speaks) sends headers and body chunks
without waiting for answers: the processor holds its headers answer and the chunks until the
body ends (``end_of_stream``, or the trailers), reads ``model`` from the reassembled body, then
answers the headers with the mutation and each chunk, in order, with a streamed body response
carrying that chunk's bytes (``end_of_stream`` on the last). Chunks after a decision (a body
past ``max_body_bytes``) are answered one by one as they come. Where the chunks split the body
does not change the decision: it is the one a buffered body gets.
At most ``max_body_bytes`` are read for the model; a longer body (or one that is not a JSON
object with a string ``model``) is forwarded as if it named no model. (A shard listener's
Envoy itself refuses a body over its limit with 413, see ``mesh/snapshot.py``.)

Routing rules (``adaptermesh.rules``, see docs/rules.md). With a rule set installed
(``ExtProcServer.set_rules``) every request is evaluated once its adapter is known, over the
request headers, the source address (Envoy's ``source.address`` attribute, else the first
``x-forwarded-for`` entry), the tenant (``x-tenant-id``) and the adapter. The first matching
rule's action sets ``x-adaptermesh-shard``, ``x-adapter-version`` or ``x-adaptermesh-priority``,
or answers an ImmediateResponse with the rule's status (a reject).

Adapter versions (gray release, ``agent/splits.py``, docs/rollout.md). When the applied
Assignment splits the requested adapter between two versions, the client's bucket (its
``x-session-id``, else its source address) picks one; the processor then sets
``x-adapter-version`` and routes by the versioned name (``x-adapter-id: <adapter>@<version>``),
which the workers serve. A rule's ``adapter_version`` action beats the split.

Health: gRPC health checking answers ``""`` and ``liveness`` SERVING while the server runs, and
``readiness`` and the ext_proc service name SERVING once the picker knows the workers (the
agent has an Assignment), as the protocol asks of a picker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from adaptermesh.agent.picker import Decision, EndpointBook, decide, model_of
from adaptermesh.agent.splits import SESSION_HEADER, SplitTable
from adaptermesh.assignment_rules import served_name
from adaptermesh.loopthread import LoopThread
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
from adaptermesh.rules import Evaluator, RequestFacts
from adaptermesh.tracing import Tracing
from adaptermesh.worker_scrape import parse_metrics

__all__ = [
    "ADAPTER_HEADER",
    "DESTINATION_HEADER",
    "SHARD_METADATA_KEY",
    "ExtProcConfig",
    "ExtProcServer",
    "MetricsPoller",
]

_log = logging.getLogger(__name__)

ADAPTER_HEADER = "x-adapter-id"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# gRPC initial metadata a shard listener's filter sends; its absence marks a GIE gateway.
SHARD_METADATA_KEY = "x-adaptermesh-shard"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# What a routing rule's action sets, and the header a rule reads the tenant from.
RULE_SHARD_HEADER = "x-adaptermesh-shard"
RULE_VERSION_HEADER = "x-adapter-version"
RULE_PRIORITY_HEADER = "x-adaptermesh-priority"
TENANT_HEADER = "x-tenant-id"
_SOURCE_ATTRIBUTE = "source.address"
_ACTION_HEADERS = {
    "shard": RULE_SHARD_HEADER,
    "adapter_version": RULE_VERSION_HEADER,
    "priority": RULE_PRIORITY_HEADER,
}

_TRACE_KEYS = frozenset({"traceparent", "tracestate"})
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass(frozen=True, slots=True)
class ExtProcConfig:
    base_model: str | None = None
    max_body_bytes: int = 4 << 20
    # Extra endpoints after the best one in the GIE answer; 0 keeps the header a single
    # ip:port, which Envoy's ORIGINAL_DST cluster (GIE's documented setup) needs.
    fallbacks: int = 0


class _Servicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        book: EndpointBook,
        config: ExtProcConfig,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.book = book
        self.config = config
        self.on_decision = on_decision
        # Swapped whole by ExtProcServer.set_rules; read once per request.
        self.rules: Evaluator | None = None
        # The applied Assignment (its adapter splits), read per request.
        self.assignment: Callable[[], assignment_pb2.Assignment | None] | None = None
        self.splits = SplitTable()
        # OpenTelemetry (docs/tracing.md): a span per decision, in the trace Envoy's ext_proc
        # call carries in its gRPC metadata.
        self.tracing = Tracing.off()

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        shard: str | None = None
        facts = _Facts()
        for key, value in context.invocation_metadata() or ():
            if key == SHARD_METADATA_KEY:
                shard = value if isinstance(value, str) else value.decode()
            elif key in _TRACE_KEYS and self.tracing.enabled:
                facts.trace[key] = value if isinstance(value, str) else value.decode()
        full_duplex = False
        held_headers = False
        decided: Decision | None = None
        subset: list[str] | None = None
        # The request body's chunks as received, until the decision; ``size`` bytes in all.
        chunks: list[bytes] = []
        size = 0
        over = False
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if request.HasField("protocol_config"):
                full_duplex = request.protocol_config.request_body_mode == _FULL_DUPLEX
            if request.HasField("metadata_context"):
                subset = _subset(request.metadata_context) if subset is None else subset
            if kind == "request_headers":
                facts.read(request)
                if request.request_headers.end_of_stream:  # no body: no model
                    decided = self._decide(None, shard, subset, facts)
                    yield self._headers_answer(decided)
                    if decided.status is not None:
                        return
                elif full_duplex:
                    held_headers = True
                else:
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            elif kind == "request_body":
                chunk = request.request_body
                if decided is not None:  # streaming on after the decision
                    yield _body_echo(chunk.body, chunk.end_of_stream)
                    continue
                chunks.append(chunk.body)
                size += len(chunk.body)
                over = size > self.config.max_body_bytes
                if not (chunk.end_of_stream or over or not full_duplex):
                    continue
                model = None if over else model_of(b"".join(chunks))
                decided = self._decide(model, shard, subset, facts)
                if decided.status is not None:
                    yield _immediate(decided)
                    return
                if held_headers:
                    yield self._headers_answer(decided)
                    for response in _body_echoes(chunks, chunk.end_of_stream):
                        yield response
                else:
                    yield self._body_answer(decided)
                chunks = []
            elif kind == "request_trailers":
                if decided is None:  # a body that ended only at its trailers
                    decided = self._decide(
                        None if over else model_of(b"".join(chunks)), shard, subset, facts
                    )
                    if decided.status is not None:
                        yield _immediate(decided)
                        return
                    if held_headers:
                        yield self._headers_answer(decided)
                        for response in _body_echoes(chunks, False):
                            yield response
                    chunks = []
                yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            elif kind == "response_headers":
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
            elif kind == "response_body":
                chunk = request.response_body
                if full_duplex:
                    yield ep.ProcessingResponse(
                        response_body=ep.BodyResponse(
                            response=ep.CommonResponse(
                                body_mutation=ep.BodyMutation(
                                    streamed_response=ep.StreamedBodyResponse(
                                        body=chunk.body, end_of_stream=chunk.end_of_stream
                                    )
                                )
                            )
                        )
                    )
                else:
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
            elif kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    def _decide(
        self, model: str | None, shard: str | None, subset: list[str] | None, facts: _Facts
    ) -> _Decided:
        if not self.tracing.enabled:
            return self._decide_now(model, shard, subset, facts)
        started = time.time_ns()
        decision = self._decide_now(model, shard, subset, facts)
        attrs = {
            "adaptermesh.adapter": model or "",
            "adaptermesh.served": decision.adapter or "",
            "adaptermesh.shard": shard or "",
            "adaptermesh.source": facts.source_ip,
            "adaptermesh.endpoint": ",".join(decision.endpoints),
            "adaptermesh.reason": decision.reason,
        }
        for key, value in decision.rule_headers:
            attrs[key] = value
        span = self.tracing.tracer.start_span(
            "ext_proc decide",
            context=Tracing.extract(facts.trace),
            kind=SpanKind.SERVER,
            start_time=started,
            attributes=attrs,
        )
        if decision.status is not None:
            span.set_status(Status(StatusCode.ERROR, f"answered {decision.status}"))
        span.end()
        return decision

    def _decide_now(
        self, model: str | None, shard: str | None, subset: list[str] | None, facts: _Facts
    ) -> _Decided:
        # A gray release (agent/splits.py) picks the adapter's version first, so the endpoint
        # pick and the adapter header see the versioned name the workers serve it under.
        served, version = model, None
        if self.assignment is not None:
            self.splits.refresh(self.assignment())
        rules = self.rules
        outcome = None
        if rules is not None:
            outcome = rules.evaluate(
                RequestFacts(
                    source_ip=facts.source_ip,
                    tenant=facts.headers.get(TENANT_HEADER, ""),
                    headers=facts.headers,
                    adapter=model or "",
                )
            )
        action = outcome.action if outcome is not None else None
        if model is not None and model != self.config.base_model:
            if action is not None and action.kind == "adapter_version":
                version = action.value  # an operator's rule beats the rollout's split
                served = served_name(model, version)
            elif self.splits:
                pick = self.splits.pick(model, facts.headers.get(SESSION_HEADER) or facts.source_ip)
                if pick is not None:
                    served, version = pick.served, pick.version
        decision = decide(
            served,
            self.config.base_model,
            self.book.candidates(shard),
            subset=subset,
            must_pick=shard is None,
            rotation=self.book.rotation,
            fallbacks=self.config.fallbacks,
        )
        decision = _Decided(**{f: getattr(decision, f) for f in _DECISION_FIELDS})
        if version:
            decision.rule_headers.append((RULE_VERSION_HEADER, version))
        if decision.status is None and action is not None:
            assert outcome is not None
            if action.kind == "reject":
                decision = dataclasses.replace(
                    decision,
                    endpoints=(),
                    status=action.status,
                    reason=action.message or f"rejected by rule {outcome.rule}",
                )
            elif action.kind != "adapter_version":
                decision.rule_headers.append((_ACTION_HEADERS[action.kind], action.value))
        if decision.endpoints:
            self.book.note_pick(decision.endpoints[0])
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    def _common(self, decision: Decision) -> ep.CommonResponse:
        mutation = ep.HeaderMutation()
        for key, value in getattr(decision, "rule_headers", ()):
            mutation.set_headers.append(_header(key, value))
        if decision.adapter is not None:
            mutation.set_headers.append(_header(ADAPTER_HEADER, decision.adapter))
        else:
            mutation.remove_headers.append(ADAPTER_HEADER)
        if decision.endpoints:
            mutation.set_headers.append(_header(DESTINATION_HEADER, ",".join(decision.endpoints)))
        # The adapter header decides the route: re-match it after the change.
        return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)

    def _headers_answer(self, decision: Decision) -> ep.ProcessingResponse:
        if decision.status is not None:
            return _immediate(decision)
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=self._common(decision)),
            dynamic_metadata=_metadata(decision),
        )

    def _body_answer(self, decision: Decision) -> ep.ProcessingResponse:
        return ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=self._common(decision)),
            dynamic_metadata=_metadata(decision),
        )


_DECISION_FIELDS = tuple(f.name for f in dataclasses.fields(Decision))


@dataclass(frozen=True)
class _Decided(Decision):
    """The picker's decision plus the headers a routing rule's action sets."""

    rule_headers: list[tuple[str, str]] = field(default_factory=list)


class _Facts:
    """What the request headers tell the routing rules."""

    __slots__ = ("headers", "source_ip", "trace")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.source_ip = ""
        self.trace: dict[str, str] = {}

    def read(self, request: ep.ProcessingRequest) -> None:
        for h in request.request_headers.headers.headers:
            self.headers[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
        attrs = request.attributes.get("envoy.filters.http.ext_proc")
        source = attrs.fields.get(_SOURCE_ATTRIBUTE) if attrs is not None else None
        if source is not None and source.string_value:
            self.source_ip = _host(source.string_value)
        elif forwarded := self.headers.get("x-forwarded-for"):
            self.source_ip = forwarded.split(",")[0].strip()


def _host(address: str) -> str:
    """``10.0.0.1:5000`` or ``[2001:db8::1]:5000`` -> the address alone."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _metadata(decision: Decision) -> struct_pb2.Struct | None:
    if not decision.endpoints:
        return None
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = ",".join(
        decision.endpoints
    )
    return meta


def _subset(context: base_pb2.Metadata) -> list[str] | None:
    hint = context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def _body_echo(data: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(
                        body=data, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def _body_echoes(chunks: list[bytes], end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """One streamed body response per held chunk, in order; ``end_of_stream`` on the last (an
    empty body still gets one response, so the stream's end reaches Envoy)."""
    if not chunks:
        return [_body_echo(b"", end_of_stream)]
    last = len(chunks) - 1
    return [_body_echo(data, end_of_stream and i == last) for i, data in enumerate(chunks)]


def _immediate(decision: Decision) -> ep.ProcessingResponse:
    code = decision.status or 503
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code),
            body=decision.reason.encode(),
            details=decision.reason.replace(" ", "_"),
        )
    )


class ExtProcServer:
    """The processor on grpcio's asyncio server, on its own thread (like the xDS server), so
    its latency does not depend on what the agent's event loop is doing."""

    def __init__(
        self,
        book: EndpointBook,
        config: ExtProcConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_decision: Callable[[Decision], None] | None = None,
        ready: bool = True,
        assignment: Callable[[], assignment_pb2.Assignment | None] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.book = book
        self.config = config or ExtProcConfig()
        self._ready = ready
        self.host = host
        self._requested_port = port
        self.port = 0
        self._on_decision = on_decision
        self._loop = LoopThread("ext-proc")
        self._server: grpc.aio.Server | None = None
        self._servicer = _Servicer(book, self.config, on_decision)
        self._servicer.assignment = assignment
        if tracing is not None:
            self._servicer.tracing = tracing
        self.health = health.aio.HealthServicer()

    def start(self) -> int:
        self.port = self._loop.start(self._start)
        _log.info("ext_proc server listening on %s:%d", self.host, self.port)
        return self.port

    async def _start(self) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 2 * self.config.max_body_bytes + (1 << 20)),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = int(server.add_insecure_port(f"{self.host}:{self._requested_port}"))
        if port == 0:
            raise OSError(f"cannot bind the ext_proc server to {self.host}:{self._requested_port}")
        await server.start()
        for name in ("", "liveness"):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready(self._ready)
        self._server = server
        return port

    async def _set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("readiness", SERVICE_NAME):
            await self.health.set(name, status)

    def set_rules(self, rules: Evaluator | None) -> None:
        """Install a compiled routing-rule set (None: no rules), from any thread; requests
        already past their decision keep the set they saw."""
        self._servicer.rules = rules

    @property
    def rules(self) -> Evaluator | None:
        return self._servicer.rules

    def set_ready(self, ready: bool) -> None:
        """Readiness (and the ext_proc service's health) from any thread."""
        self._ready = ready
        if self._loop.loop is not None:
            asyncio.run_coroutine_threadsafe(self._set_ready(ready), self._loop.loop)

    def stop(self, grace: float = 0.5) -> None:
        self._loop.stop(self._server, grace)
        self._server = None


class MetricsPoller:
    """Scrapes every worker the book knows (``GET /metrics``) into the book.

    ``assignment`` (the agent's applied Assignment) refreshes the book's workers first when its
    version changed. ``step()`` is one round; ``run()`` repeats it every ``interval_s``. A worker that does not
    answer is forgotten (scored as unknown) rather than kept at its last, possibly idle,
    reading. A failed round is logged and the loop goes on.
    """

    def __init__(
        self,
        book: EndpointBook,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        client: httpx.AsyncClient | None = None,
        assignment: Callable[[], assignment_pb2.Assignment | None] | None = None,
        on_assignment: Callable[[assignment_pb2.Assignment], None] | None = None,
    ) -> None:
        self.book = book
        self._assignment = assignment
        self._on_assignment = on_assignment
        self._version: int | None = None
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._client = client
        self.rounds = 0
        self.failures = 0

    async def step(self, client: httpx.AsyncClient) -> None:
        current = self._assignment() if self._assignment is not None else None
        if current is not None and current.version != self._version:
            self.book.set_assignment(current)
            self._version = current.version
            if self._on_assignment is not None:
                self._on_assignment(current)

        async def one(address: str, port: int) -> None:
            host = f"[{address}]" if ":" in address else address
            try:
                resp = await client.get(f"http://{host}:{port}/metrics", timeout=self.timeout_s)
                resp.raise_for_status()
                sample = parse_metrics(resp.text)
            except (httpx.HTTPError, ValueError) as exc:
                self.failures += 1
                _log.debug("scrape of %s:%d failed: %s", address, port, exc)
                self.book.observe(address, port, None)
                return
            self.book.observe(address, port, sample)

        await asyncio.gather(*(one(a, p) for a, p in self.book.targets()))
        self.rounds += 1

    async def run(self, stop: asyncio.Event | None = None) -> None:
        client = self._client or httpx.AsyncClient()
        try:
            while stop is None or not stop.is_set():
                started = time.monotonic()
                try:
                    await self.step(client)
                except Exception:
                    _log.exception("metrics round failed")
                delay = max(self.interval_s - (time.monotonic() - started), 0.0)
                if stop is None:
                    await asyncio.sleep(delay)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
        finally:
            if self._client is None:
                await client.aclose()
