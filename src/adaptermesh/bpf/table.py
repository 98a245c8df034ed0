"""The ShardTable Protocol between agent logic and the classifier's maps, the validation that
runs before any map is touched, and a pure-Python fake with the same behaviour.

Agent code depends only on :class:`ShardTable`::

    table.apply(assignment)            # validate, then write shards, pins, Maglev table, flip
    table.read_stats()                 # {shard index: ShardStats}
    table.read_counters()              # DatapathCounters (lost events, malformed, ...)
    table.poll_events(callback, 100)   # FlowEvent per new flow; returns how many were delivered

:class:`adaptermesh.bpf.loader.BpfShardTable` is the kernel implementation;
:class:`FakeShardTable` runs the same validation and the same decision order in Python, so
agent logic can be tested without root.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from adaptermesh.bpf import maglev

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
else:
    from adaptermesh.proto import assignment_pb2

__all__ = [
    "AM_MAX_PINS",
    "AM_MAX_SHARDS",
    "REASON_NAMES",
    "WEIGHT_BUDGET",
    "AssignmentError",
    "DatapathCounters",
    "FakeShardTable",
    "FlowEvent",
    "Plan",
    "ShardPlan",
    "ShardStats",
    "ShardTable",
    "SteerPlan",
    "addr16",
    "lpm_key",
    "validate_assignment",
]

WEIGHT_BUDGET = 10_000
# Must stay in sync with the defaults in classifier.h.
AM_MAX_SHARDS = 256
AM_MAX_PINS = 16384
# struct am_shard.state / .kind / .flags and struct am_event.reason (classifier.h).
STATE_ABSENT, STATE_ACTIVE, STATE_DRAINING = 0, 1, 2
STEER_NONE, STEER_TUNNEL, STEER_REDIRECT, STEER_MARK = 0, 1, 2, 3
F_SET_MAC, F_INGRESS = 0x1, 0x2
REASON_PIN, REASON_MAGLEV, REASON_REPICK = 1, 2, 3
REASON_NAMES = {REASON_PIN: "pin", REASON_MAGLEV: "maglev", REASON_REPICK: "repick"}

_MAC_RE = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class AssignmentError(ValueError):
    """An Assignment was rejected; ``field`` names the offending field (``shards[2].weight``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class ShardStats:
    """Summed over CPUs. Must stay in sync with struct am_stats."""

    packets: int = 0
    bytes: int = 0
    new_flows: int = 0
    # Ring-buffer reservations that failed for this shard's new flows (lost events).
    events_dropped: int = 0


@dataclass(frozen=True, slots=True)
class DatapathCounters:
    """Summed over CPUs. Must stay in sync with the AM_CNT_* indices."""

    ringbuf_failed: int = 0
    non_ip: int = 0
    malformed: int = 0
    vlan: int = 0
    no_shard: int = 0
    steer_failed: int = 0
    link_local: int = 0


@dataclass(frozen=True, slots=True)
class FlowEvent:
    """One new flow. Mirrors struct am_event."""

    ts_ns: int
    source: ipaddress.IPv4Address | ipaddress.IPv6Address
    shard: int
    reason: str
    version: int


@dataclass(frozen=True, slots=True)
class SteerPlan:
    """A validated steering target. Mirrors struct am_shard without state."""

    kind: int = STEER_NONE
    ifindex: int = 0
    remote_ipv4: int = 0  # host byte order
    vni: int = 0
    mark: int = 0
    mac: bytes | None = None
    ingress: bool = False


@dataclass(frozen=True, slots=True)
class ShardPlan:
    index: int
    id: str
    state: int
    weight: int
    steer: SteerPlan


@dataclass(frozen=True, slots=True)
class Plan:
    """An Assignment after validation, in the shape the maps take."""

    version: int
    shards: dict[int, ShardPlan]
    # (prefixlen in the 128-bit space, 16-byte address) -> shard index. Validation hands out
    # the same dict for the same pins (see _validate_pins), so nobody may mutate it; the loader
    # skips its pin diff when it sees the dict it applied last.
    pins: dict[tuple[int, bytes], int]
    backends: list[maglev.Backend] = field(default_factory=list)


@runtime_checkable
class ShardTable(Protocol):
    def apply(self, assignment: assignment_pb2.Assignment) -> None: ...

    def read_stats(self) -> dict[int, ShardStats]: ...

    def read_counters(self) -> DatapathCounters: ...

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int: ...

    @property
    def applied_version(self) -> int | None: ...


def addr16(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """The classifier's 16-byte form of an address (IPv4 as ``::ffff:a.b.c.d``)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return b"\x00" * 10 + b"\xff\xff" + ip.packed
    return ip.packed


def lpm_key(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> tuple[int, bytes]:
    if isinstance(net, ipaddress.IPv4Network):
        return 96 + net.prefixlen, addr16(net.network_address)
    return net.prefixlen, addr16(net.network_address)


@functools.lru_cache(maxsize=1 << 17)
def _pin_key(cidr: str) -> tuple[int, bytes]:
    # Pins change rarely between assignments; parsing 10,000 of them every 5 s would
    # dominate apply() (about 10 ms), so parsed keys are remembered.
    return lpm_key(ipaddress.ip_network(cidr, strict=True))


def _mac(text: str, name: str) -> bytes | None:
    if not text:
        return None
    if not _MAC_RE.match(text):
        raise AssignmentError(name, f"invalid MAC address {text!r}")
    return bytes(int(p, 16) for p in text.split(":"))


def _steer(
    shard: assignment_pb2.Shard,
    name: str,
    resolve_ifname: Callable[[str], int | None],
    vxlan_ifindex: int | None,
) -> SteerPlan:
    which = shard.steer.WhichOneof("target") if shard.HasField("steer") else None
    if which is None:
        return SteerPlan()
    if which == "tunnel":
        t = shard.steer.tunnel
        try:
            remote = ipaddress.IPv4Address(t.remote_ipv4)
        except ValueError as e:
            raise AssignmentError(f"{name}.steer.tunnel.remote_ipv4", str(e)) from None
        if not 0 < t.vni < 1 << 24:
            raise AssignmentError(f"{name}.steer.tunnel.vni", f"{t.vni} is not in 1..16777215")
        if vxlan_ifindex is None:
            raise AssignmentError(
                f"{name}.steer.tunnel", "this node has no collect-metadata VXLAN device"
            )
        mac = _mac(t.inner_dst_mac, f"{name}.steer.tunnel.inner_dst_mac")
        return SteerPlan(kind=STEER_TUNNEL, ifindex=vxlan_ifindex, remote_ipv4=int(remote),
                         vni=t.vni, mac=mac)
    if which == "redirect":
        r = shard.steer.redirect
        ifindex = r.ifindex
        if ifindex == 0:
            if not r.ifname:
                raise AssignmentError(f"{name}.steer.redirect", "needs ifname or ifindex")
            found = resolve_ifname(r.ifname)
            if found is None:
                raise AssignmentError(
                    f"{name}.steer.redirect.ifname", f"no interface {r.ifname!r} on this node"
                )
            ifindex = found
        mac = _mac(r.dst_mac, f"{name}.steer.redirect.dst_mac")
        return SteerPlan(kind=STEER_REDIRECT, ifindex=ifindex, mac=mac, ingress=r.ingress)
    m = shard.steer.mark.mark
    if m == 0:
        raise AssignmentError(f"{name}.steer.mark.mark", "must be non-zero")
    return SteerPlan(kind=STEER_MARK, mark=m)


def validate_assignment(
    a: assignment_pb2.Assignment,
    *,
    max_shards: int = AM_MAX_SHARDS,
    max_pins: int = AM_MAX_PINS,
    applied_version: int | None = None,
    resolve_ifname: Callable[[str], int | None] = lambda _name: None,
    vxlan_ifindex: int | None = None,
) -> Plan:
    """Check everything an Assignment says before any map is touched.

    Raises :class:`AssignmentError` naming the first bad field. An Assignment may repeat the
    applied version (an agent re-applies after a restart) but never go back.
    """
    if applied_version is not None and a.version < applied_version:
        raise AssignmentError(
            "version", f"{a.version} is older than the applied version {applied_version}"
        )
    if len(a.shards) > max_shards:
        raise AssignmentError(
            "shards", f"{len(a.shards)} shards, but the maps hold at most {max_shards}"
        )
    shards: dict[int, ShardPlan] = {}
    by_id: dict[str, ShardPlan] = {}
    where: dict[int, int] = {}
    for i, s in enumerate(a.shards):
        name = f"shards[{i}]"
        if not s.id:
            raise AssignmentError(f"{name}.id", "must not be empty")
        if s.id in by_id:
            raise AssignmentError(f"{name}.id", f"duplicate id {s.id!r}")
        if s.index >= max_shards:
            raise AssignmentError(
                f"{name}.index", f"{s.index} is out of range 0..{max_shards - 1}"
            )
        if s.index in where:
            raise AssignmentError(
                f"{name}.index", f"duplicate index {s.index} (also shards[{where[s.index]}])"
            )
        if s.state == assignment_pb2.SHARD_STATE_ACTIVE:
            state = STATE_ACTIVE
        elif s.state == assignment_pb2.SHARD_STATE_DRAINING:
            state = STATE_DRAINING
        else:
            raise AssignmentError(f"{name}.state", "must be ACTIVE or DRAINING")
        if s.weight > WEIGHT_BUDGET:
            raise AssignmentError(f"{name}.weight", f"{s.weight} exceeds {WEIGHT_BUDGET}")
        steer = _steer(s, name, resolve_ifname, vxlan_ifindex)
        plan = ShardPlan(index=s.index, id=s.id, state=state, weight=s.weight, steer=steer)
        shards[s.index] = plan
        by_id[s.id] = plan
        where[s.index] = i
    active = [p for p in shards.values() if p.state == STATE_ACTIVE]
    total = sum(p.weight for p in active)
    if active and total != WEIGHT_BUDGET:
        raise AssignmentError(
            "shards.weight", f"ACTIVE shard weights sum to {total}, want {WEIGHT_BUDGET}"
        )
    if len(a.pins) > max_pins:
        raise AssignmentError("pins", f"{len(a.pins)} pins, but am_pins holds at most {max_pins}")
    pins = _validate_pins(a, {sid: p.index for sid, p in by_id.items()})
    for i, o in enumerate(a.overrides):
        if o.shard_id not in by_id:
            raise AssignmentError(f"overrides[{i}].shard_id", f"unknown shard {o.shard_id!r}")
    backends = [maglev.Backend(key=p.id, value=p.index, weight=p.weight) for p in active
                if p.weight > 0]
    return Plan(version=a.version, shards=shards, pins=pins, backends=backends)


# One remembered result: consecutive assignments almost always carry the same pins, and
# walking 10,000 of them in Python (about 10 ms) costs more than the whole rest of apply().
# The key is the pins' wire bytes plus the shard id -> index map; a hit returns the very dict
# of the last parse, so callers can tell "unchanged" by identity.
_pins_memo: tuple[bytes, tuple[tuple[str, int], ...], dict[tuple[int, bytes], int]] | None = None


def _pins_blob(a: assignment_pb2.Assignment) -> bytes:
    only_pins = assignment_pb2.Assignment()
    only_pins.CopyFrom(a)  # one C-level copy; building from a.pins walks it in Python
    for name in ("version", "shards", "overrides", "generated_at", "reason"):
        only_pins.ClearField(name)
    return only_pins.SerializeToString(deterministic=True)


def _validate_pins(a: assignment_pb2.Assignment, index_of: dict[str, int]
                   ) -> dict[tuple[int, bytes], int]:
    global _pins_memo
    if not a.pins:
        return {}
    blob = _pins_blob(a)
    ids = tuple(sorted(index_of.items()))
    memo = _pins_memo
    if memo is not None and memo[0] == blob and memo[1] == ids:
        return memo[2]
    pins: dict[tuple[int, bytes], int] = {}
    for i, pin in enumerate(a.pins):
        try:
            key = _pin_key(pin.cidr)
        except ValueError as e:
            raise AssignmentError(f"pins[{i}].cidr", f"invalid CIDR {pin.cidr!r}: {e}") from None
        target = index_of.get(pin.shard_id)
        if target is None:
            raise AssignmentError(f"pins[{i}].shard_id", f"unknown shard {pin.shard_id!r}")
        if key in pins:
            raise AssignmentError(f"pins[{i}].cidr", f"duplicate pin {pin.cidr}")
        pins[key] = target
    _pins_memo = (blob, ids, pins)
    return pins


def _lpm_lookup(pins: dict[tuple[int, bytes], int], src: bytes) -> int | None:
    value = int.from_bytes(src, "big")
    best: tuple[int, int] | None = None
    for (plen, addr), shard in pins.items():
        mask = ((1 << plen) - 1) << (128 - plen) if plen else 0
        if value & mask == int.from_bytes(addr, "big") and (best is None or plen > best[0]):
            best = (plen, shard)
    return None if best is None else best[1]


class FakeShardTable:
    """A ShardTable in plain Python: the same validation and decision order as the classifier.

    ``classify(source, size)`` plays the classifier for one packet, so agent tests can check
    what traffic would do; stats and events come from those calls.
    """

    def __init__(
        self,
        *,
        maglev_size: int = maglev.DEFAULT_SIZE,
        max_shards: int = AM_MAX_SHARDS,
        interfaces: dict[str, int] | None = None,
        vxlan_ifindex: int | None = None,
    ) -> None:
        self.maglev_size = maglev_size
        self.max_shards = max_shards
        self.interfaces = dict(interfaces or {})
        self.vxlan_ifindex = vxlan_ifindex
        self.plan: Plan | None = None
        self.table: list[int] = [maglev.NO_SHARD] * maglev_size
        self.flows: dict[bytes, int] = {}
        self.apply_count = 0
        self._stats: dict[int, list[int]] = {}
        self._events: deque[FlowEvent] = deque()
        self._counters = DatapathCounters()

    @property
    def applied_version(self) -> int | None:
        return None if self.plan is None else self.plan.version

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        plan = validate_assignment(
            assignment,
            max_shards=self.max_shards,
            applied_version=self.applied_version,
            resolve_ifname=self.interfaces.get,
            vxlan_ifindex=self.vxlan_ifindex,
        )
        self.table = list(maglev.build_table(plan.backends, self.maglev_size))
        self.plan = plan
        self.apply_count += 1

    def _active(self, shard: int | None) -> bool:
        return (
            shard is not None
            and self.plan is not None
            and shard in self.plan.shards
            and self.plan.shards[shard].state == STATE_ACTIVE
        )

    def classify(self, source: str, size: int = 64, ts_ns: int = 0) -> int | None:
        """The shard a packet from ``source`` goes to (None: passed untouched)."""
        if self.plan is None:
            return None
        ip = ipaddress.ip_address(source)
        src = addr16(ip)
        flow = self.flows.get(src)
        pin = _lpm_lookup(self.plan.pins, src)
        shard: int | None = None
        reason = 0
        if self._active(pin):
            shard = pin
            if flow != pin:
                reason = REASON_PIN
        if shard is None and flow is not None:
            if self._active(flow):
                shard = flow
            else:
                reason = REASON_REPICK
        if shard is None:
            pick = self.table[maglev.source_hash(src) % self.maglev_size]
            if not self._active(pick):
                return None
            shard = pick
            reason = reason or REASON_MAGLEV
        st = self._stats.setdefault(shard, [0, 0, 0, 0])
        st[0] += 1
        st[1] += size
        if reason:
            self.flows[src] = shard
            st[2] += 1
            self._events.append(
                FlowEvent(ts_ns, ip, shard, REASON_NAMES[reason], self.plan.version)
            )
        return shard

    def read_stats(self) -> dict[int, ShardStats]:
        return {k: ShardStats(*v) for k, v in self._stats.items()}

    def read_counters(self) -> DatapathCounters:
        return self._counters

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int:
        n = 0
        while self._events:
            callback(self._events.popleft())
            n += 1
        return n
