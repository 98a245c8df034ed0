"""Gray release per adapter version: the controller on a fake clock, through the real store and
rebalancer, fed per-adapter worker counters by a fake source; the API and adapterctl's parsers."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.assignment_rules import RuleError, check_assignment
from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.metrics_source import Target
from adaptermesh.control_plane.policy import WorkerObservation
from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
from adaptermesh.control_plane.rollout import (
    AdapterCounters,
    RolloutController,
    RolloutError,
    parse_adapter_series,
)
from adaptermesh.control_plane.rollout_state import Window, check_spec, decide, p95
from adaptermesh.control_plane.store import Store
from adaptermesh.proto import control_plane_pb2

from .conftest import Harness, shard

S = control_plane_pb2
NEW = "credit-risk@2.0.0"


class Idle:
    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        return {}


class CounterSource:
    """Per worker, per served adapter: cumulative counters the test moves."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[str, AdapterCounters]] = {}
        self.calls = 0

    def serve(
        self, worker: str, adapter: str, requests: int, errors: int = 0, ttft_s: float = 0.05
    ) -> None:
        c = self.counters.setdefault(worker, {}).setdefault(adapter, AdapterCounters())
        c.requests += requests
        c.errors += errors
        ok = requests - errors
        for le in (0.1, 0.5, 1.0, 5.0):
            if ttft_s <= le:
                c.ttft[le] = c.ttft.get(le, 0) + ok
            else:
                c.ttft.setdefault(le, 0)
        c.ttft_count += ok

    async def collect(
        self, targets: list[Target], adapters: Iterable[str]
    ) -> dict[str, dict[str, AdapterCounters]]:
        self.calls += 1
        names = set(adapters)
        return {
            k: {
                a: AdapterCounters(c.requests, c.errors, dict(c.ttft), c.ttft_count)
                for a, c in per.items()
                if a in names
            }
            for k, per in self.counters.items()
        }


def spec(**kw: object) -> control_plane_pb2.RolloutSpec:
    base: dict[str, object] = dict(
        adapter="credit-risk",
        from_version="1.2.0",
        to_version="2.0.0",
        steps_percent=[5, 25, 50, 100],
        interval_seconds=120,
        max_error_rate=0.01,
        max_p95_ttft_ms=800,
        min_requests=20,
    )
    base.update(kw)
    return control_plane_pb2.RolloutSpec(**base)  # type: ignore[arg-type]


def setup(tmp_path: Path) -> tuple[RolloutController, CounterSource, FakeClock, Rebalancer]:
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    clock = FakeClock()
    rb = Rebalancer(store, Idle(), clock=clock, config=RebalancerConfig(interval_s=5.0))
    spec_ = shard("s0", ("10.0.0.1", 8000), ("10.0.0.2", 8000))
    rb.mutate(lambda: store.upsert_shard(spec_, clock.time()), "add s0")
    source = CounterSource()
    return RolloutController(rb, source, tick_s=1.0), source, clock, rb


def split(rb: Rebalancer) -> tuple[str, str, int] | None:
    latest = rb.hub.latest
    assert latest is not None
    check_assignment(latest)
    if not latest.adapter_splits:
        return None
    (s,) = latest.adapter_splits
    return s.stable_version, s.canary_version, s.canary_share


async def test_a_healthy_rollout_promotes_step_by_step_and_survives_a_restart(tmp_path: Path):
    ctl, source, clock, rb = setup(tmp_path)
    r = ctl.start(spec(), "release 2")
    assert split(rb) == ("1.2.0", "2.0.0", 500)  # published at once, with the write
    shares = [500]
    for _ in range(40):
        source.serve("10.0.0.1:8000", NEW, 15)
        source.serve("10.0.0.2:8000", NEW, 15)
        clock.step(30)
        await ctl.step()
        s = split(rb)
        assert s is not None
        if s[2] != shares[-1]:
            shares.append(s[2])
        if s[1] == "":
            break
    assert shares == [500, 2500, 5000, 10000, 0]
    assert split(rb) == ("2.0.0", "", 0)  # the new version is the stable one now
    (done,) = ctl.listing("credit-risk")
    assert done.state == S.ROLLOUT_STATE_COMPLETED
    assert done.id == r.id
    assert [e.kind for e in done.events] == ["start", "advance", "advance", "advance", "complete"]
    assert "promoted" in done.reason
    # Durable: a new control plane on the same file publishes the same split.
    rb.store.close()
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    rb2 = Rebalancer(store, Idle(), clock=clock)
    assert split(rb2) == ("2.0.0", "", 0)
    # The next rollout starts from the stable version by default.
    ctl2 = RolloutController(rb2, source)
    nxt = ctl2.start(spec(from_version="", to_version="2.1.0"), "")
    assert nxt.spec.from_version == "2.0.0"
    assert split(rb2) == ("2.0.0", "2.1.0", 500)


async def test_no_step_without_evidence(tmp_path: Path):
    ctl, source, clock, rb = setup(tmp_path)
    ctl.start(spec(min_requests=50), "")
    clock.step(600)
    source.serve("10.0.0.1:8000", NEW, 49)
    await ctl.step()  # baseline
    source.serve("10.0.0.1:8000", NEW, 49)
    ((_, step),) = await ctl.step()
    assert step.kind == "hold"
    assert "waiting for 50 requests" in step.reason
    assert split(rb) == ("1.2.0", "2.0.0", 500)


@pytest.mark.parametrize(
    ("errors", "ttft", "why"),
    [
        (3, 0.05, "error rate 10.0% > 1.0%"),
        (0, 2.0, "p95 TTFT"),
    ],
)
async def test_a_broken_bound_rolls_back_with_the_reason(
    tmp_path: Path, errors: int, ttft: float, why: str
):
    ctl, source, clock, rb = setup(tmp_path)
    ctl.start(spec(), "")
    await ctl.step()  # the window's baseline
    source.serve("10.0.0.1:8000", NEW, 30, errors=errors, ttft_s=ttft)
    clock.step(1)  # long before the interval: a bound acts at once
    ((_, step),) = await ctl.step()
    assert step.kind == "rollback"
    assert why in step.reason
    assert split(rb) == ("1.2.0", "", 0)
    (r,) = ctl.listing("credit-risk")
    assert r.state == S.ROLLOUT_STATE_ROLLED_BACK
    assert why in r.reason
    assert r.events[-1].kind == "rollback"
    assert why in r.events[-1].reason
    latest = rb.hub.latest
    assert latest is not None
    assert "rollback" in latest.reason


async def test_errors_before_the_step_do_not_count_and_a_worker_restart_counts_from_zero(
    tmp_path: Path,
):
    ctl, source, clock, _rb = setup(tmp_path)
    source.serve("10.0.0.1:8000", NEW, 100, errors=100)  # before the rollout began
    ctl.start(spec(), "")
    await ctl.step()
    source.counters["10.0.0.1:8000"][NEW] = AdapterCounters()  # the worker restarted
    source.serve("10.0.0.1:8000", NEW, 40)
    clock.step(121)
    ((_, step),) = await ctl.step()
    assert step.kind == "advance", step.reason


async def test_pause_resume_abort(tmp_path: Path):
    ctl, source, clock, rb = setup(tmp_path)
    ctl.start(spec(), "")
    paused = ctl.control("credit-risk", "pause", "looking at dashboards")
    assert paused.state == S.ROLLOUT_STATE_PAUSED
    source.serve("10.0.0.1:8000", NEW, 100)
    clock.step(1000)
    assert await ctl.step() == []  # a paused rollout does not move
    assert split(rb) == ("1.2.0", "2.0.0", 500)
    ctl.control("credit-risk", "resume", "")
    await ctl.step()
    source.serve("10.0.0.1:8000", NEW, 100)
    clock.step(60)
    ((_, step),) = await ctl.step()
    assert step.kind == "hold"  # the step's clock restarted at resume
    aborted = ctl.control("credit-risk", "abort", "wrong build")
    assert aborted.state == S.ROLLOUT_STATE_ABORTED
    assert aborted.share == 0
    assert split(rb) == ("1.2.0", "", 0)
    kinds = [e.kind for e in ctl.listing("credit-risk")[0].events]
    assert kinds == ["start", "pause", "resume", "abort"]
    with pytest.raises(RolloutError, match="no rollout in progress"):
        ctl.control("credit-risk", "resume", "")


async def test_promote_completes_at_once_from_any_step_running_or_paused(tmp_path: Path):
    ctl, source, clock, rb = setup(tmp_path)
    ctl.start(spec(), "")
    for _ in range(20):
        source.serve("10.0.0.1:8000", NEW, 30)
        clock.step(30)
        await ctl.step()
        if split(rb) != ("1.2.0", "2.0.0", 500):
            break
    assert split(rb) == ("1.2.0", "2.0.0", 2500)  # the second of four steps
    ctl.control("credit-risk", "pause", "")
    version = rb.store.last_version()
    done = ctl.control("credit-risk", "promote", "dashboards look fine")
    assert done.state == S.ROLLOUT_STATE_COMPLETED
    assert done.share == 0
    assert done.reason == "dashboards look fine"
    assert rb.store.last_version() == version + 1  # published at once
    assert split(rb) == ("2.0.0", "", 0)  # the new version is the stable one, as after 100%
    (listed,) = ctl.listing("credit-risk")
    assert [e.kind for e in listed.events][-2:] == ["pause", "promote"]
    assert await ctl.step() == []  # nothing left to step
    with pytest.raises(RolloutError, match="no rollout in progress"):
        ctl.control("credit-risk", "promote", "")
    nxt = ctl.start(spec(from_version="", to_version="2.1.0"), "")
    assert nxt.spec.from_version == "2.0.0"


async def test_an_unversioned_adapter_rolls_back_to_no_split(tmp_path: Path):
    ctl, _source, _clock, rb = setup(tmp_path)
    ctl.start(spec(from_version=""), "")
    assert split(rb) == ("", "2.0.0", 500)
    ctl.control("credit-risk", "abort", "")
    assert split(rb) is None


async def test_one_rollout_per_adapter_and_bad_specs_change_nothing(tmp_path: Path):
    ctl, _source, _clock, rb = setup(tmp_path)
    ctl.start(spec(), "")
    version = rb.store.last_version()
    with pytest.raises(RolloutError, match="already has a rollout in progress"):
        ctl.start(spec(to_version="3.0.0"), "")
    with pytest.raises(RuleError, match=r"spec.steps_percent\[1\]"):
        ctl.start(spec(adapter="other", steps_percent=[50, 20, 100]), "")
    with pytest.raises(RolloutError, match="already serves"):
        ctl.start(spec(adapter="other", from_version="2.0.0"), "")
    for action in ("skip", "Promote", ""):
        with pytest.raises(RolloutError, match="not one of pause, resume, promote, abort"):
            ctl.control("credit-risk", action, "")
    assert rb.store.last_version() == version
    assert [r.spec.adapter for r in ctl.listing()] == ["credit-risk"]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"adapter": ""}, "spec.adapter"),
        ({"adapter": "a@b"}, "spec.adapter"),
        ({"to_version": ""}, "spec.to_version"),
        ({"to_version": "2 0"}, "spec.to_version"),
        ({"from_version": "-x"}, "spec.from_version"),
        ({"steps_percent": []}, "spec.steps_percent"),
        ({"steps_percent": [0, 100]}, "spec.steps_percent[0]"),
        ({"steps_percent": [5, 50]}, "spec.steps_percent"),
        ({"steps_percent": [5, 5, 100]}, "spec.steps_percent[1]"),
        ({"interval_seconds": 0}, "spec.interval_seconds"),
        ({"max_error_rate": 1.5}, "spec.max_error_rate"),
        ({"max_error_rate": float("nan")}, "spec.max_error_rate"),
        ({"max_p95_ttft_ms": -1}, "spec.max_p95_ttft_ms"),
    ],
)
def test_bad_specs_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(RuleError) as info:
        check_spec(spec(**kw))
    assert info.value.field == field


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 120), max_size=25), st.integers(0, 10**6))
def test_any_steps_either_pass_or_name_a_field(steps: list[int], interval: int) -> None:
    error: RuleError | None = None
    try:
        check_spec(spec(steps_percent=[max(s, 0) for s in steps], interval_seconds=interval))
    except RuleError as exc:
        error = exc
    if error is not None:
        assert error.field.startswith(("spec.steps_percent", "spec.interval_seconds"))
    else:
        assert steps[-1] == 100
        assert all(a < b for a, b in itertools.pairwise(steps))


@settings(max_examples=300, deadline=None)
@given(
    requests=st.integers(0, 500),
    errors=st.integers(0, 500),
    elapsed=st.integers(0, 500),
    step=st.integers(0, 3),
)
def test_decide_never_moves_on_without_evidence_and_always_bounds(
    requests: int, errors: int, elapsed: int, step: int
) -> None:
    errors = min(errors, requests)
    r = control_plane_pb2.Rollout(
        id="x",
        spec=spec(),
        state=S.ROLLOUT_STATE_RUNNING,
        step=step,
        share=[5, 25, 50, 100][step] * 100,
    )
    r.step_started_at.FromSeconds(1000)
    w = Window(requests, errors, ((0.1, requests - errors),), requests - errors)
    got = decide(r, w, 1000 + elapsed)
    if requests >= 20 and errors / requests > 0.01:
        assert got.kind == "rollback"
    elif requests < 20 or elapsed < 120:
        assert got.kind == "hold"
    else:
        assert got.kind == ("complete" if step == 3 else "advance")


def test_p95_interpolates_like_histogram_quantile() -> None:
    w = Window(100, 0, ((0.1, 50), (0.5, 90), (1.0, 100)), 100)
    assert p95(w) == pytest.approx(750.0)
    assert p95(Window()) is None
    assert p95(Window(10, 0, ((0.1, 5),), 10)) == float("inf")


def test_parse_adapter_series_reads_the_worker_format() -> None:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    c = Counter("adaptermesh_adapter_requests", "x", ["adapter", "outcome"], registry=reg)
    h = Histogram(
        "adaptermesh_adapter_time_to_first_token_seconds",
        "x",
        ["adapter"],
        registry=reg,
        buckets=(0.1, 1.0),
    )
    c.labels(NEW, "stop").inc(7)
    c.labels(NEW, "length").inc(2)
    c.labels(NEW, "injected_fault").inc(3)
    c.labels(NEW, "disconnected").inc(1)
    c.labels("other", "error").inc(5)
    h.labels(NEW).observe(0.05)
    h.labels(NEW).observe(0.5)
    got = parse_adapter_series(generate_latest(reg).decode(), [NEW])
    assert set(got) == {NEW}
    g = got[NEW]
    assert (g.requests, g.errors, g.ttft, g.ttft_count) == (13, 3, {0.1: 1, 1.0: 2}, 2)


# -- the API ---------------------------------------------------------------------------------


async def test_api_start_list_control_and_errors(cp: Harness) -> None:
    stub, md = cp.stub, cp.md
    await stub.UpsertShard(
        control_plane_pb2.UpsertShardRequest(shard=shard("s0", ("10.0.0.1", 8000))), metadata=md
    )
    # No AdapterInstance names the adapter and no worker holds it: refused, nothing stored.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartRollout(S.StartRolloutRequest(spec=spec(), reason="go"), metadata=md)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.value.details() or "").startswith("spec.adapter: 'credit-risk' is not known")
    assert not (await stub.ListRollouts(S.ListRolloutsRequest(history=True), metadata=md)).rollouts
    await stub.UpsertAdapterInstance(
        control_plane_pb2.UpsertAdapterInstanceRequest(
            instance=control_plane_pb2.AdapterInstance(
                name="credit-risk", model_ref=control_plane_pb2.ModelRef(base_model="m")
            )
        ),
        metadata=md,
    )
    r = await stub.StartRollout(S.StartRolloutRequest(spec=spec(), reason="go"), metadata=md)
    assert r.share == 500
    assert r.state == S.ROLLOUT_STATE_RUNNING
    latest = await stub.GetAssignment(control_plane_pb2.GetAssignmentRequest(), metadata=md)
    assert [(s.adapter, s.canary_share) for s in latest.adapter_splits] == [("credit-risk", 500)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartRollout(S.StartRolloutRequest(spec=spec(steps_percent=[5])), metadata=md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.steps_percent" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartRollout(S.StartRolloutRequest(spec=spec()), metadata=md)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    paused = await stub.ControlRollout(
        S.ControlRolloutRequest(adapter="credit-risk", action="pause"), metadata=md
    )
    assert paused.state == S.ROLLOUT_STATE_PAUSED
    listed = await stub.ListRollouts(S.ListRolloutsRequest(history=True), metadata=md)
    assert [e.kind for e in listed.rollouts[0].events] == ["start", "pause"]
    from .conftest import RO_TOKEN, creds

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ControlRollout(
            S.ControlRolloutRequest(adapter="credit-risk", action="abort"), metadata=creds(RO_TOKEN)
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await stub.ListRollouts(S.ListRolloutsRequest(), metadata=creds(RO_TOKEN))


async def test_a_rollout_of_an_adapter_a_worker_holds_starts(cp: Harness) -> None:
    """A worker that reports a version of the adapter resident (its endpoint's adapters in the
    Assignment) makes the adapter known, without an AdapterInstance."""
    held = shard("s0", ("10.0.0.1", 8000))
    held.endpoints[0].adapters.append("credit-risk@1.2.0")
    await cp.stub.UpsertShard(control_plane_pb2.UpsertShardRequest(shard=held), metadata=cp.md)
    r = await cp.stub.StartRollout(S.StartRolloutRequest(spec=spec()), metadata=cp.md)
    assert r.state == S.ROLLOUT_STATE_RUNNING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.StartRollout(
            S.StartRolloutRequest(spec=spec(adapter="credit-risk-typo")), metadata=cp.md
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.value.details() or "").startswith("spec.adapter: ")


def test_adapterctl_parsers() -> None:
    from adaptermesh.cli.adapterctl import parse_duration, parse_fraction, parse_steps

    assert parse_duration("2m", "i") == 120
    assert parse_duration("90", "i") == 90
    assert parse_duration("800ms", "t", "ms") == pytest.approx(800)
    assert parse_duration("1.5s", "t", "ms") == pytest.approx(1500)
    assert parse_fraction("1%", "r") == pytest.approx(0.01)
    assert parse_fraction("0.2", "r") == pytest.approx(0.2)
    assert parse_steps("5,25,50,100") == [5, 25, 50, 100]
    for bad in ("x", "-1s", "nan"):
        with pytest.raises(ValueError, match="--interval"):
            parse_duration(bad, "--interval")
    with pytest.raises(ValueError, match="--max-error-rate"):
        parse_fraction("150%", "--max-error-rate")


class _LateSource:
    """Reports no worker until ``load`` is called, then one holding ``adapter``: an adapter a
    worker loaded after the control plane's last scrape."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerObservation] = {}
        self.scrapes = 0

    def load(self, adapter: str) -> None:
        self.workers = {
            "w0": WorkerObservation(
                address="10.0.0.1",
                port=8000,
                known=True,
                resident_adapters=frozenset({adapter}),
            )
        }

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        self.scrapes += 1
        return dict(self.workers)


async def test_start_waits_for_a_scrape_that_finds_a_freshly_loaded_adapter(
    tmp_path: Path,
) -> None:
    """A rollout started right after a worker loaded its adapter (before the next scrape) is
    not refused: the known-adapter check waits for the rebalancing loop's next steps; a name
    no worker ever reports is still refused, after at most two steps."""
    import asyncio
    from types import SimpleNamespace
    from typing import Any, cast

    from adaptermesh.control_plane.rollout import RolloutError
    from adaptermesh.control_plane.rollout_api import RolloutApi

    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    source = _LateSource()
    rb = Rebalancer(store, cast(Any, source), config=RebalancerConfig(interval_s=0.05))
    controller = cast(Any, SimpleNamespace(store=store, rb=rb))
    api = RolloutApi()
    stop = asyncio.Event()
    loop_task = asyncio.create_task(rb.run(stop))
    try:
        while not rb.running:
            await asyncio.sleep(0.01)
        source.load("support")  # loaded on the worker; the control plane has not scraped yet
        await api._require_known_adapter(controller, "support")
        assert source.scrapes >= 1
        before = source.scrapes
        with pytest.raises(RolloutError) as info:
            await api._require_known_adapter(controller, "typo")
        assert info.value.field == "spec.adapter"
        assert 1 <= source.scrapes - before <= 3
    finally:
        stop.set()
        await loop_task
    # No loop running: nothing would scrape again, so the refusal is immediate.
    assert not rb.running
    assert await rb.next_step(5.0) is False
    with pytest.raises(RolloutError):
        await api._require_known_adapter(controller, "typo")


class _HeldSource(CounterSource):
    """A CounterSource whose scrape waits until the test lets it finish, so an operator's
    action can land while a controller step is awaiting it."""

    def __init__(self) -> None:
        super().__init__()
        import asyncio

        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.hold = False

    async def collect(
        self, targets: list[Target], adapters: Iterable[str]
    ) -> dict[str, dict[str, AdapterCounters]]:
        if self.hold:
            self.entered.set()
            await self.release.wait()
        return await super().collect(targets, adapters)


def _setup_held(tmp_path: Path) -> tuple[RolloutController, _HeldSource, FakeClock, Rebalancer]:
    ctl, _source, clock, rb = setup(tmp_path)
    source = _HeldSource()
    ctl.source = source
    return ctl, source, clock, rb


@pytest.mark.parametrize("action", ["abort", "pause", "promote"])
async def test_an_operator_action_during_a_steps_scrape_wins_and_leaves_no_window(
    tmp_path: Path, action: str
) -> None:
    """The step read the rollout RUNNING, then awaited its scrape; the operator acted
    meanwhile. The step writes nothing over the action (its figures would have rolled the
    rollout back) and keeps no window state for a rollout that is over."""
    import asyncio

    ctl, source, clock, rb = _setup_held(tmp_path)
    started = ctl.start(spec(), "")
    await ctl.step()  # the window's baseline
    source.serve("10.0.0.1:8000", NEW, 30, errors=20)  # a broken bound: rollback if decided
    clock.step(1)
    source.hold = True
    stepping = asyncio.create_task(ctl.step())
    await source.entered.wait()
    done = ctl.control("credit-risk", action, "operator")
    version = rb.store.last_version()
    source.release.set()
    assert await stepping == []  # nothing decided for a rollout that changed meanwhile
    assert rb.store.last_version() == version  # nothing published after the action
    (stored,) = ctl.listing("credit-risk")
    assert stored.id == started.id
    assert stored.state == done.state
    assert [e.kind for e in stored.events] == ["start", action]
    if action == "pause":  # still in progress: its window state stays
        assert set(ctl._base) <= {started.id}
    else:
        assert ctl._base == {}
        assert ctl._windows == {}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from(["start", "serve", "step", "abort_in_scrape", "pause", "resume", "abort"]),
        max_size=40,
    )
)
def test_window_state_is_held_only_for_rollouts_in_progress(ops: list[str]) -> None:
    """Whatever the order of starts, steps, operator actions and actions during a scrape,
    the controller keeps window state for the rollouts in progress only (at most one per
    adapter), so ended rollouts never accumulate."""
    import asyncio
    import tempfile

    async def run(tmp: Path) -> None:
        ctl, source, clock, _rb = _setup_held(tmp)
        for op in ops:
            latest = ctl.listing("credit-risk")
            active = bool(latest) and latest[-1].state in (
                S.ROLLOUT_STATE_RUNNING,
                S.ROLLOUT_STATE_PAUSED,
            )
            if op == "start" and not active:
                ctl.start(spec(from_version="", min_requests=1000), "")
            elif op == "serve":
                source.serve("10.0.0.1:8000", NEW, 3)
                clock.step(5)
            elif op == "step":
                await ctl.step()
            elif op == "abort_in_scrape" and active:
                source.hold, source.release = True, asyncio.Event()
                source.entered.clear()
                stepping = asyncio.create_task(ctl.step())
                await asyncio.wait(
                    [asyncio.ensure_future(source.entered.wait()), stepping],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                ctl.control("credit-risk", "abort", "")
                source.release.set()
                await stepping
                source.hold = False
            elif op in ("pause", "resume", "abort") and active:
                ctl.control("credit-risk", op, "")
            in_progress = {
                r.id
                for r in ctl.listing()
                if r.state in (S.ROLLOUT_STATE_RUNNING, S.ROLLOUT_STATE_PAUSED)
            }
            if op == "step" or op == "abort_in_scrape":
                assert set(ctl._base) <= in_progress
                assert set(ctl._windows) <= in_progress
            assert len(ctl._base) <= 1
            assert len(ctl._windows) <= 1

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(Path(tmp)))


def _rollout(adapter: str, n: int) -> control_plane_pb2.Rollout:
    r = control_plane_pb2.Rollout(
        id=f"{adapter}-{n}",
        spec=spec(adapter=adapter, to_version=f"2.0.{n}"),
        state=S.ROLLOUT_STATE_ABORTED,
    )
    return r


def _event(kind: str) -> control_plane_pb2.RolloutEvent:
    return control_plane_pb2.RolloutEvent(kind=kind)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 5),
    adapters=st.lists(st.sampled_from(["a", "b", "c"]), max_size=30),
)
def test_the_store_keeps_the_newest_rollouts_per_adapter(limit: int, adapters: list[str]) -> None:
    """After any sequence of rollouts, each adapter keeps its newest ``limit`` rollouts
    (the newest always) with all their events, and nothing of the older ones."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "cp.sqlite3", synchronous="OFF", rollout_history_limit=limit)
        made: dict[str, list[str]] = {}
        for n, adapter in enumerate(adapters):
            r = _rollout(adapter, n)
            store.put_rollout(r, _event("start"))
            store.put_rollout(r, _event("abort"))
            made.setdefault(adapter, []).append(r.id)
        for adapter, ids in made.items():
            kept = store.rollouts(adapter, latest_only=False, events=True)
            assert [r.id for r in kept] == ids[-limit:]
            assert all([e.kind for e in r.events] == ["start", "abort"] for r in kept)
            (latest,) = store.rollouts(adapter)
            assert latest.id == ids[-1]
        events = store._db.execute("SELECT COUNT(*) FROM rollout_events").fetchone()[0]
        assert events == 2 * sum(min(len(ids), limit) for ids in made.values())
        store.close()


async def test_rollout_history_is_capped_through_the_controller(tmp_path: Path) -> None:
    """The default cap holds for rollouts started and aborted one after another (what a
    soak's change cycle does), and the history lists the newest ones, newest last."""
    from adaptermesh.control_plane.store import ROLLOUT_HISTORY_LIMIT

    ctl, _source, _clock, rb = setup(tmp_path)
    ids = []
    for n in range(ROLLOUT_HISTORY_LIMIT + 7):
        ids.append(ctl.start(spec(from_version="", to_version=f"2.0.{n}"), "").id)
        ctl.control("credit-risk", "abort", "")
    history = ctl.listing("credit-risk", history=True)
    assert len(history) == ROLLOUT_HISTORY_LIMIT
    assert [r.id for r in history] == ids[-ROLLOUT_HISTORY_LIMIT:]
    assert [e.kind for e in history[-1].events] == ["start", "abort"]
    assert split(rb) is None  # the newest (aborted, unversioned) still decides the split


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(2, 6),
    kinds=st.lists(
        st.tuples(st.sampled_from(["x", "y"]), st.sampled_from(["pause", "resume", "step"])),
        max_size=40,
    ),
)
def test_the_store_keeps_each_rollouts_first_and_newest_events(
    limit: int, kinds: list[tuple[str, str]]
) -> None:
    """Whatever events arrive, interleaved over two rollouts, each keeps its first event and
    its newest ``limit - 1``, in order, and the table holds nothing else."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "cp.sqlite3", synchronous="OFF", rollout_event_limit=limit)
        rollouts = {a: _rollout(a, 0) for a in ("x", "y")}
        written: dict[str, list[str]] = {a: [] for a in rollouts}
        for a, r in rollouts.items():
            store.put_rollout(r, _event(f"start-{a}"))
            written[a].append(f"start-{a}")
        for n, (a, kind) in enumerate(kinds):
            store.put_rollout(rollouts[a], _event(f"{kind}-{n}"))
            written[a].append(f"{kind}-{n}")
        for a, all_kinds in written.items():
            (got,) = store.rollouts(a, events=True)
            want = (
                all_kinds if len(all_kinds) <= limit else [all_kinds[0], *all_kinds[-(limit - 1) :]]
            )
            assert [e.kind for e in got.events] == want
        rows = store._db.execute("SELECT COUNT(*) FROM rollout_events").fetchone()[0]
        assert rows == sum(min(len(k), limit) for k in written.values())
        store.close()


def test_the_event_limit_is_checked() -> None:
    import tempfile

    with (
        tempfile.TemporaryDirectory() as tmp,
        pytest.raises(ValueError, match="rollout_event_limit"),
    ):
        Store(Path(tmp) / "cp.sqlite3", rollout_event_limit=1)


async def test_pausing_and_resuming_in_a_loop_keeps_the_events_bounded(tmp_path: Path) -> None:
    """An operator (or a script) pausing and resuming one rollout over and over: its history
    keeps the start and the newest events, ROLLOUT_EVENT_LIMIT in all."""
    from adaptermesh.control_plane.store import ROLLOUT_EVENT_LIMIT

    ctl, _source, _clock, _rb = setup(tmp_path)
    ctl.start(spec(from_version="", to_version="2.0.1"), "first")
    for n in range(ROLLOUT_EVENT_LIMIT):
        ctl.control("credit-risk", "pause", f"p{n}")
        ctl.control("credit-risk", "resume", f"r{n}")
    (r,) = ctl.listing("credit-risk", history=True)
    assert len(r.events) == ROLLOUT_EVENT_LIMIT
    assert r.events[0].kind == "start"
    assert [e.reason for e in r.events[-2:]] == [
        f"p{ROLLOUT_EVENT_LIMIT - 1}",
        f"r{ROLLOUT_EVENT_LIMIT - 1}",
    ]
    assert r.state == S.ROLLOUT_STATE_RUNNING
