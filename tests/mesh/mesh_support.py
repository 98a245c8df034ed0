"""Helpers for the mesh tests: HTTP backends, an ADS test client, traffic, assignments."""

from __future__ import annotations

import collections
import http.client
import json
import queue
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from waiting import wait_until

from adaptermesh.mesh.bootstrap import EnvoyProcess
from adaptermesh.proto import assignment_pb2 as ap

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        name = self.server.backend_name  # type: ignore[attr-defined]
        if self.path == "/health":
            self.server.health_checks += 1  # type: ignore[attr-defined]
        else:
            self.server.requests += 1  # type: ignore[attr-defined]
        body = json.dumps({"backend": name, "adapter": self.headers.get("x-adapter-id")}).encode()
        # One write: headers and body in separate segments stall on Nagle + delayed ACK.
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )

    do_GET = _answer
    do_POST = _answer


class Backend:
    """A tiny HTTP/1.1 worker on 127.0.0.1 that names itself in every answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.httpd = ThreadingHTTPServer((LOOPBACK, 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.backend_name = name  # type: ignore[attr-defined]
        self.httpd.requests = 0  # type: ignore[attr-defined]
        self.httpd.health_checks = 0  # type: ignore[attr-defined]
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class EndpointSpec:
    backend: Backend
    weight: int = 1
    adapters: tuple[str, ...] = ()
    draining: bool = False


def shard(shard_id: str, port: int, endpoints: Iterable[EndpointSpec]) -> ap.Shard:
    return ap.Shard(
        id=shard_id,
        index=0,
        weight=10_000,
        state=ap.SHARD_STATE_ACTIVE,
        service_address=LOOPBACK,
        service_port=port,
        endpoints=[
            ap.Endpoint(
                address=LOOPBACK,
                port=e.backend.port,
                weight=e.weight,
                draining=e.draining,
                adapters=list(e.adapters),
            )
            for e in endpoints
        ],
    )


def assignment(version: int, *shards: ap.Shard) -> ap.Assignment:
    return ap.Assignment(version=version, shards=list(shards), reason="test")


@dataclass
class Traffic:
    """Results of requests through Envoy: backend name -> count, and every failure."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def send_requests(
    port: int,
    n: int,
    headers: dict[str, str] | None = None,
    traffic: Traffic | None = None,
    stop: threading.Event | None = None,
) -> Traffic:
    """``n`` POSTs (or until ``stop``) on one keep-alive connection; failures are recorded."""
    out = traffic or Traffic()
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    sent = 0
    try:
        while sent < n and not (stop is not None and stop.is_set()):
            sent += 1
            try:
                conn.request(
                    "POST",
                    "/v1/completions",
                    body=b'{"prompt":"x"}',
                    headers={"content-type": "application/json", **(headers or {})},
                )
                resp = conn.getresponse()
                body = resp.read()
                if resp.status != 200:
                    out.errors.append(f"HTTP {resp.status}: {body[:200]!r}")
                    continue
                out.counts[json.loads(body)["backend"]] += 1
                if resp.getheader("connection", "").lower() == "close":
                    conn.close()
                    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
            except (OSError, http.client.HTTPException) as exc:
                out.errors.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    finally:
        conn.close()
    return out


def healthy_hosts(envoy: EnvoyProcess, cluster: str) -> list[tuple[int, int]]:
    """(port, weight) of the cluster's hosts that Envoy currently considers healthy."""
    out = []
    for status in envoy.clusters().get("cluster_statuses", []):
        if status["name"] != cluster:
            continue
        for host in status.get("host_statuses", []):
            health = host.get("health_status", {})
            bad = [k for k, v in health.items() if k.startswith("failed") and v] or health.get(
                "eds_health_status"
            ) not in (None, "HEALTHY")
            if not bad:
                out.append(
                    (
                        int(host["address"]["socket_address"]["port_value"]),
                        int(host.get("weight", 1)),
                    )
                )
    return sorted(out)


class AdsClient:
    """A raw ADS stream for protocol tests; ``delta`` picks the incremental method."""

    def __init__(self, port: int, delta: bool = False, raw: bool = False) -> None:
        self.channel = grpc.insecure_channel(f"{LOOPBACK}:{port}")
        method = "/envoy.service.discovery.v3.AggregatedDiscoveryService/" + (
            "DeltaAggregatedResources" if delta else "StreamAggregatedResources"
        )
        response_type = (
            discovery_pb2.DeltaDiscoveryResponse if delta else discovery_pb2.DiscoveryResponse
        )
        if raw:
            call = self.channel.stream_stream(
                method,
                request_serializer=lambda b: b,
                response_deserializer=response_type.FromString,
            )
        else:
            call = self.channel.stream_stream(
                method,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_type.FromString,
            )
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses: queue.Queue[Any] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self._call = call(self._iter())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _iter(self) -> Iterator[Any]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
        except grpc.RpcError as exc:
            self.error = exc
        self._responses.put(None)

    def send(self, request: Any) -> None:
        self._requests.put(request)

    def recv(self, timeout: float = 5.0) -> Any:
        """The next response; None when the stream ended; raises on timeout."""
        try:
            return self._responses.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no xDS response within {timeout}s") from None

    def expect_silence(self, seconds: float) -> None:
        try:
            item = self._responses.get(timeout=seconds)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected response: {item}")

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self.channel.close()


def wait_routable(port: int, names: set[str], timeout: float = 10.0) -> None:
    """Wait until traffic reaches every backend in ``names``. Envoy keeps a new host out of
    load balancing until its first active health check passes, which /clusters does not
    show."""

    def reached() -> bool:
        return set(send_requests(port, 4 * len(names)).counts) >= names

    wait_until(reached, timeout, what=f"traffic to reach {sorted(names)}", interval=0.1)
