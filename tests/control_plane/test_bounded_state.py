"""Per-worker state of the load sources and the placement loop is kept for listed workers only:
endpoints come and go (scale events, re-addressed pods), and nothing of a worker that left may
stay behind, or count against the live ones."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.metrics_source import PrometheusSource, ScrapeSource, Target
from adaptermesh.control_plane.preloader import Preloader
from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
from adaptermesh.control_plane.rollout import ScrapeAdapterSource
from adaptermesh.control_plane.store import Store

from .conftest import shard

# Sets of listed workers, one per round: ports of 127.0.0.1 from a small pool.
ROUNDS = st.lists(st.frozensets(st.integers(9000, 9011), max_size=6), min_size=1, max_size=12)


def _targets(ports: frozenset[int]) -> list[Target]:
    return [Target("s0", "127.0.0.1", p) for p in sorted(ports)]


def _refusing_client() -> httpx.AsyncClient:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    return httpx.AsyncClient(transport=httpx.MockTransport(refuse))


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS)
def test_scrape_source_keeps_errors_and_history_of_listed_workers_only(
    rounds: list[frozenset[int]],
) -> None:
    async def run() -> None:
        async with _refusing_client() as client:
            src = ScrapeSource(interval_s=1.0, timeout_s=0.5, client=client)
            for now, ports in enumerate(rounds):
                targets = _targets(ports)
                await src.collect(targets, float(now))
                listed = {t.key for t in targets}
                assert set(src.errors) == listed  # every listed one failed; no others
                assert set(src._history) <= listed

    asyncio.run(run())


async def test_a_removed_failing_worker_stops_counting_as_a_scrape_error(tmp_path: Path) -> None:
    """The rebalancer adds the source's failing workers to worker_scrape_errors on every step:
    a worker that failed and was then removed from its shard no longer counts."""
    async with _refusing_client() as client:
        store = Store(tmp_path / "cp.sqlite3", synchronous="OFF")
        clock = FakeClock()
        source = ScrapeSource(interval_s=5.0, timeout_s=0.5, client=client)
        rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig(interval_s=5.0))
        two = shard("s0", ("127.0.0.1", 9000), ("127.0.0.1", 9001))
        rb.mutate(lambda: store.upsert_shard(two, clock.time()), "add s0")
        await rb.step()
        assert rb.metrics.scrape_errors == 2
        one = shard("s0", ("127.0.0.1", 9000))
        rb.mutate(lambda: store.upsert_shard(one, clock.time()), "shrink s0")
        for _ in range(3):
            clock.step(5)
            await rb.step()
        assert rb.metrics.scrape_errors == 2 + 3  # the listed worker only
        store.close()


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS, answering=st.frozensets(st.integers(9000, 9011)))
def test_prometheus_source_keeps_readings_of_listed_workers_only(
    rounds: list[frozenset[int]], answering: frozenset[int]
) -> None:
    """Prometheus answers for the ``answering`` workers; the source's last readings (kept
    for staleness) hold the listed workers only."""

    def api(request: httpx.Request) -> httpx.Response:
        query = request.url.params.get("query", "")
        result = (
            [
                {"metric": {"instance": f"127.0.0.1:{p}"}, "value": [0, "1"]}
                for p in sorted(answering)
            ]
            if query.startswith("sum by (instance) (vllm:num_requests_waiting)")
            else []
        )
        return httpx.Response(200, json={"status": "success", "data": {"result": result}})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(api)) as client:
            src = PrometheusSource("http://prometheus:9090", interval_s=1.0, client=client)
            for now, ports in enumerate(rounds):
                targets = _targets(ports)
                out = await src.collect(targets, float(now))
                listed = {t.key for t in targets}
                assert set(out) == listed
                assert set(src._last) <= listed
                assert {k for k in listed if int(k.rsplit(":", 1)[1]) in answering} <= set(
                    src._last
                )

    asyncio.run(run())


async def test_rollout_source_keeps_errors_of_listed_workers_only() -> None:
    """Ports 1-3 of 127.0.0.1 refuse at once: each round's failures are its own workers'."""
    src = ScrapeAdapterSource(timeout_s=1.0)
    for ports in ({1, 2}, {2, 3}, {3}, set()):
        targets = [Target("s0", "127.0.0.1", p) for p in sorted(ports)]
        assert await src.collect(targets, ["a@2"]) == {}
        assert set(src.errors) == {t.key for t in targets}


class _SlotsAdmin:
    """A worker admin that remembers every worker's slots, as HttpWorkerAdmin does."""

    def __init__(self) -> None:
        self.slots_seen: dict[str, float] = {}

    async def residency(self, address: str, port: int) -> tuple[frozenset[str], frozenset[str]]:
        self.slots_seen[f"{address}:{port}"] = 4.0
        return frozenset(), frozenset()

    async def load(self, address: str, port: int, adapter: str, path: str, pinned: bool) -> None:
        return None


@settings(max_examples=25, deadline=None)
@given(rounds=ROUNDS)
def test_placement_forgets_slots_of_workers_no_longer_listed(
    rounds: list[frozenset[int]],
) -> None:
    async def run(tmp: Path) -> None:
        store = Store(tmp / "cp.sqlite3", synchronous="OFF")
        clock = FakeClock()
        admin = _SlotsAdmin()
        loop = Preloader(
            store, admin, clock=clock, auto_placement=True, logger=logging.getLogger("test")
        )
        for ports in rounds:
            if ports:
                spec = shard("s0", *[("127.0.0.1", p) for p in sorted(ports)])
                store.upsert_shard(spec, clock.time())
            else:
                store.delete_shard("s0", clock.time())
            await loop.step()
            listed = {f"127.0.0.1:{p}" for p in ports}
            assert set(admin.slots_seen) == listed
            assert set(loop.slots) <= listed
        store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(Path(tmp)))
