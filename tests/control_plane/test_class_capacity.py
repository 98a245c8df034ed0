"""Power-law fits per (worker, adapter class): the per-adapter histograms workers export, the
class mix that predicts a worker's tail, its fallbacks, hostile input and bounded memory."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from adaptermesh.control_plane.capacity_history import (
    ADAPTER_CLASS_LABEL,
    CapacityHistory,
    adapter_class,
)
from adaptermesh.control_plane.metrics_source import Target, _observe, _WorkerHistory
from adaptermesh.control_plane.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    ShardObservation,
    WorkerObservation,
    decide,
)
from adaptermesh.control_plane.policy.capacity import (
    CapacityConfig,
    ClassMix,
    MixedCurve,
    PowerLawFit,
    ShardCurve,
    mixed_curve,
    plan_split,
)
from adaptermesh.worker_scrape import MAX_ADAPTER_HISTOGRAMS, parse_metrics

# The worker's TTFT buckets (worker/metrics.py _TTFT_BUCKETS).
BOUNDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
KEY = "10.0.0.1:8000"
TARGET = Target("s", "10.0.0.1", 8000)


def fit(alpha: float, beta: float, eps: float, usable: bool = True) -> PowerLawFit:
    return PowerLawFit(alpha, beta, eps, 0.9, 1.0, 0.9, 50, usable, "" if usable else "test")


# -- a worker whose adapter classes follow different curves ------------------------------------


@dataclass
class ClassPlant:
    """One worker, scraped like ``ScrapeSource`` does: the exposition is real Prometheus text.

    Class ``c``'s requests at worker throughput ``T`` take ``eps_c + Exp(theta)`` seconds to
    the first token, ``theta`` chosen so the class's p95 is ``eps_c + alpha_c * T^-beta_c``.
    """

    curves: dict[str, tuple[float, float, float]]
    adapters: dict[str, tuple[str, ...]]  # class -> served adapter names
    seed: int = 0
    interval_s: float = 5.0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        r = self.registry
        self.ttft = Histogram(
            "adaptermesh_time_to_first_token_seconds", "t", registry=r, buckets=BOUNDS
        )
        self.adapter_ttft = Histogram(
            "adaptermesh_adapter_time_to_first_token_seconds",
            "t",
            ["adapter"],
            registry=r,
            buckets=BOUNDS,
        )
        self.tokens = Counter("adaptermesh_generation_tokens", "t", registry=r)
        self.hist = _WorkerHistory()
        self.now = 0.0
        self.scrape()

    def q(self, cls: str, tokens: float) -> float:
        a, b, e = self.curves[cls]
        return e + a * tokens ** (-b)

    def scrape(self) -> WorkerObservation:
        raw = parse_metrics(generate_latest(self.registry).decode())
        obs = _observe(TARGET, self.hist, raw, self.now)
        self.hist.sample, self.hist.at, self.hist.observation = raw, self.now, obs
        return obs

    def interval(self, tokens: float, shares: dict[str, float], n: int = 400) -> WorkerObservation:
        names = sorted(shares)
        for _ in range(n):
            cls = self.rng.choices(names, [shares[c] for c in names])[0]
            eps = self.curves[cls][2]
            theta = (self.q(cls, tokens) - eps) / math.log(20.0)
            lat = eps + self.rng.expovariate(1.0 / theta)
            adapter = self.rng.choice(self.adapters[cls])
            self.ttft.observe(lat)
            self.adapter_ttft.labels(adapter=adapter).observe(lat)
        self.tokens.inc(tokens * self.interval_s)
        self.now += self.interval_s
        return self.scrape()


def two_class_plant(seed: int = 0) -> ClassPlant:
    # Small-rank chat adapters: low floor, gentle. Large-rank code adapter: high floor, steep.
    return ClassPlant(
        curves={"small": (2.5e-8, -2.0, 0.05), "large": (1e-8, -2.5, 0.4)},
        adapters={"small": ("chat-a@v1", "chat-b"), "large": ("code-x@v3",)},
        seed=seed,
    )


CLASSES = {"chat-a": "small", "chat-b": "small", "code-x": "large"}


def load(tick: int, rng: random.Random) -> tuple[float, dict[str, float]]:
    """Throughput sweeps 300..2,000 tokens/s; the large class's share drifts 5 %..60 %."""
    tokens = math.exp(rng.uniform(math.log(300.0), math.log(2000.0)))
    large = 0.325 + 0.275 * math.sin(2 * math.pi * tick / 37)
    return tokens, {"small": 1.0 - large, "large": large}


def test_classes_come_from_the_instance_label_else_the_adapter_name() -> None:
    assert adapter_class("chat-a@v1", CLASSES) == "small"
    assert adapter_class("chat-a", CLASSES) == "small"
    assert adapter_class("other@v2", CLASSES) == "other"
    assert adapter_class("other", {}) == "other"


def test_the_scrape_hands_over_each_adapters_interval_histogram() -> None:
    plant = two_class_plant()
    plant.interval(500.0, {"small": 1.0})
    obs = plant.interval(500.0, {"small": 0.5, "large": 0.5}, n=200)
    assert set(obs.adapter_ttft) == {"chat-a@v1", "chat-b", "code-x@v3"}
    assert sum(h[-1][1] for h in obs.adapter_ttft.values()) == 200  # this interval only
    assert obs.first_tokens == 200
    assert all(h[-1][0] == math.inf for h in obs.adapter_ttft.values())
    # An idle adapter (nothing new in the interval) is left out.
    obs = plant.interval(500.0, {"large": 1.0}, n=50)
    assert set(obs.adapter_ttft) == {"code-x@v3"}


def test_the_scrape_keeps_at_most_the_cap_of_adapter_histograms() -> None:
    r = CollectorRegistry()
    h = Histogram(
        "adaptermesh_adapter_time_to_first_token_seconds",
        "t",
        ["adapter"],
        registry=r,
        buckets=BOUNDS,
    )
    for i in range(MAX_ADAPTER_HISTOGRAMS + 40):
        h.labels(adapter=f"a{i}").observe(0.1)
    raw = parse_metrics(generate_latest(r).decode())
    assert len(raw.adapter_ttft) == MAX_ADAPTER_HISTOGRAMS


def test_class_mix_beats_the_worker_fit_on_held_out_intervals() -> None:
    plant = two_class_plant(seed=3)
    rng = random.Random(7)
    history = CapacityHistory(CapacityConfig(), refit_every=1)
    train, held_out = 100, 50
    mix_err: list[float] = []
    own_err: list[float] = []
    last_tokens = 0.0
    for tick in range(train + held_out):
        tokens, shares = load(tick, rng)
        obs = plant.interval(tokens, shares)
        if tick >= train:
            # Walk forward: predict this interval's p95 from what was known before it.
            own = history.fits()[KEY]
            mix = history.class_mixes()[KEY]
            assert {c for c, _, _ in mix.classes} == {"small", "large"}
            curve = mixed_curve(mix, own, last_tokens)
            assert isinstance(curve, MixedCurve)
            assert obs.ttft_p95_s is not None
            mix_err.append(abs(math.log(curve.predict(tokens) / obs.ttft_p95_s)))
            own_err.append(abs(math.log(own.predict(tokens) / obs.ttft_p95_s)))
        history.add({KEY: obs}, CLASSES)
        last_tokens = tokens
    mix_median, own_median = float(np.median(mix_err)), float(np.median(own_err))
    assert mix_median < 0.6 * own_median, (mix_median, own_median)
    assert mix_median < 0.2, mix_median


def test_a_class_without_excitation_falls_back_to_the_worker_fit() -> None:
    """A class that only ever runs at one operating point has no usable fit: its share is
    the mix's rest, predicted by the worker's own fit."""
    plant = ClassPlant(
        curves={"small": (2.5e-8, -2.0, 0.05), "batch": (3e-8, -2.0, 0.06)},
        adapters={"small": ("chat-a",), "batch": ("nightly",)},
        seed=1,
    )
    rng = random.Random(2)
    history = CapacityHistory(CapacityConfig(), refit_every=1)
    for tick in range(80):
        if tick % 4 == 0:  # the batch class runs only at 800 tokens/s
            obs = plant.interval(800.0, {"small": 0.7, "batch": 0.3})
        else:
            obs = plant.interval(
                math.exp(rng.uniform(math.log(300), math.log(2000))), {"small": 1.0}
            )
        history.add({KEY: obs}, {})
    own = history.fits()[KEY]
    assert own.usable, own.reason
    mix = history.class_mixes()[KEY]
    assert [c for c, _, _ in mix.classes] == ["chat-a"]  # no label: the adapter is its class
    assert mix.rest > 0.01  # the batch class's share, for the worker's fit to predict
    assert sum(s for _, _, s in mix.classes) + mix.rest == pytest.approx(1.0)
    curve = mixed_curve(mix, own, 800.0)
    assert isinstance(curve, MixedCurve)
    assert [f for _, f in curve.growing if f is own] == [own]
    # Without a usable worker fit the rest has no curve: the worker gets none, and its shard
    # falls back to the queueing model.
    unusable = replace(own, usable=False, reason="test")
    assert mixed_curve(mix, unusable, 800.0) is None


def test_no_class_fit_and_no_worker_fit_is_the_queueing_model() -> None:
    def observation(mixes: dict[str, ClassMix]) -> Observation:
        shards = {
            sid: ShardObservation(
                sid,
                True,
                (
                    WorkerObservation(
                        f"10.0.{i}.1",
                        1,
                        True,
                        tokens_per_s=100.0 * (i + 1),
                        latency_s=0.1 * (i + 1),
                        ttft_p95_s=0.2 * (i + 1),
                        kv_cache_usage=0.3,
                    ),
                ),
            )
            for i, sid in enumerate(("a", "b"))
        }
        return Observation(shards, class_mixes=mixes)

    plain = decide(observation({}), PolicyState(), 0.0, PolicyConfig())
    half = ClassMix((("x", fit(1e-6, -2.0, 0.05), 0.5),), rest=0.5)
    with_rest = decide(observation({"10.0.0.1:1": half}), PolicyState(), 0.0, PolicyConfig())
    assert with_rest.weights == plain.weights
    assert with_rest.predicted_latency_s == {}


def test_the_planner_reads_each_shards_class_mix() -> None:
    """Two shards with the same worker fit: the one whose traffic is mostly the slow class
    gets less weight, and the planned split equalises the mixed predictions."""
    own = fit(2.5e-8, -2.0, 0.05)
    small, large = fit(2.5e-8, -2.0, 0.05), fit(1e-8, -2.5, 0.4)
    mixes = {
        "10.0.0.1:1": ClassMix((("large", large, 0.1), ("small", small, 0.9))),
        "10.0.1.1:1": ClassMix((("large", large, 0.6), ("small", small, 0.4))),
    }
    curves = [
        ShardCurve(5000.0, 0.5, 0.1, ((mixed_curve(mixes[k], own, 1000.0), 1000.0),))  # type: ignore[arg-type]
        for k in sorted(mixes)
    ]
    w = plan_split(curves, 10_000.0, 50.0)
    assert w.sum() == pytest.approx(10_000.0)
    assert w[0] > w[1]
    assert curves[0].predict(w[0]) == pytest.approx(curves[1].predict(w[1]), rel=0.02)


# -- properties --------------------------------------------------------------------------------

fits_in_bounds = st.builds(
    lambda ln_a, b, e: fit(math.exp(ln_a), b, e),
    st.floats(-30.0, 30.0),
    st.floats(-6.0, 1.0),
    st.floats(0.0, 10.0),
)


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.tuples(fits_in_bounds, st.floats(1e-3, 1.0)), min_size=1, max_size=5),
    rest=st.floats(0.0, 1.0),
    own=fits_in_bounds,
    observed=st.floats(1e-3, 1e6),
    loads=st.lists(st.floats(1e-3, 1e6), min_size=2, max_size=6),
)
def test_mixed_predictions_are_finite_and_monotone_in_load(
    parts: list[tuple[PowerLawFit, float]],
    rest: float,
    own: PowerLawFit,
    observed: float,
    loads: list[float],
) -> None:
    mix = ClassMix(tuple((f"c{i}", f, s) for i, (f, s) in enumerate(parts)), rest)
    curve = mixed_curve(mix, own, observed)
    assert curve is not None
    values = [curve.predict(t) for t in sorted(loads)]
    assert all(math.isfinite(v) and v >= 0 for v in values)
    if isinstance(curve, MixedCurve):
        assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(values))
        level = values[-1] * 1.5 + 1e-6
        cap = curve.max_throughput(level)
        if 0 < cap < math.inf:
            assert curve.predict(cap) <= level * (1 + 1e-6)


hostile = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, -1e308, 1e308, 1e-320])


@st.composite
def hostile_readings(draw: st.DrawFn) -> WorkerObservation:
    bounds = draw(st.lists(st.one_of(hostile, st.floats(1e-3, 10.0)), min_size=1, max_size=4))
    hist = {
        f"a{i}": tuple((le, draw(hostile)) for le in [*bounds, math.inf])
        for i in range(draw(st.integers(0, 3)))
    }
    return WorkerObservation(
        "10.0.0.1",
        8000,
        True,
        waiting=draw(st.one_of(hostile, st.just(0.0))),
        latency_s=draw(hostile),
        ttft_p95_s=draw(st.one_of(hostile, st.none())),
        tokens_per_s=draw(hostile),
        first_tokens=draw(hostile),
        adapter_ttft=hist,
    )


@settings(max_examples=100, deadline=None)
@given(readings=st.lists(hostile_readings(), min_size=1, max_size=40))
def test_hostile_readings_never_crash_and_never_give_a_confident_fit(
    readings: list[WorkerObservation],
) -> None:
    history = CapacityHistory(CapacityConfig(min_points=3, min_levels=3), refit_every=1)
    for w in readings:
        history.add({KEY: w}, {"a0": "x"})
        assert not any(f.usable for f in history.fits().values())
        assert history.class_mixes() == {}
    sane = WorkerObservation("10.0.0.1", 8000, True, tokens_per_s=100.0, ttft_p95_s=0.1)
    obs = Observation(
        {"s": ShardObservation("s", True, (sane,))},
        curves=history.fits(),
        class_mixes=history.class_mixes(),
    )
    decide(obs, PolicyState(), 0.0, PolicyConfig())


@settings(max_examples=200, deadline=None)
@given(
    shares=st.lists(st.one_of(hostile, st.floats(0.0, 1.0)), min_size=1, max_size=4),
    rest=st.one_of(hostile, st.floats(0.0, 1.0)),
    observed=st.one_of(hostile, st.floats(1e-3, 1e6)),
)
def test_hostile_shares_never_crash_the_mix(
    shares: list[float], rest: float, observed: float
) -> None:
    mix = ClassMix(tuple((f"c{i}", fit(1e-6, -2.0, 0.05), s) for i, s in enumerate(shares)), rest)
    curve = mixed_curve(mix, fit(1e-6, -1.0, 0.05), observed)
    if curve is not None:
        for t in (1.0, 100.0, 1e4):
            assert math.isfinite(curve.predict(t))


# -- bounded memory ----------------------------------------------------------------------------


def test_classes_per_worker_are_capped_and_idle_ones_make_room() -> None:
    cfg = CapacityConfig(max_classes=4, class_evict_after=3)
    history = CapacityHistory(cfg, refit_every=1)
    hist = tuple((le, 10.0 * (i + 1)) for i, le in enumerate((0.1, 0.5, math.inf)))

    def reading(adapters: list[str]) -> WorkerObservation:
        return WorkerObservation(
            "10.0.0.1",
            8000,
            True,
            tokens_per_s=100.0,
            ttft_p95_s=0.2,
            first_tokens=30.0 * len(adapters),
            adapter_ttft={a: hist for a in adapters},
        )

    for tick in range(200):
        # 1,000 distinct adapters over time, 6 at a time: more than the cap.
        history.add({KEY: reading([f"ad{(6 * tick + k) % 1000}" for k in range(6)])}, {})
        tracked = history._classes[KEY]
        assert len(tracked.rate) <= cfg.max_classes
        assert len([k for k in history._series if k.startswith(KEY + "|")]) <= cfg.max_classes
        assert tracked.rest > 0  # the classes past the cap still count, as rest
    # A steady set of busy classes is never evicted by newcomers.
    steady = [f"s{k}" for k in range(4)]
    for _ in range(cfg.class_evict_after + 1):
        history.add({KEY: reading(steady)}, {})
    assert set(history._classes[KEY].rate) == set(steady)
    for tick in range(10):
        history.add({KEY: reading([*steady, f"new{tick}"])}, {})
        assert set(history._classes[KEY].rate) == set(steady)
    # A worker that leaves takes its classes with it.
    history.add({}, {})
    assert history._classes == {}
    assert history._series == {}


def test_the_rebalancer_reads_classes_from_adapter_instance_labels(tmp_path: object) -> None:
    from pathlib import Path

    from adaptermesh.clock import FakeClock
    from adaptermesh.control_plane.rebalancer import Rebalancer
    from adaptermesh.control_plane.store import Store
    from adaptermesh.proto import control_plane_pb2

    from .conftest import StaticSource

    assert isinstance(tmp_path, Path)
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    try:
        rb = Rebalancer(store, StaticSource(), clock=FakeClock())
        inst = control_plane_pb2.AdapterInstance(
            name="code-x", labels={ADAPTER_CLASS_LABEL: "large"}
        )
        inst.model_ref.base_model = "m"
        inst.model_ref.adapter_path = "/adapters/code-x"
        rb.mutate(lambda: store.upsert_adapter_instance(inst, 0.0), "add")
        assert rb.layout().classes == {"code-x": "large"}
    finally:
        store.close()


@settings(max_examples=100, deadline=None)
@given(
    workers=st.lists(
        st.tuples(
            st.lists(st.tuples(fits_in_bounds, st.floats(1e-3, 1.0)), min_size=2, max_size=4),
            st.floats(1.0, 1e4),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=6,
    ),
    levels=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=5),
    weight=st.floats(1.0, 1e4),
)
def test_the_planners_batch_agrees_with_each_mixed_curve(
    workers: list[tuple[list[tuple[PowerLawFit, float]], float, int]],
    levels: list[float],
    weight: float,
) -> None:
    """``plan_split`` caps and predicts all mixed workers at once; each ``MixedCurve`` is the
    oracle."""
    from adaptermesh.control_plane.policy.capacity import _MixBatch

    shards: dict[int, list[tuple[MixedCurve, float]]] = {}
    for parts, tok, sid in workers:
        curve = mixed_curve(
            ClassMix(tuple((f"c{i}", f, s) for i, (f, s) in enumerate(parts))), None, tok
        )
        if isinstance(curve, MixedCurve):
            shards.setdefault(sid, []).append((curve, tok))
    curves = [ShardCurve(2500.0, 0.5, 0.1, tuple(v)) for _, v in sorted(shards.items())]
    batch = _MixBatch(curves)
    for c, low in zip(curves, batch.predict(weight), strict=True):
        assert low == pytest.approx(c.predict(weight), rel=1e-9)
    # In any order: each level's solve is bracketed by the levels solved before it.
    for level in levels:
        for c, cap in zip(curves, batch.max_weights(level), strict=True):
            want = c.max_weight(level)
            if want == 0 or math.isinf(want):
                assert cap == want
            else:
                assert cap == pytest.approx(want, rel=1e-6)


async def test_the_prometheus_source_reads_each_adapters_window_histogram() -> None:
    from aiohttp import web

    from adaptermesh.control_plane.metrics_source import PrometheusSource

    def answer(query: str) -> list[dict[str, object]]:
        inst = {"instance": KEY}
        if "adaptermesh_adapter_time_to_first_token_seconds_bucket" in query:
            rows = [
                ("code-x@v3", "0.5", "2"),
                ("code-x@v3", "1.0", "9"),
                ("code-x@v3", "+Inf", "10"),
                ("chat-a", "0.5", "0"),
                ("chat-a", "+Inf", "0"),  # idle in the window
                ("bad", "x", "3"),
            ]
            return [
                {"metric": inst | {"adapter": a, "le": le}, "value": [1, v]} for a, le, v in rows
            ]
        if "adaptermesh_time_to_first_token_seconds_count" in query:
            return [{"metric": inst, "value": [1, "25"]}]
        if "generation_tokens" in query:
            return [{"metric": inst, "value": [1, "800"]}]
        return []

    async def handler(request: web.Request) -> web.Response:
        result = answer(request.query["query"])
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        out = await PrometheusSource(f"http://127.0.0.1:{port}").collect([TARGET], now=1.0)
    finally:
        await runner.cleanup()
    w = out[KEY]
    assert w.first_tokens == 25
    assert w.adapter_ttft == {"code-x@v3": ((0.5, 2.0), (1.0, 9.0), (math.inf, 10.0))}


# -- the rebalancer, closed loop ---------------------------------------------------------------


class ClassPlantSource:
    """Two shards of one worker each, scraped through real exposition text. Shard ``a`` serves
    chat adapters only; shard ``b`` also the code adapter, whose share drifts 5 %..60 %. Each
    shard's throughput follows its weight; the demand swings +-40 %."""

    def __init__(self, holder: list[object], demand: float = 2400.0) -> None:
        self.holder = holder
        self.demand = demand
        self.plants = {
            "a": ClassPlant(
                curves={"small": (2.5e-8, -2.0, 0.05), "large": (1e-8, -2.5, 0.4)},
                adapters={"small": ("chat-a", "chat-b"), "large": ("code-x",)},
                seed=11,
            ),
            "b": ClassPlant(
                curves={"small": (2.5e-8, -2.0, 0.05), "large": (1e-8, -2.5, 0.4)},
                adapters={"small": ("chat-a", "chat-b"), "large": ("code-x",)},
                seed=12,
            ),
        }
        self.tick = 0
        self.worst: list[float] = []

    async def collect(self, targets: list[Target], now: float) -> dict[str, WorkerObservation]:
        rb = self.holder[0]
        weights = dict(rb.state.weights) or {"a": 5000, "b": 5000}  # type: ignore[attr-defined]
        d = self.demand * (1 + 0.4 * math.sin(2 * math.pi * self.tick / 24))
        large = 0.325 + 0.275 * math.sin(2 * math.pi * self.tick / 37)
        out: dict[str, WorkerObservation] = {}
        worst = 0.0
        for sid, plant in self.plants.items():
            shares = {"small": 1.0} if sid == "a" else {"small": 1.0 - large, "large": large}
            obs = plant.interval(d * weights.get(sid, 5000) / 10_000, shares, n=300)
            key = f"10.0.{ord(sid)}.1:8000"
            out[key] = replace(obs, address=f"10.0.{ord(sid)}.1")
            worst = max(worst, obs.ttft_p95_s or 0.0)
        self.tick += 1
        self.worst.append(worst)
        return out


async def test_the_rebalancer_fits_labelled_classes_and_plans_with_their_mix(
    tmp_path: object,
) -> None:
    from pathlib import Path

    from adaptermesh.clock import FakeClock
    from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
    from adaptermesh.control_plane.store import Store
    from adaptermesh.proto import control_plane_pb2

    from .conftest import shard

    assert isinstance(tmp_path, Path)
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL")
    holder: list[object] = []
    source = ClassPlantSource(holder)
    clock = FakeClock()
    rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig())
    holder.append(rb)
    try:
        for sid in ("a", "b"):
            spec = shard(sid, (f"10.0.{ord(sid)}.1", 8000))
            rb.mutate(lambda spec=spec: store.upsert_shard(spec, clock.time()), f"add {sid}")
        for name, cls in CLASSES.items():
            inst = control_plane_pb2.AdapterInstance(name=name, labels={ADAPTER_CLASS_LABEL: cls})
            inst.model_ref.base_model = "m"
            inst.model_ref.adapter_path = f"/adapters/{name}"
            rb.mutate(lambda inst=inst: store.upsert_adapter_instance(inst, clock.time()), "add")
        planned = 0
        for _ in range(100):
            decision = await rb.step()
            planned += bool(decision.predicted_latency_s)
            clock.step(5)
        mixes = rb.capacity.class_mixes()
        b = mixes["10.0.98.1:8000"]
        assert {c for c, _, _ in b.classes} == {"small", "large"}  # the labels, not the names
        assert planned > 0
    finally:
        store.close()
