"""The placement loop against workers over HTTP: fake workers (aiohttp on port 0) for its
rules, and real CPU workers (tiny model, PEFT adapters) for the pin that keeps an adapter in
its slot while other adapters come and go."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from waiting import async_wait_until

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane import cli
from adaptermesh.control_plane.preloader import HttpWorkerAdmin, Preloader, PreloaderConfig
from adaptermesh.control_plane.store import Store
from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import instance, shard

TOKEN = "worker-admin-secret"


@dataclass
class FakeWorker:
    """A worker's /metrics and /v1/load_lora_adapter, with the admin token check."""

    resident: dict[str, bool] = field(default_factory=dict)  # adapter -> pinned
    loads: list[dict[str, Any]] = field(default_factory=list)
    refuse: tuple[int, str, str] | None = None  # status, param, message
    port: int = 0

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = ["# TYPE adaptermesh_adapter_resident gauge"]
        lines += [
            f'adaptermesh_adapter_resident{{adapter="{a}",pinned="{str(p).lower()}"}} 1.0'
            for a, p in sorted(self.resident.items())
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def load(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"message": "the admin token is wrong"}}, status=403)
        body = await request.json()
        self.loads.append(body)
        if self.refuse is not None:
            status, param, message = self.refuse
            return web.json_response({"error": {"message": message, "param": param}}, status=status)
        self.resident[body["lora_name"]] = body["pinned"]
        return web.Response(text="Success")


Start = Callable[..., Awaitable[FakeWorker]]


@pytest.fixture
async def start_worker() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(**kw: Any) -> FakeWorker:
        w = FakeWorker(**kw)
        app = web.Application()
        app.router.add_get("/metrics", w.metrics)
        app.router.add_post("/v1/load_lora_adapter", w.load)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        w.port = runner.addresses[0][1]
        return w

    yield start
    for r in runners:
        await r.cleanup()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    yield s
    s.close()


@pytest.fixture
async def admin() -> AsyncIterator[HttpWorkerAdmin]:
    a = HttpWorkerAdmin(TOKEN, timeout_s=5.0)
    yield a
    await a.aclose()


def loop(store: Store, admin: HttpWorkerAdmin, clock: FakeClock, **cfg: Any) -> Preloader:
    return Preloader(
        store,
        admin,
        clock=clock,
        config=PreloaderConfig(**cfg),
        logger=logging.getLogger("test.placement"),
    )


async def test_preload_pin_and_replicas_reach_the_workers_once(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    a1, a2, b1 = await start_worker(), await start_worker(), await start_worker()
    store.upsert_shard(shard("shard-a", ("127.0.0.1", a1.port), ("127.0.0.1", a2.port)), 0.0)
    store.upsert_shard(shard("shard-b", ("127.0.0.1", b1.port)), 0.0)
    store.upsert_adapter_instance(
        instance(
            "credit-risk-v2",
            "risk/credit-risk-v2",
            shards=["shard-a", "shard-b"],
            pinned_shards=["shard-b"],
            replicas=2,
            preload=True,
        ),
        0.0,
    )
    clock = FakeClock()
    pre = loop(store, admin, clock)
    report = await pre.step()
    assert not report.failed
    assert not report.unreachable
    # Both workers of shard-a preloaded (unpinned); shard-b's one worker pinned, short of two.
    assert a1.resident == a2.resident == {"credit-risk-v2": False}
    assert b1.resident == {"credit-risk-v2": True}
    assert b1.loads == [
        {"lora_name": "credit-risk-v2", "lora_path": "risk/credit-risk-v2", "pinned": True}
    ]
    assert report.short == (("credit-risk-v2", "shard-b", 1, 2),)
    assert "short credit-risk-v2/shard-b" in pre.problems()
    # Idempotent: the workers hold what is wanted, so later rounds send nothing.
    for _ in range(3):
        clock.step(120)
        assert (await pre.step()).done == ()
    assert len(a1.loads) + len(a2.loads) + len(b1.loads) == 3


async def test_an_evicted_preload_comes_back_and_a_lost_pin_at_once(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    w = await start_worker()
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("warm", preload=True), 0.0)
    store.upsert_adapter_instance(instance("kept", pinned_shards=["s0"]), 0.0)
    clock = FakeClock()
    pre = loop(store, admin, clock, reload_interval_s=60.0)
    await pre.step()
    assert w.resident == {"warm": False, "kept": True}
    w.resident.clear()  # the worker restarted (or evicted the preload)
    await pre.step()
    assert w.resident == {"kept": True}  # the preload waits out its reload interval
    clock.step(61)
    await pre.step()
    assert w.resident == {"warm": False, "kept": True}
    assert [x["lora_path"] for x in w.loads] == ["kept", "warm", "kept", "warm"]


async def test_pins_are_undone_when_the_instance_stops_asking_or_goes(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    w = await start_worker(resident={"boot": True})  # a worker's own start-up pin
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("a", pinned_shards=["s0"]), 0.0)
    store.upsert_adapter_instance(instance("b", pinned_shards=["s0"]), 0.0)
    pre = loop(store, admin, FakeClock())
    await pre.step()
    assert w.resident == {"boot": True, "a": True, "b": True}
    store.upsert_adapter_instance(instance("a", preload=True), 1.0)  # a: no longer pinned
    store.delete_adapter_instance("b")  # b: gone
    report = await pre.step()
    assert {(x.adapter, x.why) for x in report.done} == {("a", "unpin"), ("b", "unpin")}
    assert w.resident == {"boot": True, "a": False, "b": False}
    assert (await pre.step()).done == ()


async def test_a_refused_load_is_named_backed_off_and_loses_nothing(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin, caplog: pytest.LogCaptureFixture
) -> None:
    w = await start_worker(refuse=(400, "lora_path", "resolves outside the adapter root"))
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("a", "/elsewhere/a", pinned_shards=["s0"]), 0.0)
    clock = FakeClock()
    pre = loop(store, admin, clock, retry_initial_s=5.0, retry_max_s=20.0)
    with caplog.at_level(logging.WARNING, "test.placement"):
        report = await pre.step()
    ((action, error),) = report.failed
    assert action.adapter == "a"
    assert "HTTP 400: lora_path: resolves outside" in error
    (problem,) = pre.problems().values()
    assert f"127.0.0.1:{w.port}" in problem
    assert "shard s0" in problem
    assert "'a'" in problem
    assert "resolves outside the adapter root" in caplog.text
    # Backoff: 5 s, then 10 s, then 20 s (capped) between tries.
    tries = []
    for t in range(60):
        clock.step(1)
        before = len(w.loads)
        await pre.step()
        if len(w.loads) > before:
            tries.append(t + 1)
    assert tries == [5, 15, 35, 55]
    w.refuse = None
    clock.step(20)
    await pre.step()
    assert w.resident == {"a": True}
    assert pre.problems() == {}


async def test_bounded_per_round_and_unreachable_workers_reported(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    w = await start_worker()
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port), ("127.0.0.1", 9)), 0.0)
    for i in range(7):
        store.upsert_adapter_instance(instance(f"a{i}", preload=True, replicas=2), 0.0)
    pre = loop(store, admin, FakeClock(), max_actions=3, concurrency=2)
    sizes = []
    for _ in range(4):
        report = await pre.step()
        sizes.append(len(report.done))
        assert report.unreachable
        assert "127.0.0.1:9" in report.unreachable[0][0]
    assert sizes == [3, 3, 1, 0]
    assert len(w.resident) == 7
    assert "unreachable 127.0.0.1:9" in pre.problems()


async def test_the_token_is_checked_by_the_worker(start_worker: Start, store: Store) -> None:
    w = await start_worker()
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("a", preload=True), 0.0)
    async with httpx.AsyncClient(trust_env=False) as client:
        pre = loop(store, HttpWorkerAdmin(None, client=client), FakeClock())
        ((_, error),) = (await pre.step()).failed
    assert "HTTP 403" in error
    assert "admin token" in error
    assert w.resident == {}


async def test_run_repeats_step_until_stopped(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    w = await start_worker()
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("a", pinned_shards=["s0"]), 0.0)
    pre = loop(store, admin, FakeClock(), interval_s=1.0)
    stop = asyncio.Event()
    task = asyncio.create_task(pre.run(stop))
    await async_wait_until(lambda: pre.steps >= 3, timeout=10)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert w.resident == {"a": True}
    assert len(w.loads) == 1


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="max_actions"):
        PreloaderConfig(max_actions=0).validate()
    with pytest.raises(ValueError, match="retry_initial_s"):
        PreloaderConfig(retry_initial_s=10, retry_max_s=5).validate()


async def _models(client: httpx.AsyncClient, port: int) -> dict[str, tuple[bool, bool]]:
    """adapter -> (resident, pinned), from a real worker's /v1/models."""
    body = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()
    return {m["id"]: (m["resident"], m["pinned"]) for m in body["data"] if m["parent"]}


async def test_real_workers_keep_the_pinned_adapter_while_others_evict(
    tmp_path: Path, store: Store, admin: HttpWorkerAdmin
) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    root = tmp_path / "adapters"
    root.mkdir()
    for i, name in enumerate(("kept", "warm", "x1", "x2")):
        make_adapter(root, model, name, rank=4, seed=i)
    engines, runners, ports = [], [], []
    for _ in range(2):  # two workers of one shard, two GPU slots each
        engine = Engine(
            model,
            root,
            device="cpu",
            dtype="float32",
            model_name="tiny",
            # A pool of the adapters' own modules: two of them fill it (an arena over every
            # module would hold more of these q,v adapters than two).
            config=EngineConfig(
                max_loras=2, max_num_seqs=2, lora_target_modules=("q_proj", "v_proj")
            ),
        )
        runner, port = await serve(
            WorkerService(engine, ServiceConfig(admin_token=TOKEN)), "127.0.0.1", 0
        )
        engines.append(engine)
        runners.append(runner)
        ports.append(port)
    client = httpx.AsyncClient(trust_env=False, timeout=60)
    try:
        store.upsert_shard(shard("s0", *(("127.0.0.1", p) for p in ports)), 0.0)
        store.upsert_adapter_instance(instance("kept", "kept", pinned_shards=["s0"]), 0.0)
        store.upsert_adapter_instance(instance("warm", "warm", preload=True, replicas=2), 0.0)
        clock = FakeClock()
        pre = loop(store, admin, clock, reload_interval_s=30.0)
        report = await pre.step()
        assert not report.failed, report.failed
        models = [await _models(client, p) for p in ports]
        assert sum(m.get("kept") == (True, True) for m in models) == 1  # replicas 0: one
        assert all(m.get("warm") == (True, False) for m in models)
        pinned_port = ports[0] if models[0].get("kept") else ports[1]
        # Traffic for two other adapters through the pinned worker's two slots: the preload
        # is evicted, the pinned adapter stays.
        for name in ("x1", "x2", "x1", "x2"):
            resp = await client.post(
                f"http://127.0.0.1:{pinned_port}/v1/completions",
                json={"model": name, "prompt": "hi", "max_tokens": 2, "temperature": 0},
            )
            assert resp.status_code == 200, resp.text
        after = await _models(client, pinned_port)
        assert after["kept"] == (True, True)
        assert after["warm"][0] is False
        assert (await pre.step()).done == ()  # inside the reload interval
        clock.step(31)
        again = await pre.step()
        assert [(a.adapter, a.port, a.why) for a in again.done] == [
            ("warm", pinned_port, "preload")
        ]
        assert (await _models(client, pinned_port))["kept"] == (True, True)
    finally:
        await client.aclose()
        for runner in runners:
            await runner.cleanup()
        for engine in engines:
            await engine.shutdown()


@pytest.mark.parametrize(("content", "says"), [(None, "No such file"), ("  \n", "is empty")])
def test_the_worker_token_file_is_checked_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, says: str
) -> None:
    path = tmp_path / "worker-token"
    if content is not None:
        path.write_text(content)
    code = cli.main(
        [
            "--state-dir",
            str(tmp_path / "state"),
            "--no-auth",
            "--worker-admin-token-file",
            str(path),
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "--worker-admin-token-file" in err
    assert says in err


async def test_a_deleted_instance_takes_its_problems_and_retries_with_it(
    start_worker: Start, store: Store, admin: HttpWorkerAdmin
) -> None:
    w = await start_worker(refuse=(503, "", "every GPU slot is pinned or in use"))
    store.upsert_shard(shard("s0", ("127.0.0.1", w.port)), 0.0)
    store.upsert_adapter_instance(instance("a", pinned_shards=["s0"]), 0.0)
    pre = loop(store, admin, FakeClock())
    assert (await pre.step()).failed
    assert "every GPU slot is pinned" in next(iter(pre.problems().values()))
    store.delete_adapter_instance("a")
    await pre.step()
    assert pre.problems() == {}
    assert pre._backoff == {}
    assert pre._not_before == {}
