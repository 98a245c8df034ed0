"""Replay recorded load traces: power-law capacity model vs the queueing model.

Input: trace JSONs written by ``record_load_trace.py`` (one worker observed by the control
plane's scraper every interval while the offered load swept around its capacity). Measured:

1. **Prediction error, walk-forward.** At each interval k, both models are calibrated on the
   intervals before k only and predict interval k's p95 time to first token from its
   throughput. Power law: ``fit_power_law`` on the last ``window`` intervals (the rebalancer's
   history); when the fit is not usable, the queueing model's prediction stands in (the
   policy's fallback). Queueing: ``L0 / (1 - rho)`` with ``L0`` the smallest p95 seen so far
   and ``rho`` from the previous interval (latency inflation, or queueing when requests wait),
   scaled by the throughput ratio. Reported: median and p90 absolute relative error.
2. **Tail latency the rebalancer achieves.** Two (or more) simulated shards whose workers
   follow the recorded curve (monotone interpolation of p95 against throughput, the second
   shard with ``--slow`` of the first's capacity), under a demand that swings +-40% around
   ``--load`` of the total capacity. The real ``policy.decide`` runs each tick, once with the
   curves ``CapacityHistory`` fits and once with the queueing model only. Reported: the mean
   and p95 over the second half of the run of the worst shard's p95.

  PYTHONPATH=src python3 bench/bench_capacity.py bench/results/load_trace_h200.json \\
      --out bench/results/capacity_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from adaptermesh.control_plane.capacity_history import CapacityHistory
from adaptermesh.control_plane.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    ShardObservation,
    WorkerObservation,
    decide,
)
from adaptermesh.control_plane.policy.capacity import CapacityConfig, fit_power_law, queue_latency


def rows_of(trace: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in trace["rows"]:
        lat = r.get("ttft_p95_s") or r.get("ttft_mean_s")
        if r.get("known") and lat and r.get("tokens_per_s", 0) > 0:
            out.append({**r, "lat": float(lat)})
    return out


def prediction_errors(rows: list[dict[str, Any]], cfg: CapacityConfig) -> dict[str, Any]:
    errs: dict[str, list[float]] = {
        "queue": [],
        "power_law": [],
        "power_law_usable_only": [],
        "queue_on_usable": [],
    }
    usable = 0
    for k in range(1, len(rows)):
        past = rows[max(0, k - cfg.window) : k]
        obs = rows[k]
        l0 = min(r["lat"] for r in rows[:k])
        prev = rows[k - 1]
        rho = max(1.0 - l0 / prev["lat"], 0.0)
        if prev.get("waiting", 0) > 0:
            rho = max(rho, 1.0 + prev["waiting"] / max(prev.get("running", 0), 1.0))
        q_pred = queue_latency(
            l0, min(cfg_rho_max(), rho * obs["tokens_per_s"] / prev["tokens_per_s"])
        )
        q_err = abs(q_pred - obs["lat"]) / obs["lat"] if math.isfinite(q_pred) else 1.0
        fit = fit_power_law([r["tokens_per_s"] for r in past], [r["lat"] for r in past], cfg)
        errs["queue"].append(q_err)
        if fit.usable:
            usable += 1
            p_err = abs(fit.predict(obs["tokens_per_s"]) - obs["lat"]) / obs["lat"]
            errs["power_law_usable_only"].append(p_err)
            errs["queue_on_usable"].append(q_err)
            errs["power_law"].append(p_err)
        else:
            errs["power_law"].append(q_err)

    def stats(v: list[float]) -> dict[str, float | None]:
        if not v:
            return {"n": 0, "median": None, "p90": None}
        a = np.array(v)
        return {"n": len(v), "median": float(np.median(a)), "p90": float(np.quantile(a, 0.9))}

    return {
        "intervals": len(rows) - 1,
        "fit_usable": usable,
        **{k: stats(v) for k, v in errs.items()},
    }


def cfg_rho_max() -> float:
    return 0.999  # past this the queueing model predicts infinity; cap to score it finitely


class TraceCurve:
    """The recorded worker: p95 TTFT against throughput, made monotone, extrapolated past the
    largest throughput seen along the last segment's slope."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        pts = sorted((r["tokens_per_s"], r["lat"]) for r in rows)
        t = np.array([p[0] for p in pts])
        lat = np.maximum.accumulate(np.array([p[1] for p in pts]))
        self.t, self.lat = t, lat
        self.cap = float(t.max())
        hi = max(1, len(t) // 5)
        dt = float(t[-1] - t[-hi - 1]) if len(t) > hi else 1.0
        self.slope = max(float(lat[-1] - lat[-hi - 1]) / max(dt, 1e-9), 1e-6)

    def __call__(self, tokens: float) -> float:
        if tokens <= self.cap:
            return float(np.interp(tokens, self.t, self.lat))
        return float(self.lat[-1] + self.slope * (tokens - self.cap))


def closed_loop(
    curve: TraceCurve, slow: float, load: float, ticks: int, power_law: bool, seed: int
) -> dict[str, float]:
    caps = {"a": 1.0, "b": slow}
    total_cap = curve.cap * sum(caps.values())
    rng = random.Random(seed)
    history = CapacityHistory(CapacityConfig(), refit_every=1)
    state = PolicyState()
    weights = {s: 5000 for s in caps}
    worst: list[float] = []
    planned = 0
    for tick in range(ticks):
        demand = (
            load
            * total_cap
            * (1 + 0.4 * math.sin(2 * math.pi * tick / 36))
            * math.exp(rng.gauss(0, 0.05))
        )
        shards = {}
        tick_worst = 0.0
        for i, (sid, c) in enumerate(caps.items()):
            tok = demand * weights.get(sid, 5000) / 10_000
            lat = curve(tok / c) * math.exp(rng.gauss(0, 0.03))
            tick_worst = max(tick_worst, lat)
            shards[sid] = ShardObservation(
                sid,
                True,
                (
                    WorkerObservation(
                        f"10.0.{i}.1",
                        8000,
                        True,
                        latency_s=lat * 0.7,
                        ttft_p95_s=lat,
                        tokens_per_s=tok,
                        waiting=0.0 if tok / c <= curve.cap else 1.0,
                        running=1.0,
                    ),
                ),
            )
        if tick >= ticks // 2:
            worst.append(tick_worst)
        obs = Observation(shards)
        if power_law:
            history.add({f"10.0.{i}.1:8000": s.workers[0] for i, s in enumerate(shards.values())})
            obs = Observation(shards, curves=history.fits())
        d = decide(obs, state, float(tick), PolicyConfig())
        state = d.state
        weights = dict(d.weights)
        planned += bool(d.predicted_latency_s)
    a = np.array(worst)
    return {
        "mean_worst_p95_s": float(a.mean()),
        "p95_worst_p95_s": float(np.quantile(a, 0.95)),
        "ticks_planned_by_power_law": planned,
        "final_weights": weights,
    }  # type: ignore[dict-item]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--slow", type=float, default=0.6, help="capacity of the second shard relative to the first"
    )
    ap.add_argument(
        "--load", type=float, default=0.7, help="mean demand as a fraction of total capacity"
    )
    ap.add_argument("--ticks", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = CapacityConfig()
    out: dict[str, Any] = {
        "bench": "bench_capacity",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "capacity_config": {k: getattr(cfg, k) for k in cfg.__slots__},
        "traces": {},
    }
    for path in args.traces:
        trace = json.loads(Path(path).read_text())
        rows = rows_of(trace)
        if len(rows) < cfg.min_points + 2:
            print(f"{path}: only {len(rows)} usable intervals", file=sys.stderr)
            return 2
        # The drain after the sweep (nothing offered) is a transient, not an operating point.
        curve = TraceCurve([r for r in rows if r.get("offered_rps", 0) > 0])
        res: dict[str, Any] = {
            "source": {
                k: trace.get(k)
                for k in ("date", "command", "machine", "model", "workload", "capacity_rps")
            },
            "prediction": prediction_errors(rows, cfg),
            "whole_trace_fit": {
                k: v
                for k, v in zip(
                    (
                        "alpha",
                        "beta",
                        "eps",
                        "r2",
                        "excitation",
                        "confidence",
                        "points",
                        "usable",
                        "reason",
                    ),
                    (
                        lambda f: (
                            f.alpha,
                            f.beta,
                            f.eps,
                            f.r2,
                            f.excitation,
                            f.confidence,
                            f.points,
                            f.usable,
                            f.reason,
                        )
                    )(
                        fit_power_law(
                            [r["tokens_per_s"] for r in rows], [r["lat"] for r in rows], cfg
                        )
                    ),
                    strict=True,
                )
            },
            "rebalancer": {
                "slow_shard_capacity": args.slow,
                "load": args.load,
                "ticks": args.ticks,
            },
        }
        for name, pl in (("queue", False), ("power_law", True)):
            res["rebalancer"][name] = closed_loop(
                curve, args.slow, args.load, args.ticks, pl, args.seed
            )
        out["traces"][Path(path).name] = res
        p = res["prediction"]
        rb = res["rebalancer"]
        print(
            f"{Path(path).name}: {p['intervals']} intervals, fit usable on {p['fit_usable']}; "
            f"median error queue {p['queue']['median']:.3f} vs power law {p['power_law']['median']:.3f}; "
            f"worst-shard p95 mean queue {rb['queue']['mean_worst_p95_s']:.4f} s vs power law "
            f"{rb['power_law']['mean_worst_p95_s']:.4f} s",
            file=sys.stderr,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
