"""The rebalancing policy: observations in, shard and endpoint weights out. Pure.

``decide(observation, current, now, config) -> Decision`` does no I/O, reads no clock and logs
nothing, so the rebalancer, the tests and the benchmark drive it the same way. It computes on
columns (``ObservationColumns``, numpy), one row per shard or worker: a 1,000-shard x
8-worker decision takes milliseconds.

Capacity model
--------------
Each shard is modelled as a queue whose latency grows as ``L = L0 / (1 - rho)`` with its
utilisation ``rho``. One smoothed observation gives ``rho`` directly:

* latency inflation ``1 - L0 / L`` (``L`` is the mean time to first token over the interval,
  ``L0`` the running minimum of its EWMA: the unloaded latency),
* KV-cache occupancy (``vllm:kv_cache_usage_perc``),
* queueing: any waiting request means ``rho >= 1``; ``1 + waiting / running`` says by how much.

``rho`` is the largest of the three. A three-parameter fit ``L = alpha * T^-beta + c`` needs a
spread of operating points that a shard held at a steady weight never visits, so its fit is
ill-conditioned exactly when the system is calm; the one-parameter queue model needs one point.

If the shard's traffic scales with its weight, ``rho_i / w_i`` is its load per unit of weight,
and the weights that equalise predicted utilisation (and so predicted latency and headroom) are
``w_i' ~ w_i / rho_i``. Both ``rho`` and the weight that produced it are smoothed with the same
EWMA, so their ratio is not skewed by the smoothing lag. Load that does not follow the weight
(pinned tenants) makes the step partial; repeated ticks close the gap.

Stability
---------
* EWMA on the inputs (``ewma_alpha``).
* A utilisation deadband: shards within ``deadband`` of the weighted mean count as equal.
* Hysteresis per shard: it starts moving only when its target is ``enter_band`` parts away and
  keeps moving until it is within ``exit_band``.
* A bounded step: no shard moves more than ``max_step`` parts per tick, and the moves are
  scaled so the budget is conserved exactly.
* Every active shard keeps at least ``min_weight``.
* Shards whose metrics are all stale are unknown: they hold their weight, they are never
  treated as idle.

Overrides fix a shard's weight until they expire; the other active shards share the rest in
proportion to their current weights and keep rebalancing among themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from adaptermesh.control_plane.policy.apportion import _apportion_cols, _waterfill_cols, apportion
from adaptermesh.control_plane.policy.capacity import (
    LatencyCurve,
    ShardCurve,
    mixed_curve,
    plan_split,
)
from adaptermesh.control_plane.policy.columns import (
    _B,
    _F,
    _I,
    EndpointWeights,
    Estimates,
    ObservationColumns,
    _seqsum,
)
from adaptermesh.control_plane.policy.types import (
    Decision,
    Observation,
    OverrideSpec,
    PolicyConfig,
    PolicyState,
)


def _ewma_cols(prev: _F, value: _F, alpha: float) -> _F:
    return np.where(np.isnan(prev), value, prev + alpha * (value - prev))


def _shard_curves(
    observed: ObservationColumns,
    active_shards: _I,
    movable: _B,
    rho: _F,
    weight_eff: _F,
    baseline: _F,
    latency: _F,
) -> list[ShardCurve] | None:
    """One curve per movable shard, or None when no movable shard has a usable fit (then the
    utilisation split applies unchanged).

    A shard's curve holds the curves of its known workers with their observed tokens/s: a
    worker's class mix where its classes' fits are usable (``mixed_curve``: the classes'
    curves weighted by their request shares, the worker's own fit for the rest), else its own
    usable fit. A shard with a worker that carries load but has no curve uses the queueing
    model as a whole, as does a shard without curves (one unidentified worker may be the
    bottleneck) and a saturated one.
    """
    class_mixes = observed.class_mixes
    if not class_mixes and not any(fit.usable for fit in observed.curves.values()):
        return None  # the steady fleet: one pass over the fits, no per-shard work
    shard_curves: list[ShardCurve] = []
    any_fit = False
    for position in np.flatnonzero(movable).tolist():
        shard_row = int(active_shards[position])
        first_worker, end_worker = (
            int(observed.offsets[shard_row]),
            int(observed.offsets[shard_row + 1]),
        )
        fits: list[tuple[LatencyCurve, float]] = []
        complete = True
        for worker_row in range(first_worker, end_worker):
            if not observed.known[worker_row]:
                continue
            worker_tokens = float(observed.tokens_per_s[worker_row])
            if not worker_tokens > 0:
                continue
            endpoint = observed.endpoints[worker_row]
            curve = mixed_curve(
                class_mixes.get(endpoint), observed.curves.get(endpoint), worker_tokens
            )
            if curve is not None:
                fits.append((curve, worker_tokens))
            else:
                complete = False
        shard_rho = float(rho[position])
        unloaded_latency = (
            float(baseline[position])
            if not math.isnan(baseline[position])
            else float(latency[position])
        )
        # A saturated shard (waiting requests or rho >= 1) has left the curve: its throughput
        # no longer grows with load, only its latency does. The queueing model handles it.
        if fits and complete and shard_rho < 1.0:
            any_fit = True
            shard_curves.append(
                ShardCurve(float(weight_eff[position]), shard_rho, unloaded_latency, tuple(fits))
            )
        else:
            shard_curves.append(
                ShardCurve(
                    float(weight_eff[position]),
                    shard_rho,
                    unloaded_latency if not math.isnan(unloaded_latency) else 1.0,
                )
            )
    return shard_curves if any_fit else None


def _previous_endpoints(
    previous: Mapping[str, Mapping[str, int]], observed: ObservationColumns
) -> tuple[_F, bool]:
    """Last tick's endpoint weights aligned to this tick's rows (nan: none), and whether the
    set of endpoints per shard is unchanged."""
    if isinstance(previous, EndpointWeights) and observed.same_layout(
        previous.shard_ids, previous.offsets, previous.endpoints
    ):
        return previous.weights.astype(np.float64), True
    aligned = np.full(len(observed.endpoints), math.nan)
    empty: Mapping[str, int] = {}
    same = set(previous) == set(observed.shard_ids)
    for shard_row, shard_id in enumerate(observed.shard_ids):
        first_row, end_row = int(observed.offsets[shard_row]), int(observed.offsets[shard_row + 1])
        shard_endpoints = previous.get(shard_id, empty)
        endpoint_keys = observed.endpoints[first_row:end_row]
        for row, endpoint in enumerate(endpoint_keys, first_row):
            weight = shard_endpoints.get(endpoint)
            if weight is not None:
                aligned[row] = weight
        if same and set(shard_endpoints) != set(endpoint_keys):
            same = False
    return aligned, same


def _endpoint_cols(observed: ObservationColumns, previous: _F, config: PolicyConfig) -> _I:
    """Favour workers with headroom, free GPU memory and the shard's adapters resident."""
    n_shards = len(observed.shard_ids)
    shard_of = observed.shard_of
    known = observed.known
    utilization = observed.kv_cache_usage
    queued = observed.waiting != 0
    utilization = np.where(
        queued,
        np.maximum(utilization, 1.0 + observed.waiting / np.maximum(observed.running, 1.0)),
        utilization,
    )
    headroom = np.where(utilization < 0.95, 1.0 - utilization, 0.05)
    free_bytes = np.where(
        np.isnan(observed.gpu_free_bytes) | ~(observed.gpu_free_bytes > 0),
        0.0,
        observed.gpu_free_bytes,
    )
    most_free_bytes = np.zeros(n_shards)
    np.maximum.at(
        most_free_bytes, shard_of[known], np.nan_to_num(observed.gpu_free_bytes[known], nan=0.0)
    )
    inverse_most_free = np.where(
        most_free_bytes > 1.0, 1.0 / np.where(most_free_bytes > 1.0, most_free_bytes, 1.0), 0.0
    )
    affinity_bonus = np.where(
        observed.wanted > 0,
        config.affinity_bonus / np.where(observed.wanted > 0, observed.wanted, 1.0),
        0.0,
    )
    score = headroom * (1.0 + config.memory_bonus * free_bytes * inverse_most_free[shard_of])
    if observed.tpot_p95_s is not None:
        # Tail decode speed: a worker whose p95 time per output token is above its shard's
        # best loses weight in proportion (at most halved); unreported rows are untouched.
        tpot_p95 = observed.tpot_p95_s
        reported = known & ~np.isnan(tpot_p95) & (tpot_p95 > 0)
        best_tpot = np.full(n_shards, np.inf)
        np.minimum.at(best_tpot, shard_of[reported], tpot_p95[reported])
        ratio = np.where(reported, best_tpot[shard_of] / np.where(reported, tpot_p95, 1.0), 1.0)
        score = score * np.clip(ratio, 0.5, 1.0)
    # Multiplying by exactly 1.0 where nothing is resident changes nothing.
    score = score * (1.0 + affinity_bonus[shard_of] * observed.affinity_hits)
    best_score = np.zeros(n_shards)
    np.maximum.at(best_score, shard_of[known], score[known])
    row_best_score = best_score[shard_of]
    row_best_nonzero = np.where(row_best_score > 0, row_best_score, 1.0)
    target = (config.endpoint_scale / row_best_nonzero) * score
    smoothed = np.where(
        np.isnan(previous), target, previous + config.ewma_alpha * (target - previous)
    )
    weights = np.maximum(1, np.round(smoothed)).astype(np.int64)
    unknown = ~known
    if unknown.any():
        # Unknown: keep what it had, never more because it looks quiet. With no previous
        # weight it gets the (upper) median of its known siblings' previous weights.
        reported = known & ~np.isnan(previous)
        median = np.full(n_shards, float(config.endpoint_scale))
        rows = np.flatnonzero(reported)
        if rows.size:
            order = np.lexsort((previous[rows], shard_of[rows]))
            rows = rows[order]
            owners = shard_of[rows]
            counts = np.bincount(owners, minlength=n_shards)
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            present = counts > 0
            median[present] = previous[rows[starts[present] + counts[present] // 2]]
        fallback = np.where(np.isnan(previous), median[shard_of], previous)
        weights = np.where(unknown, np.maximum(1, fallback).astype(np.int64), weights)
    return weights


@dataclass(frozen=True, slots=True)
class _Baseline:
    active: _I  # (A,) shard indices of the active shards
    ids: tuple[str, ...]  # (A,) their ids
    previous: _F  # (A,) the published weights (nan: none yet)
    fixed: dict[str, int]
    start_weights: _F  # (A,) starting weights of the free shards (nan for fixed ones)
    free: _B  # (A,)
    rest: int
    floor: int


def _aligned(weights: Mapping[str, int], shard_ids: tuple[str, ...]) -> _F:
    missing = math.nan
    return np.array([weights.get(shard_id, missing) for shard_id in shard_ids], dtype=np.float64)


def _baseline(
    observed: ObservationColumns,
    weights: Mapping[str, int],
    overrides: Mapping[str, int],
    config: PolicyConfig,
) -> _Baseline:
    """Overrides applied and the other shards re-normalised."""
    active = np.flatnonzero(observed.active)
    shard_ids = tuple(observed.shard_ids[i] for i in active)
    active_count = len(shard_ids)
    floor = config.weight_floor(active_count)
    # Starting point: the published weights over the active shards. A new shard starts at its
    # share by worker count (its capacity prior); the others make room proportionally.
    workers = np.maximum(1, np.diff(observed.offsets)[active])
    total_workers = int(workers.sum())
    published = _aligned(weights, shard_ids)
    current = np.where(
        np.isnan(published), config.budget * workers / max(1, total_workers), published
    )

    free = np.array([shard_id not in overrides for shard_id in shard_ids], dtype=np.bool_)
    free_count = int(free.sum())
    room = config.budget - floor * free_count
    fixed_total = sum(overrides.values())
    if overrides and (fixed_total > room or not free_count):
        fixed = apportion(
            {shard_id: float(weight) for shard_id, weight in overrides.items()},
            room if free_count else config.budget,
        )
    else:
        fixed = dict(overrides)
    rest = config.budget - sum(fixed.values())

    # Free shards share the rest; unknown ones hold their (re-normalised) share.
    current_free = current[free]
    current_free_total = _seqsum(current_free)
    if current_free_total > 0:
        free_start = current_free * rest / current_free_total
    else:
        free_start = np.full(free_count, rest / max(1, free_count))
    free_start = np.maximum(float(floor), free_start)
    excess = _seqsum(free_start) - rest
    if free_count and excess > 1e-9:
        above_floor = free_start > floor
        surplus = free_start[above_floor] - floor
        mass = _seqsum(surplus)
        free_start[above_floor] -= excess * surplus / mass
    start_weights = np.full(active_count, math.nan)
    start_weights[free] = free_start
    return _Baseline(active, shard_ids, published, fixed, start_weights, free, rest, floor)


def _effective_overrides(
    overrides: Mapping[str, OverrideSpec], observed: ObservationColumns, now: float
) -> tuple[tuple[str, ...], dict[str, int]]:
    expired = tuple(
        sorted(
            shard_id
            for shard_id, override in overrides.items()
            if override.expires_at is not None and override.expires_at <= now
        )
    )
    index = {shard_id: i for i, shard_id in enumerate(observed.shard_ids)} if overrides else {}
    effective = {
        shard_id: override.weight
        for shard_id, override in overrides.items()
        if shard_id in index and observed.active[index[shard_id]] and shard_id not in expired
    }
    return expired, effective


def _columns(observation: Observation | ObservationColumns) -> ObservationColumns:
    if isinstance(observation, ObservationColumns):
        return observation
    return ObservationColumns.from_observation(observation)


def decide(
    observation: Observation | ObservationColumns,
    current: PolicyState,
    now: float,
    config: PolicyConfig,
) -> Decision:
    observed = _columns(observation)
    shard_of = observed.shard_of
    n_shards = len(observed.shard_ids)

    # 1. Overrides: expired ones are reported for removal; ones on inactive shards are kept
    # in the store but have no effect until the shard is active again.
    expired, overrides = _effective_overrides(observed.overrides, observed, now)

    # 2. Estimates, for the active shards.
    base = _baseline(observed, current.weights, overrides, config)
    active_shards = base.active
    shard_ids = base.ids
    prior = Estimates.gather(current.estimates, shard_ids)
    known_workers = observed.known
    known_worker_shard = shard_of[known_workers]
    known_worker_count = np.bincount(known_worker_shard, minlength=n_shards)[active_shards]
    known = known_worker_count > 0

    def sum_known(values: _F, mask: _B | None = None) -> _F:
        selected = known_workers if mask is None else mask
        sums = np.bincount(shard_of[selected], weights=values[selected], minlength=n_shards)
        return sums[active_shards].astype(np.float64, copy=False)

    waiting = sum_known(observed.waiting)
    running = sum_known(observed.running)
    kv_usage = sum_known(observed.kv_cache_usage)
    tokens = sum_known(observed.tokens_per_s)
    kv_usage = np.where(known_worker_count > 0, kv_usage / np.maximum(known_worker_count, 1), 0.0)
    # Tail latency: a worker's p95 time to first token where its histogram reported one this
    # interval, its mean otherwise (older workers).
    worker_latency = observed.latency_s
    if observed.ttft_p95_s is not None:
        worker_latency = np.where(
            np.isnan(observed.ttft_p95_s), worker_latency, observed.ttft_p95_s
        )
    has_latency = known_workers & ~np.isnan(worker_latency) & (worker_latency != 0)
    worker_latency_weight = np.where(observed.tokens_per_s > 1e-9, observed.tokens_per_s, 1e-9)
    latency_weight = sum_known(worker_latency_weight, has_latency)
    weighted_latency = sum_known(worker_latency * worker_latency_weight, has_latency)
    sampled = known & (latency_weight > 0)
    sample = np.where(sampled, weighted_latency / np.where(sampled, latency_weight, 1.0), math.nan)
    latency = np.where(
        sampled, _ewma_cols(prior.latency_s, sample, config.ewma_alpha), prior.latency_s
    )
    baseline = np.where(
        sampled,
        np.where(
            np.isnan(prior.baseline_s),
            sample,
            np.minimum(sample, prior.baseline_s * (1.0 + config.baseline_drift)),
        ),
        prior.baseline_s,
    )
    # From the raw sample: rho itself is smoothed once, below, not twice.
    positive = sampled & (sample > 0)
    rho_latency = np.where(positive, 1.0 - baseline / np.where(positive, sample, 1.0), 0.0)
    rho_queue = np.where(waiting > 0, 1.0 + waiting / np.maximum(running, 1.0), 0.0)
    rho = np.minimum(
        np.maximum(np.maximum(np.maximum(rho_latency, kv_usage), rho_queue), config.rho_min),
        config.rho_max,
    )
    published = base.previous
    rho_estimate = np.where(known, _ewma_cols(prior.rho, rho, config.ewma_alpha), prior.rho)
    smoothed_weight_eff = np.where(
        np.isnan(published),
        prior.weight_eff,
        _ewma_cols(prior.weight_eff, published, config.ewma_alpha),
    )
    weight_eff_estimate = np.where(known, smoothed_weight_eff, prior.weight_eff)
    previous_tokens = np.where(prior.tokens_per_s == 0, math.nan, prior.tokens_per_s)
    tokens_estimate = np.where(
        known, _ewma_cols(previous_tokens, tokens, config.ewma_alpha), prior.tokens_per_s
    )
    latency_estimate = np.where(known, latency, prior.latency_s)
    baseline_estimate = np.where(known, baseline, prior.baseline_s)

    # 3. Targets: equal predicted utilisation among the shards that can move.
    free = base.free
    start_weights = base.start_weights
    floor = base.floor
    movable = free & known & ~np.isnan(rho_estimate) & ~np.isnan(weight_eff_estimate)
    target = start_weights.copy()
    predicted: dict[str, float] = {}
    if int(movable.sum()) >= 2:
        pool = _seqsum(start_weights[movable])
        curves = _shard_curves(
            observed,
            active_shards,
            movable,
            rho_estimate,
            weight_eff_estimate,
            baseline_estimate,
            latency_estimate,
        )
        if curves is not None:
            # Power-law fits: equalise predicted tail latency (shards without a usable fit
            # use the queueing model inside the same split).
            planned = plan_split(curves, pool, float(floor))
            target[movable] = planned
            movable_ids = [shard_ids[index] for index in np.flatnonzero(movable)]
            predicted = {
                shard_id: curve.predict(float(weight))
                for shard_id, curve, weight in zip(movable_ids, curves, planned, strict=True)
            }
        else:
            # Load per unit of weight is rho / weight_eff: equal utilisation needs
            # w ~ w_eff / rho.
            movable_rho = rho_estimate[movable]
            share = weight_eff_estimate[movable] / np.where(
                movable_rho != 0, movable_rho, config.rho_min
            )
            if _seqsum(share) > 0:
                target[movable] = _waterfill_cols(share, pool, float(floor))

    # 4. Hysteresis and the bounded step. The hysteresis is global: a rebalance starts when any
    # shard is further from its target than its entry band, and then every free shard moves
    # (the others must absorb the weight, or the budget-conserving step would cancel it) until
    # all are within the exit band.
    gaps = (target - start_weights)[free]
    start_free = start_weights[free]
    was_moving = bool(prior.moving[free].any())
    # The deadband is relative: a shard within deadband * weight of its target is balanced
    # enough, which keeps measurement noise from moving weight.
    start = bool((np.abs(gaps) > np.maximum(config.enter_band, config.deadband * start_free)).any())
    keep = was_moving and bool(
        (np.abs(gaps) > np.maximum(config.exit_band, config.deadband * start_free / 2)).any()
    )
    moving = start or keep
    moving_estimate = prior.moving.copy()
    moving_estimate[free] = moving
    deltas = np.clip(gaps, -config.max_step, config.max_step) if moving else np.zeros(gaps.size)
    raised = _seqsum(deltas[deltas > 0])
    lowered = -_seqsum(deltas[deltas < 0])
    if raised > lowered:
        deltas = np.where(deltas > 0, deltas * lowered / raised, deltas)
    elif lowered > raised:
        deltas = np.where(deltas < 0, deltas * raised / lowered, deltas)
    new_free_weights = start_free + deltas
    new_weights = np.zeros(len(shard_ids), dtype=np.int64)
    if base.fixed:
        new_weights[~free] = [
            base.fixed[shard_id]
            for shard_id, is_free in zip(shard_ids, free.tolist(), strict=True)
            if not is_free
        ]
    if new_free_weights.size:
        new_weights[free] = _apportion_cols(new_free_weights, base.rest, floor)
    weights = dict(zip(shard_ids, new_weights.tolist(), strict=True))
    estimates = Estimates(
        shard_ids,
        rho_estimate,
        weight_eff_estimate,
        latency_estimate,
        baseline_estimate,
        tokens_estimate,
        moving_estimate,
    )
    utilization: dict[str, float | None] = dict(
        zip(shard_ids, np.where(known, rho_estimate, math.nan).tolist(), strict=True)
    )
    for shard_id, is_known in zip(shard_ids, known.tolist(), strict=True):
        if not is_known:
            utilization[shard_id] = None

    # 5. Endpoint weights and the publish decision.
    previous_endpoint_weights, same_endpoints = _previous_endpoints(
        current.endpoint_weights, observed
    )
    endpoint_values = _endpoint_cols(observed, previous_endpoint_weights, config)
    endpoint_weights = EndpointWeights(
        observed.shard_ids, observed.offsets, observed.endpoints, endpoint_values
    )
    published_weights = current.weights
    structure = len(published_weights) != len(shard_ids) or bool(np.isnan(published).any())
    if structure:
        keys = sorted(set(published_weights) | set(weights))
        diffs = np.array(
            [
                abs(weights.get(shard_id, 0) - published_weights.get(shard_id, 0))
                for shard_id in keys
            ],
            dtype=np.int64,
        )
    else:
        keys = list(shard_ids)
        diffs = np.abs(new_weights - published).astype(np.int64)
    change = int(diffs.sum()) // 2
    had_endpoint_weight = ~np.isnan(previous_endpoint_weights)
    endpoint_move = (
        int(
            np.abs(
                endpoint_values[had_endpoint_weight]
                - previous_endpoint_weights[had_endpoint_weight]
            ).max()
        )
        if had_endpoint_weight.any()
        else 0
    )
    reasons: list[str] = []
    if structure:
        reasons.append("shard set changed")
    if expired:
        reasons.append("override expired: " + ", ".join(expired))
    if change >= config.publish_threshold:
        largest = np.argsort(-diffs, kind="stable")[:3].tolist()
        reasons.append(
            f"rebalance: {change} parts moved ("
            + ", ".join(
                f"{keys[index]} {published_weights.get(keys[index], 0)}->{weights.get(keys[index], 0)}"
                for index in largest
            )
            + ")"
        )
    if not same_endpoints:
        reasons.append("endpoint set changed")
    elif endpoint_move >= config.endpoint_threshold * config.endpoint_scale:
        reasons.append(f"endpoint weights moved by up to {endpoint_move}")
    publish = bool(reasons)
    out_weights: dict[str, int]
    out_endpoints: Mapping[str, Mapping[str, int]]
    if publish:
        state = PolicyState(weights, endpoint_weights, estimates)
        out_weights, out_endpoints = weights, endpoint_weights
    else:
        # Below the threshold: keep the published weights so small moves are not lost silently
        # (they are recomputed from the same target next tick).
        state = PolicyState(dict(published_weights), current.endpoint_weights, estimates)
        out_weights = {shard_id: int(weight) for shard_id, weight in published_weights.items()}
        out_endpoints = current.endpoint_weights
    return Decision(
        weights=out_weights,
        endpoint_weights=out_endpoints,
        state=state,
        change=change if publish else 0,
        publish=publish,
        reason="; ".join(reasons) if reasons else "no significant change",
        expired_overrides=expired,
        utilization=utilization,
        predicted_latency_s=predicted,
    )


def desired(
    observation: Observation | ObservationColumns,
    current: PolicyState,
    now: float,
    config: PolicyConfig,
) -> tuple[dict[str, int], Mapping[str, Mapping[str, int]]]:
    """Weights for an immediate publish after a change of desired state (an override, a pin,
    a shard): overrides applied, the others re-normalised, nothing re-estimated or moved."""
    observed = _columns(observation)
    _, overrides = _effective_overrides(observed.overrides, observed, now)
    base = _baseline(observed, current.weights, overrides, config)
    weights = dict(base.fixed)
    if base.free.any():
        shard_ids = [observed.shard_ids[i] for i in base.active]
        free_ids = [
            shard_id
            for shard_id, is_free in zip(shard_ids, base.free.tolist(), strict=True)
            if is_free
        ]
        allocated = _apportion_cols(base.start_weights[base.free], base.rest, base.floor)
        weights.update(zip(free_ids, allocated.tolist(), strict=True))
    previous_endpoint_weights, _ = _previous_endpoints(current.endpoint_weights, observed)
    values = np.where(
        np.isnan(previous_endpoint_weights), float(config.endpoint_scale), previous_endpoint_weights
    ).astype(np.int64)
    return weights, EndpointWeights(
        observed.shard_ids, observed.offsets, observed.endpoints, values
    )
