"""Sweep the INT4 add_lora's shrink and expand configs beside the bf16 defaults.

Cases: the peers bench's T <= 256 cases (H = N = 4096, T tokens over S adapters of a pool of
128, rank 16 or 64), on the decode sweep's rotating sets (``sweep_sgmm_decode.Setup``: >= 256
MB touched per pass, CUDA-graph replay), the pools quantised with ``quantize_lora`` (group 64).
For each case: the bf16 add_lora as the engine calls it (told the batch's adapters), the INT4
add_lora with the tables' configs, each INT4 shrink candidate alone and each INT4 expand
candidate alone (tiles and matrix-vector kernels), and the best pair timed together. Every
candidate is checked against the twin on the same packed pool before it is timed.

Usage: python3 bench/sweep_sgmm_int4.py --out sweep_int4.json [--budget-s 150]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import run_header, time_graph
from sweep_sgmm_decode import Setup

from adaptermesh.kernels import int4_quant, reference, sgmm_int4
from adaptermesh.kernels.sgmm_config import SgmmConfig

CASES = [(16, 16, 1), (16, 16, 16), (16, 64, 8), (16, 64, 64), (16, 256, 64), (64, 64, 64),
         (64, 256, 64)]  # (r, T, S)  # fmt: skip
SHRINK = [  # (block_m, block_n (rank rows for gemv), block_k, split_k, warps, stages, gemv)
    (16, 16, 256, 4, 4, 3, False), (16, 16, 128, 8, 4, 3, False), (16, 16, 512, 4, 4, 3, False),
    (1, 2, 1024, 1, 4, 2, True), (1, 4, 512, 1, 4, 2, True), (2, 4, 512, 1, 4, 2, True),
    (1, 8, 256, 1, 4, 3, True), (4, 2, 256, 1, 4, 2, True), (1, 16, 512, 1, 8, 2, True),
    (16, 64, 256, 4, 4, 3, False), (16, 64, 128, 8, 4, 3, False), (32, 64, 256, 2, 4, 3, False),
]  # fmt: skip
EXPAND = [  # (block_m, block_n, warps, stages, n_blocks, gemv)
    (16, 256, 4, 2, 1, False), (16, 128, 4, 3, 4, False), (16, 64, 4, 3, 4, False),
    (1, 256, 4, 2, 1, True), (1, 512, 4, 2, 1, True), (1, 256, 4, 3, 4, True),
    (2, 512, 4, 2, 1, True), (4, 512, 8, 2, 1, True), (1, 128, 4, 3, 8, True),
    (16, 256, 8, 3, 2, False), (32, 128, 4, 3, 4, False),
]  # fmt: skip


class Int4Setup:
    def __init__(self, base: Setup) -> None:
        self.base = base
        self.q: dict[int, tuple] = {}  # type: ignore[type-arg]
        for a, b, *_ in base.sets:
            if id(a) not in self.q:
                qa, qb = int4_quant.quantize_lora(a, b, 64)
                self.q[id(a)] = (qa, qb)

    def packed(self, st: tuple) -> tuple:  # type: ignore[type-arg]
        return self.q[id(st[0])]

    def want(self) -> torch.Tensor:
        st = self.base.sets[0]
        qa, qb = self.packed(st)
        want = st[3].clone()
        reference.add_lora_int4_ref(want, st[2], qa, qb, self.base.scales, self.base.ranks, st[4])
        return want.float()

    def error(self, fn: Callable[[tuple], object]) -> float:  # type: ignore[type-arg]
        st = self.base.sets[0]
        want = self.want()
        saved = st[3].clone()
        fn(st)
        err = float(((st[3].float() - want).abs() / (1 + want.abs())).max())
        st[3].copy_(saved)
        return err

    def add(self, sc: SgmmConfig | None = None, ec: SgmmConfig | None = None) -> Callable:  # type: ignore[type-arg]
        b = self.base

        def fn(st: tuple) -> None:  # type: ignore[type-arg]
            qa, qb = self.packed(st)
            sgmm_int4.add_lora_int4(st[3], st[2], qa, qb, b.scales, b.ranks, st[4],
                                    v_buffer=st[5], active_slots=b.s, shrink_cfg=sc,
                                    expand_cfg=ec, check_values=False)  # fmt: skip

        return fn

    def shrink(self, cfg: SgmmConfig) -> Callable:  # type: ignore[type-arg]
        b = self.base
        return lambda st: sgmm_int4.sgmm_shrink_int4(
            st[2], self.packed(st)[0], b.ranks, st[4], out=st[5], config=cfg, check_values=False
        )

    def expand(self, cfg: SgmmConfig) -> Callable:  # type: ignore[type-arg]
        b = self.base
        return lambda st: sgmm_int4.sgmm_expand_int4(
            st[3], st[5], self.packed(st)[1], b.scales, b.ranks, st[4], config=cfg,
            check_values=False,
        )  # fmt: skip


def _sc(c: tuple) -> SgmmConfig:  # type: ignore[type-arg]
    return SgmmConfig(c[0], c[1], c[2], split_k=c[3], num_warps=c[4], num_stages=c[5], gemv=c[6])


def _ec(c: tuple, r: int) -> SgmmConfig:  # type: ignore[type-arg]
    bk = max(16, triton.next_power_of_2(r)) if c[5] else max(32, min(64, triton.next_power_of_2(r)))
    return SgmmConfig(c[0], c[1], bk, num_warps=c[2], num_stages=c[3], n_blocks=c[4], gemv=c[5])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    res: dict = {**run_header(), "cases": [], "skipped": []}
    for r, t, s in CASES:
        if time.monotonic() - t0 > args.budget_s:
            res["skipped"].append([r, t, s])
            continue
        base = Setup("o", t, s, r, 128, seed=t * 7 + s + r)
        q = Int4Setup(base)
        row: dict = {"r": r, "t": t, "s": s, "shrink": [], "expand": []}
        row["bf16_us"] = time_graph(base.calls(base.default_fn(s)))
        row["int4_default_err"] = q.error(q.add())
        row["int4_default_us"] = time_graph(base.calls(q.add()))
        # v from the default INT4 shrink fills the buffers the expand candidates read.
        for st in base.sets:
            q.add()(st)
        best: dict[str, tuple] = {}  # type: ignore[type-arg]
        for kind, cands, mk, timed in (
            ("shrink", SHRINK, _sc, q.shrink),
            ("expand", EXPAND, lambda c, r=r: _ec(c, r), q.expand),
        ):
            for c in cands:
                cfg = mk(c)
                pair = q.add(sc=cfg) if kind == "shrink" else q.add(ec=cfg)
                try:
                    err = q.error(pair)
                    us = time_graph(base.calls(timed(cfg))) if err <= 0.03 else None
                except Exception as e:  # a config the kernels refuse (e.g. a rank too wide)
                    row[kind].append({"cfg": list(c), "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                row[kind].append({"cfg": list(c), "err": err, "us": us})
                if us is not None and (kind not in best or us < best[kind][1]):
                    best[kind] = (cfg, us, c)
        if "shrink" in best and "expand" in best:
            pair = q.add(sc=best["shrink"][0], ec=best["expand"][0])
            row["best_pair"] = [list(best["shrink"][2]), list(best["expand"][2])]
            row["best_pair_err"] = q.error(pair)
            row["best_pair_us"] = time_graph(base.calls(pair))
            row["best_ratio"] = row["best_pair_us"] / row["bf16_us"]
        row["default_ratio"] = row["int4_default_us"] / row["bf16_us"]
        res["cases"].append(row)
        print(f"CASE r={r} T={t} S={s}: bf16 {row['bf16_us']:.1f} us, int4 default "
              f"{row['int4_default_us']:.1f} ({row['default_ratio']:.2f}x), best pair "
              f"{row.get('best_pair_us', 0):.1f} ({row.get('best_ratio', 0):.2f}x) "
              f"{row.get('best_pair')}", flush=True)  # fmt: skip
        del base, q
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    res["elapsed_s"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
