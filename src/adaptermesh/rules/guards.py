"""Conjuncts that the evaluator decides in Python before it pays for a CEL evaluation.

Building a CEL activation for one request costs more than a dozen rules' Python checks (about
17 us on the 2-core CPU dev box for the request map alone, see docs/rules.md), so a rule whose
``when`` is a top-level ``&&`` of simple conjuncts is screened first: one false conjunct decides
the rule false (CEL's ``&&`` gives false whatever the other conjuncts give, errors included),
and a rule made only of conjuncts that all hold is decided true. Anything else goes to CEL.
The conjunct forms (string literals without escapes):

    adapter == "x"   request.tenant == "x"   request.source_ip == "x"
    adapter.startsWith("x")   adapter.endsWith("x")   (and the same on request.tenant)
    "k" in request.headers   request.headers["k"] == "v"   inCidr(request.source_ip, "c")
    true   false
"""

from __future__ import annotations

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
    guards: tuple[Guard, ...]
    # Every conjunct is a guard: all True decides the rule true without CEL.
    complete: bool


def _split_and(src: str) -> list[str] | None:
    """The top-level ``&&`` conjuncts, or None when the top level has ``||`` or ``?:``."""
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
            if two == "||" or c in "?:":
                return None
            if two == "&&":
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


def _guard(conjunct: str, in_cidr: Callable[[str, str], bool]) -> Guard | None:
    text = _unwrap(conjunct)
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
        # A missing key is CEL's error value, not false: leave that case to CEL.
        return lambda ip, t, h, a: (h[key] == lit) if key in h else None
    if m := re.fullmatch(rf"inCidr\(\s*request\.source_ip\s*,\s*{_LIT}\s*\)", text):
        cidr = m.group(1)
        return lambda ip, t, h, a: in_cidr(ip, cidr)
    return None


def screen(src: str, in_cidr: Callable[[str, str], bool]) -> Screen:
    """The guards of ``src``'s top-level conjuncts (none when it is not a conjunction)."""
    parts = _split_and(src)
    if parts is None:
        return Screen((), False)
    guards = [g for g in (_guard(p, in_cidr) for p in parts) if g is not None]
    return Screen(tuple(guards), len(guards) == len(parts))
