"""The rule index: per request, the rules that can possibly match, found by lookups.

The evaluator's screens cost about 0.7 us a rule on the 2-core CPU dev box, so walking all
100 rules of a set costs about 70 us even when every screen says no. The index is built at
compile time from each rule's parse tree (``guards.parse``, the same tree its screen is built
from) and gives, per request, a bitmask of candidate rules; the evaluator visits only those, in
rule order.

For each rule it derives a **necessary condition**: a set of lookup keys such that whenever the
rule's screen would not answer false, the request hits at least one of them. A rule is skipped
only when its screen would answer false, that is, when the rule is definitely false under CEL's
commutative logic (a false conjunct makes ``&&`` false whatever the rest gives, errors
included), so the skipped rules would have counted neither a match nor an error and the
indexed walk gives the same outcome as the linear one. The derivation, over the tree:

- ``not_false(atom)``: ``adapter == "x"``, ``request.tenant == "x"``,
  ``request.source_ip == "x"`` (exact lookups); ``startsWith`` / ``endsWith`` on the adapter
  or tenant (one lookup per distinct literal length); ``"k" in request.headers`` and
  ``request.headers.exists(k, k == "k")`` (key present); ``request.headers["k"] == "v"``
  (the value ``v`` under ``k``, **or** ``k`` absent: a missing key is CEL's error value,
  unknown, so such a rule stays a candidate and may count its error);
  ``inCidr(request.source_ip, "c")`` (one masked lookup per distinct prefix length and
  family); ``now.getHours() <op> n`` (the hours that pass, plus "no hour taken"); ``false``
  (no key: never a candidate). Anything else (``true``, macros, ``size()``, ...) has no
  condition: the rule is always a candidate.
- ``a && b``: the cheapest conjunct that has a condition; ``a || b``: the union of every
  branch's, or none if one branch has none; ``!a``: ``not_true(a)``, where ``not_true`` is the
  dual (``&&`` unions, ``||`` picks, ``!`` flips back; of the atoms only ``false``, ``true``
  and the hour comparisons have one).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from adaptermesh.rules.guards import (
    HOUR_COMPARE,
    Affix,
    AllOf,
    AnyOf,
    Const,
    Equals,
    HasKey,
    HeaderEquals,
    Hour,
    InCidr,
    KeyExists,
    Node,
    Not,
    address_bits,
)

__all__ = ["RuleIndex", "build_index", "members"]

# A lookup key: ("eq", field, lit), ("affix", field, how, lit), ("has", key),
# ("header", key, lit), ("cidr", version, prefix length, network as int), ("hour", h).
Key = tuple[str | int, ...]
Keys = frozenset[Key]

# Rough share of requests a key lets through, to pick among the conjuncts of an ``&&``:
# exact values are narrowest; a header equality also passes every request without the
# header, and a prefix, a CIDR or a key's presence is broad.
_COST = {"eq": 1, "header": 2, "cidr": 3, "hour": 3, "affix": 4, "has": 4}
_HOURS = range(-1, 24)  # -1: the evaluator took no hour (CEL decides)


def _cost(keys: Keys) -> int:
    return sum(_COST[str(k[0])] for k in keys)


def _cheapest(options: Sequence[Keys | None]) -> Keys | None:
    known = [k for k in options if k is not None]
    return min(known, key=_cost) if known else None


def _union(options: Sequence[Keys | None]) -> Keys | None:
    out: set[Key] = set()
    for keys in options:
        if keys is None:
            return None
        out |= keys
    return frozenset(out)


def _hours(op: str, n: int, passing: bool) -> Keys:
    compare = HOUR_COMPARE[op]
    return frozenset(("hour", h) for h in _HOURS if h < 0 or compare(h, n) is passing)


def _not_false(node: Node) -> Keys | None:
    """Keys one of which every request hits unless ``node``'s screen is false."""
    if isinstance(node, AllOf):
        return _cheapest([_not_false(p) for p in node.parts])
    if isinstance(node, AnyOf):
        return _union([_not_false(p) for p in node.parts])
    if isinstance(node, Not):
        return _not_true(node.part)
    if isinstance(node, Const):
        return None if node.value else frozenset()
    if isinstance(node, Equals):
        return frozenset({("eq", node.field, node.lit)})
    if isinstance(node, Affix):
        return frozenset({("affix", node.field, node.how, node.lit)})
    if isinstance(node, HasKey):
        return frozenset({("has", node.key)})
    if isinstance(node, KeyExists) and node.how is None:
        return frozenset({("has", node.lit)})
    if isinstance(node, HeaderEquals):
        return frozenset({("header", node.key, node.lit)})
    if isinstance(node, InCidr):
        try:
            net = ipaddress.ip_network(node.cidr, strict=False)
        except ValueError:
            return None
        return frozenset({("cidr", net.version, net.prefixlen, int(net.network_address))})
    if isinstance(node, Hour):
        return _hours(node.op, node.n, True)
    return None


def _not_true(node: Node) -> Keys | None:
    """Keys one of which every request hits unless ``node``'s screen is true."""
    if isinstance(node, AllOf):
        return _union([_not_true(p) for p in node.parts])
    if isinstance(node, AnyOf):
        return _cheapest([_not_true(p) for p in node.parts])
    if isinstance(node, Not):
        return _not_false(node.part)
    if isinstance(node, Const):
        return frozenset() if node.value else None
    if isinstance(node, Hour):
        return _hours(node.op, node.n, False)
    return None


@dataclass(frozen=True)
class RuleIndex:
    """Bitmasks of rules (bit i: rule i) per lookup key; see the module docstring."""

    rules: int
    always: int  # rules with no condition: candidates for every request
    adapter_eq: Mapping[str, int]
    tenant_eq: Mapping[str, int]
    ip_eq: Mapping[str, int]
    # (on the adapter, else the tenant; a prefix, else a suffix; literal -> rules; the
    # literals' distinct lengths, ascending)
    affixes: tuple[tuple[bool, bool, Mapping[str, int], tuple[int, ...]], ...]
    has_key: Mapping[str, int]
    key_names: frozenset[str]  # has_key's keys
    # key -> (value -> rules, every rule comparing this key: the candidates when it is absent)
    header_eq: Mapping[str, tuple[Mapping[str, int], int]]
    # version -> (netmask, network -> rules) per distinct prefix length
    cidr: Mapping[int, tuple[tuple[int, Mapping[int, int]], ...]]
    hour: tuple[int, ...] | None  # hour + 1 -> rules (index 0: no hour taken)

    @property
    def indexed(self) -> int:
        """How many rules are found by lookups rather than visited for every request."""
        return self.rules - self.always.bit_count()

    def candidates(
        self, ip: str, tenant: str, headers: Mapping[str, str], adapter: str, hour: int
    ) -> int:
        """The bitmask of rules that can match this request (a superset, never a subset)."""
        found = self.always
        if self.adapter_eq:
            found |= self.adapter_eq.get(adapter, 0)
        if self.tenant_eq:
            found |= self.tenant_eq.get(tenant, 0)
        if self.ip_eq:
            found |= self.ip_eq.get(ip, 0)
        for on_adapter, prefix, by_lit, lengths in self.affixes:
            value = adapter if on_adapter else tenant
            size = len(value)
            for n in lengths:
                if n > size:
                    break
                found |= by_lit.get(value[:n] if prefix else value[size - n :], 0)
        if self.has_key:
            # A set intersection runs in C: 0.3 us for 13 headers against 1.3 us in a loop.
            for key in self.key_names.intersection(headers):
                found |= self.has_key[key]
        for key, (by_value, every) in self.header_eq.items():
            if key in headers:
                found |= by_value.get(headers[key], 0)
            else:
                found |= every
        if self.cidr:
            bits = address_bits(ip)
            if bits is not None:
                for netmask, by_net in self.cidr.get(bits[0], ()):
                    found |= by_net.get(bits[1] & netmask, 0)
        if self.hour is not None:
            found |= self.hour[hour + 1 if 0 <= hour < 24 else 0]
        return found


def members(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending: the candidate rules in rule order."""
    if not mask & (mask - 1):  # none or one: the common case for a well-indexed set
        return [mask.bit_length() - 1] if mask else []
    # str.find runs in C: about 0.1 us a candidate, against a Python loop over every bit.
    bits = bin(mask)[:1:-1]
    out: list[int] = []
    i = bits.find("1")
    while i >= 0:
        out.append(i)
        i = bits.find("1", i + 1)
    return out


def build_index(trees: Sequence[Node | None]) -> RuleIndex:
    """The index of a rule set from each rule's tree (None: a rule with no tree)."""
    always = 0
    eq: dict[str, dict[str, int]] = {"adapter": {}, "request.tenant": {}, "request.source_ip": {}}
    affix: dict[tuple[bool, bool], dict[str, int]] = {}
    has_key: dict[str, int] = {}
    header: dict[str, dict[str, int]] = {}
    cidr: dict[int, dict[int, dict[int, int]]] = {}
    hour: list[int] | None = None
    for i, tree in enumerate(trees):
        bit = 1 << i
        keys = None if tree is None else _not_false(tree)
        if keys is None:
            always |= bit
            continue
        for key in keys:
            kind = key[0]
            if kind == "eq":
                table = eq[str(key[1])]
                table[str(key[2])] = table.get(str(key[2]), 0) | bit
            elif kind == "affix":
                slot = affix.setdefault((key[1] == "adapter", key[2] == "startsWith"), {})
                slot[str(key[3])] = slot.get(str(key[3]), 0) | bit
            elif kind == "has":
                has_key[str(key[1])] = has_key.get(str(key[1]), 0) | bit
            elif kind == "header":
                values = header.setdefault(str(key[1]), {})
                values[str(key[2])] = values.get(str(key[2]), 0) | bit
            elif kind == "cidr":
                version, length, net = int(key[1]), int(key[2]), int(key[3])
                by_net = cidr.setdefault(version, {}).setdefault(length, {})
                by_net[net] = by_net.get(net, 0) | bit
            else:
                hour = hour or [0] * len(_HOURS)
                hour[int(key[1]) + 1] |= bit
    width = {4: 32, 6: 128}
    return RuleIndex(
        rules=len(trees),
        always=always,
        adapter_eq=eq["adapter"],
        tenant_eq=eq["request.tenant"],
        ip_eq=eq["request.source_ip"],
        affixes=tuple(
            (on_adapter, prefix, lits, tuple(sorted({len(lit) for lit in lits})))
            for (on_adapter, prefix), lits in affix.items()
        ),
        has_key=has_key,
        key_names=frozenset(has_key),
        header_eq={k: (v, _or_all(v.values())) for k, v in header.items()},
        cidr={
            version: tuple(
                ((1 << width[version]) - (1 << (width[version] - length)), nets)
                for length, nets in sorted(lengths.items())
            )
            for version, lengths in cidr.items()
        },
        hour=None if hour is None else tuple(hour),
    )


def _or_all(masks: Iterable[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out
