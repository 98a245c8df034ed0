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
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from adaptermesh.assignment_rules import WEIGHT_BUDGET

__all__ = [
    "BUDGET",
    "ColumnLayout",
    "Decision",
    "EndpointWeights",
    "Estimates",
    "Observation",
    "ObservationColumns",
    "OverrideSpec",
    "PolicyConfig",
    "PolicyState",
    "ShardEstimate",
    "ShardObservation",
    "WorkerObservation",
    "apportion",
    "decide",
    "desired",
    "endpoint_key",
    "validate_weights",
]

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
    # the fraction of the shard's requested adapters that are resident on the worker.
    memory_bonus: float = 0.25
    affinity_bonus: float = 0.5
    endpoint_scale: int = 100
    # Endpoint weight changes smaller than this fraction of the scale do not force a publish.
    endpoint_threshold: float = 0.10

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


def endpoint_key(address: str, port: int) -> str:
    return f"{address}:{port}"


# -- columnar layout ---------------------------------------------------------------------------
#
# ``decide`` works on columns: one numpy row per shard and one per worker, workers grouped by
# shard in shard-id order. At 1,000 shards x 8 workers the per-object version spent ~28 ms
# (min) in Python loops; the same arithmetic on columns takes a few milliseconds. Every
# floating-point step keeps the scalar version's order of operations, and sums over shards
# are sequential (``_seqsum``, not numpy's pairwise sum), so both versions give the same
# integers: tests/control_plane/test_policy_equivalence.py checks it against the old code.

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]
_B = npt.NDArray[np.bool_]


def _seqsum(values: _F) -> float:
    """Left-to-right sum, as Python's ``sum`` does it (numpy's own sum is pairwise)."""
    return float(np.cumsum(values)[-1]) if values.size else 0.0


def _opt(value: float | None) -> float:
    return math.nan if value is None or not math.isfinite(value) else float(value)


@dataclass(frozen=True, slots=True, eq=False)
class ObservationColumns:
    """An ``Observation`` as columns, the form ``decide`` computes on.

    Shards are in id order; the workers of shard ``i`` are rows ``offsets[i]:offsets[i+1]``.
    ``nan`` stands for "not reported" in ``latency_s`` and ``gpu_free_bytes``. Affinity is
    pre-counted: ``affinity_hits[w]`` is how many of its shard's wanted adapters (requested by
    any of the shard's workers, or routed to it by an AdapterInstance) are resident on ``w``,
    and ``wanted[i]`` is how many adapters shard ``i`` wants.
    """

    shard_ids: tuple[str, ...]  # (S,)
    active: _B  # (S,)
    offsets: _I  # (S + 1,)
    endpoints: tuple[str, ...]  # (W,) "address:port"
    known: _B  # (W,)
    waiting: _F  # (W,)
    running: _F  # (W,)
    kv_cache_usage: _F  # (W,)
    latency_s: _F  # (W,) nan: no request finished in the interval
    tokens_per_s: _F  # (W,)
    gpu_free_bytes: _F  # (W,) nan: not reported
    affinity_hits: _F  # (W,)
    wanted: _F  # (S,)
    overrides: Mapping[str, OverrideSpec] = field(default_factory=dict)

    @property
    def shard_of(self) -> _I:
        """(W,) the shard index of every worker row."""
        return np.repeat(np.arange(len(self.shard_ids), dtype=np.int64), np.diff(self.offsets))

    @classmethod
    def from_observation(cls, observation: Observation) -> ObservationColumns:
        """One pass over the objects. Non-finite readings count as not reported."""
        shard_ids = tuple(sorted(observation.shards))
        shards = observation.shards
        # One tuple per worker, then one array: ~10x faster than a column at a time. numpy
        # turns None into nan and True/False into 1/0.
        rows: list[tuple[object, ...]] = []
        endpoints: list[str] = []
        hits: list[float] = []
        counts: list[int] = []
        wanted: list[float] = []
        active: list[bool] = []
        for sid in shard_ids:
            shard = shards[sid]
            workers = shard.workers
            active.append(shard.active)
            counts.append(len(workers))
            requested: frozenset[str] | set[str] = shard.routed_adapters
            for w in workers:
                if w.requested_adapters:
                    requested = requested | w.requested_adapters
            wanted.append(float(len(requested)))
            if requested:
                hits.extend(
                    [
                        float(len(requested & w.resident_adapters)) if w.resident_adapters else 0.0
                        for w in workers
                    ]
                )
            else:
                hits.extend([0.0] * len(workers))
            endpoints.extend([f"{w.address}:{w.port}" for w in workers])
            rows.extend(
                [
                    (
                        w.known,
                        w.waiting,
                        w.running,
                        w.kv_cache_usage,
                        w.latency_s,
                        w.tokens_per_s,
                        w.gpu_free_bytes,
                    )
                    for w in workers
                ]
            )
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 7)
        offsets = np.zeros(len(shard_ids) + 1, dtype=np.int64)
        np.cumsum(np.array(counts, dtype=np.int64), out=offsets[1:])
        if not np.isfinite(table).all():
            # A non-finite count or rate is as good as no reading: 0 for counts and rates,
            # nan ("not reported") for latency and free memory.
            for col, fill in ((1, 0.0), (2, 0.0), (3, 0.0), (4, math.nan), (5, 0.0), (6, math.nan)):
                bad = ~np.isfinite(table[:, col])
                table[bad, col] = fill
        return cls(
            shard_ids=shard_ids,
            active=np.array(active, dtype=np.bool_),
            offsets=offsets,
            endpoints=tuple(endpoints),
            known=table[:, 0] > 0,
            waiting=np.ascontiguousarray(table[:, 1]),
            running=np.ascontiguousarray(table[:, 2]),
            kv_cache_usage=np.ascontiguousarray(table[:, 3]),
            latency_s=np.ascontiguousarray(table[:, 4]),
            tokens_per_s=np.ascontiguousarray(table[:, 5]),
            gpu_free_bytes=np.ascontiguousarray(table[:, 6]),
            affinity_hits=np.array(hits, dtype=np.float64),
            wanted=np.array(wanted, dtype=np.float64),
            overrides=dict(observation.overrides),
        )

    def same_layout(self, shard_ids: tuple[str, ...], offsets: _I, endpoints: tuple[str, ...]) -> bool:
        return (
            (self.shard_ids is shard_ids or self.shard_ids == shard_ids)
            and np.array_equal(self.offsets, offsets)
            and (self.endpoints is endpoints or self.endpoints == endpoints)
        )


_ROW_FIELDS = ("waiting", "running", "kv_cache_usage", "latency_s", "tokens_per_s",
               "gpu_free_bytes")
# What a non-finite reading becomes: 0 for counts and rates, nan ("not reported") for latency
# and free memory.
_ROW_FILL = (0.0, 0.0, 0.0, math.nan, 0.0, math.nan)
_KNOWN = attrgetter("known")
_RESIDENT = attrgetter("resident_adapters")
_REQUESTED = attrgetter("requested_adapters")
_GETTERS = tuple(attrgetter(name) for name in _ROW_FIELDS)
_EMPTY: frozenset[str] = frozenset()


class ColumnLayout:
    """Where every shard and worker sits in ``ObservationColumns``, built once per shard set.

    The shard ids, the row of every endpoint, and the adapters routed to each shard change
    only when the desired state does; the readings change every tick. Keeping the layout lets
    a tick turn 8,000 ``WorkerObservation``s into columns with one C-level attribute sweep per
    reading and no per-worker Python code (``columns``). Adapter sets are interned into bit
    masks (``uint64`` words), so a shard's wanted adapters and every worker's hits are array
    operations; an interned set is remembered while the layout lives (new sets cost one
    lookup, repeated ones none).
    """

    __slots__ = (
        "_adapter_bit", "_mask_cache", "_masks", "_routed_masks", "_set_id", "active",
        "endpoints", "max_interned", "offsets", "routed", "shard_ids", "shard_of",
    )

    def __init__(
        self,
        shard_ids: Sequence[str],
        active: Sequence[bool],
        endpoints: Sequence[Sequence[str]],
        routed: Sequence[Collection[str]] | None = None,
    ) -> None:
        """``endpoints[i]`` are the ``address:port`` keys of shard ``shard_ids[i]``, in row order;
        ``shard_ids`` must be sorted (the order ``decide`` reports in)."""
        ids = tuple(shard_ids)
        if list(ids) != sorted(ids):
            raise ValueError("shard_ids must be sorted")
        if len(set(ids)) != len(ids):
            raise ValueError("shard_ids must be unique")
        if len(active) != len(ids) or len(endpoints) != len(ids):
            raise ValueError("active and endpoints need one entry per shard")
        if routed is not None and len(routed) != len(ids):
            raise ValueError("routed needs one entry per shard")
        self.shard_ids = ids
        self.active = np.array(list(active), dtype=np.bool_)
        counts = np.array([len(e) for e in endpoints], dtype=np.int64)
        self.offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.endpoints = tuple(k for eps in endpoints for k in eps)
        self.shard_of = np.repeat(np.arange(len(ids), dtype=np.int64), counts)
        # Interned adapter sets are forgotten past this many, so a churning adapter
        # population cannot grow the table without bound.
        self.max_interned = 65_536
        self.routed = tuple(frozenset(r) for r in routed) if routed is not None else tuple(
            _EMPTY for _ in ids
        )
        self._reset_interning()

    @classmethod
    def from_observation(cls, observation: Observation) -> ColumnLayout:
        ids = sorted(observation.shards)
        shards = [observation.shards[sid] for sid in ids]
        return cls(
            ids,
            [s.active for s in shards],
            [[f"{w.address}:{w.port}" for w in s.workers] for s in shards],
            [s.routed_adapters for s in shards],
        )

    def __len__(self) -> int:
        return len(self.endpoints)

    def _reset_interning(self) -> None:
        self._adapter_bit: dict[str, int] = {}
        self._set_id: dict[frozenset[str], int] = {_EMPTY: 0}
        self._masks: list[int] = [0]  # per interned set, a Python int bit mask
        self._mask_cache: npt.NDArray[np.uint64] | None = None
        self._routed_masks = [self._mask(r) for r in self.routed]

    def _mask(self, adapters: Collection[str]) -> int:
        bits = self._adapter_bit
        mask = 0
        for name in adapters:
            bit = bits.get(name)
            if bit is None:
                bit = bits[name] = len(bits)
            mask |= 1 << bit
        return mask

    def _ids(self, sets: list[frozenset[str]]) -> _I:
        ids = list(map(self._set_id.get, sets))
        try:
            return np.array(ids, dtype=np.int64)
        except TypeError:  # a set not seen before (None in the list)
            pass
        if len(self._set_id) + len(sets) > self.max_interned:
            self._reset_interning()
            ids = list(map(self._set_id.get, sets))
        for i, got in enumerate(ids):
            if got is None:
                s = frozenset(sets[i])
                got = self._set_id.get(s)
                if got is None:
                    got = self._set_id[s] = len(self._masks)
                    self._masks.append(self._mask(s))
                    self._mask_cache = None
                ids[i] = got
        return np.array(ids, dtype=np.int64)

    def _mask_table(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """(interned sets, words) and (shards, words) bit masks, 64 adapters per word."""
        words = max(1, (len(self._adapter_bit) + 63) // 64)
        cached = self._mask_cache
        if cached is None or cached.shape[1] != words:
            full = (1 << 64) - 1
            every = self._masks + self._routed_masks
            cached = np.array(
                [[(m >> (64 * k)) & full for k in range(words)] for m in every], dtype=np.uint64
            ).reshape(len(every), words)
            self._mask_cache = cached
        n_sets = len(self._masks)
        return cached[:n_sets], cached[n_sets:]

    def columns(
        self,
        workers: Sequence[WorkerObservation],
        overrides: Mapping[str, OverrideSpec] | None = None,
    ) -> ObservationColumns:
        """The columns for one tick: ``workers[j]`` is the reading of endpoint row ``j``.

        Non-finite readings count as not reported. Nothing here loops over workers in Python
        except interning an adapter set the layout has not seen yet.
        """
        if len(workers) != len(self.endpoints):
            raise ValueError(
                f"workers: {len(workers)} readings for {len(self.endpoints)} endpoint rows"
            )
        n_shards = len(self.shard_ids)
        cols = []
        for get, fill in zip(_GETTERS, _ROW_FILL, strict=True):
            col = np.array(list(map(get, workers)), dtype=np.float64)
            bad = ~np.isfinite(col)
            if bad.any():
                col[bad] = fill
            cols.append(col)
        known = np.array(list(map(_KNOWN, workers)), dtype=np.bool_)
        # One call for both, so a reset of the interning table cannot split them.
        both = self._ids(list(map(_RESIDENT, workers)) + list(map(_REQUESTED, workers)))
        res_ids, req_ids = both[: len(workers)], both[len(workers):]
        masks, routed = self._mask_table()
        if masks.shape[0] == 1 and not routed.any():
            # No worker names an adapter and none is routed: nothing is wanted anywhere.
            wanted = np.zeros(n_shards)
            hits = np.zeros(len(workers))
        else:
            shard_req = routed.copy()
            np.bitwise_or.at(shard_req, self.shard_of, masks[req_ids])
            wanted = np.bitwise_count(shard_req).sum(axis=1, dtype=np.int64).astype(np.float64)
            hits = (
                np.bitwise_count(shard_req[self.shard_of] & masks[res_ids])
                .sum(axis=1, dtype=np.int64)
                .astype(np.float64)
            )
        return ObservationColumns(
            shard_ids=self.shard_ids,
            active=self.active,
            offsets=self.offsets,
            endpoints=self.endpoints,
            known=known,
            waiting=cols[0],
            running=cols[1],
            kv_cache_usage=cols[2],
            latency_s=cols[3],
            tokens_per_s=cols[4],
            gpu_free_bytes=cols[5],
            affinity_hits=hits,
            wanted=wanted,
            overrides=dict(overrides) if overrides else {},
        )


class EndpointWeights(Mapping[str, Mapping[str, int]]):
    """Endpoint weights per shard, stored as one column; each shard's dict is built on access.

    Building 1,000 small dicts every tick would cost more than the decision itself, and most
    ticks publish nothing, so nobody reads them.
    """

    __slots__ = ("_index", "endpoints", "offsets", "shard_ids", "weights")

    def __init__(
        self, shard_ids: tuple[str, ...], offsets: _I, endpoints: tuple[str, ...], values: _I
    ) -> None:
        self.shard_ids = shard_ids
        self.offsets = offsets
        self.endpoints = endpoints
        self.weights = values  # (W,) int64, >= 1
        self._index: dict[str, int] | None = None

    def _position(self, shard_id: str) -> int:
        if self._index is None:
            self._index = {sid: i for i, sid in enumerate(self.shard_ids)}
        return self._index[shard_id]

    def __getitem__(self, shard_id: str) -> dict[str, int]:
        i = self._position(shard_id)
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return dict(zip(self.endpoints[lo:hi], self.weights[lo:hi].tolist(), strict=True))

    def __iter__(self) -> Iterator[str]:
        return iter(self.shard_ids)

    def __len__(self) -> int:
        return len(self.shard_ids)

    def __contains__(self, shard_id: object) -> bool:
        try:
            self._position(shard_id)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True


class Estimates(Mapping[str, ShardEstimate]):
    """Per-shard estimates as columns (``nan`` for None); ``ShardEstimate``s built on access."""

    __slots__ = (
        "_index", "baseline_s", "latency_s", "moving", "rho", "shard_ids", "tokens_per_s",
        "weight_eff",
    )

    def __init__(
        self,
        shard_ids: tuple[str, ...],
        rho: _F,
        weight_eff: _F,
        latency_s: _F,
        baseline_s: _F,
        tokens_per_s: _F,
        moving: _B,
    ) -> None:
        self.shard_ids = shard_ids
        self.rho = rho
        self.weight_eff = weight_eff
        self.latency_s = latency_s
        self.baseline_s = baseline_s
        self.tokens_per_s = tokens_per_s
        self.moving = moving
        self._index: dict[str, int] | None = None

    @classmethod
    def gather(cls, source: Mapping[str, ShardEstimate], shard_ids: tuple[str, ...]) -> Estimates:
        """The estimates of ``shard_ids`` (blank where ``source`` has none), as columns."""
        if isinstance(source, Estimates) and source.shard_ids == shard_ids:
            return source
        blank = ShardEstimate()
        ests = [source.get(sid, blank) for sid in shard_ids]
        return cls(
            shard_ids,
            np.array([_opt(e.rho) for e in ests], dtype=np.float64),
            np.array([_opt(e.weight_eff) for e in ests], dtype=np.float64),
            np.array([_opt(e.latency_s) for e in ests], dtype=np.float64),
            np.array([_opt(e.baseline_s) for e in ests], dtype=np.float64),
            np.array([e.tokens_per_s for e in ests], dtype=np.float64),
            np.array([e.moving for e in ests], dtype=np.bool_),
        )

    def __getitem__(self, shard_id: str) -> ShardEstimate:
        if self._index is None:
            self._index = {sid: i for i, sid in enumerate(self.shard_ids)}
        i = self._index[shard_id]

        def val(a: _F) -> float | None:
            v = float(a[i])
            return None if math.isnan(v) else v

        return ShardEstimate(
            rho=val(self.rho),
            weight_eff=val(self.weight_eff),
            latency_s=val(self.latency_s),
            baseline_s=val(self.baseline_s),
            tokens_per_s=float(self.tokens_per_s[i]),
            moving=bool(self.moving[i]),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.shard_ids)

    def __len__(self) -> int:
        return len(self.shard_ids)


def _ewma_cols(prev: _F, value: _F, alpha: float) -> _F:
    return np.where(np.isnan(prev), value, prev + alpha * (value - prev))


def _apportion_cols(shares: _F, total: int, floor: int) -> _I:
    """``apportion`` on a column (keys already in sorted order)."""
    n = shares.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if floor * n > total:
        floor = total // n
    clean = np.where(np.isfinite(shares), np.maximum(shares, 0.0), 0.0)
    if _seqsum(clean) <= 0:
        clean = np.ones(n)
    # Water-fill: shards whose proportional share is below the floor are pinned to it.
    pinned = np.zeros(n, dtype=np.bool_)
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
    out = np.maximum(floor, floors).astype(np.int64)
    remainder = total - int(out.sum())
    # Largest fractional part first, ties by key (the keys are sorted, so by position).
    order = np.lexsort((np.arange(n), -(exact - floors)))
    if 0 < remainder <= n:
        out[order[:remainder]] += 1
    elif remainder != 0:
        i = 0
        while remainder != 0:
            k = order[i % n]
            if remainder > 0:
                out[k] += 1
                remainder -= 1
            elif out[k] > floor:
                out[k] -= 1
                remainder += 1
            i += 1
            if i > 4 * n * (abs(remainder) + 1):
                break
    return out


def apportion(shares: Mapping[str, float], total: int, floor: int = 0) -> dict[str, int]:
    """Integers proportional to ``shares`` that sum to exactly ``total``, each >= ``floor``.

    Largest remainder: the rounding never breaks the budget. Shares are clipped to ``floor``
    first by water-filling, so a shard at the floor stays there exactly.
    """
    keys = sorted(shares)
    if not keys:
        return {}
    values = np.array([float(shares[k]) for k in keys], dtype=np.float64)
    out = _apportion_cols(values, total, floor)
    return dict(zip(keys, out.tolist(), strict=True))


def validate_weights(
    weights: Mapping[str, int],
    active: Sequence[str],
    cfg: PolicyConfig,
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
        if total != cfg.budget:
            problems.append(f"weights sum to {total}, not {cfg.budget}")
        floor = min(cfg.min_weight, cfg.budget // len(active))
        low = sorted(k for k, v in weights.items() if v < floor and k not in overridden)
        if low:
            problems.append(f"weights below the minimum {floor}: {low}")
    return problems


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
    floor = min(cfg.min_weight, cfg.budget // n) if n else 0
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


def _waterfill_cols(share: _F, total: float, floor: float) -> _F:
    """Floats proportional to ``share`` summing to ``total``, each at least ``floor``."""
    pinned = np.zeros(share.size, dtype=np.bool_)
    while True:
        free = ~pinned
        if not free.any():
            return np.full(share.size, total / share.size)
        rest = total - floor * int(pinned.sum())
        mass = _seqsum(share[free])
        out = rest * share / mass if mass > 0 else np.full(share.size, rest / int(free.sum()))
        low = free & (out < floor)
        if not low.any():
            return np.where(pinned, floor, out).astype(np.float64)
        pinned |= low


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
    has_lat = known_w & ~np.isnan(obs.latency_s) & (obs.latency_s != 0)
    lat_w = np.where(obs.tokens_per_s > 1e-9, obs.tokens_per_s, 1e-9)
    lat_weight = ksum(lat_w, has_lat)
    lat_total = ksum(obs.latency_s * lat_w, has_lat)
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
    if int(movable.sum()) >= 2:
        pool = _seqsum(c[movable])
        # Load per unit of weight is rho / weight_eff: equal utilisation needs w ~ w_eff / rho.
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
