"""Adapter version splits (gray release) as the agent's external processor applies them.

The Assignment's ``adapter_splits`` say, per adapter, which version serves which share of its
clients. A client is its session (the ``x-session-id`` header) when it sends one, else its
source address. Its bucket is a hash of the rollout id and that key into 0..9,999, and it gets
the new (canary) version when the bucket is below the canary share. So a client stays on one
version while the share is unchanged, a client already on the new version stays there as the
share grows, and each rollout draws its clients afresh.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from adaptermesh.assignment_rules import WEIGHT_BUDGET, served_name
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = ["SESSION_HEADER", "Pick", "SplitTable", "bucket"]

SESSION_HEADER = "x-session-id"


def bucket(rollout_id: str, key: str) -> int:
    """The client's place in 0..WEIGHT_BUDGET-1 for this rollout."""
    digest = hashlib.blake2b(f"{rollout_id}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % WEIGHT_BUDGET


@dataclass(frozen=True, slots=True)
class Pick:
    version: str
    # The adapter name the workers serve that version under ("a@v", or "a" for "").
    served: str
    canary: bool


class SplitTable:
    """The splits of one Assignment, rebuilt only when the Assignment object changes."""

    def __init__(self) -> None:
        self._source: assignment_pb2.Assignment | None = None
        self._splits: dict[str, assignment_pb2.AdapterSplit] = {}

    def refresh(self, assignment: assignment_pb2.Assignment | None) -> None:
        if assignment is self._source:
            return
        self._source = assignment
        self._splits = {s.adapter: s for s in assignment.adapter_splits} if assignment else {}

    def __len__(self) -> int:
        return len(self._splits)

    def pick(self, adapter: str, key: str) -> Pick | None:
        """The version ``adapter``'s request from client ``key`` goes to; None: no split."""
        split = self._splits.get(adapter)
        if split is None:
            return None
        canary = bool(split.canary_version) and (
            split.canary_share >= WEIGHT_BUDGET
            or bucket(split.rollout_id, key) < split.canary_share
        )
        version = split.canary_version if canary else split.stable_version
        return Pick(version, served_name(adapter, version), canary)
