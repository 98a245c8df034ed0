"""The cached column layout: the same columns as the per-object conversion, tick after tick,
and the rebalancer re-reads it whenever the shards or adapter instances change."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.policy import (
    ColumnLayout,
    Observation,
    ObservationColumns,
    OverrideSpec,
    PolicyConfig,
    PolicyState,
    ShardObservation,
    WorkerObservation,
    decide,
    endpoint_key,
)
from adaptermesh.control_plane.rebalancer import Rebalancer
from adaptermesh.control_plane.store import Store
from adaptermesh.proto import assignment_pb2, control_plane_pb2

from .conftest import StaticSource, shard
from .reference_policy import decide_ref
from .strategies import observations

CFG = PolicyConfig()
_ARRAYS = (
    "active",
    "offsets",
    "known",
    "waiting",
    "running",
    "kv_cache_usage",
    "latency_s",
    "tokens_per_s",
    "gpu_free_bytes",
    "affinity_hits",
    "wanted",
)


def _object_observation(rb: Rebalancer, workers: dict[str, WorkerObservation]) -> Observation:
    """The per-object Observation of the rebalancer's store, read shard by shard: the
    reference the cached column layout must match."""
    routed: dict[str, set[str]] = {}
    for inst in rb.store.list_adapter_instances():
        for route in inst.routes:
            routed.setdefault(route.shard_id, set()).add(inst.name)
    shards: dict[str, ShardObservation] = {}
    for spec in rb.store.list_shards():
        obs = []
        for ep in spec.endpoints:
            w = workers.get(endpoint_key(ep.address, ep.port))
            obs.append(w if w is not None else WorkerObservation(ep.address, ep.port, known=False))
        shards[spec.id] = ShardObservation(
            spec.id,
            active=spec.state
            in (assignment_pb2.SHARD_STATE_ACTIVE, assignment_pb2.SHARD_STATE_UNSPECIFIED),
            workers=tuple(obs),
            routed_adapters=frozenset(routed.get(spec.id, ())),
        )
    overrides = {
        sid: OverrideSpec(sid, weight, expires_at)
        for sid, weight, _, expires_at, _ in rb.store.list_overrides()
    }
    return Observation(shards, overrides)


def _assert_same(a: ObservationColumns, b: ObservationColumns) -> None:
    assert a.shard_ids == b.shard_ids
    assert a.endpoints == b.endpoints
    for name in _ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    assert dict(a.overrides) == dict(b.overrides)


def _layout_for(obs: Observation, max_interned: int | None = None) -> ColumnLayout:
    layout = ColumnLayout.from_observation(obs)
    if max_interned is not None:
        layout.max_interned = max_interned
    return layout


def _rows(layout: ColumnLayout, obs: Observation) -> list[WorkerObservation]:
    return [w for sid in layout.shard_ids for w in obs.shards[sid].workers]


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from([None, 3]))
def test_reused_layout_gives_the_per_object_columns(
    data: st.DataObject, max_interned: int | None
) -> None:
    first = data.draw(observations())
    ids = sorted(first.shards)
    routed = {
        sid: frozenset(data.draw(st.lists(st.sampled_from("xyzv"), max_size=2))) for sid in ids
    }
    layout: ColumnLayout | None = None
    fast_state = ref_state = PolicyState()
    for t in range(4):
        load = data.draw(observations(ids))
        shards = {}
        for sid in ids:
            # Same endpoints every tick (the layout's contract), new readings.
            news = load.shards[sid].workers
            ws = tuple(
                replace(news[k], address=w.address, port=w.port) if k < len(news) else w
                for k, w in enumerate(first.shards[sid].workers)
            )
            shards[sid] = ShardObservation(sid, first.shards[sid].active, ws, routed[sid])
        obs = Observation(shards, {})
        if layout is None:
            layout = _layout_for(obs, max_interned)
        if layout.endpoints != ObservationColumns.from_observation(obs).endpoints:
            layout = _layout_for(obs, max_interned)  # endpoint addresses moved: a new layout
        cols = layout.columns(_rows(layout, obs), obs.overrides)
        _assert_same(cols, ObservationColumns.from_observation(obs))
        fast = decide(cols, fast_state, float(t), CFG)
        ref = decide_ref(obs, ref_state, float(t), CFG)
        assert fast.weights == ref.weights
        assert {k: dict(v) for k, v in fast.endpoint_weights.items()} == {
            k: dict(v) for k, v in ref.endpoint_weights.items()
        }
        fast_state, ref_state = fast.state, ref.state


def test_non_finite_readings_count_as_not_reported() -> None:
    w = WorkerObservation(
        "10.0.0.1",
        80,
        known=True,
        waiting=math.inf,
        running=math.nan,
        latency_s=math.inf,
        gpu_free_bytes=-math.inf,
        tokens_per_s=math.nan,
    )
    layout = ColumnLayout(["a"], [True], [["10.0.0.1:80"]])
    cols = layout.columns([w])
    assert (cols.waiting[0], cols.running[0], cols.tokens_per_s[0]) == (0, 0, 0)
    assert math.isnan(cols.latency_s[0])
    assert math.isnan(cols.gpu_free_bytes[0])


def test_many_adapters_span_several_mask_words() -> None:
    names = [f"ad{i}" for i in range(150)]
    ws = [
        WorkerObservation(
            "10.0.0.1",
            80,
            known=True,
            resident_adapters=frozenset(names[:100]),
            requested_adapters=frozenset(names[90:]),
        ),
        WorkerObservation("10.0.0.2", 80, known=True, resident_adapters=frozenset(names[140:])),
    ]
    obs = Observation({"a": ShardObservation("a", True, tuple(ws), frozenset({"zz"}))})
    layout = ColumnLayout.from_observation(obs)
    _assert_same(layout.columns(ws), ObservationColumns.from_observation(obs))
    assert layout.columns(ws).wanted.tolist() == [61.0]
    assert layout.columns(ws).affinity_hits.tolist() == [10.0, 10.0]


def test_layout_rejects_bad_input_naming_the_field() -> None:
    with pytest.raises(ValueError, match="shard_ids"):
        ColumnLayout(["b", "a"], [True, True], [[], []])
    with pytest.raises(ValueError, match="shard_ids"):
        ColumnLayout(["a", "a"], [True, True], [[], []])
    with pytest.raises(ValueError, match="active and endpoints"):
        ColumnLayout(["a"], [True, False], [[]])
    with pytest.raises(ValueError, match="workers"):
        ColumnLayout(["a"], [True], [["x:1"]]).columns([])


def _rebalancer(tmp_path: Path) -> tuple[Rebalancer, StaticSource, Store, FakeClock]:
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    source = StaticSource()
    clock = FakeClock()
    rb = Rebalancer(store, source, clock=clock)
    for sid in ("a", "b"):
        spec = shard(sid, (f"10.1.{ord(sid)}.1", 8000), (f"10.1.{ord(sid)}.2", 8000))
        rb.mutate(lambda spec=spec: store.upsert_shard(spec, clock.time()), f"add {sid}")
    return rb, source, store, clock


def _fill(source: StaticSource, rb: Rebalancer) -> None:
    for i, t in enumerate(rb.targets()):
        source.workers[t.key] = WorkerObservation(
            t.address,
            t.port,
            known=True,
            running=4.0 + i,
            kv_cache_usage=0.1 * (i % 5),
            latency_s=0.2 + 0.01 * i,
            tokens_per_s=100.0 * (i + 1),
            resident_adapters=frozenset({"support"}),
            requested_adapters=frozenset({"support"}),
        )


def test_rebalancer_layout_follows_store_changes(tmp_path: Path) -> None:
    rb, _, store, clock = _rebalancer(tmp_path)
    first = rb.layout()
    assert rb.layout() is first  # nothing changed: no re-read
    # Written straight to the store, not through mutate(): still seen.
    store.upsert_shard(shard("c", ("10.1.99.1", 8000)), clock.time())
    second = rb.layout()
    assert second is not first
    assert "c" in second.columns.shard_ids
    assert [t.key for t in rb.targets()] == list(second.columns.endpoints)
    inst = control_plane_pb2.AdapterInstance(
        name="support",
        model_ref=control_plane_pb2.ModelRef(base_model="m"),
        routes=[control_plane_pb2.AdapterRoute(shard_id="a")],
    )
    store.upsert_adapter_instance(inst, clock.time())
    third = rb.layout()
    assert third.columns.routed[third.columns.shard_ids.index("a")] == {"support"}
    store.delete_adapter_instance("support")
    assert rb.layout() is not third
    fourth = rb.layout()
    store.delete_shard("c", clock.time())
    assert "c" not in rb.layout().columns.shard_ids
    assert rb.layout() is not fourth
    # A rolled-back change leaves a layout that matches the store.
    seen: list[bool] = []

    def abort() -> None:
        with store.transaction():
            store.upsert_shard(shard("d", ("10.1.98.1", 8000)), clock.time())
            seen.append("d" in rb.layout().columns.shard_ids)
            raise RuntimeError("abort")

    with pytest.raises(RuntimeError):
        abort()
    assert seen == [True]
    assert "d" not in rb.layout().columns.shard_ids
    # A write by another connection to the same database.
    other = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    other.upsert_shard(shard("e", ("10.1.97.1", 8000)), clock.time())
    other.close()
    assert "e" in rb.layout().columns.shard_ids


async def test_step_columns_match_the_object_observation(tmp_path: Path) -> None:
    rb, source, _, _ = _rebalancer(tmp_path)
    _fill(source, rb)
    del source.workers[rb.targets()[1].key]  # one worker says nothing: unknown
    await rb.step()
    workers = dict(rb.workers)
    cols, rows = rb.columns(workers)
    _assert_same(cols, ObservationColumns.from_observation(_object_observation(rb, workers)))
    assert [endpoint_key(w.address, w.port) for w in rows] == list(cols.endpoints)
    assert not cols.known[1]
    loads = rb.loads
    assert (loads["a"].workers, loads["a"].workers_known) == (2, 1)
    assert loads["b"].running == pytest.approx(
        sum(w.running for k, w in workers.items() if k.startswith("10.1.98."))
    )
