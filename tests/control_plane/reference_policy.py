"""The policy's previous scalar implementation, kept as an oracle for the columnar one.

Every function below is the per-shard, per-worker Python version that ``policy.decide``
replaced; it shares the input and output types with ``adaptermesh.control_plane.policy``.
``test_policy_equivalence.py`` checks that both give the same decisions on random inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from adaptermesh.control_plane.policy import (
    Decision,
    Observation,
    PolicyConfig,
    PolicyState,
    ShardEstimate,
    ShardObservation,
    endpoint_key,
)


def _ewma(prev: float | None, value: float, alpha: float) -> float:
    return value if prev is None else prev + alpha * (value - prev)


def _raw_rho(
    shard: ShardObservation, est: ShardEstimate, cfg: PolicyConfig
) -> tuple[float, float | None, float | None, float]:
    """Utilisation of one interval, with the updated latency EWMA and baseline."""
    # One pass over the workers: this runs for every shard every tick.
    waiting = running = kv = tokens = lat_weight = lat_total = 0.0
    n = 0
    for w in shard.workers:
        if not w.known:
            continue
        n += 1
        waiting += w.waiting
        running += w.running
        kv += w.kv_cache_usage
        tokens += w.tokens_per_s
        if w.latency_s:
            weight = w.tokens_per_s if w.tokens_per_s > 1e-9 else 1e-9
            lat_weight += weight
            lat_total += w.latency_s * weight
    kv = kv / n if n else 0.0
    latency = est.latency_s
    baseline = est.baseline_s
    rho_lat = 0.0
    if lat_weight > 0:
        sample = lat_total / lat_weight
        latency = _ewma(est.latency_s, sample, cfg.ewma_alpha)
        if baseline is None:
            baseline = sample
        else:
            baseline = min(sample, baseline * (1.0 + cfg.baseline_drift))
        # From the raw sample: rho itself is smoothed once, below, not twice.
        if sample > 0:
            rho_lat = 1.0 - baseline / sample
    rho_q = 1.0 + waiting / max(running, 1.0) if waiting > 0 else 0.0
    rho = max(rho_lat, kv, rho_q)
    return min(max(rho, cfg.rho_min), cfg.rho_max), latency, baseline, tokens


def apportion_ref(shares: Mapping[str, float], total: int, floor: int = 0) -> dict[str, int]:
    """Integers proportional to ``shares`` that sum to exactly ``total``, each >= ``floor``.

    Largest remainder: the rounding never breaks the budget. Shares are clipped to ``floor``
    first by water-filling, so a shard at the floor stays there exactly.
    """
    keys = sorted(shares)
    if not keys:
        return {}
    if floor * len(keys) > total:
        floor = total // len(keys)
    clean = {k: max(0.0, shares[k]) if math.isfinite(shares[k]) else 0.0 for k in keys}
    if sum(clean.values()) <= 0:
        clean = dict.fromkeys(keys, 1.0)
    # Water-fill: shards whose proportional share is below the floor are pinned to it.
    pinned: set[str] = set()
    while True:
        free = [k for k in keys if k not in pinned]
        rest = total - floor * len(pinned)
        mass = sum(clean[k] for k in free)
        if not free:
            break
        if mass <= 0:
            clean.update(dict.fromkeys(free, 1.0))
            mass = float(len(free))
        low = [k for k in free if rest * clean[k] / mass < floor]
        if not low:
            break
        pinned.update(low)
    exact: dict[str, float] = dict.fromkeys(pinned, float(floor))
    free = [k for k in keys if k not in pinned]
    rest = total - floor * len(pinned)
    mass = sum(clean[k] for k in free)
    for k in free:
        exact[k] = rest * clean[k] / mass if mass > 0 else rest / len(free)
    out = {k: max(floor, math.floor(v)) for k, v in exact.items()}
    remainder = total - sum(out.values())
    order = sorted(keys, key=lambda k: (-(exact[k] - math.floor(exact[k])), k))
    i = 0
    while remainder != 0 and order:
        k = order[i % len(order)]
        if remainder > 0:
            out[k] += 1
            remainder -= 1
        elif out[k] > floor:
            out[k] -= 1
            remainder += 1
        i += 1
        if i > 4 * len(order) * (abs(remainder) + 1):
            break
    return out


def _endpoint_weights(
    shard: ShardObservation, previous: Mapping[str, int], cfg: PolicyConfig
) -> dict[str, int]:
    """Favour workers with headroom, free GPU memory and the shard's adapters resident."""
    workers = shard.workers
    if not workers:
        return {}
    # This runs for every worker every tick (8,000 at the benchmark's size): keep it lean.
    requested: frozenset[str] | set[str] = shard.routed_adapters
    for w in workers:
        if w.requested_adapters:
            requested = requested | w.requested_adapters
    n_requested = len(requested)
    known = [w for w in workers if w.known]
    free_max = max([w.gpu_free_bytes or 0.0 for w in known], default=0.0)
    inv_free = 1.0 / free_max if free_max > 1.0 else 0.0  # below one byte: no signal
    aff_bonus = cfg.affinity_bonus / n_requested if n_requested else 0.0
    scores: dict[str, float] = {}
    for w in known:
        rho = w.kv_cache_usage
        if w.waiting:
            rho = max(rho, 1.0 + w.waiting / max(w.running, 1.0))
        headroom = 1.0 - rho if rho < 0.95 else 0.05
        free = w.gpu_free_bytes if w.gpu_free_bytes and w.gpu_free_bytes > 0 else 0.0
        score = headroom * (1.0 + cfg.memory_bonus * free * inv_free)
        if aff_bonus and w.resident_adapters:
            score *= 1.0 + aff_bonus * len(requested & w.resident_adapters)
        scores[f"{w.address}:{w.port}"] = score
    best = max(scores.values(), default=0.0)
    out: dict[str, int] = {}
    if best > 0:
        scale = cfg.endpoint_scale / best
        alpha = cfg.ewma_alpha
        for key, score in scores.items():
            target = scale * score
            prev = previous.get(key)
            value = target if prev is None else prev + alpha * (target - prev)
            out[key] = max(1, round(value))
    if len(known) < len(workers):
        # Unknown: keep what it had, never more because it looks quiet.
        known_vals = sorted(v for k, v in previous.items() if k in scores)
        median = known_vals[len(known_vals) // 2] if known_vals else cfg.endpoint_scale
        for w in workers:
            key = f"{w.address}:{w.port}"
            if key not in out:
                out[key] = max(1, previous.get(key, median))
    return out


def decide_ref(
    observation: Observation, current: PolicyState, now: float, config: PolicyConfig
) -> Decision:
    cfg = config
    active = sorted(s for s, o in observation.shards.items() if o.active)

    # 1. Overrides: expired ones are reported for removal; ones on inactive shards are kept
    # in the store but have no effect until the shard is active again.
    expired, overrides = _effective_overrides(observation, now)

    # 2. Estimates.
    estimates: dict[str, ShardEstimate] = {}
    utilization: dict[str, float | None] = {}
    known: set[str] = set()
    blank = ShardEstimate()
    for sid in active:
        shard = observation.shards[sid]
        est = current.estimates.get(sid, blank)
        w_prev = current.weights.get(sid)
        if shard.known:
            known.add(sid)
            rho, latency, baseline, tokens = _raw_rho(shard, est, cfg)
            est = ShardEstimate(
                rho=_ewma(est.rho, rho, cfg.ewma_alpha),
                weight_eff=_ewma(est.weight_eff, float(w_prev), cfg.ewma_alpha)
                if w_prev is not None
                else est.weight_eff,
                latency_s=latency,
                baseline_s=baseline,
                tokens_per_s=_ewma(est.tokens_per_s or None, tokens, cfg.ewma_alpha),
                moving=est.moving,
            )
            utilization[sid] = est.rho
        else:
            utilization[sid] = None
        estimates[sid] = est

    fixed, c, rest, free, floor = _baseline(observation, current, overrides, active, cfg)
    movable = [
        sid
        for sid in free
        if sid in known and estimates[sid].rho is not None and estimates[sid].weight_eff is not None
    ]
    target = dict(c)
    if len(movable) >= 2:
        pool = sum(c[sid] for sid in movable)
        # Load per unit of weight is rho / weight_eff: equal utilisation needs w ~ w_eff / rho.
        share = {
            sid: (estimates[sid].weight_eff or 0.0) / (estimates[sid].rho or cfg.rho_min)
            for sid in movable
        }
        if sum(share.values()) > 0:
            target.update(_waterfill(share, pool, float(floor)))

    # 6. Hysteresis and the bounded step. The hysteresis is global: a rebalance starts when any
    # shard is further from its target than its entry band, and then every free shard moves
    # (the others must absorb the weight, or the budget-conserving step would cancel it) until
    # all are within the exit band.
    gaps = {sid: target[sid] - c[sid] for sid in free}
    was_moving = any(estimates[sid].moving for sid in free)
    # The deadband is relative: a shard within deadband * weight of its target is balanced
    # enough, which keeps measurement noise from moving weight.
    start = any(abs(d) > max(cfg.enter_band, cfg.deadband * c[sid]) for sid, d in gaps.items())
    keep = was_moving and any(
        abs(d) > max(cfg.exit_band, cfg.deadband * c[sid] / 2) for sid, d in gaps.items()
    )
    moving = start or keep
    deltas: dict[str, float] = {}
    for sid in free:
        if estimates[sid].moving != moving:
            estimates[sid] = replace(estimates[sid], moving=moving)
        d = gaps[sid]
        deltas[sid] = max(-cfg.max_step, min(cfg.max_step, d)) if moving else 0.0
    pos = sum(d for d in deltas.values() if d > 0)
    neg = -sum(d for d in deltas.values() if d < 0)
    if pos > neg:
        deltas = {k: (d * neg / pos if d > 0 else d) for k, d in deltas.items()}
    elif neg > pos:
        deltas = {k: (d * pos / neg if d < 0 else d) for k, d in deltas.items()}
    new_free = {sid: c[sid] + deltas[sid] for sid in free}
    weights = dict(fixed)
    weights.update(apportion_ref(new_free, rest, floor) if free else {})

    # 7. Endpoint weights and the publish decision.
    endpoint_weights = {
        sid: _endpoint_weights(observation.shards[sid], current.endpoint_weights.get(sid, {}), cfg)
        for sid in sorted(observation.shards)
    }
    prev_w = current.weights
    keys = set(prev_w) | set(weights)
    change = sum(abs(weights.get(k, 0) - prev_w.get(k, 0)) for k in keys) // 2
    structure = set(prev_w) != set(weights)
    ep_moved = _endpoint_change(current.endpoint_weights, endpoint_weights)
    ep_structure = {k: set(v) for k, v in current.endpoint_weights.items()} != {
        k: set(v) for k, v in endpoint_weights.items()
    }
    reasons: list[str] = []
    if structure:
        reasons.append("shard set changed")
    if expired:
        reasons.append("override expired: " + ", ".join(expired))
    if change >= cfg.publish_threshold:
        moved = sorted(keys, key=lambda k: -abs(weights.get(k, 0) - prev_w.get(k, 0)))[:3]
        reasons.append(
            f"rebalance: {change} parts moved ("
            + ", ".join(f"{k} {prev_w.get(k, 0)}->{weights.get(k, 0)}" for k in moved)
            + ")"
        )
    if ep_structure:
        reasons.append("endpoint set changed")
    elif ep_moved >= cfg.endpoint_threshold * cfg.endpoint_scale:
        reasons.append(f"endpoint weights moved by up to {ep_moved}")
    publish = bool(reasons)
    if publish:
        state = PolicyState(weights, endpoint_weights, estimates)
    else:
        # Below the threshold: keep the published weights so small moves are not lost silently
        # (they are recomputed from the same target next tick).
        state = PolicyState(dict(prev_w), current.endpoint_weights, estimates)
        weights = {k: int(v) for k, v in prev_w.items()}
        endpoint_weights = {k: dict(v) for k, v in current.endpoint_weights.items()}
    return Decision(
        weights=weights,
        endpoint_weights=endpoint_weights,
        state=state,
        change=change if publish else 0,
        publish=publish,
        reason="; ".join(reasons) if reasons else "no significant change",
        expired_overrides=expired,
        utilization=utilization,
    )


def _baseline(
    observation: Observation,
    current: PolicyState,
    overrides: Mapping[str, int],
    active: Sequence[str],
    cfg: PolicyConfig,
) -> tuple[dict[str, int], dict[str, float], int, list[str], int]:
    """Overrides applied and the other shards re-normalised: (fixed, free weights, rest,
    free shard ids, floor)."""
    n = len(active)
    floor = min(cfg.min_weight, cfg.budget // n) if n else 0
    # 3. Starting point: the published weights over the active shards. A new shard starts at
    # its share by worker count (its capacity prior); the others make room proportionally.
    workers = {sid: max(1, len(observation.shards[sid].workers)) for sid in active}
    total_workers = sum(workers.values())
    cur: dict[str, float] = {}
    for sid in active:
        prev = current.weights.get(sid)
        cur[sid] = float(prev) if prev is not None else cfg.budget * workers[sid] / total_workers

    # 4. Fixed shards: overrides (scaled down if they leave no room for the others' floors).
    free = [sid for sid in active if sid not in overrides]
    room = cfg.budget - floor * len(free)
    fixed_total = sum(overrides.values())
    if overrides and (fixed_total > room or not free):
        fixed = apportion_ref(
            {k: float(v) for k, v in overrides.items()}, room if free else cfg.budget
        )
    else:
        fixed = dict(overrides)
    rest = cfg.budget - sum(fixed.values())

    # 5. Free shards share the rest; unknown ones hold their (re-normalised) share.
    cur_free_total = sum(cur[sid] for sid in free)
    c = {
        sid: (cur[sid] * rest / cur_free_total if cur_free_total > 0 else rest / len(free))
        for sid in free
    }
    c = {sid: max(float(floor), v) for sid, v in c.items()}
    excess = sum(c.values()) - rest
    if free and excess > 1e-9:
        above = {sid: v - floor for sid, v in c.items() if v > floor}
        mass = sum(above.values())
        for sid, v in above.items():
            c[sid] -= excess * v / mass
    return fixed, c, rest, free, floor


def _effective_overrides(
    observation: Observation, now: float
) -> tuple[tuple[str, ...], dict[str, int]]:
    expired = tuple(
        sorted(
            sid
            for sid, o in observation.overrides.items()
            if o.expires_at is not None and o.expires_at <= now
        )
    )
    overrides = {
        sid: o.weight
        for sid, o in observation.overrides.items()
        if sid in observation.shards and observation.shards[sid].active and sid not in expired
    }
    return expired, overrides


def desired_ref(
    observation: Observation, current: PolicyState, now: float, config: PolicyConfig
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Weights for an immediate publish after a change of desired state (an override, a pin,
    a shard): overrides applied, the others re-normalised, nothing re-estimated or moved."""
    active = sorted(s for s, o in observation.shards.items() if o.active)
    _, overrides = _effective_overrides(observation, now)
    fixed, c, rest, free, floor = _baseline(observation, current, overrides, active, config)
    weights = dict(fixed)
    weights.update(apportion_ref(c, rest, floor) if free else {})
    endpoints: dict[str, dict[str, int]] = {}
    for sid in sorted(observation.shards):
        prev = current.endpoint_weights.get(sid, {})
        endpoints[sid] = {
            endpoint_key(w.address, w.port): prev.get(
                endpoint_key(w.address, w.port), config.endpoint_scale
            )
            for w in observation.shards[sid].workers
        }
    return weights, endpoints


def _waterfill(share: Mapping[str, float], total: float, floor: float) -> dict[str, float]:
    """Floats proportional to ``share`` summing to ``total``, each at least ``floor``."""
    pinned: set[str] = set()
    while True:
        free = [k for k in share if k not in pinned]
        if not free:
            return dict.fromkeys(share, total / len(share))
        rest = total - floor * len(pinned)
        mass = sum(share[k] for k in free)
        out = {k: (rest * share[k] / mass if mass > 0 else rest / len(free)) for k in free}
        low = [k for k, v in out.items() if v < floor]
        if not low:
            out.update(dict.fromkeys(pinned, floor))
            return out
        pinned.update(low)


def _endpoint_change(
    before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]
) -> int:
    worst = 0
    for sid, eps in after.items():
        prev = before.get(sid, {})
        for key, value in eps.items():
            worst = max(worst, abs(value - prev.get(key, value)))
    return worst
