"""The worker's OpenAI-compatible HTTP service (aiohttp) around an ``EngineProtocol`` engine.

Routes follow vLLM's, so existing clients, gateways and dashboards work unchanged:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` gives SSE);
- ``GET /v1/models``; ``POST /v1/load_lora_adapter``; ``POST /v1/unload_lora_adapter``;
- ``GET /health`` and ``GET /metrics``.

Every generation request passes through a ``FairQueue`` keyed by tenant before it reaches the
engine, so the engine never holds more than ``max_running`` of this service's requests and
memory stays bounded. Errors use OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` with ``param`` naming the offending field.

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
import hashlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from adaptermesh.assignment_rules import VERSION_SEPARATOR, RuleError, check_version, served_name
from adaptermesh.httpserve import (
    BodyTimeoutError,
    JsonBodyError,
    JsonBodyParser,
    ListenerLimits,
    read_body,
    serve_app,
)
from adaptermesh.tracing import Tracing
from adaptermesh.worker.api import (
    MAX_NAME_CHARS,
    ChatChoice,
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    Usage,
    request_error,
)
from adaptermesh.worker.fair_queue import FairQueue, QueueFullError, Ticket
from adaptermesh.worker.faults import FaultTable
from adaptermesh.worker.metrics import ServiceMetrics
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    AdapterResolution,
    EngineError,
    EngineOverloadedError,
    EngineProtocol,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TokenStream,
)

# The adapter header the mesh's Envoy sets (mesh/snapshot.py BuildOptions.adapter_header); the
# worker sits beside the mesh, not above it, so the name is repeated here.
ADAPTER_HEADER = "x-adapter-id"

__all__ = ["ADAPTER_HEADER", "ApiError", "ChoiceEvent", "ServiceConfig", "WorkerService", "serve", "tenant_of"]

log = logging.getLogger(__name__)

_JSON = "application/json"
# The shard whose Envoy sent the request (agent/extproc.py's header), for span attributes.
SHARD_HEADER = "x-adaptermesh-shard"
# The adapter version the mesh chose (a rollout's split, a routing rule): agent/extproc.py sets it.
VERSION_HEADER = "x-adapter-version"
_TENANT_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+-]{1,64}$")
# Engine field names that differ from the API's.
_ENGINE_FIELD_TO_PARAM = {"name": "lora_name", "path": "lora_path", "adapter": "model",
                          "prompt_token_ids": "prompt"}
# Prompts up to this many characters are tokenised on the event loop (under 1 ms with the
# Rust tokenizer); longer ones on a thread, so a 4 MB prompt does not stall other requests.
_TOKENIZE_INLINE_CHARS = 16 << 10
_T = TypeVar("_T")


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
    stats_poll_interval_s: float = 1.0
    # Header/body deadlines, header caps and the connection cap of the listener.
    listener: ListenerLimits = field(default_factory=ListenerLimits)


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # the wire field is named "type"
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


class _QueuedPastDeadline(ApiError):
    """The request's deadline passed while it waited in the tenant queue."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__(504, "the request's deadline passed while it waited in the queue",
                         type="timeout_error", code="deadline_exceeded", headers=headers)


def _invalid(param: str, message: str, status: int = 422, code: str = "invalid_value") -> ApiError:
    return ApiError(status, f"{param}: {message}", param=param, code=code)


def _adapter_error(exc: AdapterNotFoundError, param: str) -> ApiError:
    """404 for an adapter that does not exist; 422 for one that exists but is unusable.

    The engine marks the second kind with a ``field`` attribute (a bad name, a path outside
    the adapter root, a rank or target-module mismatch, a corrupt weights file).
    """
    field_name = getattr(exc, "field", None)
    if field_name is None:
        code = "model_not_found" if param == "model" else "adapter_not_found"
        return ApiError(404, f"{param}: {exc}", param=param, code=code)
    if field_name == "name" and param != "model":
        param = "lora_name"
    return ApiError(422, f"{param}: {exc}", param=param, code="invalid_adapter")


def tenant_of(request: web.BaseRequest) -> str:
    """The tenant a request belongs to: its API key, else ``x-tenant-id``, else its address.

    API keys are hashed so that metrics labels and logs never carry a secret.
    """
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]
    header = request.headers.get("x-tenant-id", "").strip()
    if header:
        if _TENANT_ID_RE.match(header):
            return "id-" + header
        # An odd header value still names a tenant, but never lands raw in a metrics label.
        return "id-sha-" + hashlib.sha256(header.encode()).hexdigest()[:16]
    return "ip-" + (request.remote or "unknown")


# ------------------------------------------------------------------------------ validation
_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], body: dict[str, Any]) -> _M:
    """``body`` as ``model``; the first invalid field is a 422 naming it."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        param, code, message = request_error(exc)
        raise ApiError(422, message, param=param, code=code) from None


@dataclass(slots=True)
class _Job:
    """One validated generation request on its way through queue and engine."""

    kind: Literal["completion", "chat"]
    model: str
    adapter: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    tenant: str
    arrived: float
    deadline: float
    request_id: str
    # Choices: n engine sequences of one prompt, answered together.
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    # The SSE chunk's bytes up to its choices list: the same for every chunk of the request,
    # so it is encoded once instead of once per token.
    chunk_head: bytes = b""
    # The W3C trace context the request carried and its span attributes (tracing on only).
    trace_context: Any = None
    trace_attrs: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One engine event of choice ``index`` of a request run by ``WorkerService.job_events``.

    ``usage`` (the whole request's, as in the HTTP answer) is set on the event that finishes
    the request's last choice, and only there.
    """

    index: int
    event: TokenEvent
    usage: dict[str, int] | None = None


@dataclass(slots=True)
class _Progress:
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    # How the request ended, for metrics, once known.
    outcome: str | None = None
    # How the engine found the adapter (its first event carries it; tracing's span).
    resolution: AdapterResolution | None = None


class WorkerService:
    """The aiohttp application plus the fair queue and metrics it serves with."""

    def __init__(self, engine: EngineProtocol, config: ServiceConfig | None = None,
                 tracing: Tracing | None = None) -> None:
        self.engine = engine
        self.config = config or ServiceConfig()
        # OpenTelemetry spans per request (docs/tracing.md); off unless the worker is given
        # an OTLP endpoint.
        self.tracing = tracing or Tracing.off()
        c = self.config
        self.queue = FairQueue(
            max_running=c.max_running,
            max_waiting_per_tenant=c.max_waiting_per_tenant,
            max_waiting_total=c.max_waiting_total,
        )
        self.metrics = ServiceMetrics(engine, self.queue)
        self.faults = FaultTable()
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._poller: asyncio.Task[None] | None = None
        self.app = web.Application(
            client_max_size=c.max_body_bytes, middlewares=[self._error_middleware]
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.get("/v1/models", self._models),
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
        self._json = JsonBodyParser()
        # Tokenising long prompts and chat templates; two threads keep one 4 MB prompt from
        # holding up the next long one.
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="worker-tokenize")

    # ------------------------------------------------------------------------------ lifecycle
    async def _start_poller(self, _app: web.Application) -> None:
        self._poller = asyncio.create_task(self._poll_stats(), name="worker-stats-poller")

    async def _stop_poller(self, _app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    def _refuse_untokenised(self, chars: int, max_len: int, param: str) -> None:
        """413 for a text too long for the context whatever its tokens: no token covers more
        than ``engine.max_token_chars`` characters, so nothing is tokenised (a multi-megabyte
        prompt costs no tokenizer time and never stalls the loop)."""
        per = getattr(self.engine, "max_token_chars", 0)
        if isinstance(per, int) and per > 0 and chars > max_len * per:
            raise ApiError(413, f"{param}: {chars} characters cannot fit the {max_len}-token "
                           f"context (no token of this model covers more than {per} characters)",
                           param=param, code="context_length_exceeded")

    async def _close_executors(self, _app: web.Application) -> None:
        self._json.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` inline when ``size`` is small, else on the tokenizer threads."""
        if size <= _TOKENIZE_INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def _poll_stats(self) -> None:
        # Feeds the tokens/s window and drains load latencies even when nobody scrapes.
        while True:
            try:
                self.metrics.poll()
            except Exception:
                log.exception("engine stats poll failed")
            await asyncio.sleep(self.config.stats_poll_interval_s)

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new generation requests and wait for in-flight ones to finish.

        Returns True when everything finished within ``timeout`` seconds.
        """
        self.draining = True
        limit = self.config.drain_timeout_s if timeout is None else timeout
        try:
            await asyncio.wait_for(self._idle.wait(), limit)
        except TimeoutError:
            return False
        return True

    @property
    def inflight(self) -> int:
        return self._inflight

    # ----------------------------------------------------------------------------- middleware
    @web.middleware
    async def _error_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error_type = "invalid_request_error" if exc.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
                exc.status
            )
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            return ApiError(exc.status, exc.reason if exc.status != 413 else exc.text or
                            exc.reason, type=error_type, code=code, headers=headers).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return ApiError(500, "internal server error", type="server_error",
                            code="internal_error").response()

    # ------------------------------------------------------------------------------ endpoints
    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await read_body(request, self.config.listener.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body is larger than {self.config.max_body_bytes} bytes",
                           code="payload_too_large") from None
        except BodyTimeoutError as exc:
            raise ApiError(408, str(exc), code="body_timeout") from None
        except HttpProcessingError as exc:  # a broken chunked encoding or Content-Length
            raise ApiError(400, f"request body is malformed: {exc.message}",
                           code="invalid_body") from None
        if not raw:
            raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
        return await self.decode_json(raw)

    async def decode_json(self, raw: bytes) -> dict[str, Any]:
        """``raw`` as a JSON object, parsed off the loop when large; errors are ``ApiError``."""
        try:
            body = await self._json.parse(raw)
        except JsonBodyError as exc:
            raise ApiError(exc.status, exc.message, code=exc.code) from None
        except BrokenProcessPool:
            raise ApiError(503, "the JSON parser restarted; retry", type="service_unavailable",
                           code="parser_restarted", headers=self._retry_headers()) from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        return body

    def _check_admin(self, request: web.Request) -> None:
        expected = self.config.admin_token
        if expected is None:
            return
        given = request.headers.get("x-admin-token")
        if given is None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
        if not given:
            raise ApiError(401, "this endpoint needs the admin token (Authorization: Bearer or "
                           "x-admin-token)", type="authentication_error", code="missing_token",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise ApiError(403, "the admin token is wrong", type="permission_error",
                           code="invalid_token")

    async def _health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503,
                                     headers={"Retry-After": str(self.config.retry_after_s)})
        return web.json_response({"status": "ok"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        payload = generate_latest(self.metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _request: web.Request) -> web.Response:
        created = int(time.time())
        base = self.engine.model_name
        data: list[dict[str, Any]] = [
            {"id": base, "object": "model", "created": created, "owned_by": "adaptermesh",
             "root": base, "parent": None, "max_model_len": self.engine.max_model_len}
        ]
        for info in sorted(self.engine.list_adapters(), key=lambda a: a.name):
            data.append({"id": info.name, "object": "model", "created": created,
                         "owned_by": "adaptermesh", "root": info.path, "parent": base,
                         "max_model_len": self.engine.max_model_len, "rank": info.rank,
                         "resident_on_gpu": info.resident_on_gpu, "pinned": info.pinned})
        return web.json_response({"object": "list", "data": data})

    async def _load_adapter(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        load = _parse(LoadLoraAdapterRequest, await self._read_json(request))
        name, path = load.lora_name, load.lora_path
        if name == self.engine.model_name:
            raise _invalid("lora_name", "must differ from the base model's name")
        await self.load_adapter(name, path, pinned=load.pinned)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def load_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load (or reload) adapter ``name`` from ``path``, for every transport; engine errors
        become ``ApiError`` naming ``lora_name`` or ``lora_path``. ``pinned`` keeps it in its GPU
        slot (never evicted) until it is loaded again unpinned or unloaded."""
        try:
            await self.engine.load_adapter(name, path, pinned=pinned)
        except AdapterNotFoundError as exc:
            raise _adapter_error(exc, "lora_path") from None
        except InvalidRequestError as exc:
            param = _ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
            raise ApiError(422, str(exc), param=param, code="invalid_adapter") from None
        except (OSError, ValueError, RuntimeError) as exc:
            # What the filesystem says about the path (a name too long, a permission, a
            # symlink loop, which pathlib reports as RuntimeError on Python 3.11) is about the
            # client's lora_path, not a server fault. Other RuntimeErrors (CUDA) are.
            if isinstance(exc, RuntimeError) and "Symlink loop" not in str(exc):
                raise
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise _invalid("lora_path", f"cannot be read: {reason}",
                           code="invalid_adapter") from None

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        name = _parse(UnloadLoraAdapterRequest, await self._read_json(request)).lora_name
        await self.unload_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``, for every transport; errors as ``ApiError``."""
        try:
            await self.engine.unload_adapter(name)
        except AdapterNotFoundError as exc:
            raise _adapter_error(exc, "lora_name") from None
        except InvalidRequestError as exc:
            param = _ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
            raise ApiError(422, str(exc), param=param) from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        job = await self._job(request, body, "completion")
        self._inject_fault(job)
        return await self._run(request, job)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        job = await self._job(request, body, "chat")
        self._inject_fault(job)
        return await self._run(request, job)

    def _inject_fault(self, job: _Job) -> None:
        """An operator's injected fault (worker/faults.py): a 500, counted as the adapter's."""
        if self.faults.should_fail(job.adapter):
            self.metrics.observe_finished(outcome="injected_fault", arrived=job.arrived,
                                          first_token=None, last_token=None,
                                          completion_tokens=0, adapter=job.adapter)
            raise ApiError(500, f"injected fault for adapter {job.adapter!r}",
                           type="server_error", code="injected_fault")

    async def _get_faults(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        return web.json_response({"faults": self.faults.rates()})

    async def _set_faults(self, request: web.Request) -> web.Response:
        """``{"adapter": name, "error_rate": 0-1}`` (admin token); rate 0 clears."""
        self._check_admin(request)
        body = await self._read_json(request)
        adapter = body.get("adapter")
        if not isinstance(adapter, str) or not adapter:
            raise _invalid("adapter", "must be a non-empty string")
        if len(adapter) > MAX_NAME_CHARS or not adapter.isprintable():
            raise _invalid("adapter", f"must be 1-{MAX_NAME_CHARS} printable characters")
        rate = body.get("error_rate")
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise _invalid("error_rate", "must be a number in 0-1")
        try:
            self.faults.set(adapter, float(rate))
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise _invalid(field, message) from None
        return web.json_response({"faults": self.faults.rates()})

    # ----------------------------------------------------------------------- request building
    async def _job(self, request: web.Request, body: dict[str, Any],
                   kind: Literal["completion", "chat"]) -> _Job:
        if self.draining:
            raise ApiError(503, "the worker is draining; send the request to another worker",
                           type="service_unavailable", code="draining",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        arrived = time.monotonic()
        parsed: CompletionRequest | ChatCompletionRequest = (
            _parse(CompletionRequest, body) if kind == "completion"
            else _parse(ChatCompletionRequest, body))
        # A body without a model, sent to an AdapterInstance's path: the edge names the
        # adapter in the header (mesh/edge.py). The body's own model always wins.
        model = (parsed.model or request.headers.get(ADAPTER_HEADER, "").strip()
                 or self.engine.model_name)
        version = request.headers.get(VERSION_HEADER)
        if version and model != self.engine.model_name and VERSION_SEPARATOR not in model:
            # A version chosen by the mesh (a rollout's split or a routing rule): the adapter
            # is served under its versioned name (docs/rollout.md).
            try:
                check_version(version, VERSION_HEADER, allow_empty=False)
            except RuleError as exc:
                raise _invalid(VERSION_HEADER, exc.message, code="invalid_header") from None
            model = served_name(model, version)
        adapter = None if model == self.engine.model_name else model
        max_len = self.engine.max_model_len

        if isinstance(parsed, CompletionRequest):
            prompt = parsed.prompt
            if isinstance(prompt, str):
                self._refuse_untokenised(len(prompt), max_len, "prompt")
                prompt_ids = list(await self._off_loop(len(prompt), self.engine.tokenize,
                                                       prompt))
            else:
                prompt_ids = list(prompt)
            max_tokens_name, max_tokens = "max_tokens", parsed.max_tokens
        else:
            messages = [{"role": m.role, "content": m.content} for m in parsed.messages]
            chars = sum(len(m["content"]) for m in messages)
            self._refuse_untokenised(chars, max_len, "messages")
            ids = await self._off_loop(chars, self.engine.apply_chat_template, messages)
            if ids is None:
                raise ApiError(400, "messages: this model's tokenizer has no chat template; "
                               "use /v1/completions", param="messages",
                               code="chat_template_missing")
            prompt_ids = list(ids)
            max_tokens_name, max_tokens = parsed.max_tokens_field

        if len(prompt_ids) >= max_len:
            raise ApiError(413, f"prompt: has {len(prompt_ids)} tokens; this model's context "
                           f"is {max_len} tokens, so a prompt may have at most {max_len - 1}",
                           param="prompt" if kind == "completion" else "messages",
                           code="context_length_exceeded")
        room = max_len - len(prompt_ids)
        if max_tokens is None:
            max_tokens = (min(self.config.default_max_tokens, room) if kind == "completion"
                          else room)
        if max_tokens < 1:
            raise _invalid(max_tokens_name, f"must be at least 1, got {max_tokens}")
        if max_tokens > room:
            raise _invalid(max_tokens_name, f"is {max_tokens}, but the prompt has "
                           f"{len(prompt_ids)} tokens and the context is {max_len} tokens, so "
                           f"at most {room} tokens can be generated",
                           code="context_length_exceeded")

        timeout = self.config.request_timeout_s
        header = request.headers.get("x-request-timeout")
        if header is not None:
            try:
                timeout = float(header)
            except ValueError:
                timeout = math.nan
            if not math.isfinite(timeout) or timeout <= 0:
                raise _invalid("x-request-timeout", "must be a positive number of seconds",
                               code="invalid_header")
            timeout = min(timeout, self.config.max_request_timeout_s)

        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        return _Job(
            kind=kind,
            model=model,
            adapter=adapter,
            prompt_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=parsed.temperature,
                                    top_p=parsed.top_p, seed=parsed.seed, stop=parsed.stop,
                                    top_k=max(parsed.top_k, 0), min_p=parsed.min_p,
                                    presence_penalty=parsed.presence_penalty,
                                    frequency_penalty=parsed.frequency_penalty,
                                    repetition_penalty=parsed.repetition_penalty,
                                    logprobs=parsed.logprobs_k),
            n=parsed.n,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            tenant=tenant_of(request),
            arrived=arrived,
            deadline=arrived + timeout,
            request_id=prefix + uuid.uuid4().hex,
            **(self._trace_fields(request, model) if self.tracing.enabled else {}),
        )

    def _trace_fields(self, request: web.Request, model: str) -> dict[str, Any]:
        headers = request.headers
        attrs = {"adaptermesh.model": model, "adaptermesh.tenant": tenant_of(request),
                 "adaptermesh.adapter": model.split(VERSION_SEPARATOR, 1)[0],
                 "adaptermesh.adapter_version": model.partition(VERSION_SEPARATOR)[2]}
        if shard := headers.get(SHARD_HEADER):
            attrs["adaptermesh.shard"] = shard
        return {"trace_context": Tracing.extract(headers), "trace_attrs": attrs}

    # ------------------------------------------------------------------------------ execution
    def _retry_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.config.retry_after_s)}

    def _engine_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, AdapterNotFoundError):
            return _adapter_error(exc, "model")
        if isinstance(exc, InvalidRequestError):
            param = _ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
            return ApiError(422, str(exc), param=param, code="invalid_value")
        if isinstance(exc, EngineOverloadedError):
            self.metrics.rejected.labels(reason="engine_overloaded").inc()
            return ApiError(429, f"the engine is overloaded: {exc}", type="rate_limit_error",
                            code="engine_overloaded", headers=self._retry_headers())
        return ApiError(500, f"engine error: {exc}", type="server_error", code="engine_error")

    async def _run(self, request: web.Request, job: _Job) -> web.StreamResponse:
        ticket = self._enqueue(job)
        progress = _Progress()
        progresses = [progress] + [_Progress() for _ in range(job.n - 1)]
        outcome = "error"
        streams: list[TokenStream] = []
        try:
            await self._admit(job, ticket, streams)
            iters = [stream.__aiter__() for stream in streams]
            # The first events come before any header, so errors still get a real status code.
            firsts = [await self._next_event(it, job, p) for it, p in zip(iters, progresses,
                                                                          strict=True)]
            if job.stream and job.n == 1:
                return await self._stream_response(request, job, firsts[0], iters[0], progress)
            if job.stream:
                return await self._stream_choices(request, job, firsts, iters, progresses)
            results = await asyncio.gather(
                *(self._collect(job, first, it, p)
                  for first, it, p in zip(firsts, iters, progresses, strict=True)),
                return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            outputs = [r for r in results if isinstance(r, tuple)]
            progress.outcome = outcome = _outcome(progresses)
            return web.json_response(self._final_body(job, outputs, progresses))
        except _QueuedPastDeadline:
            outcome = "deadline_queued"
            raise
        except ApiError as exc:
            if outcome == "error":
                outcome = exc.code or "error"
            raise
        except asyncio.CancelledError:
            outcome = "disconnected"
            raise
        finally:
            self._settle(job, ticket, streams, progresses, progress.outcome or outcome)

    async def build_job(self, request: web.Request, body: dict[str, Any],
                        kind: Literal["completion", "chat"]) -> _Job:
        """``body`` validated as a completion or chat request of ``request``'s tenant, with the
        same limits and errors as the HTTP routes (``ApiError``)."""
        return await self._job(request, body, kind)

    async def job_events(self, job: _Job) -> AsyncGenerator[ChoiceEvent, None]:
        """Run ``job`` and yield its choices' events as they come, for transports other than
        HTTP responses (the WebSocket route).

        Same tenant queue, deadlines, metrics and errors (``ApiError``, raised from the
        iterator) as ``_run``. The event that finishes the last choice carries the request's
        usage. Closing the iterator early, or cancelling its consumer, cancels the engine
        sequences and counts the request as ``disconnected``, as an HTTP client that goes
        away does.
        """
        ticket = self._enqueue(job)
        progresses = [_Progress() for _ in range(job.n)]
        outcome: str | None = None
        streams: list[TokenStream] = []
        pumps: list[asyncio.Task[None]] = []
        try:
            await self._admit(job, ticket, streams)
            iters = [stream.__aiter__() for stream in streams]
            merged: asyncio.Queue[tuple[int, TokenEvent | ApiError]] = asyncio.Queue()

            async def pump(index: int) -> None:
                while True:
                    try:
                        event = await self._next_event(iters[index], job, progresses[index])
                    except ApiError as exc:
                        merged.put_nowait((index, exc))
                        return
                    merged.put_nowait((index, event))
                    if event.finish_reason is not None:
                        return

            if job.n > 1:
                pumps = [asyncio.create_task(pump(i)) for i in range(job.n)]
            finished = 0
            item: TokenEvent | ApiError
            while finished < job.n:
                if job.n == 1:
                    index, item = 0, await self._next_event(iters[0], job, progresses[0])
                else:
                    index, item = await merged.get()
                if isinstance(item, ApiError):
                    raise item
                reason = item.finish_reason
                if reason in ("cancelled", "error"):
                    assert reason is not None
                    raise self._finish_error(job, reason)
                usage = None
                if reason is not None:
                    finished += 1
                    if finished == job.n:
                        outcome = _outcome(progresses)
                        usage = self._usage(progresses)
                yield ChoiceEvent(index, item, usage)
        except _QueuedPastDeadline:
            if outcome is None:
                outcome = "deadline_queued"
            raise
        except ApiError as exc:
            if outcome is None:
                outcome = exc.code or "error"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if outcome is None:
                outcome = "disconnected"
            raise
        finally:
            for task in pumps:
                task.cancel()
            if pumps:
                await asyncio.gather(*pumps, return_exceptions=True)
            self._settle(job, ticket, streams, progresses, outcome or "error")

    # -- the steps every transport shares (HTTP responses and job_events) --------------------
    def _enqueue(self, job: _Job) -> Ticket:
        """Put the request in its tenant's queue (429 when full) and count it in flight."""
        try:
            ticket = self.queue.submit(job.tenant, cost=len(job.prompt_ids) +
                                       job.n * job.sampling.max_tokens)
        except QueueFullError as exc:
            self.metrics.rejected.labels(reason=f"{exc.scope}_queue_full").inc()
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                           headers=self._retry_headers()) from None
        self._inflight += 1
        self._idle.clear()
        return ticket

    async def _admit(self, job: _Job, ticket: Ticket, streams: list[TokenStream]) -> None:
        """Wait for the queue to admit the request (504 past its deadline), then submit its n
        choices to the engine, appending each stream as it is made (so a failure part-way
        still leaves every submitted stream to cancel)."""
        try:
            async with asyncio.timeout_at(job.deadline):
                await self.queue.wait(ticket)
        except TimeoutError:
            raise _QueuedPastDeadline(self._retry_headers()) from None
        assert ticket.admitted_at is not None
        self.metrics.queue_wait.observe(ticket.admitted_at - ticket.enqueued_at)
        self.metrics.observe_prompt(len(job.prompt_ids))
        try:
            for index in range(job.n):
                streams.append(self.engine.submit(self._generation(job, index)))
        except EngineError as exc:
            raise self._engine_error(exc) from None

    def _settle(self, job: _Job, ticket: Ticket, streams: list[TokenStream],
                progresses: list[_Progress], outcome: str) -> None:
        """Cancel unfinished choices, release the queue slot, record the request once, and
        mark the server idle when it was the last in flight."""
        for stream, p in zip(streams, progresses, strict=False):
            if p.finish_reason is None:
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
            self._record_spans(job, ticket, min(firsts_seen) if firsts_seen else None,
                               max(lasts_seen) if lasts_seen else None, outcome, resolution)
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def _record_spans(self, job: _Job, ticket: Ticket, first: float | None,
                      last: float | None, outcome: str,
                      resolution: AdapterResolution | None = None) -> None:
        """The request's spans, from the times already taken (monotonic, turned into the
        epoch nanoseconds OTLP wants): the request, its queueing, adapter resolution (the
        engine's first lookup to its lease: the tier that served it and the load it waited
        for), prefill (admission to the first token) and decode (first to last token)."""
        now = time.monotonic()
        shift = time.time_ns() - int(now * 1e9)

        def ns(t: float) -> int:
            return int(t * 1e9) + shift

        tracer = self.tracing.tracer
        attrs = dict(job.trace_attrs or {})
        attrs["adaptermesh.outcome"] = outcome
        root = tracer.start_span("worker " + job.kind, context=job.trace_context,
                                 kind=SpanKind.SERVER, start_time=ns(job.arrived),
                                 attributes=attrs)
        ctx = set_span_in_context(root)
        admitted = ticket.admitted_at
        if admitted is not None:
            tracer.start_span("queue", context=ctx, start_time=ns(ticket.enqueued_at),
                              attributes={"adaptermesh.tenant": job.tenant}).end(ns(admitted))
            if first is not None:
                tracer.start_span("prefill", context=ctx, start_time=ns(admitted), attributes={
                    "adaptermesh.prompt_tokens": len(job.prompt_ids),
                    "adaptermesh.adapter": job.adapter or ""}).end(ns(first))
                if last is not None and last > first:
                    tracer.start_span("decode", context=ctx, start_time=ns(first)).end(ns(last))
        if resolution is not None:
            tracer.start_span("adapter resolution", context=ctx,
                              start_time=ns(resolution.started), attributes={
                                  "adaptermesh.adapter": job.adapter or "",
                                  "adaptermesh.adapter.tier": resolution.tier,
                                  "adaptermesh.adapter.cache_hit": resolution.tier == "gpu",
                                  "adaptermesh.adapter.load_ms": resolution.load_s * 1e3,
                                  "adaptermesh.adapter.slot_version": resolution.version,
                              }).end(ns(max(resolution.resolved, resolution.started)))
        if outcome not in ("stop", "length"):
            root.set_status(Status(StatusCode.ERROR, outcome))
        root.end(ns(now))

    @staticmethod
    def _generation(job: _Job, index: int) -> GenerationRequest:
        """The engine request of choice ``index``; choice i > 0 of a seeded request gets
        seed + i, so the choices differ and the whole answer is still reproducible."""
        sampling = job.sampling
        if index and sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + index)
        return GenerationRequest(
            request_id=job.request_id if job.n == 1 else f"{job.request_id}-{index}",
            prompt_token_ids=tuple(job.prompt_ids),
            adapter=job.adapter,
            sampling=sampling,
            deadline=job.deadline,
        )

    async def _next_event(self, events: AsyncIterator[TokenEvent], job: _Job,
                          progress: _Progress) -> TokenEvent:
        try:
            async with asyncio.timeout_at(job.deadline):
                event = await anext(events)
        except TimeoutError:
            raise ApiError(504, "the request's deadline passed during generation",
                           type="timeout_error", code="deadline_exceeded") from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the request without a finish reason",
                           type="server_error", code="engine_error") from None
        except EngineError as exc:
            raise self._engine_error(exc) from None
        now = time.monotonic()
        if event.resolution is not None:
            progress.resolution = event.resolution
        if event.token_id is not None or event.text:
            if progress.first_token is None:
                progress.first_token = now
            progress.last_token = now
        progress.prompt_tokens = event.prompt_tokens or len(job.prompt_ids)
        progress.completion_tokens = event.completion_tokens
        if event.finish_reason is not None:
            progress.finish_reason = event.finish_reason
            if progress.first_token is None and event.completion_tokens > 0:
                progress.first_token = now
            if progress.last_token is None and progress.first_token is not None:
                progress.last_token = now
        return event

    def _finish_error(self, job: _Job, reason: str) -> ApiError:
        if reason == "cancelled" and time.monotonic() >= job.deadline - 0.05:
            return ApiError(504, "the request's deadline passed during generation",
                            type="timeout_error", code="deadline_exceeded")
        if reason == "cancelled":
            return ApiError(503, "the engine cancelled the request (it is shutting down)",
                            type="service_unavailable", code="cancelled",
                            headers=self._retry_headers())
        return ApiError(500, "the engine failed while generating", type="server_error",
                        code="engine_error")

    async def _collect(self, job: _Job, first: TokenEvent, events: AsyncIterator[TokenEvent],
                       progress: _Progress) -> tuple[str, list[TokenLogprob]]:
        parts = [first.text]
        lps = list(first.logprobs)
        event = first
        while event.finish_reason is None:
            event = await self._next_event(events, job, progress)
            parts.append(event.text)
            lps.extend(event.logprobs)
        reason = event.finish_reason
        if reason in ("cancelled", "error"):
            raise self._finish_error(job, reason)
        return "".join(parts), lps

    def _final_body(self, job: _Job, outputs: list[tuple[str, list[TokenLogprob]]],
                    progresses: list[_Progress]) -> dict[str, Any]:
        usage = self._usage(progresses)
        choices: list[dict[str, Any]] = []
        asked = job.sampling.logprobs is not None
        for index, ((text, lps), p) in enumerate(zip(outputs, progresses, strict=True)):
            if job.kind == "completion":
                choices.append(CompletionChoice(
                    index=index, text=text, finish_reason=p.finish_reason,
                    logprobs=CompletionLogprobs(**_completion_logprobs(lps)) if asked else None,
                ).model_dump())
            else:
                choices.append(ChatChoice(
                    index=index, message={"role": "assistant", "content": text},
                    finish_reason=p.finish_reason,
                    logprobs=ChatLogprobs(**_chat_logprobs(lps)) if asked else None,
                ).model_dump())
        obj = "text_completion" if job.kind == "completion" else "chat.completion"
        return {"id": job.request_id, "object": obj, "created": job.created,
                "model": job.model, "choices": choices, "usage": usage}

    @staticmethod
    def _usage(progresses: _Progress | list[_Progress]) -> dict[str, int]:
        """Usage of the whole request: the prompt once, the tokens of every choice."""
        ps = progresses if isinstance(progresses, list) else [progresses]
        prompt = ps[0].prompt_tokens
        completion = sum(p.completion_tokens for p in ps)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion).model_dump()

    def _chunk(self, job: _Job, text: str | None, finish_reason: str | None,
               role: bool = False, index: int = 0, lps: tuple[TokenLogprob, ...] = ()) -> bytes:
        """One SSE chunk; ``lps``: the logprobs of the tokens whose text it carries."""
        if job.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text or "",
                                      "logprobs": _completion_logprobs(lps) if lps else None,
                                      "finish_reason": finish_reason}
            obj = "text_completion"
        else:
            delta: dict[str, str] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta,
                      "logprobs": _chat_logprobs(lps) if lps else None,
                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        if not job.chunk_head:
            head = _sse({"id": job.request_id, "object": obj, "created": job.created,
                         "model": job.model, "choices": []})
            job.chunk_head = head[: -len(b"]}\n\n")]
        return job.chunk_head + _dumps(choice) + b"]}\n\n"

    async def _stream_response(self, request: web.Request, job: _Job, first: TokenEvent,
                               events: AsyncIterator[TokenEvent],
                               progress: _Progress) -> web.StreamResponse:
        """Send the SSE stream; ``progress.outcome`` says how it ended."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     "x-request-id": job.request_id}
        )
        await response.prepare(request)
        progress.outcome = "disconnected"  # until a later line knows better
        event = first
        try:
            if job.kind == "chat":
                await response.write(self._chunk(job, "", None, role=True))
            while True:
                if event.finish_reason in ("cancelled", "error"):
                    assert event.finish_reason is not None
                    error = self._finish_error(job, event.finish_reason)
                    await response.write(_sse(error.body()))
                    await response.write(b"data: [DONE]\n\n")
                    progress.outcome = error.code or "error"
                    return response
                # One chunk per generated token, even when its text is "" (an incomplete
                # multi-byte character): clients time tokens by chunks, as with vLLM.
                if event.token_id is not None or event.text or event.finish_reason is not None:
                    await response.write(self._chunk(job, event.text, event.finish_reason,
                                                     lps=event.logprobs))
                if event.finish_reason is not None:
                    break
                try:
                    event = await self._next_event(events, job, progress)
                except ApiError as exc:
                    # Headers are gone: report in-band, as vLLM does, and end the stream.
                    await response.write(_sse(exc.body()))
                    await response.write(b"data: [DONE]\n\n")
                    progress.outcome = exc.code or "error"
                    return response
            if job.include_usage:
                await response.write(_sse({"id": job.request_id, "object": (
                    "text_completion" if job.kind == "completion" else "chat.completion.chunk"),
                    "created": job.created, "model": job.model, "choices": [],
                    "usage": self._usage(progress)}))
            await response.write(b"data: [DONE]\n\n")
            progress.outcome = progress.finish_reason or "error"
            await response.write_eof()
        except ConnectionResetError:
            progress.outcome = "disconnected"
        return response

    async def _stream_choices(self, request: web.Request, job: _Job, firsts: list[TokenEvent],
                              iters: list[AsyncIterator[TokenEvent]],
                              progresses: list[_Progress]) -> web.StreamResponse:
        """The SSE stream of n > 1 choices: each choice's chunks in the order its tokens come,
        interleaved, each naming its ``index``; ``progresses[0].outcome`` says how it ended."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     "x-request-id": job.request_id}
        )
        await response.prepare(request)
        head = progresses[0]
        head.outcome = "disconnected"
        events: asyncio.Queue[tuple[int, TokenEvent | ApiError]] = asyncio.Queue()

        async def pump(index: int, event: TokenEvent, it: AsyncIterator[TokenEvent],
                       progress: _Progress) -> None:
            while True:
                events.put_nowait((index, event))
                if event.finish_reason is not None:
                    return
                try:
                    event = await self._next_event(it, job, progress)
                except ApiError as exc:
                    events.put_nowait((index, exc))
                    return

        pumps = [asyncio.create_task(pump(i, first, it, p))
                 for i, (first, it, p) in enumerate(zip(firsts, iters, progresses, strict=True))]
        try:
            if job.kind == "chat":
                for index in range(job.n):
                    await response.write(self._chunk(job, "", None, role=True, index=index))
            finished = 0
            while finished < job.n:
                index, item = await events.get()
                if isinstance(item, ApiError) or item.finish_reason in ("cancelled", "error"):
                    error = item if isinstance(item, ApiError) else self._finish_error(
                        job, str(item.finish_reason))
                    await response.write(_sse(error.body()))
                    await response.write(b"data: [DONE]\n\n")
                    head.outcome = error.code or "error"
                    return response
                if item.token_id is not None or item.text or item.finish_reason is not None:
                    await response.write(self._chunk(job, item.text, item.finish_reason,
                                                     index=index, lps=item.logprobs))
                if item.finish_reason is not None:
                    finished += 1
            if job.include_usage:
                await response.write(_sse({"id": job.request_id, "object": (
                    "text_completion" if job.kind == "completion" else "chat.completion.chunk"),
                    "created": job.created, "model": job.model, "choices": [],
                    "usage": self._usage(progresses)}))
            await response.write(b"data: [DONE]\n\n")
            head.outcome = _outcome(progresses)
            await response.write_eof()
        except ConnectionResetError:
            head.outcome = "disconnected"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        return response


def _outcome(progresses: list[_Progress]) -> str:
    """A finished request's outcome: ``length`` when any choice hit its cap, else ``stop``."""
    reasons = {p.finish_reason for p in progresses}
    if None in reasons or not reasons <= {"stop", "length"}:
        return "error"
    return "length" if "length" in reasons else "stop"


# A logprob the model gives (almost) no chance is reported as this, not -inf, which JSON
# cannot carry.
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB


def _completion_logprobs(lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """The legacy completions shape; each ``top_logprobs`` dict holds the asked-for most
    likely alternatives and the sampled token, keyed by text (the first of equal texts)."""
    tops: list[dict[str, float]] = []
    for e in lps:
        top: dict[str, float] = {}
        for t in e.top:
            top.setdefault(t.token, _lp(t.logprob))
        top.setdefault(e.token, _lp(e.logprob))
        tops.append(top)
    return {"tokens": [e.token for e in lps], "token_logprobs": [_lp(e.logprob) for e in lps],
            "top_logprobs": tops, "text_offset": [e.text_offset for e in lps]}


def _chat_logprobs(lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.token_bytes),
         "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob),
                           "bytes": list(t.token_bytes)} for t in e.top]}
        for e in lps]}


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


async def serve(
    service: WorkerService, host: str, port: int, *, shutdown_timeout: float = 2.0
) -> tuple[web.AppRunner, int]:
    """Start serving ``service`` on ``host:port`` (0 picks a free port); returns the port.

    The listener has ``service.config.listener``'s limits. ``runner.cleanup()`` waits
    ``shutdown_timeout`` seconds for handlers still running, then cancels them;
    ``WorkerService.drain`` is the place for a long, orderly wait.
    """
    refused = service.metrics.listener_refused
    return await serve_app(service.app, host, port, service.config.listener,
                           handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           on_refusal=lambda reason: refused.labels(reason=reason).inc())
