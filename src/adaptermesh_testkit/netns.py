"""Network-namespace topologies for the classifier's tests and the demo.

:class:`NodeTopology` builds one "node" namespace with the classifier's interface, a tenant
namespace holding several tenant addresses, and one namespace per shard::

    tenant ns  eth <-veth-> <p>tn  node ns  <p>s<i> <-veth-> eth  shard i ns
    10.77.0.11..                   (classifier on <p>tn ingress)        VIP on lo
                                   <p>vx: collect-metadata VXLAN        <p>vx<i>: VXLAN, VNI 100+i

Every shard can be reached by all three steering modes: ``mark`` (policy routing: fwmark
0x100+i -> table 100+i -> VIP via shard i), ``redirect`` (to ``<p>s<i>`` with the shard's MAC)
and ``tunnel`` (VXLAN to the shard's underlay address, VNI 100+i). The node's main table has
no route to the VIP, so a packet that is not steered never reaches any shard.

Helpers run code inside a namespace per thread (:func:`adaptermesh.bpf.namespace.inside`:
setns affects only the calling thread), so sockets made inside keep working from any thread.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from adaptermesh.bpf.namespace import CLONE_NEWNET, inside

__all__ = [
    "CLONE_NEWNET",
    "HttpServer",
    "NodeTopology",
    "ShardNs",
    "UdpReceiver",
    "delete_namespaces",
    "http_get",
    "inject",
    "inside",
    "ip",
    "raw_udp_frames",
    "send_udp",
    "settle",
    "socket_in",
    "udp_receivers",
]


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


def sysctl(ns: str, key: str, value: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True)


def socket_in(
    ns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_DGRAM, proto: int = 0
) -> socket.socket:
    with inside(ns):
        return socket.socket(family, kind, proto)


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def delete_namespaces(prefix: str) -> None:
    """Delete every namespace whose name starts with ``prefix`` (leftovers of a crash)."""
    for name in list_namespaces():
        if name.startswith(prefix):
            subprocess.run(["ip", "netns", "del", name], check=False)


@dataclass
class ShardNs:
    index: int
    ns: str
    node_if: str  # veth end in the node namespace
    node_addr: str  # node's underlay address towards this shard
    addr: str  # shard's underlay address
    mac: str  # MAC of the shard's veth end
    vxlan_if: str
    vxlan_mac: str
    vni: int
    mark: int
    table: int


@dataclass
class NodeTopology:
    """Build with :meth:`create`, tear down with :meth:`destroy` (or use it as a context)."""

    prefix: str
    n_shards: int = 3
    tenant_addrs: list[str] = field(
        default_factory=lambda: ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    )
    vip: str = "10.79.0.10"
    node_ns: str = ""
    tenant_ns: str = ""
    tenant_if: str = ""
    node_tenant_if: str = ""
    node_tenant_mac: str = ""
    vxlan_dev: str = ""
    shards: list[ShardNs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.prefix) > 8:
            raise ValueError("prefix: at most 8 characters (interface names hold 15)")
        p = self.prefix
        self.node_ns, self.tenant_ns = f"{p}-node", f"{p}-tenant"
        self.tenant_if, self.node_tenant_if, self.vxlan_dev = f"{p}te", f"{p}tn", f"{p}vx"

    def __enter__(self) -> NodeTopology:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> None:
        p, node, tenant = self.prefix, self.node_ns, self.tenant_ns
        for ns in (node, tenant):
            ip("netns", "add", ns)
            ip("link", "set", "lo", "up", ns=ns)
        for key in (
            "net.ipv4.ip_forward",
            "net.ipv4.conf.all.rp_filter",
            "net.ipv4.conf.default.rp_filter",
        ):
            sysctl(node, key, "1" if key.endswith("forward") else "0")
        # IPv4 only: no neighbour discovery chatter in the counters.
        for ns in (node, tenant):
            sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
            sysctl(ns, "net.ipv6.conf.default.disable_ipv6", "1")
        # tenant <-> node
        ip(
            "link",
            "add",
            self.node_tenant_if,
            "type",
            "veth",
            "peer",
            "name",
            self.tenant_if,
            "netns",
            tenant,
            ns=node,
        )
        ip("addr", "add", "10.77.0.1/24", "dev", self.node_tenant_if, ns=node)
        ip("link", "set", self.node_tenant_if, "up", ns=node)
        for i, a in enumerate(self.tenant_addrs):
            ip("addr", "add", f"{a}/{24 if i == 0 else 32}", "dev", self.tenant_if, ns=tenant)
        ip("link", "set", self.tenant_if, "up", ns=tenant)
        ip("route", "add", "default", "via", "10.77.0.1", "src", self.tenant_addrs[0], ns=tenant)
        self.node_tenant_mac = _mac_of(node, self.node_tenant_if)
        # the node's collect-metadata VXLAN device (tunnel steering)
        ip("link", "add", self.vxlan_dev, "type", "vxlan", "external", "dstport", "4789", ns=node)
        ip("link", "set", self.vxlan_dev, "up", ns=node)
        for i in range(self.n_shards):
            self.shards.append(self._create_shard(i, p))

    def _create_shard(self, i: int, p: str) -> ShardNs:
        node = self.node_ns
        ns = f"{p}-s{i}"
        node_if, shard_if, vx = f"{p}s{i}", f"{p}e{i}", f"{p}vx{i}"
        node_addr, addr = f"10.78.{i}.1", f"10.78.{i}.2"
        vni, mark, table = 100 + i, 0x100 + i, 100 + i
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", ns=ns)
        for key in ("net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
            sysctl(ns, key, "0")
        ip("link", "add", node_if, "type", "veth", "peer", "name", shard_if, "netns", ns, ns=node)
        ip("addr", "add", f"{node_addr}/24", "dev", node_if, ns=node)
        ip("link", "set", node_if, "up", ns=node)
        ip("addr", "add", f"{addr}/24", "dev", shard_if, ns=ns)
        ip("link", "set", shard_if, "up", ns=ns)
        ip("addr", "add", f"{self.vip}/32", "dev", "lo", ns=ns)
        ip("route", "add", "default", "via", node_addr, ns=ns)
        vx_mac = f"02:a1:00:00:00:{i + 1:02x}"
        ip(
            "link",
            "add",
            vx,
            "address",
            vx_mac,
            "type",
            "vxlan",
            "id",
            str(vni),
            "local",
            addr,
            "dstport",
            "4789",
            "nolearning",
            ns=ns,
        )
        ip("link", "set", vx, "up", ns=ns)
        for dev in (shard_if, vx):
            sysctl(ns, f"net.ipv4.conf.{dev}.rp_filter", "0")
        # mark steering: fwmark -> per-shard table -> the VIP through this shard
        ip("rule", "add", "fwmark", hex(mark), "lookup", str(table), ns=node)
        ip("route", "add", f"{self.vip}/32", "via", addr, "table", str(table), ns=node)
        return ShardNs(
            index=i,
            ns=ns,
            node_if=node_if,
            node_addr=node_addr,
            addr=addr,
            mac=_mac_of(ns, shard_if),
            vxlan_if=vx,
            vxlan_mac=vx_mac,
            vni=vni,
            mark=mark,
            table=table,
        )

    def destroy(self) -> None:
        for s in self.shards:
            ip("netns", "del", s.ns, check=False)
        ip("netns", "del", self.tenant_ns, check=False)
        ip("netns", "del", self.node_ns, check=False)
        delete_namespaces(f"{self.prefix}-")
        self.shards = []


def _mac_of(ns: str, dev: str) -> str:
    for line in ip("-o", "link", "show", dev, ns=ns).split("\\"):
        parts = line.split()
        if "link/ether" in parts:
            return parts[parts.index("link/ether") + 1]
    raise RuntimeError(f"no MAC on {ns}/{dev}")


class UdpReceiver:
    """Counts UDP datagrams that reach ``addr:port`` inside namespace ``ns``."""

    def __init__(self, ns: str, addr: str, port: int) -> None:
        self.sock = socket_in(ns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((addr, port))
        self.sock.settimeout(0.2)
        self.received: list[tuple[str, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, (src, _port) = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            self.received.append((src, data))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


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
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    return [
        bytes(
            Ether(dst=topo.node_tenant_mac)
            / IP(src=s, dst=topo.vip, ttl=16)
            / UDP(sport=40000, dport=port)
            / s.encode()
        )
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


def udp_receivers(topo: NodeTopology, port: int) -> list[UdpReceiver]:
    return [UdpReceiver(s.ns, topo.vip, port) for s in topo.shards]


def settle(rx: list[UdpReceiver], want: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while sum(len(r.received) for r in rx) < want and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.1)  # anything extra (misrouted duplicates) shows up too
