"""WebSocket streaming on the worker: ``GET /v1/ws``.

One socket carries many completion and chat completion requests, each with an ``id`` the
client picks, and streams their tokens back as JSON text messages::

    -> {"id": "a", "type": "completion", "model": "alpha", "prompt": "Hi", "max_tokens": 8}
    -> {"id": "b", "type": "chat", "messages": [{"role": "user", "content": "Hi"}]}
    <- {"id": "a", "type": "token", "index": 0, "text": " there", "token_id": 612,
        "finish_reason": null}
    <- {"id": "a", "type": "done", "request_id": "cmpl-...", "model": "alpha",
        "finish_reasons": ["length"], "usage": {...}}
    -> {"type": "cancel", "id": "b"}
    <- {"id": "b", "type": "done", ..., "finish_reasons": ["cancelled"], "usage": null}
    <- {"id": null, "type": "error", "status": 400, "error": {"message", "type", "param",
        "code"}}

The route lives on the HTTP service's application, so it shares its port, listener guards,
tenant (``Authorization`` / ``x-tenant-id`` of the upgrade request), ``x-request-timeout``,
drain and metrics. A request's body is validated by the same models and limits as the HTTP
routes, and runs through ``WorkerService.job_events``: the same tenant queue, engine
admission, deadlines and errors. ``docs/worker-service.md`` lists the protocol and its limits.

A socket owns a bounded send buffer. Request tasks never wait on the network: they queue
messages, and one sender task writes them in order. A client that stops reading fills the
buffer and is closed with 1008; every request in flight on a socket is cancelled in the
engine when the socket ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web

from adaptermesh.assignment_rules import quote
from adaptermesh.worker.service import ADAPTER_HEADER, ApiError, WorkerService

__all__ = ["WS_PATH", "WebSocketLimits", "WebSocketRoute", "mount_websocket"]

log = logging.getLogger(__name__)

WS_PATH = "/v1/ws"
# Message types a client may send, and the request kind each one runs as.
_KINDS: dict[str, Literal["completion", "chat"]] = {"completion": "completion", "chat": "chat"}
_TYPES = (*_KINDS, "cancel")
_MAX_ID_CHARS = 128
# A close frame's reason is at most 123 bytes (RFC 6455 5.5: 125 minus the code).
_MAX_REASON_BYTES = 123
# Session close labels of the close codes aiohttp sets when it ends a socket itself.
_ERROR_CLOSES: dict[int | None, str] = {
    WSCloseCode.MESSAGE_TOO_BIG: "message_too_big",
    WSCloseCode.PROTOCOL_ERROR: "protocol_error",
    WSCloseCode.INVALID_TEXT: "protocol_error",
}


@dataclass(frozen=True, slots=True)
class WebSocketLimits:
    """Per-socket limits of ``/v1/ws``. Message size is the service's ``max_body_bytes``."""

    # Requests in flight on one socket; one more gets an error message, the socket stays open.
    max_inflight: int = 16
    # Bytes of messages queued for a socket and not yet handed to its transport. Past this the
    # client is not reading, and it is closed with 1008: ~4,000 token messages, which is many
    # seconds of output for the fastest stream.
    send_buffer_bytes: int = 1 << 20
    # Server pings this often; no pong within half of it closes the socket.
    heartbeat_s: float = 20.0
    # How long a close waits for the client's close frame before dropping the connection.
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_inflight", "send_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("heartbeat_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class WebSocketRoute:
    """``GET /v1/ws`` on a ``WorkerService``'s application."""

    def __init__(self, service: WorkerService, limits: WebSocketLimits | None = None) -> None:
        self.service = service
        self.limits = limits or WebSocketLimits()
        self._sessions: set[_Session] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        metrics = self.service.metrics
        ws = _Socket(
            heartbeat=self.limits.heartbeat_s,
            max_msg_size=self.service.config.max_body_bytes,
            timeout=self.limits.close_timeout_s,
            # Tokens are a few bytes each: per-message deflate costs more than it saves.
            compress=False,
        )
        if not ws.can_prepare(request).ok:
            raise ApiError(
                426,
                f"{WS_PATH} is a WebSocket endpoint; send an Upgrade: websocket request",
                code="upgrade_required",
                headers={"Upgrade": "websocket", "Connection": "Upgrade"},
            )
        if self.service.draining:
            raise ApiError(
                503,
                "the worker is draining; open the socket on another worker",
                type="service_unavailable",
                code="draining",
                headers={"Retry-After": str(self.service.config.retry_after_s)},
            )
        await ws.prepare(request)
        session = _Session(self, request, ws)
        self._sessions.add(session)
        metrics.ws_open.inc()
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
            metrics.ws_open.dec()
            metrics.ws_sessions.labels(close=session.close_reason).inc()
        return ws

    async def close_all(self, _app: web.Application | None = None) -> None:
        """Close every socket with 1001 (the server is going away)."""
        await asyncio.gather(
            *(
                s.close(WSCloseCode.GOING_AWAY, "the worker is shutting down", "server_shutdown")
                for s in list(self._sessions)
            ),
            return_exceptions=True,
        )


def mount_websocket(
    service: WorkerService, limits: WebSocketLimits | None = None
) -> WebSocketRoute:
    """Add ``GET /v1/ws`` to ``service.app`` (before it starts serving)."""
    route = WebSocketRoute(service, limits)
    service.app.router.add_get(WS_PATH, route.handle)
    service.app.on_shutdown.append(route.close_all)
    return route


class _Socket(web.WebSocketResponse):
    """aiohttp's socket, with a reason on the 1009 close it sends for an oversize message."""

    async def close(
        self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True
    ) -> bool:
        if code == WSCloseCode.MESSAGE_TOO_BIG and not message:
            message = (
                f"a message may have at most {self._max_msg_size} bytes (the request body limit)"
            ).encode()
        return await super().close(code=code, message=message, drain=drain)


class _Session:
    """One socket: its receive loop, its sender, and the requests in flight on it."""

    def __init__(
        self, route: WebSocketRoute, request: web.Request, ws: web.WebSocketResponse
    ) -> None:
        self.route = route
        self.service = route.service
        self.limits = route.limits
        self.request = request
        self.ws = ws
        self.inflight: dict[str | int, asyncio.Task[None]] = {}
        # Client-cancelled ids, so their tasks answer "cancelled" rather than "disconnected".
        self._cancelled: set[str | int] = set()
        self._out: deque[str] = deque()
        self._out_bytes = 0
        self._wake = asyncio.Event()
        # Set once the server decides to close: (code, reason) of its close frame.
        self._close_frame: tuple[int, str] | None = None
        self._close_wanted = asyncio.Event()
        self._ended = asyncio.Event()
        # The close code of a protocol error aiohttp closed the socket for.
        self._error_code: int | None = None
        self._sender: asyncio.Task[None] | None = None
        # How the session ended, for adaptermesh_websocket_sessions{close}.
        self.close_reason = "client_closed"

    # ------------------------------------------------------------------------------ receiving
    async def run(self) -> None:
        """Serve the socket until the client goes away or the server closes it."""
        self._sender = asyncio.create_task(self._send_loop(), name="ws-sender")
        receiver = asyncio.create_task(self._receive_loop(), name="ws-receiver")
        close_wanted = asyncio.create_task(self._close_wanted.wait(), name="ws-close-wanted")
        dropped = False
        try:
            await asyncio.wait({receiver, close_wanted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The connection dropped (handler cancellation) or the server is stopping.
            dropped = not receiver.done()
            raise
        finally:
            self._label_ending(dropped)
            # The close handshake reads the socket itself, so the receiver stops first.
            for task in (receiver, close_wanted):
                task.cancel()
            await asyncio.gather(receiver, close_wanted, return_exceptions=True)
            await self._finish()
            self._ended.set()

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type is WSMsgType.TEXT:
                await self._on_text(msg.data)
            elif msg.type is WSMsgType.BINARY:
                self._start_close(
                    WSCloseCode.UNSUPPORTED_DATA,
                    "binary frames are not accepted; send JSON text",
                    "binary_frame",
                )
                return
            else:
                # ERROR: aiohttp has sent the close frame itself (1009 for a message over
                # max_msg_size, 1002 for a broken frame). CLOSE, CLOSING, CLOSED: the client
                # closed, or the connection dropped.
                if msg.type is WSMsgType.ERROR and isinstance(msg.data, WebSocketError):
                    self._error_code = msg.data.code
                return

    def _label_ending(self, dropped: bool) -> None:
        """``close_reason`` from how the socket ended, unless the server chose to close it."""
        if self._close_frame is not None:
            return
        code = self._error_code or self.ws.close_code
        if code in _ERROR_CLOSES:
            self.close_reason = _ERROR_CLOSES[code]
        elif dropped or code not in (WSCloseCode.OK, WSCloseCode.GOING_AWAY):
            self.close_reason = "disconnected"
        else:
            self.close_reason = "client_closed"

    async def _finish(self) -> None:
        """Cancel every request in flight (freeing its engine slot), stop sending, close."""
        tasks = list(self.inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._sender is not None:
            # A sender stuck writing to a client that does not read would hold the close
            # frame behind it; the close frame goes straight to the transport instead.
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        if self.ws.closed:
            return
        code, reason = self._close_frame or (WSCloseCode.OK, "")
        with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
            # Sends the close frame, then waits up to close_timeout_s for the client's.
            await asyncio.wait_for(
                self.ws.close(code=code, message=reason.encode()[:_MAX_REASON_BYTES], drain=False),
                self.limits.close_timeout_s * 2,
            )
        transport = self.request.transport
        if transport is not None and transport.get_write_buffer_size() > 0:
            # The client never read its way to the close frame: drop the connection, so its
            # unread messages do not hold memory until TCP gives up.
            transport.abort()

    async def _on_text(self, text: str) -> None:
        if not text:
            self._error(
                None, ApiError(400, "message is empty; send a JSON object", code="invalid_json")
            )
            return
        try:
            # Same parser as request bodies: depth-bounded, and off the loop when large.
            message = await self.service.decode_json(text.encode())
        except ApiError as exc:
            self._error(None, exc)
            return
        present = "id" in message
        cid = message.pop("id", None)
        if not _valid_id(cid):
            self._error(
                None,
                ApiError(
                    400,
                    f"id: {'must be' if present else 'is required,'} a string of 1 to "
                    f"{_MAX_ID_CHARS} characters or an integer",
                    param="id",
                    code="invalid_value" if present else "missing_field",
                ),
            )
            return
        assert isinstance(cid, str | int)
        kind = message.pop("type", "completion")
        if kind not in _TYPES:
            self._error(
                cid,
                ApiError(
                    400,
                    f"type: must be one of {', '.join(_TYPES)}, got {json.dumps(kind)[:64]}",
                    param="type",
                    code="invalid_value",
                ),
            )
            return
        if kind == "cancel":
            self._cancel(cid, message)
            return
        if cid in self.inflight:
            self._error(
                cid,
                ApiError(
                    409,
                    f"id: {json.dumps(cid)} is already in flight on this socket; pick another id",
                    param="id",
                    code="duplicate_id",
                ),
            )
            return
        if len(self.inflight) >= self.limits.max_inflight:
            self.service.metrics.rejected.labels(reason="websocket_inflight").inc()
            self._error(
                cid,
                ApiError(
                    429,
                    f"this socket already has {self.limits.max_inflight} "
                    "requests in flight; wait for one to finish or open "
                    "another socket",
                    type="rate_limit_error",
                    param="id",
                    code="too_many_inflight",
                ),
            )
            return
        self.inflight[cid] = asyncio.create_task(
            self._serve(cid, _KINDS[kind], message), name=f"ws-request-{cid}"
        )

    def _cancel(self, cid: str | int, message: dict[str, Any]) -> None:
        if message:
            field = sorted(message)[0]
            self._error(
                cid,
                ApiError(
                    400,
                    f"{field}: is not a field of a cancel message",
                    param=field,
                    code="unknown_field",
                ),
            )
            return
        task = self.inflight.get(cid)
        if task is None:
            self._error(
                cid,
                ApiError(
                    404,
                    f"id: no request {json.dumps(cid)} is in flight on this socket",
                    param="id",
                    code="unknown_id",
                ),
            )
            return
        self._cancelled.add(cid)
        task.cancel()

    # ------------------------------------------------------------------------------- requests
    async def _serve(
        self, cid: str | int, kind: Literal["completion", "chat"], body: dict[str, Any]
    ) -> None:
        metrics = self.service.metrics
        outcome = "error"
        request_id: str | None = None
        model: str | None = None
        try:
            # The edge checked the caller for the adapter in the upgrade's header (mesh/edge.py)
            # and never reads the messages: a message may not name another model.
            routed = self.request.headers.get(ADAPTER_HEADER, "").strip()
            named = body.get("model")
            if routed and named is not None and named != routed:
                raise ApiError(
                    403,
                    f"model: {quote(named)} is not the adapter this socket was "
                    f"routed for ({ADAPTER_HEADER}: {quote(routed)})",
                    type="permission_error",
                    param="model",
                    code="adapter_mismatch",
                )
            job = await self.service.build_job(self.request, body, kind)
            request_id, model = job.request_id, job.model
            reasons: list[str | None] = [None] * job.n
            events = self.service.job_events(job)
            # echo: each choice's first message is the prompt's text (no token id), sent once
            # the choice has its first event, as the SSE stream sends it first.
            echo_pending = set(range(job.n)) if job.echo else set()
            async with contextlib.aclosing(events):
                async for item in events:
                    event = item.event
                    if item.index in echo_pending:
                        echo_pending.discard(item.index)
                        self._send(
                            {
                                "id": cid,
                                "type": "token",
                                "index": item.index,
                                "text": job.echo,
                                "token_id": None,
                                "finish_reason": None,
                            }
                        )
                    if event.finish_reason is not None:
                        reasons[item.index] = event.finish_reason
                    # One message per generated token, even when its text is "" (an
                    # incomplete multi-byte character), as the SSE stream sends one chunk.
                    if event.token_id is not None or event.text or event.finish_reason is not None:
                        self._send(
                            {
                                "id": cid,
                                "type": "token",
                                "index": item.index,
                                "text": event.text,
                                "token_id": event.token_id,
                                "finish_reason": event.finish_reason,
                            }
                        )
                    if item.usage is not None:
                        self._send(
                            {
                                "id": cid,
                                "type": "done",
                                "request_id": request_id,
                                "model": model,
                                "finish_reasons": reasons,
                                "usage": item.usage,
                            }
                        )
                        outcome = _outcome(reasons)
        except ApiError as exc:
            outcome = exc.code or "error"
            self._error(cid, exc)
        except asyncio.CancelledError:
            if cid in self._cancelled:
                outcome = "cancelled"
                self._send(
                    {
                        "id": cid,
                        "type": "done",
                        "request_id": request_id,
                        "model": model,
                        "finish_reasons": ["cancelled"],
                        "usage": None,
                    }
                )
            else:
                outcome = "disconnected"
            raise
        except Exception:
            log.exception("websocket request %r failed", cid)
            self._error(
                cid,
                ApiError(500, "internal server error", type="server_error", code="internal_error"),
            )
        finally:
            self._cancelled.discard(cid)
            self.inflight.pop(cid, None)
            metrics.ws_requests.labels(outcome=outcome).inc()

    # -------------------------------------------------------------------------------- sending
    def _error(self, cid: str | int | None, exc: ApiError) -> None:
        self._send({"id": cid, "type": "error", "status": exc.status, **exc.body()})

    def _send(self, message: dict[str, Any]) -> None:
        """Queue ``message``; a full send buffer closes the socket with 1008."""
        if self._close_frame is not None:
            return
        text = json.dumps(message, separators=(",", ":"))
        if self._out_bytes + len(text) > self.limits.send_buffer_bytes:
            self._start_close(
                WSCloseCode.POLICY_VIOLATION,
                f"the client is not reading: {self.limits.send_buffer_bytes} "
                "bytes of messages are waiting",
                "slow_client",
            )
            return
        self._out.append(text)
        self._out_bytes += len(text)
        self._wake.set()

    async def _send_loop(self) -> None:
        ws = self.ws
        out = self._out
        try:
            while True:
                while not out:
                    self._wake.clear()
                    await self._wake.wait()
                text = out.popleft()
                self._out_bytes -= len(text)
                # Waits while the transport's buffer is over its high-water mark, which is
                # how a client that does not read backs messages up into ``out``.
                await ws.send_str(text)
        except (ConnectionError, RuntimeError):
            # The peer went away (or the socket is closing); the receive loop sees it too.
            return

    # -------------------------------------------------------------------------------- closing
    def _start_close(self, code: int, reason: str, label: str) -> None:
        """Close with ``code``: requests are cancelled now, the handshake runs in ``run``."""
        if self._close_frame is not None:
            return
        self._close_frame = (code, reason)
        self.close_reason = label
        self._out.clear()
        self._out_bytes = 0
        # Free the engine now rather than when the close handshake ends.
        for task in self.inflight.values():
            task.cancel()
        self._close_wanted.set()

    async def close(self, code: int, reason: str, label: str) -> None:
        self._start_close(code, reason, label)
        await self._ended.wait()


def _valid_id(cid: Any) -> bool:
    if isinstance(cid, str):
        return 0 < len(cid) <= _MAX_ID_CHARS
    return type(cid) is int and abs(cid) < 1 << 53


def _outcome(reasons: list[str | None]) -> str:
    """A finished request's outcome: ``length`` when any choice hit its cap, else ``stop``."""
    return "length" if "length" in reasons else "stop"
