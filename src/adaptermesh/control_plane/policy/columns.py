"""The observation as columns: one numpy row per shard and one per worker, and the
mappings (endpoint weights, estimates) that a decision hands back over those columns."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from adaptermesh.control_plane.policy.capacity import ClassMix, PowerLawFit
from adaptermesh.control_plane.policy.types import (
    Observation,
    OverrideSpec,
    ShardEstimate,
    WorkerObservation,
)

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


def _reading(value: float | None) -> float:
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
    ttft_p95_s: _F | None = None  # (W,) nan: not reported; None: no worker reports it
    tpot_p95_s: _F | None = None  # (W,) as above
    curves: Mapping[str, PowerLawFit] = field(default_factory=dict)
    class_mixes: Mapping[str, ClassMix] = field(default_factory=dict)

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
        for shard_id in shard_ids:
            shard = shards[shard_id]
            workers = shard.workers
            active.append(shard.active)
            counts.append(len(workers))
            requested: frozenset[str] | set[str] = shard.routed_adapters
            for worker in workers:
                if worker.requested_adapters:
                    requested = requested | worker.requested_adapters
            wanted.append(float(len(requested)))
            if requested:
                hits.extend(
                    [
                        float(len(requested & worker.resident_adapters))
                        if worker.resident_adapters
                        else 0.0
                        for worker in workers
                    ]
                )
            else:
                hits.extend([0.0] * len(workers))
            endpoints.extend([f"{worker.address}:{worker.port}" for worker in workers])
            rows.extend(
                [
                    (
                        worker.known,
                        worker.waiting,
                        worker.running,
                        worker.kv_cache_usage,
                        worker.latency_s,
                        worker.tokens_per_s,
                        worker.gpu_free_bytes,
                        worker.ttft_p95_s,
                        worker.tpot_p95_s,
                    )
                    for worker in workers
                ]
            )
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 9)
        offsets = np.zeros(len(shard_ids) + 1, dtype=np.int64)
        np.cumsum(np.array(counts, dtype=np.int64), out=offsets[1:])
        if not np.isfinite(table).all():
            # A non-finite count or rate is as good as no reading: 0 for counts and rates,
            # nan ("not reported") for latency and free memory.
            for column, fill in (
                (1, 0.0),
                (2, 0.0),
                (3, 0.0),
                (4, math.nan),
                (5, 0.0),
                (6, math.nan),
                (7, math.nan),
                (8, math.nan),
            ):
                bad = ~np.isfinite(table[:, column])
                table[bad, column] = fill
        # A latency no worker can have (negative, or above a million seconds) is a broken
        # exporter: not reported, like a non-finite one (and no overflow downstream).
        latencies = table[:, (4, 7, 8)]
        wild = (latencies < 0) | (latencies > _MAX_LATENCY_S)
        if wild.any():
            table[:, (4, 7, 8)] = np.where(wild, math.nan, latencies)
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
            ttft_p95_s=_reported(table[:, 7]),
            tpot_p95_s=_reported(table[:, 8]),
            curves=dict(observation.curves),
            class_mixes=dict(observation.class_mixes),
        )

    def same_layout(
        self, shard_ids: tuple[str, ...], offsets: _I, endpoints: tuple[str, ...]
    ) -> bool:
        return (
            (self.shard_ids is shard_ids or self.shard_ids == shard_ids)
            and np.array_equal(self.offsets, offsets)
            and (self.endpoints is endpoints or self.endpoints == endpoints)
        )


_MAX_LATENCY_S = 1e6
_ROW_FIELDS = (
    "waiting",
    "running",
    "kv_cache_usage",
    "latency_s",
    "tokens_per_s",
    "gpu_free_bytes",
    "ttft_p95_s",
    "tpot_p95_s",
)
# What a non-finite reading becomes: 0 for counts and rates, nan ("not reported") for latency
# and free memory.
_ROW_FILL = (0.0, 0.0, 0.0, math.nan, 0.0, math.nan, math.nan, math.nan)


def _reported(column: _F) -> _F | None:
    """A percentile column, or None when no worker reported it (the common old-worker case)."""
    return np.ascontiguousarray(column) if not np.isnan(column).all() else None


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
        "_adapter_bit",
        "_mask_cache",
        "_masks",
        "_routed_masks",
        "_set_id",
        "active",
        "endpoints",
        "max_interned",
        "offsets",
        "routed",
        "shard_ids",
        "shard_of",
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
        counts = np.array([len(shard_endpoints) for shard_endpoints in endpoints], dtype=np.int64)
        self.offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.endpoints = tuple(key for shard_endpoints in endpoints for key in shard_endpoints)
        self.shard_of = np.repeat(np.arange(len(ids), dtype=np.int64), counts)
        # Interned adapter sets are forgotten past this many, so a churning adapter
        # population cannot grow the table without bound.
        self.max_interned = 65_536
        self.routed = (
            tuple(frozenset(routed_set) for routed_set in routed)
            if routed is not None
            else tuple(_EMPTY for _ in ids)
        )
        self._reset_interning()

    @classmethod
    def from_observation(cls, observation: Observation) -> ColumnLayout:
        ids = sorted(observation.shards)
        shards = [observation.shards[shard_id] for shard_id in ids]
        return cls(
            ids,
            [shard.active for shard in shards],
            [[f"{worker.address}:{worker.port}" for worker in shard.workers] for shard in shards],
            [shard.routed_adapters for shard in shards],
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
        set_ids = list(map(self._set_id.get, sets))
        try:
            return np.array(set_ids, dtype=np.int64)
        except TypeError:  # a set not seen before (None in the list)
            pass
        if len(self._set_id) + len(sets) > self.max_interned:
            self._reset_interning()
            set_ids = list(map(self._set_id.get, sets))
        for position, got in enumerate(set_ids):
            if got is None:
                adapter_set = frozenset(sets[position])
                got = self._set_id.get(adapter_set)
                if got is None:
                    got = self._set_id[adapter_set] = len(self._masks)
                    self._masks.append(self._mask(adapter_set))
                    self._mask_cache = None
                set_ids[position] = got
        return np.array(set_ids, dtype=np.int64)

    def _mask_table(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """(interned sets, words) and (shards, words) bit masks, 64 adapters per word."""
        words = max(1, (len(self._adapter_bit) + 63) // 64)
        cached = self._mask_cache
        if cached is None or cached.shape[1] != words:
            full = (1 << 64) - 1
            every = self._masks + self._routed_masks
            cached = np.array(
                [[(mask >> (64 * word)) & full for word in range(words)] for mask in every],
                dtype=np.uint64,
            ).reshape(len(every), words)
            self._mask_cache = cached
        n_sets = len(self._masks)
        return cached[:n_sets], cached[n_sets:]

    def columns(
        self,
        workers: Sequence[WorkerObservation],
        overrides: Mapping[str, OverrideSpec] | None = None,
        curves: Mapping[str, PowerLawFit] | None = None,
        class_mixes: Mapping[str, ClassMix] | None = None,
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
        readings = []
        for read, fill in zip(_GETTERS, _ROW_FILL, strict=True):
            reading = np.array(list(map(read, workers)), dtype=np.float64)
            bad = ~np.isfinite(reading)
            if bad.any():
                reading[bad] = fill
            readings.append(reading)
        known = np.array(list(map(_KNOWN, workers)), dtype=np.bool_)
        # One call for both, so a reset of the interning table cannot split them.
        both = self._ids(list(map(_RESIDENT, workers)) + list(map(_REQUESTED, workers)))
        resident_ids, requested_ids = both[: len(workers)], both[len(workers) :]
        masks, routed = self._mask_table()
        if masks.shape[0] == 1 and not routed.any():
            # No worker names an adapter and none is routed: nothing is wanted anywhere.
            wanted = np.zeros(n_shards)
            hits = np.zeros(len(workers))
        else:
            shard_requested = routed.copy()
            np.bitwise_or.at(shard_requested, self.shard_of, masks[requested_ids])
            wanted = (
                np.bitwise_count(shard_requested).sum(axis=1, dtype=np.int64).astype(np.float64)
            )
            hits = (
                np.bitwise_count(shard_requested[self.shard_of] & masks[resident_ids])
                .sum(axis=1, dtype=np.int64)
                .astype(np.float64)
            )
        return ObservationColumns(
            shard_ids=self.shard_ids,
            active=self.active,
            offsets=self.offsets,
            endpoints=self.endpoints,
            known=known,
            waiting=readings[0],
            running=readings[1],
            kv_cache_usage=readings[2],
            latency_s=readings[3],
            tokens_per_s=readings[4],
            gpu_free_bytes=readings[5],
            affinity_hits=hits,
            wanted=wanted,
            overrides=dict(overrides) if overrides else {},
            ttft_p95_s=_reported(readings[6]),
            tpot_p95_s=_reported(readings[7]),
            curves=curves if curves is not None else {},
            class_mixes=class_mixes if class_mixes is not None else {},
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
            self._index = {shard: position for position, shard in enumerate(self.shard_ids)}
        return self._index[shard_id]

    def __getitem__(self, shard_id: str) -> dict[str, int]:
        position = self._position(shard_id)
        first, end = int(self.offsets[position]), int(self.offsets[position + 1])
        return dict(zip(self.endpoints[first:end], self.weights[first:end].tolist(), strict=True))

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
        "_index",
        "baseline_s",
        "latency_s",
        "moving",
        "rho",
        "shard_ids",
        "tokens_per_s",
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
        estimates = [source.get(shard_id, blank) for shard_id in shard_ids]
        return cls(
            shard_ids,
            np.array([_reading(estimate.rho) for estimate in estimates], dtype=np.float64),
            np.array([_reading(estimate.weight_eff) for estimate in estimates], dtype=np.float64),
            np.array([_reading(estimate.latency_s) for estimate in estimates], dtype=np.float64),
            np.array([_reading(estimate.baseline_s) for estimate in estimates], dtype=np.float64),
            np.array([estimate.tokens_per_s for estimate in estimates], dtype=np.float64),
            np.array([estimate.moving for estimate in estimates], dtype=np.bool_),
        )

    def __getitem__(self, shard_id: str) -> ShardEstimate:
        if self._index is None:
            self._index = {shard: position for position, shard in enumerate(self.shard_ids)}
        position = self._index[shard_id]

        def optional(column: _F) -> float | None:
            value = float(column[position])
            return None if math.isnan(value) else value

        return ShardEstimate(
            rho=optional(self.rho),
            weight_eff=optional(self.weight_eff),
            latency_s=optional(self.latency_s),
            baseline_s=optional(self.baseline_s),
            tokens_per_s=float(self.tokens_per_s[position]),
            moving=bool(self.moving[position]),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.shard_ids)

    def __len__(self) -> int:
        return len(self.shard_ids)
