"""Argument types shared by the processes' command lines (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import math
import re
from fractions import Fraction
from pathlib import Path

__all__ = [
    "DURATION_UNITS",
    "MAX_DURATION_S",
    "fraction",
    "non_negative_float",
    "non_negative_int",
    "parse_duration",
    "percent",
    "port",
    "positive_float",
    "positive_int",
    "read_secret",
]


def port(text: str) -> int:
    """A TCP port, 0 (pick one / off, where the flag says so) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535")
    return value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A whole number, at least 1 (a count, a size in bytes or tokens)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def non_negative_int(text: str) -> int:
    """A whole number, 0 or more (a limit where 0 means none)."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds, an interval)."""
    value = _finite(text)
    if not (math.isfinite(value) and value > 0.0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def non_negative_float(text: str) -> float:
    """A finite number, 0 or more (seconds where 0 means none)."""
    value = _finite(text)
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 0 or more")
    return value


def fraction(text: str) -> float:
    """A share in 0..1 (a sampling ratio)."""
    value = _finite(text)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in 0-1")
    return value


def percent(text: str) -> float:
    """A percentage in 0..100."""
    value = _finite(text)
    if not (math.isfinite(value) and 0.0 <= value <= 100.0):
        raise argparse.ArgumentTypeError(f"{text!r} is not in 0-100")
    return value


def read_secret(path: Path, flag: str) -> str:
    """The token or password in ``path``, stripped; ValueError naming ``flag`` when the file
    cannot be read or holds nothing (a process must not start with an empty secret)."""
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text


# Seconds per unit of a duration: ``800ms``, ``90`` or ``90s``, ``2m``, ``1h``, ``7d``.
DURATION_UNITS = {
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
}
_UNIT_NAMES = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# Ten years (365-day years): no timeout, TTL or interval is meant to be longer.
MAX_DURATION_S = 10 * 365 * 86400
_DURATION = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<unit>ms|s|m|h|d)?")


def parse_duration(
    text: str,
    flag: str,
    *,
    unit: str = "s",
    zero_ok: bool = False,
    whole: bool = False,
    maximum_s: int = MAX_DURATION_S,
) -> float:
    """A duration given as a plain decimal number and an optional unit (``ms``, ``s``, ``m``,
    ``h``, ``d``; a bare number is in ``unit``), returned in ``unit``.

    Refused with a one-line ValueError naming ``flag``: anything else (signs, exponents,
    ``inf``, ``nan``, unknown units), zero unless ``zero_ok``, a fraction of ``unit`` when
    ``whole``, and anything above ``maximum_s`` seconds. The arithmetic is exact, so
    ``1500ms`` is 1.5 s and ``90000ms`` a whole 90 s.
    """
    raw = str(text)
    shown = repr(raw) if len(raw) <= 40 else repr(raw[:40] + "...")
    match = _DURATION.fullmatch(raw.strip().lower()) if len(raw) <= 64 else None
    if match is None:
        raise ValueError(f"{flag}: {shown} is not a duration such as 90, 90s, 2m, 1h or 800ms")
    seconds = Fraction(match["number"]) * DURATION_UNITS[match["unit"] or unit]
    if seconds > maximum_s:
        limit = "10 years" if maximum_s == MAX_DURATION_S else f"{maximum_s} s"
        raise ValueError(f"{flag}: {shown} is longer than {limit}")
    if seconds == 0 and not zero_ok:
        raise ValueError(f"{flag}: {shown} must be longer than 0")
    value = seconds / DURATION_UNITS[unit]
    if whole and value.denominator != 1:
        raise ValueError(f"{flag}: {shown} is not a whole number of {_UNIT_NAMES[unit]}")
    return float(value)
