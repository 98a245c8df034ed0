"""Per-worker and per (worker, adapter class) history of (tokens/s, tail latency), and the
power-law fits and class mixes the policy reads.

The rebalancer adds every tick's readings; ``fits()`` returns one ``PowerLawFit`` per worker
with enough history and ``class_mixes()`` one ``ClassMix`` per worker that has a usable fit
for at least one adapter class. Readings from a saturated worker (requests waiting) are left
out: past saturation the throughput stops following the load and only the queue grows, which
is the queueing model's regime, not the curve's. A series is re-fitted every ``refit_every``
new readings, staggered by its key, so a tick re-fits a fraction of a large fleet. The latency
is the worker's p95 time to first token over the interval where its histogram reported one,
its mean otherwise.

Adapter classes
---------------
An adapter's class is the ``adaptermesh.io/adapter-class`` label of its AdapterInstance when
the operator set one (adapters of one rank and target modules cost the same per token, and
only the operator knows which those are); otherwise the adapter is its own class, under its
name without the version (``a@v2`` is ``a``: a new version is the same adapter shape). Each
class's reading is the p95 of its adapters' TTFT histograms merged over the interval (a
merged histogram, not an average of percentiles), against the *worker's* tokens/s: the class
shares the worker's batches. A class reading needs ``min_class_requests`` requests in the
interval. Request shares are EWMAs of each class's requests per reading; ``rest`` is the
share of requests in no tracked class (base-model requests, classes past the cap).

Memory is bounded: at most ``max_classes`` classes per worker, each one window of readings. A
new class takes a free place, or the place of the class idle longest if that one has been
idle for ``class_evict_after`` readings of its worker; otherwise its requests count as
``rest``. A worker that leaves the observation takes its classes with it.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from adaptermesh.assignment_rules import VERSION_SEPARATOR
from adaptermesh.control_plane.metrics_source import TAIL_QUANTILE
from adaptermesh.control_plane.policy import WorkerObservation
from adaptermesh.control_plane.policy.capacity import (
    CapacityConfig,
    ClassMix,
    PowerLawFit,
    fit_power_law,
    narrow_range,
)
from adaptermesh.worker_scrape import interval_quantile

__all__ = ["ADAPTER_CLASS_LABEL", "CapacityHistory", "adapter_class"]

# The AdapterInstance label that names an adapter's class (docs/control-plane.md).
ADAPTER_CLASS_LABEL = "adaptermesh.io/adapter-class"
# Requests per interval beyond this are a broken counter, not load: clipped so that shares
# stay finite.
_MAX_COUNT = 1e12


def adapter_class(served: str, classes: Mapping[str, str]) -> str:
    """The class of a served adapter name: its AdapterInstance's class label, else its name
    without the version."""
    base = served.split(VERSION_SEPARATOR, 1)[0]
    return classes.get(base) or base


@dataclass(slots=True)
class _Series:
    tokens: deque[float]
    latency: deque[float]
    phase: int  # which tick of every refit_every this series is re-fitted on
    new: int = 0
    fit: PowerLawFit | None = None


@dataclass(slots=True)
class _Classes:
    """One worker's tracked classes: EWMA of requests per reading, and when each was seen."""

    rate: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    rest: float = 0.0
    readings: int = 0


def _count(value: float) -> float:
    return min(value, _MAX_COUNT) if math.isfinite(value) and value > 0 else 0.0


def _merge(
    histograms: list[tuple[tuple[float, float], ...]],
) -> tuple[tuple[float, float], ...] | None:
    """Bucket-wise sum of interval histograms with one set of bounds (others are left out)."""
    bounds = [le for le, _ in histograms[0]]
    total = [0.0] * len(bounds)
    for h in histograms:
        if len(h) != len(bounds) or any(le != b for (le, _), b in zip(h, bounds, strict=True)):
            continue
        for i, (_, c) in enumerate(h):
            total[i] += _count(c)
    if not total or not total[-1] > 0:
        return None
    return tuple(zip(bounds, total, strict=True))


@dataclass
class CapacityHistory:
    config: CapacityConfig = field(default_factory=CapacityConfig)
    refit_every: int = 3
    _series: dict[str, _Series] = field(default_factory=dict)
    _classes: dict[str, _Classes] = field(default_factory=dict)
    _ticks: int = 0
    _refit_tick: int = -1

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

    def add(
        self, workers: Mapping[str, WorkerObservation], classes: Mapping[str, str] | None = None
    ) -> None:
        """One tick's readings; workers no longer present are forgotten. ``classes``: the
        adapter class label per AdapterInstance name (``adapter_class``)."""
        self._ticks += 1
        for key, w in workers.items():
            if not w.known or w.age_s > 0:
                continue  # a stale or repeated reading is not a new operating point
            # Saturated: throughput has stopped following load, latency has not.
            fit_ok = not w.waiting > 0 and w.tokens_per_s > 0 and math.isfinite(w.tokens_per_s)
            if w.adapter_ttft or key in self._classes:
                self._add_classes(key, w, classes or {}, fit_ok)
            if not fit_ok:
                continue
            lat = w.ttft_p95_s if w.ttft_p95_s is not None else w.latency_s
            if lat is None or not lat > 0:
                continue
            self.add_reading(key, w.tokens_per_s, lat)
        for key in [k for k in self._series if k.split("|", 1)[0] not in workers]:
            del self._series[key]
        for key in [k for k in self._classes if k not in workers]:
            del self._classes[key]

    def _add_classes(
        self, key: str, w: WorkerObservation, classes: Mapping[str, str], fit_ok: bool
    ) -> None:
        cfg = self.config
        per: dict[str, list[tuple[tuple[float, float], ...]]] = {}
        for name, buckets in w.adapter_ttft.items():
            if buckets:
                per.setdefault(adapter_class(name, classes), []).append(buckets)
        state = self._classes.setdefault(key, _Classes())
        state.readings += 1
        now = state.readings
        counts: dict[str, float] = {}
        merged: dict[str, tuple[tuple[float, float], ...]] = {}
        untracked = 0.0
        adapters = 0.0
        for cls in sorted(per):  # a stable order: admission must not depend on dict order
            hist = _merge(per[cls])
            if hist is None:
                continue
            n = hist[-1][1]
            adapters += n
            if cls not in state.rate and not self._admit(key, state):
                untracked += n
                continue
            state.rate.setdefault(cls, 0.0)
            state.seen[cls] = now
            counts[cls] = n
            merged[cls] = hist
        a = 2.0 / (cfg.class_share_window + 1)
        for cls, rate in state.rate.items():
            state.rate[cls] = rate + a * (counts.get(cls, 0.0) - rate)
        # Requests with no adapter series (base-model requests) and untracked classes.
        rest = untracked + max(0.0, _count(w.first_tokens) - adapters)
        state.rest += a * (min(rest, _MAX_COUNT) - state.rest)
        if not fit_ok:
            return
        for cls, hist in merged.items():
            if counts[cls] < cfg.min_class_requests:
                continue
            zeros = tuple((le, 0.0) for le, _ in hist)
            p95 = interval_quantile(TAIL_QUANTILE, hist, zeros)
            if p95 is not None and p95 > 0 and math.isfinite(p95):
                self.add_reading(f"{key}|{cls}", w.tokens_per_s, p95)

    def _admit(self, key: str, state: _Classes) -> bool:
        """Room for one more class on this worker, evicting the one idle longest if it has
        been idle long enough; False: the cap holds."""
        if len(state.rate) < self.config.max_classes:
            return True
        oldest = min(state.seen, key=lambda c: (state.seen[c], c))
        if state.readings - state.seen[oldest] < self.config.class_evict_after:
            return False
        del state.rate[oldest], state.seen[oldest]
        self._series.pop(f"{key}|{oldest}", None)
        return True

    def _refit(self) -> None:
        if self._refit_tick == self._ticks:
            return
        self._refit_tick = self._ticks
        cfg = self.config
        tick = self._ticks % self.refit_every
        for s in self._series.values():
            if len(s.tokens) < cfg.min_points:
                continue
            if s.fit is None or (s.new >= self.refit_every and s.phase == tick):
                s.fit = narrow_range(
                    min(s.tokens), max(s.tokens), len(s.tokens), cfg
                ) or fit_power_law(list(s.tokens), list(s.latency), cfg)
                s.new = 0

    def fits(self) -> dict[str, PowerLawFit]:
        """The per-worker fits (keys ``address:port``) of workers with enough readings."""
        self._refit()
        return {
            key: s.fit for key, s in self._series.items() if s.fit is not None and "|" not in key
        }

    def class_mixes(self) -> dict[str, ClassMix]:
        """Per worker with a usable fit for at least one class: its classes' fits and request
        shares. The share of classes without a usable fit, and of requests in no tracked
        class, is the mix's ``rest``, predicted by the worker's own fit; a worker without a
        usable fit gets a mix only when that rest is at most ``max_uncovered_share`` (the
        classes' shares are then scaled to sum to 1)."""
        self._refit()
        out: dict[str, ClassMix] = {}
        for key, state in self._classes.items():
            total = sum(state.rate.values()) + state.rest
            if not total > 0 or not math.isfinite(total):
                continue
            usable: list[tuple[str, PowerLawFit, float]] = []
            for cls, rate in sorted(state.rate.items()):
                s = self._series.get(f"{key}|{cls}")
                if s is not None and s.fit is not None and s.fit.usable and rate > 0:
                    usable.append((cls, s.fit, rate / total))
            if not usable:
                continue
            covered = sum(share for _, _, share in usable)
            rest = max(0.0, 1.0 - covered)
            own = self._series.get(key)
            if own is None or own.fit is None or not own.fit.usable:
                if rest > self.config.max_uncovered_share:
                    continue
                usable = [(c, f, share / covered) for c, f, share in usable]
                rest = 0.0
            out[key] = ClassMix(tuple(usable), rest)
        return out
