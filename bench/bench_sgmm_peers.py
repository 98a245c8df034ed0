"""SGMM add_lora side by side with the peers' Triton multi-LoRA kernels (issue 13's table).

bf16, H = N = 4096, tokens spread evenly over S adapters in contiguous segments, a pool of
128 adapters (ranks 16, 64 or mixed 8/16/32/64, zero-padded to the largest), rotating input
sets (activations, metadata and the adapters they use) totalling at least 256 MB so L2 does
not hold them, times from CUDA-graph replay (median). Every implementation is checked against
an fp32 torch computation on the first set before it is timed; a failing one is reported and
not timed. Also: eager host cost per call, host time per metadata build, and the optional
INT4 and AdaFuse sections when those modules exist.

Peers come from ``bench/.peers`` (``python3 bench/sgmm_peers.py prepare``); without it they
are skipped and the JSON says so.

Usage: python3 bench/bench_sgmm_peers.py --out bench/results/sgmm_peers_h200.json
       [--peers DIR] [--quick] [--budget-s 220] | --selfcheck-cpu
"""

from __future__ import annotations

import os
import sys

if "--selfcheck-cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime as dt
import importlib
import inspect
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _timing import copy_bandwidth, time_graph
from sgmm_peers import PeerCase, load

from adaptermesh.kernels import sgmm
from adaptermesh.kernels.meta import build_segment_meta

DT = torch.bfloat16
POOL = 128
SCALE = 0.5
MIN_ROTATE = 256 << 20
MAX_SETS = 512
MIXED = (8, 16, 32, 64)

# (rank spec, T, S, target µs) exactly as issue 13's table.
CASES: list[tuple[Any, int, int, float]] = [
    (16, 16, 1, 7.5), (16, 16, 16, 11.5), (16, 64, 8, 8.6), (16, 64, 64, 18.2),
    (16, 256, 64, 19.0), (16, 4096, 1, 37.0), (16, 4096, 64, 49.0), (64, 64, 64, 50.0),
    (64, 256, 64, 46.6), (64, 4096, 1, 42.9), (64, 4096, 64, 131.0),
    ("mixed", 64, 64, 33.6), ("mixed", 256, 64, 34.3), ("mixed", 4096, 64, 107.0),
]  # fmt: skip
QUICK = {(16, 16, 1), (16, 64, 64), (16, 4096, 64), ("mixed", 256, 64)}


def case_name(r: Any, t: int, s: int) -> str:
    return f"r{r}_T{t}_S{s}"


class Case:
    """One table row: pools of adapters and rotating input sets."""

    def __init__(
        self,
        r: Any,
        t: int,
        s: int,
        *,
        h: int = 4096,
        n: int = 4096,
        device: str = "cuda",
        dtype: torch.dtype = DT,
        pool: int = POOL,
        n_sets: int | None = None,
        seed: int = 0,
    ) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.r, self.t, self.s, self.h, self.n, self.pool = r, t, s, h, n, pool
        ranks = [MIXED[i % 4] for i in range(pool)] if r == "mixed" else [int(r)] * pool
        self.rmax = max(ranks)
        self.ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
        self.scales = torch.full((pool,), SCALE, device=device)
        s_used = min(s, t)
        self.s_used = s_used
        used_ranks = [ranks[i] for i in range(s_used)]
        # Minimum bytes: x read, out read + written, each used adapter's A and B read once.
        e = torch.finfo(dtype).bits // 8
        if r == "mixed":  # used adapters' ranks depend on the set; take the pool's mean
            mean_r = sum(ranks) / pool
            ad = s_used * mean_r * (h + n) * e
        else:
            ad = sum(used_ranks) * (h + n) * e
        self.min_bytes = int(e * (t * h + 2 * t * n) + ad)
        if n_sets is None:
            n_sets = min(MAX_SETS, max(8, math.ceil(MIN_ROTATE / self.min_bytes)))
        self.n_sets = n_sets
        per_pool = max(1, pool // max(1, s_used))
        self.n_pools = max(1, min(8, math.ceil(n_sets / per_pool)))
        mask = torch.arange(self.rmax, device=device)[None, :] < self.ranks[:, None]
        self.a, self.b = [], []
        for _ in range(self.n_pools):
            a = torch.randn(pool, self.rmax, h, device=device, generator=g) / h**0.5
            b = torch.randn(pool, n, self.rmax, device=device, generator=g) / self.rmax**0.5
            self.a.append((a * mask[:, :, None]).to(dtype).contiguous())
            self.b.append((b * mask[:, None, :]).to(dtype).contiguous())
        self.sets: list[dict[str, Any]] = []
        for i in range(n_sets):
            p = i % self.n_pools
            off = ((i // self.n_pools) * s_used) % pool
            used = [(off + j) % pool for j in range(s_used)]
            slots = torch.tensor(
                [used[k * s_used // t] for k in range(t)], dtype=torch.int32, device=device
            )
            x = torch.randn(t, h, device=device, generator=g).to(dtype)
            out = torch.randn(t, n, device=device, generator=g).to(dtype)
            meta = build_segment_meta(slots, pool)
            v = torch.empty(1, t, self.rmax, device=device, dtype=torch.float32)
            self.sets.append(dict(pool=p, slots=slots, x=x, out=out, meta=meta, v=v))
        self.out0 = self.sets[0]["out"].clone()

    def rotating_bytes(self) -> int:
        return self.n_sets * self.min_bytes

    def reference(self) -> torch.Tensor:
        st = self.sets[0]
        a, b = self.a[st["pool"]].float(), self.b[st["pool"]].float()
        idx = st["slots"].long()
        x = st["x"].float()
        v = torch.einsum("th,trh->tr", x, a[idx])
        return self.out0.float() + SCALE * torch.einsum("tr,tnr->tn", v, b[idx])

    def segments(self, st: dict[str, Any]) -> list[tuple[int, int, int]]:
        sl = st["slots"].tolist()
        segs: list[list[int]] = []
        for i, v in enumerate(sl):
            if i == 0 or v != sl[i - 1]:
                segs.append([i, 0, v])
            segs[-1][1] += 1
        return [(a, b, c) for a, b, c in segs]

    # -- implementations: each returns one callable per input set --
    def ours(self, hint: bool = True, pdl: bool | None = None) -> list[Callable[[], None]]:
        """add_lora told the batch's distinct adapters (``active_slots``, which the scheduler
        knows when it builds the batch); ``hint=False``: the worst case it assumes otherwise
        (every pool slot active), as a graph captured once for any mix does. ``pdl=False``:
        the expand as a plain launch instead of a programmatic dependent one."""
        active = self.s_used if hint else None

        def mk(st: dict[str, Any]) -> Callable[[], None]:
            a, b = self.a[st["pool"]].unsqueeze(0), (self.b[st["pool"]],)
            return lambda: sgmm.add_lora(
                st["out"], st["x"], a, b, self.scales, self.ranks, st["meta"],
                v_buffer=st["v"], active_slots=active, check_values=False, pdl=pdl,
            )  # fmt: skip

        return [mk(st) for st in self.sets]

    def peer(self, build: Callable[[PeerCase], Callable[[], None]]) -> list[Callable[[], None]]:
        return [build(PeerCase(x=st["x"], out=st["out"], a=self.a[st["pool"]],
                               b=self.b[st["pool"]], slots=st["slots"], ranks=self.ranks,
                               scale=SCALE)) for st in self.sets]  # fmt: skip

    def torch_mm(self) -> list[Callable[[], None]]:
        def mk(st: dict[str, Any]) -> Callable[[], None]:
            ((_, _, s),) = self.segments(st)
            a, b = self.a[st["pool"]][s], self.b[st["pool"]][s]
            return lambda: st["out"].addmm_(st["x"] @ a.T, b.T, alpha=SCALE)

        return [mk(st) for st in self.sets]

    def torch_loop(self) -> list[Callable[[], None]]:
        def mk(st: dict[str, Any]) -> Callable[[], None]:
            segs = self.segments(st)
            a, b = self.a[st["pool"]], self.b[st["pool"]]
            x, out = st["x"], st["out"]

            def run() -> None:
                for s0, ln, s in segs:
                    out[s0 : s0 + ln].addmm_(x[s0 : s0 + ln] @ a[s].T, b[s].T, alpha=SCALE)

            return run

        return [mk(st) for st in self.sets]

    def torch_bmm(self) -> list[Callable[[], None]]:
        def mk(st: dict[str, Any]) -> Callable[[], None]:
            idx = st["slots"].long()
            a, b = self.a[st["pool"]], self.b[st["pool"]]
            x, out = st["x"], st["out"]

            def run() -> None:
                v = torch.bmm(a.index_select(0, idx), x.unsqueeze(2))
                out.add_(torch.bmm(b.index_select(0, idx), v).squeeze(2), alpha=SCALE)

            return run

        return [mk(st) for st in self.sets]


def check(
    case: Case, fns: list[Callable[[], None]], ref: torch.Tensor | None = None
) -> tuple[bool, float, str | None]:
    """Run set 0 once from a fresh ``out`` and compare with fp32 torch (``ref``: another
    expected result, e.g. from dequantised weights)."""
    st = case.sets[0]
    st["out"].copy_(case.out0)
    try:
        fns[0]()
    except Exception as e:
        return False, float("nan"), f"{type(e).__name__}: {e}"[:400]
    if ref is None:
        ref = case.reference()
    err = (st["out"].float() - ref).abs().max().item()
    tol = 2e-2 * max(1.0, ref.abs().max().item())
    st["out"].copy_(case.out0)
    ok = err <= tol
    return ok, err, None if ok else f"max error {err:.3g} > {tol:.3g}"


def impls(case: Case, peers: dict[str, Any]) -> dict[str, Callable[[], list[Callable[[], None]]]]:
    out: dict[str, Callable[[], list[Callable[[], None]]]] = {
        "ours": case.ours,
        "ours_no_hint": lambda: case.ours(hint=False),
        "ours_no_pdl": lambda: case.ours(pdl=False),
    }
    for name, p in peers.items():
        out[name] = lambda b=p.build: case.peer(b)
    if case.s_used == 1:
        out["torch_mm"] = case.torch_mm
    else:
        out["torch_loop"] = case.torch_loop
        if case.t <= 256:
            out["torch_bmm"] = case.torch_bmm
    return out


def run_case(case: Case, peers: dict[str, Any], bw: float | None) -> dict[str, Any]:
    row: dict[str, Any] = dict(r=case.r, t=case.t, s=case.s, h=case.h, n=case.n,
                               pool=case.pool, n_sets=case.n_sets, n_pools=case.n_pools,
                               rotating_mb=case.rotating_bytes() / 2**20,
                               min_bytes=case.min_bytes, impls={})  # fmt: skip
    for name, mk in impls(case, peers).items():
        rec: dict[str, Any] = {}
        try:
            fns = mk()
        except Exception as e:
            row["impls"][name] = {"ok": False, "error": f"build: {type(e).__name__}: {e}"[:400]}
            continue
        ok, err, msg = check(case, fns)
        rec.update(ok=ok, max_err=err)
        if not ok:
            rec["error"] = msg
        elif bw is not None:
            try:
                us = time_graph(fns)
                gbs = case.min_bytes / (us * 1e-6) / 1e9
                rec.update(us=us, gb_s=gbs, pct_copy_bw=100 * gbs / bw)
            except Exception as e:
                rec["error"] = f"timing: {type(e).__name__}: {e}"[:400]
        row["impls"][name] = rec
        del fns
    peer_us = [v["us"] for k, v in row["impls"].items() if k in peers and "us" in v]
    row["best_peer_us"] = min(peer_us) if peer_us else None
    return row


def host_cost(peers: dict[str, Any], calls: int = 300) -> dict[str, Any]:
    """CPU µs per eager call on a small shape (the GPU is not the bottleneck)."""
    case = Case(16, 16, 4, h=512, n=512, n_sets=1, seed=3)
    st = case.sets[0]
    fns: dict[str, Callable[[], None]] = {"ours": case.ours()[0]}
    fns["ours_plan"] = sgmm.plan_add_lora(
        st["out"],
        st["x"],
        case.a[0].unsqueeze(0),
        (case.b[0],),
        case.scales,
        case.ranks,
        st["meta"],
        v_buffer=st["v"],
        check_values=False,
    )
    for name, p in peers.items():
        try:
            fns[name] = case.peer(p.build)[0]
        except Exception as e:
            print(f"host cost: {name} not built ({e})")
    fns["torch_loop"] = case.torch_loop()[0]
    res: dict[str, Any] = {}
    for name, f in fns.items():
        try:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            best = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                best.append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
            res[name] = min(best)
        except Exception as e:
            res[name] = f"{type(e).__name__}: {e}"[:200]
    return res


def metadata_cost(t: int = 256, s: int = 64, calls: int = 300) -> float:
    """Host µs per build_segment_meta into preallocated buffers (one per step)."""
    slots = torch.tensor([k * s // t for k in range(t)], dtype=torch.int32, device="cuda")
    meta = build_segment_meta(slots, POOL)
    for _ in range(10):
        build_segment_meta(slots, POOL, out=meta, check_values=False)
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            build_segment_meta(slots, POOL, out=meta, check_values=False)
        best.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return min(best)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_nbytes(o) for o in vars(obj).values())
    return 0


def int4_section(cases: list[Case], bw: float | None) -> dict[str, Any]:
    """INT4 adapters vs bf16, when adaptermesh.kernels.sgmm_int4 exists."""
    try:
        q = importlib.import_module("adaptermesh.kernels.sgmm_int4")
        quant = importlib.import_module("adaptermesh.kernels.int4_quant")
    except ImportError as e:
        return {"skipped": f"no adaptermesh.kernels.sgmm_int4 ({e})"}
    if not (hasattr(quant, "quantize_lora") and hasattr(q, "add_lora_int4")):
        return {"skipped": "int4_quant lacks quantize_lora or sgmm_int4 add_lora_int4"}
    sig = str(inspect.signature(q.add_lora_int4))
    res: dict[str, Any] = {"add_lora_int4_signature": sig, "cases": []}
    group = 128
    for case in cases:
        if case.t > 256:
            continue
        row: dict[str, Any] = {"name": case_name(case.r, case.t, case.s)}
        try:
            # The pool's layout: A grouped along H, B along N (quantize_lora).
            pairs = [
                quant.quantize_lora(a.unsqueeze(0), (b,), group)
                for a, b in zip(case.a, case.b, strict=True)
            ]
            qa = [p[0] for p in pairs]
            qb = [p[1][0] for p in pairs]
            row["bytes_int4"] = _nbytes(qa[0]) + _nbytes(qb[0])
            row["bytes_bf16"] = _nbytes(case.a[0]) + _nbytes(case.b[0])

            def mk(
                st: dict[str, Any], qa: Any = qa, qb: Any = qb, case: Case = case
            ) -> Callable[[], None]:
                return lambda: q.add_lora_int4(
                    st["out"],
                    st["x"],
                    qa[st["pool"]],
                    (qb[st["pool"]],),
                    case.scales,
                    case.ranks,
                    st["meta"],
                    v_buffer=st["v"],
                    active_slots=case.s,
                    check_values=False,
                )  # the batch's adapters, as ``ours`` is told

            fns = [mk(st) for st in case.sets]
            # Expected: the same sum over the dequantised pool (the quantisation error itself
            # is the tests' concern, tests/kernels/test_sgmm_int4.py).
            st0 = case.sets[0]
            da = quant.dequantize_int4(qa[st0["pool"]])[0]
            db = quant.dequantize_int4(qb[st0["pool"]])
            idx = st0["slots"].long()
            v = torch.einsum("th,trh->tr", st0["x"].float(), da[idx])
            ref = case.out0.float() + SCALE * torch.einsum("tr,tnr->tn", v, db[idx])
            ok, err, msg = check(case, fns, ref)
            row.update(ok=ok, max_err=err, error=msg)
            # The quantisation error itself: INT4 result against the bf16 adapters' exact sum,
            # beside the size of the LoRA term it perturbs.
            st0["out"].copy_(case.out0)
            fns[0]()
            exact = case.reference()
            diff = (st0["out"].float() - exact).abs()
            term = (exact - case.out0.float()).abs()
            row.update(err_vs_bf16_max=diff.max().item(), err_vs_bf16_mean=diff.mean().item(),
                       lora_term_mean_abs=term.mean().item())  # fmt: skip
            st0["out"].copy_(case.out0)
            if ok and bw is not None:
                row["us_int4"] = time_graph(fns)
                row["us_bf16"] = time_graph(case.ours())
                row["ratio"] = row["us_int4"] / row["us_bf16"]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        res["cases"].append(row)
    sized = [c for c in res["cases"] if c.get("bytes_int4")]
    if sized:
        res["adapters_per_gb_ratio"] = sized[0]["bytes_bf16"] / sized[0]["bytes_int4"]
    return res


def adafuse_section() -> dict[str, Any]:
    try:
        m = importlib.import_module("bench_adafuse")
    except Exception as e:
        return {"skipped": f"bench_adafuse not importable ({type(e).__name__}: {e})"}
    fn = getattr(m, "fused_switch_figures", None)
    if fn is None:
        return {"skipped": "bench_adafuse has no fused_switch_figures()"}
    try:
        return dict(fn())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def selfcheck_cpu(peers_dir: Path) -> int:
    """Tiny shapes under TRITON_INTERPRET=1: ours and every peer against fp32 torch."""
    peers, errors = load(peers_dir)
    print("peer load errors:", errors or "none")
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        for r in (16, "mixed"):
            case = Case(r, 5, 3, h=64, n=64, device="cpu", dtype=dtype, pool=4, n_sets=2)
            for name, mk in impls(case, peers).items():
                try:
                    ok, err, msg = check(case, mk())
                except Exception as e:
                    ok, err, msg = False, float("nan"), f"{type(e).__name__}: {e}"[:300]
                print(f"{dtype!s:15} r={r!s:5} {name:14} ok={ok} max_err={err:.3g} {msg or ''}")
                bad += (not ok) and dtype == torch.bfloat16
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sgmm_peers_h200.json")
    ap.add_argument("--peers", type=Path, default=HERE / ".peers")
    ap.add_argument("--quick", action="store_true", help="four cases only")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=220.0,
        help="stop adding cases once this many seconds have passed",
    )
    ap.add_argument(
        "--selfcheck-cpu",
        action="store_true",
        help="tiny shapes under the Triton interpreter, no GPU",
    )
    args = ap.parse_args()
    if args.selfcheck_cpu:
        sys.exit(selfcheck_cpu(args.peers))
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --selfcheck-cpu)")
    t_start = time.monotonic()
    peers, peer_errors = load(args.peers)
    peer_sources: dict[str, Any] = {}
    if (args.peers / "SOURCES.json").exists():
        src = json.loads((args.peers / "SOURCES.json").read_text())
        peer_sources = {
            k: {"commit": v.get("commit"), "version": v.get("version"), "files": v.get("files")}
            for k, v in src.items()
        }
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s; peers {sorted(peers)}; errors {peer_errors}")
    results: dict[str, Any] = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), date=dt.datetime.now(dt.UTC).isoformat(),
        command=" ".join([sys.executable, *sys.argv]), dtype="bf16", pool=POOL,
        copy_bw_gb_s=bw, peers=sorted(peers), peer_errors=peer_errors,
        peer_sources=peer_sources, cases=[], skipped=[],
    )  # fmt: skip
    if not peers:
        results["peers_note"] = f"no peers loaded from {args.peers}: peers skipped"
    targets: dict[str, Any] = {}
    small: list[Case] = []
    for r, t, s, target in CASES:
        name = case_name(r, t, s)
        if args.quick and (r, t, s) not in QUICK:
            continue
        if time.monotonic() - t_start > args.budget_s:
            results["skipped"].append(name)
            targets[name] = {"value": None, "target": target, "met": False, "skipped": True}
            continue
        case = Case(r, t, s)
        row = run_case(case, peers, bw)
        row["name"] = name
        results["cases"].append(row)
        us = row["impls"]["ours"].get("us")
        targets[name] = {"value": us, "target": target, "met": us is not None and us <= target}
        print(
            name,
            {
                k: round(v["us"], 1) if "us" in v else v.get("error")
                for k, v in row["impls"].items()
            },
            flush=True,
        )
        if t <= 256:  # INT4 is timed against bf16 on every case of T <= 256
            small.append(case)
        else:
            del case
            torch.cuda.empty_cache()
    hc = host_cost(peers)
    results["host_cost_us"] = hc
    # The eager call with prebuilt arguments (plan_add_lora) is what the target asks for; the
    # plain add_lora (checks and config choice on every call) is reported beside it.
    for key, impl in (("host_cost_us", "ours_plan"), ("host_cost_plain_add_lora_us", "ours")):
        v = hc.get(impl) if isinstance(hc.get(impl), float) else None
        targets[key] = {
            "value": v,
            "target": 30.0,
            "met": v is not None and v <= 30.0,
            "impl": impl,
        }
    md = metadata_cost()
    results["metadata_us"] = md
    targets["metadata_us"] = {"value": md, "target": 50.0, "met": md <= 50.0}
    i4 = int4_section(small, bw)
    results["int4"] = i4
    for c in i4.get("cases", []):
        targets[f"int4_ratio_{c['name']}"] = {
            "value": c.get("ratio"),
            "target": 1.0,
            "met": c.get("ratio") is not None and c["ratio"] <= 1.0,
        }
    if "adapters_per_gb_ratio" in i4:
        v = i4["adapters_per_gb_ratio"]
        targets["int4_adapters_per_gb_ratio"] = {"value": v, "target": 3.5, "met": v >= 3.5}
    af = adafuse_section()
    results["adafuse"] = af
    if "pct_copy_bw" in af:
        targets["adafuse_pct_copy_bw"] = {
            "value": af["pct_copy_bw"],
            "target": 70.0,
            "met": af["pct_copy_bw"] >= 70.0,
        }
    results["targets"] = targets
    results["wall_s"] = time.monotonic() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(targets, indent=1, default=str))
    print(f"wrote {args.out} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
