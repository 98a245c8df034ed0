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
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from adaptermesh import assignment_rules as rules
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
    "Attachable",
    "Attachment",
    "DatapathCounters",
    "FakeShardTable",
    "FlowEvent",
    "FlowLookup",
    "PinDelta",
    "Plan",
    "ShardPlan",
    "ShardStats",
    "ShardTable",
    "SteerPlan",
    "addr16",
    "lpm_key",
    "validate_assignment",
]

# The one copy of each limit lives in assignment_rules; the loader compiles the classifier
# with -DAM_MAX_SHARDS / -DAM_MAX_PINS from these.
WEIGHT_BUDGET = rules.WEIGHT_BUDGET
AM_MAX_SHARDS = rules.MAX_SHARDS
AM_MAX_PINS = rules.MAX_PINS
# struct am_shard.state / .kind / .flags and struct am_event.reason (classifier.h).
STATE_ABSENT, STATE_ACTIVE, STATE_DRAINING = 0, 1, 2
STEER_NONE, STEER_TUNNEL, STEER_REDIRECT, STEER_MARK = 0, 1, 2, 3
F_SET_MAC, F_INGRESS = 0x1, 0x2
REASON_PIN, REASON_MAGLEV, REASON_REPICK = 1, 2, 3
REASON_NAMES = {REASON_PIN: "pin", REASON_MAGLEV: "maglev", REASON_REPICK: "repick"}

# An Assignment was rejected; ``field`` names the offending field (``shards[2].weight``).
AssignmentError = rules.RuleError


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
    # AM_CNT_MARTIAN: sources no client has (unspecified, loopback, multicast,
    # 255.255.255.255, IPv4-mapped in an IPv6 header).
    martian_source: int = 0


_V4_MARTIAN = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/4", "255.255.255.255/32")
)
_V4_LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
_V6_LINK_LOCAL = ipaddress.ip_network("fe80::/10")


def source_pass_reason(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The counter a packet from ``ip`` is passed untouched under, before any lookup (None:
    a possible client). Must stay in sync with am_martian4/am_martian6 and the link-local checks in classifier.bpf.c."""
    if isinstance(ip, ipaddress.IPv4Address):
        if any(ip in n for n in _V4_MARTIAN):
            return "martian_source"
        return "link_local" if ip in _V4_LINK_LOCAL else None
    if ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip.ipv4_mapped is not None:
        return "martian_source"
    return "link_local" if ip in _V6_LINK_LOCAL else None


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
    # The change from the previous validation's pins, when there was one with the same shard
    # indices (None: unchanged, i.e. ``pins`` is that very dict, or no base to diff against).
    pins_delta: PinDelta | None = None


@runtime_checkable
class ShardTable(Protocol):
    def apply(self, assignment: assignment_pb2.Assignment) -> None: ...

    def read_stats(self) -> dict[int, ShardStats]: ...

    def read_counters(self) -> DatapathCounters: ...

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int: ...

    @property
    def applied_version(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Attachment:
    """What of the datapath is in place: the interface, the classifier's filter on its
    ingress, and the maps whose pins are gone (``BpfShardTable.inspect()``)."""

    interface: bool = True
    filter: bool = True
    unpinned: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.interface and self.filter and not self.unpinned


@runtime_checkable
class Attachable(Protocol):
    """A datapath that can say whether it is still attached, and attach again."""

    def inspect(self) -> Attachment: ...

    def reattach(self) -> None: ...

    def watch_links(self, wake: Callable[[], None], stop: threading.Event) -> None: ...


@runtime_checkable
class FlowLookup(Protocol):
    """A datapath that can say where one source's sticky flow goes now."""

    def lookup_flow(self, source: str) -> int | None:
        """The shard index of ``source``'s entry in the sticky flow table (None: none)."""
        ...


def addr16(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """The classifier's 16-byte form of an address (IPv4 as ``::ffff:a.b.c.d``)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return b"\x00" * 10 + b"\xff\xff" + ip.packed
    return ip.packed


def lpm_key(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> tuple[int, bytes]:
    if isinstance(net, ipaddress.IPv4Network):
        return 96 + net.prefixlen, addr16(net.network_address)
    return net.prefixlen, addr16(net.network_address)


# The plain spellings (dotted quad or colon-hex, then a decimal prefix without leading zeros)
# are parsed by inet_pton, about 1 us against ipaddress' 11 us; anything else, and every
# error, goes through ipaddress, which stays the authority on what is valid (a property test
# checks that both agree wherever the fast path answers).
_V4_PREFIX = b"\x00" * 10 + b"\xff\xff"


def _fast_pin_key(cidr: str) -> tuple[int, bytes] | None:
    text, sep, digits = cidr.partition("/")
    if (
        not sep
        or not digits.isascii()
        or not digits.isdigit()
        or len(digits) > 3
        or (digits[0] == "0" and len(digits) > 1)
    ):
        return None
    v4 = ":" not in text
    try:
        packed = socket.inet_pton(socket.AF_INET if v4 else socket.AF_INET6, text)
    except (OSError, ValueError):  # ValueError: an embedded NUL or non-ASCII text
        return None
    plen = int(digits)
    bits = 32 if v4 else 128
    if plen > bits or int.from_bytes(packed, "big") & ((1 << (bits - plen)) - 1):
        return None  # ipaddress words the error
    return (96 + plen, _V4_PREFIX + packed) if v4 else (plen, packed)


def _parse_pin_key(cidr: str) -> tuple[int, bytes]:
    # The shared rules decide what a CIDR is; the fast path only answers for plain spellings
    # that they accept too.
    return _fast_pin_key(cidr) or lpm_key(rules.cidr_network(cidr))


@functools.lru_cache(maxsize=1 << 17)
def _pin_key(cidr: str) -> tuple[int, bytes]:
    # Pins change rarely between assignments; parsing 10,000 of them every 5 s would
    # dominate apply() (about 10 ms), so parsed keys are remembered.
    return _parse_pin_key(cidr)


def _steer(
    shard: assignment_pb2.Shard,
    name: str,
    resolve_ifname: Callable[[str], int | None],
    vxlan_ifindex: int | None,
) -> SteerPlan:
    which = shard.steer.WhichOneof("target") if shard.HasField("steer") else None
    if which is None:
        return SteerPlan()
    # What needs nothing of this node is the shared rules' call; then the node's own facts.
    steer = shard.steer
    rules.check_steer(steer, name + ".steer", which)
    if which == "tunnel":
        t = shard.steer.tunnel
        remote = ipaddress.IPv4Address(t.remote_ipv4)
        if vxlan_ifindex is None:
            raise AssignmentError(
                f"{name}.steer.tunnel", "this node has no collect-metadata VXLAN device"
            )
        mac = rules.mac_bytes(t.inner_dst_mac, f"{name}.steer.tunnel.inner_dst_mac")
        return SteerPlan(
            kind=STEER_TUNNEL, ifindex=vxlan_ifindex, remote_ipv4=int(remote), vni=t.vni, mac=mac
        )
    if which == "redirect":
        r = shard.steer.redirect
        ifindex = r.ifindex
        if ifindex == 0:
            found = resolve_ifname(r.ifname)
            if found is None:
                raise AssignmentError(
                    f"{name}.steer.redirect.ifname", f"no interface {r.ifname!r} on this node"
                )
            ifindex = found
        mac = rules.mac_bytes(r.dst_mac, f"{name}.steer.redirect.dst_mac")
        return SteerPlan(kind=STEER_REDIRECT, ifindex=ifindex, mac=mac, ingress=r.ingress)
    return SteerPlan(kind=STEER_MARK, mark=shard.steer.mark.mark)


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
    # The shard set's rules (ids, indices in this table's range, states, the weight budget)
    # are assignment_rules'; what is left here is what the node adds: steering targets.
    rules.check_shard_set(a.shards, max_shards)
    shards: dict[int, ShardPlan] = {}
    by_id: dict[str, ShardPlan] = {}
    for i, s in enumerate(a.shards):
        state = STATE_ACTIVE if s.state == assignment_pb2.SHARD_STATE_ACTIVE else STATE_DRAINING
        steer = _steer(s, f"shards[{i}]", resolve_ifname, vxlan_ifindex)
        plan = ShardPlan(index=s.index, id=s.id, state=state, weight=s.weight, steer=steer)
        shards[s.index] = plan
        by_id[s.id] = plan
    active = [p for p in shards.values() if p.state == STATE_ACTIVE]
    if len(a.pins) > max_pins:
        raise AssignmentError("pins", f"{len(a.pins)} pins, but am_pins holds at most {max_pins}")
    pins, pins_delta = _validate_pins(a, {sid: p.index for sid, p in by_id.items()})
    for i, o in enumerate(a.overrides):
        if o.shard_id not in by_id:
            raise AssignmentError(f"overrides[{i}].shard_id", f"unknown shard {o.shard_id!r}")
    backends = [
        maglev.Backend(key=p.id, value=p.index, weight=p.weight) for p in active if p.weight > 0
    ]
    return Plan(
        version=a.version, shards=shards, pins=pins, backends=backends, pins_delta=pins_delta
    )


# Pins arrive as 10,000 small protobuf messages every few seconds and almost all of them are
# the same as last time. Reading a field of each from Python costs about 2.5 ms (a wrapper
# object per pin and per string), more than the rest of validation, so pins are handled as
# their wire bytes: the Assignment is serialized once and re-read as a message whose field 3
# is ``repeated bytes``, which hands over every Pin's encoding as one bytes object (about
# 0.6 ms for 10,000, all in C). A record is then the content key for its parse, and the change
# since the last validated pin list is two set differences over records.
_PinKey = tuple[int, bytes]


def _pins_wire_class() -> type[Message]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="adaptermesh/bpf/pins_wire.proto", package="adaptermesh.bpf.wire", syntax="proto3"
    )
    msg = fdp.message_type.add(name="PinsWire")
    msg.field.add(
        name="pins",
        number=assignment_pb2.Assignment.DESCRIPTOR.fields_by_name["pins"].number,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()  # a private pool: nothing global is registered
    pool.Add(fdp)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("adaptermesh.bpf.wire.PinsWire")
    )


_PinsWire = _pins_wire_class()


def _pin_records(a: assignment_pb2.Assignment) -> list[bytes]:
    """Each pin's wire encoding, in order (equal pins give equal bytes)."""
    wire: Any = _PinsWire.FromString(a.SerializeToString())
    return list(wire.pins)


# record -> (LPM key, shard id). A plain dict, not lru_cache: a miss costs about 0.6 us less
# without the LRU bookkeeping, and hits can be taken in bulk with map(dict.get, ...). When it
# outgrows its bound it is simply emptied (it refills from the next lists).
_ENTRY_CACHE_MAX = 1 << 17
_entry_cache: dict[bytes, tuple[_PinKey, str]] = {}


def _pin_entry(record: bytes) -> tuple[_PinKey, str]:
    # Raises ValueError for an invalid CIDR (not cached: the walk reports it by position).
    hit = _entry_cache.get(record)
    if hit is None:
        pin = assignment_pb2.Pin.FromString(record)
        hit = (_parse_pin_key(pin.cidr), pin.shard_id)
        if len(_entry_cache) >= _ENTRY_CACHE_MAX:
            _entry_cache.clear()
        _entry_cache[record] = hit
    return hit


def _pin_entries(records: list[bytes]) -> list[tuple[_PinKey, str]]:
    """_pin_entry for many records: the cached ones in one C-level pass."""
    got = list(map(_entry_cache.get, records))
    if None not in got:
        return cast(list[tuple[_PinKey, str]], got)
    return [
        hit if hit is not None else _pin_entry(rec) for hit, rec in zip(got, records, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class PinDelta:
    """How ``Plan.pins`` differs from ``base``, the pins dict of an earlier validation.

    A ShardTable that applied exactly ``base`` (checked by identity) writes ``upserts`` and
    deletes ``deletes`` instead of comparing all pins.
    """

    base: dict[_PinKey, int]
    upserts: dict[_PinKey, int]
    deletes: tuple[_PinKey, ...]


@dataclass(slots=True)
class _PinsMemo:
    records: list[bytes]
    keys: dict[bytes, _PinKey]  # record -> its LPM key, for every record in ``records``
    ids: tuple[tuple[str, int], ...]
    pins: dict[_PinKey, int]


# The last validated pin list. A hit hands back the very same dict, so callers can tell
# "unchanged" by identity; a near miss yields a PinDelta against it.
_pins_memo: _PinsMemo | None = None


def _walk_pins(a: assignment_pb2.Assignment, index_of: dict[str, int]) -> dict[_PinKey, int]:
    """Pin by pin, in order: the reference check that names the first bad field."""
    pins: dict[_PinKey, int] = {}
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
    return pins


def _full_pins(
    records: list[bytes], index_of: dict[str, int]
) -> tuple[dict[_PinKey, int], dict[bytes, _PinKey]] | None:
    """All pins from their records with C-level maps over the cache; None: some pin is bad
    (the caller walks them to name it)."""
    try:
        entries = _pin_entries(records)
    except ValueError:
        return None
    targets = list(map(index_of.get, (sid for _, sid in entries)))
    if None in targets:
        return None
    keys = [k for k, _ in entries]
    pins = dict(zip(keys, cast(list[int], targets), strict=True))
    if len(pins) != len(records):
        return None
    return pins, dict(zip(records, keys, strict=True))


def _delta_pins(
    memo: _PinsMemo, record_set: set[bytes], index_of: dict[str, int]
) -> tuple[dict[_PinKey, int], dict[bytes, _PinKey], PinDelta] | None:
    """Pins as memo's plus the records that came and minus those that went; None: some pin
    is bad (the caller walks the pins to name it)."""
    # Bulk set and map operations (C loops) rather than a Python loop per record.
    added = list(record_set.difference(memo.keys))
    removed = memo.keys.keys() - record_set
    pins = memo.pins.copy()
    keys = memo.keys.copy()
    gone = list(map(keys.pop, removed))
    for key in gone:
        del pins[key]
    try:
        entries = _pin_entries(added)
    except ValueError:
        return None
    targets = list(map(index_of.get, [sid for _, sid in entries]))
    if None in targets:
        return None
    new_keys = [key for key, _ in entries]
    upserts = dict(zip(new_keys, cast(list[int], targets), strict=True))
    if len(upserts) != len(entries) or not pins.keys().isdisjoint(upserts):
        return None  # two pins for one prefix (spelled differently)
    pins.update(upserts)
    keys.update(zip(added, new_keys, strict=True))
    # A key that left under one spelling and came back under another (or moved shard) is an
    # upsert, never a delete.
    deletes = tuple(set(gone).difference(upserts))
    return pins, keys, PinDelta(base=memo.pins, upserts=upserts, deletes=deletes)


def _validate_pins(
    a: assignment_pb2.Assignment, index_of: dict[str, int]
) -> tuple[dict[_PinKey, int], PinDelta | None]:
    global _pins_memo
    records = _pin_records(a)
    ids = tuple(sorted(index_of.items()))
    memo = _pins_memo
    if memo is not None and memo.ids == ids and memo.records == records:
        return memo.pins, None
    found: tuple[dict[_PinKey, int], dict[bytes, _PinKey]] | None = None
    delta: PinDelta | None = None
    record_set = set(records)
    if len(record_set) != len(records):
        pass  # a pin repeated verbatim: the walk names it
    elif memo is not None and memo.ids == ids:
        got = _delta_pins(memo, record_set, index_of)
        if got is not None:
            found, delta = got[:2], got[2]
    else:
        # First pins, or shard indices moved: every pin is re-derived (the cache still
        # spares the parsing); the table diffs against what it wrote.
        found = _full_pins(records, index_of)
    if found is None:
        pins = _walk_pins(a, index_of)  # raises naming the first bad pin
        found = pins, dict(zip(records, pins, strict=True))
    _pins_memo = _PinsMemo(records=records, keys=found[1], ids=ids, pins=found[0])
    return found[0], delta


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

    def lookup_flow(self, source: str) -> int | None:
        return self.flows.get(addr16(ipaddress.ip_address(source)))

    def classify(self, source: str, size: int = 64, ts_ns: int = 0) -> int | None:
        """The shard a packet from ``source`` goes to (None: passed untouched)."""
        if self.plan is None:
            return None
        ip = ipaddress.ip_address(source)
        passed = source_pass_reason(ip)
        if passed is not None:
            self._counters = replace(
                self._counters, **{passed: getattr(self._counters, passed) + 1}
            )
            return None
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
