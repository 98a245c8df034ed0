"""JSON Schema's string formats as regular expressions the grammar enforces exactly.

llguidance's own format regexes admit values no validator accepts (year 0000, second 60 at
any time), so the worker replaces every ``format`` with a ``pattern`` of its own before the
schema compiles (``schema_rules.enforceable_schema``). Each pattern matches a subset of the
format's ABNF (RFC 3339, RFC 3986, RFC 4291, RFC 1123, RFC 5321/5322, RFC 6901, RFC 9562)
that every common validator accepts: what the grammar generates always validates, and the
subset is stated where it is narrower than the RFC.

* ``date`` (RFC 3339 full-date): years 0001 to 9999 (Python, pydantic and jsonschema refuse
  0000), days per month, 29 February only in leap years (Gregorian rule).
* ``time`` (RFC 3339 full-time): seconds 00 to 59. A leap second (60) is valid only at
  23:59:60 UTC at the end of a month in which one was inserted, which no schema or validator
  can know ahead of time, and Python's ``datetime`` refuses any second 60: it is never
  generated. Fractions have 1 to 6 digits (Python's microseconds); ``T`` and ``Z`` are upper
  case; the offset is ``Z`` or ``+hh:mm`` / ``-hh:mm`` with hh 00 to 23.
* ``date-time``: ``date`` ``T`` ``time``.
* ``duration`` (RFC 3339 appendix A): ``P`` with years, months, days, weeks and a ``T`` part
  in that grammar's order; each number has 1 to 9 digits.
* ``email``: a dot-atom local part (RFC 5322 atext, at most 64 characters) ``@`` a host name
  of at least two labels whose last label starts with a letter; at most 254 characters. No
  quoted local parts or address literals.
* ``hostname`` (RFC 1123): dot-separated labels of 1 to 63 letters, digits and hyphens, not
  starting or ending with a hyphen; at most 253 characters; no trailing dot.
* ``ipv4``: dotted decimal, 0 to 255, no leading zeros (Python's ``ipaddress`` refuses them).
* ``ipv6`` (RFC 4291 text form, as RFC 3986's IPv6address): with ``::`` compression and an
  IPv4 tail; no zone index.
* ``uuid`` (RFC 9562): 8-4-4-4-12 hexadecimal digits, either case; pydantic's ``uuid1`` to
  ``uuid8`` (``UUID4`` fields and the like) also fix the version digit and the RFC variant.
* ``ipvanyaddress`` (pydantic's ``IPvAnyAddress``): ``ipv4`` or ``ipv6``.
* ``uri`` (RFC 3986 URI) and ``uri-reference`` (URI or relative reference): ASCII, with
  percent-encoding.
* ``json-pointer`` (RFC 6901).

Every other format name (``idn-email``, ``idn-hostname``, ``iri``, ``iri-reference``,
``uri-template``, ``relative-json-pointer``, ``regex``, and any unknown name) is refused with
a 400 naming the schema path: a format the grammar cannot enforce would be a promise broken.
"""

from __future__ import annotations

__all__ = ["ENFORCED_FORMATS", "format_patterns"]

_YEAR = r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
# Multiples of 4 from 04 to 96, as two digits.
_BY_FOUR = r"(?:0[48]|[2468][048]|[13579][26])"
# Divisible by 4 and not by 100, or by 400 (0000 is no year).
_LEAP_YEAR = rf"(?:[0-9]{{2}}{_BY_FOUR}|{_BY_FOUR}00)"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
    rf"|{_LEAP_YEAR}-02-29)"
)
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_N = r"[0-9]{1,9}"
_DUR_TIME = rf"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DUR_DATE = rf"(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)"
_DURATION = rf"P(?:{_DUR_DATE}(?:{_DUR_TIME})?|{_DUR_TIME}|{_N}W)"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
_H16 = r"[0-9A-Fa-f]{1,4}"
_LS32 = rf"(?:{_H16}:{_H16}|{_IPV4})"


def _groups_before(most: int) -> str:
    """Up to ``most`` + 1 h16 groups before a ``::`` (RFC 3986's ``[ *n( h16 ":" ) h16 ]``)."""
    if most < 0:
        return ""
    return rf"(?:(?:{_H16}:){{0,{most}}}{_H16})?"


_IPV6 = (
    "(?:"
    + "|".join(
        [
            rf"(?:{_H16}:){{6}}{_LS32}",
            rf"::(?:{_H16}:){{5}}{_LS32}",
            rf"{_groups_before(0)}::(?:{_H16}:){{4}}{_LS32}",
            rf"{_groups_before(1)}::(?:{_H16}:){{3}}{_LS32}",
            rf"{_groups_before(2)}::(?:{_H16}:){{2}}{_LS32}",
            rf"{_groups_before(3)}::{_H16}:{_LS32}",
            rf"{_groups_before(4)}::{_LS32}",
            rf"{_groups_before(5)}::{_H16}",
            rf"{_groups_before(6)}::",
        ]
    )
    + ")"
)
_HEX4 = r"[0-9A-Fa-f]{4}"
_UUID = rf"[0-9A-Fa-f]{{8}}-{_HEX4}-{_HEX4}-{_HEX4}-[0-9A-Fa-f]{{12}}"


def _uuid_version(version: int) -> str:
    return rf"[0-9A-Fa-f]{{8}}-{_HEX4}-{version}[0-9A-Fa-f]{{3}}-[89ABab][0-9A-Fa-f]{{3}}-[0-9A-Fa-f]{{12}}"


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL})*"
_TOP_LABEL = r"[A-Za-z](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = rf"{_ATEXT}+(?:\.{_ATEXT}+)*@(?:{_LABEL}\.)+{_TOP_LABEL}"
_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})"
_SEGMENT_NC = rf"(?:[A-Za-z0-9._~!$&'()*+,;=@-]|{_PCT})"
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*"
_USERINFO = rf"(?:[A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*"
_IP_LITERAL = rf"\[(?:{_IPV6}|v[0-9A-Fa-f]+\.[A-Za-z0-9._~!$&'()*+,;=:-]+)\]"
_REG_NAME = rf"(?:[A-Za-z0-9._~!$&'()*+,;=-]|{_PCT})*"
_AUTHORITY = rf"(?:{_USERINFO}@)?(?:{_IP_LITERAL}|{_REG_NAME})(?::[0-9]*)?"
_PATH_ABEMPTY = rf"(?:/{_PCHAR}*)*"
_PATH_ABSOLUTE = rf"/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?"
_PATH_ROOTLESS = rf"{_PCHAR}+(?:/{_PCHAR}*)*"
_PATH_NOSCHEME = rf"{_SEGMENT_NC}+(?:/{_PCHAR}*)*"
_QUERY = rf"(?:{_PCHAR}|[/?])*"
_HIER = rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_PATH_ROOTLESS})?"
_URI = rf"{_SCHEME}:{_HIER}(?:\?{_QUERY})?(?:#{_QUERY})?"
_RELATIVE = (
    rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_PATH_NOSCHEME})?"
    rf"(?:\?{_QUERY})?(?:#{_QUERY})?"
)
_JSON_POINTER = r"(?:/(?:[^~/]|~[01])*)*"

# Each format: the patterns a value must match, all of them (length limits are intersected
# with the structure rather than written into it).
_FORMATS: dict[str, tuple[str, ...]] = {
    "date": (_DATE,),
    "time": (_TIME,),
    "date-time": (rf"{_DATE}T{_TIME}",),
    "duration": (_DURATION,),
    "email": (_EMAIL, r"[^@]{1,64}@.*", r".{1,254}"),
    "hostname": (_HOSTNAME, r".{1,253}"),
    "ipv4": (_IPV4,),
    "ipv6": (_IPV6,),
    "ipvanyaddress": (f"(?:{_IPV4}|{_IPV6})",),
    "uuid": (_UUID,),
    **{f"uuid{version}": (_uuid_version(version),) for version in range(1, 9)},
    "uri": (_URI,),
    "uri-reference": (f"(?:{_URI}|{_RELATIVE})",),
    "json-pointer": (_JSON_POINTER,),
}
ENFORCED_FORMATS = tuple(_FORMATS)


def format_patterns(name: str) -> tuple[str, ...] | None:
    """The anchored patterns a string of format ``name`` must match, or None when the format
    is not one the worker enforces."""
    patterns = _FORMATS.get(name)
    if patterns is None:
        return None
    return tuple(f"^{pattern}$" for pattern in patterns)
