"""Real traffic in the test topology: UDP receivers, HTTP servers, senders."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from adaptermesh.bpf.netns import NodeTopology, UdpReceiver, inside, socket_in


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.shard_name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class HttpServer:
    def __init__(self, ns: str, addr: str, port: int, name: str) -> None:
        with inside(ns):
            self.srv = ThreadingHTTPServer((addr, port), _Handler)
        self.srv.shard_name = name  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def http_get(topo: NodeTopology, src: str, port: int, timeout: float = 3.0) -> tuple[int, str]:
    s = socket_in(topo.tenant_ns, socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.bind((src, 0))
        s.connect((topo.vip, port))
        s.sendall(b"GET / HTTP/1.0\r\nHost: vip\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def send_udp(topo: NodeTopology, src: str, port: int, payloads: list[bytes]) -> None:
    s = socket_in(topo.tenant_ns)
    try:
        s.bind((src, 0))
        for p in payloads:
            s.sendto(p, (topo.vip, port))
    finally:
        s.close()


def raw_udp_frames(topo: NodeTopology, sources: list[str], port: int) -> list[bytes]:
    """Frames from arbitrary source addresses (the node routes them; nothing replies)."""
    return [
        bytes(Ether(dst=topo.node_tenant_mac) / IP(src=s, dst=topo.vip, ttl=16)
              / UDP(sport=40000, dport=port) / s.encode())
        for s in sources
    ]


def inject(topo: NodeTopology, frames: list[bytes], pace_every: int = 200) -> None:
    sock = socket_in(topo.tenant_ns, socket.AF_PACKET, socket.SOCK_RAW)
    try:
        sock.bind((topo.tenant_if, 0))
        for i, f in enumerate(frames):
            sock.send(f)
            if pace_every and i % pace_every == pace_every - 1:
                time.sleep(0.002)  # let the softirq drain the backlog
    finally:
        sock.close()


def receivers(topo: NodeTopology, port: int) -> list[UdpReceiver]:
    return [UdpReceiver(s.ns, topo.vip, port) for s in topo.shards]


def settle(rx: list[UdpReceiver], want: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while sum(len(r.received) for r in rx) < want and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.1)  # anything extra (misrouted duplicates) shows up too
