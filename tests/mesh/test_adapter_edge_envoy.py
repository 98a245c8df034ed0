"""AdapterInstance edges through a real Envoy: a path route to the adapter, placement on
another shard, and every security rule (401 without or with a bad token, 403 without a
scope, 403 in plaintext for a TLS adapter, 403 for unnamed gRPC and WebSocket requests while
an adapter is guarded), each proven to leave the workers untouched.

Tokens are HS256 JWTs (tests/edge_tokens.py); Envoy verifies them with the JWKS given in
``BuildOptions.edge_auth``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TEST_OPTIONS
from edge_tokens import ISSUER, JWKS, OTHER_KEY, bearer, token
from mesh_support import LOOPBACK, free_port, wait_until

from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.edge import EdgeAuthOptions, EdgeTlsOptions
from adaptermesh.mesh.server import XdsServer
from adaptermesh.proto import assignment_pb2 as ap

ADAPTER = "credit-risk-v2"
SCOPES = ["risk:evaluate", "tenant-acme"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        server: Any = self.server
        if self.path != "/health":
            with server.lock:
                server.seen.append((self.path, self.headers.get("x-adapter-id"), body))
        out = json.dumps(
            {"backend": server.name, "path": self.path, "adapter": self.headers.get("x-adapter-id")}
        ).encode()
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(out), out)
        )

    do_GET = _answer
    do_POST = _answer


class Worker:
    """A worker stand-in that records every request it is sent (health checks aside)."""

    def __init__(self, name: str) -> None:
        self.httpd = ThreadingHTTPServer((LOOPBACK, 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.name = name  # type: ignore[attr-defined]
        self.httpd.seen = []  # type: ignore[attr-defined]
        self.httpd.lock = threading.Lock()  # type: ignore[attr-defined]
        self.port = int(self.httpd.server_address[1])
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def seen(self) -> list[tuple[str, str | None, bytes]]:
        with self.httpd.lock:  # type: ignore[attr-defined]
            return list(self.httpd.seen)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclasses.dataclass
class Edge:
    workers: dict[str, Worker]
    ports: dict[str, int]
    ca: Path

    def url(self, shard: str, path: str) -> str:
        return f"http://{LOOPBACK}:{self.ports[shard]}{path}"

    def total_seen(self) -> int:
        return sum(len(w.seen) for w in self.workers.values())


def edge_assignment(ports: dict[str, int], workers: dict[str, Worker]) -> ap.Assignment:
    shards = [
        ap.Shard(
            id=sid,
            index=i,
            weight=5_000,
            state=ap.SHARD_STATE_ACTIVE,
            service_address=LOOPBACK,
            service_port=ports[sid],
            endpoints=[
                ap.Endpoint(
                    address=LOOPBACK,
                    port=workers[sid].port,
                    weight=1,
                    adapters=[ADAPTER] if sid == "s1" else ["open-adapter"],
                )
            ],
        )
        for i, sid in enumerate(("s0", "s1"))
    ]
    return ap.Assignment(
        version=1,
        reason="test",
        shards=shards,
        adapters=[
            ap.AdapterEdge(
                name=ADAPTER,
                protocol="http-json",
                paths=["/v1/evaluate"],
                scopes=SCOPES,
                shards=["s1"],
            ),
            ap.AdapterEdge(name="tls-only", protocol="http-json", paths=["/v1/tls-only"], tls=True),
            ap.AdapterEdge(name="open-adapter", protocol="http-json", paths=["/v1/open"]),
            ap.AdapterEdge(
                name="elsewhere-only",
                paths=["/v1/elsewhere"],
                allowed_cidrs=["10.99.0.0/16", "192.0.2.0/24"],
            ),
            ap.AdapterEdge(
                name="loopback-only", paths=["/v1/loopback"], allowed_cidrs=["127.0.0.0/8"]
            ),
        ],
    )


def _self_signed(d: Path) -> tuple[Path, Path]:
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "edge.key",
            "-out",
            "edge.pem",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        cwd=d,
        check=True,
        capture_output=True,
    )
    return d / "edge.pem", d / "edge.key"


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    cert, key = _self_signed(tmp_path_factory.mktemp("edge-tls"))
    workers = {sid: Worker(sid) for sid in ("s0", "s1")}
    ports = {sid: free_port() for sid in ("s0", "s1")}
    options = dataclasses.replace(
        TEST_OPTIONS,
        edge_auth=EdgeAuthOptions(ISSUER, JWKS),
        grpc_port_offset=1,
        edge_tls=EdgeTlsOptions(str(cert), str(key)),
    )
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    cache.set_assignment("node-edge", edge_assignment(ports, workers))
    envoy = EnvoyProcess(build_bootstrap("node-edge", xds_port, initial_fetch_timeout_s=5.0))
    try:
        envoy.start(ready_timeout=20.0)
        state = Edge(workers, ports, cert)

        def routable() -> bool:
            try:
                return all(
                    httpx.get(state.url(s, "/health"), timeout=2).status_code == 200 for s in ports
                )
            except httpx.HTTPError:
                return False

        wait_until(routable, 15, what="both shards routable through Envoy", interval=0.1)
        yield state
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        for w in workers.values():
            w.close()


def _refused(edge: Edge, status: int, method: str, url: str, **kw: Any) -> httpx.Response:
    before = edge.total_seen()
    r = httpx.request(method, url, timeout=10, **kw)
    assert r.status_code == status, (r.status_code, r.text)
    assert edge.total_seen() == before, "a refused request reached a worker"
    return r


BODY = {"prompt": "score this applicant", "max_tokens": 4}


def test_the_path_reaches_the_adapter_on_its_placement_shard(edge: Edge) -> None:
    # Sent to s0's listener; the adapter is placed on s1 only, so s1's worker answers.
    before = len(edge.workers["s1"].seen)
    r = httpx.post(
        edge.url("s0", "/v1/evaluate"),
        json=BODY,
        headers=bearer(token(" ".join(SCOPES))),
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"backend": "s1", "path": "/v1/completions", "adapter": ADAPTER}
    path, adapter, body = edge.workers["s1"].seen[before]
    assert (path, adapter, json.loads(body)) == ("/v1/completions", ADAPTER, BODY)


def test_the_header_and_the_body_reach_the_placement_shard_too(edge: Edge) -> None:
    ok = bearer(token(f"other {SCOPES[1]} {SCOPES[0]}"))
    r = httpx.post(
        edge.url("s0", "/v1/completions"), json={**BODY, "model": ADAPTER}, headers=ok, timeout=10
    )
    assert r.json()["backend"] == "s1", r.text
    r = httpx.post(
        edge.url("s0", "/v1/completions"),
        json=BODY,
        headers={**ok, "x-adapter-id": ADAPTER},
        timeout=10,
    )
    assert r.json()["backend"] == "s1", r.text


def test_no_token_is_401_and_the_worker_sees_nothing(edge: Edge) -> None:
    for shard in ("s0", "s1"):
        _refused(edge, 401, "POST", edge.url(shard, "/v1/evaluate"), json=BODY)


@pytest.mark.parametrize("bad", ["signed-by-another-key", "expired", "other-issuer", "junk"])
def test_an_invalid_token_is_401(edge: Edge, bad: str) -> None:
    scope = " ".join(SCOPES)
    tok = {
        "signed-by-another-key": token(scope, key=OTHER_KEY),
        "expired": token(scope, exp_in=-120),
        "other-issuer": token(scope, iss="https://elsewhere.test"),
        "junk": "not.a.jwt",
    }[bad]
    _refused(edge, 401, "POST", edge.url("s1", "/v1/evaluate"), json=BODY, headers=bearer(tok))


def test_a_missing_scope_is_403(edge: Edge) -> None:
    for scope in (
        SCOPES[0],
        SCOPES[1],
        "",
        "risk:evaluat tenant-acme",
        "risk:evaluate-x tenant-acme",
    ):
        _refused(
            edge,
            403,
            "POST",
            edge.url("s1", "/v1/evaluate"),
            json=BODY,
            headers=bearer(token(scope)),
        )


def test_naming_the_adapter_by_header_or_body_is_checked_too(edge: Edge) -> None:
    url = edge.url("s1", "/v1/completions")
    _refused(edge, 401, "POST", url, json=BODY, headers={"x-adapter-id": ADAPTER})
    # The body decides over a header that names an open adapter.
    _refused(
        edge,
        401,
        "POST",
        url,
        json={**BODY, "model": ADAPTER},
        headers={"x-adapter-id": "open-adapter"},
    )
    _refused(
        edge, 403, "POST", url, json={**BODY, "model": ADAPTER}, headers=bearer(token(SCOPES[1]))
    )


def test_a_tls_adapter_refuses_plaintext(edge: Edge) -> None:
    r = _refused(edge, 403, "POST", edge.url("s0", "/v1/tls-only"), json=BODY)
    assert "requires TLS" in r.text


def test_unnamed_grpc_and_websocket_are_refused_while_an_adapter_is_guarded(edge: Edge) -> None:
    # Envoy answers a gRPC request's local 403 as gRPC: PERMISSION_DENIED (7).
    r = _refused(
        edge,
        200,
        "POST",
        edge.url("s0", "/inference.GRPCInferenceService/ModelInfer"),
        content=b"\x00\x00\x00\x00\x00",
        headers={"content-type": "application/grpc"},
    )
    assert r.headers["grpc-status"] == "7", r.headers
    _refused(edge, 403, "GET", edge.url("s0", "/v1/ws"))


def test_open_adapters_and_the_base_model_need_no_token(edge: Edge) -> None:
    r = httpx.post(edge.url("s0", "/v1/open"), json=BODY, timeout=10)
    assert r.json() == {"backend": "s0", "path": "/v1/completions", "adapter": "open-adapter"}
    r = httpx.post(edge.url("s0", "/v1/completions"), json=BODY, timeout=10)
    assert r.status_code == 200
    assert r.json()["backend"] == "s0"


def test_allowed_sources_are_checked(edge: Edge) -> None:
    r = _refused(edge, 403, "POST", edge.url("s0", "/v1/elsewhere"), json=BODY)
    assert "RBAC" in r.text
    r = httpx.post(edge.url("s0", "/v1/loopback"), json=BODY, timeout=10)
    assert r.json() == {"backend": "s0", "path": "/v1/completions", "adapter": "loopback-only"}


def test_a_tls_adapter_is_served_over_tls_on_the_same_port(edge: Edge) -> None:
    url = edge.url("s0", "/v1/tls-only").replace("http://", "https://")
    r = httpx.post(url, json=BODY, timeout=10, verify=str(edge.ca))
    assert r.status_code == 200, r.text
    assert r.json() == {"backend": "s0", "path": "/v1/completions", "adapter": "tls-only"}
    # TLS does not stand in for a token.
    url = edge.url("s1", "/v1/evaluate").replace("http://", "https://")
    _refused(edge, 401, "POST", url, json=BODY, verify=str(edge.ca))
    r = httpx.post(
        url, json=BODY, timeout=10, verify=str(edge.ca), headers=bearer(token(" ".join(SCOPES)))
    )
    assert r.json()["adapter"] == ADAPTER


def test_a_plaintext_http2_client_cannot_claim_https(edge: Edge) -> None:
    """h2c with prior knowledge lets a client write its own :scheme; the listener writes
    over it before routing."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    with socket.create_connection((LOOPBACK, edge.ports["s0"]), timeout=10) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        body = json.dumps(BODY).encode()
        conn.send_headers(
            1,
            [
                (":method", "POST"),
                (":scheme", "https"),
                (":authority", f"{LOOPBACK}:{edge.ports['s0']}"),
                (":path", "/v1/tls-only"),
                ("content-type", "application/json"),
                ("content-length", str(len(body))),
            ],
        )
        conn.send_data(1, body, end_stream=True)
        before = edge.total_seen()
        sock.sendall(conn.data_to_send())
        status = None
        while status is None:
            data = sock.recv(65536)
            assert data, "connection closed before the response"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"]
            sock.sendall(conn.data_to_send())
    assert status == b"403"
    assert edge.total_seen() == before


def test_a_body_of_another_content_type_cannot_name_a_guarded_adapter(edge: Edge) -> None:
    url = edge.url("s1", "/v1/completions")
    body = json.dumps({**BODY, "model": ADAPTER})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "APPLICATION/JSON",
        "application/json; charset=latin-1",
        "application/json;x=1",
        "application/jsonx",
    ):
        _refused(edge, 415, "POST", url, content=body, headers={"content-type": content_type})
    _refused(edge, 415, "POST", url, content=body)  # no content type at all
    # JSON with a charset is read, so the adapter's checks apply.
    for content_type in ("application/json; charset=utf-8", "application/json;charset=UTF-8"):
        _refused(edge, 401, "POST", url, content=body, headers={"content-type": content_type})
