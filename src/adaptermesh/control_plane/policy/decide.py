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
    obs: ObservationColumns,
    act: _I,
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
    mixes = obs.class_mixes
    if not mixes and not any(f.usable for f in obs.curves.values()):
        return None  # the steady fleet: one pass over the fits, no per-shard work
    out: list[ShardCurve] = []
    any_fit = False
    for i in np.flatnonzero(movable).tolist():
        s = int(act[i])
        lo, hi = int(obs.offsets[s]), int(obs.offsets[s + 1])
        fits: list[tuple[LatencyCurve, float]] = []
        complete = True
        for j in range(lo, hi):
            if not obs.known[j]:
                continue
            tok = float(obs.tokens_per_s[j])
            if not tok > 0:
                continue
            key = obs.endpoints[j]
            curve = mixed_curve(mixes.get(key), obs.curves.get(key), tok)
            if curve is not None:
                fits.append((curve, tok))
            else:
                complete = False
        r = float(rho[i])
        l0 = float(baseline[i]) if not math.isnan(baseline[i]) else float(latency[i])
        # A saturated shard (waiting requests or rho >= 1) has left the curve: its throughput
        # no longer grows with load, only its latency does. The queueing model handles it.
        if fits and complete and r < 1.0:
            any_fit = True
            out.append(ShardCurve(float(weight_eff[i]), r, l0, tuple(fits)))
        else:
            out.append(ShardCurve(float(weight_eff[i]), r, l0 if not math.isnan(l0) else 1.0))
    return out if any_fit else None


def _previous_endpoints(
    previous: Mapping[str, Mapping[str, int]], obs: ObservationColumns
) -> tuple[_F, bool]:
    """Last tick's endpoint weights aligned to this tick's rows (nan: none), and whether the
    set of endpoints per shard is unchanged."""
    if isinstance(previous, EndpointWeights) and obs.same_layout(
        previous.shard_ids, previous.offsets, previous.endpoints
    ):
        return previous.weights.astype(np.float64), True
    prev = np.full(len(obs.endpoints), math.nan)
    empty: Mapping[str, int] = {}
    same = set(previous) == set(obs.shard_ids)
    for i, sid in enumerate(obs.shard_ids):
        lo, hi = int(obs.offsets[i]), int(obs.offsets[i + 1])
        eps = previous.get(sid, empty)
        keys = obs.endpoints[lo:hi]
        for j, key in enumerate(keys, lo):
            v = eps.get(key)
            if v is not None:
                prev[j] = v
        if same and set(eps) != set(keys):
            same = False
    return prev, same


def _endpoint_cols(obs: ObservationColumns, prev: _F, cfg: PolicyConfig) -> _I:
    """Favour workers with headroom, free GPU memory and the shard's adapters resident."""
    n_shards = len(obs.shard_ids)
    shard_of = obs.shard_of
    known = obs.known
    rho = obs.kv_cache_usage
    queued = obs.waiting != 0
    rho = np.where(queued, np.maximum(rho, 1.0 + obs.waiting / np.maximum(obs.running, 1.0)), rho)
    headroom = np.where(rho < 0.95, 1.0 - rho, 0.05)
    free = np.where(np.isnan(obs.gpu_free_bytes) | ~(obs.gpu_free_bytes > 0), 0.0, obs.gpu_free_bytes)
    free_max = np.zeros(n_shards)
    np.maximum.at(free_max, shard_of[known], np.nan_to_num(obs.gpu_free_bytes[known], nan=0.0))
    inv_free = np.where(free_max > 1.0, 1.0 / np.where(free_max > 1.0, free_max, 1.0), 0.0)
    aff_bonus = np.where(
        obs.wanted > 0, cfg.affinity_bonus / np.where(obs.wanted > 0, obs.wanted, 1.0), 0.0
    )
    score = headroom * (1.0 + cfg.memory_bonus * free * inv_free[shard_of])
    if obs.tpot_p95_s is not None:
        # Tail decode speed: a worker whose p95 time per output token is above its shard's
        # best loses weight in proportion (at most halved); unreported rows are untouched.
        tpot = obs.tpot_p95_s
        has = known & ~np.isnan(tpot) & (tpot > 0)
        best_tpot = np.full(n_shards, np.inf)
        np.minimum.at(best_tpot, shard_of[has], tpot[has])
        ratio = np.where(has, best_tpot[shard_of] / np.where(has, tpot, 1.0), 1.0)
        score = score * np.clip(ratio, 0.5, 1.0)
    # Multiplying by exactly 1.0 where nothing is resident changes nothing.
    score = score * (1.0 + aff_bonus[shard_of] * obs.affinity_hits)
    best = np.zeros(n_shards)
    np.maximum.at(best, shard_of[known], score[known])
    best_w = best[shard_of]
    safe_best = np.where(best_w > 0, best_w, 1.0)
    target = (cfg.endpoint_scale / safe_best) * score
    value = np.where(np.isnan(prev), target, prev + cfg.ewma_alpha * (target - prev))
    out = np.maximum(1, np.round(value)).astype(np.int64)
    unknown = ~known
    if unknown.any():
        # Unknown: keep what it had, never more because it looks quiet. With no previous
        # weight it gets the (upper) median of its known siblings' previous weights.
        has = known & ~np.isnan(prev)
        median = np.full(n_shards, float(cfg.endpoint_scale))
        rows = np.flatnonzero(has)
        if rows.size:
            order = np.lexsort((prev[rows], shard_of[rows]))
            rows = rows[order]
            owners = shard_of[rows]
            counts = np.bincount(owners, minlength=n_shards)
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            present = counts > 0
            median[present] = prev[rows[starts[present] + counts[present] // 2]]
        fallback = np.where(np.isnan(prev), median[shard_of], prev)
        out = np.where(unknown, np.maximum(1, fallback).astype(np.int64), out)
    return out


@dataclass(frozen=True, slots=True)
class _Baseline:
    active: _I  # (A,) shard indices of the active shards
    ids: tuple[str, ...]  # (A,) their ids
    previous: _F  # (A,) the published weights (nan: none yet)
    fixed: dict[str, int]
    c: _F  # (A,) starting weights of the free shards (nan for fixed ones)
    free: _B  # (A,)
    rest: int
    floor: int


def _aligned(weights: Mapping[str, int], ids: tuple[str, ...]) -> _F:
    nan = math.nan
    return np.array([weights.get(sid, nan) for sid in ids], dtype=np.float64)


def _baseline(
    obs: ObservationColumns,
    weights: Mapping[str, int],
    overrides: Mapping[str, int],
    cfg: PolicyConfig,
) -> _Baseline:
    """Overrides applied and the other shards re-normalised."""
    active = np.flatnonzero(obs.active)
    ids = tuple(obs.shard_ids[i] for i in active)
    n = len(ids)
    floor = cfg.weight_floor(n)
    # Starting point: the published weights over the active shards. A new shard starts at its
    # share by worker count (its capacity prior); the others make room proportionally.
    workers = np.maximum(1, np.diff(obs.offsets)[active])
    total_workers = int(workers.sum())
    prev = _aligned(weights, ids)
    cur = np.where(np.isnan(prev), cfg.budget * workers / max(1, total_workers), prev)

    free = np.array([sid not in overrides for sid in ids], dtype=np.bool_)
    n_free = int(free.sum())
    room = cfg.budget - floor * n_free
    fixed_total = sum(overrides.values())
    if overrides and (fixed_total > room or not n_free):
        fixed = apportion(
            {k: float(v) for k, v in overrides.items()}, room if n_free else cfg.budget
        )
    else:
        fixed = dict(overrides)
    rest = cfg.budget - sum(fixed.values())

    # Free shards share the rest; unknown ones hold their (re-normalised) share.
    cur_free = cur[free]
    cur_free_total = _seqsum(cur_free)
    if cur_free_total > 0:
        c = cur_free * rest / cur_free_total
    else:
        c = np.full(n_free, rest / max(1, n_free))
    c = np.maximum(float(floor), c)
    excess = _seqsum(c) - rest
    if n_free and excess > 1e-9:
        above = c > floor
        v = c[above] - floor
        mass = _seqsum(v)
        c[above] -= excess * v / mass
    full = np.full(n, math.nan)
    full[free] = c
    return _Baseline(active, ids, prev, fixed, full, free, rest, floor)



def _effective_overrides(
    overrides: Mapping[str, OverrideSpec], obs: ObservationColumns, now: float
) -> tuple[tuple[str, ...], dict[str, int]]:
    expired = tuple(
        sorted(
            sid
            for sid, o in overrides.items()
            if o.expires_at is not None and o.expires_at <= now
        )
    )
    index = {sid: i for i, sid in enumerate(obs.shard_ids)} if overrides else {}
    effective = {
        sid: o.weight
        for sid, o in overrides.items()
        if sid in index and obs.active[index[sid]] and sid not in expired
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
    cfg = config
    obs = _columns(observation)
    shard_of = obs.shard_of
    n_shards = len(obs.shard_ids)

    # 1. Overrides: expired ones are reported for removal; ones on inactive shards are kept
    # in the store but have no effect until the shard is active again.
    expired, overrides = _effective_overrides(obs.overrides, obs, now)

    # 2. Estimates, for the active shards.
    base = _baseline(obs, current.weights, overrides, cfg)
    act = base.active
    ids = base.ids
    old = Estimates.gather(current.estimates, ids)
    known_w = obs.known
    kw_shard = shard_of[known_w]
    n_known = np.bincount(kw_shard, minlength=n_shards)[act]
    known = n_known > 0

    def ksum(values: _F, mask: _B | None = None) -> _F:
        sel = known_w if mask is None else mask
        sums = np.bincount(shard_of[sel], weights=values[sel], minlength=n_shards)
        return sums[act].astype(np.float64, copy=False)

    waiting = ksum(obs.waiting)
    running = ksum(obs.running)
    kv = ksum(obs.kv_cache_usage)
    tokens = ksum(obs.tokens_per_s)
    kv = np.where(n_known > 0, kv / np.maximum(n_known, 1), 0.0)
    # Tail latency: a worker's p95 time to first token where its histogram reported one this
    # interval, its mean otherwise (older workers).
    lat_col = obs.latency_s
    if obs.ttft_p95_s is not None:
        lat_col = np.where(np.isnan(obs.ttft_p95_s), lat_col, obs.ttft_p95_s)
    has_lat = known_w & ~np.isnan(lat_col) & (lat_col != 0)
    lat_w = np.where(obs.tokens_per_s > 1e-9, obs.tokens_per_s, 1e-9)
    lat_weight = ksum(lat_w, has_lat)
    lat_total = ksum(lat_col * lat_w, has_lat)
    sampled = known & (lat_weight > 0)
    sample = np.where(sampled, lat_total / np.where(sampled, lat_weight, 1.0), math.nan)
    latency = np.where(sampled, _ewma_cols(old.latency_s, sample, cfg.ewma_alpha), old.latency_s)
    baseline = np.where(
        sampled,
        np.where(
            np.isnan(old.baseline_s),
            sample,
            np.minimum(sample, old.baseline_s * (1.0 + cfg.baseline_drift)),
        ),
        old.baseline_s,
    )
    # From the raw sample: rho itself is smoothed once, below, not twice.
    positive = sampled & (sample > 0)
    rho_lat = np.where(positive, 1.0 - baseline / np.where(positive, sample, 1.0), 0.0)
    rho_q = np.where(waiting > 0, 1.0 + waiting / np.maximum(running, 1.0), 0.0)
    rho = np.minimum(np.maximum(np.maximum(np.maximum(rho_lat, kv), rho_q), cfg.rho_min),
                     cfg.rho_max)
    w_prev = base.previous
    est_rho = np.where(known, _ewma_cols(old.rho, rho, cfg.ewma_alpha), old.rho)
    weff_new = np.where(np.isnan(w_prev), old.weight_eff,
                        _ewma_cols(old.weight_eff, w_prev, cfg.ewma_alpha))
    est_weff = np.where(known, weff_new, old.weight_eff)
    tok_prev = np.where(old.tokens_per_s == 0, math.nan, old.tokens_per_s)
    est_tokens = np.where(known, _ewma_cols(tok_prev, tokens, cfg.ewma_alpha), old.tokens_per_s)
    est_latency = np.where(known, latency, old.latency_s)
    est_baseline = np.where(known, baseline, old.baseline_s)

    # 3. Targets: equal predicted utilisation among the shards that can move.
    free = base.free
    c = base.c
    floor = base.floor
    movable = free & known & ~np.isnan(est_rho) & ~np.isnan(est_weff)
    target = c.copy()
    predicted: dict[str, float] = {}
    if int(movable.sum()) >= 2:
        pool = _seqsum(c[movable])
        curves = _shard_curves(obs, act, movable, est_rho, est_weff, est_baseline, est_latency)
        if curves is not None:
            # Power-law fits: equalise predicted tail latency (shards without a usable fit
            # use the queueing model inside the same split).
            planned = plan_split(curves, pool, float(floor))
            target[movable] = planned
            m_ids = [ids[i] for i in np.flatnonzero(movable)]
            predicted = {
                sid: c_.predict(float(w)) for sid, c_, w in zip(m_ids, curves, planned, strict=True)
            }
        else:
            # Load per unit of weight is rho / weight_eff: equal utilisation needs
            # w ~ w_eff / rho.
            rho_m = est_rho[movable]
            share = est_weff[movable] / np.where(rho_m != 0, rho_m, cfg.rho_min)
            if _seqsum(share) > 0:
                target[movable] = _waterfill_cols(share, pool, float(floor))

    # 4. Hysteresis and the bounded step. The hysteresis is global: a rebalance starts when any
    # shard is further from its target than its entry band, and then every free shard moves
    # (the others must absorb the weight, or the budget-conserving step would cancel it) until
    # all are within the exit band.
    gaps = (target - c)[free]
    cf = c[free]
    was_moving = bool(old.moving[free].any())
    # The deadband is relative: a shard within deadband * weight of its target is balanced
    # enough, which keeps measurement noise from moving weight.
    start = bool((np.abs(gaps) > np.maximum(cfg.enter_band, cfg.deadband * cf)).any())
    keep = was_moving and bool(
        (np.abs(gaps) > np.maximum(cfg.exit_band, cfg.deadband * cf / 2)).any()
    )
    moving = start or keep
    est_moving = old.moving.copy()
    est_moving[free] = moving
    deltas = np.clip(gaps, -cfg.max_step, cfg.max_step) if moving else np.zeros(gaps.size)
    pos = _seqsum(deltas[deltas > 0])
    neg = -_seqsum(deltas[deltas < 0])
    if pos > neg:
        deltas = np.where(deltas > 0, deltas * neg / pos, deltas)
    elif neg > pos:
        deltas = np.where(deltas < 0, deltas * pos / neg, deltas)
    new_free = cf + deltas
    new_weights = np.zeros(len(ids), dtype=np.int64)
    if base.fixed:
        new_weights[~free] = [base.fixed[sid] for sid, f in zip(ids, free.tolist(), strict=True)
                              if not f]
    if new_free.size:
        new_weights[free] = _apportion_cols(new_free, base.rest, floor)
    weights = dict(zip(ids, new_weights.tolist(), strict=True))
    estimates = Estimates(ids, est_rho, est_weff, est_latency, est_baseline, est_tokens,
                          est_moving)
    utilization: dict[str, float | None] = dict(
        zip(ids, np.where(known, est_rho, math.nan).tolist(), strict=True)
    )
    for sid, k in zip(ids, known.tolist(), strict=True):
        if not k:
            utilization[sid] = None

    # 5. Endpoint weights and the publish decision.
    prev_ep, same_endpoints = _previous_endpoints(current.endpoint_weights, obs)
    ep_values = _endpoint_cols(obs, prev_ep, cfg)
    endpoint_weights = EndpointWeights(obs.shard_ids, obs.offsets, obs.endpoints, ep_values)
    prev_w = current.weights
    structure = len(prev_w) != len(ids) or bool(np.isnan(w_prev).any())
    if structure:
        keys = sorted(set(prev_w) | set(weights))
        diffs = np.array(
            [abs(weights.get(k, 0) - prev_w.get(k, 0)) for k in keys], dtype=np.int64
        )
    else:
        keys = list(ids)
        diffs = np.abs(new_weights - w_prev).astype(np.int64)
    change = int(diffs.sum()) // 2
    moved_ep = ~np.isnan(prev_ep)
    ep_moved = (
        int(np.abs(ep_values[moved_ep] - prev_ep[moved_ep]).max()) if moved_ep.any() else 0
    )
    reasons: list[str] = []
    if structure:
        reasons.append("shard set changed")
    if expired:
        reasons.append("override expired: " + ", ".join(expired))
    if change >= cfg.publish_threshold:
        top = np.argsort(-diffs, kind="stable")[:3].tolist()
        reasons.append(
            f"rebalance: {change} parts moved ("
            + ", ".join(
                f"{keys[i]} {prev_w.get(keys[i], 0)}->{weights.get(keys[i], 0)}" for i in top
            )
            + ")"
        )
    if not same_endpoints:
        reasons.append("endpoint set changed")
    elif ep_moved >= cfg.endpoint_threshold * cfg.endpoint_scale:
        reasons.append(f"endpoint weights moved by up to {ep_moved}")
    publish = bool(reasons)
    out_weights: dict[str, int]
    out_endpoints: Mapping[str, Mapping[str, int]]
    if publish:
        state = PolicyState(weights, endpoint_weights, estimates)
        out_weights, out_endpoints = weights, endpoint_weights
    else:
        # Below the threshold: keep the published weights so small moves are not lost silently
        # (they are recomputed from the same target next tick).
        state = PolicyState(dict(prev_w), current.endpoint_weights, estimates)
        out_weights = {k: int(v) for k, v in prev_w.items()}
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
    obs = _columns(observation)
    _, overrides = _effective_overrides(obs.overrides, obs, now)
    base = _baseline(obs, current.weights, overrides, config)
    weights = dict(base.fixed)
    if base.free.any():
        ids = [obs.shard_ids[i] for i in base.active]
        free_ids = [sid for sid, f in zip(ids, base.free.tolist(), strict=True) if f]
        alloc = _apportion_cols(base.c[base.free], base.rest, base.floor)
        weights.update(zip(free_ids, alloc.tolist(), strict=True))
    prev, _ = _previous_endpoints(current.endpoint_weights, obs)
    values = np.where(np.isnan(prev), float(config.endpoint_scale), prev).astype(np.int64)
    return weights, EndpointWeights(obs.shard_ids, obs.offsets, obs.endpoints, values)
