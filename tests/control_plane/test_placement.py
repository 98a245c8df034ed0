"""The placement plan (pure): which loads bring the workers to the instances' preload,
pinnedShards and replicas; idempotent, bounded and stable."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane.placement import Action, Want, WorkerView, plan, wants_of
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2

from .conftest import instance


def _inst(name: str, **placement: object) -> control_plane_pb2.AdapterInstance:
    return instance(name, f"risk/{name}", **placement)


SHARDS = [assignment_pb2.Shard(id=i) for i in ("s0", "s1", "s2")]


def _workers(n: int = 3, shards: tuple[str, ...] = ("s0", "s1", "s2")) -> list[WorkerView]:
    return [WorkerView(s, f"10.0.{j}.{i}", 8000, True) for j, s in enumerate(shards)
            for i in range(1, n + 1)]


def _apply(workers: list[WorkerView], actions: tuple[Action, ...]) -> list[WorkerView]:
    """What the workers hold after the loads (a load replaces the pin state)."""
    out = []
    for w in workers:
        resident, pinned = set(w.resident), set(w.pinned)
        for a in actions:
            if (a.address, a.port) == (w.address, w.port):
                resident.add(a.adapter)
                (pinned.add if a.pinned else pinned.discard)(a.adapter)
        out.append(replace(w, resident=frozenset(resident), pinned=frozenset(pinned)))
    return out


def test_instances_asking_nothing_want_nothing() -> None:
    wants = wants_of([_inst("a")], SHARDS)
    assert wants == [Want("a", "risk/a", (), frozenset(), 1)]
    assert plan(wants, _workers(), managed={}).actions == ()


def test_preload_loads_one_worker_per_placement_shard_by_default() -> None:
    wants = wants_of([_inst("a", preload=True, shards=["s1", "s2"])], SHARDS)
    p = plan(wants, _workers(), managed={})
    assert sorted(a.shard_id for a in p.actions) == ["s1", "s2"]
    assert all(not a.pinned and a.why == "preload" and a.path == "risk/a" for a in p.actions)


def test_shards_default_to_route_shards_then_every_shard() -> None:
    routed = _inst("a", preload=True)
    routed.routes.add(shard_id="s2", weight=1)
    assert wants_of([routed], SHARDS)[0].shards == ("s2",)
    assert wants_of([_inst("b", preload=True)], SHARDS)[0].shards == ("s0", "s1", "s2")


def test_pinned_shards_pin_on_replicas_and_replicas_alone_preload() -> None:
    wants = wants_of([_inst("a", shards=["s0", "s1"], pinned_shards=["s1"], replicas=2)], SHARDS)
    p = plan(wants, _workers(), managed={})
    by = {(a.shard_id, a.pinned) for a in p.actions}
    assert by == {("s0", False), ("s1", True)}
    assert len(p.actions) == 4  # two workers on each shard
    assert len(p.pins) == 2
    assert all(k[1] == "a" for k in p.pins)


def test_already_resident_workers_are_kept_and_nothing_is_sent_twice() -> None:
    workers = _workers()
    workers[2] = replace(workers[2], resident=frozenset({"a"}))  # s0's third worker
    wants = wants_of([_inst("a", preload=True, shards=["s0"])], SHARDS)
    assert plan(wants, workers, managed={}).actions == ()


def test_short_shards_unreachable_and_draining_workers() -> None:
    workers = _workers(2)
    workers[0] = replace(workers[0], known=False)
    workers[1] = replace(workers[1], draining=True)
    wants = wants_of([_inst("a", preload=True, shards=["s0"], replicas=2)], SHARDS)
    p = plan(wants, workers, managed={})
    assert p.actions == ()
    assert p.short == (("a", "s0", 0, 2),)


def test_unpin_where_the_instance_no_longer_wants_it_or_is_gone() -> None:
    workers = _workers(1)
    s0, s1, s2 = workers
    workers = [replace(s0, resident=frozenset({"a", "x", "boot"}),
                       pinned=frozenset({"a", "x", "boot"})), s1, s2]
    wants = wants_of([_inst("a", preload=True, shards=["s0"])], SHARDS)  # a: no longer pinned
    p = plan(wants, workers, managed={(s0.key, "x"): "old/x"})
    unpins = {(a.adapter, a.path, a.pinned, a.why) for a in p.actions}
    # x: the loop pinned it and its instance is gone; boot: a worker's own pin, left alone.
    assert unpins == {("a", "risk/a", False, "unpin"), ("x", "old/x", False, "unpin")}


def test_held_pairs_and_the_bound_defer() -> None:
    wants = wants_of([_inst(f"a{i}", preload=True) for i in range(10)], SHARDS)
    p = plan(wants, _workers(), managed={}, max_actions=4)
    assert len(p.actions) == 4
    assert p.deferred == 26
    held = frozenset(a.key for a in p.actions)
    q = plan(wants, _workers(), managed={}, held=held, max_actions=100)
    assert not held & {a.key for a in q.actions}
    assert q.deferred == 4


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[control_plane_pb2.AdapterInstance], list[WorkerView]]:
    names = draw(st.lists(st.sampled_from("abcdef"), unique=True, max_size=5))
    shard_ids = st.sampled_from(("s0", "s1", "s2"))
    insts = []
    for n in names:
        placed = draw(st.lists(shard_ids, unique=True, max_size=3))
        pinned = draw(st.lists(st.sampled_from(placed), unique=True)) if placed else []
        insts.append(_inst(n, preload=draw(st.booleans()), shards=placed, pinned_shards=pinned,
                           replicas=draw(st.integers(0, 4))))
    workers = []
    for j, s in enumerate(("s0", "s1", "s2")):
        for i in range(draw(st.integers(0, 3))):
            res = frozenset(draw(st.lists(st.sampled_from("abcdefz"), unique=True)))
            pin = frozenset(draw(st.lists(st.sampled_from(sorted(res)), unique=True))) if res else frozenset()
            workers.append(WorkerView(s, f"10.1.{j}.{i}", 8000, draw(st.booleans()),
                                      draw(st.booleans()), res, pin))
    return insts, workers


@settings(max_examples=150, deadline=None)
@given(scenes(), st.integers(1, 8))
def test_plans_are_bounded_and_converge_to_a_fixed_point(scene, bound) -> None:
    insts, workers = scene
    wants = wants_of(insts, SHARDS)
    for _ in range(100):  # each round sends at most ``bound``; rounds converge
        p = plan(wants, workers, managed={}, max_actions=bound)
        assert len(p.actions) <= bound
        assert all(w.known and not w.draining for w in workers
                   for a in p.actions if a.why != "unpin" and a.key[0] == w.key)
        if not p.actions:
            break
        workers = _apply(workers, p.actions)
    else:
        raise AssertionError("the plan did not converge")
    # At the fixed point every shard holds min(replicas, serving workers), pinned where asked.
    for want in wants:
        for shard_id in want.shards:
            serving = [w for w in workers
                       if w.shard_id == shard_id and w.known and not w.draining]
            pin = shard_id in want.pinned_shards
            holding = [w for w in serving
                       if want.adapter in (w.pinned if pin else w.resident)]
            assert len(holding) >= min(want.replicas, len(serving))
    # Known workers keep an instance's adapter pinned only where the plan wants it.
    named = {x.adapter for x in wants}
    pins = {(w.key, a) for w in workers if w.known for a in w.pinned if a in named}
    assert pins <= set(p.pins)
