"""The ``merged_adapters`` body field of a generation request: its shape and limits, checked
without touching any adapter (``adapter_merge`` builds the merge)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from adaptermesh.worker.types import ParamError

__all__ = [
    "DEFAULT_MAX_PARTS",
    "MAJORITY_SIGN_METHODS",
    "MERGE_FIELD",
    "MERGE_STRATEGIES",
    "PRUNED",
    "RANDOM",
    "SIGNED",
    "MergeSpec",
    "MergeSpecError",
    "parse_merge_spec",
]

MERGE_FIELD = "merged_adapters"
MERGE_STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
MAJORITY_SIGN_METHODS = ("total", "frequency")
DEFAULT_MAX_PARTS = 8
SIGNED = ("ties", "dare_ties")
PRUNED = ("ties", "dare_linear", "dare_ties", "magnitude_prune")
RANDOM = ("dare_linear", "dare_ties")


class MergeSpecError(ParamError):
    """A bad ``merged_adapters`` value; ``param`` names the sub-field (``merged_adapters.ids``)."""


@dataclass(frozen=True, slots=True)
class MergeSpec:
    ids: tuple[str, ...]
    weights: tuple[float, ...]
    merge_strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"
    seed: int = 0

    def options(self) -> dict[str, Any]:
        """The options that change the result of this strategy (what the cache key names)."""
        out: dict[str, Any] = {"merge_strategy": self.merge_strategy}
        if self.merge_strategy in PRUNED:
            out["density"] = self.density
        if self.merge_strategy in SIGNED:
            out["majority_sign_method"] = self.majority_sign_method
        if self.merge_strategy in RANDOM and self.density < 1:
            out["seed"] = self.seed
        return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_merge_spec(value: Any, max_parts: int = DEFAULT_MAX_PARTS) -> MergeSpec:
    """``merged_adapters`` as a MergeSpec; raises MergeSpecError naming the sub-field."""
    f = MERGE_FIELD
    if not isinstance(value, dict):
        raise MergeSpecError(f, f"must be an object, got {type(value).__name__}")
    known = {"ids", "weights", "merge_strategy", "density", "majority_sign_method", "seed"}
    extra = sorted(set(value) - known)
    if extra:
        raise MergeSpecError(f"{f}.{extra[0]}", "is not a field of merged_adapters")
    ids = value.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
        raise MergeSpecError(f"{f}.ids", "must be a non-empty list of adapter names")
    if len(ids) > max_parts:
        raise MergeSpecError(
            f"{f}.ids", f"names {len(ids)} adapters; at most {max_parts} may be merged"
        )
    seen: set[str] = set()
    for i, name in enumerate(ids):
        if name in seen:
            raise MergeSpecError(f"{f}.ids[{i}]", f"{name!r} is named twice")
        seen.add(name)
    weights = value.get("weights")
    if weights is None:
        weights = [1.0] * len(ids)
    if not isinstance(weights, list) or not all(_number(w) for w in weights):
        raise MergeSpecError(f"{f}.weights", "must be a list of finite numbers")
    if len(weights) != len(ids):
        raise MergeSpecError(
            f"{f}.weights", f"has {len(weights)} entries for {len(ids)} adapters in ids"
        )
    strategy = value.get("merge_strategy", "linear")
    if strategy not in MERGE_STRATEGIES:
        raise MergeSpecError(
            f"{f}.merge_strategy",
            f"{strategy!r} is not one of {', '.join(MERGE_STRATEGIES)} "
            "(the SVD and cat combinations are not served)",
        )
    density = value.get("density", 1.0)
    if not _number(density) or not 0 < density <= 1:
        raise MergeSpecError(f"{f}.density", f"must be a number in (0, 1], got {density!r}")
    sign = value.get("majority_sign_method", "total")
    if sign not in MAJORITY_SIGN_METHODS:
        raise MergeSpecError(
            f"{f}.majority_sign_method",
            f"{sign!r} is not one of {', '.join(MAJORITY_SIGN_METHODS)}",
        )
    seed = value.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise MergeSpecError(f"{f}.seed", f"must be an integer in [0, 2**63), got {seed!r}")
    return MergeSpec(
        tuple(ids), tuple(float(w) for w in weights), strategy, float(density), sign, seed
    )
