"""The power-law capacity model: fit, confidence, prediction and the latency-equalising split.

Model
-----
A worker's tail latency (p95 time to first token) as a function of the throughput it carries::

    L(T) = alpha * T^(-beta) + eps          alpha > 0, beta in [beta_min, beta_max], 0 <= eps < min L

``eps`` is the latency floor (prefill of an idle worker), ``alpha * T^(-beta)`` the part that
load adds. Latency grows with load, so a healthy fit has ``beta < 0``; ``beta`` may be slightly
positive (batching makes a busier worker's tail no worse), which the planner reads as "no
constraint from this worker".

Fit (``fit_power_law``)
-----------------------
In log space, so one slow interval does not dominate: for each ``eps`` on a grid of fractions
of the smallest latency, ``ln(L - eps) = ln(alpha) - beta * ln(T)`` is a straight line fitted by
least squares; ``beta`` and ``ln(alpha)`` are clipped to their bounds (and ``ln(alpha)``
re-fitted for a clipped ``beta``). The ``eps`` with the smallest squared error of ``ln L``
wins. Three parameters are identifiable only if the observations span a range of throughputs,
so the fit reports:

* at least ``min_levels`` distinct throughput levels (bins of ``ln T``), else no fit at all;
* ``excitation``: the standard deviation of ``ln T`` over ``full_log_spread`` (capped at 1),
  and 0 below ``min_log_spread`` (a worker held at one operating point);
* ``r2``: the share of the variance of ``ln L`` the curve explains;
* ``confidence = r2 * excitation``, in [0, 1]. The fit is *usable* when ``confidence >=
  min_confidence`` and it had ``min_points`` observations; otherwise the caller falls back to
  the queueing model ``L = L0 / (1 - rho)``, which needs one point.

Planning (``plan_split``)
-------------------------
A shard's traffic scales with its weight, so each worker's throughput at shard weight ``w`` is
``T_j(w) = T_j * w / w_eff``. A shard's predicted tail latency is the worst of its workers'.
The split equalises predicted tail latency: find the level ``lambda`` at which the largest
weights whose predictions stay at or under ``lambda`` sum to the pool (bisection on
``ln lambda``; each shard's weight at a level is closed form for both models).

Adapter classes (``ClassMix``, ``MixedCurve``)
----------------------------------------------
Requests of different adapter classes share a worker's batches but not its latency: a class
of large-rank adapters has a higher floor and a steeper curve. Each (worker, class) gets its
own fit, with the same rules, of the class's p95 TTFT against the *worker's* throughput. A
worker's tail at throughput ``T`` is then the p95 of the mixture of its classes, each
weighted by its observed request share ``s_c``. With each class's p95 ``q_c(T)`` and floor
``eps_c`` known, each class's wait above its floor is taken as exponential (the M/M/1
sojourn time): ``P(L > x) = 20^(-(x - eps_c) / (q_c - eps_c))`` above the floor, 1 below it;
the mixture's p95 ``x`` solves ``sum_c s_c P_c(L > x) = 0.05`` (bisection: it lies between
the smallest and the largest ``q_c``). One class gives back its own curve; the share-weighted
mean of the ``q_c`` would not be the mixture's p95 (it under-reads the tail by most of the
gap to the slowest class).
A class whose fit is not usable is predicted by the worker's own fit (its share is the mix's
``rest``); ``MixedCurve`` is monotone non-decreasing in ``T`` (a class fit with ``beta >= 0``
adds the constant it predicts at the worker's observed throughput).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "CapacityConfig",
    "ClassMix",
    "LatencyCurve",
    "MixedCurve",
    "PowerLawFit",
    "ShardCurve",
    "fit_power_law",
    "mixed_curve",
    "narrow_range",
    "plan_split",
    "queue_latency",
]

_F = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    # Observations kept per worker (one per tick: 10 minutes at the 5 s period).
    window: int = 120
    min_points: int = 8
    # Standard deviation of ln(T) below which the curve is not identified (a factor ~1.2 in
    # throughput) and at which excitation counts fully (a factor ~1.35).
    min_log_spread: float = 0.15
    full_log_spread: float = 0.3
    min_confidence: float = 0.5
    # Distinct operating points needed: readings whose ln(T) fall in different bins this wide.
    min_levels: int = 5
    level_width: float = 0.05
    ln_alpha_bounds: tuple[float, float] = (-30.0, 30.0)
    beta_bounds: tuple[float, float] = (-6.0, 1.0)
    eps_grid: int = 16
    # Readings below this throughput (tokens/s) carry no information about the curve.
    min_tokens_per_s: float = 1e-3
    # Adapter classes tracked per worker (each holds one window of readings); a class idle
    # for ``class_evict_after`` readings of its worker gives its place to a new one.
    max_classes: int = 8
    class_evict_after: int = 12
    # A class's interval p95 is a reading only when at least this many of its requests had
    # their first token in the interval (a p95 of two requests is their maximum).
    min_class_requests: int = 5
    # Request shares: an EWMA over about this many readings of the worker (1 min at 5 s).
    class_share_window: int = 12
    # With no usable worker fit, the class mix stands alone only if the classes without a
    # usable fit (and requests of no tracked class) carry at most this share.
    max_uncovered_share: float = 0.05

    def validate(self) -> None:
        if self.window < self.min_points or self.min_points < 3:
            raise ValueError("capacity: need 3 <= min_points <= window")
        if not 0 <= self.min_log_spread < self.full_log_spread:
            raise ValueError("capacity: need 0 <= min_log_spread < full_log_spread")
        if self.min_levels < 3 or not self.level_width > 0:
            raise ValueError("capacity: need min_levels >= 3 and level_width > 0")
        if not 0 < self.min_confidence <= 1:
            raise ValueError("capacity: min_confidence must be in (0, 1]")
        beta_low, beta_high = self.beta_bounds
        if not beta_low < beta_high:
            raise ValueError("capacity: beta_bounds must be increasing")
        if not self.ln_alpha_bounds[0] < self.ln_alpha_bounds[1]:
            raise ValueError("capacity: ln_alpha_bounds must be increasing")
        if self.eps_grid < 1:
            raise ValueError("capacity: eps_grid must be >= 1")
        if self.max_classes < 1 or self.class_evict_after < 1:
            raise ValueError("capacity: need max_classes >= 1 and class_evict_after >= 1")
        if self.min_class_requests < 1 or self.class_share_window < 1:
            raise ValueError("capacity: need min_class_requests >= 1 and class_share_window >= 1")
        if not 0 <= self.max_uncovered_share < 1:
            raise ValueError("capacity: max_uncovered_share must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class PowerLawFit:
    alpha: float
    beta: float
    eps: float
    r2: float
    excitation: float
    confidence: float
    points: int
    usable: bool
    reason: str  # why it is not usable; "" when it is

    def predict(self, tokens_per_s: float) -> float:
        throughput = max(float(tokens_per_s), 1e-9)
        try:
            return self.eps + self.alpha * math.pow(throughput, -self.beta)
        except OverflowError:
            return math.inf

    def max_throughput(self, latency_s: float) -> float:
        """The largest throughput whose predicted latency is at most ``latency_s`` (inf: no
        limit, 0: never)."""
        if self.beta >= 0:
            return math.inf
        if latency_s <= self.eps:
            return 0.0
        try:
            return math.exp(math.log((latency_s - self.eps) / self.alpha) / (-self.beta))
        except OverflowError:
            return math.inf


def _unusable(points: int, reason: str) -> PowerLawFit:
    return PowerLawFit(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, points, False, reason)


def narrow_range(
    tokens_min: float, tokens_max: float, points: int, config: CapacityConfig
) -> PowerLawFit | None:
    """The unusable fit, without fitting, when the readings cannot reach the excitation bar.

    The standard deviation of ``ln T`` is at most half its range, so a range below twice
    ``min_log_spread`` can never pass: a steady fleet costs two comparisons per worker."""
    if tokens_min > 0 and math.log(tokens_max / tokens_min) < 2 * config.min_log_spread:
        return _unusable(
            points,
            f"not excited: ln(T) range {math.log(tokens_max / tokens_min):.3f}"
            f" < {2 * config.min_log_spread}",
        )
    return None


def fit_power_law(
    tokens_per_s: Sequence[float] | _F, latency_s: Sequence[float] | _F, config: CapacityConfig
) -> PowerLawFit:
    """Fit ``L = alpha * T^(-beta) + eps`` to paired readings; never raises on bad data."""
    throughput = np.asarray(tokens_per_s, dtype=np.float64)
    latency = np.asarray(latency_s, dtype=np.float64)
    if throughput.shape != latency.shape or throughput.ndim != 1:
        raise ValueError("tokens_per_s and latency_s must be 1-d and of one length")
    valid = (
        np.isfinite(throughput)
        & np.isfinite(latency)
        & (throughput > config.min_tokens_per_s)
        & (latency > 0)
    )
    throughput, latency = throughput[valid], latency[valid]
    count = int(throughput.size)
    if count < config.min_points:
        return _unusable(count, f"{count} points, need {config.min_points}")
    ln_throughput = np.log(throughput)
    ln_latency = np.log(latency)
    spread = float(ln_throughput.std())
    # Three parameters need at least as many distinct operating points, and a couple more to
    # tell a curve from noise: two levels always fit perfectly and say nothing.
    levels = int(np.unique(np.round(ln_throughput / config.level_width)).size)
    if levels < config.min_levels:
        return _unusable(
            count, f"not excited: {levels} distinct throughput levels, need {config.min_levels}"
        )
    if spread < config.min_log_spread:
        # One operating point identifies no curve: skip the fit (the steady state, so cheap).
        return _unusable(count, f"not excited: ln(T) spread {spread:.3f} < {config.min_log_spread}")
    excitation = min(1.0, spread / config.full_log_spread)
    latency_min = float(latency.min())
    beta_low, beta_high = config.beta_bounds
    ln_alpha_low, ln_alpha_high = config.ln_alpha_bounds
    centred_ln_throughput = ln_throughput - ln_throughput.mean()
    throughput_sum_squares = float(centred_ln_throughput @ centred_ln_throughput)

    def line(fraction: float) -> tuple[float, float, float, float]:
        eps = fraction * latency_min
        ln_excess = np.log(latency - eps)
        slope = (
            float(centred_ln_throughput @ (ln_excess - ln_excess.mean())) / throughput_sum_squares
            if throughput_sum_squares > 0
            else 0.0
        )
        beta = min(beta_high, max(beta_low, -slope))
        ln_alpha = min(
            ln_alpha_high, max(ln_alpha_low, float((ln_excess + beta * ln_throughput).mean()))
        )
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            residuals = ln_latency - np.log(eps + np.exp(ln_alpha - beta * ln_throughput))
        sse = float(residuals @ residuals)
        return (sse if math.isfinite(sse) else math.inf, ln_alpha, beta, eps)

    # eps as a fraction of the smallest latency: a grid dense near 1 (a floor close to the
    # unloaded latency is the common case), then golden-section search around the best point.
    fractions = [0.0] + [
        1.0 - 10.0 ** (-3.0 * step / max(1, config.eps_grid - 1))
        for step in range(1, config.eps_grid)
    ]
    if config.eps_grid > 1:
        fractions[-1] = 0.999
    scored = [line(fraction) for fraction in fractions]
    best_index = min(range(len(scored)), key=lambda index: scored[index][0])
    best = scored[best_index]
    low_fraction, high_fraction = (
        fractions[max(0, best_index - 1)],
        fractions[min(len(fractions) - 1, best_index + 1)],
    )
    golden = (math.sqrt(5) - 1) / 2
    left, right = (
        high_fraction - golden * (high_fraction - low_fraction),
        low_fraction + golden * (high_fraction - low_fraction),
    )
    left_fit, right_fit = line(left), line(right)
    for _ in range(24):
        if left_fit[0] < right_fit[0]:
            high_fraction, right, right_fit = right, left, left_fit
            left = high_fraction - golden * (high_fraction - low_fraction)
            left_fit = line(left)
        else:
            low_fraction, left, left_fit = left, right, right_fit
            right = low_fraction + golden * (high_fraction - low_fraction)
            right_fit = line(right)
    for candidate in (left_fit, right_fit):
        if candidate[0] < best[0]:
            best = candidate
    if not math.isfinite(best[0]):
        return _unusable(count, "no finite fit")
    sse, ln_alpha, beta, eps = best
    centred_ln_latency = ln_latency - ln_latency.mean()
    total_sum_squares = float(centred_ln_latency @ centred_ln_latency)
    r2 = max(0.0, min(1.0, 1.0 - sse / total_sum_squares)) if total_sum_squares > 1e-12 else 0.0
    confidence = r2 * excitation
    reason = ""
    if confidence < config.min_confidence:
        reason = f"confidence {confidence:.2f} < {config.min_confidence} (r2 {r2:.2f})"
    return PowerLawFit(
        math.exp(ln_alpha), beta, eps, r2, excitation, confidence, count, not reason, reason
    )


def queue_latency(baseline_s: float, rho: float) -> float:
    """The queueing model ``L0 / (1 - rho)``; inf at or past saturation."""
    return baseline_s / (1.0 - rho) if rho < 1.0 else math.inf


class LatencyCurve(Protocol):
    """What the planner needs of a worker's curve: a p95 TTFT at a throughput, and the largest
    throughput that keeps it at or under a level."""

    def predict(self, tokens_per_s: float) -> float: ...

    def max_throughput(self, latency_s: float) -> float: ...


@dataclass(frozen=True, slots=True)
class ClassMix:
    """One worker's traffic by adapter class, as the capacity history resolved it.

    ``classes`` holds ``(class, fit, share)`` for the classes whose fit is usable; ``rest`` is
    the share of requests the worker's own fit predicts (classes without a usable fit, and
    requests in no tracked class). Shares are of all requests and sum to 1.
    """

    classes: tuple[tuple[str, PowerLawFit, float], ...]
    rest: float = 0.0


# The tail read: p95, so a class's tail probability at its own p95 is 0.05 = 20^-1.
_TAIL = 0.05
_LN_TAIL = math.log(1.0 / _TAIL)
_LN_T_LO = math.log(1e-9)
# Throughputs searched: 1e-9 to e^60 (1e26) tokens/s; a cap above that is no cap.
_LN_T_HI = 60.0


def _tail(latency: float, parts: Sequence[tuple[float, float, float]]) -> float:
    """``P(L > x)`` of the mixture of classes ``(share, p95 q, floor e)``, each with an
    exponential tail above its floor."""
    total = 0.0
    for share, p95, floor in parts:
        if latency <= floor or math.isinf(p95):
            total += share
        elif p95 > floor:
            total += share * math.exp(-_LN_TAIL * (latency - floor) / (p95 - floor))
    return total


@dataclass(frozen=True, slots=True)
class MixedCurve:
    """A worker's p95 TTFT from its adapter classes' curves and request shares (see the
    module docstring). ``growing``: ``(share, fit)`` of class fits with ``beta < 0``;
    ``fixed``: ``(share, p95)`` of the others, held at their prediction for the worker's
    observed throughput. Shares sum to 1."""

    growing: tuple[tuple[float, PowerLawFit], ...]
    fixed: tuple[tuple[float, float, float], ...] = ()  # (share, p95, floor)

    def _parts(self, tokens_per_s: float) -> list[tuple[float, float, float]]:
        return [(share, fit.predict(tokens_per_s), fit.eps) for share, fit in self.growing] + list(
            self.fixed
        )

    def predict(self, tokens_per_s: float) -> float:
        parts = [part for part in self._parts(tokens_per_s) if part[0] > 0]
        if not parts:
            return 0.0
        p95s = [p95 for _, p95, _ in parts]
        low, high = min(p95s), max(p95s)
        if math.isinf(high):
            return math.inf
        if not high > 0:
            return 0.0
        # The mixture's p95 lies between its classes' smallest and largest p95: at x = low
        # every class still has at least 5 % of its requests above x, at x = high none has more.
        # Bisection on ln x: the classes' p95s may be orders of magnitude apart.
        ln_low, ln_high = math.log(max(low, 1e-300)), math.log(high)
        for _ in range(64):
            mid = 0.5 * (ln_low + ln_high)
            if _tail(math.exp(mid), parts) > _TAIL:
                ln_low = mid
            else:
                ln_high = mid
        return math.exp(ln_high)

    def max_throughput(self, latency_s: float) -> float:
        if not latency_s > 0:
            return 0.0

        # predict(T) <= level  <=>  P(L > level) <= 0.05 at T, and that tail grows with T.
        def over(ln_t: float) -> bool:
            return _tail(latency_s, self._parts(math.exp(ln_t))) > _TAIL

        if over(_LN_T_LO):
            return 0.0
        if not over(_LN_T_HI):
            return math.inf
        low, high = _LN_T_LO, _LN_T_HI
        for _ in range(60):
            mid = 0.5 * (low + high)
            if over(mid):
                high = mid
            else:
                low = mid
        return math.exp(low)


def mixed_curve(
    mix: ClassMix | None, worker_fit: PowerLawFit | None, tokens_per_s: float
) -> LatencyCurve | None:
    """The curve that predicts one worker: its class mix where it has one, else its own fit.

    A class without a usable fit, and the ``rest`` share, are predicted by the worker's fit;
    with no usable worker fit and a ``rest`` left, there is no curve (the caller falls back
    to the queueing model). None: no curve at all."""
    own = worker_fit if worker_fit is not None and worker_fit.usable else None
    if mix is None:
        return own
    parts: list[tuple[float, PowerLawFit]] = []
    rest = mix.rest if math.isfinite(mix.rest) and mix.rest > 0 else 0.0
    for _, fit, share in mix.classes:
        if not (math.isfinite(share) and share > 0):
            continue
        if fit.usable:
            parts.append((share, fit))
        else:
            rest += share
    if rest > 0:
        if own is None:
            return None
        parts.append((rest, own))
    total = sum(share for share, _ in parts)
    if not parts or not total > 0:
        return own
    if len(parts) == 1:
        return parts[0][1]
    throughput = float(tokens_per_s) if math.isfinite(tokens_per_s) else 0.0
    growing = tuple((share / total, fit) for share, fit in parts if fit.beta < 0)
    fixed = tuple(
        (share / total, fit.predict(throughput), fit.eps) for share, fit in parts if fit.beta >= 0
    )
    return MixedCurve(growing, fixed)


@dataclass(frozen=True, slots=True)
class ShardCurve:
    """What predicts one shard's tail latency at a candidate weight ``w``.

    ``weight_eff`` is the weight that produced the observed load. With ``fits`` (one curve per
    worker that has one: its usable fit or its class mix, with that worker's observed
    tokens/s), a worker's throughput
    at ``w`` is ``tokens * w / weight_eff``. Without, the queueing model: ``rho(w) = rho *
    w / weight_eff`` and ``L = baseline / (1 - rho(w))``.
    """

    weight_eff: float
    rho: float
    baseline_s: float
    fits: tuple[tuple[LatencyCurve, float], ...] = ()

    def predict(self, weight: float, *, skip_mixed: bool = False) -> float:
        scale = weight / self.weight_eff
        if self.fits:
            return max(
                (
                    fit.predict(worker_tokens * scale)
                    for fit, worker_tokens in self.fits
                    if not (skip_mixed and isinstance(fit, MixedCurve))
                ),
                default=-math.inf,
            )
        return queue_latency(self.baseline_s, self.rho * scale)

    def max_weight(self, level: float, *, skip_mixed: bool = False) -> float:
        """The largest weight whose predicted latency is at most ``level``; ``skip_mixed``:
        leave out the workers with a ``MixedCurve`` (``plan_split`` caps those in one batch)."""
        if self.fits:
            weight = math.inf
            for fit, worker_tokens in self.fits:
                if skip_mixed and isinstance(fit, MixedCurve):
                    continue
                cap = fit.max_throughput(level)
                if worker_tokens > 0:
                    weight = min(weight, cap * self.weight_eff / worker_tokens)
            return weight
        if level <= self.baseline_s or self.rho <= 0:
            return math.inf if self.rho <= 0 else 0.0
        return self.weight_eff * (1.0 - self.baseline_s / level) / self.rho


class _MixBatch:
    """Every ``MixedCurve`` of a plan as (worker, class) arrays, so the throughput caps of all
    of them at one level are one vectorised bisection on ``ln T`` instead of one Python
    bisection per worker (100 shards x 8 mixed workers: ~10 s per plan one by one).

    A fixed class is a growing one with exponent 0: ``q = eps + (q - eps) * T^0``."""

    # On ln T in [ln 1e-9, 60]: 30 halvings leave 7e-8 of ln T (a weight to 1e-7 of itself,
    # where the Assignment's parts are 1e-4 of the budget); bisection stops there.
    _STEPS = 30
    _TOL = 8e-8

    def __init__(self, curves: Sequence[ShardCurve]) -> None:
        rows: list[list[tuple[float, float, float, float]]] = []  # (share, alpha, -beta, eps)
        shard: list[int] = []
        per_token: list[float] = []
        for position, curve in enumerate(curves):
            for fit, worker_tokens in curve.fits:
                if isinstance(fit, MixedCurve) and worker_tokens > 0:
                    rows.append(
                        [
                            (share, class_fit.alpha, -class_fit.beta, class_fit.eps)
                            for share, class_fit in fit.growing
                        ]
                        + [(share, p95 - floor, 0.0, floor) for share, p95, floor in fit.fixed]
                    )
                    shard.append(position)
                    per_token.append(curve.weight_eff / worker_tokens)
        most_classes = max((len(row_parts) for row_parts in rows), default=0)
        table = np.zeros((len(rows), max(most_classes, 1), 4))
        for row, row_parts in enumerate(rows):
            table[row, : len(row_parts)] = row_parts
        self.share, self.alpha, self.power, self.eps = (table[:, :, column] for column in range(4))
        self.shard = np.array(shard, dtype=np.int64)
        self.per_token = np.array(per_token, dtype=np.float64)
        self.n = len(curves)
        # Levels solved so far, ascending, with (ln T under the cap, ln T over it, caps).
        self._levels: list[float] = []
        self._solved: list[tuple[_F, _F, _F]] = []

    def __len__(self) -> int:
        return int(self.shard.size)

    def _over(self, ln_t: _F, scale: _F, below: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Per worker: is its mixture's p95 above the level at ``T = e^ln_t``? ``scale`` is
        ``ln 20 * (level - eps) / alpha``, ``below`` where the level is at or under a class
        floor: a class's tail at the level is ``exp(-scale * T^-power)``."""
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            term = np.where(below, 1.0, np.exp(-scale * np.exp(-self.power * ln_t[:, None])))
        tail: _F = (self.share * term).sum(axis=1)
        return tail > _TAIL

    def predict(self, weight: float) -> _F:
        """(shards,) the largest mixed-worker prediction of each shard at ``weight`` (-inf:
        none); the vectorised ``MixedCurve.predict``."""
        out = np.full(self.n, -math.inf)
        if not len(self):
            return out
        ln_t = np.log(np.maximum(weight / self.per_token, 1e-9))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            gap = self.alpha * np.exp(self.power * ln_t[:, None])
            p95 = self.eps + gap
            used = self.share > 0
            low = np.log(np.maximum(np.where(used, p95, np.inf).min(axis=1), 1e-300))
            top = np.where(used, p95, 0.0).max(axis=1)
            high = np.log(np.where(np.isfinite(top) & (top > 0), top, 1.0))
            for _ in range(self._STEPS + 10):
                mid = 0.5 * (low + high)
                latency = np.exp(mid)[:, None]
                term = np.where(
                    latency < self.eps, 1.0, np.exp(-_LN_TAIL * (latency - self.eps) / gap)
                )
                over = (self.share * term).sum(axis=1) > _TAIL
                low = np.where(over, mid, low)
                high = np.where(over, high, mid)
            value = np.where(np.isfinite(top), np.where(top > 0, np.exp(high), 0.0), math.inf)
        np.maximum.at(out, self.shard, value)
        return out

    def max_weights(self, level: float) -> _F:
        """(shards,) the smallest weight cap of each shard's mixed workers at ``level``
        (inf: none, or no cap)."""
        caps = self._caps(level) if level > 0 else np.zeros(len(self))
        out = np.full(self.n, math.inf)
        with np.errstate(invalid="ignore"):
            np.minimum.at(
                out, self.shard, np.nan_to_num(caps * self.per_token, nan=0.0, posinf=math.inf)
            )
        return out

    def _caps(self, level: float) -> _F:
        """Throughput caps at ``level`` by bisection on ``ln T``, bracketed by the levels
        already solved: a throughput under the cap at a lower level is under it here, one
        over the cap at a higher level is over it here. ``plan_split`` bisects the level, so
        its brackets shrink with it and a late level costs a few steps."""
        count = len(self)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # alpha 0 (a fixed class at its floor): no tail above the floor.
            scale = np.where(
                self.alpha > 0,
                _LN_TAIL * (level - self.eps) / np.where(self.alpha > 0, self.alpha, 1.0),
                np.inf,
            )
        below = level <= self.eps
        low = np.full(count, _LN_T_LO)
        high = np.full(count, _LN_T_HI)
        known_low = np.zeros(count, dtype=np.bool_)  # low is a throughput known to be under
        known_high = np.zeros(count, dtype=np.bool_)  # high is one known to be over
        zero = np.zeros(count, dtype=np.bool_)
        free = np.zeros(count, dtype=np.bool_)
        position = bisect.bisect_left(self._levels, level)
        if position < len(self._levels) and self._levels[position] == level:
            return self._solved[position][2]
        if position > 0:
            low_below, _, caps_below = self._solved[position - 1]
            free |= np.isinf(caps_below) & (caps_below > 0)
            use = caps_below > 0
            low = np.where(use, np.maximum(low, low_below), low)
            known_low |= use
        if position < len(self._levels):
            _, high_above, caps_above = self._solved[position]
            zero |= caps_above == 0
            use = np.isfinite(caps_above)
            high = np.where(use, np.minimum(high, high_above), high)
            known_high |= use
        zero |= ~known_low & ~free & self._over(low, scale, below)
        free |= ~known_high & ~zero & ~self._over(high, scale, below)
        for _ in range(self._STEPS):
            if not ((high - low) > self._TOL).any():
                break
            mid = 0.5 * (low + high)
            over = self._over(mid, scale, below)
            high = np.where(over, mid, high)
            low = np.where(over, low, mid)
        caps = np.where(zero, 0.0, np.where(free, math.inf, np.exp(low)))
        self._levels.insert(position, level)
        self._solved.insert(position, (low, high, caps))
        return caps


def plan_split(curves: Sequence[ShardCurve], pool: float, floor: float) -> _F:
    """Weights (floats, each >= ``floor``, summing to ``pool``) that equalise predicted tail
    latency across ``curves``. Requires ``pool >= floor * len(curves)``."""
    count = len(curves)
    if count == 0:
        return np.zeros(0)
    spare = pool - floor * count
    batch = _MixBatch(curves)

    def alloc(level: float) -> _F:
        if not len(batch):
            return np.array(
                [min(pool, max(floor, curve.max_weight(level))) for curve in curves],
                dtype=np.float64,
            )
        mixed = batch.max_weights(level)
        return np.array(
            [
                min(
                    pool,
                    max(floor, min(curve.max_weight(level, skip_mixed=True), float(mixed_cap))),
                )
                for curve, mixed_cap in zip(curves, mixed, strict=True)
            ],
            dtype=np.float64,
        )

    if len(batch):
        mixed_lows = batch.predict(floor)
        lows = [
            max(curve.predict(floor, skip_mixed=True), float(mixed_cap))
            for curve, mixed_cap in zip(curves, mixed_lows, strict=True)
        ]
    else:
        lows = [curve.predict(floor) for curve in curves]
    low_level = max(
        1e-9,
        min(low_latency for low_latency in lows if math.isfinite(low_latency))
        if any(map(math.isfinite, lows))
        else 1e-9,
    )
    high_level = low_level * 2.0
    for _ in range(200):
        if alloc(high_level).sum() >= pool:
            break
        high_level *= 2.0
    high_weights = alloc(high_level)
    if high_weights.sum() < pool:
        # No level reaches the pool (every shard is capped): give the remainder evenly.
        even: _F = high_weights + (pool - high_weights.sum()) / count
        return even
    low = math.log(low_level)
    high = math.log(high_level)
    for _ in range(60):
        mid = 0.5 * (low + high)
        if alloc(math.exp(mid)).sum() >= pool:
            high = mid
        else:
            low = mid
    weights = alloc(math.exp(high))
    # Scale what is above the floor so the total is exactly the pool.
    above = weights - floor
    mass = float(above.sum())
    if mass > 0 and spare >= 0:
        weights = floor + above * (spare / mass)
    return weights
