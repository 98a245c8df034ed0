"""Benchmark the SGMM add_lora (shrink + expand) on a CUDA GPU against torch baselines.

Shapes: H=4096, N in {4096, 14336}, r in {16, 64}, T in {16, 64, 256, 4096}, S in {1, 8, 64}
distinct adapters (tokens spread round-robin over the S slots), bf16. Every case rotates over
16 input sets (x, out, metadata) so L2 (60 MB) does not hold the activations between calls.

Reported per case: median µs for CUDA-graph replay and eager launch; the baselines measured in
the same run (per-adapter torch loop, gathered bmm, and for S=1 two torch.mm's: the roofline);
GB/s against the minimum bytes (x read once, out read and written once, each used adapter's A
and B read once) and that as a percentage of the device-to-device copy bandwidth measured at
the start of the run. Launches per add_lora are counted with the torch profiler.

``--sweep`` first times each op alone over a small candidate list per (T, r) (and N for the
expand), checks every candidate's result against an fp32 torch computation, picks one config
per (T bucket, rank bucket) (the expand's pick minimises the summed slowdown over both N), and
then times the cases with the picked configs: those picks are what the tables in
``kernels/sgmm_config.py`` hold. ``--trim`` times only the shapes behind the issue's targets:
S=1 for every (N, r, T) with torch.mm, T=4096 and T=64 at S=64 (the latter with the torch loop).

Usage: python3 bench/bench_sgmm.py --out results.json [--tune] [--quick] [--sweep] [--trim]
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import copy_bandwidth, time_graph, time_rotating

from adaptermesh.kernels import sgmm
from adaptermesh.kernels.meta import build_segment_meta
from adaptermesh.kernels.sgmm_config import SgmmConfig, expand_config, shrink_config

N_SETS = 16
DT = torch.bfloat16


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


# Candidates for --sweep: shrink (block_m, block_k, split_k, num_warps, num_stages), expand
# (block_m, block_n, num_warps, num_stages, prefetch_out), per token count.
SHRINK_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    16: [(16, 256, 1, 4, 3), (16, 128, 8, 4, 3), (16, 128, 16, 4, 3), (16, 128, 32, 4, 3),
         (16, 256, 8, 4, 3), (16, 256, 16, 4, 3), (16, 64, 32, 4, 3), (16, 64, 64, 4, 3)],
    64: [(16, 256, 1, 4, 3), (16, 128, 8, 4, 3), (16, 128, 16, 4, 3), (16, 128, 32, 4, 3),
         (16, 256, 8, 4, 3), (16, 256, 16, 4, 3), (32, 128, 16, 4, 3), (16, 64, 32, 4, 3)],
    256: [(32, 256, 1, 4, 3), (16, 128, 4, 4, 3), (16, 128, 8, 4, 3), (32, 128, 4, 4, 3),
          (32, 128, 8, 4, 3), (32, 256, 4, 4, 3), (64, 256, 4, 4, 3), (16, 256, 2, 4, 3)],
    4096: [(32, 256, 1, 4, 3), (64, 256, 1, 4, 3), (32, 128, 1, 4, 3), (64, 128, 1, 4, 4),
           (128, 128, 1, 8, 3), (64, 256, 1, 8, 3), (32, 256, 2, 4, 3)],
}  # fmt: skip
EXPAND_CANDIDATES: dict[int, list[tuple[int, int, int, int, bool]]] = {
    16: [(16, 128, 4, 2, False), (16, 128, 4, 2, True), (16, 64, 4, 2, True),
         (16, 256, 4, 2, True), (16, 64, 2, 2, True)],
    64: [(16, 128, 4, 2, False), (16, 128, 4, 2, True), (16, 64, 4, 2, True),
         (16, 256, 4, 2, True), (32, 128, 4, 2, True)],
    256: [(32, 128, 4, 2, False), (32, 128, 4, 2, True), (16, 128, 4, 2, True),
          (32, 256, 4, 2, True), (64, 128, 4, 2, True), (16, 256, 4, 2, True)],
    4096: [(64, 128, 4, 2, False), (64, 128, 4, 2, True), (64, 128, 8, 2, True),
           (64, 256, 8, 2, True), (128, 128, 8, 2, True), (32, 256, 4, 2, True)],
}  # fmt: skip


def _bn(r: int) -> int:
    return min(64, max(16, triton.next_power_of_2(r)))


def _shrink_cfg(c: tuple[int, int, int, int, int], r: int) -> SgmmConfig:
    return SgmmConfig(c[0], _bn(r), c[1], num_warps=c[3], num_stages=c[4], split_k=c[2])


def _expand_cfg(c: tuple[int, int, int, int, bool], r: int) -> SgmmConfig:
    return SgmmConfig(c[0], c[1], _bn(r), num_warps=c[2], num_stages=c[3], prefetch_out=c[4])


def _shrink_calls(case: Case, cfg: SgmmConfig) -> list[Callable[[], object]]:
    def mk(x, meta, v):  # type: ignore[no-untyped-def]
        return lambda: sgmm.sgmm_shrink(
            x, case.lora_a, case.ranks, meta, out=v, config=cfg, check_values=False
        )

    return [mk(x, meta, v) for x, _out, _slots, meta, v in case.sets]


def _expand_calls(case: Case, cfg: SgmmConfig) -> list[Callable[[], object]]:
    def mk(out, meta, v):  # type: ignore[no-untyped-def]
        return lambda: sgmm.sgmm_expand(
            out, v, case.lora_b, case.scales, case.ranks, meta, config=cfg, check_values=False
        )

    return [mk(out, meta, v) for _x, out, _slots, meta, v in case.sets]


def sweep(results: dict, out_path: str) -> dict[tuple[int, int], tuple[SgmmConfig, SgmmConfig]]:
    """Time each op alone per candidate (graph replay over the 16 input sets), check it, pick."""
    rows: list[dict] = []
    results["sweep"] = rows
    picks: dict[tuple[int, int], tuple[SgmmConfig, SgmmConfig]] = {}
    for t, r in itertools.product((16, 64, 256, 4096), (16, 64)):
        case = Case(t, 1, 4096, r, seed=100 + t + r)
        x0, _o, _sl, meta0, v0 = case.sets[0]
        want_v = x0.float() @ case.lora_a[0, 0].float().T
        for c in SHRINK_CANDIDATES[t]:
            cfg = _shrink_cfg(c, r)
            v0.fill_(float("nan"))
            sgmm.sgmm_shrink(x0, case.lora_a, case.ranks, meta0, out=v0, config=cfg)
            err = float((v0[0] - want_v).abs().max())
            us = time_graph(_shrink_calls(case, cfg), reps=5)
            rows.append({"op": "shrink", "t": t, "r": r, "cfg": list(c), "us": us, "max_err": err})
            print(f"SWEEP shrink T={t} r={r} {c} {us:.2f} us err {err:.2e}", flush=True)
        del case
        ok = [w for w in rows if w["op"] == "shrink" and (w["t"], w["r"]) == (t, r)]
        ok = [w for w in ok if w["max_err"] < 1e-2] or ok
        best_shrink = min(ok, key=lambda w: w["us"])
        exp_rows: dict[tuple, dict[int, float]] = {}
        for n in (4096, 14336):
            case = Case(t, 1, n, r, seed=200 + t + r + n)
            for x, _out, _slots, meta, v in case.sets:
                sgmm.sgmm_shrink(x, case.lora_a, case.ranks, meta, out=v)
            _x0, out0, _sl, meta0, v0 = case.sets[0]
            for c in EXPAND_CANDIDATES[t]:
                cfg = _expand_cfg(c, r)
                before = out0.clone()
                sgmm.sgmm_expand(out0, v0, case.lora_b, case.scales, case.ranks, meta0, config=cfg)
                delta = v0[0].to(DT).float() @ case.lora_b[0][0].float().T
                want = (before.float() + 0.5 * delta).to(DT).float()
                # Relative to the element: out grows by O(1) per timed call, and a bf16 ulp
                # grows with it.
                err = float(((out0.float() - want).abs() / (1 + want.abs())).max())
                us = time_graph(_expand_calls(case, cfg), reps=5)
                rows.append({"op": "expand", "t": t, "r": r, "n": n, "cfg": list(c), "us": us,
                             "max_err": err})  # fmt: skip
                print(f"SWEEP expand T={t} r={r} N={n} {c} {us:.2f} us err {err:.2e}", flush=True)
                if err < 0.03:
                    exp_rows.setdefault(c, {})[n] = us
            del case
            torch.cuda.empty_cache()
        full = {c: d for c, d in exp_rows.items() if len(d) == 2}
        if not full:  # nothing checked out: keep the first (current default) candidate
            full = {EXPAND_CANDIDATES[t][0]: {4096: float("nan"), 14336: float("nan")}}
        best_n = {n: min(d[n] for d in full.values()) for n in (4096, 14336)}
        best_expand = min(full, key=lambda c: sum(full[c][n] / best_n[n] for n in best_n))
        picks[(t, r)] = (_shrink_cfg(tuple(best_shrink["cfg"]), r), _expand_cfg(best_expand, r))
        pick = {"t": t, "r": r, "shrink": best_shrink["cfg"], "shrink_us": best_shrink["us"]}
        pick |= {"expand": list(best_expand), "expand_us": full[best_expand]}
        results.setdefault("picks", []).append(pick)
        print(f"PICK T={t} r={r} shrink {best_shrink['cfg']} expand {best_expand}", flush=True)
        Path(out_path).write_text(json.dumps(results, indent=1))
    return picks


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="pick configs per (T, r) first")
    ap.add_argument("--trim", action="store_true", help="only the shapes behind the targets")
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
    # Launch counts: one add_lora call, and 32 layers x 4 calls sharing one metadata build.
    c = Case(64, 8, 4096, 16, seed=5)
    _x, _out, slots, meta, _v = c.sets[0]
    results["launches_per_add_lora"] = count_launches(c.ours()[0])
    c16 = Case(16, 1, 4096, 64, seed=6)  # small T: the split-K shrink path
    results["launches_per_add_lora_split_path"] = count_launches(c16.ours()[0])
    results["launches_build_segment_meta"] = count_launches(
        lambda: build_segment_meta(slots, 8, out=meta, check_values=False)
    )
    results["build_segment_meta_us"] = time_rotating(
        [lambda: build_segment_meta(slots, 8, out=meta, check_values=False)]
    )
    picks = sweep(results, args.out) if args.sweep else {}
    shapes = list(itertools.product(ns, rs, ts, ss))
    if args.trim:
        shapes = [(n, r, t, s) for n, r, t, s in shapes if s == 1 or (s == 64 and t in (64, 4096))]
    rows: list[dict] = []
    results["cases"] = rows
    for n, r, t, s in shapes:
        case = Case(t, s, n, r, seed=t * 7 + s)
        row: dict = {"n": n, "r": r, "t": t, "s": s, "min_bytes": case.min_bytes()}
        cfgs = picks.get((t, r), (None, None))
        if args.sweep:
            row["shrink_cfg"] = cfgs[0].__dict__ if cfgs[0] else None
            row["expand_cfg"] = cfgs[1].__dict__ if cfgs[1] else None
        row["graph_us"] = time_graph(case.ours(*cfgs))
        row["eager_us"] = time_rotating(case.ours(*cfgs))
        loop = not args.trim or (s == 64 and t == 64)
        row["loop_us"] = time_rotating(case.torch_loop(), reps=5, passes=1) if loop else None
        gathered = t * r * (4096 + n) * 2
        row["bmm_us"] = (
            time_rotating(case.gathered_bmm(), reps=5, passes=1)
            if gathered < 2**31 and not args.trim
            else None
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
            f"{row['eager_us']:8.1f} loop {row['loop_us'] or float('nan'):9.1f} bmm "
            f"{row['bmm_us'] if row['bmm_us'] is not None else float('nan'):9.1f} "
            f"mm {row.get('mm_us', float('nan')):7.1f} GB/s {row['gbs']:6.0f} "
            f"({row['pct_copy_bw']:4.1f}%)",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(results, indent=1))
    # Targets.
    t1 = [r for r in rows if r["s"] == 64 and r["t"] == 64 and r["loop_us"]]
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
