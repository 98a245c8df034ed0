"""The placement plan (pure): which loads bring the workers to the instances' preload,
pinnedShards and replicas; idempotent, bounded and stable."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane.placement import (
    Action,
    ShardCapacity,
    Want,
    WorkerView,
    homed,
    homes,
    plan,
    shard_capacities,
    wants_home,
    wants_of,
    with_home,
)
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2

from .conftest import instance


def _inst(name: str, **placement: object) -> control_plane_pb2.AdapterInstance:
    return instance(name, f"risk/{name}", **placement)


SHARDS = [assignment_pb2.Shard(id=i) for i in ("s0", "s1", "s2")]


def _workers(n: int = 3, shards: tuple[str, ...] = ("s0", "s1", "s2")) -> list[WorkerView]:
    return [
        WorkerView(s, f"10.0.{j}.{i}", 8000, True)
        for j, s in enumerate(shards)
        for i in range(1, n + 1)
    ]


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
    workers = [
        replace(s0, resident=frozenset({"a", "x", "boot"}), pinned=frozenset({"a", "x", "boot"})),
        s1,
        s2,
    ]
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
        insts.append(
            _inst(
                n,
                preload=draw(st.booleans()),
                shards=placed,
                pinned_shards=pinned,
                replicas=draw(st.integers(0, 4)),
            )
        )
    workers = []
    for j, s in enumerate(("s0", "s1", "s2")):
        for i in range(draw(st.integers(0, 3))):
            res = frozenset(draw(st.lists(st.sampled_from("abcdefz"), unique=True)))
            pin = (
                frozenset(draw(st.lists(st.sampled_from(sorted(res)), unique=True)))
                if res
                else frozenset()
            )
            workers.append(
                WorkerView(
                    s, f"10.1.{j}.{i}", 8000, draw(st.booleans()), draw(st.booleans()), res, pin
                )
            )
    return insts, workers


@settings(max_examples=150, deadline=None)
@given(scenes(), st.integers(1, 8))
def test_plans_are_bounded_and_converge_to_a_fixed_point(scene, bound) -> None:
    insts, workers = scene
    wants = wants_of(insts, SHARDS)
    for _ in range(100):  # each round sends at most ``bound``; rounds converge
        p = plan(wants, workers, managed={}, max_actions=bound)
        assert len(p.actions) <= bound
        assert all(
            w.known and not w.draining
            for w in workers
            for a in p.actions
            if a.why != "unpin" and a.key[0] == w.key
        )
        if not p.actions:
            break
        workers = _apply(workers, p.actions)
    else:
        raise AssertionError("the plan did not converge")
    # At the fixed point every shard holds min(replicas, serving workers), pinned where asked.
    for want in wants:
        for shard_id in want.shards:
            serving = [w for w in workers if w.shard_id == shard_id and w.known and not w.draining]
            pin = shard_id in want.pinned_shards
            holding = [w for w in serving if want.adapter in (w.pinned if pin else w.resident)]
            assert len(holding) >= min(want.replicas, len(serving))
    # Known workers keep an instance's adapter pinned only where the plan wants it.
    named = {x.adapter for x in wants}
    pins = {(w.key, a) for w in workers if w.known for a in w.pinned if a in named}
    assert pins <= set(p.pins)


# -- automatic homes ----------------------------------------------------------------------

ADAPTER_NAMES = [f"adapter-{i}" for i in range(600)]


def _caps(**slots: float) -> list[ShardCapacity]:
    return [ShardCapacity(sid, True, v) for sid, v in slots.items()]


shard_names = st.lists(
    st.sampled_from([f"s{i}" for i in range(12)]), min_size=1, max_size=8, unique=True
)


@settings(max_examples=40, deadline=None)
@given(shard_names, st.data())
def test_a_shard_joining_or_leaving_moves_only_its_share(names: list[str], data: st.DataObject):
    slots = {n: float(data.draw(st.integers(1, 8), label=f"slots {n}")) for n in names}
    before = homes(ADAPTER_NAMES, _caps(**slots))
    joiner = data.draw(st.sampled_from([f"j{i}" for i in range(4)]))
    joined = homes(ADAPTER_NAMES, _caps(**slots, **{joiner: 4.0}))
    moved = [a for a in ADAPTER_NAMES if joined[a] != before[a]]
    # Only to the new shard, and about its share of the weight.
    assert all(joined[a] == joiner for a in moved)
    share = 4.0 / (sum(slots.values()) + 4.0)
    assert len(moved) <= len(ADAPTER_NAMES) * share + 4 * (len(ADAPTER_NAMES) * share) ** 0.5 + 5
    if len(names) > 1:
        leaver = data.draw(st.sampled_from(names))
        left = homes(ADAPTER_NAMES, _caps(**{n: v for n, v in slots.items() if n != leaver}))
        # Only the leaver's adapters move; the rest stay where they were.
        assert all(left[a] == before[a] for a in ADAPTER_NAMES if before[a] != leaver)
        assert leaver not in left.values()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=2, max_size=5))
def test_homes_follow_the_slots_within_tolerance(weights: list[int]) -> None:
    names = [f"adapter-{i}" for i in range(4000)]
    caps = _caps(**{f"s{i}": float(w) for i, w in enumerate(weights)})
    got = homes(names, caps)
    total = sum(weights)
    for i, w in enumerate(weights):
        share = sum(1 for h in got.values() if h == f"s{i}") / len(names)
        assert abs(share - w / total) < 0.035, (i, share, w / total)


def test_homes_are_stable_and_fall_back_to_equal_weights() -> None:
    caps = _caps(s0=4, s1=4, s2=4)
    assert homes(ADAPTER_NAMES, caps) == homes(list(reversed(ADAPTER_NAMES)), caps)
    unknown = homes(ADAPTER_NAMES, _caps(s0=0, s1=0, s2=0))
    assert unknown == homes(ADAPTER_NAMES, _caps(s0=2, s1=2, s2=2))
    assert homes(ADAPTER_NAMES, [ShardCapacity("s0", False, 4)]) == {}


def test_capacities_sum_serving_workers_and_fill_in_the_unknown() -> None:
    draining = assignment_pb2.Shard(id="s2", state=assignment_pb2.SHARD_STATE_DRAINING)
    draining.endpoints.add(address="10.0.2.1", port=8000)
    s0 = assignment_pb2.Shard(id="s0", state=assignment_pb2.SHARD_STATE_ACTIVE)
    s0.endpoints.add(address="10.0.0.1", port=8000)
    s0.endpoints.add(address="10.0.0.2", port=8000)
    s0.endpoints.add(address="10.0.0.3", port=8000, draining=True)
    s1 = assignment_pb2.Shard(id="s1")
    s1.endpoints.add(address="10.0.1.1", port=8000)
    slots = {"10.0.0.1:8000": 4.0, "10.0.0.3:8000": 4.0, "10.0.2.1:8000": 8.0}
    caps = shard_capacities([s1, draining, s0], slots)
    # s0: one known (4) + one unknown at the known mean (16/3); the draining worker left out.
    assert caps == [
        ShardCapacity("s0", True, 4.0 + 16 / 3),
        ShardCapacity("s1", True, 16 / 3),
        ShardCapacity("s2", False, 8.0),
    ]
    assert shard_capacities([s0, s1], {}) == [
        ShardCapacity("s0", True, 0.0),
        ShardCapacity("s1", True, 0.0),
    ]


@st.composite
def fleets(
    draw: st.DrawFn,
) -> tuple[list[control_plane_pb2.AdapterInstance], list[assignment_pb2.Shard]]:
    shard_list = []
    for i in range(draw(st.integers(0, 5))):
        state = draw(
            st.sampled_from(
                [
                    assignment_pb2.SHARD_STATE_ACTIVE,
                    assignment_pb2.SHARD_STATE_DRAINING,
                    assignment_pb2.SHARD_STATE_UNSPECIFIED,
                ]
            )
        )
        s = assignment_pb2.Shard(id=f"s{i}", state=state)
        for j in range(draw(st.integers(0, 3))):
            s.endpoints.add(address=f"10.0.{i}.{j + 1}", port=8000, draining=draw(st.booleans()))
        shard_list.append(s)
    ids = [s.id for s in shard_list]
    instances = []
    for k in range(draw(st.integers(0, 12))):
        inst = _inst(f"a{k}", replicas=draw(st.integers(0, 3)))
        if ids and draw(st.booleans()):
            inst.placement.shards.extend(
                draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
            )
        instances.append(inst)
    return instances, shard_list


@settings(max_examples=80, deadline=None)
@given(
    fleets(),
    st.dictionaries(
        st.sampled_from([f"10.0.{i}.{j}:8000" for i in range(5) for j in range(1, 4)]),
        st.sampled_from([0.0, 1.0, 4.0, 8.0]),
    ),
)
def test_one_home_per_instance_on_an_active_shard_and_explicit_placement_wins(
    fleet: tuple[list[control_plane_pb2.AdapterInstance], list[assignment_pb2.Shard]],
    slots: dict[str, float],
) -> None:
    instances, shard_list = fleet
    names = [i.name for i in instances if wants_home(i)]
    got = homes(names, shard_capacities(shard_list, slots))
    active = {s.id for s in shard_list if s.state != assignment_pb2.SHARD_STATE_DRAINING}
    if active:
        assert set(got) == set(names)  # exactly one home each
        assert set(got.values()) <= active  # never draining or absent
    else:
        assert got == {}
    placed = homed(instances, got)
    for before, after in zip(instances, placed, strict=True):
        if before.placement.shards:
            assert after == before  # explicit placement wins
        elif before.name in got:
            assert list(after.placement.shards) == [got[before.name]]
            assert after.placement.replicas == max(1, before.placement.replicas)
    wants = {w.adapter: w for w in wants_of(placed, shard_list)}
    for name, home in got.items():
        assert wants[name].shards == (home,)


def test_a_homed_instance_keeps_its_pinned_shards_and_route_shards_name_their_own() -> None:
    pinned = _inst("a", pinned_shards=["s2"])
    assert list(with_home(pinned, "s0").placement.shards) == ["s0", "s2"]
    routed = _inst("b")
    routed.routes.add(shard_id="s1", weight=1)
    assert not wants_home(routed)
    assert homed([routed], {"b": "s0"}) == [routed]
