"""The power-law capacity model: the fit, its confidence and fallback, the latency-equalising
split, and a closed loop whose workers follow known power laws."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.capacity_history import CapacityHistory
from adaptermesh.control_plane.metrics_source import Target
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
    PowerLawFit,
    ShardCurve,
    fit_power_law,
    narrow_range,
    plan_split,
)
from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
from adaptermesh.control_plane.store import Store

from .conftest import shard

CFG = CapacityConfig()


def law(t: np.ndarray, alpha: float, beta: float, eps: float) -> np.ndarray:
    return eps + alpha * t ** (-beta)


def test_fit_recovers_a_known_power_law() -> None:
    rng = np.random.default_rng(1)
    t = np.exp(rng.uniform(math.log(50), math.log(2000), 60))
    lat = law(t, 2e-7, -2.0, 0.04) * np.exp(rng.normal(0, 0.02, t.size))
    fit = fit_power_law(t, lat, CFG)
    assert fit.usable, fit.reason
    assert fit.beta == pytest.approx(-2.0, abs=0.25)
    assert fit.eps == pytest.approx(0.04, rel=0.3)
    assert fit.confidence > 0.8
    for x in (100.0, 1000.0, 1800.0):
        assert fit.predict(x) == pytest.approx(float(law(np.array(x), 2e-7, -2.0, 0.04)), rel=0.1)


def test_steady_operating_point_falls_back() -> None:
    rng = np.random.default_rng(2)
    t = 800.0 * np.exp(rng.normal(0, 0.01, 60))  # a shard held at one weight
    lat = law(t, 2e-7, -2.0, 0.04) * np.exp(rng.normal(0, 0.02, t.size))
    fit = fit_power_law(t, lat, CFG)
    assert not fit.usable
    assert fit.confidence == 0.0
    assert "not excited" in fit.reason


def test_too_few_points_and_pure_noise_fall_back() -> None:
    assert not fit_power_law([100.0, 200.0, 400.0], [0.1, 0.2, 0.4], CFG).usable
    rng = np.random.default_rng(3)
    t = np.exp(rng.uniform(math.log(50), math.log(2000), 60))
    lat = np.exp(rng.normal(math.log(0.2), 0.5, t.size))  # latency unrelated to load
    fit = fit_power_law(t, lat, CFG)
    assert not fit.usable
    assert "confidence" in fit.reason


finite = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6),
    st.floats(min_value=1e-3, max_value=1e4),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
)


@settings(max_examples=150, deadline=None)
@given(
    pairs=st.lists(st.tuples(finite, finite), min_size=0, max_size=80),
    noise=st.floats(0.0, 1.0),
)
def test_fit_never_returns_nan_or_out_of_bounds(
    pairs: list[tuple[float, float]], noise: float
) -> None:
    t = np.array([p[0] for p in pairs], dtype=np.float64)
    lat = np.array([p[1] for p in pairs], dtype=np.float64) * (1 + noise)
    fit = fit_power_law(t, lat, CFG)
    for v in (fit.alpha, fit.beta, fit.eps, fit.r2, fit.excitation, fit.confidence):
        assert math.isfinite(v)
    assert 0.0 <= fit.confidence <= 1.0
    assert 0.0 <= fit.r2 <= 1.0
    if fit.points >= CFG.min_points and fit.confidence > 0:
        assert CFG.beta_bounds[0] <= fit.beta <= CFG.beta_bounds[1]
        assert CFG.ln_alpha_bounds[0] <= math.log(fit.alpha) <= CFG.ln_alpha_bounds[1]
        ok = np.isfinite(t) & np.isfinite(lat) & (t > CFG.min_tokens_per_s) & (lat > 0)
        assert 0.0 <= fit.eps < float(lat[ok].min())
    assert fit.usable == (fit.reason == "")


@settings(max_examples=100, deadline=None)
@given(
    level=st.floats(1.0, 1e4),
    spread=st.floats(0.0, 0.14),
    noise=st.floats(0.0, 0.5),
    beta=st.floats(-4.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_low_excitation_gives_low_confidence(
    level: float, spread: float, noise: float, beta: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    t = level * np.exp(rng.normal(0, spread, 40))
    assume(float(np.log(t).std()) < CFG.min_log_spread)
    lat = law(t, 1e-3, beta, 0.02) * np.exp(rng.normal(0, noise, t.size))
    fit = fit_power_law(t, lat, CFG)
    assert fit.confidence < CFG.min_confidence
    assert not fit.usable


def _fit(alpha: float, beta: float, eps: float) -> PowerLawFit:
    return PowerLawFit(alpha, beta, eps, 1.0, 1.0, 1.0, 50, True, "")


def test_plan_split_equalises_predicted_latency() -> None:
    fast = ShardCurve(5000.0, 0.5, 0.05, ((_fit(1e-7, -2.0, 0.05), 1000.0),))
    slow = ShardCurve(5000.0, 0.5, 0.05, ((_fit(1e-6, -2.0, 0.05), 1000.0),))
    w = plan_split([fast, slow], 10_000.0, 50.0)
    assert w.sum() == pytest.approx(10_000.0)
    assert w[0] > w[1]
    assert fast.predict(w[0]) == pytest.approx(slow.predict(w[1]), rel=1e-3)


@settings(max_examples=100, deadline=None)
@given(
    shards=st.lists(
        st.tuples(
            st.floats(1e-9, 1e-3),
            st.floats(-4.0, 0.5),
            st.floats(0.0, 0.5),
            st.floats(1.0, 1e4),
            st.booleans(),
            st.floats(0.01, 3.0),
        ),
        min_size=1,
        max_size=8,
    ),
    floor=st.sampled_from([0.0, 50.0]),
)
def test_plan_split_keeps_the_budget_and_floor(
    shards: list[tuple[float, float, float, float, bool, float]], floor: float
) -> None:
    pool = 10_000.0
    curves = [
        ShardCurve(1000.0, rho, 0.05, ((_fit(a, b, e), tok),) if use_fit else ())
        for a, b, e, tok, use_fit, rho in shards
    ]
    w = plan_split(curves, pool, floor)
    assert np.isfinite(w).all()
    assert w.sum() == pytest.approx(pool, rel=1e-6)
    assert (w >= floor - 1e-6).all()


# -- closed loop: workers whose p95 follows a known power law ----------------------------------


@dataclass
class PowerLawPlant:
    """Two workers per shard; shard i's traffic is demand * w_i / budget; each worker's p95
    TTFT is ``eps + alpha * T^2`` at its throughput T, times log-normal noise."""

    curves: dict[str, tuple[float, float, float]]  # shard -> (alpha, beta, eps)
    demand: float
    swing: float = 0.4
    noise: float = 0.03
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def p95(self, sid: str, tokens: float) -> float:
        a, b, e = self.curves[sid]
        return e + a * max(tokens, 1e-9) ** (-b)

    def observe(self, weights: dict[str, int], tick: int) -> tuple[Observation, float]:
        d = self.demand * (1 + self.swing * math.sin(2 * math.pi * tick / 24))
        shards = {}
        worst = 0.0
        for sid in self.curves:
            t = d * weights.get(sid, 5000) / 10_000 / 2
            lat = self.p95(sid, t)
            worst = max(worst, lat)
            workers = tuple(
                WorkerObservation(
                    f"10.0.{ord(sid[-1])}.{j}",
                    8000,
                    True,
                    latency_s=lat * 0.6,
                    ttft_p95_s=lat * math.exp(self.rng.gauss(0, self.noise)),
                    tokens_per_s=t,
                )
                for j in range(2)
            )
            shards[sid] = ShardObservation(sid, True, workers)
        return Observation(shards), worst


def run_loop(
    plant: PowerLawPlant, power_law: bool, ticks: int = 120
) -> tuple[float, CapacityHistory]:
    cfg = PolicyConfig()
    history = CapacityHistory(CapacityConfig(), refit_every=1)
    state = PolicyState()
    weights = {sid: 10_000 // len(plant.curves) for sid in plant.curves}
    tail: list[float] = []
    for tick in range(ticks):
        obs, worst = plant.observe(weights, tick)
        if tick >= ticks // 2:
            tail.append(worst)
        if power_law:
            history.add(
                {f"{w.address}:{w.port}": w for s in obs.shards.values() for w in s.workers}
            )
            obs = Observation(obs.shards, curves=history.fits())
        d = decide(obs, state, float(tick), cfg)
        state = d.state
        weights = dict(d.weights)
    return float(np.mean(tail)), history


def test_loop_fits_the_plant_and_beats_the_queueing_model_on_tail_latency() -> None:
    # Shard a: fast prefill, steep growth; shard b: slow prefill, gentle growth.
    plant = dict(curves={"a": (4e-8, -2.5, 0.03), "b": (2e-4, -1.0, 0.12)}, demand=4000.0)
    queue_tail, _ = run_loop(PowerLawPlant(**plant), power_law=False)
    law_tail, history = run_loop(PowerLawPlant(**plant), power_law=True)
    fits = history.fits()
    fa = fits["10.0.97.0:8000"]
    assert fa.usable, fa.reason
    assert fa.beta == pytest.approx(-2.5, abs=0.4)
    assert law_tail <= queue_tail * 1.02, (law_tail, queue_tail)


def test_loop_with_identical_shards_matches_the_queueing_model() -> None:
    plant = dict(curves={"a": (1e-6, -2.0, 0.05), "b": (1e-6, -2.0, 0.05)}, demand=3000.0)
    queue_tail, _ = run_loop(PowerLawPlant(**plant), power_law=False)
    law_tail, _ = run_loop(PowerLawPlant(**plant), power_law=True)
    assert law_tail == pytest.approx(queue_tail, rel=0.05)


def test_history_skips_stale_and_idle_readings_and_forgets_gone_workers() -> None:
    h = CapacityHistory(CapacityConfig(min_points=3, window=10), refit_every=1)
    live = WorkerObservation("10.0.0.1", 1, True, ttft_p95_s=0.1, tokens_per_s=100.0)
    stale = WorkerObservation("10.0.0.2", 1, True, ttft_p95_s=0.1, tokens_per_s=100.0, age_s=5.0)
    idle = WorkerObservation("10.0.0.3", 1, True, ttft_p95_s=None, latency_s=None, tokens_per_s=0.0)
    for _ in range(4):
        h.add({"a:1": live, "b:1": stale, "c:1": idle})
    assert set(h.fits()) == {"a:1"}
    h.add({"b:1": stale})
    assert h.fits() == {}


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.floats(1.0, 1e5), min_size=8, max_size=60),
    seed=st.integers(0, 2**16),
)
def test_narrow_range_rejects_only_what_the_fit_rejects(tokens: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = np.array(tokens)
    lat = law(t, 1e-6, -1.5, 0.02) * np.exp(rng.normal(0, 0.05, t.size))
    quick = narrow_range(float(t.min()), float(t.max()), t.size, CFG)
    if quick is not None:
        assert not quick.usable
        assert not fit_power_law(t, lat, CFG).usable


def test_slow_decode_tail_loses_endpoint_weight() -> None:
    def obs(tpot_b: float | None) -> Observation:
        return Observation(
            {
                "s": ShardObservation(
                    "s",
                    True,
                    (
                        WorkerObservation("10.0.0.1", 1, True, tokens_per_s=100.0, tpot_p95_s=0.02),
                        WorkerObservation(
                            "10.0.0.2", 1, True, tokens_per_s=100.0, tpot_p95_s=tpot_b
                        ),
                    ),
                )
            }
        )

    slow = decide(obs(0.08), PolicyState(), 0.0, PolicyConfig()).endpoint_weights["s"]
    assert slow["10.0.0.1:1"] == 100
    assert slow["10.0.0.2:1"] == 50  # 4x slower tail: halved, the floor of the scaling
    same = decide(obs(None), PolicyState(), 0.0, PolicyConfig()).endpoint_weights["s"]
    assert same["10.0.0.1:1"] == same["10.0.0.2:1"]


class PowerLawSource:
    """The Rebalancer's load source: the power-law plant at the weights last published."""

    def __init__(self, plant: PowerLawPlant, holder: list[Any]) -> None:
        self.plant = plant
        self.holder = holder
        self.tick = 0
        self.worst: list[float] = []

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        weights = dict(self.holder[0].state.weights) or {s: 5000 for s in self.plant.curves}
        obs, worst = self.plant.observe(weights, self.tick)
        self.tick += 1
        self.worst.append(worst)
        return {f"{w.address}:{w.port}": w for s in obs.shards.values() for w in s.workers}


async def run_rebalancer(
    tmp_path: Path, plant: PowerLawPlant, power_law: bool, ticks: int = 100
) -> tuple[float, Any]:
    store = Store(tmp_path / f"cp-{power_law}.sqlite3", synchronous="NORMAL")
    holder: list[Any] = []
    source = PowerLawSource(plant, holder)
    clock = FakeClock()
    rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig(power_law=power_law))
    holder.append(rb)
    for sid in sorted(plant.curves):
        spec = shard(sid, *[(f"10.0.{ord(sid[-1])}.{j}", 8000) for j in range(2)])
        rb.mutate(lambda spec=spec: store.upsert_shard(spec, clock.time()), f"add {sid}")
    for _ in range(ticks):
        await rb.step()
        clock.step(5)
    store.close()
    return float(np.mean(source.worst[ticks // 2 :])), rb


async def test_rebalancer_with_a_fake_clock_fits_the_plant_and_beats_the_queueing_model(
    tmp_path: Path,
) -> None:
    plant = dict(curves={"a": (4e-8, -2.5, 0.03), "b": (2e-4, -1.0, 0.12)}, demand=4000.0)
    queue_tail, _ = await run_rebalancer(tmp_path, PowerLawPlant(**plant), power_law=False)
    law_tail, rb = await run_rebalancer(tmp_path, PowerLawPlant(**plant), power_law=True)
    fit = rb.capacity.fits()["10.0.97.0:8000"]
    assert fit.usable, fit.reason
    assert fit.beta == pytest.approx(-2.5, abs=0.4)
    assert law_tail <= queue_tail * 1.02, (law_tail, queue_tail)
