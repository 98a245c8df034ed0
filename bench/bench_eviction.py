"""Adapter eviction benchmark: hit rate, loads per second and decode throughput per policy.

Traces (seeded, ``--requests`` requests each, 1,000 adapters ``a0000``..``a0999``):

* ``zipf-<s>``: independent requests, adapter i with probability proportional to 1/(i+1)^s,
  for s in 0.6, 0.8, 1.0, 1.2 (ranks shuffled once so names carry no order).
* ``bursty``: a Markov-modulated hot set. 48 hot adapters (three quarters of the 64 slots)
  take 85% of requests (uniformly among them); the other 15% are Zipf(0.8) over all 1,000.
  Phases last an exponentially distributed number of requests (mean 5,000); at each phase
  change half of the hot set is replaced by adapters drawn uniformly from the rest.
* ``scan``: Zipf(1.0) with a scan every 2,000 requests: 200 adapters never requested before
  in this trace, once each, in a row (a batch job touching its tenants' adapters once).
* ``bursty-scan``: the condition the design's figure (LRU 68%) describes, calibrated to it. A
  stable hot set of 60 adapters (it fits the 64 slots with 4 to spare) served in rotation: each
  round requests every hot adapter once, ordered by the adapter's fixed phase plus a uniform
  jitter of +-1/4 round (steady tenants, as a fair-share scheduler serves backlogged tenants in
  turn). Bursts interrupt the rotation: 8 distinct cold adapters in a row, drawn uniformly
  from the other 940 (a batch job or crawler sweeping adapters; one-off within a burst, a cold
  adapter recurs about once in 117 bursts). The knob is the burst rate: an exponentially
  distributed number of hot requests between bursts, mean ``mean_gap``.
  Calibrated once (``BURSTY_SCAN_MEAN_GAP``, see there): the grid value whose LRU hit rate,
  averaged over three calibration seeds that are not the bench's seed, is nearest 0.68. The
  bench re-runs that search every time and records it (``calibration`` in the JSON) with
  whether it still picks the constant; the reported row uses the constant on ``--seed``.
  The shape (60 hot, bursts of 8, jitter, rotation) was fixed before the calibration by one
  criterion on LRU and Belady only: at LRU 0.68 the offline optimum must stay clearly above
  0.90, or the 0.90 target would again be out of reach by construction. A rotation meets it:
  a burst that overflows the 4 spare slots evicts, under LRU, the hot adapters next in the
  rotation, and each of their misses evicts the next one. With hot requests drawn
  independently (as in ``bursty``) LRU loses only about one hot request per cold one, and
  LRU at 0.68 leaves the optimum below 0.90; the JSON records that variant
  (``calibration.bursty-scan-independent``: the same search, with its LRU and Belady).
* (Each trace row also records ``sim_us_per_request``: host microseconds per simulated request,
  both tiers' policy bookkeeping included, the simulator's own set updates too.)
* Working-set sweep (the no-thrash-collapse check): W distinct adapters, W in 32 .. 1,000:
  ``sweep-zipf`` (Zipf 0.8 over the W) and ``sweep-loop`` (rounds over all W, each round in
  a fresh random order: the pattern where LRU collapses once W exceeds the slots).

Simulation. Two tiers as in ``AdapterManager``: ``--slots`` GPU slots (64) in front of a CPU
cache of ``--cpu-adapters`` adapters (256; the adapters all have one size, so a count stands
for the byte budget), each with its own instance of the policy, fed exactly as the manager
feeds it: every request is an access on the GPU policy; a GPU miss is an access on the CPU
policy and a load from the CPU cache (CPU hit) or from disk. Every slot is evictable (the
trace has no notion of in-flight requests; pinned and busy slots are the manager's rule, which
the policies' tests cover). Belady's offline-optimal GPU hit rate is reported beside the
policies as the ceiling.

Cost model, constants MEASURED in this run on ``--device`` (never typed in):

* ``load_cpu_s``: ``AdapterManager`` loading a rank-16 adapter (q, k, v, o) whose packed
  weights are in the CPU cache into a GPU slot (reserve with eviction, copy, verify, commit):
  median over on-demand loads.
* ``load_disk_s``: the same from the adapter's files on disk (OS page cache warm: the files
  were just written).
* ``step_s``: one decode step of the engine at batch ``--batch`` with resident adapters:
  (wall(T2) - wall(T1)) / ((tokens(T2) - tokens(T1)) / batch) for runs of T1 and T2 tokens per
  request, the minimum over ``--step-repeats`` repeats (other work on a shared host only adds).

Each request decodes ``--tokens-per-request`` tokens; the engine decodes ``--batch`` rows per
step. For a trace of R requests with m_cpu CPU-hit loads and m_disk disk loads:

    tokens = R * tokens_per_request,    steps = tokens / batch
    throughput (serial)  = tokens / (steps * step_s + m_cpu * load_cpu_s + m_disk * load_disk_s)
    throughput (overlap) = tokens / max(steps * step_s, m_cpu * load_cpu_s + m_disk * load_disk_s)

"serial" is the figure used for targets: a load's copy competes with decoding for the device
and the host, and the request that waits on it contributes nothing meanwhile. "overlap" is
the bound if loads hid entirely behind decoding (the manager loads off the event loop).
Loads per second: GPU misses per second at the modelled serial throughput, and at a fixed
offered load of ``--request-rate`` requests per second.

Targets (in the JSON): (1) hit rate >= 0.90 on ``bursty`` (the figure the design reports for
LRU-Greedy), and the same on ``bursty-scan`` (the trace calibrated to the design's LRU 0.68);
(2) no thrash collapse on both sweeps: between adjacent working-set sizes
(each step at most 1.5x) throughput never drops by more than 50%, and at every size it stays
at least half of the throughput Belady's hit rate would give.

Usage:
  python bench/bench_eviction.py --out bench/results/eviction_cpu.json            (CPU, tiny model)
  python bench/bench_eviction.py --device cuda --shape llama7b --out bench/results/eviction_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import heapq
import itertools
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import ATTN, SHAPE_7B, SHAPE_TINY, random_weights, write_adapter

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.eviction import DEFAULT_POLICY, POLICY_NAMES, make_policy
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import make_model_config, make_tokenizer

N_ADAPTERS = 1000
SWEEP = (32, 48, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1000)
ZIPF_S = (0.6, 0.8, 1.0, 1.2)

# bursty-scan: the shape, fixed before calibration (see the module docstring).
BURSTY_SCAN_HOT = 60  # hot adapters: the hot set fits the 64 slots with 4 to spare
BURSTY_SCAN_BURST = 8  # distinct cold adapters per burst: twice the spare slots
BURSTY_SCAN_JITTER = 0.5  # width of the rotation's uniform jitter, in rounds (+-1/4 round)
# The knob, calibrated once: mean hot requests between bursts. Chosen by
# ``calibrate_bursty_scan`` (LRU hit rate, mean over CALIBRATION_SEEDS, 60,000 requests each,
# 64 slots, 256-adapter CPU tier, grid CALIBRATION_GRID): nearest 0.68 at mean_gap = 100
# (LRU 0.670; 90 gives 0.648, 110 gives 0.691; burst share 7.6%; Belady 0.928 there). The
# bench re-runs this search and records whether it still picks this value
# (``calibration.bursty-scan.reproduced``).
BURSTY_SCAN_MEAN_GAP = 100
BURSTY_SCAN_TARGET_LRU = 0.68  # the design's LRU hit rate under bursty access
CALIBRATION_SEEDS = (101, 102, 103)  # never the bench's --seed (default 7)
CALIBRATION_REQUESTS = 60_000
CALIBRATION_GRID = tuple(range(10, 201, 10))


def log(msg: str) -> None:
    print(f"[bench_eviction {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- traces ----------------------------------------------------------------------------------


def _names(n: int) -> list[str]:
    return [f"a{i:04d}" for i in range(n)]


def _zipf_sampler(keys: list[str], s: float, rng: random.Random) -> Any:
    order = list(keys)
    rng.shuffle(order)
    cum = []
    total = 0.0
    for i in range(len(order)):
        total += 1.0 / (i + 1) ** s
        cum.append(total)

    def draw(k: int) -> list[str]:
        return rng.choices(order, cum_weights=cum, k=k)

    return draw


def trace_zipf(n_keys: int, s: float, requests: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return list(_zipf_sampler(_names(n_keys), s, rng)(requests))


def trace_bursty(
    requests: int,
    seed: int,
    hot: int = 48,
    p_hot: float = 0.85,
    mean_phase: float = 5000.0,
    replace: float = 0.5,
) -> list[str]:
    rng = random.Random(seed)
    keys = _names(N_ADAPTERS)
    background = _zipf_sampler(keys, 0.8, rng)
    hot_set = rng.sample(keys, hot)
    out: list[str] = []
    while len(out) < requests:
        phase = max(1, int(rng.expovariate(1.0 / mean_phase)))
        bg = iter(background(phase))
        for _ in range(phase):
            out.append(rng.choice(hot_set) if rng.random() < p_hot else next(bg))
        cold = [k for k in keys if k not in set(hot_set)]
        for i in rng.sample(range(hot), int(hot * replace)):
            hot_set[i] = cold.pop(rng.randrange(len(cold)))
    return out[:requests]


def trace_scan(requests: int, seed: int, every: int = 2000, scan_len: int = 200) -> list[str]:
    rng = random.Random(seed)
    keys = _names(N_ADAPTERS)
    draw = _zipf_sampler(keys, 1.0, rng)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < requests:
        chunk = draw(every)
        out.extend(chunk)
        seen.update(chunk)
        fresh = [k for k in keys if k not in seen]
        rng.shuffle(fresh)
        scan = fresh[:scan_len]
        seen.update(scan)
        out.extend(scan)
    return out[:requests]


def bursty_scan_hot_set(seed: int, hot: int = BURSTY_SCAN_HOT) -> list[str]:
    """The hot set of ``trace_bursty_scan(..., seed, hot=hot)``."""
    return random.Random(seed).sample(_names(N_ADAPTERS), hot)


def trace_bursty_scan(
    requests: int,
    seed: int,
    mean_gap: float = BURSTY_SCAN_MEAN_GAP,
    *,
    hot: int = BURSTY_SCAN_HOT,
    burst: int = BURSTY_SCAN_BURST,
    jitter: float = BURSTY_SCAN_JITTER,
    hot_order: str = "rotation",
) -> list[str]:
    """A stable hot set in rotation, interrupted by bursts of distinct cold adapters.

    ``hot_order="independent"`` draws each hot request uniformly from the hot set instead (the
    variant the calibration records beside the rotation; not a reported trace).
    """
    if hot_order not in ("rotation", "independent"):
        raise ValueError(f"hot_order: expected rotation or independent, got {hot_order!r}")
    if not 0 < hot < N_ADAPTERS or not 0 < burst <= N_ADAPTERS - hot or mean_gap <= 0:
        raise ValueError(f"bursty-scan: bad shape hot={hot} burst={burst} mean_gap={mean_gap}")
    hot_set = bursty_scan_hot_set(seed, hot)
    hot_keys = set(hot_set)
    cold = [k for k in _names(N_ADAPTERS) if k not in hot_keys]
    rng = random.Random(f"bursty-scan requests {seed}")  # str seeds hash the same everywhere
    phase = {k: rng.random() for k in hot_set}
    round_left: list[str] = []  # the current round, next request last

    def next_hot() -> str:
        if hot_order == "independent":
            return rng.choice(hot_set)
        if not round_left:
            jittered = {k: phase[k] + jitter * (rng.random() - 0.5) for k in hot_set}
            round_left.extend(sorted(hot_set, key=jittered.__getitem__, reverse=True))
        return round_left.pop()

    out: list[str] = []
    while len(out) < requests:
        for _ in range(max(1, int(rng.expovariate(1.0 / mean_gap)))):
            out.append(next_hot())
        out.extend(rng.sample(cold, burst))
    return out[:requests]


def burst_share(trace: list[str], seed: int, hot: int = BURSTY_SCAN_HOT) -> float:
    """Share of a bursty-scan trace's requests that are outside its hot set."""
    hot_keys = set(bursty_scan_hot_set(seed, hot))
    return sum(1 for k in trace if k not in hot_keys) / len(trace)


def trace_loop(n_keys: int, requests: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    keys = _names(n_keys)
    out: list[str] = []
    while len(out) < requests:
        rng.shuffle(keys)
        out.extend(keys)
    return out[:requests]


# ---- simulation ------------------------------------------------------------------------------


def simulate(policy: str, trace: list[str], slots: int, cpu_adapters: int) -> dict[str, int]:
    """Two tiers fed as AdapterManager feeds them (see the module docstring)."""
    gpu = make_policy(policy, slots)
    cpu = make_policy(policy, cpu_adapters)
    on_gpu: set[str] = set()
    on_cpu: set[str] = set()

    def anything(_: str) -> bool:
        return True

    hits = cpu_hits = disk = 0
    for key in trace:
        gpu.access(key)
        if key in on_gpu:
            hits += 1
            continue
        cpu.access(key)
        if key in on_cpu:
            cpu_hits += 1
        else:
            disk += 1
            on_cpu.add(key)
            cpu.insert(key)
            if len(on_cpu) > cpu_adapters:
                gone = cpu.evict(lambda k, key=key: k != key)  # type: ignore[misc]
                assert gone is not None
                on_cpu.remove(gone)
        if len(on_gpu) >= slots:
            victim = gpu.evict(anything)
            assert victim is not None
            on_gpu.remove(victim)
        on_gpu.add(key)
        gpu.insert(key)
    return {"requests": len(trace), "hits": hits, "cpu_hits": cpu_hits, "disk_loads": disk}


def belady_hits(trace: list[str], slots: int) -> int:
    """Offline optimum (evict the resident key requested furthest in the future)."""
    nxt: list[float] = [0.0] * len(trace)
    last: dict[str, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = last.get(trace[i], math.inf)
        last[trace[i]] = i
    resident: dict[str, float] = {}  # key -> its next use
    heap: list[tuple[float, str]] = []  # (-next use, key); stale entries skipped
    hits = 0
    for i, key in enumerate(trace):
        if key in resident:
            hits += 1
        elif len(resident) >= slots:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits


def figures(sim: dict[str, int], c: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    r = sim["requests"]
    misses = r - sim["hits"]
    tokens = r * args.tokens_per_request
    decode = tokens / args.batch * c["step_s"]
    load = sim["cpu_hits"] * c["load_cpu_s"] + sim["disk_loads"] * c["load_disk_s"]
    serial = tokens / (decode + load)
    return {
        "hit_rate": sim["hits"] / r,
        "cpu_hit_rate_of_misses": sim["cpu_hits"] / misses if misses else 0.0,
        "gpu_misses": misses,
        "disk_loads": sim["disk_loads"],
        "throughput_tok_s": serial,
        "throughput_overlap_tok_s": tokens / max(decode, load),
        "loads_per_s_at_throughput": misses / (decode + load),
        "loads_per_s_at_request_rate": misses / r * args.request_rate,
    }


def calibrate_bursty_scan(slots: int, cpu_adapters: int, hot_order: str) -> dict[str, Any]:
    """The search that chose ``BURSTY_SCAN_MEAN_GAP``: per grid value, LRU's GPU hit rate
    averaged over ``CALIBRATION_SEEDS``; the pick is the value nearest the target (the smaller
    gap on a tie). Belady's hit rate at the pick, on the same seeds, is recorded beside it."""
    grid: list[dict[str, Any]] = []
    for gap in CALIBRATION_GRID:
        per_seed, share = [], []
        for seed in CALIBRATION_SEEDS:
            tr = trace_bursty_scan(CALIBRATION_REQUESTS, seed, gap, hot_order=hot_order)
            per_seed.append(simulate("lru", tr, slots, cpu_adapters)["hits"] / len(tr))
            share.append(burst_share(tr, seed))
        grid.append(
            {
                "mean_gap": gap,
                "lru_hit_rate": statistics.fmean(per_seed),
                "lru_hit_rate_per_seed": per_seed,
                "burst_share": statistics.fmean(share),
            }
        )
    pick = min(grid, key=lambda r: (abs(r["lru_hit_rate"] - BURSTY_SCAN_TARGET_LRU), r["mean_gap"]))
    belady = [
        belady_hits(tr, slots) / len(tr)
        for tr in (
            trace_bursty_scan(CALIBRATION_REQUESTS, seed, pick["mean_gap"], hot_order=hot_order)
            for seed in CALIBRATION_SEEDS
        )
    ]
    return {
        "hot_order": hot_order,
        "knob": "mean_gap (mean hot requests between bursts, exponential)",
        "target_lru_hit_rate": BURSTY_SCAN_TARGET_LRU,
        "seeds": list(CALIBRATION_SEEDS),
        "requests_per_seed": CALIBRATION_REQUESTS,
        "shape": {
            "hot": BURSTY_SCAN_HOT,
            "burst": BURSTY_SCAN_BURST,
            "jitter_rounds": BURSTY_SCAN_JITTER,
        },
        "grid": grid,
        "picked_mean_gap": pick["mean_gap"],
        "lru_hit_rate_at_pick": pick["lru_hit_rate"],
        "belady_hit_rate_at_pick": statistics.fmean(belady),
        "belady_hit_rate_at_pick_per_seed": belady,
    }


# ---- measured constants -----------------------------------------------------------------------


async def measure_constants(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    device = args.device
    cfg: dict[str, Any] = SHAPE_7B if args.shape == "llama7b" else SHAPE_TINY
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_dir = work / "model"
    make_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(make_model_config("llama", **cfg)))
    root = work / "adapters"
    n_load = args.load_samples
    slots = max(args.batch, 4)
    names = [f"m{i:03d}" for i in range(slots + n_load)]
    for i, n in enumerate(names):
        write_adapter(root, n, cfg, 16, i, "cpu")
    ecfg = EngineConfig(
        max_model_len=256,
        max_num_seqs=args.batch,
        max_loras=slots,
        max_lora_rank=16,
        max_num_batched_tokens=args.batch * 8 + args.batch,
        max_prefill_chunk=64,
        cpu_cache_bytes=16 << 30,
        use_cuda_graphs=device == "cuda",
    )
    eng = Engine(
        model_dir,
        root,
        device=device,
        dtype=dtype,
        config=ecfg,
        model_name=f"{args.shape}-shape",
        weights=random_weights(cfg, device, dtype),
    )
    mgr = eng.adapters
    try:
        # Disk loads fill every slot; the n_load after them each evict one (all from disk).
        disk: list[float] = []
        for n in names:
            await asyncio.gather(*eng.prefetch([n]))
            disk.append(mgr.counters.latencies[-1])
        # CPU-cache loads: n_load adapters were evicted from their slots, not from the cache.
        cpu: list[float] = []
        for n in [n for n in names if n not in mgr.published][:n_load]:
            before = mgr.counters.cpu_hits
            await asyncio.gather(*eng.prefetch([n]))
            assert mgr.counters.cpu_hits == before + 1, "expected a CPU-cache load"
            cpu.append(mgr.counters.latencies[-1])
        # Decode step at batch B with resident adapters.
        resident = [a.name for a in eng.list_adapters() if a.resident_on_gpu][: args.batch]
        ids = tuple(range(3, 11))

        async def run(tokens: int) -> tuple[float, int]:
            """Wall seconds and tokens produced by ``batch`` requests of ``tokens`` tokens."""
            t = time.perf_counter()
            reqs = [
                GenerationRequest(
                    f"r{tokens}-{i}-{time.perf_counter_ns()}",
                    ids,
                    resident[i % len(resident)],
                    SamplingParams(max_tokens=tokens),
                )
                for i in range(args.batch)
            ]

            async def one(r: GenerationRequest) -> int:
                return sum([1 async for e in eng.submit(r) if e.token_id is not None])

            made = sum(await asyncio.gather(*(one(r) for r in reqs)))
            return time.perf_counter() - t, made

        t1, t2 = args.step_tokens
        for n in (4, t1, t2):  # warm-up: every graph bucket and length the timed runs meet
            await run(n)
        steps, runs = [], []
        for _ in range(args.step_repeats):
            (w1, n1), (w2, n2) = await run(t1), await run(t2)
            steps.append((w2 - w1) / ((n2 - n1) / args.batch))  # per step of ``batch`` rows
            runs.append({"wall_s": [w1, w2], "tokens": [n1, n2]})
        # The least disturbed repeat: on a shared host, other work only ever adds time. A
        # repeat whose short run was the slower one (a stall in it) measures nothing: dropped.
        valid = [s for s in steps if s > 0]
        if not valid:
            raise RuntimeError(f"no repeat measured a step (per-step seconds {steps})")
        step_s = min(valid)
    finally:
        await eng.shutdown()
    disk_evicting = disk[slots:]
    return {
        "load_cpu_s": statistics.median(cpu),
        "load_disk_s": statistics.median(disk_evicting or disk),
        "step_s": step_s,
        "samples": {
            "load_cpu_s": cpu,
            "load_disk_s": disk_evicting or disk,
            "step_s": steps,
            "step_runs": runs,
        },
        "statistic": "loads: median; step: minimum over repeats",
        "model_shape": cfg,
        "adapter": {"rank": 16, "targets": list(ATTN), "file_dtype": "bfloat16"},
        "engine_dtype": str(dtype),
        "batch": args.batch,
        "slots": slots,
        "step_tokens": list(args.step_tokens),
        "page_cache": "warm (adapter files written just before)",
    }


# ---- main ------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--shape",
        choices=["tiny", "llama7b"],
        default=None,
        help="default: tiny on cpu, llama7b on cuda",
    )
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--cpu-adapters", type=int, default=256)
    ap.add_argument("--requests", type=int, default=60_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="decode rows per step (default 8 on cpu, 64 on cuda)",
    )
    ap.add_argument("--tokens-per-request", type=int, default=128)
    ap.add_argument(
        "--request-rate", type=float, default=100.0, help="offered requests/s for loads per second"
    )
    ap.add_argument("--load-samples", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, nargs=2, default=(8, 24))
    ap.add_argument("--step-repeats", type=int, default=5)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    args.shape = args.shape or ("llama7b" if args.device == "cuda" else "tiny")
    args.batch = args.batch or (64 if args.device == "cuda" else 8)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        make_policy(p, 1, field="--policies")
    result: dict[str, Any] = {
        "bench": "bench_eviction",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else (platform.processor() or platform.machine()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "inputs": {
            "adapters": N_ADAPTERS,
            "slots": args.slots,
            "cpu_adapters": args.cpu_adapters,
            "requests_per_trace": args.requests,
            "seed": args.seed,
            "batch": args.batch,
            "tokens_per_request": args.tokens_per_request,
            "request_rate": args.request_rate,
            "policies": policies,
            "default_policy": DEFAULT_POLICY,
            "sweep_working_sets": list(SWEEP),
            "lru_greedy_window": 8,
        },
    }
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="bench_eviction_") as tmp:
        log(f"measuring constants on {args.device} ({args.shape})")
        c = asyncio.run(measure_constants(args, Path(tmp)))
    result["constants"] = c
    log(
        f"load cpu {1e3 * c['load_cpu_s']:.2f} ms, disk {1e3 * c['load_disk_s']:.2f} ms, step {1e3 * c['step_s']:.2f} ms"
    )

    traces: dict[str, list[str]] = {
        f"zipf-{s}": trace_zipf(N_ADAPTERS, s, args.requests, args.seed) for s in ZIPF_S
    }
    traces["bursty"] = trace_bursty(args.requests, args.seed)
    traces["scan"] = trace_scan(args.requests, args.seed)
    traces["bursty-scan"] = trace_bursty_scan(args.requests, args.seed)

    calibration: dict[str, Any] = {}
    for variant, order in (("bursty-scan", "rotation"), ("bursty-scan-independent", "independent")):
        t = time.perf_counter()
        cal = calibrate_bursty_scan(args.slots, args.cpu_adapters, order)
        calibration[variant] = cal
        log(
            f"calibration {variant}: mean_gap {cal['picked_mean_gap']} gives LRU "
            f"{cal['lru_hit_rate_at_pick']:.3f}, Belady {cal['belady_hit_rate_at_pick']:.3f} "
            f"[{time.perf_counter() - t:.1f}s]"
        )
    calibration["bursty-scan"]["constant_mean_gap"] = BURSTY_SCAN_MEAN_GAP
    calibration["bursty-scan"]["reproduced"] = (
        calibration["bursty-scan"]["picked_mean_gap"] == BURSTY_SCAN_MEAN_GAP
    )
    calibration["bursty-scan"]["reported_trace"] = {
        "seed": args.seed,
        "requests": args.requests,
        "mean_gap": BURSTY_SCAN_MEAN_GAP,
        "burst_share": burst_share(traces["bursty-scan"], args.seed),
    }
    calibration["bursty-scan-independent"]["note"] = (
        "the same shape and search with each hot request drawn independently from the hot set; "
        "recorded to show that LRU at 0.68 then leaves the offline optimum below 0.90 "
        "(not a reported trace)"
    )
    if not calibration["bursty-scan"]["reproduced"]:
        log(
            f"WARNING: the calibration now picks mean_gap "
            f"{calibration['bursty-scan']['picked_mean_gap']}, not the constant "
            f"{BURSTY_SCAN_MEAN_GAP}; the reported row uses the constant"
        )
    result["calibration"] = calibration
    res: dict[str, Any] = {}
    for tname, tr in traces.items():
        t = time.perf_counter()
        row: dict[str, Any] = {"distinct": len(set(tr))}
        bh = belady_hits(tr, args.slots)
        row["belady"] = figures(
            {"requests": len(tr), "hits": bh, "cpu_hits": len(tr) - bh, "disk_loads": 0}, c, args
        )
        row["belady"] = {"hit_rate": row["belady"]["hit_rate"]}
        for p in policies:
            t0 = time.perf_counter()
            sim = simulate(p, tr, args.slots, args.cpu_adapters)
            # Host cost of the policy bookkeeping (both tiers and the simulator's own sets).
            us = 1e6 * (time.perf_counter() - t0) / len(tr)
            row[p] = {**figures(sim, c, args), "sim_us_per_request": us}
        res[tname] = row
        log(
            f"{tname}: "
            + ", ".join(f"{p} {row[p]['hit_rate']:.3f}" for p in policies)
            + f" (belady {row['belady']['hit_rate']:.3f}) [{time.perf_counter() - t:.1f}s]"
        )
    result["traces"] = res

    sweeps: dict[str, Any] = {}
    for family in ("sweep-zipf", "sweep-loop"):
        pts: dict[str, Any] = {}
        for w in SWEEP:
            tr = (
                trace_zipf(w, 0.8, args.requests, args.seed + w)
                if family == "sweep-zipf"
                else trace_loop(w, args.requests, args.seed + w)
            )
            bh = belady_hits(tr, args.slots)
            # Belady's misses priced as CPU-cache loads: the best case for the ceiling.
            pt: dict[str, Any] = {
                "belady": figures(
                    {"requests": len(tr), "hits": bh, "cpu_hits": len(tr) - bh, "disk_loads": 0},
                    c,
                    args,
                )
            }
            for p in policies:
                pt[p] = figures(simulate(p, tr, args.slots, args.cpu_adapters), c, args)
            pts[str(w)] = pt
        sweeps[family] = pts
        log(
            f"{family}: "
            + "; ".join(
                f"W={w} " + "/".join(f"{pts[str(w)][p]['hit_rate']:.2f}" for p in policies)
                for w in SWEEP
            )
        )
    result["sweeps"] = sweeps

    targets: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for p in policies:
        hr = res["bursty"][p]["hit_rate"]
        hs = res["bursty-scan"][p]["hit_rate"]
        tp: dict[str, Any] = {
            "bursty_hit_rate": hr,
            "bursty_hit_rate_ge_0.90": hr >= 0.90,
            "bursty_belady_hit_rate": res["bursty"]["belady"]["hit_rate"],
            "bursty_scan_hit_rate": hs,
            "bursty_scan_hit_rate_ge_0.90": hs >= 0.90,
            "bursty_scan_belady_hit_rate": res["bursty-scan"]["belady"]["hit_rate"],
        }
        ok = True
        for family, pts in sweeps.items():
            thr = [pts[str(w)][p]["throughput_tok_s"] for w in SWEEP]
            opt = [pts[str(w)]["belady"]["throughput_tok_s"] for w in SWEEP]
            hit = [pts[str(w)][p]["hit_rate"] for w in SWEEP]
            hit_opt = [pts[str(w)]["belady"]["hit_rate"] for w in SWEEP]
            drop = max(1 - b / a for a, b in itertools.pairwise(thr))
            vs_opt = min(t / o for t, o in zip(thr, opt, strict=True))
            hit_vs_opt = min(h / o for h, o in zip(hit, hit_opt, strict=True) if o > 0)
            tp[f"{family}_max_adjacent_throughput_drop"] = drop
            tp[f"{family}_min_throughput_vs_belady"] = vs_opt
            tp[f"{family}_min_hit_rate_vs_belady"] = hit_vs_opt
            ok = ok and drop <= 0.5 and vs_opt >= 0.5 and hit_vs_opt >= 0.5
        tp["no_thrash_collapse"] = ok
        targets[p] = tp
        all_hits = [res[t][p]["hit_rate"] for t in res] + [
            pts[str(w)][p]["hit_rate"] for pts in sweeps.values() for w in SWEEP
        ]
        summary[p] = {
            "mean_hit_rate_traces": statistics.fmean(res[t][p]["hit_rate"] for t in res),
            "mean_hit_rate_sweeps": statistics.fmean(
                pts[str(w)][p]["hit_rate"] for pts in sweeps.values() for w in SWEEP
            ),
            "mean_hit_rate_all": statistics.fmean(all_hits),
            "mean_throughput_vs_lru": statistics.fmean(
                [res[t][p]["throughput_tok_s"] / res[t]["lru"]["throughput_tok_s"] for t in res]
                + [
                    pts[str(w)][p]["throughput_tok_s"] / pts[str(w)]["lru"]["throughput_tok_s"]
                    for pts in sweeps.values()
                    for w in SWEEP
                ]
            )
            if "lru" in policies
            else None,
        }
    best = max(policies, key=lambda q: summary[q]["mean_hit_rate_all"])
    summary["best_by_mean_hit_rate"] = best
    targets["default_is_best"] = {
        "default": DEFAULT_POLICY,
        "best": best,
        "met": best == DEFAULT_POLICY,
    }
    targets["criteria"] = {
        "bursty_hit_rate_ge_0.90": "GPU hit rate on the bursty trace >= 0.90 (design's LRU-Greedy figure); "
        "bursty_belady_hit_rate is the offline optimum on the same trace",
        "bursty_scan_hit_rate_ge_0.90": "GPU hit rate on the bursty-scan trace (calibrated so that LRU gets "
        "about 0.68, the design's LRU figure; see calibration.bursty-scan) >= 0.90 (the design's "
        "LRU-Greedy figure); bursty_scan_belady_hit_rate is the offline optimum on the same trace",
        "no_thrash_collapse": "on sweep-zipf and sweep-loop: throughput falls by at most 50% between adjacent "
        "working-set sizes (steps <= 1.5x), stays >= 50% of the throughput at Belady's hit rate, and the "
        "hit rate stays >= 50% of Belady's at every size",
        "default_is_best": "the EngineConfig default has the highest mean GPU hit rate over all traces and "
        "sweep points (each weighted equally)",
    }
    result["summary"] = summary
    result["targets"] = targets
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for p in policies:
        t = targets[p]
        log(
            f"{p}: bursty {t['bursty_hit_rate']:.3f} (>=0.90 {t['bursty_hit_rate_ge_0.90']}), "
            f"bursty-scan {t['bursty_scan_hit_rate']:.3f} (>=0.90 {t['bursty_scan_hit_rate_ge_0.90']}), "
            f"no collapse {t['no_thrash_collapse']}"
        )
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
