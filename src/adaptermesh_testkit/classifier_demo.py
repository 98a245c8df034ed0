"""``adaptermesh demo classifier``: the datapath alone, in network namespaces.

It builds a node namespace with the classifier on its tenant-facing interface, a tenant namespace
with several tenant addresses and three shard namespaces (one steered by VXLAN tunnel, one by
mark + policy routing, one by redirect). Tenants send UDP and HTTP to the service address; the
demo applies a pin and a weight change and prints per-shard counts after each step. Everything
is torn down on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from collections import Counter
from types import FrameType
from typing import TYPE_CHECKING

from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.bpf.table import ShardStats
from adaptermesh.clisetup import DefaultsHelpFormatter
from adaptermesh_testkit.netns import (
    HttpServer,
    NodeTopology,
    UdpReceiver,
    delete_namespaces,
    http_get,
    inject,
    raw_udp_frames,
    send_udp,
    settle,
    udp_receivers,
)

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2 as pb
else:
    from adaptermesh.proto import assignment_pb2 as pb

__all__ = ["main"]

UDP_PORT, HTTP_PORT = 7000, 8080
TENANTS = [f"10.77.0.{11 + i}" for i in range(6)]


def _assignment(
    topo: NodeTopology, version: int, weights: tuple[int, int, int], pins: dict[str, str]
) -> pb.Assignment:
    a = pb.Assignment(version=version, reason="demo")
    for s, w in zip(topo.shards, weights, strict=True):
        sh = a.shards.add(
            id=f"shard-{s.index}",
            index=s.index,
            weight=w,
            state=pb.SHARD_STATE_ACTIVE,
            service_address=topo.vip,
            service_port=HTTP_PORT,
        )
        if s.index == 0:
            sh.steer.tunnel.remote_ipv4 = s.addr
            sh.steer.tunnel.vni = s.vni
            sh.steer.tunnel.inner_dst_mac = s.vxlan_mac
        elif s.index == 1:
            sh.steer.mark.mark = s.mark
        else:
            sh.steer.redirect.ifname = s.node_if
            sh.steer.redirect.dst_mac = s.mac
    for cidr, shard in pins.items():
        a.pins.add(cidr=cidr, shard_id=shard)
    return a


def _where(rx: list[UdpReceiver]) -> dict[str, int]:
    return {src: i for i, r in enumerate(rx) for src, _ in r.received}


def _print_counts(
    title: str, table: BpfShardTable, rx: list[UdpReceiver], before: dict[int, ShardStats]
) -> None:
    stats = table.read_stats()
    print(f"\n== {title}")
    print(f"{'shard':<8}{'steer':<10}{'packets':>9}{'new flows':>11}{'received':>10}")
    for i, mode in enumerate(("tunnel", "mark", "redirect")):
        b = before.get(i, ShardStats())
        s = stats.get(i, ShardStats())
        print(
            f"shard-{i:<2}{mode:<10}{s.packets - b.packets:>9}{s.new_flows - b.new_flows:>11}"
            f"{len(rx[i].received):>10}"
        )


def _round(
    topo: NodeTopology,
    table: BpfShardTable,
    rx: list[UdpReceiver],
    title: str,
    extra_sources: list[str],
) -> None:
    before = table.read_stats()
    for r in rx:
        r.received.clear()
    for src in TENANTS:
        send_udp(topo, src, UDP_PORT, [f"{src}:{k}".encode() for k in range(20)])
    if extra_sources:
        inject(topo, raw_udp_frames(topo, extra_sources, UDP_PORT))
    settle(rx, 20 * len(TENANTS) + len(extra_sources))
    where = _where(rx)
    http = {src: http_get(topo, src, HTTP_PORT) for src in TENANTS}
    _print_counts(title, table, rx, before)
    for src in TENANTS:
        status, body = http[src]
        print(f"  tenant {src:<12} UDP -> shard-{where.get(src, '?')}   HTTP {status} from {body}")
    if extra_sources:
        spread = Counter(where[s] for s in extra_sources if s in where)
        share = ", ".join(f"shard-{i}: {spread[i] / len(extra_sources):.0%}" for i in range(3))
        print(f"  {len(extra_sources)} other sources: {share}")


_MAIN_PID = os.getpid()


def _raise_interrupt(_sig: int, _frame: FrameType | None) -> None:
    if os.getpid() != _MAIN_PID:  # a forked helper inherited the handler
        os._exit(143)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="adaptermesh demo classifier",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--prefix", default="amdemo", help="namespace/device name prefix")
    ap.add_argument(
        "--pin-dir", default="/sys/fs/bpf/amdemo", help="bpffs directory for the demo's maps"
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("adaptermesh demo: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    delete_namespaces(f"{args.prefix}-")  # leftovers of an earlier run that was killed
    topo = NodeTopology(prefix=args.prefix, n_shards=3, tenant_addrs=TENANTS)
    table: BpfShardTable | None = None
    rx: list[UdpReceiver] = []
    servers: list[HttpServer] = []
    try:
        print(f"building namespaces {topo.node_ns}, {topo.tenant_ns}, {args.prefix}-s0..2")
        topo.create()
        print("compiling and attaching the classifier ...")
        table = BpfShardTable(
            topo.node_tenant_if, pin_dir=args.pin_dir, vxlan_dev=topo.vxlan_dev, netns=topo.node_ns
        )
        table.attach()
        table.clear_flows()
        rx = udp_receivers(topo, UDP_PORT)
        servers = [HttpServer(s.ns, topo.vip, HTTP_PORT, f"shard-{s.index}") for s in topo.shards]
        version = (table.applied_version or 0) + 1
        others = [str(ipaddress.IPv4Address("10.90.0.0") + k) for k in range(300)]
        table.apply(_assignment(topo, version, (4000, 3000, 3000), {}))
        _round(topo, table, rx, f"v{version}: weights 40/30/30, no pins", others)
        version += 1
        table.apply(
            _assignment(
                topo,
                version,
                (4000, 3000, 3000),
                {f"{TENANTS[-1]}/32": "shard-2", "10.77.0.12/31": "shard-1"},
            )
        )
        _round(
            topo,
            table,
            rx,
            f"v{version}: pin {TENANTS[-1]}/32 -> shard-2, 10.77.0.12/31 -> shard-1",
            [],
        )
        version += 1
        table.apply(
            _assignment(
                topo,
                version,
                (1000, 1000, 8000),
                {f"{TENANTS[-1]}/32": "shard-2", "10.77.0.12/31": "shard-1"},
            )
        )
        newer = [str(ipaddress.IPv4Address("10.91.0.0") + k) for k in range(300)]
        _round(
            topo,
            table,
            rx,
            f"v{version}: weights 10/10/80 (live flows stay, new flows follow)",
            newer,
        )
        reasons: Counter[str] = Counter()
        table.poll_events(lambda e: reasons.update([e.reason]), 0)
        c = table.read_counters()
        print(
            f"\nnew-flow events: {dict(reasons)}; lost events: {c.ringbuf_failed}; "
            f"passed untouched: non-IP {c.non_ip}, malformed {c.malformed}, "
            f"no shard {c.no_shard}"
        )
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        for srv in servers:
            srv.close()
        for r in rx:
            r.close()
        if table is not None:
            table.close(detach=True, unpin=True)
        topo.destroy()


if __name__ == "__main__":
    sys.exit(main())
