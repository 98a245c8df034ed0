"""TCP connections keep their shard (am_conns): a pin, a weight change or a drain moves a
source's new connections and its UDP, never a connection in flight; an opening SYN decides
afresh; a connection whose shard left the assignment goes where its source goes now. Through
BPF_PROG_TEST_RUN, beside a model of the decision that property tests replay."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from adaptermesh.bpf import libbpf
from adaptermesh.bpf.loader import BpfShardTable

from .helpers import S, make_assignment
from .test_prog_run import events, expected_maglev, shard_of

pytestmark = pytest.mark.root

MARKS = {0: 0x100, 1: 0x101, 2: 0x102}
VIP4, VIP6 = "10.79.0.10", "fd00:79::10"


def _shards(
    weights: tuple[int, int, int] = (5000, 3000, 2000),
    draining: tuple[int, ...] = (),
    absent: tuple[int, ...] = (),
) -> list[S]:
    """Shards 0-2 steered by mark; the ACTIVE ones share the weight budget in the proportions
    of ``weights``."""
    active = [i for i in range(3) if i not in draining and i not in absent]
    total = sum(weights[i] for i in active)
    share = {i: weights[i] * 10_000 // total for i in active}
    if active:
        share[active[0]] += 10_000 - sum(share.values())
    return [
        S(f"shard-{i}", i, share.get(i, 0), ("mark", MARKS[i]), i in draining)
        for i in range(3)
        if i not in absent
    ]


def tcp(src: str, sport: int, flags: str = "A", dport: int = 8080) -> bytes:
    ip = IPv6(src=src, dst=VIP6) if ":" in src else IP(src=src, dst=VIP4)
    return bytes(
        Ether(dst="02:00:00:00:00:01", src="02:00:00:00:00:02")
        / ip
        / TCP(sport=sport, dport=dport, flags=flags)
        / b"x"
    )


def udp(src: str) -> bytes:
    ip = IPv6(src=src, dst=VIP6) if ":" in src else IP(src=src, dst=VIP4)
    return bytes(Ether(dst="02:00:00:00:00:01") / ip / UDP(sport=4000, dport=5000) / b"x")


def run(table: BpfShardTable, frame: bytes) -> int | None:
    return shard_of(libbpf.prog_test_run(table.prog_fd, frame))


def _source_not_on(table: BpfShardTable, prefix: str, shard: int) -> str:
    return next(
        f"{prefix}.{k}" for k in range(1, 250) if expected_maglev(table, f"{prefix}.{k}") != shard
    )


def test_a_pin_moves_new_connections_not_open_ones(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = _source_not_on(fresh, "10.90.0", 1)
    before = run(fresh, tcp(src, 40001, "S"))
    assert before == expected_maglev(fresh, src) != 1
    assert run(fresh, tcp(src, 40001, "A")) == before
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-1"}))
    # The open connection stays (its data, its FIN, the last ACK), the source's new ones and
    # its UDP take the pin.
    for flags in ("A", "PA", "FA", "A"):
        assert run(fresh, tcp(src, 40001, flags)) == before
    assert run(fresh, tcp(src, 40002, "S")) == 1
    assert run(fresh, tcp(src, 40002, "A")) == 1
    assert run(fresh, udp(src)) == 1
    assert run(fresh, tcp(src, 40001, "A")) == before  # still, after the source moved


def test_a_drain_keeps_open_connections_until_they_end(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = next(f"10.91.0.{k}" for k in range(1, 250) if expected_maglev(fresh, f"10.91.0.{k}") == 1)
    assert run(fresh, tcp(src, 41001, "S")) == 1
    fresh.apply(make_assignment(_shards(draining=(1,))))
    assert run(fresh, tcp(src, 41001, "PA")) == 1  # in flight on the draining shard
    fresh_conn = run(fresh, tcp(src, 41002, "S"))
    assert fresh_conn == expected_maglev(fresh, src) != 1  # nothing new goes there
    assert run(fresh, udp(src)) == fresh_conn
    assert run(fresh, tcp(src, 41001, "A")) == 1


def test_a_connection_whose_shard_left_goes_where_its_source_goes(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = next(f"10.92.0.{k}" for k in range(1, 250) if expected_maglev(fresh, f"10.92.0.{k}") == 2)
    assert run(fresh, tcp(src, 42001, "S")) == 2
    fresh.apply(make_assignment(_shards(absent=(2,))))
    moved = run(fresh, tcp(src, 42001, "A"))
    assert moved == expected_maglev(fresh, src) != 2
    fresh.apply(make_assignment(_shards()))  # shard 2 back: the connection stays where it went
    assert run(fresh, tcp(src, 42001, "A")) == moved


def test_an_opening_syn_decides_afresh(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = _source_not_on(fresh, "10.93.0", 0)
    first = run(fresh, tcp(src, 43001, "S"))
    assert first != 0
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-0"}))
    assert run(fresh, tcp(src, 43001, "A")) == first
    # The same ports opened again (a reused port): the new connection follows the pin.
    assert run(fresh, tcp(src, 43001, "S")) == 0
    assert run(fresh, tcp(src, 43001, "A")) == 0
    # A SYN-ACK is not an opening SYN (a simultaneous open's second half).
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-2"}))
    assert run(fresh, tcp(src, 43001, "SA")) == 0


def test_a_connection_first_seen_mid_stream_is_kept_from_then(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = _source_not_on(fresh, "10.94.0", 1)
    first = run(fresh, tcp(src, 44001, "PA"))  # began before the classifier knew it
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-1"}))
    assert run(fresh, tcp(src, 44001, "A")) == first != 1


def test_ipv6_connections_are_kept_alike(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = next(
        f"fd00:95::{k:x}" for k in range(1, 500) if expected_maglev(fresh, f"fd00:95::{k:x}") != 2
    )
    first = run(fresh, tcp(src, 45001, "S"))
    fresh.apply(make_assignment(_shards(), pins={f"{src}/128": "shard-2"}))
    assert run(fresh, tcp(src, 45001, "A")) == first != 2
    assert run(fresh, tcp(src, 45002, "S")) == 2


def test_kept_connections_count_as_packets_not_new_flows(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = _source_not_on(fresh, "10.96.0", 1)
    first = run(fresh, tcp(src, 46001, "S"))
    assert first is not None
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-1"}))
    events(fresh)
    stats = fresh.read_stats()
    for _ in range(5):
        run(fresh, tcp(src, 46001, "A"))
    after = fresh.read_stats()
    assert after[first].packets - stats[first].packets == 5
    assert after[first].new_flows == stats[first].new_flows
    assert events(fresh) == []


def test_later_fragments_classify_by_source(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards()))
    src = _source_not_on(fresh, "10.97.0", 1)
    first = run(fresh, tcp(src, 47001, "S"))
    fresh.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-1"}))
    payload = b"\x00" * 40
    frag = bytes(
        Ether(dst="02:00:00:00:00:01") / IP(src=src, dst=VIP4, proto=6, frag=100) / payload
    )
    assert run(fresh, frag) == 1  # no ports: the source's pin
    assert run(fresh, tcp(src, 47001, "A")) == first


# ---- a model of the decision, replayed against the datapath ------------------------------------


@dataclass
class Model:
    """The classifier's decision in Python: pins, shard states, sticky flows, connections."""

    pins: dict[str, int] = field(default_factory=dict)  # source -> shard
    state: dict[int, str] = field(default_factory=dict)  # shard -> active / draining
    flows: dict[str, int] = field(default_factory=dict)  # source -> sticky shard
    conns: dict[tuple[str, int], int] = field(default_factory=dict)  # (source, port) -> shard

    def active(self, shard: int | None) -> bool:
        return shard is not None and self.state.get(shard) == "active"

    def decide(self, table: BpfShardTable, src: str, port: int | None, flags: str) -> int:
        opening = "S" in flags and "A" not in flags
        if port is not None and not opening and (src, port) in self.conns:
            kept = self.conns[(src, port)]
            if kept in self.state:  # active or draining
                return kept
        pin = self.pins.get(src)
        flow = self.flows.get(src)
        if self.active(pin):
            shard = pin
        elif self.active(flow):
            shard = flow
        else:
            shard = expected_maglev(table, src)
        assert shard is not None
        self.flows[src] = shard
        if port is not None:
            self.conns[(src, port)] = shard
        return shard


SOURCES = ("10.98.0.1", "10.98.0.2", "10.98.0.3")
PORTS = (50001, 50002)

apply_op = st.tuples(
    st.just("apply"),
    st.dictionaries(st.sampled_from(SOURCES), st.sampled_from((0, 1, 2)), max_size=2),
    st.sampled_from(((), (0,), (1,), (2,))),  # draining
    st.sampled_from(((), (1,), (2,))),  # absent
)
send_op = st.tuples(
    st.just("send"),
    st.sampled_from(SOURCES),
    st.sampled_from((*PORTS, None)),  # None: UDP
    st.sampled_from(("S", "A", "PA", "FA", "SA")),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(st.one_of(apply_op, send_op), min_size=1, max_size=25))
def test_the_datapath_follows_the_model(
    table: BpfShardTable, ops: list[tuple[object, ...]]
) -> None:
    table.clear_flows()
    model = Model()
    initial = make_assignment(_shards())
    table.apply(initial)
    model.state = {0: "active", 1: "active", 2: "active"}
    for op in ops:
        if op[0] == "apply":
            _, pins, draining, absent = op
            assert isinstance(pins, dict)
            assert isinstance(draining, tuple)
            assert isinstance(absent, tuple)
            draining = tuple(i for i in draining if i not in absent)
            if len(set(draining) | set(absent)) == 3:
                continue  # no active shard left: not a case for this model
            pins = {s: i for s, i in pins.items() if i not in absent}
            table.apply(
                make_assignment(
                    _shards(draining=draining, absent=absent),
                    pins={f"{s}/32": f"shard-{i}" for s, i in pins.items()},
                )
            )
            model.pins = dict(pins)
            model.state = {
                i: "draining" if i in draining else "active" for i in range(3) if i not in absent
            }
            continue
        _, src, port, flags = op
        assert isinstance(src, str)
        assert isinstance(flags, str)
        if port is None:
            frame, want = udp(src), model.decide(table, src, None, flags)
        else:
            assert isinstance(port, int)
            frame, want = tcp(src, port, flags), model.decide(table, src, port, flags)
        got = run(table, frame)
        assert got == want, (op, model)


def test_the_stateless_build_keeps_no_connection() -> None:
    """The stateless variant (``learn=False``, the bench's Maglev-only build) writes no map:
    a TCP segment follows its source's pin like any packet."""
    pin_dir = f"/sys/fs/bpf/amb-stateless-{secrets.token_hex(4)}"
    table = BpfShardTable("lo", pin_dir=pin_dir, learn=False)
    try:
        table.apply(make_assignment(_shards()))
        src = _source_not_on(table, "10.99.0", 1)
        assert run(table, tcp(src, 48001, "S")) == expected_maglev(table, src)
        table.apply(make_assignment(_shards(), pins={f"{src}/32": "shard-1"}))
        assert run(table, tcp(src, 48001, "A")) == 1
    finally:
        table.close(detach=False, unpin=True)
