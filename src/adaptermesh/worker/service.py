"""The worker's OpenAI-compatible HTTP service (aiohttp) around an ``EngineProtocol`` engine.

Routes follow vLLM's, so existing clients, gateways and dashboards work unchanged:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` gives SSE);
- ``GET /v1/models``; ``POST /v1/load_lora_adapter``; ``POST /v1/unload_lora_adapter``;
- ``GET /health`` and ``GET /metrics``.

Every generation request passes through a ``FairQueue`` keyed by tenant before it reaches the
engine, so the engine never holds more than ``max_running`` of this service's requests and
memory stays bounded. Errors use OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` with ``param`` naming the offending field (``http_errors.py``).

``WorkerService._generate`` is a generation request's whole path, top to bottom; the pieces it
calls live beside it: ``request_body.py`` (reading the JSON body), ``request_translation.py``
(the OpenAI body to the engine's ``GenerationRequest``), ``generation_responses.py`` (an SSE
stream, or each choice collected), ``response_rendering.py`` (the bodies and chunks),
``admin_endpoints.py`` and ``status_endpoints.py`` (the other routes), ``request_spans.py``
(tracing) and ``http_server.py`` (the error middleware and ``serve``).

Run it with ``serve()``: it puts the app behind ``adaptermesh.httpserve``'s listener guards
(header and body deadlines, header caps, a connection cap) with ``handler_cancellation=True``,
so a client that disconnects cancels its handler, which cancels the engine request and frees
its slot even while it is queued.

CPU-heavy request work stays off the event loop: bodies over ``JSON_INLINE_BYTES`` are parsed
in a child process, and prompts over ``_TOKENIZE_INLINE_CHARS`` are tokenised on a thread (the
Rust tokenizer releases the GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from adaptermesh.httpserve import JsonBodyParser, ListenerLimits
from adaptermesh.tracing import Tracing
from adaptermesh.worker.admin_endpoints import (
    check_admin_token,
    load_adapter_into_engine,
    loaded_message,
    set_fault_rate,
    unload_adapter_from_engine,
    unloaded_message,
)
from adaptermesh.worker.api import (
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from adaptermesh.worker.fair_queue import FairQueue, QueueFullError, Ticket
from adaptermesh.worker.faults import FaultTable
from adaptermesh.worker.generation_inputs import GenerationInputs
from adaptermesh.worker.generation_job import (
    ChoiceEvent,
    ChoiceProgress,
    GenerationJob,
    GenerationKind,
    record_event,
    request_outcome,
)
from adaptermesh.worker.generation_responses import (
    FinishError,
    NextEvent,
    collect_choice,
    interleaved,
    stream_choices,
    stream_single_choice,
)
from adaptermesh.worker.http_errors import (
    ApiError,
    QueuedPastDeadlineError,
    adapter_error,
    draining_error,
    engine_error_as_api_error,
    finish_reason_error,
    generation_deadline_error,
    invalid_field,
    retry_after_headers,
)
from adaptermesh.worker.http_server import error_middleware, serve
from adaptermesh.worker.metrics import ServiceMetrics
from adaptermesh.worker.request_body import decode_json_object, read_json_object
from adaptermesh.worker.request_spans import record_request_spans, trace_fields
from adaptermesh.worker.request_translation import (
    ADAPTER_HEADER,
    REQUEST_TIMEOUT_HEADER,
    SHARD_HEADER,
    VERSION_HEADER,
    checked_max_tokens,
    generation_job,
    generation_request,
    merged_adapter,
    parse_body,
    parse_generation_body,
    request_timeout,
    resolve_model,
    tenant_of,
)
from adaptermesh.worker.response_rendering import best_candidates, final_body, usage_body
from adaptermesh.worker.status_endpoints import (
    health_response,
    metrics_response,
    model_body,
    models_body,
)
from adaptermesh.worker.structured_request import (
    SCHEMA_DOCUMENTS,
)
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    EngineError,
    EngineOverloadedError,
    EngineProtocol,
    TokenEvent,
    TokenStream,
)

__all__ = [
    "ADAPTER_HEADER",
    "SHARD_HEADER",
    "VERSION_HEADER",
    "ApiError",
    "ChoiceEvent",
    "ServiceConfig",
    "WorkerService",
    "serve",
    "tenant_of",
]

log = logging.getLogger(__name__)

# Prompts up to this many characters are tokenised on the event loop (under 1 ms with the
# Rust tokenizer); longer ones on a thread, so a 4 MB prompt does not stall other requests.
_TOKENIZE_INLINE_CHARS = 16 << 10
_Result = TypeVar("_Result")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Limits and policies of one worker service. See ``docs/worker-service.md``."""

    # Requests admitted into the engine at once; the rest wait in the tenant queues.
    max_running: int = 64
    max_waiting_per_tenant: int = 64
    max_waiting_total: int = 1024
    # Deadline of a request that does not send ``x-request-timeout`` (seconds).
    request_timeout_s: float = 600.0
    # A client's ``x-request-timeout`` is capped at this (seconds).
    max_request_timeout_s: float = 3600.0
    # Retry-After on 429 and 503 (seconds).
    retry_after_s: int = 1
    admin_token: str | None = None
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 16
    # Seconds SIGTERM waits for in-flight requests before cancelling them.
    drain_timeout_s: float = 30.0
    # Seconds of the drain during which /health already fails but new requests are still
    # served: a load balancer that routes by health checks (Envoy every 5 s) stops sending
    # before the worker starts refusing, so no request lands on a refusing worker.
    drain_grace_s: float = 0.0
    stats_poll_interval_s: float = 1.0
    # The output format chat tool calls are parsed from (tool_calls.TOOL_CALL_PARSERS):
    # "auto" picks by the tokenizer's marker tokens, then the model family.
    tool_call_parser: str = "auto"
    # Header/body deadlines, header caps and the connection cap of the listener.
    listener: ListenerLimits = field(default_factory=ListenerLimits)


@dataclass(frozen=True, slots=True)
class _Running:
    """An admitted request's choices: per choice, the call that reads its next event, and its
    progress; and the error of a choice that finished ``cancelled`` or ``error``."""

    next_events: list[NextEvent]
    progresses: list[ChoiceProgress]
    finish_error: FinishError


class WorkerService:
    """The aiohttp application plus the fair queue and metrics it serves with."""

    def __init__(
        self,
        engine: EngineProtocol,
        config: ServiceConfig | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or ServiceConfig()
        # OpenTelemetry spans per request (docs/tracing.md); off unless the worker is given
        # an OTLP endpoint.
        self.tracing = tracing or Tracing.off()
        self.queue = FairQueue(
            max_running=self.config.max_running,
            max_waiting_per_tenant=self.config.max_waiting_per_tenant,
            max_waiting_total=self.config.max_waiting_total,
        )
        self.metrics = ServiceMetrics(engine, self.queue)
        self.faults = FaultTable()
        self.draining = False  # new generation requests are refused
        self.unready = False  # /health fails (from the start of a drain)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._poller: asyncio.Task[None] | None = None
        self.app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[error_middleware]
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.get("/v1/models", self._models),
                web.get("/v1/models/{name}", self._model),
                web.post("/v1/load_lora_adapter", self._load_adapter),
                web.post("/v1/unload_lora_adapter", self._unload_adapter),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/v1/admin/faults", self._get_faults),
                web.post("/v1/admin/faults", self._set_faults),
            ]
        )
        self.app.on_startup.append(self._start_poller)
        self.app.on_cleanup.append(self._stop_poller)
        self.app.on_cleanup.append(self._close_executors)
        self._json = JsonBodyParser(nested=SCHEMA_DOCUMENTS)
        # Output constraints, grammars and prompt ids (long ones off the event loop).
        self.inputs = GenerationInputs(engine, self.config.tool_call_parser)
        # A finished request's spans, from the times already taken (request_spans.py).
        self._record_spans = functools.partial(record_request_spans, self.tracing.tracer)

    # ----------------------------------------------------------------- generation endpoints
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: GenerationKind) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``, the whole path: parse the
        body, validate it, resolve the adapter and tokenise (``build_job``), wait in the
        tenant queue, submit one ``GenerationRequest`` per choice, then stream the events as
        SSE or collect them, and answer."""
        body = await self._read_json(request)
        # Validate, resolve the model and adapter, tokenise, check the context and deadline.
        job = await self.build_job(request, body, kind)
        self._inject_fault(job)
        async with self._running(job) as run:
            next_events, progresses = run.next_events, run.progresses
            # The first events come before any header, so errors still get a real status code.
            firsts = [await next_event() for next_event in next_events]
            if job.stream and job.n == 1:
                return await stream_single_choice(
                    request, job, firsts[0], next_events[0], run.finish_error, progresses[0]
                )
            if job.stream:
                return await stream_choices(
                    request, job, firsts, next_events, run.finish_error, progresses
                )
            # Not streamed: every choice collected, then one JSON body.
            results = await asyncio.gather(
                *(
                    collect_choice(first, next_event, run.finish_error)
                    for first, next_event in zip(firsts, next_events, strict=True)
                ),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            outputs = [result for result in results if isinstance(result, tuple)]
            progresses[0].outcome = request_outcome(progresses)
            if job.best_of:
                # The n candidates with the highest cumulative logprob, best first; usage
                # counts every candidate's tokens.
                chosen = best_candidates(outputs, job.n)
                return web.json_response(
                    final_body(
                        job,
                        [outputs[i] for i in chosen],
                        [progresses[i] for i in chosen],
                        usage=usage_body(progresses),
                    )
                )
            return web.json_response(final_body(job, outputs, progresses))

    @contextlib.asynccontextmanager
    async def _running(self, job: GenerationJob) -> AsyncIterator[_Running]:
        """A generation request's one path through the worker, for every route: wait for its
        adapter, take its place in the tenant queue, wait for admission, submit its choices,
        and hand the caller their event readers; then, however the caller ends (an answer,
        an ``ApiError``, a disconnect), cancel what still runs, release the queue slot and
        record the request once. ``progresses[0].outcome``, where the caller sets it, is the
        outcome recorded; else the way the request ended names it."""
        await self._adapter_ready(job)
        ticket = self._enqueue(job)
        progresses = [ChoiceProgress() for _ in range(job.candidates)]
        streams: list[TokenStream] = []
        ended = "error"
        try:
            await self._wait_for_admission(job, ticket)
            # One GenerationRequest per choice, each the engine's own sequence.
            self._submit_choices(job, streams)
            yield _Running(
                self._event_readers(job, streams, progresses), progresses, self._finish_error(job)
            )
        except QueuedPastDeadlineError:
            ended = "deadline_queued"
            raise
        except ApiError as exc:
            ended = exc.code or "error"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            ended = "disconnected"
            raise
        finally:
            self._settle(job, ticket, streams, progresses, progresses[0].outcome or ended)

    async def _adapter_ready(self, job: GenerationJob) -> None:
        """Wait for the job's adapter when its load is in flight or must come from a store
        (``Engine.await_adapter``), before the job takes a place in the tenant queue and an
        admission slot: 503 with Retry-After when that wait runs out."""
        await_adapter = getattr(self.engine, "await_adapter", None)
        if await_adapter is None or job.adapter is None:
            return
        try:
            await await_adapter(job.adapter)
        except EngineError as exc:
            error = engine_error_as_api_error(exc, self.config.retry_after_s)
            # Counted once, as a request that reached the engine and failed would be.
            self.metrics.observe_finished(
                outcome=error.code or "error",
                arrived=job.arrived,
                first_token=None,
                last_token=None,
                completion_tokens=0,
                adapter=job.adapter,
            )
            raise error from None

    async def build_job(
        self, request: web.Request, body: dict[str, Any], kind: GenerationKind
    ) -> GenerationJob:
        """``body`` validated as a completion or chat request of ``request``'s tenant, with the
        same limits and errors as the HTTP routes (``ApiError``)."""
        if self.draining:
            raise draining_error(self.config.retry_after_s)
        arrived = time.monotonic()
        parsed = parse_generation_body(kind, body)
        model, adapter = resolve_model(parsed.model, request.headers, self.engine.model_name)
        model, adapter = await merged_adapter(parsed, model, adapter, self.engine)
        spec, plan = self.inputs.output_constraints(parsed)
        if plan is not None and getattr(self.engine, "compile_grammar", None) is not None:
            # Every tool definition compiles, whatever the tool choice (400 naming it).
            for tool_spec in plan.tool_specs():
                await self.inputs.compile_grammar(tool_spec, adapter)
        # An adapter that ships its own tokenizer tokenises its prompts (adapter_text.py).
        prompt_ids = await self.inputs.prompt_token_ids(parsed, plan, adapter)
        grammar = None if spec is None else await self.inputs.compile_grammar(spec, adapter)
        echo = None
        if isinstance(parsed, CompletionRequest) and parsed.echo:
            prompt = parsed.prompt
            text = await self.inputs.adapter_text(adapter) or self.engine
            echo = prompt if isinstance(prompt, str) else text.detokenize(list(prompt))
        max_tokens = checked_max_tokens(
            parsed, len(prompt_ids), self.engine.max_model_len, self.config.default_max_tokens
        )
        timeout_s = request_timeout(
            request.headers.get(REQUEST_TIMEOUT_HEADER),
            self.config.request_timeout_s,
            self.config.max_request_timeout_s,
        )
        tenant = tenant_of(request)
        return generation_job(
            parsed,
            model=model,
            adapter=adapter,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            tenant=tenant,
            arrived=arrived,
            timeout_s=timeout_s,
            echo=echo,
            trace_fields=(
                trace_fields(request.headers, model, tenant) if self.tracing.enabled else None
            ),
            grammar=grammar,
            tool_plan=plan,
        )

    async def job_events(self, job: GenerationJob) -> AsyncGenerator[ChoiceEvent, None]:
        """Run ``job`` and yield its choices' events as they come, for transports other than
        HTTP responses (the WebSocket route).

        Same tenant queue, deadlines, metrics and errors (``ApiError``, raised from the
        iterator) as ``_generate``. The event that finishes the last choice carries the
        request's usage. Closing the iterator early, or cancelling its consumer, cancels the
        engine sequences and counts the request as ``disconnected``, as an HTTP client that
        goes away does.
        """
        if job.best_of:
            raise invalid_field(
                "best_of",
                "above n is served by the HTTP routes only: its candidates are ranked after "
                "they finish, so their events cannot be sent as they come",
                code="unsupported",
            )
        async with (
            self._running(job) as run,
            contextlib.aclosing(interleaved(run.next_events)) as items,
        ):
            finished = 0
            async for index, item in items:
                if isinstance(item, ApiError):
                    raise item
                reason = item.finish_reason
                if reason in ("cancelled", "error"):
                    raise run.finish_error(str(reason))
                usage = None
                if reason is not None:
                    finished += 1
                    if finished == job.n:
                        run.progresses[0].outcome = request_outcome(run.progresses)
                        usage = usage_body(run.progresses)
                yield ChoiceEvent(index, item, usage)

    # ---------------------------------------- the steps every transport shares (HTTP and WS)
    def _inject_fault(self, job: GenerationJob) -> None:
        """An operator's injected fault (worker/faults.py): a 500, counted as the adapter's."""
        if self.faults.should_fail(job.adapter):
            self.metrics.observe_finished(
                outcome="injected_fault",
                arrived=job.arrived,
                first_token=None,
                last_token=None,
                completion_tokens=0,
                adapter=job.adapter,
            )
            raise ApiError(
                500,
                f"injected fault for adapter {job.adapter!r}",
                type="server_error",
                code="injected_fault",
            )

    def _enqueue(self, job: GenerationJob) -> Ticket:
        """Put the request in its tenant's queue (429 when full) and count it in flight."""
        try:
            ticket = self.queue.submit(
                job.tenant, cost=len(job.prompt_ids) + job.candidates * job.sampling.max_tokens
            )
        except QueueFullError as exc:
            self.metrics.rejected.labels(reason=f"{exc.scope}_queue_full").inc()
            raise ApiError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers=retry_after_headers(self.config.retry_after_s),
            ) from None
        self._inflight += 1
        self._idle.clear()
        return ticket

    async def _wait_for_admission(self, job: GenerationJob, ticket: Ticket) -> None:
        """Wait for the queue to admit the request (504 past its deadline)."""
        try:
            async with asyncio.timeout_at(job.deadline):
                await self.queue.wait(ticket)
        except TimeoutError:
            raise QueuedPastDeadlineError(retry_after_headers(self.config.retry_after_s)) from None
        assert ticket.admitted_at is not None
        self.metrics.queue_wait.observe(ticket.admitted_at - ticket.enqueued_at)
        self.metrics.observe_prompt(len(job.prompt_ids))

    def _submit_choices(self, job: GenerationJob, streams: list[TokenStream]) -> None:
        """Submit the request's n choices to the engine, appending each stream as it is made
        (so a failure part-way still leaves every submitted stream to cancel)."""
        try:
            for index in range(job.candidates):
                streams.append(self.engine.submit(generation_request(job, index)))
        except EngineError as exc:
            raise self._engine_error(exc) from None

    def _event_readers(
        self, job: GenerationJob, streams: list[TokenStream], progresses: list[ChoiceProgress]
    ) -> list[NextEvent]:
        """Per choice, the call that waits for its next engine event and records it."""
        return [
            functools.partial(self._next_event, stream.__aiter__(), job, progress)
            for stream, progress in zip(streams, progresses, strict=True)
        ]

    async def _next_event(
        self, events: AsyncIterator[TokenEvent], job: GenerationJob, progress: ChoiceProgress
    ) -> TokenEvent:
        try:
            async with asyncio.timeout_at(job.deadline):
                event = await anext(events)
        except TimeoutError:
            raise generation_deadline_error() from None
        except StopAsyncIteration:
            raise ApiError(
                500,
                "the engine ended the request without a finish reason",
                type="server_error",
                code="engine_error",
            ) from None
        except EngineError as exc:
            raise self._engine_error(exc) from None
        record_event(progress, event, len(job.prompt_ids), time.monotonic())
        return event

    def _finish_error(self, job: GenerationJob) -> FinishError:
        """The error of a choice of ``job`` that finished ``cancelled`` or ``error``."""

        def error_of(reason: str) -> ApiError:
            return finish_reason_error(reason, job.deadline, self.config.retry_after_s)

        return error_of

    def _engine_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, EngineOverloadedError):
            self.metrics.rejected.labels(reason="engine_overloaded").inc()
        return engine_error_as_api_error(exc, self.config.retry_after_s)

    def _settle(
        self,
        job: GenerationJob,
        ticket: Ticket,
        streams: list[TokenStream],
        progresses: list[ChoiceProgress],
        outcome: str,
    ) -> None:
        """Cancel unfinished choices, release the queue slot, record the request once, and
        mark the server idle when it was the last in flight."""
        for stream, progress in zip(streams, progresses, strict=False):
            if progress.finish_reason is None:
                stream.cancel()
        self.queue.release(ticket)
        # One observation per request: with n choices, the first token of any choice and the
        # last of all, over the longest choice's tokens.
        firsts_seen = [p.first_token for p in progresses if p.first_token is not None]
        lasts_seen = [p.last_token for p in progresses if p.last_token is not None]
        self.metrics.observe_finished(
            outcome=outcome,
            arrived=job.arrived,
            first_token=min(firsts_seen) if firsts_seen else None,
            last_token=max(lasts_seen) if lasts_seen else None,
            completion_tokens=max(p.completion_tokens for p in progresses),
            adapter=job.adapter,
        )
        if self.tracing.enabled:
            resolution = next((p.resolution for p in progresses if p.resolution), None)
            self._record_spans(
                job,
                ticket,
                min(firsts_seen) if firsts_seen else None,
                max(lasts_seen) if lasts_seen else None,
                outcome,
                resolution,
            )
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    # ------------------------------------------------------------------- adapter endpoints
    async def _load_adapter(self, request: web.Request) -> web.Response:
        check_admin_token(request.headers, self.config.admin_token)
        load = parse_body(LoadLoraAdapterRequest, await self._read_json(request))
        if load.lora_name == self.engine.model_name:
            raise invalid_field("lora_name", "must differ from the base model's name")
        await self.load_adapter(load.lora_name, load.lora_path, pinned=load.pinned)
        return web.Response(text=loaded_message(load.lora_name))

    async def load_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load (or reload) adapter ``name`` from ``path``, for every transport; engine errors
        become ``ApiError`` naming ``lora_name`` or ``lora_path``. ``pinned`` keeps it in its GPU
        slot (never evicted) until it is loaded again unpinned or unloaded."""
        await load_adapter_into_engine(
            self.engine, name, path, pinned=pinned, retry_after_s=self.config.retry_after_s
        )

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        check_admin_token(request.headers, self.config.admin_token)
        name = parse_body(UnloadLoraAdapterRequest, await self._read_json(request)).lora_name
        await self.unload_adapter(name)
        return web.Response(text=unloaded_message(name))

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``, for every transport; errors as ``ApiError``."""
        await unload_adapter_from_engine(self.engine, name)

    async def _get_faults(self, request: web.Request) -> web.Response:
        check_admin_token(request.headers, self.config.admin_token)
        return web.json_response({"faults": self.faults.rates()})

    async def _set_faults(self, request: web.Request) -> web.Response:
        """``{"adapter": name, "error_rate": 0-1}`` (admin token); rate 0 clears."""
        check_admin_token(request.headers, self.config.admin_token)
        set_fault_rate(self.faults, await self._read_json(request))
        return web.json_response({"faults": self.faults.rates()})

    # -------------------------------------------------------------------- status endpoints
    async def _health(self, _request: web.Request) -> web.Response:
        ranks_up = getattr(self.engine, "ranks_up", None)
        ranks: tuple[bool, ...] = ranks_up() if callable(ranks_up) else ()
        return health_response(self.unready or self.draining, self.config.retry_after_s, ranks)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(models_body(self.engine))

    async def _model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model: the base model, or an adapter this worker serves now or
        would load at its first request (``location``: resident, root, store); 404
        ``model_not_found`` otherwise. Nothing is loaded (a store's copy is fetched into the
        cache). The control plane asks it before a rollout (docs/rollout.md)."""
        name = request.match_info["name"]
        if name == self.engine.model_name:
            return web.json_response(model_body(self.engine, name, None, "resident"))
        try:
            location = await self.engine.locate_adapter(name)
        except AdapterNotFoundError as exc:
            raise adapter_error(exc, "model", self.config.retry_after_s) from None
        if location is None:
            raise ApiError(
                404,
                f"model: {name!r} is not served here: not loaded, not under the adapter root "
                "and in no adapter store",
                param="model",
                code="model_not_found",
            )
        return web.json_response(model_body(self.engine, name, self.engine.model_name, location))

    # ------------------------------------------------------------------------ request body
    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        return await read_json_object(
            request,
            self._json,
            max_body_bytes=self.config.max_body_bytes,
            body_timeout_s=self.config.listener.body_timeout_s,
            retry_after_s=self.config.retry_after_s,
        )

    async def decode_json(self, raw: bytes) -> dict[str, Any]:
        """``raw`` as a JSON object, parsed off the loop when large; errors are ``ApiError``."""
        return await decode_json_object(raw, self._json, retry_after_s=self.config.retry_after_s)

    # --------------------------------------------------------------------------- lifecycle
    async def _start_poller(self, _app: web.Application) -> None:
        self._poller = asyncio.create_task(self._poll_stats(), name="worker-stats-poller")

    async def _stop_poller(self, _app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def _close_executors(self, _app: web.Application) -> None:
        self._json.close()
        self.inputs.close()

    async def _poll_stats(self) -> None:
        # Feeds the tokens/s window and drains load latencies even when nobody scrapes.
        while True:
            try:
                self.metrics.poll()
            except Exception:
                log.exception("engine stats poll failed")
            await asyncio.sleep(self.config.stats_poll_interval_s)

    async def drain(self, timeout: float | None = None) -> bool:
        """Fail /health, serve on for ``drain_grace_s`` (load balancers stop sending), then
        refuse new generation requests and wait for in-flight ones to finish.

        Returns True when everything finished within ``timeout`` seconds (the grace included).
        """
        limit = self.config.drain_timeout_s if timeout is None else timeout
        self.unready = True
        grace = min(self.config.drain_grace_s, limit)
        started = time.monotonic()
        if grace > 0:
            await asyncio.sleep(grace)
        self.draining = True
        try:
            await asyncio.wait_for(
                self._idle.wait(), max(0.0, limit - (time.monotonic() - started))
            )
        except TimeoutError:
            return False
        return True

    @property
    def inflight(self) -> int:
        return self._inflight
