"""The MQTT bridge: requests from a broker topic to the mesh, one answer per request id.

Order of operations (docs/bridge.md has the guarantees this gives):

1. A request arrives (QoS 1; the client acknowledges manually). Invalid: an error reply goes to
   its reply topic, then the PUBACK. Valid: ``Store.accept`` inserts it unless its id is known
   and returns when the row is on disk.
2. New id: it waits in the work queue, *unacknowledged*, until one of ``max_in_flight`` workers
   takes it; the worker sends the PUBACK and then submits it to the mesh. The broker sends at
   most Receive Maximum unacknowledged messages, so a slow mesh stops the flow at the broker
   instead of filling this process. A broker that sends more anyway (mosquitto 2.0.11 refills
   the whole window after each PUBACK) finds the network thread waiting for room in the queue
   before it reads on, so the bridge never holds more than Receive Maximum waiting requests.
3. The answer (or final error) is stored, then published at QoS 1 to the reply topic; the
   broker's PUBACK marks it published.
4. A redelivered id: in progress here -> acknowledged (its worker answers); done but not
   confirmed published -> the stored answer is published again; published -> acknowledged
   only. An id reused for a different request gets a ``conflict`` error reply.
5. On start, accepted-but-unanswered requests run again and stored-but-unconfirmed answers are
   published again. The session is persistent (clean start off, session expiry), so the
   broker keeps QoS 1 requests for the bridge while it is down.

Threads: paho's network loop calls ``_on_*``; the workers are asyncio tasks. They share the
store (it locks) and ``_known`` (under ``_lock``, never held across a paho call).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adaptermesh.bridge.mesh import MeshClient, MeshResult
from adaptermesh.bridge.protocol import (
    Invalid,
    Request,
    answer_reply,
    error_reply,
    parse_request,
)
from adaptermesh.bridge.store import DONE, Row, Store

__all__ = ["Bridge", "BridgeConfig", "BridgeStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BridgeConfig:
    broker_host: str
    broker_port: int
    request_topic: str
    base_url: str
    state_dir: Path
    # Requests submitted to the mesh at once.
    max_in_flight: int = 16
    # Unacknowledged requests the broker may send ahead (MQTT v5 Receive Maximum); 0: as
    # many as max_in_flight, so at most 2 x max_in_flight requests are held in memory.
    receive_maximum: int = 0
    client_id: str = "adaptermesh-bridge"
    # How long the broker keeps the session (subscription and queued requests) while the
    # bridge is away.
    session_expiry_s: int = 7 * 24 * 3600
    keepalive_s: int = 30
    request_timeout_s: float = 300.0
    max_attempts: int = 6
    max_payload_bytes: int = 1 << 20
    # How long a published answer is kept to recognise a redelivered id.
    retention_s: float = 24 * 3600.0
    # On stop, how long running requests may take to finish.
    drain_s: float = 10.0
    username: str | None = None
    password: str | None = None
    synchronous: str = "FULL"

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not 0 <= self.receive_maximum <= 65535:
            raise ValueError("receive_maximum must be in 0..65535")
        if not self.request_topic or "\x00" in self.request_topic:
            raise ValueError("request_topic must be a non-empty topic filter")
        if self.retention_s <= 0:
            raise ValueError("retention_s must be positive")

    @property
    def receive_window(self) -> int:
        return self.receive_maximum or min(self.max_in_flight, 65535)


@dataclass
class BridgeStats:
    """Counters since start (also served as Prometheus metrics)."""

    received: int = 0
    invalid: int = 0
    unanswerable: int = 0  # invalid and no usable reply topic
    duplicates: int = 0  # redelivered ids, answered by the first delivery or the store
    conflicts: int = 0
    recovered: int = 0  # unfinished requests run again at start
    republished: int = 0  # stored answers published again (restart or redelivery)
    answered: int = 0
    errors: int = 0  # answers that are error replies (mesh refused / unavailable)
    published: int = 0  # answers confirmed by the broker
    in_flight: int = 0
    max_in_flight_seen: int = 0
    waiting: int = 0
    max_waiting_seen: int = 0


@dataclass
class _Job:
    id: str
    mid: int | None  # the request's packet id while it waits unacknowledged
    started: bool = False


@dataclass
class _Shared:
    """State the paho thread and the workers share, under ``Bridge._lock``."""

    known: dict[str, _Job] = field(default_factory=dict)  # queued, running or publishing
    publishing: dict[int, str | None] = field(default_factory=dict)  # mid -> id
    early_acks: set[int] = field(default_factory=set)  # PUBACKs seen before publish() returned


class Bridge:
    def __init__(
        self,
        config: BridgeConfig,
        *,
        mesh: MeshClient | None = None,
        clock: Callable[[], float] = time.time,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.stats = BridgeStats()
        self.store = Store(config.state_dir / "bridge.sqlite3", config.synchronous)
        self.mesh = mesh or MeshClient(
            config.base_url,
            timeout=config.request_timeout_s,
            max_attempts=config.max_attempts,
            max_connections=config.max_in_flight,
        )
        self._clock = clock
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._shared = _Shared()
        self._ready = False
        self._stopping = False
        self._republish: list[Row] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._loop_thread = 0
        self._busy: set[asyncio.Task[None]] = set()
        # Requests accepted (or about to be) that no worker has taken yet.
        self._room = threading.Condition()
        self._waiting = 0
        self._client = self._make_client()

    # -- lifecycle --

    def _make_client(self) -> paho.Client:
        c = self.config
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=c.client_id,
            protocol=MQTTProtocolVersion.MQTTv5,
            manual_ack=True,
        )
        if c.username is not None:
            client.username_pw_set(c.username, c.password)
        client.reconnect_delay_set(1, 30)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then let running requests finish (``drain_s``)."""
        c = self.config
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._queue = asyncio.Queue()
        for row in self.store.unfinished():
            self._shared.known[row.request.id] = job = _Job(row.request.id, mid=None)
            self._waiting += 1
            self._enqueue(job)
            self.stats.recovered += 1
        self._republish = self.store.unpublished()
        if self.stats.recovered or self._republish:
            log.info(
                "recovering: %d requests to run, %d answers to publish again",
                self.stats.recovered,
                len(self._republish),
            )
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = c.session_expiry_s
        props.ReceiveMaximum = c.receive_window
        self._client.connect_async(
            c.broker_host,
            c.broker_port,
            keepalive=c.keepalive_s,
            clean_start=False,
            properties=props,
        )
        self._client.loop_start()
        workers = [
            asyncio.create_task(self._worker(), name=f"bridge-worker-{i}")
            for i in range(c.max_in_flight)
        ]
        pruner = asyncio.create_task(self._prune_loop(), name="bridge-prune")
        try:
            await stop.wait()
        finally:
            self._stopping = True
            with self._room:
                self._room.notify_all()
            pruner.cancel()
            for t in workers:
                if t not in self._busy:
                    t.cancel()
            await asyncio.wait(workers, timeout=c.drain_s)
            for t in workers:
                t.cancel()
            await asyncio.gather(*workers, pruner, return_exceptions=True)
            # Give the broker a moment to confirm answers already sent.
            deadline = time.monotonic() + min(2.0, c.drain_s)
            while self._shared.publishing and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            self._client.disconnect()
            self._client.loop_stop()
            await self.mesh.aclose()
            self.store.close()

    # -- paho callbacks (network thread) --

    def _on_connect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: Any,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason.is_failure:
            log.error("broker refused the connection: %s", reason)
            return
        sock = client.socket()
        if isinstance(sock, socket.socket):
            # Small packets (PUBACK, then the reply) back to back: without this, Nagle's
            # algorithm and the broker's delayed ACK add about 40 ms to a request.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        log.info(
            "connected to %s:%d (session present: %s)",
            self.config.broker_host,
            self.config.broker_port,
            flags.session_present,
        )
        client.subscribe(self.config.request_topic, options=SubscribeOptions(qos=1, noLocal=True))

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: Any,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if not self._stopping:
            log.warning("disconnected from the broker (%s); reconnecting", reason)

    def _on_subscribe(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reasons: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        if any(r.is_failure for r in reasons):
            log.error("subscription to %r refused: %s", self.config.request_topic, reasons)
            return
        if self._ready:
            return
        self._ready = True
        for row in self._republish:
            self._publish_answer(row)
        self._republish = []
        if self._on_ready is not None:
            self._on_ready()

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            self._receive(msg)
        except Exception:
            # Not acknowledged: the broker redelivers it on the next connection.
            log.exception("could not take a request (left unacknowledged)")

    def _receive(self, msg: paho.MQTTMessage) -> None:
        self.stats.received += 1
        props = msg.properties
        parsed = parse_request(
            bytes(msg.payload),
            loops_back=lambda t: paho.topic_matches_sub(self.config.request_topic, t),
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=getattr(props, "CorrelationData", None),
            max_bytes=self.config.max_payload_bytes,
        )
        if isinstance(parsed, Invalid):
            self._refuse(parsed)
            self._ack(msg.mid)
            return
        if not self._reserve():
            return  # stopping: left unacknowledged, so the broker redelivers it
        new = False
        try:
            new = self._accept(parsed, msg.mid)
        finally:
            if not new:
                self._release()

    def _reserve(self) -> bool:
        """Wait for room in the work queue (the back-pressure bound); False when stopping."""
        with self._room:
            while self._waiting >= self.config.receive_window and not self._stopping:
                self._room.wait(1.0)
            if self._stopping:
                return False
            self._waiting += 1
            return True

    def _release(self) -> None:
        with self._room:
            self._waiting -= 1
            self._room.notify()

    def _accept(self, parsed: Request, mid: int) -> bool:
        """Store the request; True when it became a new job (it keeps its queue slot)."""
        row = self.store.accept(parsed, self._clock())
        if row.digest != parsed.digest:
            self.stats.conflicts += 1
            self._publish(
                parsed.reply_to,
                error_reply(
                    parsed.id,
                    parsed.correlation,
                    status=409,
                    kind="conflict",
                    field="id",
                    message="this id was already used for a different request (endpoint or body "
                    "differ); use a new idempotency key",
                ),
                parsed.correlation_data,
                None,
            )
            self._ack(mid)
            return False
        with self._lock:
            job = self._shared.known.get(parsed.id)
            if job is None and row.state != DONE:
                self._shared.known[parsed.id] = job = _Job(parsed.id, mid=mid)
                new = True
            else:
                new = False
                if job is not None and not job.started:
                    # A redelivery of a request still waiting: ack it when a worker takes it.
                    job.mid = mid
                    self.stats.duplicates += 1
                    return False
        if new:
            assert job is not None
            self._enqueue(job)
            return True
        self.stats.duplicates += 1
        if job is None and not row.published:
            self._publish_answer(row)
        self._ack(mid)
        return False

    def _on_publish(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        with self._lock:
            if mid not in self._shared.publishing:
                self._shared.early_acks.add(mid)
                return
            req_id = self._shared.publishing.pop(mid)
        self._published(req_id, reason)

    def _published(self, req_id: str | None, reason: ReasonCode) -> None:
        if reason.is_failure:
            log.error("the broker refused reply %s: %s", req_id, reason)
        if req_id is None:
            return
        try:
            self.store.mark_published(req_id, self._clock())
        except Exception:
            log.exception("could not mark %s published (it may be published again)", req_id)
        self.stats.published += 1
        with self._lock:
            self._shared.known.pop(req_id, None)

    # -- helpers (any thread) --

    def _ack(self, mid: int) -> None:
        self._client.ack(mid, 1)

    def _enqueue(self, job: _Job) -> None:
        loop, queue = self._loop, self._queue
        assert loop is not None
        assert queue is not None

        def put() -> None:
            queue.put_nowait(job)
            self.stats.waiting = queue.qsize()
            self.stats.max_waiting_seen = max(self.stats.max_waiting_seen, queue.qsize())

        if threading.get_ident() == self._loop_thread:
            put()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: stays unacknowledged
                loop.call_soon_threadsafe(put)

    def _refuse(self, bad: Invalid) -> None:
        self.stats.invalid += 1
        if bad.reply_to is None:
            self.stats.unanswerable += 1
            log.warning(
                "dropped an invalid request with no reply topic: %s %s", bad.field, bad.message
            )
            return
        self._publish(
            bad.reply_to,
            error_reply(
                bad.id,
                bad.correlation,
                status=400,
                kind="invalid_request",
                field=bad.field,
                message=f"{bad.field}: {bad.message}",
            ),
            bad.correlation_data,
            None,
        )

    def _publish_answer(self, row: Row) -> None:
        assert row.answer is not None
        with self._lock:
            self._shared.known.setdefault(row.request.id, _Job(row.request.id, None, True))
        self.stats.republished += 1
        req = row.request
        self._publish(req.reply_to, row.answer, req.correlation_data, req.id)

    def _publish(
        self, topic: str, payload: bytes, correlation_data: bytes | None, req_id: str | None
    ) -> None:
        props = None
        if correlation_data is not None:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.CorrelationData = correlation_data
        info = self._client.publish(topic, payload, qos=1, properties=props)
        with self._lock:
            early = info.mid in self._shared.early_acks
            if early:
                self._shared.early_acks.discard(info.mid)
            else:
                self._shared.publishing[info.mid] = req_id
        if early:
            self._published(req_id, ReasonCode(PacketTypes.PUBACK, identifier=0))

    # -- workers (asyncio) --

    async def _worker(self) -> None:
        assert self._queue is not None
        task = asyncio.current_task()
        assert task is not None
        while not self._stopping:
            job = await self._queue.get()
            self.stats.waiting = self._queue.qsize()
            self._release()
            self._busy.add(task)
            try:
                await self._serve(job)
            except Exception:
                log.exception("request %s failed in the bridge; it will be retried", job.id)
                await asyncio.sleep(1.0)
                with self._room:
                    self._waiting += 1
                self._enqueue(job)
            finally:
                self._busy.discard(task)

    async def _serve(self, job: _Job) -> None:
        with self._lock:
            job.started = True
            mid, job.mid = job.mid, None
        if mid is not None:
            self._ack(mid)
        row = await asyncio.to_thread(self.store.get, job.id)
        if row is None:  # pruned meanwhile: nothing to answer
            with self._lock:
                self._shared.known.pop(job.id, None)
            return
        if row.state == DONE:  # answered by an earlier run
            if not row.published:
                self._publish_answer(row)
            return
        req = row.request
        self.stats.in_flight += 1
        self.stats.max_in_flight_seen = max(self.stats.max_in_flight_seen, self.stats.in_flight)
        try:
            result = await self.mesh.submit(req.endpoint, req.body)
        finally:
            self.stats.in_flight -= 1
        answer = _answer(req, result)
        self.stats.answered += 1
        self.stats.errors += not result.ok
        if await asyncio.to_thread(self.store.complete, req.id, answer, self._clock()):
            self._publish(req.reply_to, answer, req.correlation_data, req.id)

    async def _prune_loop(self) -> None:
        interval = min(60.0, self.config.retention_s / 10)
        while True:
            await asyncio.sleep(interval)
            try:
                gone = await asyncio.to_thread(
                    self.store.prune, self._clock() - self.config.retention_s
                )
                if gone:
                    log.info("pruned %d answered requests past retention", gone)
            except Exception:
                log.exception("pruning the request store failed")

    def collector(self) -> Collector:
        return _StatsCollector(self)


def _answer(req: Request, result: MeshResult) -> bytes:
    if result.ok:
        return answer_reply(req.id, req.correlation, req.endpoint, result.status, result.body)
    if result.unavailable or result.body is None:
        return error_reply(
            req.id,
            req.correlation,
            status=result.status,
            kind="mesh_unavailable" if result.unavailable else "mesh_error",
            message=result.error,
        )
    err = result.body.get("error") if isinstance(result.body, dict) else None
    message = f"the mesh answered HTTP {result.status}"
    field_name = None
    if isinstance(err, dict):
        message = str(err.get("message") or message)
        if isinstance(err.get("param"), str) and err["param"]:
            field_name = "body." + err["param"]
    return error_reply(
        req.id,
        req.correlation,
        status=result.status,
        kind="mesh_error",
        message=message,
        field=field_name,
        response=result.body,
    )


class _StatsCollector(Collector):
    _COUNTERS = (
        "received",
        "invalid",
        "duplicates",
        "conflicts",
        "recovered",
        "republished",
        "answered",
        "errors",
        "published",
    )
    _GAUGES = ("in_flight", "waiting")

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge

    def collect(self) -> Iterator[Metric]:
        stats = self._bridge.stats
        for name in self._COUNTERS:
            yield CounterMetricFamily(
                f"adaptermesh_bridge_{name}", f"Bridge requests: {name}", value=getattr(stats, name)
            )
        for name in self._GAUGES:
            yield GaugeMetricFamily(
                f"adaptermesh_bridge_{name}", f"Bridge requests: {name}", value=getattr(stats, name)
            )
        counts = self._bridge.store.counts()
        g = GaugeMetricFamily(
            "adaptermesh_bridge_stored_requests",
            "Rows in the bridge's request store",
            labels=["state"],
        )
        for state, n in counts.items():
            g.add_metric([state], n)
        yield g
