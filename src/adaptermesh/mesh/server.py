"""The per-node Aggregated Discovery Service (state of the world and incremental).

Usage::

    cache = SnapshotCache()
    server = XdsServer(cache, host="127.0.0.1", port=0)
    port = server.start()            # serves on its own thread and asyncio loop
    cache.set_assignment("node-a", assignment)
    ...
    server.stop()

:class:`XdsServer` serves ``StreamAggregatedResources`` and ``DeltaAggregatedResources`` on
grpcio's asyncio server, in a background thread, so a synchronous or an asyncio agent can
embed it. Every Envoy stream is its own coroutine with its own queue: a slow Envoy only
delays itself.

Protocol rules it follows:

- The first request of a stream must carry ``node.id`` and every request a ``type_url``;
  otherwise the stream ends with ``INVALID_ARGUMENT`` (the server keeps running).
- Per type, one response is in flight at a time. A request whose ``response_nonce`` is not
  the last nonce sent for its type is stale and ignored (counted).
- An ACK records the version; a NACK (``error_detail`` set) records the rejected version and
  Envoy's message in the cache's status, a metric and the log. Envoy keeps its last good
  config, and that type version is never sent to that node again; the next publish gets a new
  version.
- Pushes follow Envoy's order: clusters, endpoints, listeners, routes. Only types whose
  version changed are pushed.
- A type URL we do not serve gets an empty response once per request without a nonce
  (Envoy's init does not hang on it), and is counted.
- The first request of a type on a new stream is always answered (a reconnecting Envoy
  resumes with the current version), unless that version was NACKed by the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from adaptermesh.loopthread import LoopThread
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.metrics import XdsMetrics
from adaptermesh.mesh.snapshot import (
    ADS_TYPE_ORDER,
    CLUSTER_TYPE,
    LISTENER_TYPE,
    Snapshot,
)

__all__ = ["XdsServer"]

log = logging.getLogger(__name__)

_SERVED = frozenset(ADS_TYPE_ORDER)
# Types whose empty first subscription means "everything" (xDS legacy wildcard).
_WILDCARD_TYPES = frozenset((CLUSTER_TYPE, LISTENER_TYPE))
_END = object()


@dataclass(frozen=True)
class _BadRequest:
    detail: str


_WAKE = object()


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


@dataclass
class _TypeState:
    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    nonce: str | None = None
    sent_version: str | None = None
    acked_version: str | None = None
    awaiting: bool = False
    force: bool = True
    # Delta only: what the client holds, name -> resource version.
    known: dict[str, str] = field(default_factory=dict)


class _Stream:
    """One Envoy stream: a reader task feeds a queue that a single loop consumes."""

    mode = "sotw"

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: XdsMetrics,
        stream_id: int,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.stream_id = stream_id
        self.context = context
        self.node_id: str | None = None
        self.key: str | None = None
        self.types: dict[str, _TypeState] = {}
        self._nonces = itertools.count(1)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._wake_pending = False
        self._loop = asyncio.get_running_loop()

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._queue.put_nowait(_WAKE)

    def _wake_threadsafe(self) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self._loop.call_soon_threadsafe(self._wake)

    async def run(self, requests: AsyncIterator[Any]) -> None:
        async def read() -> None:
            try:
                async for request in requests:
                    self._queue.put_nowait(request)
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # an undecodable message ends up here
                self._queue.put_nowait(_BadRequest(f"{type(exc).__name__}: {exc}"))
            finally:
                self._queue.put_nowait(_END)

        reader = asyncio.create_task(read())
        cancel_watch: Callable[[], None] | None = None
        self.metrics.streams.labels(self.mode).inc()
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                if isinstance(item, _BadRequest):
                    await self._protocol_error("undecodable", f"bad request: {item.detail}")
                if item is _WAKE:
                    self._wake_pending = False
                    await self._push_all()
                    # A publish that changed nothing this node holds needs no round trip:
                    # the node is already at the new version.
                    self._check_in_sync()
                    continue
                if self.node_id is None:
                    if not item.HasField("node") or not item.node.id:
                        await self._protocol_error(
                            "missing_node", "the first request must carry node.id"
                        )
                    self.node_id = str(item.node.id)
                    self.key = self.cache.node_key(item.node)
                    self.cache.stream_opened(self.node_id, self.key)
                    cancel_watch = self.cache.watch(self.key, self._wake_threadsafe)
                    log.info(
                        "%s stream %d opened by %s (key %s)",
                        self.mode,
                        self.stream_id,
                        self.node_id,
                        self.key,
                    )
                if not item.type_url:
                    await self._protocol_error("missing_type_url", "type_url is required on ADS")
                await self._on_request(item)
        finally:
            self.metrics.streams.labels(self.mode).dec()
            reader.cancel()
            if cancel_watch is not None:
                cancel_watch()
            if self.node_id is not None:
                self.cache.stream_closed(self.node_id)
                log.info("%s stream %d of %s closed", self.mode, self.stream_id, self.node_id)

    async def _protocol_error(self, reason: str, detail: str) -> None:
        self.metrics.protocol_errors.labels(reason).inc()
        log.warning("closing xDS stream %d: %s", self.stream_id, detail)
        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)

    async def _push_all(self) -> None:
        for type_url in ADS_TYPE_ORDER:
            state = self.types.get(type_url)
            if state is not None:
                await self._maybe_send(type_url, state)

    def _next_nonce(self) -> str:
        return f"{self.stream_id}-{next(self._nonces)}"

    def _snapshot(self) -> Snapshot | None:
        assert self.key is not None
        return self.cache.get_snapshot(self.key)

    def _rejected(self, type_url: str, version: str) -> bool:
        assert self.node_id is not None
        return version in self.cache.rejected_versions(self.node_id, type_url)

    def _handle_ack_or_nack(self, type_url: str, state: _TypeState, request: Any) -> None:
        assert self.node_id is not None
        state.awaiting = False
        rejected = state.sent_version or ""
        if request.HasField("error_detail"):
            self.cache.record_nack(
                self.node_id,
                type_url,
                rejected,
                str(request.error_detail.message),
                int(request.error_detail.code),
            )
            return
        state.acked_version = state.sent_version
        if type_url in _SERVED and state.sent_version is not None:
            self.cache.record_ack(self.node_id, type_url, state.sent_version)
            self._check_in_sync()

    def _check_in_sync(self) -> None:
        snapshot = self._snapshot()
        if snapshot is None or self.node_id is None:
            return
        served = [(t, s) for t, s in self.types.items() if t in _SERVED]
        if served and all(s.acked_version == snapshot.type_versions[t] for t, s in served):
            self.cache.record_in_sync(self.node_id, snapshot.version)

    def _record_push(self, type_url: str, version: str) -> None:
        assert self.node_id is not None
        self.metrics.pushes.labels(_short(type_url), self.mode).inc()
        if type_url in _SERVED:
            self.cache.record_sent(self.node_id, type_url, version)

    async def _on_request(self, request: Any) -> None:
        raise NotImplementedError

    async def _maybe_send(self, type_url: str, state: _TypeState) -> None:
        raise NotImplementedError


class _SotwStream(_Stream):
    mode = "sotw"

    async def _on_request(self, request: discovery_pb2.DiscoveryRequest) -> None:
        type_url = str(request.type_url)
        state = self.types.get(type_url)
        first = state is None
        if state is None:
            state = self.types[type_url] = _TypeState()
            if type_url not in _SERVED:
                self.metrics.unknown_types.inc()
                log.warning("node %s asked for unserved type %s", self.node_id, type_url)
        if request.response_nonce:
            if request.response_nonce != state.nonce:
                self.metrics.stale_nonces.inc()
                log.debug(
                    "ignoring %s request with stale nonce %r (last %r)",
                    _short(type_url),
                    request.response_nonce,
                    state.nonce,
                )
                return
            self._handle_ack_or_nack(type_url, state, request)
        else:
            # A request without a nonce opens (or re-opens) the subscription: answer it.
            state.awaiting = False
            state.force = True
        names = set(request.resource_names)
        wildcard = "*" in names or (
            not names and type_url in _WILDCARD_TYPES and (first or state.wildcard)
        )
        names.discard("*")
        if wildcard != state.wildcard or names != state.names:
            state.wildcard, state.names = wildcard, names
            state.force = True
        await self._maybe_send(type_url, state)

    async def _maybe_send(self, type_url: str, state: _TypeState) -> None:
        if state.awaiting:
            return
        resources: list[Any] = []
        if type_url in _SERVED:
            snapshot = self._snapshot()
            if snapshot is None:
                return
            version = snapshot.type_versions[type_url]
            if self._rejected(type_url, version):
                state.force = False
                return
            if not state.force and version == state.sent_version:
                return
            packed = snapshot.packed[type_url]
            resources = [packed[n] for n in sorted(packed) if state.wildcard or n in state.names]
        else:
            if not state.force:
                return
            version = ""
        nonce = self._next_nonce()
        state.nonce, state.sent_version, state.awaiting, state.force = nonce, version, True, False
        self._record_push(type_url, version)
        await self.context.write(
            discovery_pb2.DiscoveryResponse(
                version_info=version, resources=resources, type_url=type_url, nonce=nonce
            )
        )


class _DeltaStream(_Stream):
    mode = "delta"

    async def _on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        type_url = str(request.type_url)
        state = self.types.get(type_url)
        if state is None:
            subscribe = set(request.resource_names_subscribe)
            state = self.types[type_url] = _TypeState(
                wildcard="*" in subscribe or (not subscribe and type_url in _WILDCARD_TYPES),
                known=dict(request.initial_resource_versions),
            )
            if type_url not in _SERVED:
                self.metrics.unknown_types.inc()
                log.warning("node %s asked for unserved type %s", self.node_id, type_url)
        if request.response_nonce:
            if request.response_nonce != state.nonce:
                self.metrics.stale_nonces.inc()
            else:
                self._handle_ack_or_nack(type_url, state, request)
        for name in request.resource_names_subscribe:
            if name == "*":
                state.wildcard = True
            else:
                state.names.add(name)
        for name in request.resource_names_unsubscribe:
            if name == "*":
                state.wildcard = False
            else:
                state.names.discard(name)
                state.known.pop(name, None)
        await self._maybe_send(type_url, state)

    async def _maybe_send(self, type_url: str, state: _TypeState) -> None:
        if state.awaiting:
            return
        updates: list[discovery_pb2.Resource] = []
        removed: list[str] = []
        version = ""
        if type_url in _SERVED:
            snapshot = self._snapshot()
            if snapshot is None:
                return
            version = snapshot.type_versions[type_url]
            if self._rejected(type_url, version):
                state.force = False
                return
            current = snapshot.resource_versions[type_url]
            packed = snapshot.packed[type_url]
            for name in sorted(current):
                if (state.wildcard or name in state.names) and state.known.get(name) != current[
                    name
                ]:
                    updates.append(
                        discovery_pb2.Resource(
                            name=name, version=current[name], resource=packed[name]
                        )
                    )
            removed = sorted(n for n in state.known if n not in current)
            if not updates and not removed and not state.force:
                # Nothing this client holds changed: it is already at this version.
                if state.acked_version != version:
                    state.acked_version = state.sent_version = version
                    self._check_in_sync()
                return
        elif not state.force:
            return
        for resource in updates:
            state.known[resource.name] = resource.version
        for name in removed:
            state.known.pop(name, None)
        nonce = self._next_nonce()
        state.nonce, state.sent_version, state.awaiting, state.force = nonce, version, True, False
        self._record_push(type_url, version)
        await self.context.write(
            discovery_pb2.DeltaDiscoveryResponse(
                system_version_info=version,
                resources=updates,
                type_url=type_url,
                removed_resources=removed,
                nonce=nonce,
            )
        )


class _AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, cache: SnapshotCache, metrics: XdsMetrics) -> None:
        self._cache = cache
        self._metrics = metrics
        self._ids = itertools.count(1)

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        stream = _SotwStream(self._cache, self._metrics, next(self._ids), context)
        await stream.run(request_iterator)

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        stream = _DeltaStream(self._cache, self._metrics, next(self._ids), context)
        await stream.run(request_iterator)


class XdsServer:
    """ADS over grpcio's asyncio server, on its own thread.

    ``start()`` binds ``host:port`` (0 picks a free port) and returns the port; ``stop()``
    closes every stream and the server. Usable as a context manager.
    """

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: XdsMetrics | None = None,
    ) -> None:
        self.cache = cache
        self.host = host
        self._requested_port = port
        self.metrics = metrics or cache.metrics
        self.port: int | None = None
        self._loop = LoopThread("xds-server")
        self._server: grpc.aio.Server | None = None

    def start(self) -> int:
        self.port = self._loop.start(self._start)
        log.info("xDS server listening on %s:%d", self.host, self.port)
        return self.port

    async def _start(self) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                # Find dead Envoys whose TCP connection never closed.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ]
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
            _AdsServicer(self.cache, self.metrics), server
        )
        port = int(server.add_insecure_port(f"{self.host}:{self._requested_port}"))
        if port == 0:
            raise OSError(f"cannot bind the xDS server to {self.host}:{self._requested_port}")
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float = 0.5) -> None:
        if self._loop.loop is None:
            return
        self._loop.stop(self._server, grace)
        self._server = None
        log.info("xDS server on port %s stopped", self.port)

    def __enter__(self) -> XdsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
