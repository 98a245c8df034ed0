"""Benchmark the SGMM add_lora (shrink + expand) on a CUDA GPU against torch baselines.

Shapes: H=4096, N in {4096, 14336}, r in {16, 64}, T in {16, 64, 256, 4096}, S in {1, 8, 64}
distinct adapters (tokens spread round-robin over the S slots), bf16. Every case rotates over
16 input sets (x, out, metadata) so L2 (60 MB) does not hold the activations between calls.

Reported per case: median µs for CUDA-graph replay and eager launch; the baselines measured in
the same run (per-adapter torch loop, gathered bmm, and for S=1 two torch.mm's: the roofline);
GB/s against the minimum bytes (x read once, out read and written once, each used adapter's A
and B read once) and that as a percentage of the device-to-device copy bandwidth measured at
the start of the run. Launches per add_lora are counted with the torch profiler.

Usage: python3 bench/bench_sgmm.py --out results.json [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adaptermesh.kernels import build_segment_meta, sgmm
from adaptermesh.kernels.sgmm import SgmmConfig, expand_config, shrink_config

N_SETS = 16
DT = torch.bfloat16


def time_rotating(fns: list[Callable[[], object]], reps: int = 7, passes: int = 3) -> float:
    """Median over reps of the mean µs per call, cycling through the input sets."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        for _ in range(passes):
            for f in fns:
                f()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (passes * len(fns)))
    return statistics.median(out)


def time_graph(fns: list[Callable[[], object]], reps: int = 7, replays: int = 3) -> float:
    """µs per call when the calls over all input sets are captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    return statistics.median(out)


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s counting bytes read plus written (2 GiB buffers)."""
    n = 1 << 30
    a = torch.empty(n, dtype=DT, device="cuda").normal_()
    b = torch.empty_like(a)
    us = time_rotating([lambda: b.copy_(a)], reps=10, passes=5)
    return 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e9


def count_launches(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
    )


class Case:
    def __init__(self, t: int, s: int, n: int, r: int, h: int = 4096, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.t, self.s, self.n, self.r, self.h = t, s, n, r, h
        self.lora_a = torch.randn(1, s, r, h, device="cuda", dtype=DT, generator=g) / h**0.5
        self.lora_b = (torch.randn(s, n, r, device="cuda", dtype=DT, generator=g) / r**0.5,)
        self.scales = torch.full((s,), 0.5, device="cuda")
        self.ranks = torch.full((s,), r, dtype=torch.int32, device="cuda")
        self.sets = []
        for i in range(N_SETS):
            x = torch.randn(t, h, device="cuda", dtype=DT, generator=g)
            out = torch.randn(t, n, device="cuda", dtype=DT, generator=g)
            perm = torch.randperm(t, device="cuda", generator=g)
            slots = (perm % s).to(torch.int32)
            meta = build_segment_meta(slots, s)
            v = torch.empty(1, t, r, device="cuda", dtype=torch.float32)
            self.sets.append((x, out, slots, meta, v))
            del i
        self.used = min(s, t)

    def min_bytes(self) -> int:
        e = 2  # bf16
        return e * (self.t * self.h + 2 * self.t * self.n + self.used * self.r * (self.h + self.n))

    def ours(self, shrink_cfg: SgmmConfig | None = None, expand_cfg: SgmmConfig | None = None):
        def mk(x, out, slots, meta, v):  # type: ignore[no-untyped-def]
            return lambda: sgmm.add_lora(
                out, x, self.lora_a, self.lora_b, self.scales, self.ranks, meta,
                v_buffer=v, shrink_cfg=shrink_cfg, expand_cfg=expand_cfg, check_values=False,
            )  # fmt: skip

        return [mk(*st) for st in self.sets]

    def torch_loop(self):
        a, b = self.lora_a[0], self.lora_b[0]

        def mk(x, out, slots, meta, v):  # type: ignore[no-untyped-def]
            groups = [(s, (slots == s).nonzero().flatten()) for s in range(self.s)]
            groups = [(s, idx) for s, idx in groups if idx.numel()]

            def run() -> None:
                for s, idx in groups:
                    xs = x.index_select(0, idx)
                    y = (xs @ a[s].T) @ b[s].T
                    out.index_add_(0, idx, y, alpha=0.5)

            return run

        return [mk(*st) for st in self.sets]

    def gathered_bmm(self):
        a, b = self.lora_a[0], self.lora_b[0]

        def mk(x, out, slots, meta, v):  # type: ignore[no-untyped-def]
            idx = slots.long()

            def run() -> None:
                ga = a.index_select(0, idx)  # [T, r, H]
                gb = b.index_select(0, idx)  # [T, N, r]
                vv = torch.bmm(ga, x.unsqueeze(2))  # [T, r, 1]
                out.add_(torch.bmm(gb, vv).squeeze(2), alpha=0.5)

            return run

        return [mk(*st) for st in self.sets]

    def torch_mm(self):
        a, b = self.lora_a[0, 0], self.lora_b[0][0]

        def mk(x, out, slots, meta, v):  # type: ignore[no-untyped-def]
            return lambda: out.addmm_(x @ a.T, b.T, alpha=0.5)

        return [mk(*st) for st in self.sets]


def tune(results: dict) -> None:
    """Sweep tile sizes for shrink and expand on representative shapes."""
    rows = []
    for t, s, n, r in [(64, 64, 14336, 16), (4096, 1, 14336, 16), (16, 1, 4096, 16)]:
        case = Case(t, s, n, r, seed=1)
        for bm, bk, st in itertools.product((16, 32, 64), (128, 256), (3,)):
            cfg = SgmmConfig(bm, min(64, max(16, triton.next_power_of_2(r))), bk, 4, st)
            us = time_graph(case.ours(shrink_cfg=cfg, expand_cfg=expand_config(t, n, r)), reps=3)
            rows.append({"op": "shrink+default_expand", "t": t, "s": s, "n": n, "r": r,
                         "block_m": bm, "block_k": bk, "stages": st, "us": us})  # fmt: skip
        for bm, bn, w in [*itertools.product((16, 32, 64), (64, 128, 256), (4,)), (64, 128, 8)]:
            cfg = SgmmConfig(bm, bn, min(64, max(16, triton.next_power_of_2(r))), w, 2)
            us = time_graph(case.ours(shrink_cfg=shrink_config(t, 4096, r), expand_cfg=cfg), reps=3)
            rows.append({"op": "default_shrink+expand", "t": t, "s": s, "n": n, "r": r,
                         "block_m": bm, "block_n": bn, "warps": w, "us": us})  # fmt: skip
        del case
        torch.cuda.empty_cache()
    results["tuning"] = rows
    for key in ("shrink+default_expand", "default_shrink+expand"):
        for shape in {(r["t"], r["s"], r["n"], r["r"]) for r in rows if r["op"] == key}:
            sel = [r for r in rows if r["op"] == key and (r["t"], r["s"], r["n"], r["r"]) == shape]
            best = min(sel, key=lambda r: r["us"])
            print(f"TUNE {key} {shape}: best {best}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results: dict = {
        "bench": "sgmm",
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "dtype": "bfloat16",
        "input_sets": N_SETS,
    }
    bw = copy_bandwidth()
    results["copy_bandwidth_gbs"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s")
    if args.tune:
        tune(results)
    ts = (16, 64, 256, 4096)
    ss = (1, 8, 64)
    ns = (4096, 14336)
    rs = (16, 64)
    if args.quick:
        ts, ss, ns, rs = (64, 4096), (1, 64), (4096,), (16,)
    rows = []
    for n, r, t, s in itertools.product(ns, rs, ts, ss):
        case = Case(t, s, n, r, seed=t * 7 + s)
        row: dict = {"n": n, "r": r, "t": t, "s": s, "min_bytes": case.min_bytes()}
        row["graph_us"] = time_graph(case.ours())
        row["eager_us"] = time_rotating(case.ours())
        row["loop_us"] = time_rotating(case.torch_loop(), reps=5, passes=1)
        gathered = t * r * (4096 + n) * 2
        row["bmm_us"] = (
            time_rotating(case.gathered_bmm(), reps=5, passes=1) if gathered < 2**31 else None
        )
        if s == 1:
            row["mm_us"] = time_rotating(case.torch_mm())
            row["mm_graph_us"] = time_graph(case.torch_mm())
        row["gbs"] = row["min_bytes"] / (row["graph_us"] * 1e-6) / 1e9
        row["pct_copy_bw"] = 100 * row["gbs"] / bw
        rows.append(row)
        del case
        torch.cuda.empty_cache()
        print(
            f"N={n:5d} r={r:2d} T={t:4d} S={s:2d} graph {row['graph_us']:8.1f} eager "
            f"{row['eager_us']:8.1f} loop {row['loop_us']:9.1f} bmm "
            f"{row['bmm_us'] if row['bmm_us'] is not None else float('nan'):9.1f} "
            f"mm {row.get('mm_us', float('nan')):7.1f} GB/s {row['gbs']:6.0f} "
            f"({row['pct_copy_bw']:4.1f}%)",
            flush=True,
        )
    results["cases"] = rows
    # Launch counts: one add_lora call, and 32 layers x 4 calls sharing one metadata build.
    c = Case(64, 8, 4096, 16, seed=5)
    _x, _out, slots, meta, _v = c.sets[0]
    results["launches_per_add_lora"] = count_launches(c.ours()[0])
    results["launches_build_segment_meta"] = count_launches(
        lambda: build_segment_meta(slots, 8, out=meta, check_values=False)
    )
    results["build_segment_meta_us"] = time_rotating(
        [lambda: build_segment_meta(slots, 8, out=meta, check_values=False)]
    )
    # Targets.
    t1 = [r for r in rows if r["s"] == 64 and r["t"] == 64]
    t2 = [r for r in rows if r["s"] == 1 and "mm_us" in r]
    t3 = [r for r in rows if r["t"] == 4096]
    results["targets"] = {
        "s64_t64_speedup_vs_loop_min": min(
            (r["loop_us"] / r["graph_us"] for r in t1), default=None
        ),
        "s64_t64_speedup_vs_loop_eager_min": min(
            (r["loop_us"] / r["eager_us"] for r in t1), default=None
        ),
        "s1_ratio_vs_mm_graph_max": max(
            (r["graph_us"] / r["mm_graph_us"] for r in t2), default=None
        ),
        "s1_ratio_vs_mm_eager_max": max((r["eager_us"] / r["mm_us"] for r in t2), default=None),
        "t4096_pct_copy_bw_min": min((r["pct_copy_bw"] for r in t3), default=None),
        "launches_per_add_lora": results["launches_per_add_lora"],
    }
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("TARGETS", json.dumps(results["targets"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
