"""The rebalancing loop, the immediate publish path, and the Assignment fan-out.

``Rebalancer.step()`` is one read -> decide -> validate -> publish. ``run()`` only repeats it
every ``interval_s`` and backs off after a failure; the loop never dies. Changes of desired
state (shards, overrides, pins) go through ``Rebalancer.mutate``, which writes them and the
Assignment they cause in one transaction and publishes at once, without waiting for a tick.

Everything runs on one asyncio loop: a mutation and the synchronous part of a step never
interleave, so the policy state and the store cannot drift apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from adaptermesh import adapter_edge
from adaptermesh import assignment_rules as rules
from adaptermesh.backoff import Backoff
from adaptermesh.clock import Clock, SystemClock, sleep_or_stop
from adaptermesh.control_plane import placement, policy
from adaptermesh.control_plane.capacity_history import ADAPTER_CLASS_LABEL, CapacityHistory
from adaptermesh.control_plane.metrics import ControlPlaneMetrics, ControlPlaneState
from adaptermesh.control_plane.metrics_source import LoadSource, Target
from adaptermesh.control_plane.policy import (
    ColumnLayout,
    Decision,
    ObservationColumns,
    OverrideSpec,
    PolicyConfig,
    PolicyState,
    WorkerObservation,
    endpoint_key,
)
from adaptermesh.control_plane.policy.capacity import CapacityConfig
from adaptermesh.control_plane.rollout_state import splits as rollout_splits
from adaptermesh.control_plane.store import Store
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2
from adaptermesh.rules import RuleError as RoutingRuleError
from adaptermesh.rules import carried_pins, carried_rules, routing_rules_message

__all__ = [
    "AssignmentHub",
    "PublishError",
    "Rebalancer",
    "RebalancerConfig",
]

T = TypeVar("T")
_F = npt.NDArray[np.float64]
_ACTIVE = assignment_pb2.SHARD_STATE_ACTIVE


class PublishError(Exception):
    """The computed Assignment failed validation; nothing was published."""


class AssignmentHub:
    """The newest Assignment plus a wake-up for every watcher when it changes.

    Watchers always get the newest version (Assignments are complete, so skipping
    intermediate versions loses nothing), which keeps a slow watcher from holding a queue.
    """

    def __init__(self) -> None:
        self._latest: assignment_pb2.Assignment | None = None
        self._changed = asyncio.Event()
        self.watchers = 0

    @property
    def latest(self) -> assignment_pb2.Assignment | None:
        return self._latest

    def publish(self, assignment: assignment_pb2.Assignment) -> None:
        if self._latest is not None and assignment.version <= self._latest.version:
            raise PublishError(f"version {assignment.version} is not above {self._latest.version}")
        self._latest = assignment
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def newer_than(self, version: int) -> assignment_pb2.Assignment:
        while True:
            changed = self._changed
            latest = self._latest
            if latest is not None and latest.version > version:
                return latest
            await changed.wait()


@dataclass(frozen=True, slots=True)
class RebalancerConfig:
    interval_s: float = 5.0
    max_backoff_s: float = 60.0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The power-law capacity model (docs/control-plane.md); False: the queueing model only.
    power_law: bool = True
    capacity: CapacityConfig = field(default_factory=CapacityConfig)


@dataclass(slots=True)
class ShardLoadView:
    """What GetStatus shows per shard."""

    shard_id: str
    weight: int
    queue_depth: float
    running: float
    latency_ms: float
    tokens_per_s: float
    kv_cache_usage: float
    free_gpu_bytes: float
    known: bool
    utilization: float
    workers: int
    workers_known: int
    age_s: float


@dataclass(frozen=True, slots=True, eq=False)
class _Layout:
    """The desired state a tick needs, read from the store once per change of it."""

    key: tuple[int, int]
    specs: tuple[assignment_pb2.Shard, ...]  # in id order
    columns: ColumnLayout
    targets: tuple[Target, ...]  # one per endpoint row
    # Stand-ins for workers the load source said nothing about: unknown, never idle.
    unknown: tuple[WorkerObservation, ...]
    # The AdapterInstances' edge contracts (adapter_edge), for every Assignment.
    edges: tuple[assignment_pb2.AdapterEdge, ...] = ()
    # AdapterInstance name -> its adapter class label, for the capacity fits per class.
    classes: Mapping[str, str] = field(default_factory=dict)
    # The instances that name no shards (automatic homes may place them), in name order.
    homeless: tuple[control_plane_pb2.AdapterInstance, ...] = ()

    @classmethod
    def read(cls, store: Store) -> _Layout:
        key = store.layout_key()
        routed: dict[str, set[str]] = {}
        instances = store.list_adapter_instances()
        for inst in instances:
            # Shard routes lie inside placement.shards (adapter_edge.check_instance); with
            # placement and no shard routes, the placement's shards hold the adapter.
            for shard_id in [r.shard_id for r in inst.routes if r.shard_id] or list(
                inst.placement.shards
            ):
                routed.setdefault(shard_id, set()).add(inst.name)
        specs = tuple(sorted(store.list_shards(), key=lambda s: s.id))
        columns = ColumnLayout(
            [s.id for s in specs],
            [s.state in (_ACTIVE, assignment_pb2.SHARD_STATE_UNSPECIFIED) for s in specs],
            [[endpoint_key(ep.address, ep.port) for ep in s.endpoints] for s in specs],
            [routed.get(s.id, ()) for s in specs],
        )
        targets = tuple(Target(s.id, ep.address, ep.port) for s in specs for ep in s.endpoints)
        unknown = tuple(WorkerObservation(t.address, t.port, known=False) for t in targets)
        classes = {
            i.name: i.labels[ADAPTER_CLASS_LABEL]
            for i in instances
            if i.labels.get(ADAPTER_CLASS_LABEL)
        }
        homeless = tuple(
            sorted((i for i in instances if placement.wants_home(i)), key=lambda i: i.name)
        )
        return cls(
            key,
            specs,
            columns,
            targets,
            unknown,
            tuple(adapter_edge.edges_of(instances)),
            classes,
            homeless,
        )


_AGE = attrgetter("age_s")


class Rebalancer:
    def __init__(
        self,
        store: Store,
        source: LoadSource,
        *,
        clock: Clock | None = None,
        config: RebalancerConfig | None = None,
        hub: AssignmentHub | None = None,
        logger: logging.Logger | None = None,
        metrics: ControlPlaneMetrics | None = None,
    ) -> None:
        self.store = store
        self.source = source
        self.clock: Clock = clock or SystemClock()
        self.config = config or RebalancerConfig()
        self.config.policy.validate()
        self.hub = hub or AssignmentHub()
        self.log = logger or logging.getLogger("adaptermesh.control_plane.rebalancer")
        self.workers: dict[str, WorkerObservation] = {}
        # Callers of next_step() waiting for the loop's next finished step (run() sets running).
        self.running = False
        self._step_waiters: list[asyncio.Future[None]] = []
        # The observed resident adapters per worker in the last published Assignment: a change
        # (an adapter loaded or evicted, a worker gone) publishes without waiting for weights.
        self._affinity_published: dict[str, tuple[str, ...]] = {}
        self._loads: dict[str, ShardLoadView] | None = {}
        self._loads_from: tuple[ObservationColumns, _F, Decision, Mapping[str, int]] | None = None
        self._layout: _Layout | None = None
        # Sorted adapter tuples per resident set, so publishing affinity does not sort 8,000
        # small sets every tick.
        self._sorted_adapters: dict[frozenset[str], tuple[str, ...]] = {}
        # The live routing-rule set in its carried form (rebuilt when its version moves).
        self._carried: assignment_pb2.RoutingRules | None = None
        # Automatic homes (adapter -> shard) from the placement loop, and the edges built
        # with them for one layout (rebuilt when either changes).
        self.homes: dict[str, str] = {}
        self._homed_edges: (
            tuple[tuple[int, int], dict[str, str], tuple[assignment_pb2.AdapterEdge, ...]] | None
        ) = None
        self.steps = 0
        self.failures = 0
        self.publishes = 0
        self.last_error = ""
        self.metrics = metrics or ControlPlaneMetrics()
        self.metrics.bind(self.metrics_state, self.clock.time)
        self.capacity = CapacityHistory(self.config.capacity)
        self.state = PolicyState()
        latest = store.latest_assignment()
        if latest is not None:
            self.state = PolicyState(
                weights={s.id: s.weight for s in latest.shards if s.state == _ACTIVE},
                endpoint_weights={
                    s.id: {endpoint_key(e.address, e.port): e.weight for e in s.endpoints}
                    for s in latest.shards
                },
            )
            self.hub.publish(latest)

    # -- desired state -> observation ------------------------------------------------------

    def layout(self) -> _Layout:
        """The cached desired-state layout, re-read only when the store says it changed."""
        key = self.store.layout_key()
        if self._layout is None or self._layout.key != key:
            self._layout = _Layout.read(self.store)
        return self._layout

    def targets(self) -> list[Target]:
        return list(self.layout().targets)

    def _rows(
        self, layout: _Layout, workers: Mapping[str, WorkerObservation]
    ) -> list[WorkerObservation]:
        """One reading per endpoint row, in row order; unknown where the source had none."""
        return list(map(workers.get, layout.columns.endpoints, layout.unknown))

    def columns(
        self, workers: Mapping[str, WorkerObservation]
    ) -> tuple[ObservationColumns, list[WorkerObservation]]:
        """The policy's input for ``workers``: the same as ``observation`` gives, as columns
        built on the cached layout (array writes only), plus the rows it was built from."""
        layout = self.layout()
        rows = self._rows(layout, workers)
        overrides = {
            sid: OverrideSpec(sid, weight, expires_at)
            for sid, weight, _, expires_at, _ in self.store.list_overrides()
        }
        return layout.columns.columns(rows, overrides), rows

    # -- building and publishing -----------------------------------------------------------

    def _affinity(self) -> dict[str, tuple[str, ...]]:
        """The adapters to publish per worker; a worker absent keeps its shard spec's list.

        An unreachable worker gets none: Envoy would keep picking it when it is the only holder
        of an adapter (that subset panics), while without affinity the request falls back to
        the shard's healthy workers, which load the adapter on demand.
        """
        memo = self._sorted_adapters
        if len(memo) > 65_536:
            memo.clear()
        out: dict[str, tuple[str, ...]] = {}
        for key, seen in self.workers.items():
            if seen.down:
                out[key] = ()
            elif seen.known and seen.resident_adapters:
                res = seen.resident_adapters
                got = memo.get(res)
                if got is None:
                    got = memo[res] = tuple(sorted(res))
                out[key] = got
        return out

    def _build(
        self,
        weights: Mapping[str, int],
        endpoint_weights: Mapping[str, Mapping[str, int]],
        reason: str,
        affinity: Mapping[str, tuple[str, ...]],
    ) -> assignment_pb2.Assignment:
        now = self.clock.time()
        if len(reason) > rules.MAX_REASON:  # a summary: its head says what changed
            reason = reason[: rules.MAX_REASON - 3] + "..."
        out = assignment_pb2.Assignment(version=self.store.last_version() + 1, reason=reason)
        out.generated_at.FromNanoseconds(int(now * 1e9))
        for spec in self.layout().specs:
            shard = out.shards.add()
            shard.CopyFrom(spec)
            if shard.state == assignment_pb2.SHARD_STATE_UNSPECIFIED:
                shard.state = _ACTIVE
            shard.weight = weights.get(spec.id, 0) if shard.state == _ACTIVE else 0
            eps = endpoint_weights.get(spec.id, {})
            for ep in shard.endpoints:
                key = endpoint_key(ep.address, ep.port)
                ep.weight = max(1, eps.get(key, self.config.policy.endpoint_scale))
                # Absent: keep the shard spec's own list (see ``_affinity``).
                observed = affinity.get(key)
                if observed is not None:
                    del ep.adapters[:]
                    ep.adapters.extend(observed)
        pinned = set()
        for cidr, shard_id in self.store.list_pins():
            out.pins.add(cidr=cidr, shard_id=shard_id)
            pinned.add(cidr)
        carried = self._routing_rules()
        if carried is not None:
            out.routing_rules.CopyFrom(carried)
            # The set's source-CIDR-only rules reach the classifier as pins; an operator's pin
            # of the same CIDR wins (it is the more specific intent, and the rule agrees or
            # was written later against a pinned range).
            active = frozenset(s.id for s in out.shards if s.state == _ACTIVE)
            for pin in carried_pins(carried, active):
                if pin.cidr not in pinned:
                    out.pins.append(pin)
                    pinned.add(pin.cidr)
        out.overrides.extend(self.store.live_overrides(now))
        out.adapters.extend(self._edges())
        out.adapter_splits.extend(rollout_splits(self.store.rollouts()))
        return out

    def _edges(self) -> tuple[assignment_pb2.AdapterEdge, ...]:
        """The instances' edges, with each automatic home as the placement of an instance
        that names no shards (``placement.with_home``). Homes that would take the Assignment
        past ``adapter_edge.MAX_EDGES`` edges are left out (in name order), so they never
        stop a publish; those adapters are served as without a home."""
        layout = self.layout()
        placed = [i for i in layout.homeless if i.name in self.homes]
        if not placed:
            return layout.edges
        memo = self._homed_edges
        if memo is not None and memo[0] == layout.key and memo[1] == self.homes:
            return memo[2]
        by_name = {e.name: e for e in layout.edges}
        room = adapter_edge.MAX_EDGES - len(by_name)
        for inst in placement.homed(placed, self.homes):
            edge = adapter_edge.edge_of(inst)
            if edge is None:
                continue
            if edge.name not in by_name:
                if room <= 0:
                    continue
                room -= 1
            by_name[edge.name] = edge
        edges = tuple(by_name[name] for name in sorted(by_name))
        self._homed_edges = (layout.key, dict(self.homes), edges)
        return edges

    def resume_homes(self) -> None:
        """Take the homes of the last stored Assignment's edges (instances naming no shards
        whose edge has one), so a restarted control plane publishes the same edges until the
        placement loop's first round delivers its own."""
        latest = self.store.latest_assignment()
        if latest is None:
            return
        homeless = {i.name for i in self.layout().homeless}
        self.homes = {
            e.name: e.shards[0] for e in latest.adapters if e.name in homeless and e.shards
        }

    def set_homes(self, homes: Mapping[str, str]) -> None:
        """Take the placement loop's automatic homes; a change that moves an edge publishes
        a new Assignment at once (raises PublishError when it cannot be published)."""
        new = dict(homes)
        if new == self.homes:
            return
        before, old = self._edges(), self.homes
        self.homes = new
        if self._edges() == before:
            return
        moved = sorted(a for a in set(new) | set(old) if new.get(a) != old.get(a))
        shown = ", ".join(f"{a}->{new.get(a, '-')}" for a in moved[:8])
        more = f" and {len(moved) - 8} more" if len(moved) > 8 else ""
        try:
            self.mutate(lambda: None, f"adapter homes: {shown}{more}")
        except Exception:
            self.homes = old
            raise

    def _routing_rules(self) -> assignment_pb2.RoutingRules | None:
        """The live rule set in its carried form, rebuilt only when its version moves."""
        version = self.store.live_rule_set_version()
        if version == 0:
            return None
        if self._carried is None or self._carried.version != version:
            record = self.store.rule_set(version)
            assert record is not None
            self._carried = routing_rules_message(record.version, record.document)
        return self._carried

    def _validate(self, assignment: assignment_pb2.Assignment) -> None:
        # First what every agent will check before it applies (the same rules, so nothing
        # published can be refused by all of them at once), then the policy's own budget.
        try:
            rules.check_assignment(assignment)
            adapter_edge.check_edges(assignment)
            try:
                carried_rules(assignment.routing_rules)
            except RoutingRuleError as exc:
                raise rules.RuleError("routing_rules", str(exc)) from None
        except rules.RuleError as exc:
            raise PublishError(str(exc)) from exc
        active = [s.id for s in assignment.shards if s.state == _ACTIVE]
        weights = {s.id: s.weight for s in assignment.shards if s.state == _ACTIVE}
        problems = policy.validate_weights(
            weights, active, self.config.policy, {o.shard_id for o in assignment.overrides}
        )
        if problems:
            raise PublishError("; ".join(problems))

    def _stage(
        self,
        weights: Mapping[str, int],
        endpoint_weights: Mapping[str, Mapping[str, int]],
        reason: str,
        affinity: Mapping[str, tuple[str, ...]] | None = None,
    ) -> assignment_pb2.Assignment:
        """Build, validate and record an Assignment inside the caller's transaction."""
        if affinity is None:
            affinity = self._affinity()
        try:
            assignment = self._build(weights, endpoint_weights, reason, affinity)
            self._validate(assignment)
            self.store.append_assignment(assignment)
        except Exception:
            # The caller's transaction rolls back, and a rule set version it wrote may be
            # written again with other content: forget the carried form built from it.
            self._carried = None
            raise
        return assignment

    def _commit(
        self,
        assignment: assignment_pb2.Assignment,
        state: PolicyState,
        affinity: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.state = state
        self._affinity_published = self._affinity() if affinity is None else affinity
        self.publishes += 1
        self.metrics.count_publish(assignment.reason)
        self.hub.publish(assignment)

    def mutate(self, change: Callable[[], T], reason: str, *, publish: bool = True) -> T:
        """Apply a desired-state change and publish its Assignment at once, atomically.

        If the change or the Assignment it leads to is invalid, the transaction rolls back
        and nothing is stored or published.
        """
        with self.store.transaction():
            result = change()
            if not publish:
                return result
            obs, _ = self.columns(self.workers)
            weights, endpoints = policy.desired(
                obs, self.state, self.clock.time(), self.config.policy
            )
            affinity = self._affinity()
            assignment = self._stage(weights, endpoints, reason, affinity)
        self._commit(
            assignment,
            PolicyState(weights, endpoints, self.state.estimates),
            affinity,
        )
        return result

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> Decision:
        """One read -> decide -> validate -> publish."""
        self.steps += 1
        started = time.perf_counter()
        workers = await self.source.collect(self.targets(), self.clock.monotonic())
        errors = getattr(self.source, "errors", None)
        if isinstance(errors, Mapping):
            # ScrapeSource keeps one entry per worker whose last scrape failed.
            self.metrics.scrape_errors += len(errors)
        self.workers = dict(workers)
        now = self.clock.time()
        t0 = time.perf_counter()
        obs, rows = self.columns(self.workers)
        if self.config.power_law:
            self.capacity.add(self.workers, self.layout().classes)
            obs = replace(obs, curves=self.capacity.fits(), class_mixes=self.capacity.class_mixes())
        decision = policy.decide(obs, self.state, now, self.config.policy)
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        affinity = self._affinity()
        affinity_changed = affinity != self._affinity_published
        if decision.publish or decision.expired_overrides or affinity_changed:
            reason = decision.reason
            if affinity_changed and not (decision.publish or decision.expired_overrides):
                reason = _affinity_reason(affinity, self._affinity_published)
            with self.store.transaction():
                if decision.expired_overrides:
                    self.store.delete_expired_overrides(now)
                assignment = self._stage(
                    decision.weights, decision.endpoint_weights, reason, affinity
                )
            self._commit(assignment, decision.state, affinity)
        else:
            self.state = decision.state
        ages = np.array(list(map(_AGE, rows)), dtype=np.float64)
        self._loads_from = (obs, ages, decision, self.state.weights)
        self._loads = None
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        return decision

    @property
    def loads(self) -> dict[str, ShardLoadView]:
        """Per-shard load of the last step, built when read (GetStatus, a metrics scrape)."""
        if self._loads is None:
            assert self._loads_from is not None
            self._loads = _summarise(*self._loads_from)
        return self._loads

    def metrics_state(self) -> ControlPlaneState:
        """What a metrics scrape exports: the newest Assignment, the loop's counters, the
        per-shard load of the last step and the nodes' reports (read from the store)."""
        latest = self.hub.latest
        return ControlPlaneState(
            assignment_version=latest.version if latest is not None else 0,
            # What the nodes are told: DRAINING shards at 0.
            shard_weights={} if latest is None else {s.id: s.weight for s in latest.shards},
            rebalance_steps=self.steps,
            rebalance_failures=self.failures,
            watch_streams=self.hub.watchers,
            shard_loads=self.loads,
            nodes=self.store.list_nodes(),
        )

    async def next_step(self, timeout_s: float) -> bool:
        """Wait until the loop (``run``) finishes its next step, failed or not: True then; False
        after ``timeout_s``, or at once when no loop runs (no step would come)."""
        if not self.running:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._step_waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if waiter in self._step_waiters:
                self._step_waiters.remove(waiter)

    def _wake_step_waiters(self) -> None:
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Repeat ``step()`` every interval until ``stop`` is set; back off after failures."""
        self.running = True
        try:
            await self._run(stop)
        finally:
            self.running = False
            self._wake_step_waiters()

    async def _run(self, stop: asyncio.Event | None) -> None:
        stop = stop or asyncio.Event()
        # n failures in a row wait interval * 2**n, up to max_backoff_s (no jitter: there is
        # one control plane, so no herd to spread out).
        cap = self.config.max_backoff_s
        backoff = Backoff(min(2 * self.config.interval_s, cap), cap, jitter=0.0)
        consecutive = 0
        while not stop.is_set():
            delay = self.config.interval_s
            try:
                await self.step()
                consecutive = 0
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                self.last_error = repr(exc)
                consecutive += 1
                delay = backoff.next()
                self.log.exception(
                    "rebalance step failed (%d in a row); retry in %.1fs", consecutive, delay
                )
            self._wake_step_waiters()
            await sleep_or_stop(self.clock, delay, stop)

    def status_loads(self) -> list[control_plane_pb2.ShardLoad]:
        return [
            control_plane_pb2.ShardLoad(
                shard_id=v.shard_id,
                weight=self.state.weights.get(v.shard_id, 0),
                queue_depth=v.queue_depth,
                running=v.running,
                latency_ms=v.latency_ms,
                tokens_per_s=v.tokens_per_s,
                kv_cache_usage=v.kv_cache_usage,
                free_gpu_bytes=v.free_gpu_bytes,
                known=v.known,
                utilization=v.utilization,
                workers=v.workers,
                workers_known=v.workers_known,
                age_s=v.age_s,
            )
            for v in sorted(self.loads.values(), key=lambda v: v.shard_id)
        ]


def _affinity_reason(
    now: Mapping[str, tuple[str, ...]], before: Mapping[str, tuple[str, ...]]
) -> str:
    gone = sorted(k for k, v in now.items() if v == () and before.get(k) != ())
    moved = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
    detail = (
        f"unreachable {', '.join(gone)}" if gone else f"resident adapters of {', '.join(moved)}"
    )
    return f"endpoint set changed: adapter affinity ({detail})"


def _summarise(
    obs: ObservationColumns, ages: _F, decision: Decision, weights: Mapping[str, int]
) -> dict[str, ShardLoadView]:
    n = len(obs.shard_ids)
    shard_of = obs.shard_of
    known = obs.known
    ks = shard_of[known]

    def ksum(values: _F) -> list[float]:
        out: list[float] = np.bincount(ks, weights=values[known], minlength=n).tolist()
        return out

    n_known = np.bincount(ks, minlength=n)
    kv = np.bincount(ks, weights=obs.kv_cache_usage[known], minlength=n)
    kv_mean = np.where(n_known > 0, kv / np.maximum(n_known, 1), 0.0).tolist()
    finite = np.isfinite(ages)
    min_age = np.full(n, np.inf)
    np.minimum.at(min_age, shard_of[finite], ages[finite])
    age = np.where(np.isfinite(min_age), min_age, -1.0).tolist()
    waiting, running = ksum(obs.waiting), ksum(obs.running)
    tokens = ksum(obs.tokens_per_s)
    free = ksum(np.nan_to_num(obs.gpu_free_bytes, nan=0.0))
    counts = np.diff(obs.offsets).tolist()
    nk = n_known.tolist()
    estimates = decision.state.estimates
    loads: dict[str, ShardLoadView] = {}
    for i, sid in enumerate(obs.shard_ids):
        est = estimates.get(sid)
        lat = est.latency_s if est is not None and est.latency_s is not None else 0.0
        loads[sid] = ShardLoadView(
            shard_id=sid,
            weight=weights.get(sid, 0),
            queue_depth=waiting[i],
            running=running[i],
            latency_ms=lat * 1000.0,
            tokens_per_s=tokens[i],
            kv_cache_usage=kv_mean[i],
            free_gpu_bytes=free[i],
            known=nk[i] > 0,
            utilization=decision.utilization.get(sid) or 0.0,
            workers=counts[i],
            workers_known=nk[i],
            age_s=age[i],
        )
    return loads
