"""Strict checks of JSON Schema's string formats, written apart from the worker's patterns (by
hand, over the standard library), so a wrong pattern cannot agree with itself: what the
grammar generates for a format must pass these and jsonschema's format checker.

``strict_format_errors(schema, instance)`` lists the values at the schema's ``format``
positions that fail; ``duplicate_keys(text)`` parses JSON and lists repeated keys.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import string
import uuid
from typing import Any

import jsonschema

_ATEXT = set(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-")
_LDH = set(string.ascii_letters + string.digits + "-")
_DIGITS = set(string.digits)
_UNRESERVED = set(string.ascii_letters + string.digits + "-._~")
_SUB_DELIMS = set("!$&'()*+,;=")
_HEX = set(string.hexdigits)


def _date(value: str) -> bool:
    if len(value) != 10 or value[4] != "-" or value[7] != "-":
        return False
    if not set(value[:4] + value[5:7] + value[8:]) <= _DIGITS:
        return False
    try:
        datetime.date(int(value[:4]), int(value[5:7]), int(value[8:]))  # year >= 1
    except ValueError:
        return False
    return True


def _time(value: str) -> bool:
    """RFC 3339 full-time, second 60 refused (the worker's stated rule), as Python reads it."""
    if len(value) < 9 or value[2] != ":" or value[5] != ":":
        return False
    hh, mm, ss = value[:2], value[3:5], value[6:8]
    if not set(hh + mm + ss) <= _DIGITS or int(hh) > 23 or int(mm) > 59 or int(ss) > 59:
        return False
    rest = value[8:]
    if rest.startswith("."):
        digits = 0
        while 1 + digits < len(rest) and rest[1 + digits] in _DIGITS:
            digits += 1
        if digits == 0:
            return False
        rest = rest[1 + digits :]
    if rest == "Z":
        ok = True
    elif len(rest) == 6 and rest[0] in "+-" and rest[3] == ":":
        oh, om = rest[1:3], rest[4:6]
        ok = set(oh + om) <= _DIGITS and int(oh) <= 23 and int(om) <= 59
    else:
        ok = False
    if not ok:
        return False
    try:
        datetime.time.fromisoformat(value)
    except ValueError:
        return False
    return True


def _date_time(value: str) -> bool:
    if len(value) < 11 or value[10] != "T" or not _date(value[:10]) or not _time(value[11:]):
        return False
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _number_then(text: str, i: int, letters: str) -> tuple[int, str] | None:
    j = i
    while j < len(text) and text[j] in _DIGITS:
        j += 1
    if j == i or j >= len(text) or text[j] not in letters:
        return None
    return j + 1, text[j]


def _duration(value: str) -> bool:
    """RFC 3339 appendix A, read designator by designator."""
    if not value.startswith("P") or len(value) < 3:
        return False
    i, date_part, time_part = 1, [], []
    while i < len(value) and value[i] != "T":
        step = _number_then(value, i, "YMWD")
        if step is None:
            return False
        i, unit = step
        date_part.append(unit)
    if i < len(value):
        i += 1
        if i >= len(value):
            return False
        while i < len(value):
            step = _number_then(value, i, "HMS")
            if step is None:
                return False
            i, unit = step
            time_part.append(unit)
    if "W" in date_part:
        return date_part == ["W"] and not time_part
    allowed_dates = ([], ["D"], ["M"], ["M", "D"], ["Y"], ["Y", "M"], ["Y", "M", "D"])
    allowed_times = ([], ["H"], ["H", "M"], ["H", "M", "S"], ["M"], ["M", "S"], ["S"])
    if date_part not in allowed_dates or time_part not in allowed_times:
        return False
    return bool(date_part or time_part)


def _hostname(value: str) -> bool:
    if not 1 <= len(value) <= 253:
        return False
    for label in value.split("."):
        if not 1 <= len(label) <= 63 or not set(label) <= _LDH:
            return False
        if label[0] == "-" or label[-1] == "-":
            return False
    return True


def _email(value: str) -> bool:
    if len(value) > 254 or value.count("@") < 1:
        return False
    local, _, domain = value.rpartition("@")
    if not 1 <= len(local) <= 64 or "@" in local:
        return False
    if any(not atom or not set(atom) <= _ATEXT for atom in local.split(".")):
        return False
    labels = domain.split(".")
    return len(labels) >= 2 and _hostname(domain) and labels[-1][0].isalpha()


def _ipv4(value: str) -> bool:
    parts = value.split(".")
    if len(parts) != 4:
        return False
    for part in parts:
        if not part or not set(part) <= _DIGITS or (len(part) > 1 and part[0] == "0"):
            return False
        if int(part) > 255:
            return False
    ipaddress.IPv4Address(value)
    return True


def _ipv6(value: str) -> bool:
    if "%" in value:
        return False
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


def _uuid(value: str) -> bool:
    if len(value) != 36 or [i for i, c in enumerate(value) if c == "-"] != [8, 13, 18, 23]:
        return False
    if not set(value.replace("-", "")) <= _HEX:
        return False
    uuid.UUID(value)
    return True


def _pct_ok(text: str, extra: set[str]) -> bool:
    i = 0
    while i < len(text):
        char = text[i]
        if char == "%":
            code = text[i + 1 : i + 3]
            if len(code) != 2 or not set(code) <= _HEX:
                return False
            i += 3
            continue
        if char not in _UNRESERVED and char not in _SUB_DELIMS and char not in extra:
            return False
        i += 1
    return True


def _authority(text: str) -> bool:
    userinfo, at, hostport = text.rpartition("@")
    if at and not _pct_ok(userinfo, {":"}):
        return False
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0:
            return False
        literal, rest = hostport[1:end], hostport[end + 1 :]
        if literal[:1] in ("v", "V"):
            version, dot, tail = literal[1:].partition(".")
            if not dot or not version or not set(version) <= _HEX or not tail:
                return False
            if not _pct_ok(tail, {":"}) or "%" in tail:
                return False
        elif not _ipv6(literal):
            return False
    else:
        host, colon, port = hostport.partition(":")
        rest = colon + port
        if not _pct_ok(host, set()):
            return False
    if rest:
        return rest.startswith(":") and set(rest[1:]) <= _DIGITS
    return True


def _path_query_fragment(text: str) -> bool:
    text, hash_, fragment = text.partition("#")
    if hash_ and not _pct_ok(fragment, {":", "@", "/", "?"}):
        return False
    path, question, query = text.partition("?")
    if question and not _pct_ok(query, {":", "@", "/", "?"}):
        return False
    return all(_pct_ok(segment, {":", "@"}) for segment in path.split("/"))


def _split_hier(text: str) -> tuple[str | None, str]:
    """(authority or None, the rest) of a hier-part or relative-part."""
    if text.startswith("//"):
        end = len(text)
        for stop in "/?#":
            at = text.find(stop, 2)
            if at >= 0:
                end = min(end, at)
        return text[2:end], text[end:]
    return None, text


def _uri(value: str) -> bool:
    scheme, colon, rest = value.partition(":")
    if not colon or not scheme or not scheme[0].isascii() or not scheme[0].isalpha():
        return False
    if not set(scheme) <= set(string.ascii_letters + string.digits + "+-."):
        return False
    authority, rest = _split_hier(rest)
    if authority is not None and not _authority(authority):
        return False
    return _path_query_fragment(rest)


def _uri_reference(value: str) -> bool:
    if _uri(value):
        return True
    authority, rest = _split_hier(value)
    if authority is not None:
        return _authority(authority) and _path_query_fragment(rest)
    first = rest.split("/")[0].split("?")[0].split("#")[0]
    if ":" in first:  # a relative path's first segment has no colon
        return False
    return _path_query_fragment(rest)


def _json_pointer(value: str) -> bool:
    if value and not value.startswith("/"):
        return False
    for token in value.split("/")[1:]:
        i = 0
        while i < len(token):
            if token[i] == "~":
                if token[i + 1 : i + 2] not in ("0", "1"):
                    return False
                i += 2
                continue
            i += 1
    return True


def _uuid_version(version: int) -> Any:
    def check(value: str) -> bool:
        # Python reads a version only for the RFC variant, as pydantic's UUIDn fields do.
        return _uuid(value) and uuid.UUID(value).version == version

    return check


CHECKS = {
    "date": _date,
    "time": _time,
    "date-time": _date_time,
    "duration": _duration,
    "email": _email,
    "hostname": _hostname,
    "ipv4": _ipv4,
    "ipv6": _ipv6,
    "uuid": _uuid,
    **{f"uuid{v}": _uuid_version(v) for v in range(1, 9)},
    "ipvanyaddress": lambda value: _ipv4(value) or _ipv6(value),
    "uri": _uri,
    "uri-reference": _uri_reference,
    "json-pointer": _json_pointer,
}


def strict_format_errors(schema: Any, instance: Any, root: Any = None) -> list[tuple[str, Any]]:
    """``(format, value)`` for each string at a ``format`` of ``schema`` (through
    properties, patternProperties, additionalProperties, items, prefixItems, local ``$ref``,
    allOf, anyOf and oneOf) that fails its strict check."""
    errors: list[tuple[str, Any]] = []
    root = schema if root is None else root

    def walk(sub: Any, value: Any) -> None:
        if not isinstance(sub, dict):
            return
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target = root
            for part in ref[2:].split("/"):
                target = target[part]
            walk(target, value)
        for part in sub.get("allOf", []):
            walk(part, value)
        name = sub.get("format")
        types = sub.get("type")
        admits_strings = types is None or types == "string" or "string" in types
        strict = isinstance(name, str) and isinstance(value, str) and admits_strings
        if strict and not CHECKS[name](value):
            errors.append((name, value))
        branches = sub.get("anyOf", []) + sub.get("oneOf", [])
        if branches:
            # One branch that the value meets, strictly, is enough.
            found = []
            for branch in branches:
                if not jsonschema.Draft202012Validator({**branch, "$defs": {}}).is_valid(value):
                    continue
                found.append(strict_format_errors(branch, value, root))
            if found and not any(branch_errors == [] for branch_errors in found):
                errors.extend(found[0])
        if isinstance(value, dict):
            properties = sub.get("properties", {})
            for key, item in value.items():
                matched = False
                if key in properties:
                    walk(properties[key], item)
                    matched = True
                for pattern, pattern_schema in sub.get("patternProperties", {}).items():
                    if re.search(pattern, key):
                        walk(pattern_schema, item)
                        matched = True
                if not matched:
                    walk(sub.get("additionalProperties"), item)
        if isinstance(value, list):
            prefix = sub.get("prefixItems", [])
            for index, item in enumerate(value):
                walk(prefix[index] if index < len(prefix) else sub.get("items"), item)

    walk(schema, instance)
    return errors


def duplicate_keys(text: str) -> list[str]:
    """The keys that some object of the JSON ``text`` repeats (a strict parse: ValueError
    when it is not JSON)."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                repeated.append(key)
            seen.add(key)
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return repeated
