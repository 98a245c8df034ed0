"""Automatic homes (``--auto-placement``): the placement loop gives every instance that names
no shards a home weighted by the slots the workers report, the rebalancer publishes it as the
edge's placement (every other shard's Envoy forwards there) and the loop preloads it there."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from adaptermesh import adapter_edge
from adaptermesh.clock import FakeClock
from adaptermesh.control_plane import cli
from adaptermesh.control_plane.preloader import HttpWorkerAdmin, Preloader
from adaptermesh.control_plane.rebalancer import Rebalancer
from adaptermesh.control_plane.store import Store
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

from .conftest import StaticSource, instance, shard


@dataclass
class SlotWorker:
    """A worker's /metrics (its slots and resident adapters) and its load endpoint."""

    slots: int
    resident: set[str] = field(default_factory=set)
    loads: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = [
            f'vllm:lora_requests_info{{running_lora_adapters="",waiting_lora_adapters="",'
            f'max_lora="{self.slots}"}} 1.0'
        ]
        lines += [
            f'adaptermesh_adapter_resident{{adapter="{a}",pinned="false"}} 1.0'
            for a in sorted(self.resident)
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.loads.append(body)
        self.resident.add(body["lora_name"])
        return web.Response(text="Success")


@pytest.fixture
async def fleet() -> AsyncIterator[list[SlotWorker]]:
    """Shards s0 (two workers of 4 slots), s1 (one of 4), s2 (one of 16)."""
    runners: list[web.AppRunner] = []
    workers = [SlotWorker(4), SlotWorker(4), SlotWorker(4), SlotWorker(16)]
    for w in workers:
        app = web.Application()
        app.router.add_get("/metrics", w.metrics)
        app.router.add_post("/v1/load_lora_adapter", w.load)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        w.port = runner.addresses[0][1]
    yield workers
    for r in runners:
        await r.cleanup()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    yield s
    s.close()


def _shards(store: Store, workers: list[SlotWorker], *, s2_state: int = 0) -> None:
    ep = [("127.0.0.1", w.port) for w in workers]
    store.upsert_shard(shard("s0", ep[0], ep[1]), 0.0)
    store.upsert_shard(shard("s1", ep[2]), 0.0)
    store.upsert_shard(shard("s2", ep[3], state=s2_state), 0.0)


def _edges(rb: Rebalancer) -> dict[str, list[str]]:
    latest = rb.hub.latest
    assert latest is not None
    return {e.name: list(e.shards) for e in latest.adapters}


async def test_homes_are_published_preloaded_once_and_move_only_off_a_draining_shard(
    fleet: list[SlotWorker], store: Store
) -> None:
    _shards(store, fleet)
    names = [f"a{i:02d}" for i in range(40)]
    for name in names:
        store.upsert_adapter_instance(instance(name, f"lib/{name}"), 0.0)
    store.upsert_adapter_instance(instance("fixed", "lib/fixed", shards=["s1"]), 0.0)
    clock = FakeClock()
    rb = Rebalancer(store, StaticSource(), clock=clock)
    admin = HttpWorkerAdmin(timeout_s=5.0)
    pre = Preloader(
        store,
        admin,
        clock=clock,
        logger=logging.getLogger("test.auto"),
        auto_placement=True,
        on_homes=rb.set_homes,
    )
    try:
        report = await pre.step()
        assert not report.failed
        assert not report.unreachable
        # Every instance naming no shards has one home, weighted 8:4:16 (s0: 4+4, s1: 4, s2: 16).
        assert set(pre.homes) == set(names)
        counts = {s: sum(1 for h in pre.homes.values() if h == s) for s in ("s0", "s1", "s2")}
        assert counts["s1"] < counts["s0"] < counts["s2"], counts
        # Published as the edges' placement; the explicit instance keeps its own.
        edges = _edges(rb)
        assert edges["fixed"] == ["s1"]
        assert {n: edges[n] for n in names} == {n: [pre.homes[n]] for n in names}
        assert rb.hub.latest is not None
        assert rb.hub.latest.reason.startswith("adapter homes: ")
        # Preloaded on one worker of its home, paths as the instance says.
        by_shard = {"s0": fleet[:2], "s1": fleet[2:3], "s2": fleet[3:]}
        loaded = report.done + (await _drain(pre))
        for name in names:
            holders = [w for w in by_shard[pre.homes[name]] if name in w.resident]
            assert len(holders) == 1, name
            assert all(
                w not in holders for s, ws in by_shard.items() if s != pre.homes[name] for w in ws
            )
        assert len(loaded) == len(names)
        assert all(a.path == f"lib/{a.adapter}" and not a.pinned for a in loaded)
        # Stable: later rounds move nothing and publish nothing.
        publishes = rb.publishes
        clock.step(120)
        assert (await pre.step()).done == ()
        assert rb.publishes == publishes
        # Draining s2 moves only s2's adapters.
        before = dict(pre.homes)
        _shards(store, fleet, s2_state=assignment_pb2.SHARD_STATE_DRAINING)
        await pre.step()
        assert "s2" not in pre.homes.values()
        assert all(pre.homes[n] == before[n] for n in names if before[n] != "s2")
        assert {n: _edges(rb)[n] for n in names} == {n: [pre.homes[n]] for n in names}
    finally:
        await admin.aclose()


async def _drain(pre: Preloader) -> tuple[Any, ...]:
    """Rounds until nothing more is sent (16 loads go out per round)."""
    done: tuple[Any, ...] = ()
    for _ in range(10):
        report = await pre.step()
        if not report.done:
            break
        done += report.done
    return done


async def test_off_by_default_nothing_gets_a_home(fleet: list[SlotWorker], store: Store) -> None:
    _shards(store, fleet)
    store.upsert_adapter_instance(instance("a0", "lib/a0"), 0.0)
    clock = FakeClock()
    admin = HttpWorkerAdmin(timeout_s=5.0)
    pre = Preloader(store, admin, clock=clock)
    try:
        assert (await pre.step()).done == ()
        assert pre.homes == {}
        assert all(not w.loads for w in fleet)
    finally:
        await admin.aclose()
    assert cli.build_parser().parse_args(["--state-dir", "x", "--no-auth"]).auto_placement is False
    assert (
        cli.build_parser()
        .parse_args(["--state-dir", "x", "--no-auth", "--auto-placement"])
        .auto_placement
        is True
    )


def test_a_restarted_control_plane_resumes_the_published_homes(store: Store) -> None:
    store.upsert_shard(shard("s0", ("127.0.0.1", 1)), 0.0)
    store.upsert_shard(shard("s1", ("127.0.0.1", 2)), 0.0)
    for name in ("a", "b"):
        store.upsert_adapter_instance(instance(name, f"lib/{name}"), 0.0)
    rb = Rebalancer(store, StaticSource(), clock=FakeClock())
    rb.set_homes({"a": "s1", "b": "s0"})
    again = Rebalancer(store, StaticSource(), clock=FakeClock())
    assert again.homes == {}
    again.resume_homes()
    assert again.homes == {"a": "s1", "b": "s0"}
    assert again._edges() == rb._edges()


def test_homes_past_the_edge_limit_are_left_out_not_refused(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_edge, "MAX_EDGES", 3)
    store.upsert_shard(shard("s0", ("127.0.0.1", 1)), 0.0)
    store.upsert_shard(shard("s1", ("127.0.0.1", 2)), 0.0)
    store.upsert_adapter_instance(instance("fixed", "lib/fixed", shards=["s0"]), 0.0)
    names = [f"a{i}" for i in range(6)]
    for name in names:
        store.upsert_adapter_instance(instance(name, f"lib/{name}"), 0.0)
    rb = Rebalancer(store, StaticSource(), clock=FakeClock())
    rb.set_homes(dict.fromkeys(names, "s1"))
    assert _edges(rb) == {"fixed": ["s0"], "a0": ["s1"], "a1": ["s1"]}
