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

# A guard answers True, False, or None (cannot tell: CEL decides).
Guard = Callable[[str, str, Mapping[str, str], str], "bool | None"]
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
        return lambda ip, t, h, a: a == lit
    if name == "request.tenant":
        return lambda ip, t, h, a: t == lit
    return lambda ip, t, h, a: ip == lit


def _affix(name: str, how: str, lit: str) -> Guard:
    if name == "adapter":
        if how == "startsWith":
            return lambda ip, t, h, a: a.startswith(lit)
        return lambda ip, t, h, a: a.endswith(lit)
    if how == "startsWith":
        return lambda ip, t, h, a: t.startswith(lit)
    return lambda ip, t, h, a: t.endswith(lit)


def _atom(text: str, in_cidr: Callable[[str, str], bool]) -> Guard | None:
    if text == "true":
        return lambda ip, t, h, a: True
    if text == "false":
        return lambda ip, t, h, a: False
    fields = "|".join(re.escape(f) for f in _FIELDS)
    if m := re.fullmatch(rf"({fields})\s*==\s*{_LIT}", text):
        return _equals(m.group(1), m.group(2))
    if m := re.fullmatch(
        rf"(adapter|request\.tenant)\.(startsWith|endsWith)\(\s*{_LIT}\s*\)", text
    ):
        return _affix(m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(rf"{_LIT}\s+in\s+request\.headers", text):
        key = m.group(1)
        return lambda ip, t, h, a: key in h
    if m := re.fullmatch(rf"request\.headers\[\s*{_LIT}\s*\]\s*==\s*{_LIT}", text):
        key, lit = m.group(1), m.group(2)
        return lambda ip, t, h, a: (h[key] == lit) if key in h else None
    if m := re.fullmatch(rf"inCidr\(\s*request\.source_ip\s*,\s*{_LIT}\s*\)", text):
        return _cidr(m.group(1), in_cidr)
    return None


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
        return lambda ip, t, h, a: in_cidr(ip, cidr)
    version, mask, base = net.version, int(net.netmask), int(net.network_address)

    def decide(ip: str, t: str, h: Mapping[str, str], a: str) -> bool | None:
        bits = _address_bits(ip)
        return bits is not None and bits[0] == version and bits[1] & mask == base

    return decide


def _unknown(ip: str, t: str, h: Mapping[str, str], a: str) -> bool | None:
    return None


def _any(parts: list[Guard]) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str) -> bool | None:
        out: bool | None = False
        for p in parts:
            v = p(ip, t, h, a)
            if v is True:
                return True
            if v is None:
                out = None
        return out

    return decide


def _all(parts: list[Guard]) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str) -> bool | None:
        out: bool | None = True
        for p in parts:
            v = p(ip, t, h, a)
            if v is False:
                return False
            if v is None:
                out = None
        return out

    return decide


def _not(part: Guard) -> Guard:
    def decide(ip: str, t: str, h: Mapping[str, str], a: str) -> bool | None:
        v = part(ip, t, h, a)
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
