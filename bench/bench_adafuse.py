"""Benchmark AdaFuse's fused_switch on a Llama-2-7B-shaped backbone (random bf16 weights).

32 layers x 7 targeted modules (q, k, v, o: 4096x4096; gate, up: 11008x4096; down:
4096x11008), 8 experts of rank 16 per module, top-2 selections. Measured in one run:

- the tiling sweep: every ``fuse_config.SWITCH_CANDIDATES`` config in exact mode, each checked
  against the torch twin on two modules, the fastest one kept (``fused_switch_figures``,
  also imported by bench/bench_sgmm_peers.py);
- fused_switch, exact mode (reads the pristine copy W0, writes W) and delta mode (reads and
  writes W) with the kept config: one launch for all 224 modules; median ms over random
  switches;
- baseline: a per-module torch loop, ``torch.addmm(W0, B_sel * g, A_sel, out=W)`` (224 addmm
  launches plus the small gathers);
- GB/s over the backbone bytes touched (read + write of every targeted weight) and as a share
  of the device-to-device copy bandwidth measured in the same run (the ``targets`` entry:
  at least 70%);
- drift after 1,000 random switches then an unmerge: exact mode must be bit-identical; delta
  mode reports the worst element in ulps of bf16;
- the router for one token and the gated SGMM path for T in {16, 64} on one 4096x4096 module.

Usage: python3 bench/bench_adafuse.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adaptermesh.kernels import dispatch, fuse_config, fuse_kernels

DEVICE = "cuda"
DT = torch.bfloat16
E, R, K_TOP = 8, 16, 2
LAYER = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]
PCT_COPY_BW_TARGET = 70.0


def timed_ms(fn: Callable[[], object], reps: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written per second) of a 2 GiB bf16 buffer."""
    n = 1 << 30
    bufs = [
        torch.empty(n, dtype=DT, device=DEVICE).normal_(),
        torch.empty(n, dtype=DT, device=DEVICE),
    ]
    bufs[1].copy_(bufs[0])
    ms = statistics.median(timed_ms(lambda: bufs[1].copy_(bufs[0]), 20))
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


@dataclass
class Backbone:
    """The 7B-shaped targets with their expert sets and both merge tables."""

    targets: list[fuse_config.MergeTarget]
    exact: fuse_config.MergeTable
    delta: fuse_config.MergeTable
    sels: list[tuple[torch.Tensor, torch.Tensor]]  # 32 random top-k selections
    gen: torch.Generator

    def sel(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _random_sel(self.gen)


def _random_sel(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(E, device=DEVICE, generator=g)[:K_TOP].to(torch.int32)
    gates = torch.softmax(torch.randn(K_TOP, device=DEVICE, generator=g), 0)
    return ids, gates


def build_backbone(layers: int = 32, seed: int = 0) -> Backbone:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    targets = []
    for _ in range(layers):
        for nn_, kk in LAYER:
            w = torch.randn(nn_, kk, device=DEVICE, dtype=DT, generator=g) * 0.02
            la = torch.randn(E, R, kk, device=DEVICE, dtype=DT, generator=g) / kk**0.5
            lb = torch.randn(E, nn_, R, device=DEVICE, dtype=DT, generator=g) / R**0.5 * 0.02
            targets.append(fuse_config.MergeTarget(w, la, lb, scale=2.0, master=w.clone()))
    exact = fuse_config.build_merge_table(targets, exact=True)
    delta = fuse_config.build_merge_table(targets, exact=False)
    return Backbone(targets, exact, delta, [_random_sel(g) for _ in range(32)], g)


def _twin_error(bb: Backbone, ids: torch.Tensor, gates: torch.Tensor) -> float:
    """Worst |W - (W0 + c * Delta)| in bf16 ulps of max(|W|, |W0|) over the first and the last
    module after an exact-mode switch to (ids, gates): at most 1 when the kernel is right (the
    rounding itself is half an ulp; a near-tie may go either way with the fp32 sum order)."""
    from adaptermesh.kernels.reference import _selection_delta_ref

    worst = 0.0
    for t in (bb.targets[0], bb.targets[-1]):
        assert t.master is not None
        want = t.master.float() + t.scale * _selection_delta_ref(t.lora_a, t.lora_b, ids, gates)
        mag = torch.maximum(want.abs(), t.master.float().abs()).clamp(min=2**-16)
        ulp = mag * 2**-7
        worst = max(worst, float(((t.weight.float() - want).abs() / ulp).max()))
    return worst


def _time_switch(
    table: fuse_config.MergeTable,
    sels: Sequence[tuple[torch.Tensor, torch.Tensor]],
    config: fuse_config.SwitchConfig,
    reps: int,
) -> float:
    dispatch.fused_switch(table, *sels[0], config=config)  # compile
    torch.cuda.synchronize()
    it = iter(range(10**9))
    times = timed_ms(
        lambda: dispatch.fused_switch(table, *sels[next(it) % len(sels)], config=config), reps
    )
    return statistics.median(times)


def fused_switch_figures(
    backbone: Backbone | None = None,
    *,
    configs: Sequence[fuse_config.SwitchConfig] = fuse_config.SWITCH_CANDIDATES,
    reps: int = 10,
    copy_gbs: float | None = None,
) -> dict[str, Any]:
    """Sweep the switch tilings in exact mode on the 7B shape and report the fastest.

    Keys: ``ms`` (median exact-mode switch), ``gbps`` (backbone bytes read + written per
    second), ``pct_copy_bw`` (share of the device-to-device copy rate measured here),
    ``config`` (the fastest tiling, a dict), ``copy_bandwidth_gbs``, ``backbone_bytes_touched``,
    ``default_config`` with ``default_ms``, and ``sweep`` (every candidate: config, ms, GB/s,
    % of copy bandwidth, compile + timing seconds, worst error against the twin in ulps). A
    config off the twin by more than one ulp is never picked. Builds the 7B backbone (~26 GB)
    when none is given and frees it afterwards.
    """
    own = backbone is None
    bw = copy_gbs if copy_gbs is not None else copy_bandwidth_gbs()
    bb = backbone if backbone is not None else build_backbone()
    table = bb.exact
    touched = table.backbone_bytes()
    sweep: list[dict[str, Any]] = []
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            ms = _time_switch(table, bb.sels, cfg, reps)
            ids, gates = bb.sels[1]
            dispatch.fused_switch(table, ids, gates, config=cfg)
            err = _twin_error(bb, ids, gates)
        except Exception as exc:  # e.g. out of shared memory on this GPU: record, go on
            sweep.append({"config": cfg.as_dict(), "error": repr(exc)[:300]})
            print(f"SWEEP {cfg.as_dict()} failed: {exc!r}"[:300])
            continue
        gbps = touched / (ms * 1e-3) / 1e9
        sweep.append({
            "config": cfg.as_dict(), "ms": ms, "gbps": gbps, "pct_copy_bw": 100 * gbps / bw,
            "programs": fuse_kernels.switch_launch_args(table, K_TOP, K_TOP, cfg)[0].num_programs,
            "twin_max_ulps": err, "seconds": time.perf_counter() - t0,
        })  # fmt: skip
        print(f"SWEEP {cfg.as_dict()} {ms:.3f} ms {100 * gbps / bw:.1f}% twin {err:.2f} ulp")
    dispatch.fused_unmerge(table)
    torch.cuda.synchronize()
    ran = [r for r in sweep if "ms" in r]
    if not ran:
        raise RuntimeError(f"no switch config ran: {sweep}")
    ok = [r for r in ran if r["twin_max_ulps"] <= 1.0]
    best = min(ok or ran, key=lambda r: r["ms"])
    default = next(
        (r for r in ran if r["config"] == fuse_config.DEFAULT_SWITCH_CONFIG.as_dict()), None
    )
    out = {
        "ms": best["ms"],
        "gbps": best["gbps"],
        "pct_copy_bw": best["pct_copy_bw"],
        "config": best["config"],
        "copy_bandwidth_gbs": bw,
        "backbone_bytes_touched": touched,
        "default_config": fuse_config.DEFAULT_SWITCH_CONFIG.as_dict(),
        "default_ms": default["ms"] if default else None,
        "all_configs_match_twin": len(ok) == len(sweep),  # and all of them ran
        "sweep": sweep,
    }
    if own:
        del bb, table
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--switches", type=int, default=1000)
    args = ap.parse_args()
    res: dict[str, Any] = {
        "bench": "adafuse",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "model": f"Llama-2-7B shapes, {args.layers} layers x 7 modules, E={E}, r={R}, top-{K_TOP}",
    }
    t_start = time.perf_counter()
    bw = copy_bandwidth_gbs()
    res["copy_bandwidth_gbs"] = bw
    bb = build_backbone(args.layers)
    targets, exact, delta, sels, g = bb.targets, bb.exact, bb.delta, bb.sels, bb.gen
    sel = bb.sel
    touched = exact.backbone_bytes()
    res["backbone_bytes_touched"] = touched
    res["modules"] = len(targets)

    fig = fused_switch_figures(bb, copy_gbs=bw)
    res["switch_sweep"] = fig["sweep"]
    res["switch_config"] = fig["config"]
    res["switch_default_config"] = fig["default_config"]
    res["switch_default_ms"] = fig["default_ms"]
    res["switch_all_configs_match_twin"] = fig["all_configs_match_twin"]
    best = fuse_config.SwitchConfig(**fig["config"])
    res["programs"] = fuse_kernels.switch_launch_args(exact, K_TOP, K_TOP, best)[0].num_programs
    for name, table in (("exact", exact), ("delta", delta)):
        try:
            med = _time_switch(table, sels, best, 15)
        except Exception as exc:  # the delta variant needs more shared memory
            print(f"{name} mode with {best}: {exc!r}; timing the default config"[:300])
            res[f"fused_switch_{name}_config_error"] = repr(exc)[:300]
            best = fuse_config.DEFAULT_SWITCH_CONFIG
            med = _time_switch(table, sels, best, 15)
        res[f"fused_switch_{name}_config"] = best.as_dict()
        res[f"fused_switch_{name}_ms"] = med
        res[f"fused_switch_{name}_gbs"] = touched / (med * 1e-3) / 1e9
        res[f"fused_switch_{name}_pct_copy_bw"] = 100 * touched / (med * 1e-3) / 1e9 / bw
        dispatch.fused_unmerge(table, config=best)
    torch.cuda.synchronize()
    pct = res["fused_switch_exact_pct_copy_bw"]
    res["targets"] = {
        "adafuse_switch_pct_copy_bw": {
            "value": pct, "target": PCT_COPY_BW_TARGET, "met": pct >= PCT_COPY_BW_TARGET,
        },
    }  # fmt: skip

    def loop(ids: torch.Tensor, gates: torch.Tensor) -> None:
        idx = ids.long()
        for t in targets:
            bsel = (
                t.lora_b.index_select(0, idx) * (gates * t.scale).to(DT)[:, None, None]
            )  # [k, N, r]
            bcat = bsel.permute(1, 0, 2).reshape(t.weight.shape[0], -1)
            acat = t.lora_a.index_select(0, idx).reshape(-1, t.weight.shape[1])
            torch.addmm(t.master, bcat, acat, out=t.weight)

    loop(*sels[0])
    torch.cuda.synchronize()
    it2 = iter(range(10**9))
    med = statistics.median(timed_ms(lambda: loop(*sels[next(it2) % 32]), 7))
    res["torch_addmm_loop_ms"] = med
    res["torch_addmm_loop_gbs"] = touched / (med * 1e-3) / 1e9
    for t in targets:
        t.weight.copy_(t.master)
    exact.cur_ids = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    res["speedup_vs_addmm_loop"] = med / res["fused_switch_exact_ms"]

    # Launch count for one switch.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dispatch.fused_switch(exact, *sels[1], config=best)
        torch.cuda.synchronize()
    res["launches_per_switch"] = sum(
        1 for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
    )  # fmt: skip

    # Drift: random switches, then back to the backbone.
    for name, table in (("exact", exact), ("delta", delta)):
        for _ in range(args.switches):
            dispatch.fused_switch(table, *sel(), config=best)
        dispatch.fused_unmerge(table, config=best)
        torch.cuda.synchronize()
        worst_abs = 0.0
        worst_ulp = 0.0
        identical = True
        for t in targets:
            d = (t.weight.float() - t.master.float()).abs()
            identical &= bool(torch.equal(t.weight, t.master))
            worst_abs = max(worst_abs, float(d.max()))
            # ulp of the largest magnitude the element can take while merged
            mag = t.master.float().abs() + d  # lower bound on what the element reached
            worst_ulp = max(worst_ulp, float((d / (mag.clamp(min=2**-126) * 2**-7)).max()))
        res[f"drift_{name}"] = {
            "switches": args.switches,
            "bit_identical": identical,
            "max_abs": worst_abs,
            "max_ulps_vs_own_magnitude": worst_ulp,
        }
        for t in targets:
            t.weight.copy_(t.master)

    # Router (one token) and gated SGMM on one 4096x4096 module.
    h = torch.randn(1, 4096, device=DEVICE, dtype=DT, generator=g)
    r_w = torch.randn(E, 4096, device=DEVICE, dtype=DT, generator=g) / 64
    r_b = torch.zeros(E, device=DEVICE, dtype=DT)
    dispatch.route(h, r_w, r_b, K_TOP)
    res["router_t1_us"] = 1e3 * statistics.median(
        timed_ms(lambda: dispatch.route(h, r_w, r_b, K_TOP), 50)
    )
    tgt = targets[0]
    for t_ in (16, 64):
        x = torch.randn(t_, 4096, device=DEVICE, dtype=DT, generator=g)
        out = torch.randn(t_, 4096, device=DEVICE, dtype=DT, generator=g)
        ids, gates = dispatch.route(x, r_w, r_b, K_TOP)

        def gated(x=x, out=out, ids=ids, gates=gates) -> None:  # type: ignore[no-untyped-def]
            dispatch.gated_add_lora(out, x, tgt.lora_a, tgt.lora_b, ids, gates, 2.0)

        gated()
        res[f"gated_sgmm_t{t_}_us"] = 1e3 * statistics.median(timed_ms(gated, 50))

        def gated_loop(x=x, out=out, ids=ids, gates=gates) -> None:  # type: ignore[no-untyped-def]
            for e in range(E):
                for j in range(K_TOP):
                    rows = (ids[:, j] == e).nonzero().flatten()
                    v = (x[rows] @ tgt.lora_a[e].T) * gates[rows, j : j + 1].to(DT)
                    out.index_add_(0, rows, v @ tgt.lora_b[e].T, alpha=2.0)

        gated_loop()
        res[f"gated_torch_loop_t{t_}_us"] = 1e3 * statistics.median(timed_ms(gated_loop, 20))
    res["bench_seconds"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("ADAFUSE", json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
