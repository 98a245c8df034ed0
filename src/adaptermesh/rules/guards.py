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
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Guard", "Screen", "screen"]

# A guard answers True, False, or None (cannot tell: CEL decides), from the source address,
# tenant, headers, adapter and the UTC hour of ``now`` (-1 when the set does not read ``now``).
Guard = Callable[[str, str, Mapping[str, str], str, int], "bool | None"]
_LIT = r'"([^"\\]*)"'
_FIELDS = ("adapter", "request.tenant", "request.source_ip")


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


def _atom(text: str, in_cidr: Callable[[str, str], bool]) -> Guard | None:
    if text == "true":
        return lambda ip, t, h, a, hr: True
    if text == "false":
        return lambda ip, t, h, a, hr: False
    fields = "|".join(re.escape(f) for f in _FIELDS)
    if m := re.fullmatch(rf"({fields})\s*==\s*{_LIT}", text):
        return _equals(m.group(1), m.group(2))
    if m := re.fullmatch(
        rf"(adapter|request\.tenant)\.(startsWith|endsWith)\(\s*{_LIT}\s*\)", text
    ):
        return _affix(m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(rf"{_LIT}\s+in\s+request\.headers", text):
        key = m.group(1)
        return lambda ip, t, h, a, hr: key in h
    if m := re.fullmatch(rf"request\.headers\[\s*{_LIT}\s*\]\s*==\s*{_LIT}", text):
        key, lit = m.group(1), m.group(2)
        return lambda ip, t, h, a, hr: (h[key] == lit) if key in h else None
    if m := re.fullmatch(rf"inCidr\(\s*request\.source_ip\s*,\s*{_LIT}\s*\)", text):
        return _cidr(m.group(1), in_cidr)
    if m := re.fullmatch(
        rf"request\.headers\.exists\(\s*([A-Za-z_]\w*)\s*,\s*\1\s*"
        rf"(?:\.\s*(startsWith|endsWith)\(\s*{_LIT}\s*\)|==\s*{_LIT})\s*\)",
        text,
    ):
        return _key_exists(m.group(2), m.group(3) if m.group(2) else m.group(4))
    if m := re.fullmatch(r"now\.getHours\(\)\s*(==|!=|<=|>=|<|>)\s*(-?\d{1,3})", text):
        return _hour(m.group(1), int(m.group(2)))
    return None


def _key_exists(how: str | None, lit: str) -> Guard:
    # CEL's exists over a map ranges over its keys; strings' startsWith never errors.
    if how == "startsWith":
        return lambda ip, t, h, a, hr: any(k.startswith(lit) for k in h)
    if how == "endsWith":
        return lambda ip, t, h, a, hr: any(k.endswith(lit) for k in h)
    return lambda ip, t, h, a, hr: lit in h


_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": int.__eq__, "!=": int.__ne__, "<": int.__lt__,
    "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__,
}


def _hour(op: str, n: int) -> Guard:
    # ``now.getHours()`` is the UTC hour, 0-23; an hour the evaluator did not take (-1) is
    # unknown and goes to CEL.
    compare = _COMPARE[op]
    return lambda ip, t, h, a, hr: None if hr < 0 else compare(hr, n)


@functools.lru_cache(maxsize=65536)
def _address_bits(ip: str) -> tuple[int, int] | None:
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
        bits = _address_bits(ip)
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


def _tree(src: str, in_cidr: Callable[[str, str], bool], unknown: list[int]) -> Guard:
    """The screen of ``src``; each unknown sub-expression appends to ``unknown``."""
    text = _unwrap(src.strip())
    for op, join in (("||", _any), ("&&", _all)):
        parts = _split(text, op)
        if parts is None:
            unknown.append(1)
            return _unknown
        if len(parts) > 1:
            return join([_tree(p, in_cidr, unknown) for p in parts])
    if text.startswith("!") and not text.startswith("!="):
        rest = _unwrap(text[1:].strip())
        if rest != text[1:].strip() or _atom(rest, in_cidr) is not None:
            return _not(_tree(rest, in_cidr, unknown))
    atom = _atom(text, in_cidr)
    if atom is None:
        unknown.append(1)
        return _unknown
    return atom


def screen(src: str, in_cidr: Callable[[str, str], bool]) -> Screen:
    """The Python screen of one rule's ``when``."""
    unknown: list[int] = []
    decide = _tree(src, in_cidr, unknown)
    if decide is _unknown:
        return Screen(None, False)
    return Screen(decide, not unknown)
