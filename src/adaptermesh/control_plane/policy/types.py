"""What the policy reads and returns: its configuration, the observations, the state it
carries between ticks, and the decision. Plain frozen dataclasses; no logic beyond checking
the configuration and the one rule it implies (each active shard's minimum weight)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from adaptermesh.assignment_rules import WEIGHT_BUDGET
from adaptermesh.control_plane.policy.capacity import ClassMix, PowerLawFit

# Shard weights are parts per BUDGET over ACTIVE shards: the Assignment rules' constant.
BUDGET = WEIGHT_BUDGET


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    budget: int = BUDGET
    min_weight: int = 50
    ewma_alpha: float = 0.5
    max_step: int = 1500
    deadband: float = 0.10
    enter_band: int = 100
    exit_band: int = 20
    publish_threshold: int = 50
    rho_min: float = 0.02
    rho_max: float = 4.0
    # Per tick, the latency baseline may rise this much toward the current latency. Off by
    # default: a drifting baseline slowly forgets the unloaded latency under steady load, and
    # the estimate it feeds then moves weight on a stationary load.
    baseline_drift: float = 0.01
    # Endpoint scoring: bonus for free GPU memory (relative to the shard's best worker) and for
    # the fraction of the shard's requested adapters that are resident on the worker; a worker
    # whose p95 time per output token is above its shard's best is scaled by best / its own
    # (at least 0.5).
    memory_bonus: float = 0.25
    affinity_bonus: float = 0.5
    endpoint_scale: int = 100
    # Endpoint weight changes smaller than this fraction of the scale do not force a publish.
    endpoint_threshold: float = 0.10

    def weight_floor(self, active_shards: int) -> int:
        """The least weight each of ``active_shards`` keeps: ``min_weight``, lowered to an
        even share of the budget when there are too many shards for it (0 with none)."""
        return min(self.min_weight, self.budget // active_shards) if active_shards else 0

    def validate(self) -> None:
        if self.budget <= 0:
            raise ValueError("budget must be positive")
        if not 0 <= self.min_weight < self.budget:
            raise ValueError("min_weight must be in [0, budget)")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        if self.max_step <= 0:
            raise ValueError("max_step must be positive")
        if not 0 <= self.exit_band <= self.enter_band:
            raise ValueError("bands must satisfy 0 <= exit_band <= enter_band")
        if not 0 < self.rho_min < self.rho_max:
            raise ValueError("rho bounds must satisfy 0 < rho_min < rho_max")


@dataclass(frozen=True, slots=True)
class WorkerObservation:
    """One worker's scraped metrics, already turned into rates over the last interval."""

    address: str
    port: int
    # False when the worker's last good scrape is older than the staleness limit.
    known: bool
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    # Mean time to first token over the interval; None when no request finished in it.
    latency_s: float | None = None
    # 95th percentiles over the interval from the workers' histograms (time to first token,
    # time per output token); None when the histogram had no new observation.
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    tokens_per_s: float = 0.0
    gpu_free_bytes: float | None = None
    resident_adapters: frozenset[str] = frozenset()
    # Adapters named by running or waiting requests.
    requested_adapters: frozenset[str] = frozenset()
    age_s: float = 0.0
    # True when the latest scrape could not connect at all (nothing listening): the worker is
    # gone, not merely slow. Its load still counts as unknown until the staleness limit, but it
    # loses adapter affinity at once.
    down: bool = False
    # Requests whose first token came in the interval (the TTFT histogram's count delta).
    first_tokens: float = 0.0
    # Per served adapter, its TTFT histogram over the interval: (upper bound, cumulative
    # count) ascending, +Inf last; only adapters with a request in the interval.
    adapter_ttft: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ShardObservation:
    shard_id: str
    active: bool
    workers: tuple[WorkerObservation, ...] = ()
    # Adapters routed to this shard by AdapterInstances.
    routed_adapters: frozenset[str] = frozenset()

    @property
    def known(self) -> bool:
        return any(w.known for w in self.workers)


@dataclass(frozen=True, slots=True)
class OverrideSpec:
    shard_id: str
    weight: int
    # Seconds on the caller's clock; None: no TTL.
    expires_at: float | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    shards: Mapping[str, ShardObservation]
    overrides: Mapping[str, OverrideSpec] = field(default_factory=dict)
    # Fitted power-law curves per endpoint key (``address:port``); only usable ones are used.
    curves: Mapping[str, PowerLawFit] = field(default_factory=dict)
    # Per endpoint key, its traffic by adapter class with the classes' fits (capacity.py).
    class_mixes: Mapping[str, ClassMix] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ShardEstimate:
    rho: float | None = None  # smoothed utilisation; None until the first known observation
    weight_eff: float | None = None  # smoothed weight that produced the observed rho
    latency_s: float | None = None  # smoothed mean time to first token
    baseline_s: float | None = None  # unloaded latency estimate
    tokens_per_s: float = 0.0
    moving: bool = False  # hysteresis state


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between ticks. ``weights`` are the published weights."""

    weights: Mapping[str, int] = field(default_factory=dict)
    endpoint_weights: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    estimates: Mapping[str, ShardEstimate] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    weights: dict[str, int]
    # Per shard, endpoint key -> weight (an ``EndpointWeights`` column view from ``decide``).
    endpoint_weights: Mapping[str, Mapping[str, int]]
    state: PolicyState
    # Total variation against the previous weights, in parts (sum of |delta| / 2).
    change: int
    publish: bool
    reason: str
    expired_overrides: tuple[str, ...]
    utilization: dict[str, float | None]
    # Per shard moved by the power-law planner: its predicted tail latency at the new weight.
    predicted_latency_s: dict[str, float] = field(default_factory=dict)


def endpoint_key(address: str, port: int) -> str:
    return f"{address}:{port}"
