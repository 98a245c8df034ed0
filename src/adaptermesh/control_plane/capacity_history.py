"""Per-worker (tokens/s, tail latency) history and the power-law fits the policy reads.

The rebalancer adds every tick's readings; ``fits()`` returns one ``PowerLawFit`` per worker
with enough history. Readings from a saturated worker (requests waiting) are left out: past
saturation the throughput stops following the load and only the queue grows, which is the
queueing model's regime, not the curve's. A worker is re-fitted every ``refit_every`` new readings, staggered by
its key, so a tick re-fits a fraction of a large fleet. The latency is the worker's p95 time
to first token over the interval where its histogram reported one, its mean otherwise.

Per adapter class: readings may also be added under ``worker|class`` keys (``add_reading``)
by a source that sees per-class latency; the fit is the same.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from adaptermesh.control_plane.policy import WorkerObservation
from adaptermesh.control_plane.policy.capacity import (
    CapacityConfig,
    PowerLawFit,
    fit_power_law,
    narrow_range,
)

__all__ = ["CapacityHistory"]


@dataclass(slots=True)
class _Series:
    tokens: deque[float]
    latency: deque[float]
    phase: int  # which tick of every refit_every this series is re-fitted on
    new: int = 0
    fit: PowerLawFit | None = None


@dataclass
class CapacityHistory:
    config: CapacityConfig = field(default_factory=CapacityConfig)
    refit_every: int = 3
    _series: dict[str, _Series] = field(default_factory=dict)
    _ticks: int = 0

    def __post_init__(self) -> None:
        self.config.validate()
        if self.refit_every < 1:
            raise ValueError("refit_every must be >= 1")

    def add_reading(self, key: str, tokens_per_s: float, latency_s: float) -> None:
        s = self._series.get(key)
        if s is None:
            w = self.config.window
            s = self._series[key] = _Series(
                deque(maxlen=w), deque(maxlen=w), zlib.crc32(key.encode()) % self.refit_every
            )
        s.tokens.append(tokens_per_s)
        s.latency.append(latency_s)
        s.new += 1

    def add(self, workers: Mapping[str, WorkerObservation]) -> None:
        """One tick's readings; workers no longer present are forgotten."""
        self._ticks += 1
        for key, w in workers.items():
            if not w.known or w.age_s > 0:
                continue  # a stale or repeated reading is not a new operating point
            if w.waiting > 0:
                continue  # saturated: throughput has stopped following load, latency has not
            lat = w.ttft_p95_s if w.ttft_p95_s is not None else w.latency_s
            if lat is None or not lat > 0 or not w.tokens_per_s > 0:
                continue
            self.add_reading(key, w.tokens_per_s, lat)
        for key in [k for k in self._series if k.split("|", 1)[0] not in workers]:
            del self._series[key]

    def fits(self) -> dict[str, PowerLawFit]:
        out: dict[str, PowerLawFit] = {}
        cfg = self.config
        tick = self._ticks % self.refit_every
        for key, s in self._series.items():
            if len(s.tokens) < cfg.min_points:
                continue
            due = s.fit is None or (s.new >= self.refit_every and s.phase == tick)
            if due:
                s.fit = narrow_range(min(s.tokens), max(s.tokens), len(s.tokens), cfg) or fit_power_law(
                    list(s.tokens), list(s.latency), cfg
                )
                s.new = 0
            assert s.fit is not None
            out[key] = s.fit
        return out
