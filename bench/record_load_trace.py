"""Record a load trace from a real worker: what the control plane would observe, tick by tick,
while the offered load sweeps up, down and around the worker's capacity.

Server (this process): the real ``Engine`` + ``WorkerService`` on 127.0.0.1 with random
weights (Llama-2-7B shape, bf16 on CUDA; a tiny shape on CPU) and 16 rank-16 adapters on
q, k, v, o, built as ``bench_service.py`` builds them. Load (this process, its own aiohttp
session): Poisson arrivals of completions (prompt 128 tokens, 64 output tokens, adapter
uniform at random, not streamed, so the client costs one response per request on the shared
event loop; TTFT is measured by the worker's own histogram) at each rate of the sweep. Observer: the control plane's own
``ScrapeSource`` scraping ``/metrics`` every ``--interval`` seconds, so each trace row is
exactly a ``WorkerObservation`` (tokens/s, mean and p95 TTFT, p95 TPOT, waiting, running,
KV use, free GPU memory) plus the offered rate and the client-side end-to-end p95 of the
requests that finished in the interval.

The sweep: a closed-loop probe measures capacity (requests/s at ``--batch`` in flight), then
the offered rate visits fractions of it, each held for ``--step`` seconds: up, down, and a
shuffled second pass, so fits see a wide range of operating points in both directions.

  PYTHONPATH=src python3 bench/record_load_trace.py --device cuda \\
      --out bench/results/load_trace_h200.json          # ~6 minutes on an H200
  PYTHONPATH=src python3 bench/record_load_trace.py --device cpu --tiny \\
      --out bench/results/load_trace_cpu.json           # a couple of minutes on CPU

``bench/bench_capacity.py`` replays the trace.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_service as bs

FRACTIONS = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 0.6, 0.3, 0.15, 0.5, 0.9, 0.2, 0.75, 0.35)


async def one(session: Any, url: str, body: dict[str, Any], t_base: float) -> dict[str, Any]:
    t0 = time.monotonic()
    rec: dict[str, Any] = {"sent": t0 - t_base, "status": 0, "e2e": None}
    try:
        async with session.post(
            url + "/v1/completions",
            json=body,
            headers={"x-tenant-id": body["model"], "x-request-timeout": "120"},
        ) as resp:
            rec["status"] = resp.status
            await resp.read()
    except Exception as exc:  # a failed request is a data point, not a crash
        rec["status"] = type(exc).__name__
    rec["e2e"] = time.monotonic() - t0
    return rec


def log(msg: str) -> None:
    print(f"[record_load_trace] {msg}", file=sys.stderr, flush=True)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import torch

    from adaptermesh.clock import SystemClock
    from adaptermesh.control_plane.metrics_source import ScrapeSource, Target
    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
    from adaptermesh_testkit.checkpoints import make_model_config, make_tokenizer

    device = args.device
    cfg = dict(bs.SHAPE_TINY if args.tiny else bs.SHAPE_7B)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="load-trace-"))
    model_dir, root = work / "model", work / "adapters"
    model_dir.mkdir()
    root.mkdir()
    make_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(make_model_config("llama", **cfg)))
    adapters = [f"ad{i:02d}" for i in range(args.adapters)]
    for i, name in enumerate(adapters):
        bs.write_adapter(root, name, cfg, args.rank, seed=i, device=device)
    ecfg = EngineConfig(
        max_model_len=args.prompt_len + args.max_tokens + 64,
        max_num_seqs=args.batch,
        max_loras=len(adapters),
        max_lora_rank=args.rank,
        max_num_batched_tokens=max(2048, args.batch + 2 * args.prompt_len),
        max_prefill_chunk=max(512, args.prompt_len),
    )
    engine = Engine(
        model_dir,
        root,
        device=device,
        dtype=dtype,
        config=ecfg,
        model_name="trace-base",
        weights=bs.random_weights(cfg, device, dtype),
    )
    await asyncio.gather(*engine.prefetch(adapters))
    service = WorkerService(
        engine,
        ServiceConfig(
            max_running=2 * args.batch,
            max_waiting_per_tenant=100_000,
            max_waiting_total=100_000,
            request_timeout_s=120.0,
        ),
    )
    runner, port = await serve(service, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(args.seed)
    t_base = time.monotonic()
    records: list[dict[str, Any]] = []

    def body(i: int) -> dict[str, Any]:
        return {
            "model": rng.choice(adapters),
            "prompt": bs.prompt_ids(args.seed * 100003 + i, args.prompt_len),
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    result: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            # 1. Capacity probe: closed loop at the engine's batch.
            counter = iter(range(10**9))
            done: list[dict[str, Any]] = []
            stop_at = time.monotonic() + args.probe

            async def closed() -> None:
                while time.monotonic() < stop_at:
                    b = body(next(counter))
                    done.append(await one(session, url, b, t_base))

            t0 = time.monotonic()
            await asyncio.gather(*(closed() for _ in range(args.batch)))
            capacity = sum(1 for r in done if r["status"] == 200) / (time.monotonic() - t0)
            log(f"capacity ~{capacity:.2f} requests/s at {args.batch} in flight")

            # 2. The sweep, observed by the control plane's scraper.
            source = ScrapeSource(interval_s=args.interval, timeout_s=min(2.0, args.interval))
            target = Target("trace", "127.0.0.1", port)
            clock = SystemClock()
            rows: list[dict[str, Any]] = []
            offered = {"rate": 0.0}
            stop = asyncio.Event()

            async def observe() -> None:
                await source.collect(
                    [target], clock.monotonic()
                )  # the first scrape has no interval
                next_at = time.monotonic() + args.interval
                while not stop.is_set():
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    next_at += args.interval
                    now = time.monotonic()
                    obs = (await source.collect([target], clock.monotonic()))[target.key]
                    window = [
                        r["e2e"]
                        for r in records
                        if r["status"] == 200
                        and now - args.interval <= t_base + r["sent"] + r["e2e"] <= now
                    ]
                    rows.append(
                        {
                            "t": now - t_base,
                            "offered_rps": offered["rate"],
                            "tokens_per_s": obs.tokens_per_s,
                            "ttft_mean_s": obs.latency_s,
                            "ttft_p95_s": obs.ttft_p95_s,
                            "tpot_p95_s": obs.tpot_p95_s,
                            "waiting": obs.waiting,
                            "running": obs.running,
                            "kv_cache_usage": obs.kv_cache_usage,
                            "gpu_free_bytes": obs.gpu_free_bytes,
                            "known": obs.known,
                            "client_e2e_p95_s": bs.pct(window, 95),
                            "client_finished": len(window),
                        }
                    )

            observer = asyncio.create_task(observe())
            tasks: list[asyncio.Task[dict[str, Any]]] = []
            i = 0
            for frac in FRACTIONS[: args.levels]:
                rate = max(0.05, frac * capacity)
                offered["rate"] = rate
                log(f"offered {rate:.2f} requests/s ({frac:.2f} x capacity) for {args.step:.0f} s")
                end = time.monotonic() + args.step
                t = time.monotonic()
                while True:
                    t += rng.expovariate(rate)
                    if t >= end:
                        break
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                    b = body(i)
                    i += 1
                    tasks.append(asyncio.create_task(one(session, url, b, t_base)))
                    tasks[-1].add_done_callback(lambda f: records.append(f.result()))
                await asyncio.sleep(max(0.0, end - time.monotonic()))
            offered["rate"] = 0.0
            # Let the backlog drain for one interval, then stop observing.
            await asyncio.sleep(args.interval)
            stop.set()
            await observer
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        result = {
            "bench": "record_load_trace",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {
                "device": device,
                "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "model": {"shape": cfg, "dtype": str(dtype), "weights": "random"},
            "adapters": {"count": len(adapters), "rank": args.rank, "targets": list(bs.ATTN)},
            "workload": {
                "prompt_tokens": args.prompt_len,
                "max_tokens": args.max_tokens,
                "batch": args.batch,
                "arrivals": "poisson",
                "fractions": list(FRACTIONS[: args.levels]),
                "step_s": args.step,
                "interval_s": args.interval,
            },
            "capacity_rps": capacity,
            "requests": len(records),
            "requests_ok": sum(1 for r in records if r["status"] == 200),
            "rows": rows,
        }
    finally:
        await runner.cleanup()
        await engine.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny model shape (the CPU check); default on cpu"
    )
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--batch", type=int, default=None, help="engine max_num_seqs (default 64 cuda, 8 cpu)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (cpu: 16)")
    ap.add_argument("--levels", type=int, default=len(FRACTIONS))
    ap.add_argument(
        "--step", type=float, default=None, help="seconds per load level (default 16 cuda, 6 cpu)"
    )
    ap.add_argument(
        "--interval", type=float, default=None, help="scrape interval (default 3 cuda, 2 cpu)"
    )
    ap.add_argument(
        "--probe", type=float, default=None, help="capacity probe seconds (default 15 cuda, 8 cpu)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.tiny = args.tiny or cpu
    args.batch = args.batch or (8 if cpu else 64)
    args.max_tokens = args.max_tokens or (16 if cpu else 64)
    args.step = args.step or (6.0 if cpu else 16.0)
    args.interval = args.interval or (2.0 if cpu else 3.0)
    args.probe = args.probe or (8.0 if cpu else 15.0)
    if cpu:
        args.prompt_len = min(args.prompt_len, 64)
    if not math.isfinite(args.step) or args.step < args.interval:
        ap.error("--step must be at least --interval")
    started = time.monotonic()
    result = asyncio.run(main_async(args))
    result["wall_s"] = time.monotonic() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    log(
        f"wrote {args.out}: {len(result['rows'])} rows, {result['requests_ok']}/{result['requests']} requests ok, "
        f"{result['wall_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
