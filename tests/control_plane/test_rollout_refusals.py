"""Rollouts that cannot serve are refused before anything is stored: a target version no
worker of the adapter's shards can find, and a listing of an adapter nobody knows.

The workers are small HTTP servers answering ``GET /v1/models/{name}`` as a real worker does
(``tests/worker_service/test_engine_integration.py`` holds the worker to it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.control_plane.loadable import refusing_shards
from adaptermesh.proto import control_plane_pb2

from .conftest import Harness, shard

S = control_plane_pb2


class Worker:
    """Answers 200 for the names in ``finds``, 404 model_not_found for any other."""

    def __init__(self, finds: set[str]) -> None:
        self.finds = finds
        self.asked: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.asked.append(name)
        if name in self.finds:
            return web.json_response({"id": name, "object": "model", "location": "root"})
        return web.json_response(
            {
                "error": {
                    "message": f"model: {name!r} is not served here",
                    "code": "model_not_found",
                }
            },
            status=404,
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models/{name}", self._model)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def workers() -> AsyncIterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(*finds: str) -> Worker:
        w = Worker(set(finds))
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


def spec(to: str) -> S.RolloutSpec:
    return S.RolloutSpec(
        adapter="support", to_version=to, steps_percent=[50, 100], interval_seconds=60
    )


async def _mesh(cp: Harness, *shard_workers: Worker, routes: tuple[str, ...] = ()) -> None:
    for w in shard_workers:
        await w.start()
    for i, w in enumerate(shard_workers):
        s = shard(f"s{i}", ("127.0.0.1", w.port))
        await cp.stub.UpsertShard(S.UpsertShardRequest(shard=s), metadata=cp.md)
    inst = S.AdapterInstance(name="support", model_ref=S.ModelRef(base_model="tiny"))
    for sid in routes:
        inst.routes.add(shard_id=sid)
    await cp.stub.UpsertAdapterInstance(
        S.UpsertAdapterInstanceRequest(instance=inst), metadata=cp.md
    )


async def _state(cp: Harness) -> tuple[bytes, int]:
    latest = await cp.stub.GetAssignment(S.GetAssignmentRequest(), metadata=cp.md)
    listed = await cp.stub.ListRollouts(S.ListRolloutsRequest(history=True), metadata=cp.md)
    return latest.SerializeToString(), len(listed.rollouts)


async def test_a_version_no_worker_finds_is_refused_and_nothing_changes(cp: Harness, workers):
    await _mesh(cp, workers("support@2.0.0"), workers())
    before = await _state(cp)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.StartRollout(S.StartRolloutRequest(spec=spec("9.9.9")), metadata=cp.md)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.value.details() or "").startswith(
        "spec.to_version: 'support@9.9.9' cannot be served on shard s0, s1: "
    )
    assert await _state(cp) == before  # the Assignment (routes, splits) and the rollouts


async def test_a_version_one_reached_shard_lacks_is_refused_naming_that_shard(cp, workers):
    await _mesh(cp, workers("support@2.0.0"), workers("support"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.StartRollout(S.StartRolloutRequest(spec=spec("2.0.0")), metadata=cp.md)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot be served on shard s1:" in (info.value.details() or "")


async def test_only_the_shards_the_routes_reach_are_asked(cp: Harness, workers) -> None:
    lacking = workers()
    await _mesh(cp, workers("support@2.0.0"), lacking, routes=("s0",))
    r = await cp.stub.StartRollout(S.StartRolloutRequest(spec=spec("2.0.0")), metadata=cp.md)
    assert r.state == S.ROLLOUT_STATE_RUNNING
    assert lacking.asked == []


async def test_a_worker_that_cannot_tell_does_not_block_the_rollout(cp: Harness, workers):
    gone = workers()
    await _mesh(cp, workers("support@2.0.0"), gone)
    await gone.stop()  # s1's worker does not answer at all
    r = await cp.stub.StartRollout(S.StartRolloutRequest(spec=spec("2.0.0")), metadata=cp.md)
    assert r.state == S.ROLLOUT_STATE_RUNNING


@pytest.mark.parametrize("history", [False, True])
async def test_listing_an_unknown_adapter_is_not_found(cp: Harness, workers, history):
    await _mesh(cp, workers())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.ListRollouts(
            S.ListRolloutsRequest(adapter="nosuch", history=history), metadata=cp.md
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nosuch'" in (info.value.details() or "")
    # A known adapter without a rollout yet is an empty listing, not an error.
    listed = await cp.stub.ListRollouts(
        S.ListRolloutsRequest(adapter="support", history=history), metadata=cp.md
    )
    assert list(listed.rollouts) == []


finds = st.sampled_from([True, False, None])


@given(st.dictionaries(st.sampled_from(["s0", "s1", "s2", "s3"]), st.lists(finds, max_size=4)))
def test_a_shard_refuses_when_someone_answered_and_nobody_finds_it(answers) -> None:
    refusing = refusing_shards(answers)
    assert refusing == sorted(refusing)
    for sid, got in answers.items():
        assert (sid in refusing) == (False in got and True not in got)
