"""Benchmark AdaFuse's fused_switch on a Llama-2-7B-shaped backbone (random bf16 weights).

32 layers x 7 targeted modules (q, k, v, o: 4096x4096; gate, up: 11008x4096; down:
4096x11008), 8 experts of rank 16 per module, top-2 selections. Measured in one run:

- fused_switch, exact mode (reads the pristine copy W0, writes W) and delta mode (reads and
  writes W): one launch for all 224 modules; median ms over random switches;
- baseline: a per-module torch loop, ``torch.addmm(W0, B_sel * g, A_sel, out=W)`` (224 addmm
  launches plus the small gathers);
- GB/s over the backbone bytes touched (read + write of every targeted weight) and as a share
  of the device-to-device copy bandwidth measured in the same run;
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
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adaptermesh.kernels import fuse

DT = torch.bfloat16
E, R, K_TOP = 8, 16, 2
LAYER = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]


def timed_ms(fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--switches", type=int, default=1000)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {
        "bench": "adafuse",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "model": f"Llama-2-7B shapes, {args.layers} layers x 7 modules, E={E}, r={R}, top-{K_TOP}",
    }
    n = 1 << 30
    bufs = [
        torch.empty(n, dtype=DT, device="cuda").normal_(),
        torch.empty(n, dtype=DT, device="cuda"),
    ]
    bufs[1].copy_(bufs[0])
    ms = statistics.median(timed_ms(lambda: bufs[1].copy_(bufs[0]), 20))
    bw = 2 * n * 2 / (ms * 1e-3) / 1e9
    res["copy_bandwidth_gbs"] = bw
    bufs.clear()

    targets = []
    for _ in range(args.layers):
        for nn_, kk in LAYER:
            w = torch.randn(nn_, kk, device="cuda", dtype=DT, generator=g) * 0.02
            la = torch.randn(E, R, kk, device="cuda", dtype=DT, generator=g) / kk**0.5
            lb = torch.randn(E, nn_, R, device="cuda", dtype=DT, generator=g) / R**0.5 * 0.02
            targets.append(fuse.MergeTarget(w, la, lb, scale=2.0, master=w.clone()))
    exact = fuse.build_merge_table(targets, exact=True)
    delta = fuse.build_merge_table(targets, exact=False)
    touched = exact.backbone_bytes()
    res["backbone_bytes_touched"] = touched
    res["modules"] = len(targets)
    res["tiles"] = exact.total_tiles

    def sel() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randperm(E, device="cuda", generator=g)[:K_TOP].to(torch.int32)
        gates = torch.softmax(torch.randn(K_TOP, device="cuda", generator=g), 0)
        return ids, gates

    sels = [sel() for _ in range(32)]
    for name, table in (("exact", exact), ("delta", delta)):
        fuse.fused_switch(table, *sels[0])  # compile
        torch.cuda.synchronize()
        it = iter(range(10**9))
        times = timed_ms(lambda t=table, it=it: fuse.fused_switch(t, *sels[next(it) % 32]), 15)
        med = statistics.median(times)
        res[f"fused_switch_{name}_ms"] = med
        res[f"fused_switch_{name}_gbs"] = touched / (med * 1e-3) / 1e9
        res[f"fused_switch_{name}_pct_copy_bw"] = 100 * touched / (med * 1e-3) / 1e9 / bw
        fuse.fused_unmerge(table)
    torch.cuda.synchronize()

    def loop(ids: torch.Tensor, gates: torch.Tensor) -> None:
        idx = ids.long()
        for t in targets:
            bsel = t.lora_b.index_select(0, idx) * (gates * t.scale).to(DT)[:, None, None]  # [k, N, r]
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
    exact.cur_ids = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    res["speedup_vs_addmm_loop"] = med / res["fused_switch_exact_ms"]

    # Launch count for one switch.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fuse.fused_switch(exact, *sels[1])
        torch.cuda.synchronize()
    res["launches_per_switch"] = sum(
        1 for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
    )  # fmt: skip

    # Drift: random switches, then back to the backbone.
    for name, table in (("exact", exact), ("delta", delta)):
        for _ in range(args.switches):
            fuse.fused_switch(table, *sel())
        fuse.fused_unmerge(table)
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
    h = torch.randn(1, 4096, device="cuda", dtype=DT, generator=g)
    router = fuse.AdaFuseRouter(4096, E, K_TOP, dtype=DT, device="cuda")
    router(h)
    res["router_t1_us"] = 1e3 * statistics.median(timed_ms(lambda: router(h), 50))
    tgt = targets[0]
    for t_ in (16, 64):
        x = torch.randn(t_, 4096, device="cuda", dtype=DT, generator=g)
        out = torch.randn(t_, 4096, device="cuda", dtype=DT, generator=g)
        ids, gates = fuse.route(x, router.weight, router.bias, K_TOP)

        def gated(x=x, out=out, ids=ids, gates=gates) -> None:  # type: ignore[no-untyped-def]
            fuse.gated_add_lora(out, x, tgt.lora_a, tgt.lora_b, ids, gates, 2.0)

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
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("ADAFUSE", json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
