"""Argument types shared by the processes' command lines (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse

__all__ = ["port"]


def port(text: str) -> int:
    """A TCP port, 0 (pick one / off, where the flag says so) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535")
    return value
