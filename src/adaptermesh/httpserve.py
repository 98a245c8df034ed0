"""HTTP listeners that survive slow and hostile clients: one owner for every listener limit.

aiohttp has no slowloris protection of its own. ``serve_app`` starts an ``aiohttp`` application
on a listener whose connections go through ``_GuardedHandler`` (a ``RequestHandler``), which
adds, per listener:

- a header deadline: a request's line and headers must arrive within ``header_timeout_s`` of
  the connection opening (or of its first byte, on a kept-alive connection); otherwise the
  client gets 408 and the connection closes. Idle kept-alive connections close after
  ``keepalive_timeout_s``.
- header size caps: ``max_line_size`` per line, ``max_field_size`` per field, ``max_headers``
  fields and ``max_header_bytes`` in all; over any of them the client gets 431.
- a connection cap: at ``max_connections`` open connections a new one first evicts the oldest
  connection still waiting for its headers (a stalled client, or an idle kept-alive one);
  when there is none it is answered 503 and closed at once, so connections never pile up.
  The cap is also held below the process's file-descriptor limit, which ``raise_fd_limit``
  raises to the hard limit at start.

Body deadlines belong to the handlers that read bodies: ``read_body`` reads one within
``body_timeout_s``. ``JsonBodyParser`` parses JSON bodies with a depth cap (``MAX_JSON_DEPTH``)
and a value cap (``MAX_JSON_VALUES``) (fields that hold a document of their own, such as a JSON
schema, count their levels from the field, against their own cap: ``NestedDocument``), and
parses bodies over ``JSON_INLINE_BYTES`` in a child
process: ``json.loads`` holds the GIL, so a thread would not free the event loop (a 4 MB body
of 1.3 M small values takes 120-500 ms to parse here). Every error these guards send is JSON
in OpenAI's error shape. See
``docs/worker-service.md`` ("Limits") for the values and the measurements behind them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import multiprocessing
import resource
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler, _ErrInfo

__all__ = [
    "FD_RESERVE",
    "JSON_INLINE_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "BodyTimeoutError",
    "JsonBodyError",
    "JsonBodyParser",
    "ListenerLimits",
    "NestedDocument",
    "error_json",
    "parse_json_bounded",
    "raise_fd_limit",
    "read_body",
    "serve_app",
]

log = logging.getLogger(__name__)

# File descriptors kept free of client connections: model and adapter files, the engine's
# threads, outgoing gRPC and metrics connections, logs.
FD_RESERVE = 256
# Ceiling used when the hard limit is "unlimited" (setrlimit refuses RLIM_INFINITY for
# RLIMIT_NOFILE on Linux; 2^20 is the kernel's default nr_open).
_FD_CEILING = 1 << 20


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """Per-listener limits. The defaults are the production values."""

    # Open connections at once (further capped by the fd limit less FD_RESERVE). 1,000 stalled
    # clients leave room for real ones; evicting stalled ones keeps room above that.
    max_connections: int = 4096
    # Seconds for a request's line and headers to arrive.
    header_timeout_s: float = 10.0
    # Seconds for a request's whole body to arrive (a 4 MiB body at 1 Mbit/s takes 34 s).
    body_timeout_s: float = 60.0
    # Seconds an idle kept-alive connection stays open.
    keepalive_timeout_s: float = 15.0
    # Seconds the server keeps reading (and dropping) a body it answered without reading, so
    # the client sees the answer instead of a reset; aiohttp's default of 10 s would let a
    # slow body hold a connection that long after its 408.
    lingering_time_s: float = 2.0
    # aiohttp's defaults for one line and one field; at most 100 fields and 32 KiB in all
    # (browsers and SDKs send well under 8 KiB).
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 100
    max_header_bytes: int = 32 << 10
    backlog: int = 1024

    def handler_args(self) -> dict[str, Any]:
        """The ``RequestHandler`` keyword arguments these limits set."""
        return {
            "keepalive_timeout": self.keepalive_timeout_s,
            "lingering_time": self.lingering_time_s,
            "max_line_size": self.max_line_size,
            "max_field_size": self.max_field_size,
            "max_headers": self.max_headers,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BodyTimeoutError(Exception):
    """The request body did not arrive within the listener's body deadline."""


# OpenAI-style bodies nest 5 deep (messages[].content[].text); 32 leaves room for extensions.
MAX_JSON_DEPTH = 32
# Values (scalars and containers) in one body: a prompt of 2^18 token ids is past any context
# this worker serves, and unpickling that many values costs the event loop about 10 ms.
MAX_JSON_VALUES = 1 << 18
# Bodies up to this size are parsed on the event loop: at most ~8 ms for the worst case here
# (21 K empty lists); larger ones go to the child process.
JSON_INLINE_BYTES = 64 << 10


class JsonBodyError(ValueError):
    """A body that is not JSON, or is over the depth or value cap; ``status`` is 400 or 413;
    ``param``: the field whose nesting is over its own cap (see ``NestedDocument``)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(status, code, message, param)  # all in args, so it pickles
        self.status = status
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class NestedDocument:
    """Fields of a body that hold a document of their own (a JSON schema): at ``path`` (keys,
    with "*" for any list index), the value's levels count from 1 at the field against
    ``max_depth`` instead of adding to the body's."""

    path: tuple[str, ...]
    max_depth: int


def _field_name(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def parse_json_bounded(
    raw: bytes,
    max_depth: int = MAX_JSON_DEPTH,
    max_values: int = MAX_JSON_VALUES,
    nested: tuple[NestedDocument, ...] = (),
) -> Any:
    """``json.loads(raw)``, refusing nesting over ``max_depth`` and over ``max_values`` values;
    a ``nested`` document's levels count from its own field, against its own cap."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        # The C decoder stops at the interpreter's recursion limit (1000), long before memory.
        raise JsonBodyError(
            400, "json_too_deep", f"request body: JSON nests deeper than {max_depth} levels"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonBodyError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    values = 0
    # (value, depth, cap, path while it may still lead to a nested document, the document)
    stack: list[tuple[Any, int, int, tuple[str | int, ...] | None, str | None]] = [
        (obj, 1, max_depth, () if nested else None, None)
    ]
    while stack:
        value, depth, cap, path, document = stack.pop()
        values += 1
        if values > max_values:
            raise JsonBodyError(
                413, "too_many_values", f"request body: more than {max_values} JSON values"
            )
        if path is not None and path:
            for spec in nested:
                if len(spec.path) == len(path) and all(
                    want == "*" or want == got for want, got in zip(spec.path, path, strict=True)
                ):
                    depth, cap, document = 1, spec.max_depth, _field_name(path)
                    path = None
                    break
            else:
                if not any(
                    len(spec.path) > len(path)
                    and all(w == "*" or w == g for w, g in zip(spec.path, path, strict=False))
                    for spec in nested
                ):
                    path = None
        if isinstance(value, dict | list):
            if depth > cap:
                if document is not None:
                    raise JsonBodyError(
                        400,
                        "json_too_deep",
                        f"{document}: nests deeper than {cap} levels (counted from {document})",
                        document,
                    )
                raise JsonBodyError(
                    400, "json_too_deep", f"request body: JSON nests deeper than {max_depth} levels"
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    child = None if path is None else (*path, key)
                    stack.append((item, depth + 1, cap, child, document))
            else:
                for index, item in enumerate(value):
                    child = None if path is None else (*path, index)
                    stack.append((item, depth + 1, cap, child, document))
    return obj


class JsonBodyParser:
    """Parses small bodies inline and large ones in one spawned child process.

    ``spawn``, not ``fork``: the worker process holds CUDA state and threads.
    """

    def __init__(
        self, inline_bytes: int = JSON_INLINE_BYTES, nested: tuple[NestedDocument, ...] = ()
    ) -> None:
        self.inline_bytes = inline_bytes
        self.nested = nested
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, raw: bytes) -> Any:
        if len(raw) <= self.inline_bytes:
            return parse_json_bounded(raw, nested=self.nested)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        parse = functools.partial(parse_json_bounded, nested=self.nested)
        try:
            return await loop.run_in_executor(self._pool, parse, raw)
        except BrokenProcessPool:
            self._pool = None
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def error_json(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _raw_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return _FD_CEILING if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
        return soft
    return target


async def read_body(request: web.BaseRequest, timeout_s: float) -> bytes:
    """The request body, read within ``timeout_s`` seconds (``BodyTimeoutError`` otherwise).

    ``web.HTTPRequestEntityTooLarge`` passes through for a body over ``client_max_size``.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout_s:g} s") from None


class _HeadersTooLargeError(BadHttpMessage):
    """Headers over ``max_header_bytes`` in all (aiohttp caps only single lines and counts)."""


def _header_bytes(message: Any) -> int:
    raw = getattr(message, "raw_headers", None) or ()
    return sum(len(name) + len(value) + 4 for name, value in raw)


class _Gate:
    """The open connections of one listener, oldest first, and who hears of refusals."""

    def __init__(self, cap: int, on_refusal: Callable[[str], None] | None) -> None:
        self.cap = cap
        self.open: dict[_GuardedHandler, None] = {}
        self._on_refusal = on_refusal

    def refused(self, reason: str) -> None:
        if self._on_refusal is not None:
            self._on_refusal(reason)

    def admit(self, handler: _GuardedHandler) -> bool:
        if len(self.open) >= self.cap:
            victim = next((h for h in self.open if h.awaiting_headers()), None)
            if victim is None:
                self.refused("too_many_connections")
                return False
            self.refused("evicted")
            victim.reject(
                408,
                "the connection was closed to make room: its request headers had not arrived",
                "header_timeout",
                quiet_when_idle=True,
            )
        self.open[handler] = None
        return True


class _GuardedHandler(RequestHandler):
    """aiohttp's connection protocol plus the header deadline, header byte cap and gate.

    It reads three attributes of ``RequestHandler`` (``_waiter``, ``_messages``,
    ``_request_count``) to tell "waiting for a request's headers" from "handling one"; the
    tests in ``tests/worker_service/test_http_hardening.py`` hold them to the installed aiohttp.
    """

    def __init__(
        self, manager: web.Server, *, gate: _Gate, limits: ListenerLimits, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._limits = limits
        self._admitted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    # ------------------------------------------------------------------------------ state
    def awaiting_headers(self) -> bool:
        """True while no complete request is parsed or being handled on this connection."""
        if self._force_close or self._messages:
            return False
        if self._request_count == 0:
            return True
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def reject(
        self,
        status: int,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        *,
        quiet_when_idle: bool = False,
    ) -> None:
        """Answer ``status`` with a JSON error and close, whatever the parser holds.

        With ``quiet_when_idle``, a connection that has sent nothing of its next request is
        closed without an answer: a client could read an unasked-for 408 on an idle
        kept-alive connection as the answer to the request it sends next.
        """
        self._cancel_header_timer()
        self._gate.open.pop(self, None)
        transport = self.transport
        idle = self._header_bytes == 0
        if transport is not None and not transport.is_closing() and not (quiet_when_idle and idle):
            transport.write(_raw_response(status, error_json(status, message, code), headers))
        self.force_close()

    # --------------------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._gate.admit(self):
            assert isinstance(transport, asyncio.Transport)
            body = error_json(
                503, "this server is at its connection limit; retry shortly", "too_many_connections"
            )
            transport.write(_raw_response(503, body, {"Retry-After": "1"}))
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._gate.open.pop(self, None)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close:
            return
        before = self._request_count
        in_headers = self.awaiting_headers()
        if in_headers:
            self._header_bytes += len(data)
            if self._header_timer is None:
                self._arm_header_timer()
        super().data_received(data)
        limit = self._limits.max_header_bytes
        if self._request_count != before:
            self._header_bytes = 0
            self._cancel_header_timer()
            # Headers that arrived whole in one read are measured on the parsed messages. An
            # oversized one is swapped for an error entry, so aiohttp answers it (through
            # handle_error, 431) instead of running its handler, and drops what follows.
            first = len(self._messages) - (self._request_count - before)
            for i in range(max(first, 0), len(self._messages)):
                if _header_bytes(self._messages[i][0]) > limit:
                    exc = _HeadersTooLargeError(f"request headers are larger than {limit} bytes")
                    while len(self._messages) > i:
                        self._messages.pop()
                    self._messages.append(
                        (_ErrInfo(status=431, exc=exc, message=exc.message), EMPTY_PAYLOAD)
                    )
                    break
        elif in_headers and self._header_bytes > limit:
            self._gate.refused("headers_too_large")
            self.reject(431, f"request headers are larger than {limit} bytes", "headers_too_large")

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong | _HeadersTooLargeError) or (
            isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)
        ):
            status, code = 431, "headers_too_large"
            self._gate.refused(code)
        elif status < 500:
            code = "bad_request"
            self._gate.refused(code)
        else:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            code = "internal_error"
        text = (exc.message if isinstance(exc, BadHttpMessage) else None) or message
        if status >= 500 or not text:
            text = HTTPStatus(status).phrase
        response = web.json_response(error_json(status, str(text), code), status=status)
        response.force_close()
        return response

    # ----------------------------------------------------------------------------- timers
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self._loop.call_later(
            self._limits.header_timeout_s, self._on_header_deadline
        )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_deadline(self) -> None:
        self._header_timer = None
        if (
            self.transport is not None
            and self.awaiting_headers()
            and (self._request_count == 0 or self._header_bytes > 0)
        ):
            self._gate.refused("header_timeout")
            self.reject(
                408,
                f"request headers did not arrive within {self._limits.header_timeout_s:g} s",
                "header_timeout",
                quiet_when_idle=True,
            )


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections are ``_GuardedHandler``s sharing one gate."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        limits: ListenerLimits,
        gate: _Gate,
        handler_kwargs: dict[str, Any],
    ) -> None:
        super().__init__(runner, backlog=limits.backlog)
        self._host = host
        self._port = port
        self._limits = limits
        self.gate = gate
        self._handler_kwargs = handler_kwargs

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        manager = self._runner.server
        assert manager is not None

        def factory() -> _GuardedHandler:
            return _GuardedHandler(
                manager, gate=self.gate, limits=self._limits, loop=loop, **self._handler_kwargs
            )

        self._server = await loop.create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=True
        )


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    limits: ListenerLimits | None = None,
    *,
    handler_cancellation: bool = False,
    shutdown_timeout: float = 2.0,
    on_refusal: Callable[[str], None] | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) behind the listener guards.

    ``on_refusal(reason)`` hears of each connection the guards close or refuse before a
    handler runs: ``too_many_connections``, ``evicted``, ``header_timeout``,
    ``headers_too_large``, ``bad_request``. Returns the runner (``await runner.cleanup()``
    stops it) and the bound port.
    """
    limits = limits or ListenerLimits()
    fd_soft = raise_fd_limit()
    cap = max(1, min(limits.max_connections, fd_soft - FD_RESERVE))
    # One dict for both: the runner's Server and the guarded handlers get the same settings.
    handler_kwargs: dict[str, Any] = {"access_log": None, **limits.handler_args()}
    runner = web.AppRunner(
        app,
        handler_cancellation=handler_cancellation,
        shutdown_timeout=shutdown_timeout,
        **handler_kwargs,
    )
    await runner.setup()
    site = _GuardedSite(runner, host, port, limits, _Gate(cap, on_refusal), handler_kwargs)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = int(runner.addresses[0][1])
    return runner, bound
