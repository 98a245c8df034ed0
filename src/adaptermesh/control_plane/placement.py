"""Which workers should hold which adapters: the pure half of the placement loop.

An AdapterInstance's ``placement`` asks for residency (docs/adapter-instance.md):

* ``preload``: the adapter is loaded onto workers of its shards before any request needs it.
* ``pinnedShards``: on these shards it is loaded *pinned*: the worker never evicts it.
* ``replicas``: how many workers of each of those shards hold it (0 means 1; fewer when the
  shard has fewer serving workers). A ``replicas`` above 0 asks for residency by itself.

The shards are ``placement.shards``, else the instance's shard routes, else every shard; the
pinned shards always count. :func:`plan` compares what is wanted with what each worker's
``/metrics`` says it holds (``adaptermesh_adapter_resident{adapter, pinned}``) and returns
the loads that close the gap. No I/O, no clock: the loop (``control_plane/preloader.py``)
reads, calls this and acts.

Replicas are picked stably: workers that already hold the adapter pinned, then resident, then
by rendezvous hash of (adapter, worker), so each adapter lands on the same workers round after
round while different adapters spread over a shard's workers. Unreachable and draining
workers are never picked; the next round replaces them.

A worker keeps an adapter pinned only where an instance wants it: pins of an instance's
adapter elsewhere (pinnedShards or replicas shrunk) and pins the loop made itself for an
adapter whose instance is gone are loaded again unpinned, so the worker may evict them.
Pins nobody asked the loop for (a worker's ``--lora-modules``) are left alone.

Automatic homes (``adaptermesh control-plane --auto-placement``): an instance that names no
shards itself (no ``placement.shards``, no shard routes) gets one home shard from
:func:`homes`, a rendezvous hash of (adapter, shard) weighted by each shard's adapter slots
(:func:`shard_capacities`: the GPU slots its serving workers report). :func:`with_home` writes
the home into the instance as if it had named it, so the Assignment's edge forwards requests
for it to that shard and :func:`wants_of` preloads it on ``replicas`` workers there.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from adaptermesh.control_plane.policy import endpoint_key
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2

__all__ = [
    "Action",
    "Plan",
    "ShardCapacity",
    "Want",
    "WorkerView",
    "homed",
    "homes",
    "plan",
    "shard_capacities",
    "wants_home",
    "wants_of",
    "with_home",
]

PIN = "pin"
PRELOAD = "preload"
UNPIN = "unpin"
_ORDER = {PIN: 0, PRELOAD: 1, UNPIN: 2}


@dataclass(frozen=True, slots=True)
class Want:
    """What one AdapterInstance asks of the workers."""

    adapter: str
    path: str  # as the workers see it (``modelRef.adapterPath``, else the adapter's name)
    shards: tuple[str, ...]  # shards that hold it resident; empty: none asked
    pinned_shards: frozenset[str]
    replicas: int  # workers per shard, >= 1


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the latest scrape saw it."""

    shard_id: str
    address: str
    port: int
    known: bool  # this round's scrape answered
    draining: bool = False
    resident: frozenset[str] = frozenset()
    pinned: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return endpoint_key(self.address, self.port)


@dataclass(frozen=True, slots=True)
class Action:
    """One ``POST /v1/load_lora_adapter`` to one worker."""

    shard_id: str
    address: str
    port: int
    adapter: str
    path: str
    pinned: bool
    why: str  # pin, preload or unpin

    @property
    def key(self) -> tuple[str, str]:
        return endpoint_key(self.address, self.port), self.adapter


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    # Loads that were due but left for a later round: over ``max_actions`` or held back.
    deferred: int
    # (adapter, shard, held, wanted) where a shard has fewer serving workers than replicas.
    short: tuple[tuple[str, str, int, int], ...]
    # (worker key, adapter) -> path of every pin this plan wants.
    pins: Mapping[tuple[str, str], str]


def _residency_shards(
    inst: control_plane_pb2.AdapterInstance, shard_ids: Sequence[str]
) -> tuple[str, ...]:
    p = inst.placement
    if not (p.preload or p.pinned_shards or p.replicas):
        return ()
    routed = [r.shard_id for r in inst.routes if r.shard_id]
    base = list(p.shards) or routed or list(shard_ids)
    return tuple(dict.fromkeys([*base, *p.pinned_shards]))


def wants_of(
    instances: Iterable[control_plane_pb2.AdapterInstance], shards: Iterable[assignment_pb2.Shard]
) -> list[Want]:
    """One Want per instance (those asking nothing have no shards), in adapter order."""
    ids = sorted(s.id for s in shards)
    out = [
        Want(
            adapter=inst.name,
            path=inst.model_ref.adapter_path or inst.name,
            shards=_residency_shards(inst, ids),
            pinned_shards=frozenset(inst.placement.pinned_shards),
            replicas=max(1, inst.placement.replicas),
        )
        for inst in instances
    ]
    return sorted(out, key=lambda w: w.adapter)


def _rank(adapter: str, key: str) -> bytes:
    return hashlib.blake2b(f"{adapter}\0{key}".encode(), digest_size=8).digest()


def plan(
    wants: Sequence[Want],
    workers: Sequence[WorkerView],
    *,
    managed: Mapping[tuple[str, str], str],
    held: frozenset[tuple[str, str]] = frozenset(),
    max_actions: int = 16,
) -> Plan:
    """The loads that bring ``workers`` to ``wants``.

    ``managed`` holds the pins the loop made earlier ((worker key, adapter) -> path);
    ``held`` the (worker key, adapter) pairs not to touch this round (a recent failure or
    preload). At most ``max_actions`` come back: pins first, then preloads, then unpins.
    """
    if max_actions < 0:
        raise ValueError("max_actions must be >= 0")
    by_shard: dict[str, list[WorkerView]] = {}
    for w in workers:
        if w.known and not w.draining:
            by_shard.setdefault(w.shard_id, []).append(w)
    due: list[Action] = []
    short: list[tuple[str, str, int, int]] = []
    pins: dict[tuple[str, str], str] = {}
    named: dict[str, str] = {}
    for want in wants:
        named[want.adapter] = want.path
        for shard_id in want.shards:
            a = want.adapter
            eligible = sorted(
                by_shard.get(shard_id, ()),
                key=lambda w: (a not in w.pinned, a not in w.resident, _rank(a, w.key)),
            )
            chosen = eligible[: want.replicas]
            if len(chosen) < want.replicas:
                short.append((a, shard_id, len(chosen), want.replicas))
            pin = shard_id in want.pinned_shards
            for w in chosen:
                if pin:
                    pins[(w.key, a)] = want.path
                    if a not in w.pinned:
                        due.append(Action(w.shard_id, w.address, w.port, a, want.path, True, PIN))
                elif a not in w.resident:
                    due.append(Action(w.shard_id, w.address, w.port, a, want.path, False, PRELOAD))
    for w in workers:
        if not w.known:
            continue
        for a in sorted(w.pinned):
            if (w.key, a) in pins:
                continue
            path = named.get(a) or managed.get((w.key, a))
            if path is not None:
                due.append(Action(w.shard_id, w.address, w.port, a, path, False, UNPIN))
    due.sort(key=lambda act: (_ORDER[act.why], act.adapter, act.shard_id, act.address, act.port))
    ready = [act for act in due if act.key not in held]
    actions = tuple(ready[:max_actions])
    return Plan(actions, len(due) - len(actions), tuple(short), pins)


# -- automatic homes ------------------------------------------------------------------------

_HOME_STATES = (assignment_pb2.SHARD_STATE_ACTIVE, assignment_pb2.SHARD_STATE_UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class ShardCapacity:
    """One shard as a candidate home."""

    shard_id: str
    active: bool  # active (not draining): it may be a home
    slots: float  # adapter GPU slots of its serving workers; 0: none known


def shard_capacities(
    shards: Iterable[assignment_pb2.Shard], slots: Mapping[str, float]
) -> list[ShardCapacity]:
    """Each shard's adapter slots: the sum over its serving (not draining) workers of the GPU
    slots each reported last (``slots``: worker key -> slots). A worker that never reported
    counts as the mean of those that did; with none reported every shard counts 0 (equal
    weights in :func:`homes`)."""
    listed = sorted(shards, key=lambda s: s.id)
    known = [
        v
        for s in listed
        for ep in s.endpoints
        if (v := slots.get(endpoint_key(ep.address, ep.port), 0.0)) > 0
    ]
    mean = sum(known) / len(known) if known else 0.0
    out = []
    for s in listed:
        total = 0.0
        for ep in s.endpoints:
            if not ep.draining:
                reported = slots.get(endpoint_key(ep.address, ep.port), 0.0)
                total += reported if reported > 0 else mean
        out.append(ShardCapacity(s.id, s.state in _HOME_STATES, total))
    return out


def _home_score(adapter: str, shard_id: str, weight: float) -> float:
    """Weighted rendezvous score: the shard with the largest wins, with a probability
    proportional to its weight, and a shard's score does not depend on the others."""
    digest = hashlib.blake2b(f"home\0{adapter}\0{shard_id}".encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 0.5) / 2.0**64  # in (0, 1)
    return weight / -math.log(uniform)


def homes(adapters: Iterable[str], shards: Sequence[ShardCapacity]) -> dict[str, str]:
    """adapter -> its home shard: among the active shards, by rendezvous hash of (adapter,
    shard) weighted by slots (equal weights when no active shard has any). Stable: a shard
    that leaves moves only its own adapters, one that joins takes only its share, and a
    weight change moves adapters to or from that shard only. Empty when no shard is active."""
    active = [s for s in shards if s.active]
    weighted = {s.shard_id: s.slots for s in active if s.slots > 0}
    weights = weighted or {s.shard_id: 1.0 for s in active}
    if not weights:
        return {}
    return {
        adapter: max(weights, key=lambda sid: (_home_score(adapter, sid, weights[sid]), sid))
        for adapter in adapters
    }


def wants_home(inst: control_plane_pb2.AdapterInstance) -> bool:
    """An instance that names no shards itself (no ``placement.shards``, no shard routes)."""
    return not inst.placement.shards and not any(r.shard_id for r in inst.routes)


def with_home(
    inst: control_plane_pb2.AdapterInstance, home: str
) -> control_plane_pb2.AdapterInstance:
    """``inst`` as if it named ``home`` (and its pinned shards) in ``placement.shards`` and
    asked for ``max(replicas, 1)`` workers there: its edge forwards to the home and the loop
    preloads it there."""
    out = control_plane_pb2.AdapterInstance()
    out.CopyFrom(inst)
    out.placement.shards[:] = list(dict.fromkeys([home, *inst.placement.pinned_shards]))
    out.placement.replicas = max(1, inst.placement.replicas)
    return out


def homed(
    instances: Iterable[control_plane_pb2.AdapterInstance], home_of: Mapping[str, str]
) -> list[control_plane_pb2.AdapterInstance]:
    """The instances with their homes written in (:func:`with_home`); an instance that names
    its own shards, or has no home, as it is."""
    return [
        with_home(inst, home_of[inst.name]) if inst.name in home_of and wants_home(inst) else inst
        for inst in instances
    ]
