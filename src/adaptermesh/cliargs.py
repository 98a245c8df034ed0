"""Argument types shared by the processes' command lines (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = [
    "fraction",
    "non_negative_int",
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
