"""The part of a rule's ``when`` that the evaluator decides in Python before it pays for CEL.

Building a CEL activation for one request costs more than a dozen rules' Python checks (about
17 us on the 2-core CPU dev box for the request map alone, see docs/rules.md), so each rule is
screened first. Its ``when`` is read as a tree of ``||``, ``&&`` and ``!`` over simple atoms
(string literals without escapes):

    adapter == "x"   request.tenant == "x"   request.source_ip == "x"
    adapter.startsWith("x")   adapter.endsWith("x")   (and the same on request.tenant)
    "k" in request.headers   request.headers["k"] == "v"   inCidr(request.source_ip, "c")
    true   false

Any other sub-expression is unknown. The tree is evaluated with three values, true, false and
unknown, by CEL's own commutative logic: ``&&`` is false when any side is false whatever the
others give (errors included) and true when all are true; ``||`` the mirror image. A known
root decides the rule exactly as CEL would; an unknown root sends the rule to CEL. A missing
header key in ``request.headers["k"]`` is unknown (CEL's error value), never false.

``parse`` gives the tree itself (``AnyOf``, ``AllOf``, ``Not``, the atom nodes and ``Opaque``
for what is not read); ``screen`` turns it into a guard, and the rule index
(``rules/index.py``) derives its lookups from the same tree, so the two cannot disagree on
what an expression says.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "HOUR_COMPARE",
    "Affix",
    "AllOf",
    "AnyOf",
    "Const",
    "Equals",
    "Guard",
    "HasKey",
    "HeaderEquals",
    "Hour",
    "InCidr",
    "KeyExists",
    "Node",
    "Not",
    "Opaque",
    "Screen",
    "address_bits",
    "parse",
    "screen",
    "screen_of",
]

# A guard answers True, False, or None (cannot tell: CEL decides), from the source address,
# tenant, headers, adapter and the UTC hour of ``now`` (-1 when the set does not read ``now``).
Guard = Callable[[str, str, Mapping[str, str], str, int], "bool | None"]
_LIT = r'"([^"\\]*)"'
_FIELDS = ("adapter", "request.tenant", "request.source_ip")


# -- the tree ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: bool


@dataclass(frozen=True)
class Equals:
    field: str  # "adapter", "request.tenant" or "request.source_ip"
    lit: str


@dataclass(frozen=True)
class Affix:
    field: str  # "adapter" or "request.tenant"
    how: str  # "startsWith" or "endsWith"
    lit: str


@dataclass(frozen=True)
class HasKey:
    key: str  # "key" in request.headers


@dataclass(frozen=True)
class HeaderEquals:
    key: str  # request.headers["key"] == lit: unknown when the key is missing
    lit: str


@dataclass(frozen=True)
class InCidr:
    cidr: str  # inCidr(request.source_ip, cidr)


@dataclass(frozen=True)
class KeyExists:
    how: str | None  # request.headers.exists(k, k.startsWith/endsWith(lit)), None: k == lit
    lit: str


@dataclass(frozen=True)
class Hour:
    op: str  # now.getHours() <op> n
    n: int


@dataclass(frozen=True)
class Opaque:
    """A sub-expression the screen does not read: CEL decides it."""


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class AllOf:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    part: Node


Node = (Const | Equals | Affix | HasKey | HeaderEquals | InCidr | KeyExists | Hour | Opaque) | (
    AnyOf | AllOf | Not
)
_OPAQUE = Opaque()


@dataclass(frozen=True)
class Screen:
    # None when no part of the expression is known: straight to CEL.
    decide: Guard | None
    # Every atom is known: the screen decides unless a header key is missing.
    complete: bool


def _split(src: str, op: str) -> list[str] | None:
    """``src`` split at top-level ``op`` (``||`` or ``&&``); None when the top level has ``?:``
    (or, splitting on ``&&``, an ``||``, which binds looser)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(src):
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < len(src) and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            two = src[i : i + 2]
            if c in "?:" or (op == "&&" and two == "||"):
                return None
            if two == op:
                parts.append(src[start:i])
                start = i + 2
                i += 2
                continue
        i += 1
    parts.append(src[start:])
    return [p.strip() for p in parts]


def _unwrap(text: str) -> str:
    """``text`` without parentheses that enclose all of it."""
    while text.startswith("(") and _closing(text) == len(text) - 1:
        text = text[1:-1].strip()
    return text


def _closing(text: str) -> int:
    """The index of the bracket that closes ``text[0]``, skipping string literals."""
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        depth += c in "([{"
        depth -= c in ")]}"
        if depth == 0:
            return i
        i += 1
    return -1


def _atom(text: str) -> Node:
    if text in ("true", "false"):
        return Const(text == "true")
    fields = "|".join(re.escape(f) for f in _FIELDS)
    if m := re.fullmatch(rf"({fields})\s*==\s*{_LIT}", text):
        return Equals(m.group(1), m.group(2))
    if m := re.fullmatch(
        rf"(adapter|request\.tenant)\.(startsWith|endsWith)\(\s*{_LIT}\s*\)", text
    ):
        return Affix(m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(rf"{_LIT}\s+in\s+request\.headers", text):
        return HasKey(m.group(1))
    if m := re.fullmatch(rf"request\.headers\[\s*{_LIT}\s*\]\s*==\s*{_LIT}", text):
        return HeaderEquals(m.group(1), m.group(2))
    if m := re.fullmatch(rf"inCidr\(\s*request\.source_ip\s*,\s*{_LIT}\s*\)", text):
        return InCidr(m.group(1))
    if m := re.fullmatch(
        rf"request\.headers\.exists\(\s*([A-Za-z_]\w*)\s*,\s*\1\s*"
        rf"(?:\.\s*(startsWith|endsWith)\(\s*{_LIT}\s*\)|==\s*{_LIT})\s*\)",
        text,
    ):
        return KeyExists(m.group(2), m.group(3) if m.group(2) else m.group(4))
    if m := re.fullmatch(r"now\.getHours\(\)\s*(==|!=|<=|>=|<|>)\s*(-?\d{1,3})", text):
        return Hour(m.group(1), int(m.group(2)))
    return _OPAQUE


def parse(src: str) -> Node:
    """The tree of ``src``: ``||``, ``&&`` and ``!`` over the atoms the screen reads."""
    text = _unwrap(src.strip())
    for op, join in (("||", AnyOf), ("&&", AllOf)):
        parts = _split(text, op)
        if parts is None:
            return _OPAQUE
        if len(parts) > 1:
            return join(tuple(parse(p) for p in parts))
    if text.startswith("!") and not text.startswith("!="):
        rest = _unwrap(text[1:].strip())
        if rest != text[1:].strip() or not isinstance(_atom(rest), Opaque):
            return Not(parse(rest))
    return _atom(text)


def _opaque_inside(node: Node) -> bool:
    if isinstance(node, Opaque):
        return True
    if isinstance(node, AnyOf | AllOf):
        return any(_opaque_inside(p) for p in node.parts)
    if isinstance(node, Not):
        return _opaque_inside(node.part)
    return False


# -- guards ------------------------------------------------------------------------------------


def _equals(name: str, lit: str) -> Guard:
    if name == "adapter":
        return lambda ip, t, h, a, hr: a == lit
    if name == "request.tenant":
        return lambda ip, t, h, a, hr: t == lit
    return lambda ip, t, h, a, hr: ip == lit


def _affix(name: str, how: str, lit: str) -> Guard:
    if name == "adapter":
        if how == "startsWith":
            return lambda ip, t, h, a, hr: a.startswith(lit)
        return lambda ip, t, h, a, hr: a.endswith(lit)
    if how == "startsWith":
        return lambda ip, t, h, a, hr: t.startswith(lit)
    return lambda ip, t, h, a, hr: t.endswith(lit)


def _key_exists(how: str | None, lit: str) -> Guard:
    # CEL's exists over a map ranges over its keys; strings' startsWith never errors.
    if how == "startsWith":
        return lambda ip, t, h, a, hr: any(k.startswith(lit) for k in h)
    if how == "endsWith":
        return lambda ip, t, h, a, hr: any(k.endswith(lit) for k in h)
    return lambda ip, t, h, a, hr: lit in h


# now.getHours() <op> n, for the screens and the index alike.
HOUR_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": int.__eq__,
    "!=": int.__ne__,
    "<": int.__lt__,
    "<=": int.__le__,
    ">": int.__gt__,
    ">=": int.__ge__,
}


def _hour(op: str, n: int) -> Guard:
    # ``now.getHours()`` is the UTC hour, 0-23; an hour the evaluator did not take (-1) is
    # unknown and goes to CEL.
    compare = HOUR_COMPARE[op]
    return lambda ip, t, h, a, hr: None if hr < 0 else compare(hr, n)


@functools.lru_cache(maxsize=65536)
def address_bits(ip: str) -> tuple[int, int] | None:
    """(IP version, the address as an integer), or None for a string that is no address."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    return addr.version, int(addr)


def _cidr(cidr: str, in_cidr: Callable[[str, str], bool]) -> Guard:
    # Integer compare against a cached parse of the address: ipaddress's own `in` costs
    # several times more per rule. A CIDR that does not parse falls back to in_cidr.
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return lambda ip, t, h, a, hr: in_cidr(ip, cidr)
    version, mask, base = net.version, int(net.netmask), int(net.network_address)

    def decide(ip: str, t: str, h: Mapping[str, str], a: str, hr: int) -> bool | None:
        bits = address_bits(ip)
        return bits is not None and bits[0] == version and bits[1] & mask == base

    return decide


def _unknown(ip: str, t: str, h: Mapping[str, str], a: str, hr: int) -> bool | None:
    return None


def _any(parts: list[Guard]) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str, hr: int) -> bool | None:
        out: bool | None = False
        for p in parts:
            v = p(ip, t, h, a, hr)
            if v is True:
                return True
            if v is None:
                out = None
        return out

    return decide


def _all(parts: list[Guard]) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str, hr: int) -> bool | None:
        out: bool | None = True
        for p in parts:
            v = p(ip, t, h, a, hr)
            if v is False:
                return False
            if v is None:
                out = None
        return out

    return decide


def _not(part: Guard) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str, hr: int) -> bool | None:
        v = part(ip, t, h, a, hr)
        return None if v is None else not v

    return decide


def _guard(node: Node, in_cidr: Callable[[str, str], bool]) -> Guard:
    if isinstance(node, AnyOf):
        return _any([_guard(p, in_cidr) for p in node.parts])
    if isinstance(node, AllOf):
        return _all([_guard(p, in_cidr) for p in node.parts])
    if isinstance(node, Not):
        return _not(_guard(node.part, in_cidr))
    if isinstance(node, Const):
        value = node.value
        return lambda ip, t, h, a, hr: value
    if isinstance(node, Equals):
        return _equals(node.field, node.lit)
    if isinstance(node, Affix):
        return _affix(node.field, node.how, node.lit)
    if isinstance(node, HasKey):
        key = node.key
        return lambda ip, t, h, a, hr: key in h
    if isinstance(node, HeaderEquals):
        key, lit = node.key, node.lit
        return lambda ip, t, h, a, hr: (h[key] == lit) if key in h else None
    if isinstance(node, InCidr):
        return _cidr(node.cidr, in_cidr)
    if isinstance(node, KeyExists):
        return _key_exists(node.how, node.lit)
    if isinstance(node, Hour):
        return _hour(node.op, node.n)
    return _unknown


def screen(src: str, in_cidr: Callable[[str, str], bool]) -> Screen:
    """The Python screen of one rule's ``when``."""
    return screen_of(parse(src), in_cidr)


def screen_of(tree: Node, in_cidr: Callable[[str, str], bool]) -> Screen:
    """The Python screen of a parsed ``when``."""
    if isinstance(tree, Opaque):
        return Screen(None, False)
    return Screen(_guard(tree, in_cidr), not _opaque_inside(tree))
