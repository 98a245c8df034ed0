"""Per-shard load facts from the classifier's counters and its new-flow events.

``am_stats`` gives cumulative packets, bytes and new flows per shard index; rates are the
difference between two reads divided by the time between them. ``am_events`` says which shard
each new flow got; the tracker keeps the latest shard per source address and counts a flow as
active while it has been seen within ``active_window_s`` (the classifier only reports a flow
when it starts or is re-picked, so "active" means "started or re-picked within the window").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from adaptermesh.agent.ports import FlowEvent, ShardStats

__all__ = ["LoadTracker", "ShardRates"]


@dataclass(frozen=True, slots=True)
class ShardRates:
    shard_index: int
    packets_per_s: float
    bytes_per_s: float
    new_flows_per_s: float
    active_flows: int
    packets_total: int
    bytes_total: int
    new_flows_total: int


class LoadTracker:
    """Thread-safe: the ring-buffer thread calls ``on_event``, the event loop the rest."""

    def __init__(self, active_window_s: float = 60.0, max_sources: int = 1_000_000) -> None:
        self.active_window_s = active_window_s
        # Bounded so that a scan from millions of spoofed sources cannot grow the agent forever.
        self.max_sources = max_sources
        self._lock = threading.Lock()
        self._sources: dict[str, tuple[int, float]] = {}
        self._events_total = 0
        self._events_by_reason: dict[str, int] = {}
        self._prev: Mapping[int, ShardStats] | None = None
        self._prev_t = 0.0
        self._last: dict[int, ShardRates] = {}
        self.counters: dict[str, int] = {}

    @property
    def events_total(self) -> int:
        return self._events_total

    def events_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._events_by_reason)

    def on_event(self, event: FlowEvent, now: float) -> None:
        with self._lock:
            self._events_total += 1
            self._events_by_reason[event.reason] = self._events_by_reason.get(event.reason, 0) + 1
            source = str(event.source)
            if source not in self._sources and len(self._sources) >= self.max_sources:
                self._prune_locked(now)
                if len(self._sources) >= self.max_sources:
                    return
            self._sources[source] = (event.shard, now)

    def _prune_locked(self, now: float) -> None:
        cutoff = now - self.active_window_s
        stale = [src for src, (_, seen) in self._sources.items() if seen < cutoff]
        for src in stale:
            del self._sources[src]

    def flows(self, now: float) -> list[tuple[str, int, float]]:
        """(source, shard index, seconds since its event) for every active flow."""
        with self._lock:
            self._prune_locked(now)
            return [(src, shard, now - seen) for src, (shard, seen) in self._sources.items()]

    def active_flows(self, now: float) -> dict[int, int]:
        with self._lock:
            self._prune_locked(now)
            counts: dict[int, int] = {}
            for shard, _ in self._sources.values():
                counts[shard] = counts.get(shard, 0) + 1
            return counts

    def update(self, stats: Mapping[int, ShardStats], now: float) -> dict[int, ShardRates]:
        """Take a fresh ``read_stats()`` snapshot and return per-shard rates since the last."""
        active = self.active_flows(now)
        rates: dict[int, ShardRates] = {}
        prev, dt = self._prev, now - self._prev_t
        for index, cur in stats.items():
            before = prev.get(index) if prev is not None else None
            if before is None or dt <= 0:
                pps = bps = nfs = 0.0
            else:
                # A counter that went backwards means the maps were recreated (--detach and a
                # fresh start): count from zero rather than report a negative rate.
                pps = max(cur.packets - before.packets, 0) / dt
                bps = max(cur.bytes - before.bytes, 0) / dt
                nfs = max(cur.new_flows - before.new_flows, 0) / dt
            rates[index] = ShardRates(
                shard_index=index,
                packets_per_s=pps,
                bytes_per_s=bps,
                new_flows_per_s=nfs,
                active_flows=active.get(index, 0),
                packets_total=cur.packets,
                bytes_total=cur.bytes,
                new_flows_total=cur.new_flows,
            )
        self._prev, self._prev_t = dict(stats), now
        self._last = rates
        return rates

    def last(self) -> dict[int, ShardRates]:
        return dict(self._last)
