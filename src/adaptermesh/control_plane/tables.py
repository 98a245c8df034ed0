"""Per-worker and per-rollout tables that must not outlive what they are about."""

from __future__ import annotations

from collections.abc import Container, MutableMapping
from typing import TypeVar

__all__ = ["keep_only"]

K = TypeVar("K")
V = TypeVar("V")


def keep_only(table: MutableMapping[K, V], wanted: Container[K]) -> None:
    """Drop every entry of ``table`` whose key is not in ``wanted`` (a worker no longer
    listed, a rollout no longer in progress)."""
    for key in [k for k in table if k not in wanted]:
        del table[key]
