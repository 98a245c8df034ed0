"""Integer weights from shares: largest-remainder apportioning of a budget with a floor,
water-filling, and the check that a set of weights spends the budget."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from adaptermesh.control_plane.policy.columns import _F, _I, _seqsum
from adaptermesh.control_plane.policy.types import PolicyConfig


def _apportion_cols(shares: _F, total: int, floor: int) -> _I:
    """``apportion`` on a column (keys already in sorted order)."""
    count = shares.size
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if floor * count > total:
        floor = total // count
    clean = np.where(np.isfinite(shares), np.maximum(shares, 0.0), 0.0)
    if _seqsum(clean) <= 0:
        clean = np.ones(count)
    # Water-fill: shards whose proportional share is below the floor are pinned to it.
    pinned = np.zeros(count, dtype=np.bool_)
    while True:
        free = ~pinned
        if not free.any():
            break
        rest = total - floor * int(pinned.sum())
        mass = _seqsum(clean[free])
        if mass <= 0:
            clean = np.where(free, 1.0, clean)
            mass = float(free.sum())
        low = free & (rest * clean / mass < floor)
        if not low.any():
            break
        pinned |= low
    free = ~pinned
    rest = total - floor * int(pinned.sum())
    mass = _seqsum(clean[free])
    if mass > 0:
        exact = np.where(pinned, float(floor), rest * clean / mass)
    else:
        exact = np.where(pinned, float(floor), rest / max(1, int(free.sum())))
    floors = np.floor(exact)
    weights = np.maximum(floor, floors).astype(np.int64)
    remainder = total - int(weights.sum())
    # Largest fractional part first, ties by key (the keys are sorted, so by position).
    order = np.lexsort((np.arange(count), -(exact - floors)))
    if 0 < remainder <= count:
        weights[order[:remainder]] += 1
    elif remainder != 0:
        step = 0
        while remainder != 0:
            row = order[step % count]
            if remainder > 0:
                weights[row] += 1
                remainder -= 1
            elif weights[row] > floor:
                weights[row] -= 1
                remainder += 1
            step += 1
            if step > 4 * count * (abs(remainder) + 1):
                break
    return weights


def apportion(shares: Mapping[str, float], total: int, floor: int = 0) -> dict[str, int]:
    """Integers proportional to ``shares`` that sum to exactly ``total``, each >= ``floor``.

    Largest remainder: the rounding never breaks the budget. Shares are clipped to ``floor``
    first by water-filling, so a shard at the floor stays there exactly.
    """
    keys = sorted(shares)
    if not keys:
        return {}
    values = np.array([float(shares[key]) for key in keys], dtype=np.float64)
    weights = _apportion_cols(values, total, floor)
    return dict(zip(keys, weights.tolist(), strict=True))


def validate_weights(
    weights: Mapping[str, int],
    active: Sequence[str],
    config: PolicyConfig,
    overridden: Collection[str] = (),
) -> list[str]:
    """Problems with a weight set; empty when it may be published.

    Overridden shards may sit below the minimum: the operator asked for that weight.
    """
    problems: list[str] = []
    unknown = sorted(set(weights) - set(active))
    if unknown:
        problems.append(f"weights name unknown or inactive shards: {unknown}")
    missing = sorted(set(active) - set(weights))
    if missing:
        problems.append(f"active shards without a weight: {missing}")
    if active:
        total = sum(weights.values())
        if total != config.budget:
            problems.append(f"weights sum to {total}, not {config.budget}")
        floor = config.weight_floor(len(active))
        low = sorted(
            shard_id
            for shard_id, weight in weights.items()
            if weight < floor and shard_id not in overridden
        )
        if low:
            problems.append(f"weights below the minimum {floor}: {low}")
    return problems


def _waterfill_cols(share: _F, total: float, floor: float) -> _F:
    """Floats proportional to ``share`` summing to ``total``, each at least ``floor``."""
    pinned = np.zeros(share.size, dtype=np.bool_)
    while True:
        free = ~pinned
        if not free.any():
            return np.full(share.size, total / share.size)
        rest = total - floor * int(pinned.sum())
        mass = _seqsum(share[free])
        proportional = (
            rest * share / mass if mass > 0 else np.full(share.size, rest / int(free.sum()))
        )
        low = free & (proportional < floor)
        if not low.any():
            return np.where(pinned, floor, proportional).astype(np.float64)
        pinned |= low
