"""What an Assignment may contain: the one owner of its rules and limits.

The control plane checks every write against these rules before it stores anything, the
rebalancer checks every Assignment before it publishes, and the node agent checks every
Assignment before it applies it. Because all three call the same functions, a value the agent
would refuse can never be stored, and an agent never freezes on an Assignment that the
control plane thought was fine.

Every check raises :class:`RuleError`, whose ``field`` names the offending field
(``shards[2].steer.tunnel.vni``, ``shard.endpoints[0].address``) and whose message says what
is allowed. ``docs/limits.md`` lists every limit with its value and the error it produces.

The map sizes are the classifier's: the loader compiles ``classifier.bpf.c`` with
``-DAM_MAX_SHARDS=MAX_SHARDS`` and ``-DAM_MAX_PINS=MAX_PINS`` from here, so there is one copy
of each.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
else:
    from adaptermesh.proto import assignment_pb2

__all__ = [
    "LB_POLICIES",
    "LB_POLICY_LABEL",
    "MAX_ADAPTERS_PER_ENDPOINT",
    "MAX_ADAPTER_NAME",
    "MAX_ADAPTER_SPLITS",
    "MAX_ALLOWED_CIDRS",
    "MAX_APPLY_ERROR",
    "MAX_ASSIGNMENT_BYTES",
    "MAX_ENDPOINTS",
    "MAX_ERROR_MESSAGE",
    "MAX_IFNAME",
    "MAX_LABELS",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_NODES",
    "MAX_NODE_ID",
    "MAX_PINS",
    "MAX_QUOTED",
    "MAX_REASON",
    "MAX_RULES_DOCUMENT_BYTES",
    "MAX_SHARDS",
    "MAX_VNI",
    "SHARD_ID_RE",
    "UPSTREAM_PROTOCOLS",
    "UPSTREAM_PROTOCOL_LABEL",
    "VERSION_RE",
    "VERSION_SEPARATOR",
    "WEIGHT_BUDGET",
    "RuleError",
    "bounded_message",
    "check_adapter_name",
    "check_address",
    "check_assignment",
    "check_labels",
    "check_mac",
    "check_port",
    "check_reason",
    "check_routing_rules",
    "check_shard",
    "check_shard_id",
    "check_shard_set",
    "check_split",
    "check_steer",
    "check_version",
    "cidr_network",
    "mac_bytes",
    "normalise_cidr",
    "quote",
    "served_name",
]

# -- limits ----------------------------------------------------------------------------------

# am_shards / am_stats entries: shard indices are 0 .. MAX_SHARDS - 1 (classifier.h).
MAX_SHARDS = 256
# am_pins (LPM trie) entries (classifier.h).
MAX_PINS = 16_384
# Shard weights are parts per 10,000 and sum to this over ACTIVE shards.
WEIGHT_BUDGET = 10_000
# VXLAN network identifiers are 24 bits; 0 is refused (no tunnel key).
MAX_VNI = (1 << 24) - 1
# Linux interface names (IFNAMSIZ - 1).
MAX_IFNAME = 15
MAX_ENDPOINTS = 1024  # per shard
MAX_ADAPTERS_PER_ENDPOINT = 4096
MAX_ADAPTER_NAME = 256
MAX_LABELS = 64
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 256
MAX_REASON = 512  # operator text: override reasons, the Assignment's reason
MAX_ALLOWED_CIDRS = 256  # per adapter instance
MAX_NODES = 4096  # node rows the control plane keeps (load reports create them)
MAX_NODE_ID = 253
MAX_APPLY_ERROR = 4096
# Adapters under gray release at once (Assignment.adapter_splits).
MAX_ADAPTER_SPLITS = 1024
# The whole Assignment, serialised: under gRPC's default 4 MiB receive limit, which the
# agents' watch channels keep, with room for the stream's framing.
MAX_ASSIGNMENT_BYTES = 3 << 20
# The routing-rule set an Assignment carries (its canonical JSON, UTF-8): 2 MiB, under the
# whole Assignment's bound with room for 16,384 pins and 256 shards. A stored set must fit:
# the publish that would carry a larger one is refused, so ApplyRules refuses the set.
MAX_RULES_DOCUMENT_BYTES = 2 << 20

# Shard ids become BPF-side names, Envoy resource names (``shard-<id>``) and stat names.
SHARD_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
LB_POLICY_LABEL = "adaptermesh.io/lb-policy"
UPSTREAM_PROTOCOL_LABEL = "adaptermesh.io/upstream-protocol"
LB_POLICIES = ("round_robin", "least_request")
UPSTREAM_PROTOCOLS = ("http1", "http2", "downstream")
# Adapter versions: a worker serves version v of adapter a as the adapter "a@v" (a directory
# of that name under its adapter root), so a version is a short name-safe token.
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
VERSION_SEPARATOR = "@"
_MAC_RE = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_ACTIVE = assignment_pb2.SHARD_STATE_ACTIVE
_DRAINING = assignment_pb2.SHARD_STATE_DRAINING
_STATES = (assignment_pb2.SHARD_STATE_UNSPECIFIED, _ACTIVE, _DRAINING)


# Client input quoted in an error message: this many characters of it, then its length. A
# megabyte name would otherwise travel back whole in the error, and a gRPC status that large
# exceeds the client's metadata limit (it then sees RESOURCE_EXHAUSTED, not the error meant).
MAX_QUOTED = 64
# Any error message that crosses a process boundary (a gRPC status, an HTTP error body) is cut
# to this many UTF-8 bytes, whatever it quotes: the backstop behind ``quote``. (gRPC
# percent-encodes a status message's non-ASCII bytes, so it travels in at most 3x that.)
MAX_ERROR_MESSAGE = 768


def quote(value: object, limit: int = MAX_QUOTED) -> str:
    """``value`` as an error message quotes it: ``repr`` of at most ``limit`` characters, and
    for a longer one its first ``limit`` characters and its length:
    ``'aaaa…' (1048576 characters)``. Every message that quotes client input uses this."""
    if not isinstance(value, str):
        text = repr(value)
        if len(text) <= limit:
            return text
        return f"{text[:limit]}… ({len(text)} characters)"
    if len(value) <= limit:
        return repr(value)
    head = repr(value[:limit])
    return f"{head[:-1]}…{head[-1]} ({len(value)} characters)"


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def bounded_message(
    text: str, limit: int = MAX_ERROR_MESSAGE, size: Callable[[str], int] = _utf8_size
) -> str:
    """``text`` cut so that ``size`` of it (UTF-8 bytes unless told) is at most ``limit``: an
    error message about to leave the process. A cut one ends with ``… (N characters)``."""
    if size(text) <= limit:
        return text
    tail = f"… ({len(text)} characters)"
    room = limit - size(tail)
    low, high = 0, max(0, min(len(text), room))  # every character costs at least 1
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        if size(text[:middle]) <= room:
            low = middle
        else:
            high = middle - 1
    return text[:low] + tail


class RuleError(ValueError):
    """A value breaks a rule; ``field`` names it, ``message`` says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


# -- single values ---------------------------------------------------------------------------


def _text(value: str, field: str, limit: int, what: str = "characters") -> None:
    if len(value) > limit:
        raise RuleError(field, f"at most {limit} {what}, got {len(value)}")


def check_shard_id(value: str, field: str) -> None:
    if not value:
        raise RuleError(field, "required")
    if not SHARD_ID_RE.match(value):
        raise RuleError(field, f"{quote(value)} must match {SHARD_ID_RE.pattern}")


def check_address(value: str, field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP address in its plain form: no host names (Envoy's EDS takes addresses), no
    ``%zone`` suffix (two spellings of one address would be two endpoints)."""
    if not value:
        raise RuleError(field, "required")
    if "%" in value:
        raise RuleError(field, f"{quote(value)}: scoped addresses (%zone) are not allowed")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise RuleError(field, f"{quote(value)} is not an IP address") from None


# The longest IP address text ("ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255" is 45), with
# room for a prefix length: longer text is refused before a cache could keep it.
_MAX_ADDRESS_TEXT = 64


def _address_key(value: str) -> str | None:
    """The canonical text of an acceptable address, None otherwise (check_address words it)."""
    if len(value) > _MAX_ADDRESS_TEXT:
        return None
    return _cached_address_key(value)


@functools.lru_cache(maxsize=1 << 15)
def _cached_address_key(value: str) -> str | None:
    """Cached: an Assignment repeats the same few thousand worker addresses every few seconds."""
    if not value or "%" in value:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def _adapter_ok(name: str) -> bool:
    # The length first: the cache below then never keeps a long name a client sent.
    return 0 < len(name) <= MAX_ADAPTER_NAME and _printable(name)


@functools.lru_cache(maxsize=1 << 16)
def _printable(name: str) -> bool:
    return name.isprintable()


def check_adapter_name(value: str, field: str) -> None:
    """An adapter a version can be added to: printable, no version separator."""
    if not _adapter_ok(value) or VERSION_SEPARATOR in value or value != value.strip():
        raise RuleError(
            field,
            f"{quote(value)} must be 1-{MAX_ADAPTER_NAME - 66} printable "
            f"characters without {VERSION_SEPARATOR!r} or surrounding spaces",
        )
    if len(value) > MAX_ADAPTER_NAME - 66:  # room for "@" and the longest version
        raise RuleError(field, f"at most {MAX_ADAPTER_NAME - 66} characters, got {len(value)}")


def check_version(value: str, field: str, *, allow_empty: bool = True) -> None:
    """An adapter version: "" (the adapter's own name) or a VERSION_RE token."""
    if value == "" and allow_empty:
        return
    if not VERSION_RE.match(value):
        raise RuleError(
            field,
            f"{quote(value)} is not a version: 1-64 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit",
        )


def served_name(adapter: str, version: str) -> str:
    """The adapter name a worker serves ``version`` of ``adapter`` under."""
    return f"{adapter}{VERSION_SEPARATOR}{version}" if version else adapter


def check_split(split: assignment_pb2.AdapterSplit, field: str) -> None:
    check_adapter_name(split.adapter, f"{field}.adapter")
    check_version(split.stable_version, f"{field}.stable_version")
    check_version(split.canary_version, f"{field}.canary_version")
    if split.canary_share > WEIGHT_BUDGET:
        raise RuleError(
            f"{field}.canary_share",
            f"{split.canary_share} exceeds {WEIGHT_BUDGET} (parts per 10,000)",
        )
    if split.canary_share and split.canary_version == split.stable_version:
        raise RuleError(
            f"{field}.canary_version", f"equals the stable version {quote(split.stable_version)}"
        )
    _text(split.rollout_id, f"{field}.rollout_id", 64)


def check_port(value: int, field: str) -> None:
    if not 1 <= value <= 65535:
        raise RuleError(field, f"{value} is not in 1..65535")


def mac_bytes(value: str, field: str) -> bytes | None:
    """The six bytes of ``aa:bb:cc:dd:ee:ff``; None for empty (keep the frame's own)."""
    if not value:
        return None
    if not _MAC_RE.match(value):
        raise RuleError(field, f"invalid MAC address {quote(value)} (want aa:bb:cc:dd:ee:ff)")
    return bytes(int(p, 16) for p in value.split(":"))


def check_mac(value: str, field: str) -> None:
    mac_bytes(value, field)


def check_reason(value: str, field: str = "reason") -> None:
    _text(value, field, MAX_REASON)


def check_labels(labels: Mapping[str, str], field: str) -> None:
    if len(labels) > MAX_LABELS:
        raise RuleError(field, f"at most {MAX_LABELS} labels, got {len(labels)}")
    for k, v in labels.items():
        if not k or len(k) > MAX_LABEL_KEY:
            raise RuleError(f"{field}[{quote(k)}]", f"label keys are 1-{MAX_LABEL_KEY} characters")
        if len(v) > MAX_LABEL_VALUE:
            raise RuleError(
                f"{field}[{quote(k)}]", f"label values are at most {MAX_LABEL_VALUE} characters"
            )
    policy = labels.get(LB_POLICY_LABEL)
    if policy is not None and policy not in LB_POLICIES:
        raise RuleError(
            f"{field}[{LB_POLICY_LABEL}]", f"{quote(policy)} is not one of {', '.join(LB_POLICIES)}"
        )
    protocol = labels.get(UPSTREAM_PROTOCOL_LABEL)
    if protocol is not None and protocol not in UPSTREAM_PROTOCOLS:
        raise RuleError(
            f"{field}[{UPSTREAM_PROTOCOL_LABEL}]",
            f"{quote(protocol)} is not one of {', '.join(UPSTREAM_PROTOCOLS)}",
        )


def cidr_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """The network ``text`` names, strictly (no host bits, no ``%zone``); ValueError if none.

    ``ipaddress`` keeps a zone in the network (``fe80::1%eth0/128``), while the classifier
    keys on the address alone, so a zoned pin would collide with the plain one in am_pins.
    """
    if "%" in text:
        raise ValueError("scoped addresses (%zone) are not allowed in a CIDR")
    if text != text.strip():
        raise ValueError("leading or trailing white space")
    return ipaddress.ip_network(text, strict=True)


@functools.lru_cache(maxsize=1 << 15)
def _canonical_cidr(text: str) -> str:
    return str(cidr_network(text))


def normalise_cidr(text: str, field: str = "cidr") -> str:
    """The canonical spelling of a CIDR (one spelling per prefix, so duplicates are seen)."""
    if not text:
        raise RuleError(field, "required")
    try:
        return _canonical_cidr(text)
    except ValueError as exc:
        # ipaddress's own message repeats the text (or a piece of it): quoted, and cut.
        detail = bounded_message(str(exc).replace(repr(text), quote(text)), 160)
        raise RuleError(field, f"{quote(text)} is not a valid CIDR ({detail})") from None


# -- a shard ---------------------------------------------------------------------------------


def check_steer(steer: assignment_pb2.Steer, field: str, kind: str | None = "?") -> None:
    """Checks that need nothing of the node; the agent then resolves ifnames and devices.

    ``kind``: the caller's ``steer.WhichOneof("target")``, when it has it already.
    """
    if kind == "?":
        kind = steer.WhichOneof("target")
    if kind == "tunnel":
        t = steer.tunnel
        try:
            ipaddress.IPv4Address(t.remote_ipv4)
        except ValueError:
            raise RuleError(
                f"{field}.tunnel.remote_ipv4", f"{quote(t.remote_ipv4)} is not an IPv4 address"
            ) from None
        if not 0 < t.vni <= MAX_VNI:
            raise RuleError(f"{field}.tunnel.vni", f"{t.vni} is not in 1..{MAX_VNI}")
        check_mac(t.inner_dst_mac, f"{field}.tunnel.inner_dst_mac")
    elif kind == "redirect":
        r = steer.redirect
        if not r.ifname and not r.ifindex:
            raise RuleError(f"{field}.redirect", "needs ifname or ifindex")
        if len(r.ifname) > MAX_IFNAME:
            raise RuleError(
                f"{field}.redirect.ifname", f"interface names are at most {MAX_IFNAME} characters"
            )
        if not r.ifname.isprintable() or any(c in r.ifname for c in "/ "):
            raise RuleError(
                f"{field}.redirect.ifname", f"{quote(r.ifname)} is not an interface name"
            )
        check_mac(r.dst_mac, f"{field}.redirect.dst_mac")
    elif kind == "mark" and steer.mark.mark == 0:
        raise RuleError(f"{field}.mark.mark", "must be non-zero (0 means no mark)")


def check_shard(
    shard: assignment_pb2.Shard, field: str, *, published: bool = False, weighted: bool = False
) -> None:
    """One shard's own fields. ``published``: as it appears in an Assignment (state set,
    index in the maps' range, endpoint weights >= 1), not as an operator writes it;
    ``weighted``: only the endpoint weights (what Envoy's EDS needs).

    As an operator writes it (neither flag), a shard also needs a way in: steering (tunnel,
    redirect or mark) or a service listener. One with neither would get weight at once while
    no packet could reach it. Published shards are not held to this, so an Assignment that
    carries a shard stored before the rule still publishes and applies."""
    as_written = not (weighted or published)
    weighted = weighted or published
    check_shard_id(shard.id, f"{field}.id")
    if shard.state not in _STATES or (published and shard.state not in (_ACTIVE, _DRAINING)):
        raise RuleError(f"{field}.state", "must be ACTIVE or DRAINING")
    if published and shard.index >= MAX_SHARDS:
        raise RuleError(f"{field}.index", f"{shard.index} is out of range 0..{MAX_SHARDS - 1}")
    if shard.weight > WEIGHT_BUDGET:
        raise RuleError(f"{field}.weight", f"{shard.weight} exceeds {WEIGHT_BUDGET}")
    if len(shard.endpoints) > MAX_ENDPOINTS:
        raise RuleError(
            f"{field}.endpoints", f"at most {MAX_ENDPOINTS} endpoints, got {len(shard.endpoints)}"
        )
    seen: set[tuple[str | None, int]] = set()
    # Field names are built only on an error: this loop runs over every worker of every
    # shard on each publish and each apply.
    for j, ep in enumerate(shard.endpoints):
        key = (_address_key(ep.address), ep.port)
        if key[0] is None:
            check_address(ep.address, f"{field}.endpoints[{j}].address")  # raises
        if not 1 <= ep.port <= 65535:
            check_port(ep.port, f"{field}.endpoints[{j}].port")
        if weighted and ep.weight < 1:
            raise RuleError(f"{field}.endpoints[{j}].weight", f"must be >= 1, got {ep.weight}")
        if key in seen:
            raise RuleError(f"{field}.endpoints[{j}]", f"duplicate endpoint {ep.address}:{ep.port}")
        seen.add(key)
        adapters = ep.adapters
        if len(adapters) > MAX_ADAPTERS_PER_ENDPOINT:
            raise RuleError(
                f"{field}.endpoints[{j}].adapters",
                f"at most {MAX_ADAPTERS_PER_ENDPOINT}, got {len(adapters)}",
            )
        if adapters and not all(map(_adapter_ok, adapters)):
            k = next(k for k, name in enumerate(adapters) if not _adapter_ok(name))
            raise RuleError(
                f"{field}.endpoints[{j}].adapters[{k}]",
                f"{quote(adapters[k])} must be 1-{MAX_ADAPTER_NAME} printable characters",
            )
    kind = shard.steer.WhichOneof("target")
    check_steer(shard.steer, f"{field}.steer", kind)
    if shard.service_address or shard.service_port:
        check_address(shard.service_address, f"{field}.service_address")
        check_port(shard.service_port, f"{field}.service_port")
    elif as_written and kind is None:
        raise RuleError(
            f"{field}.steer",
            "a shard needs steering (tunnel, redirect or mark) or a service_address and "
            "service_port; it has neither, so it would get weight but no traffic",
        )
    check_labels(shard.labels, f"{field}.labels")


# -- a whole Assignment ----------------------------------------------------------------------


def _pin_targets(shards: Iterable[assignment_pb2.Shard]) -> dict[str, int]:
    return {s.id: s.state for s in shards}


def check_shard_set(shards: Sequence[assignment_pb2.Shard], max_shards: int = MAX_SHARDS) -> None:
    """The rules that make a list of shards one consistent set of map entries: at most
    ``max_shards`` of them, ids non-empty and unique, indices unique and in
    0..``max_shards`` - 1, state ACTIVE or DRAINING, each weight within the budget and the
    ACTIVE weights summing to it. ``check_assignment`` calls it after each shard's own rules;
    the classifier's tables (``bpf.table``) call it with their own map size."""
    if len(shards) > max_shards:
        raise RuleError("shards", f"{len(shards)} shards, but the maps hold at most {max_shards}")
    ids: dict[str, int] = {}
    indices: dict[int, int] = {}
    total = 0
    active = 0
    for i, s in enumerate(shards):
        if not s.id:
            raise RuleError(f"shards[{i}].id", "must not be empty")
        if s.id in ids:
            raise RuleError(
                f"shards[{i}].id", f"duplicate id {quote(s.id)} (also shards[{ids[s.id]}])"
            )
        ids[s.id] = i
        if s.index >= max_shards:
            raise RuleError(f"shards[{i}].index", f"{s.index} is out of range 0..{max_shards - 1}")
        if s.index in indices:
            raise RuleError(
                f"shards[{i}].index", f"duplicate index {s.index} (also shards[{indices[s.index]}])"
            )
        indices[s.index] = i
        if s.state not in (_ACTIVE, _DRAINING):
            raise RuleError(f"shards[{i}].state", "must be ACTIVE or DRAINING")
        if s.weight > WEIGHT_BUDGET:
            raise RuleError(f"shards[{i}].weight", f"{s.weight} exceeds {WEIGHT_BUDGET}")
        if s.state == _ACTIVE:
            total += s.weight
            active += 1
    if active and total != WEIGHT_BUDGET:
        raise RuleError(
            "shards.weight", f"ACTIVE shard weights sum to {total}, want {WEIGHT_BUDGET}"
        )


def check_assignment(a: assignment_pb2.Assignment) -> None:
    """Everything an Assignment says, as the agent's maps and Envoy will meet it."""
    if len(a.shards) > MAX_SHARDS:
        raise RuleError("shards", f"{len(a.shards)} shards, but the maps hold at most {MAX_SHARDS}")
    if len(a.pins) > MAX_PINS:
        raise RuleError("pins", f"{len(a.pins)} pins, but am_pins holds at most {MAX_PINS}")
    if len(a.overrides) > MAX_SHARDS:
        raise RuleError("overrides", f"at most {MAX_SHARDS}, got {len(a.overrides)}")
    check_reason(a.reason)
    size = a.ByteSize()
    if size > MAX_ASSIGNMENT_BYTES:
        raise RuleError("assignment", f"{size} bytes serialised, at most {MAX_ASSIGNMENT_BYTES}")
    for i, s in enumerate(a.shards):
        field = f"shards[{i}]"
        check_shard(s, field, published=True)
        # Shards may share a service address and port: the classifier steers the VIP to each
        # shard's own node, whose Envoy serves only that shard's listener. Envoys that serve
        # several shards (xds_group "node") need distinct ones; the snapshot checks that.
        if s.state != _ACTIVE and s.weight:
            raise RuleError(f"{field}.weight", f"a DRAINING shard has weight 0, not {s.weight}")
    check_shard_set(a.shards)
    states = _pin_targets(a.shards)
    _check_pins(a.pins, states)
    for i, o in enumerate(a.overrides):
        _check_target(states, o.shard_id, f"overrides[{i}].shard_id")
        if o.weight > WEIGHT_BUDGET:
            raise RuleError(f"overrides[{i}].weight", f"{o.weight} exceeds {WEIGHT_BUDGET}")
        check_reason(o.reason, f"overrides[{i}].reason")
    if len(a.adapter_splits) > MAX_ADAPTER_SPLITS:
        raise RuleError(
            "adapter_splits", f"at most {MAX_ADAPTER_SPLITS}, got {len(a.adapter_splits)}"
        )
    check_routing_rules(a.routing_rules)
    split_of: dict[str, int] = {}
    for i, split in enumerate(a.adapter_splits):
        check_split(split, f"adapter_splits[{i}]")
        if split.adapter in split_of:
            raise RuleError(
                f"adapter_splits[{i}].adapter",
                f"duplicate adapter "
                f"{quote(split.adapter)} (also adapter_splits[{split_of[split.adapter]}])",
            )
        split_of[split.adapter] = i


def check_routing_rules(r: assignment_pb2.RoutingRules, field: str = "routing_rules") -> None:
    """The carried rule set's envelope: version, size, digest. What the rules say is checked by
    ``adaptermesh.rules.carried`` (parse and compile), which the rebalancer and the agent call."""
    if not r.document_json:
        if r.version or r.digest:
            raise RuleError(field, "no document_json: version and digest must be unset")
        return
    if r.version < 1:
        raise RuleError(f"{field}.version", "a carried rule set has a version of at least 1")
    size = len(r.document_json.encode())
    if size > MAX_RULES_DOCUMENT_BYTES:
        raise RuleError(
            f"{field}.document_json", f"{size} bytes, at most {MAX_RULES_DOCUMENT_BYTES}"
        )
    if r.digest != hashlib.sha256(r.document_json.encode()).digest():
        raise RuleError(f"{field}.digest", "is not the SHA-256 of document_json")


def _canonical_or_none(text: str) -> str | None:
    if len(text) > _MAX_ADDRESS_TEXT:
        return None
    return _cached_canonical_or_none(text)


@functools.lru_cache(maxsize=1 << 17)
def _cached_canonical_or_none(text: str) -> str | None:
    try:
        return _canonical_cidr(text)
    except ValueError:
        return None


def _check_pins(pins: Iterable[assignment_pb2.Pin], states: Mapping[str, int]) -> None:
    # 16,384 pins on every publish and apply: the common all-valid case is a few C-level
    # passes over cached results; any problem is then found and named by the walk below.
    pins = list(pins)
    cidrs = [p.cidr for p in pins]
    targets = {p.shard_id for p in pins}
    canon = list(map(_canonical_or_none, cidrs))
    active = {sid for sid, state in states.items() if state == _ACTIVE}
    if None not in canon and len(set(canon)) == len(canon) and targets <= active:
        return
    seen: dict[str, int] = {}
    for i, pin in enumerate(pins):
        cidr = normalise_cidr(pin.cidr, f"pins[{i}].cidr")
        if cidr in seen:
            raise RuleError(
                f"pins[{i}].cidr", f"duplicate pin {pin.cidr} (also pins[{seen[cidr]}])"
            )
        seen[cidr] = i
        _check_target(states, pin.shard_id, f"pins[{i}].shard_id")


def _check_target(states: Mapping[str, int], shard_id: str, field: str) -> None:
    state = states.get(shard_id)
    if state is None:
        raise RuleError(field, f"unknown shard {quote(shard_id)}")
    if state != _ACTIVE:
        raise RuleError(field, f"shard {quote(shard_id)} is DRAINING")
