"""Worker capacity as the number of adapters grows, measured through the HTTP API.

Each row of the table starts its own ``adaptermesh worker`` process with that row's flags (so a
row is what a user who starts the worker that way gets), registers the row's adapters with
``POST /v1/load_lora_adapter``, then runs bench_service.py's serving mix against it: prompts
uniform in 64..2,048 tokens, outputs uniform in 16..512 (``max_tokens``), streaming, each request
naming one adapter (uniformly, or Zipf(1.0) where the row says so) and acting as its tenant.

1. Capacity: output tok/s under a closed loop of 256 requests in flight, counted by the client
   over a window after a ramp (the ramp also covers CUDA-graph capture and kernel compilation).
2. Load: Poisson arrivals at 80% of that rate: TTFT p50/p95 and TPOT p95 (client side).
3. The worker's own counters from its ``/metrics`` before and after each phase: adapter loads
   (the load-latency histogram's count), GPU-slot evictions, cache misses and hits, generated
   tokens; the scheduler's counters: loads started, evictions of an adapter a waiting request
   wanted, admissions that waited for a load, and scheduling passes that could run no step while
   a request waited for a load (a step itself never waits on a load: loads run beside the step
   loop).

Rows (Llama-2-7B shape with random bf16 weights; on CPU the tiny shape, counts x ``--scale``):

    row              adapters  GPU slots   worker flags beyond the common ones    popularity
    base8                   8          8                                          uniform
    r512_all              512        512                                          uniform
    r2000_512           2,000        512                                          uniform
    r512_128              512        128                                          uniform
    r512_128_lru          512        128   --adapter-eviction lru                 uniform
    r512_128_seq64        512        128   --max-num-seqs 64                      uniform
    zipf2000            2,000        512                                          Zipf(1.0)
    r2000_512_density   2,000        512   --lora-density-configs                 uniform
    zipf2000_density    2,000        512   --lora-density-configs                 Zipf(1.0)
    r2000_auto          2,000    (worker)  none at all                            uniform
    r2000_auto_r8       2,000    (worker)  --max-lora-rank 8 only                 uniform
    r2000_auto_b2048    2,000    (worker)  --max-num-batched-tokens 2048          uniform
                                           --max-prefill-chunk 2048
    r2000_auto_b8192    2,000    (worker)  the same at 8192                       uniform
    sizing_auto            64    (worker)  none: the worker sizes itself          uniform
    sizing_fixed           64         64   --max-num-seqs 128 only                uniform

The three r2000_auto rows (rank-8 q,v adapters, no sizing flags) compare the step token budget
and prefill chunk the worker chooses with 2,048 and with 8,192 (the budget vLLM picks for an
online server on a GPU of 70 GiB or more), for the TTFT they cost. r2000_auto_r8 gives the
pool's largest rank as the adapters' (8; the worker's default is 64): with no sizing flag and no
--lora-target-modules, its adapter arena holds as many of them as a pool told q_proj v_proj
(``worker_reported.lora_pool`` names how many of each shape).
The first seven use rank-8 adapters on q_proj and v_proj and the common flags --max-num-seqs 256
--max-num-batched-tokens 2048 --max-prefill-chunk 2048 --max-model-len 2576 --max-lora-rank 8;
the sizing pair uses 64 rank-16 adapters on all seven modules. base8 runs first in every
invocation (added when ``--rows`` leaves it out): each row's ratio is to the base8 of the same run.
On a GPU a first, unmeasured base8 (``warmup_row``) runs before it: the first worker on a machine
compiles the Triton kernels, and a base8 that paid for that measured 896 tok/s against 1,613-3,436
for the rows after it on an H200. That row runs closed loops only, at 256, 64 and 16 requests in
flight for ``--warmup-s`` in all (90 s on a GPU), so that the batch sizes and prefill/decode
mixes of the rows' two phases are compiled before any row measures; each level's tok/s is kept
(``warmup_row.warmup_levels``). A row's capacity window (30 s after a 30 s ramp on a GPU) is
longer than the closed loop's first prefill burst and the length of a request (16-512 tokens at
30-80 ms each); ``capacity_second_over_first_half`` in the table, near 1, says the window held a
steady state.

Files: one model directory (config, tokenizer, random weights as one safetensors file, drawn on
the device) and the adapters, written once per invocation in a child process (so this process
never holds GPU memory beside the workers) under a temporary directory, or under ``--work-dir``,
where a second invocation finds and reuses them. Every adapter has its own random weights by
default (2,000 rank-8 q,v adapters of the 7B shape are 8.4 MB each, 16.8 GB);
``--distinct-adapters N`` writes N and hard-links the rest to them (the worker validates names,
shapes and finiteness, not contents, so a linked adapter loads, occupies a slot and is evicted
like any other; only its numbers repeat).

Usage:
    python bench/bench_many_adapters.py --device cuda --budget-s 540 \\
        --rows base8,r512_all,r2000_512,r512_128,r512_128_lru --work-dir /tmp/many \\
        --out bench/results/many_adapters_h200.json
    python bench/bench_many_adapters.py --device cpu --rows base8,r512_128 --out /tmp/many_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
SRC_DIR = BENCH_DIR.parent / "src"
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(SRC_DIR))

import bench_service
from _results import provenance
from bench_service import (
    ALL7,
    SHAPE_7B,
    SHAPE_TINY,
    MixSchedule,
    capacity_then_load,
    log,
    prompt_ids,
    random_weights,
    write_adapter,
    write_model_skeleton,
)

bench_service.LOG_NAME = "bench_many_adapters"

# Adapter sets: name -> (rank, target modules, name prefix).
ADAPTER_SETS: dict[str, tuple[int, tuple[str, ...], str]] = {
    "qv_r8": (8, ("q_proj", "v_proj"), "qv"),
    "all7_r16": (16, ALL7, "a7"),
}
BASELINE = "base8"
WORKER_MAIN = "import sys; from adaptermesh.cli.main import main; sys.exit(main())"


@dataclasses.dataclass(frozen=True)
class Row:
    """One worker configuration: how many adapters requests spread over, how many GPU slots."""

    adapters: int
    slots: int | None  # None: the worker's own choice
    popularity: str = "uniform"  # or "zipf"
    eviction: str | None = None  # --adapter-eviction
    max_num_seqs: int | None = None  # None: --max-num-seqs of the run
    adapter_set: str = "qv_r8"
    sizing_flags: str = "all"  # "all": the common engine flags; "none"; "seqs_loras": those two
    extra: tuple[str, ...] = ()  # worker flags added after the sizing flags


ROWS: dict[str, Row] = {
    "base8": Row(8, 8),
    "r512_all": Row(512, 512),
    "r2000_512": Row(2000, 512),
    "r512_128": Row(512, 128),
    "r512_128_lru": Row(512, 128, eviction="lru"),
    "r512_128_seq64": Row(512, 128, max_num_seqs=64),
    "zipf2000": Row(2000, 512, popularity="zipf"),
    # The same two rows with the LoRA kernels' tiles picked by the step's tokens per adapter.
    "r2000_512_density": Row(2000, 512, extra=("--lora-density-configs",)),
    "zipf2000_density": Row(2000, 512, popularity="zipf", extra=("--lora-density-configs",)),
    # No sizing flags at all (the worker chooses sequences, slots, step budget and chunk), then
    # the same with the step token budget and prefill chunk given: what the budget costs TTFT.
    "r2000_auto": Row(2000, None, sizing_flags="none"),
    # The same with the adapters' rank as the pool's largest (not a sizing flag): the
    # configuration of the no-flags row (421 slots in a pool of slots).
    "r2000_auto_r8": Row(2000, None, sizing_flags="none", extra=("--max-lora-rank", "8")),
    "r2000_auto_b2048": Row(
        2000,
        None,
        sizing_flags="none",
        extra=("--max-num-batched-tokens", "2048", "--max-prefill-chunk", "2048"),
    ),
    "r2000_auto_b8192": Row(
        2000,
        None,
        sizing_flags="none",
        extra=("--max-num-batched-tokens", "8192", "--max-prefill-chunk", "8192"),
    ),
    "sizing_auto": Row(64, None, adapter_set="all7_r16", sizing_flags="none"),
    "sizing_fixed": Row(
        64, 64, max_num_seqs=128, adapter_set="all7_r16", sizing_flags="seqs_loras"
    ),
}

# Per-run defaults: (GPU, CPU). GPU: the timed phases take about 40 s a row (each phase starts
# its client 2 s ahead; the capacity phase 6 + 8 s, the load phase 8 s + at most 12 s of tail,
# which a 512-token answer at ~25 ms a token needs: latency percentiles count finished requests);
# with the worker's start, registration and stop (not measured when this was written: an
# estimate of 20-40 s) a row is about a minute, so the ten runs of the table (base8 in each of
# two commands) come to about 10 minutes. CPU: a smoke run of two tiny rows in under a minute.
SIZE_FLAGS: dict[str, tuple[Any, Any, type, str]] = {
    # dest: (GPU default, CPU default, type, help)
    "scale": (1.0, 1 / 16, float, "adapter, slot and per-row sequence counts x this, at least 2"),
    "concurrency": (256, 16, int, "closed-loop requests in flight"),
    "max_num_seqs": (256, 16, int, "worker --max-num-seqs of the rows that set it"),
    "ramp_s": (30.0, 0.5, float, "seconds before counting starts"),
    "capacity_s": (30.0, 2.0, float, "closed-loop counting window, s"),
    "run_s": (16.0, 3.0, float, "Poisson arrival window, s"),
    "max_tail_s": (
        24.0,
        10.0,
        float,
        "after the last arrival, cut requests still running after this",
    ),
    "warmup_s": (90.0, 6.0, float, "the warm-up row's closed loops, s in all"),
    "prompt": ([64, 2048], [16, 128], int, "prompt tokens, uniform in [LO, HI]"),
    "output": ([16, 512], [4, 32], int, "max_tokens, uniform in [LO, HI]"),
    "max_model_len": (2576, 176, int, "worker --max-model-len of the rows that set it"),
    "timeout": (120.0, 60.0, float, "per-request deadline, s"),
    "start_timeout": (300.0, 120.0, float, "seconds a worker may take to listen"),
}


def scaled(count: int, scale: float) -> int:
    return max(2, round(count * scale))


def adapter_names(set_name: str, count: int) -> list[str]:
    prefix = ADAPTER_SETS[set_name][2]
    return [f"{prefix}{i:04d}" for i in range(count)]


# ====================================================================== files (child process)
def prepare_files(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the model directory and the adapter sets ``spec`` asks for, skipping what an
    earlier run left complete; returns what it wrote, how long it took and the device facts."""
    import torch
    from bench_engine_speed import driver_version, versions
    from safetensors.torch import save_file

    device = spec["device"]
    gpu = device == "cuda"
    cfg = dict(SHAPE_7B if gpu else SHAPE_TINY)
    dtype = torch.bfloat16 if gpu else torch.float32
    work = Path(spec["work"])
    model_dir, root = work / "model", work / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "driver": driver_version() if gpu else None,
        "versions": versions(),
        "model": {"shape": cfg, "dtype": str(dtype), "weights": "random"},
        "adapter_sets": {},
    }
    marker = model_dir / ".complete"
    t = time.monotonic()
    if not marker.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        write_model_skeleton(model_dir, cfg)
        weights = {
            name: tensor.cpu().contiguous()
            for name, tensor in random_weights(cfg, device, dtype).items()
        }
        save_file(weights, str(model_dir / "model.safetensors"))
        del weights
        marker.write_text("1")
    out["model"]["write_s"] = time.monotonic() - t
    for set_name, count in spec["sets"].items():
        rank, targets, _ = ADAPTER_SETS[set_name]
        distinct = min(count, spec["distinct"] or count)
        done = root / f".complete-{set_name}"
        t = time.monotonic()
        if not (done.exists() and json.loads(done.read_text()) == [count, distinct]):
            names = adapter_names(set_name, count)
            for i, name in enumerate(names[:distinct]):
                write_adapter(root, name, cfg, rank, seed=1000 + i, device=device, targets=targets)
            for i, name in enumerate(names[distinct:], start=distinct):
                source = root / names[i % distinct]
                target = root / name
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                for file in ("adapter_model.safetensors", "adapter_config.json"):
                    os.link(source / file, target / file)
            done.write_text(json.dumps([count, distinct]))
        size = (root / adapter_names(set_name, 1)[0] / "adapter_model.safetensors").stat().st_size
        out["adapter_sets"][set_name] = {
            "count": count,
            "distinct": distinct,
            "rank": rank,
            "targets": list(targets),
            "bytes_each": size,
            "write_s": time.monotonic() - t,
            "weights": "random, distinct"
            if distinct == count
            else f"random, {distinct} distinct, the rest hard links to them (name i -> i mod {distinct})",
        }
    if gpu:
        torch.cuda.synchronize()
    return out


# ================================================================================ the worker
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def counter(metrics: dict[str, float], name: str) -> float | None:
    for key in (name, name + "_total"):
        if key in metrics:
            return metrics[key]
    return None


def worker_counters(metrics: dict[str, float]) -> dict[str, float | None]:
    return {
        "adapter_loads": counter(metrics, "adaptermesh_adapter_load_latency_seconds_count"),
        "evictions": counter(metrics, "adaptermesh_adapter_cache_evictions"),
        "cache_misses": counter(metrics, "adaptermesh_adapter_cache_misses"),
        "cache_hits": counter(metrics, "adaptermesh_adapter_cache_hits"),
        "generated_tokens": counter(metrics, "adaptermesh_generation_tokens"),
        "loads_started": counter(metrics, "adaptermesh_adapter_loads_started"),
        "evictions_wanted": counter(metrics, "adaptermesh_adapter_evictions_wanted"),
        "admissions_waited_on_load": counter(
            metrics, "adaptermesh_admissions_waited_on_adapter_load"
        ),
        "scheduler_idle_on_adapter_load": counter(
            metrics, "adaptermesh_scheduler_idle_on_adapter_load"
        ),
    }


def counter_delta(
    after: dict[str, float | None], before: dict[str, float | None]
) -> dict[str, float | None]:
    return {
        key: None if after[key] is None or before.get(key) is None else after[key] - before[key]  # type: ignore[operator]
        for key in after
    }


class Worker:
    """One ``adaptermesh worker`` process on a free port, its log in a file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.session: Any = None

    async def start(self, timeout_s: float) -> None:
        import aiohttp

        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(SRC_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        with self.log_path.open("wb") as log_file:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                WORKER_MAIN,
                "worker",
                *self.argv,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            line = b""
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            if not line:
                raise RuntimeError(
                    f"the worker did not start within {timeout_s:.0f} s "
                    f"(exit {self.proc.returncode}): {self.log_tail()}"
                )
            found = re.search(rb"listening on (http://\S+)", line)
            if found:
                self.url = found.group(1).decode()
                break
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def metrics(self) -> dict[str, float]:
        async with self.session.get(self.url + "/metrics") as resp:
            resp.raise_for_status()
            return parse_metrics(await resp.text())

    async def register(self, names: list[str], parallel: int = 8) -> None:
        queue = list(reversed(names))

        async def one() -> None:
            while queue:
                name = queue.pop()
                async with self.session.post(
                    self.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}
                ) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"loading {name}: {resp.status} {await resp.text()}")

        await asyncio.gather(*(one() for _ in range(parallel)))

    async def warm_up(self, adapter: str, timeout_s: float) -> None:
        """One short completion, so the engine's first step (lazy initialisation, the first
        kernels) is not inside the capacity phase."""
        body = {"model": adapter, "prompt": prompt_ids(1, 16), "max_tokens": 2}
        async with self.session.post(
            self.url + "/v1/completions", json=body, headers={"x-request-timeout": str(timeout_s)}
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"warm-up request: {resp.status} {await resp.text()}")

    async def settle(self, limit_s: float = 60.0) -> None:
        """Until the worker holds no request (admitted or queued), at most ``limit_s``."""
        t = time.monotonic()
        while time.monotonic() - t < limit_s:
            m = await self.metrics()
            if not m.get("adaptermesh_requests_admitted") and not m.get(
                "vllm:num_requests_waiting"
            ):
                return
            await asyncio.sleep(0.25)

    async def stop(self) -> int | None:
        if self.session is not None:
            await self.session.close()
        if self.proc is None or self.proc.returncode is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), 40)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            return await self.proc.wait()


# ==================================================================================== a row
def worker_argv(row: Row, args: argparse.Namespace, work: Path) -> list[str]:
    gpu = args.device == "cuda"
    argv = [
        "--model",
        str(work / "model"),
        "--adapter-root",
        str(work / "adapters"),
        "--port",
        "0",
        "--device",
        args.device,
        "--dtype",
        "bfloat16" if gpu else "float32",
        "--served-model-name",
        "bench-base",
        "--request-timeout",
        str(args.timeout),
        "--drain-timeout",
        "5",
        # The bench stops the worker it talks to directly: no load balancer to wait for.
        "--drain-grace",
        "0",
    ]
    seqs = args.max_num_seqs if row.max_num_seqs is None else scaled(row.max_num_seqs, args.scale)
    slots = None if row.slots is None else scaled(row.slots, args.scale)
    if row.sizing_flags == "all":
        argv += [
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(seqs),
            "--max-num-batched-tokens",
            "2048",
            "--max-prefill-chunk",
            "2048",
            "--max-loras",
            str(slots),
            "--max-lora-rank",
            str(ADAPTER_SETS[row.adapter_set][0]),
        ]
    elif row.sizing_flags == "seqs_loras":
        argv += ["--max-num-seqs", str(seqs), "--max-loras", str(slots)]
    if row.eviction is not None:
        argv += ["--adapter-eviction", row.eviction]
    return argv + list(row.extra)


def _pct(values: list[float], q: float) -> float | None:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# Buckets of distinct adapters per step for the GPU time split (the SGMM kernels' segments).
ADAPTER_BUCKETS = ((0, 8), (9, 32), (33, 64), (65, 128), (129, 1 << 30))


def summarise_steps(steps: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """The worker's step records (``--step-profile``) that completed in [t0, t1): where the
    window's time went, by step kind and by the number of distinct adapters a step held."""
    win = [st for st in steps if t0 <= st["t"] < t1]
    if not win:
        return {"steps": 0, "window_s": t1 - t0}
    span = t1 - t0
    decode = [st for st in win if st["prefill_tokens"] == 0]
    mixed = [st for st in win if st["prefill_tokens"] > 0]
    tokens = sum(st["tokens"] for st in win)

    def kind(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "steps": len(rows),
            "gpu_ms_sum_share_of_window": sum(st["gpu_ms"] for st in rows) / 1e3 / span,
            "gpu_ms_p50": _pct([st["gpu_ms"] for st in rows], 0.5),
            "gpu_ms_mean": _mean([st["gpu_ms"] for st in rows]),
            "host_ms_p50": _pct([st["host_ms"] for st in rows], 0.5),
            "rows_mean": _mean([st["rows"] for st in rows]),
            "tokens_mean": _mean([st["tokens"] for st in rows]),
            "adapters_mean": _mean([st["adapters"] for st in rows]),
            "graph_share": sum(1 for st in rows if st["graph"]) / len(rows) if rows else None,
        }

    buckets = {}
    for lo, hi in ADAPTER_BUCKETS:
        rows = [st for st in decode if lo <= st["adapters"] <= hi]
        if rows:
            label = f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}"
            # Per decode row, so buckets of different batch sizes compare.
            buckets[label] = {
                **kind(rows),
                "gpu_us_per_decode_row": _mean([1e3 * st["gpu_ms"] / st["rows"] for st in rows]),
            }
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(win)]
    return {
        "steps": len(win),
        "window_s": span,
        "steps_per_s": len(win) / span,
        "tokens": tokens,
        "prefill_token_share": sum(st["prefill_tokens"] for st in win) / tokens if tokens else None,
        "gpu_busy_share": sum(st["gpu_ms"] for st in win) / 1e3 / span,
        "step_interval_ms_p50": 1e3 * _pct(gaps, 0.5) if gaps else None,
        "adapters_per_step_p50": _pct([st["adapters"] for st in win], 0.5),
        "adapters_per_step_p90": _pct([st["adapters"] for st in win], 0.9),
        "adapters_per_step_max": max(st["adapters"] for st in win),
        "steps_over_64_adapters_share": sum(1 for st in win if st["adapters"] > 64) / len(win),
        "decode_only": kind(decode),
        "with_prefill": kind(mixed),
        "decode_by_adapters": buckets,
    }


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by the worker's stop
            out.append(json.loads(line))
    return out


def sizes_line(log_text: str) -> str | None:
    """The worker's start-up line of the sizes it chose and why (``sizes: ...``)."""
    found = re.search(r"sizes: (.*)", log_text)
    return found.group(1).strip() if found else None


def lora_pool(log_text: str) -> str | None:
    """The worker's adapter pool as its start-up line describes it (``lora pool ...``): its
    slots, or its arena and how many adapters of each shape it holds."""
    found = re.search(r"lora pool (.*?), lora ops", log_text)
    return found.group(1).strip() if found else None


def admission_slots(log_text: str) -> int | None:
    found = re.search(r"with (\d+) admission slots", log_text)
    return int(found.group(1)) if found else None


# The warm-up row's closed loops: concurrency as a fraction of --concurrency, each for a third
# of --warmup-s. Full, a quarter and a sixteenth of the loop reach the decode batch sizes and
# the prefill/decode mixes that the rows' capacity and 80% load phases reach.
WARMUP_LEVELS = (1.0, 0.25, 1 / 16)


async def warm_shapes(
    base: dict[str, Any], concurrency: int, seconds: float, settle: Any
) -> list[dict[str, Any]]:
    """Closed loops at each of WARMUP_LEVELS for ``seconds / 3`` each, nothing measured: the
    worker compiles and captures what the rows will reach. Returns each level's output tok/s
    (over the level's second half), which shows when compiling stopped."""
    out = []
    per = seconds / len(WARMUP_LEVELS)
    for k, level in enumerate(WARMUP_LEVELS):
        c = max(1, round(concurrency * level))
        phase = await bench_service.mix_phase(
            None, {**base, "mode": "mix_closed", "seed": 21 + k, "concurrency": c}, (per / 2, per)
        )
        summ = bench_service.mix_summary(phase["client"]["records"], per / 2)
        out.append(
            {
                "concurrency": c,
                "seconds": per,
                "output_tok_s": summ["output_tok_s"],
                "output_tok_s_halves": summ["output_tok_s_halves"],
                "status_counts": summ["status_counts"],
            }
        )
        log(f"warm-up at {c} in flight: {summ['output_tok_s']:.0f} output tok/s")
        await settle()
    return out


async def run_row(
    name: str,
    args: argparse.Namespace,
    work: Path,
    save: Any,
    result: dict[str, Any],
    warmup_s: float | None = None,
) -> None:
    """Start the row's worker, register its adapters, measure, stop it; fills ``result`` (which
    ``save`` writes out) as it goes. With ``warmup_s``: closed loops for that long instead of
    the measured phases (the warm-up row)."""
    row = ROWS[name]
    count = scaled(row.adapters, args.scale)
    names = adapter_names(row.adapter_set, count)
    argv = worker_argv(row, args, work)
    steps_path = work / f"steps-{name}.jsonl"
    if args.step_profile and warmup_s is None:
        steps_path.unlink(missing_ok=True)
        argv += ["--step-profile", str(steps_path)]
    result.update(
        {
            "adapters": count,
            "adapter_set": row.adapter_set,
            "popularity": row.popularity,
            "zipf_exponent": args.zipf if row.popularity == "zipf" else None,
            "worker_command": " ".join(["adaptermesh", "worker", *argv]),
        }
    )
    worker = Worker(argv, work / f"worker-{name}.log")
    t0 = time.monotonic()
    try:
        await worker.start(args.start_timeout)
        result["start_s"] = time.monotonic() - t0
        log(
            f"{name}: worker up at {worker.url} in {result['start_s']:.1f}s; registering {count} adapters"
        )
        t = time.monotonic()
        await worker.register(names)
        result["register_s"] = time.monotonic() - t
        t = time.monotonic()
        await worker.warm_up(names[0], args.timeout)
        result["warmup_s"] = time.monotonic() - t
        gauges = await worker.metrics()
        registered = worker_counters(gauges)
        result["worker_reported"] = {
            "gpu_slots_total": gauges.get("adaptermesh_gpu_slots_total"),
            "max_loras": gauges.get("adaptermesh_max_loras"),
            "admission_slots": admission_slots(worker.log_tail(200_000)),
            "sizes": sizes_line(worker.log_tail(200_000)),
            "lora_pool": lora_pool(worker.log_tail(200_000)),
        }
        result["counters"] = {"registration": registered}
        # Zipf: popularity in a fixed shuffled order, so the most popular adapters are not simply
        # the first (or last) registered.
        popular = list(names)
        if row.popularity == "zipf":
            random.Random(5).shuffle(popular)
        lo_p, hi_p = args.prompt
        base = {
            "url": worker.url,
            "adapters": popular,
            "prompt_range": [lo_p, hi_p],
            "output_range": list(args.output),
            "timeout_s": args.timeout,
            **({"zipf": args.zipf} if row.popularity == "zipf" else {}),
        }
        snapshots = [registered]

        async def settle() -> None:
            await worker.settle()
            snapshots.append(worker_counters(await worker.metrics()))

        if warmup_s is not None:
            result["warmup_levels"] = await warm_shapes(base, args.concurrency, warmup_s, settle)
            return

        schedule = MixSchedule(
            args.concurrency,
            args.ramp_s,
            args.capacity_s,
            args.run_s,
            args.load,
            args.max_tail_s,
            tuple(args.output),
        )
        started = time.time()
        await capacity_then_load(None, base, schedule, result, save, settle)
        if args.step_profile:
            t0 = started + args.ramp_s
            result["step_profile"] = {
                "capacity": summarise_steps(read_steps(steps_path), t0, t0 + args.capacity_s),
                "note": "engine step records (--step-profile) that completed in the capacity "
                "window (after the ramp): GPU time between the step's events, host launch time, "
                "distinct adapters (SGMM segments) and prefill tokens per step",
            }
        await settle()
        result["counters"]["capacity"] = counter_delta(snapshots[1], snapshots[0])
        result["counters"]["load"] = counter_delta(snapshots[2], snapshots[1])
        result["counters"]["measured"] = counter_delta(snapshots[2], snapshots[0])
    except Exception as exc:  # a failed row is reported, the next row still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["worker_log_tail"] = worker.log_tail()
        log(f"{name}: failed: {result['error']}")
    finally:
        result["worker_exit"] = await worker.stop()
        result["row_s"] = time.monotonic() - t0


def table_row(name: str, r: dict[str, Any], baseline: float | None, scale: float) -> dict[str, Any]:
    spec = ROWS[name]
    capacity = (r.get("capacity") or {}).get("output_tok_s")
    halves = (r.get("capacity") or {}).get("output_tok_s_halves")
    load = r.get("load") or {}
    measured = (r.get("counters") or {}).get("measured") or {}
    return {
        "row": name,
        "adapters": r.get("adapters"),
        "gpu_slots": None if spec.slots is None else scaled(spec.slots, scale),
        "eviction": spec.eviction,
        "popularity": spec.popularity,
        "capacity_output_tok_s": capacity,
        "ratio_vs_base8": capacity / baseline if capacity and baseline else None,
        # The capacity window's second half over its first: near 1 in a steady state.
        "capacity_second_over_first_half": halves[1] / halves[0] if halves and halves[0] else None,
        "ttft_p50_ms": (load.get("ttft_ms") or {}).get("p50"),
        "ttft_p95_ms": (load.get("ttft_ms") or {}).get("p95"),
        "tpot_p95_ms": (load.get("tpot_ms") or {}).get("p95"),
        "load_output_tok_s": load.get("output_tok_s"),
        "adapter_loads": measured.get("adapter_loads"),
        "evictions": measured.get("evictions"),
        "cache_misses": measured.get("cache_misses"),
        "evictions_wanted": measured.get("evictions_wanted"),
        "scheduler_idle_on_adapter_load": measured.get("scheduler_idle_on_adapter_load"),
        "error": r.get("error"),
    }


def print_table(table: list[dict[str, Any]]) -> None:
    print("\n== bench_many_adapters (capacity through HTTP; latency at the load fraction) ==")
    print(
        f"{'row':16s} {'adapters':>8s} {'slots':>6s} {'tok/s':>8s} {'ratio':>6s} "
        f"{'2nd/1st':>7s} {'ttft50':>8s} {'ttft95':>8s} {'tpot95':>7s} {'loads':>7s} "
        f"{'evict':>7s} {'miss':>7s}"
    )

    def fmt(v: Any, digits: int = 0) -> str:
        return "n/a" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    for t in table:
        print(
            f"{t['row']:16s} {fmt(t['adapters']):>8s} {fmt(t['gpu_slots']):>6s} "
            f"{fmt(t['capacity_output_tok_s']):>8s} {fmt(t['ratio_vs_base8'], 2):>6s} "
            f"{fmt(t['capacity_second_over_first_half'], 2):>7s} "
            f"{fmt(t['ttft_p50_ms']):>8s} {fmt(t['ttft_p95_ms']):>8s} "
            f"{fmt(t['tpot_p95_ms'], 1):>7s} {fmt(t['adapter_loads']):>7s} "
            f"{fmt(t['evictions']):>7s} {fmt(t['cache_misses']):>7s}"
            + (f"  ERROR {t['error']}" if t["error"] else "")
        )
    sys.stdout.flush()


def default_out(gpu_name: str | None) -> Path:
    device = (
        "cpu"
        if gpu_name is None
        else (
            "h200"
            if "H200" in gpu_name
            else re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")
        )
    )
    return BENCH_DIR / "results" / f"many_adapters_{device}.json"


async def run(args: argparse.Namespace, rows: list[str]) -> dict[str, Any]:
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    own_work = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench-many-adapters-") if own_work else args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    sets: dict[str, int] = {}
    for name in rows:
        row = ROWS[name]
        sets[row.adapter_set] = max(sets.get(row.adapter_set, 0), scaled(row.adapters, args.scale))
    spec = {
        "device": args.device,
        "work": str(work),
        "sets": sets,
        "distinct": args.distinct_adapters,
    }
    log(f"writing the model and adapters ({sets}) under {work}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--prepare", json.dumps(spec), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"writing the files failed (exit {proc.returncode})")
    files = json.loads(out.decode().strip().splitlines()[-1])
    log(f"files ready in {time.monotonic() - t_start:.1f}s")
    packages = [
        p for p in ("torch", "triton", "safetensors", "aiohttp") if importlib.util.find_spec(p)
    ]
    result: dict[str, Any] = {
        "bench": "bench_many_adapters",
        **provenance(*packages, load_start=load_start),
        "device": args.device,
        "gpu": files["gpu"],
        "driver": files["driver"],
        "versions": files["versions"],
        "model": files["model"],
        "adapter_sets": files["adapter_sets"],
        "workload": {
            "prompt_tokens": f"uniform [{args.prompt[0]}, {args.prompt[1]}]",
            "max_tokens": f"uniform [{args.output[0]}, {args.output[1]}]",
            "max_model_len": args.max_model_len,
            "sampling": "API default (no temperature sent)",
            "stream": True,
            "tenant": "one per adapter (x-tenant-id)",
            "arrivals": "closed loop, then Poisson",
            "closed_concurrency": args.concurrency,
            "load": args.load,
            "ramp_s": args.ramp_s,
            "capacity_s": args.capacity_s,
            "warmup_row_s": args.warmup_s if args.warmup_row else None,
            "warmup_levels": list(WARMUP_LEVELS) if args.warmup_row else None,
            "run_s": args.run_s,
            "max_tail_s": args.max_tail_s,
            "zipf_exponent": args.zipf,
            "max_num_seqs": args.max_num_seqs,
            "scale": args.scale,
            "registration": "POST /v1/load_lora_adapter for every adapter of the row, 8 at once",
            "counters": "worker /metrics deltas over the capacity and load phases (measured); "
            "registration: totals right after registering",
        },
        "rows": {},
        "table": [],
        "skipped": [],
    }
    out_path = Path(args.out) if args.out else default_out(files["gpu"])
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")

    # SIGTERM (a stage's timeout): the running row stops its worker, the file keeps what is done.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    longest = 0.0
    try:
        if args.warmup_row:
            # The first worker of a machine compiles the Triton kernels (the cache on disk
            # serves the later ones) and its row measured that: run the baseline once first,
            # kept apart and not used for any ratio.
            result["warmup_row"] = {"row": BASELINE}
            await run_row(BASELINE, args, work, save, result["warmup_row"], warmup_s=args.warmup_s)
            longest = result["warmup_row"]["row_s"]
            save()
        for name in rows:
            elapsed = time.monotonic() - t_start
            if args.budget_s is not None and longest and elapsed + longest > args.budget_s:
                result["skipped"].append(
                    {
                        "row": name,
                        "reason": f"budget: {elapsed:.0f}s used, "
                        f"a row took up to {longest:.0f}s, budget {args.budget_s:.0f}s",
                    }
                )
                log(f"{name}: skipped (budget)")
                save()
                continue
            row_result: dict[str, Any] = {}
            result["rows"][name] = row_result
            await run_row(name, args, work, save, row_result)
            longest = max(longest, row_result["row_s"])
            baseline = (result["rows"].get(BASELINE, {}).get("capacity") or {}).get("output_tok_s")
            result["table"] = [
                table_row(n, r, baseline, args.scale) for n, r in result["rows"].items()
            ]
            save()
    finally:
        result["wall_s"] = time.monotonic() - t_start
        save()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {out_path}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--prepare", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated rows (default: all): {', '.join(ROWS)}",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results JSON (default bench/results/many_adapters_<device>.json)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="where the model and adapters are written and kept (reused when already "
        "there); default: a temporary directory removed at the end",
    )
    p.add_argument(
        "--distinct-adapters",
        type=int,
        default=None,
        help="adapters with their own weights per set; the rest are hard links (default: all)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip a row when the time used plus the longest row so far would pass this",
    )
    p.add_argument(
        "--step-profile",
        action="store_true",
        help="start each row's worker with --step-profile and summarise its steps over the "
        "capacity window (step_profile in each row: GPU and host ms, distinct adapters and "
        "prefill tokens per step, the steps' share of the window)",
    )
    p.add_argument(
        "--warmup-row",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the baseline row once before the table, kept apart as warmup_row (its "
        "worker compiles the kernels; default: on with --device cuda)",
    )
    d = p.add_argument_group("sizes and durations (defaults: GPU / CPU)")
    for dest, (on_gpu, on_cpu, kind, text) in SIZE_FLAGS.items():
        pair = isinstance(on_gpu, list)
        shown = " / ".join(" ".join(map(str, v)) if pair else str(v) for v in (on_gpu, on_cpu))
        d.add_argument(
            "--" + dest.replace("_", "-"),
            type=kind,
            default=None,
            help=f"{text} ({shown})",
            **({"nargs": 2, "metavar": ("LO", "HI")} if pair else {}),
        )
    d.add_argument("--load", type=float, default=0.8, help="Poisson rate as a fraction of capacity")
    d.add_argument("--zipf", type=float, default=1.0, help="exponent of the Zipf rows")
    args = p.parse_args()
    if args.prepare:
        print(json.dumps(prepare_files(json.loads(args.prepare))))
        return 0
    gpu = args.device == "cuda"
    if args.warmup_row is None:
        args.warmup_row = gpu
    for dest, (on_gpu, on_cpu, _, _) in SIZE_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, on_gpu if gpu else on_cpu)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)} (known: {', '.join(ROWS)})")
    rows = [BASELINE] + [r for r in dict.fromkeys(rows) if r != BASELINE]
    if args.prompt[1] + args.output[1] > args.max_model_len:
        p.error("--prompt HI + --output HI must fit in --max-model-len")
    try:
        result = asyncio.run(run(args, rows))
    except asyncio.CancelledError:
        log("stopped by SIGTERM; the results file holds the rows finished before")
        return 1
    print_table(result["table"])
    return 0 if result["table"] and not any(t["error"] for t in result["table"]) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
