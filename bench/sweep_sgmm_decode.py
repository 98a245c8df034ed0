"""Sweep add_lora configs on the shapes the engine runs: per module group, per batch shape.

The engine applies LoRA per layer as four add_lora calls on a Llama-2-7B shape: qkv (H=4096,
three 4096-wide slices), o (4096 -> 4096), gate_up (4096 -> two 11008-wide slices) and down
(11008 -> 4096). Each is timed here for batch shapes (T tokens over S distinct adapters, one
pool of ``--pool`` slots) from decode (one token per adapter) to prefill-like, with every
candidate of two families:

- two launches: each shrink candidate with the best expand, each expand candidate with the
  best shrink (for both ops: tensor-core tiles and the matrix-vector kernels) (the ops are timed alone and their
  times add);
- the current defaults of ``kernels/sgmm_config.py`` (what add_lora picks by itself).

Inputs rotate over enough layers of adapter pools and activations that at least 256 MB are
touched per pass, so neither the adapters nor the activations sit in L2 (a real step reads
every layer's adapters from HBM). Times are CUDA-graph replay, median of 5. Every candidate is
checked against an fp32 torch computation before it is timed; a failing one is recorded and
never picked. ``picks`` per (T bucket, density, rank bucket) minimise the summed time over the
four module groups: these are what the tables in ``kernels/sgmm_config.py`` hold.

Usage: python3 bench/sweep_sgmm_decode.py --out sweep.json [--budget-s 200] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import copy_bandwidth, run_header, time_graph

from adaptermesh.kernels import sgmm, sgmm_config
from adaptermesh.kernels.meta import build_segment_meta
from adaptermesh.kernels.sgmm_config import SgmmConfig

DT = torch.bfloat16
GROUPS = {
    "qkv": (4096, (4096, 4096, 4096)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}
# (T, S distinct adapters); the pool has --pool slots either way.
SHAPES = [(1, 1), (16, 16), (16, 1), (64, 64), (64, 8), (64, 1), (256, 64), (256, 256), (1024, 64)]
SHRINK = [  # sgmm_config.ShrinkTile fields, in order
    (16, 256, 1, 4, 3, 0), (16, 256, 4, 4, 3, 0), (16, 256, 8, 4, 3, 0), (32, 256, 4, 4, 3, 0),
    (16, 256, 1, 4, 5, 0), (16, 256, 4, 4, 5, 0), (32, 256, 4, 4, 5, 0), (16, 128, 8, 4, 5, 0),
    # matrix-vector: block_m tokens and gemv_rows rank rows per program, block_k of H per step
    (1, 512, 1, 4, 2, 4), (1, 1024, 1, 4, 2, 2), (1, 256, 1, 4, 3, 8), (2, 512, 1, 4, 2, 4),
    (1, 512, 1, 8, 2, 16), (4, 256, 1, 4, 2, 2),
]  # fmt: skip
EXPAND = [  # sgmm_config.ExpandTile fields, in order (block_m, block_n, ..., n_blocks, gemv)
    (16, 256, 4, 2, True, 1, False), (16, 256, 4, 2, True, 2, False),
    (16, 256, 4, 3, True, 4, False), (16, 128, 4, 3, True, 4, False),
    (1, 256, 4, 2, False, 1, True), (1, 512, 4, 2, False, 1, True),
    (1, 256, 4, 3, False, 4, True), (1, 1024, 8, 2, False, 1, True),
    (2, 512, 4, 2, False, 1, True), (4, 512, 8, 2, False, 1, True),
]  # fmt: skip
# Hoisted v (whole rank in one tile, loaded once per program; one product per column block),
# an optional 8th field; and long-batch tiles, tried from T >= 1024 only.
EXPAND_HOIST = [
    (16, 256, 4, 3, False, 4, False, True), (32, 256, 4, 3, False, 4, False, True),
    (16, 512, 8, 3, False, 2, False, True),
]  # fmt: skip
EXPAND_LARGE = [
    (64, 128, 4, 3, False, 8, False, True), (64, 256, 8, 3, False, 4, False, True),
    (128, 128, 8, 3, False, 4, False, True), (32, 128, 4, 4, False, 8, False, True),
    (64, 128, 4, 2, False, 1, False), (64, 256, 8, 2, True, 1, False),
    (64, 128, 8, 3, False, 8, False, True), (64, 128, 4, 4, False, 8, False, True),
    (64, 64, 4, 3, False, 16, False, True), (32, 256, 8, 3, False, 4, False, True),
    (128, 64, 8, 3, False, 8, False, True),
]  # fmt: skip
SHRINK_LARGE = [
    (64, 128, 1, 4, 4, 0), (64, 256, 1, 8, 3, 0), (128, 64, 1, 4, 4, 0), (128, 128, 1, 8, 3, 0),
    (32, 128, 1, 4, 5, 0), (64, 64, 1, 4, 5, 0),
    (16, 512, 2, 4, 3, 0), (16, 512, 4, 8, 3, 0), (32, 512, 2, 8, 3, 0), (16, 256, 2, 4, 6, 0),
    (16, 128, 4, 4, 6, 0), (32, 256, 2, 8, 4, 0),
]  # fmt: skip
# One launch (shrink + expand fused): (block_m, block_n, block_k, n_blocks, num_warps,
# num_stages); n_blocks column blocks of block_n per program, block_k of H per shrink step.
FUSED = [
    (16, 64, 256, 1, 4, 3), (16, 128, 256, 1, 4, 3), (16, 256, 128, 1, 4, 3),
    (16, 128, 512, 1, 8, 2), (16, 256, 128, 4, 4, 3), (16, 256, 128, 16, 4, 3),
    (32, 256, 128, 16, 8, 3), (32, 128, 64, 32, 4, 3), (64, 256, 64, 16, 8, 3),
    (16, 128, 128, 32, 4, 4), (32, 256, 64, 8, 8, 3), (16, 512, 128, 8, 8, 3),
]  # fmt: skip
# Ranks other than the first are swept on these shapes only.
SHAPES_OTHER_RANKS = [(16, 1), (64, 64), (256, 64), (4096, 1)]
TARGET_BYTES = 256 << 20


class Setup:
    """Rotating sets for one (group, T, S, r): each set has its own pool layer and inputs."""

    def __init__(self, group: str, t: int, s: int, r: int, pool: int, seed: int) -> None:
        h, sizes = GROUPS[group]
        self.group, self.t, self.s, self.r, self.h, self.sizes = group, t, s, r, h, sizes
        g = torch.Generator(device="cuda").manual_seed(seed)
        ns = len(sizes)
        used = min(s, t)
        self.min_bytes = 2 * (t * h + 2 * t * sum(sizes) + used * r * (h * ns + sum(sizes)))
        # Enough sets that one pass touches TARGET_BYTES; the sets draw their adapters from
        # LAYERS pool layers (like a real step's layers), at random slots.
        self.n_sets = max(4, min(64, math.ceil(TARGET_BYTES / self.min_bytes)))
        layers = min(self.n_sets, 4)
        pools = []
        for _ in range(layers):
            a = torch.randn(ns, pool, r, h, device="cuda", dtype=DT, generator=g) / h**0.5
            b = tuple(torch.randn(pool, n, r, device="cuda", dtype=DT, generator=g) / r**0.5
                      for n in sizes)  # fmt: skip
            pools.append((a, b))
        self.sets = []
        for i in range(self.n_sets):
            a, b = pools[i % layers]
            x = torch.randn(t, h, device="cuda", dtype=DT, generator=g)
            out = torch.randn(t, sum(sizes), device="cuda", dtype=DT, generator=g)
            chosen = torch.randperm(pool, device="cuda", generator=g)[:s]
            slots = chosen[torch.arange(t, device="cuda") % s].to(torch.int32)
            meta = build_segment_meta(slots, pool)
            v = torch.empty(ns, t, r, device="cuda", dtype=torch.float32)
            self.sets.append((a, b, x, out, meta, v))
        self.scales = torch.full((pool,), 0.5, device="cuda")
        self.ranks = torch.full((pool,), r, dtype=torch.int32, device="cuda")

    def want(self) -> torch.Tensor:
        a, b, x, out, meta, _v = self.sets[0]
        slots = meta.token_slots[: self.t].long()
        res = out.float().clone()
        col = 0
        for i, n in enumerate(self.sizes):
            v = torch.einsum("th,trh->tr", x.float(), a[i][slots].float())
            d = torch.einsum("tr,tnr->tn", v.to(DT).float(), b[i][slots].float())
            res[:, col : col + n] += 0.5 * d
            col += n
        return res

    def error(self, fn: Callable[[tuple], object]) -> float:  # type: ignore[type-arg]
        out = self.sets[0][3]
        want = self.want()
        saved = out.clone()
        fn(self.sets[0])
        err = float(((out.float() - want).abs() / (1 + want.abs())).max())
        out.copy_(saved)
        return err

    def calls(self, fn: Callable[[tuple], object]) -> list[Callable[[], object]]:  # type: ignore[type-arg]
        return [lambda st=st: fn(st) for st in self.sets]

    def shrink_fn(self, cfg: SgmmConfig) -> Callable[[tuple], object]:  # type: ignore[type-arg]
        return lambda st: sgmm.sgmm_shrink(
            st[2], st[0], self.ranks, st[4], out=st[5], config=cfg, check_values=False
        )

    def expand_fn(self, cfg: SgmmConfig) -> Callable[[tuple], object]:  # type: ignore[type-arg]
        return lambda st: sgmm.sgmm_expand(
            st[3], st[5], st[1], self.scales, self.ranks, st[4], config=cfg, check_values=False
        )

    def pair_fn(self, sc: SgmmConfig, ec: SgmmConfig) -> Callable[[tuple], object]:  # type: ignore[type-arg]
        return lambda st: sgmm.add_lora(
            st[3], st[2], st[0], st[1], self.scales, self.ranks, st[4], v_buffer=st[5],
            shrink_cfg=sc, expand_cfg=ec, check_values=False,
        )  # fmt: skip

    def default_fn(
        self,
        active: int | None = None,
        pdl: bool | None = None,
        sc: SgmmConfig | None = None,
        ec: SgmmConfig | None = None,
    ) -> Callable[[tuple], object]:  # type: ignore[type-arg]
        return lambda st: sgmm.add_lora(
            st[3], st[2], st[0], st[1], self.scales, self.ranks, st[4], v_buffer=st[5],
            active_slots=active, check_values=False, pdl=pdl, shrink_cfg=sc, expand_cfg=ec,
        )  # fmt: skip

    def fused_fn(self, cfg: SgmmConfig) -> Callable[[tuple], object]:  # type: ignore[type-arg]
        return lambda st: sgmm.add_lora(
            st[3], st[2], st[0], st[1], self.scales, self.ranks, st[4], v_buffer=st[5],
            fused_cfg=cfg, check_values=False,
        )  # fmt: skip


def _bn(r: int) -> int:
    return min(64, max(16, triton.next_power_of_2(r)))


def run_case(setup: Setup, results: list[dict], quick: bool) -> dict:
    row: dict = {"group": setup.group, "t": setup.t, "s": setup.s, "r": setup.r}
    # Shrink alone, with the default expand's buffer filled once.
    shrink_us: dict[tuple, float] = {}
    large = setup.t >= 1024
    for c in SHRINK[:4] + SHRINK[8:10] if quick else SHRINK + (SHRINK_LARGE if large else []):
        if c[5]:
            cfg = SgmmConfig(c[0], c[5], c[1], num_warps=c[3], num_stages=c[4], gemv=True)
        else:
            cfg = SgmmConfig(c[0], _bn(setup.r), c[1], num_warps=c[3], num_stages=c[4],
                             split_k=c[2])  # fmt: skip
        ec = sgmm_config.expand_config(setup.t, max(setup.sizes), setup.r)
        err = setup.error(setup.pair_fn(cfg, ec))
        if err > 0.03:
            results.append({**row, "kind": "shrink", "cfg": list(c), "err": err, "us": None})
            continue
        shrink_us[c] = time_graph(setup.calls(setup.shrink_fn(cfg)))
        results.append({**row, "kind": "shrink", "cfg": list(c), "err": err, "us": shrink_us[c]})
    expand_us: dict[tuple, float] = {}
    for c in EXPAND[:4] if quick else EXPAND + EXPAND_HOIST + (EXPAND_LARGE if large else []):
        cfg = _expand_cfg(c, setup.r)
        sc = sgmm_config.shrink_config(setup.t, setup.h, setup.r)
        err = setup.error(setup.pair_fn(sc, cfg))
        if err > 0.03:
            results.append({**row, "kind": "expand", "cfg": list(c), "err": err, "us": None})
            continue
        expand_us[c] = time_graph(setup.calls(setup.expand_fn(cfg)))
        results.append({**row, "kind": "expand", "cfg": list(c), "err": err, "us": expand_us[c]})
    default_err = setup.error(setup.default_fn(setup.s))
    default_us = time_graph(setup.calls(setup.default_fn(setup.s)))
    best = {
        "shrink": min(shrink_us.items(), key=lambda kv: kv[1]) if shrink_us else None,
        "expand": min(expand_us.items(), key=lambda kv: kv[1]) if expand_us else None,
    }
    two = (best["shrink"][1] + best["expand"][1]) if best["shrink"] and best["expand"] else None
    # The default pair with and without the expand as a programmatic dependent launch, and
    # the best shrink + best expand timed together both ways (their overlap is not a sum).
    nopdl_us = time_graph(setup.calls(setup.default_fn(setup.s, pdl=False)))
    pair_us: dict[str, float] = {}
    if best["shrink"] and best["expand"]:
        sc = _shrink_cfg(best["shrink"][0], setup.r)
        ec = _expand_cfg(best["expand"][0], setup.r)
        for pdl in (False, True):
            pair_us["pdl" if pdl else "plain"] = time_graph(
                setup.calls(setup.default_fn(setup.s, pdl=pdl, sc=sc, ec=ec))
            )
    fused_us: dict[tuple, float] = {}
    for c in (FUSED[:4] if quick else FUSED) if setup.r <= sgmm_config.FUSED_MAX_RANK else []:
        cfg = SgmmConfig(c[0], c[1], c[2], n_blocks=c[3], num_warps=c[4], num_stages=c[5],
                         fused=True)  # fmt: skip
        err = setup.error(setup.fused_fn(cfg))
        if err > 0.03:
            results.append({**row, "kind": "fused", "cfg": list(c), "err": err, "us": None})
            continue
        fused_us[c] = time_graph(setup.calls(setup.fused_fn(cfg)))
        results.append({**row, "kind": "fused", "cfg": list(c), "err": err, "us": fused_us[c]})
    best["fused"] = min(fused_us.items(), key=lambda kv: kv[1]) if fused_us else None
    return {
        "shrink_us": shrink_us, "expand_us": expand_us, "best": best,
        "two_launch_us": two, "default_us": default_us, "default_err": default_err,
        "default_nopdl_us": nopdl_us, "pair_us": pair_us,
    }  # fmt: skip


def _shrink_cfg(c: tuple, r: int) -> SgmmConfig:  # type: ignore[type-arg]
    if c[5]:
        return SgmmConfig(c[0], c[5], c[1], num_warps=c[3], num_stages=c[4], gemv=True)
    return SgmmConfig(c[0], _bn(r), c[1], num_warps=c[3], num_stages=c[4], split_k=c[2])


def _expand_cfg(c: tuple, r: int) -> SgmmConfig:  # type: ignore[type-arg]
    hoist = len(c) > 7 and c[7]
    bk = max(16, triton.next_power_of_2(r)) if c[6] or hoist else _bn(r)
    return SgmmConfig(c[0], c[1], bk, num_warps=c[2], num_stages=c[3], prefetch_out=c[4],
                      n_blocks=c[5], gemv=c[6], hoist_v=hoist)  # fmt: skip


def host_costs() -> dict:
    """CPU µs to issue one call (median of 5 bursts of 200 calls, timed before the sync), on a
    small decode shape so the GPU is never the bottleneck."""
    setup = Setup("qkv", 16, 16, 16, 128, seed=5)
    a, b, x, out, meta, v = setup.sets[0]
    slots = meta.token_slots[:16].clone()

    def burst(fn: Callable[[], object], n: int = 200) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        return statistics.median(times)

    res: dict = {}
    res["add_lora_us"] = burst(
        lambda: sgmm.add_lora(out, x, a, b, setup.scales, setup.ranks, meta, v_buffer=v,
                              check_values=False))  # fmt: skip
    plan = sgmm.plan_add_lora(out, x, a, b, setup.scales, setup.ranks, meta, v_buffer=v,
                              check_values=False)  # fmt: skip
    res["plan_us"] = burst(plan)
    res["segment_meta_triton_us"] = burst(
        lambda: build_segment_meta(slots, 128, 16, out=meta, check_values=False)
    )
    res["segment_meta_torch_us"] = burst(
        lambda: build_segment_meta(slots, 128, 16, out=meta, check_values=False,
                                   use_triton=False))  # fmt: skip
    return res


def _r1(d: dict) -> dict:  # type: ignore[type-arg]
    return {k: round(v, 1) for k, v in d.items()}


def _t_bucket(t: int) -> int:
    return next(b for b in sgmm_config.T_BUCKETS if t <= b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", type=int, default=128, help="pool slots (default 128)")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--shapes", default=None, help="TxS list for the first rank, e.g. 1x1,64x64 (default: all)"
    )
    ap.add_argument("--groups", default=None, help="module groups, e.g. qkv,gate_up (default: all)")
    ap.add_argument(
        "--shapes-other",
        default=None,
        help="TxS list for the other ranks (default: 16x1,64x64,256x64,4096x1)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results: dict = {
        **run_header(), "copy_gbps": copy_bandwidth(), "pool": args.pool, "candidates": [], "cases": [],
        "skipped": [],
    }  # fmt: skip
    print(f"copy bandwidth {results['copy_gbps']:.0f} GB/s", flush=True)
    results["host"] = host_costs()
    print(f"HOST {results['host']}", flush=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in ts.split("x")) for ts in args.shapes.split(",")]
    groups = list(GROUPS) if not args.groups else args.groups.split(",")
    order = [(t, s, ranks[0]) for (t, s) in shapes]
    other = SHAPES_OTHER_RANKS
    if args.shapes_other:
        other = [tuple(int(v) for v in ts.split("x")) for ts in args.shapes_other.split(",")]
    order += [(t, s, r) for r in ranks[1:] for (t, s) in other]
    for t, s, r in order:
        for group in groups:
            if time.monotonic() - t0 > args.budget_s:
                results["skipped"].append([group, t, s, r])
                continue
            setup = Setup(group, t, s, r, max(args.pool, s), seed=t * 7 + s + r)
            res = run_case(setup, results["candidates"], args.quick)
            b = res["best"]
            case = {
                "group": group, "t": t, "s": s, "r": r, "n_sets": setup.n_sets,
                "min_bytes": setup.min_bytes,
                "best_shrink": list(b["shrink"][0]) if b["shrink"] else None,
                "best_shrink_us": b["shrink"][1] if b["shrink"] else None,
                "best_expand": list(b["expand"][0]) if b["expand"] else None,
                "best_expand_us": b["expand"][1] if b["expand"] else None,
                "two_launch_us": res["two_launch_us"], "default_us": res["default_us"],
                "default_err": res["default_err"], "default_nopdl_us": res["default_nopdl_us"],
                "pair_us": res["pair_us"],
                "best_fused": list(b["fused"][0]) if b["fused"] else None,
                "best_fused_us": b["fused"][1] if b["fused"] else None,
            }  # fmt: skip
            best_us = case["two_launch_us"] or res["default_us"]
            case["best_pct_copy_bw"] = (
                100 * setup.min_bytes / (best_us * 1e-6) / 1e9 / results["copy_gbps"]
            )
            case["default_pct_copy_bw"] = (
                100 * setup.min_bytes / (res["default_us"] * 1e-6) / 1e9 / results["copy_gbps"]
            )
            results["cases"].append(case)
            print(f"CASE {group:7s} T={t:4d} S={s:3d} r={r:2d}: default {res['default_us']:.1f} us, "
                  f"two {case['two_launch_us'] and round(case['two_launch_us'], 1)} "
                  f"({case['best_shrink']} + {case['best_expand']}); no-pdl "
                  f"{res['default_nopdl_us']:.1f}, pair {_r1(res['pair_us'])}, fused "
                  f"{case['best_fused_us'] and round(case['best_fused_us'], 1)} "
                  f"{case['best_fused']}", flush=True)  # fmt: skip
            del setup
            torch.cuda.empty_cache()
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    # Picks per (T bucket, density, rank bucket): candidate with the least summed time over the
    # module groups and shapes of that key.
    picks: dict[str, dict] = {}
    keyed: dict[tuple, list[dict]] = {}
    for row in results["candidates"]:
        if row["us"] is None:
            continue
        dens = sgmm_config.density_bucket(row["t"], row["s"])
        key = (_t_bucket(row["t"]), dens, "low" if row["r"] <= 32 else "high", row["kind"])
        keyed.setdefault(key, []).append(row)
    for key, rows in keyed.items():
        per_cfg: dict[tuple, dict[tuple, float]] = {}
        for row in rows:
            per_cfg.setdefault(tuple(row["cfg"]), {})[(row["group"], row["t"], row["s"])] = row[
                "us"
            ]
        n_cases = max(len(v) for v in per_cfg.values())
        full = {c: v for c, v in per_cfg.items() if len(v) == n_cases}
        best_cfg = min(full, key=lambda c: sum(full[c].values()))
        picks["/".join(map(str, key))] = {"cfg": list(best_cfg), "sum_us": sum(full[best_cfg].values()),
                                          "cases": n_cases}  # fmt: skip
    results["picks"] = picks
    for k, v in sorted(picks.items()):
        print(f"PICK {k}: {v}", flush=True)
    results["elapsed_s"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
