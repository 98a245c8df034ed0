"""The loop: fake-clock scenarios through the real store, a failing source, and run()."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from waiting import async_wait_until

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.metrics_source import Target
from adaptermesh.control_plane.policy import WorkerObservation, endpoint_key
from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
from adaptermesh.control_plane.store import Store

from .conftest import shard
from .plant import Plant


class PlantSource:
    """Feeds the loop what the closed-loop plant says for the weights last published."""

    def __init__(self, plant: Plant, rb: list[Rebalancer]) -> None:
        self.plant = plant
        self.rb = rb
        self.fail = 0

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("scrape failed")
        obs = self.plant.observe(self.rb[0].state.weights)
        out = {}
        for _sid, s in obs.shards.items():
            for w in s.workers:
                out[endpoint_key(w.address, w.port)] = w
        return {t.key: out[t.key] for t in targets if t.key in out}


def _setup(tmp_path: Path, plant: Plant) -> tuple[Rebalancer, PlantSource, FakeClock]:
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    holder: list[Rebalancer] = []
    source = PlantSource(plant, holder)
    clock = FakeClock()
    rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig(interval_s=5.0))
    holder.append(rb)
    for i, sid in enumerate(sorted(plant.capacity)):
        eps = [(f"10.0.{i}.{k + 1}", 8000) for k in range(plant.workers_per_shard)]
        spec = shard(sid, *eps)
        rb.mutate(lambda spec=spec: store.upsert_shard(spec, clock.time()), f"add {sid}")
    return rb, source, clock


async def test_spike_shifts_weight_within_two_ticks_and_comes_back(tmp_path: Path) -> None:
    plant = Plant({"a": 400, "b": 400, "c": 400, "d": 400}, steerable=800)
    rb, _, clock = _setup(tmp_path, plant)
    for _ in range(8):
        await rb.step()
        clock.step(5)
    steady = dict(rb.state.weights)
    assert max(steady.values()) - min(steady.values()) <= 200  # equal shards, equal weights
    version = rb.hub.latest.version
    plant.pinned["d"] = 350  # a tenant pinned to d starts hammering it
    shifted = False
    for _ in range(2):
        await rb.step()
        clock.step(5)
        if rb.state.weights["d"] < steady["d"] - 500:
            shifted = True
            break
    assert shifted, f"d still at {rb.state.weights['d']} (was {steady['d']})"
    assert rb.hub.latest.version > version
    assert "rebalance" in rb.hub.latest.reason
    for _ in range(10):
        await rb.step()
        clock.step(5)
    low = rb.state.weights["d"]
    assert plant.rho("d", rb.state.weights) < 1.0  # no longer overloaded
    plant.pinned["d"] = 0.0  # the spike ends
    for _ in range(6):
        await rb.step()
        clock.step(5)
    assert rb.state.weights["d"] > low + 500
    assert abs(rb.state.weights["d"] - steady["d"]) <= 400
    # Every published version is in the history with its reason, strictly increasing.
    hist = rb.store.history(1000)
    versions = [a.version for a in hist]  # newest first
    assert len(versions) >= 3  # the first Assignment, the shift away from d, the way back
    assert versions[0] == rb.hub.latest.version
    assert all(newer > older for newer, older in itertools.pairwise(versions)), versions
    assert all(a.reason for a in hist)
    rb.store.close()


async def test_no_publish_below_threshold(tmp_path: Path) -> None:
    plant = Plant({"a": 400, "b": 400}, steerable=400)
    rb, _, clock = _setup(tmp_path, plant)
    for _ in range(6):
        await rb.step()
        clock.step(5)
    v = rb.hub.latest.version
    for _ in range(5):
        d = await rb.step()
        clock.step(5)
        assert not d.publish
    assert rb.hub.latest.version == v
    rb.store.close()


async def test_failed_steps_back_off_and_the_loop_survives(tmp_path: Path) -> None:
    plant = Plant({"a": 400, "b": 400}, steerable=400)
    rb, source, _clock = _setup(tmp_path, plant)
    source.fail = 3
    stop = asyncio.Event()
    task = asyncio.create_task(rb.run(stop))
    for _ in range(200):
        await asyncio.sleep(0)
        if rb.steps >= 6:
            break
    stop.set()
    await asyncio.wait_for(task, 5)
    assert rb.failures == 3
    assert rb.steps >= 4
    assert "scrape failed" in rb.last_error
    rb.store.close()


async def test_run_smoke_with_the_system_clock(tmp_path: Path) -> None:
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")

    class Idle:
        async def collect(
            self, targets: Sequence[Target], now: float
        ) -> dict[str, WorkerObservation]:
            return {}

    rb = Rebalancer(store, Idle(), config=RebalancerConfig(interval_s=0.02))
    rb.mutate(lambda: store.upsert_shard(shard("a", ("10.0.0.1", 8000)), 0.0), "add a")
    stop = asyncio.Event()
    task = asyncio.create_task(rb.run(stop))
    await async_wait_until(lambda: rb.steps >= 3, 5, what="three steps")
    stop.set()
    await asyncio.wait_for(task, 2)
    assert rb.failures == 0
    assert rb.loads["a"].known is False  # no metrics: unknown, not idle
    store.close()


@pytest.mark.parametrize("bad", ["sum", "unknown"])
async def test_invalid_assignment_is_never_published(tmp_path: Path, bad: str) -> None:
    from adaptermesh.control_plane.rebalancer import PublishError

    plant = Plant({"a": 400, "b": 400}, steerable=400)
    rb, _, _ = _setup(tmp_path, plant)
    v = rb.hub.latest.version
    weights = {"a": 6000, "b": 6000} if bad == "sum" else {"a": 5000, "b": 4000, "zz": 1000}
    with pytest.raises(PublishError):
        with rb.store.transaction():
            rb._stage(weights, {}, "bad")
    assert rb.hub.latest.version == v
    assert rb.store.last_version() == v
    rb.store.close()


class DownSource:
    """Two workers, both resident-holding adapter ``a``; ``down`` marks one unreachable."""

    def __init__(self) -> None:
        self.down: set[str] = set()

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        return {
            t.key: WorkerObservation(
                address=t.address,
                port=t.port,
                known=True,
                running=1.0,
                latency_s=0.05,
                tokens_per_s=100.0,
                resident_adapters=frozenset({"a"}) if t.address.endswith(".1") else frozenset(),
                down=t.key in self.down,
            )
            for t in targets
        }


async def test_unreachable_worker_loses_adapter_affinity_at_once(tmp_path: Path) -> None:
    """A dead worker that alone holds an adapter must stop attracting that adapter's requests
    on the next tick (not after the staleness window), and regain affinity when it returns."""
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    source = DownSource()
    clock = FakeClock()
    rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig(interval_s=5.0))
    spec = shard("s", ("10.0.0.1", 8000), ("10.0.0.2", 8000))
    rb.mutate(lambda: store.upsert_shard(spec, clock.time()), "add s")
    for _ in range(3):
        await rb.step()
        clock.step(5)

    def adapters() -> dict[str, list[str]]:
        current = rb.hub.latest
        assert current is not None
        return {f"{e.address}": list(e.adapters) for e in current.shards[0].endpoints}

    assert adapters()["10.0.0.1"] == ["a"]
    before = store.last_version()
    source.down = {"10.0.0.1:8000"}
    await rb.step()
    assert store.last_version() == before + 1, "an unreachable worker must publish at once"
    assert adapters()["10.0.0.1"] == []
    assert "unreachable 10.0.0.1:8000" in rb.hub.latest.reason
    clock.step(5)
    await rb.step()
    assert store.last_version() == before + 1, "no republish while nothing changes"
    source.down = set()
    clock.step(5)
    await rb.step()
    assert adapters()["10.0.0.1"] == ["a"]
