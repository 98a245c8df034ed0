"""A closed-loop load model for driving the policy: the traffic follows the weights it sets.

Each shard serves up to ``capacity`` tokens/s. It receives its weight's share of the steerable
traffic plus ``pinned`` traffic that no weight moves. Latency follows the same queue law the
policy assumes only loosely (it saturates, and queueing adds waiting requests), and ``noise``
multiplies every observed quantity by a bounded random factor.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from adaptermesh.control_plane.policy import (
    Observation,
    OverrideSpec,
    ShardObservation,
    WorkerObservation,
)

SLOTS = 16.0


@dataclass
class Plant:
    capacity: dict[str, float]
    steerable: float
    pinned: dict[str, float] = field(default_factory=dict)
    base_latency: float = 0.05
    noise: float = 0.0
    workers_per_shard: int = 2
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def rho(self, shard: str, weights: Mapping[str, int], budget: int = 10_000) -> float:
        offered = self.steerable * weights.get(shard, 0) / budget + self.pinned.get(shard, 0.0)
        return offered / self.capacity[shard]

    def _n(self) -> float:
        return 1.0 + self.rng.uniform(-self.noise, self.noise) if self.noise else 1.0

    def observe(
        self,
        weights: Mapping[str, int],
        overrides: Mapping[str, OverrideSpec] | None = None,
        unknown: frozenset[str] = frozenset(),
    ) -> Observation:
        shards = {}
        for sid in self.capacity:
            rho = self.rho(sid, weights)
            workers = []
            for k in range(self.workers_per_shard):
                served = min(rho, 1.0) * self.capacity[sid] / self.workers_per_shard
                latency = self.base_latency / (1.0 - min(rho, 0.95))
                workers.append(
                    WorkerObservation(
                        address=f"10.0.{sorted(self.capacity).index(sid)}.{k + 1}",
                        port=8000,
                        known=sid not in unknown,
                        waiting=max(0.0, rho - 1.0) * SLOTS * self._n(),
                        running=min(rho, 1.0) * SLOTS * self._n(),
                        kv_cache_usage=min(1.0, 0.8 * min(rho, 1.0) * self._n()),
                        latency_s=latency * self._n(),
                        tokens_per_s=served * self._n(),
                        gpu_free_bytes=8e9,
                    )
                )
            shards[sid] = ShardObservation(sid, True, tuple(workers))
        return Observation(shards, dict(overrides or {}))


def ideal_weights(plant: Plant, budget: int = 10_000, floor: float = 50.0) -> dict[str, float]:
    """Weights that equalise utilisation exactly (water-filling with a floor), by bisection."""

    def weights_at(rho: float) -> dict[str, float]:
        return {
            sid: max(floor, budget * (rho * c - plant.pinned.get(sid, 0.0)) / plant.steerable)
            for sid, c in plant.capacity.items()
        }

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(weights_at(mid).values()) > budget:
            hi = mid
        else:
            lo = mid
    return weights_at(lo)


def total_variation(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    return sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)) / 2
