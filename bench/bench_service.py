"""Worker-service benchmark: open-loop Poisson load over 64 adapters, light to overload.

Server side (this process): the real ``Engine`` with random weights (Llama-2-7B shape on CUDA,
a tiny shape on CPU), 64 rank-16 adapters on q, k, v, o written in PEFT's format, and the
``WorkerService`` on 127.0.0.1. Client side: a separate process (this file with ``--client``,
importing only aiohttp) that streams completions over HTTP, so load generation does not share
the server's event loop.

Measured, each by this script in one run:
1. Capacity: requests/s the engine completes when called directly with a full batch.
2. Load sweep: Poisson arrivals at fractions of that capacity (0.25x to 1.5x), each request
   naming one of 64 adapters uniformly at random and acting as that adapter's tenant. Per rate:
   TTFT and TPOT p50/p99 (client side, queueing included), 429s, goodput (requests/s and
   tokens/s that met the SLO) and the share of offered requests served within the SLO.
3. HTTP overhead: the same closed-loop workload (concurrency 1 and 16) through HTTP streaming
   and through ``Engine.submit`` in this process; the difference in TTFT and per-token time.

``--mix`` (a separate mode; the default above is unchanged): a serving mix over 64 rank-16
adapters on all seven modules. Prompts uniform in 64..2,048 tokens, outputs uniform in 16..512
(``max_tokens``; random weights rarely sample EOS, and the completion tokens actually received
are recorded), context limit 2,576, streaming, the API's default sampling (no temperature sent:
temperature 1), Poisson arrivals, tenant = adapter. Engine: max_num_seqs 256,
max_num_batched_tokens 2048, max_prefill_chunk 2048, KV from gpu_memory_fraction.
1. Capacity: output tok/s the server completes under a saturating closed loop (256 requests in
   flight), counted by the client over a window after a ramp; the engine's own token counter
   over the same window beside it.
2. Load: Poisson arrivals at 80% of that rate for a fixed time: TTFT and TPOT p50/p95/p99
   (client side, queueing included), output tok/s achieved, and the targets.
The header carries the measured copy bandwidth and bf16 matmul rate and, from them, the floor
this mix puts on output tok/s (prefill FLOPs, KV and weight bytes per output token).

Usage:
    python bench/bench_service.py --device cuda --out bench/results/service_h200.json
    python bench/bench_service.py --device cpu --out /tmp/service_cpu.json   # small smoke run
    python bench/bench_service.py --mix --device cuda --out bench/results/engine_speed_h200_http.json
    python bench/bench_service.py --mix --device cpu --out /tmp/mix_cpu.json   # small smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL7 = (*ATTN, "gate_proj", "up_proj", "down_proj")
SHAPE_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
SHAPE_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 384,
    "max_position_embeddings": 512,
}
LOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# Prompt token ids are drawn from the tokenizer's byte-level range, so they decode.
PROMPT_ID_RANGE = (3, 384)


LOG_NAME = "bench_service"  # the prefix of log lines; a bench that imports this file sets its own


def log(msg: str) -> None:
    print(f"[{LOG_NAME} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(length)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def summarize(
    records: list[dict[str, Any]], duration: float, wall: float, slo_ttft: float, slo_tpot: float
) -> dict[str, Any]:
    """``duration``: the arrival window; ``wall``: until the last response ended (rates of
    completed work divide by it, so a backlog served after the window is not over-counted)."""
    ok = [r for r in records if r["status"] == 200 and r["tokens"] > 0]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    good = [r for r in ok if r["ttft"] <= slo_ttft and (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    codes: dict[str, int] = {}
    for r in records:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    return {
        "offered": len(records),
        "offered_req_s": len(records) / duration,
        "wall_s": wall,
        "completed": len(ok),
        "status_counts": codes,
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
        "goodput_req_s": len(good) / wall,
        "goodput_tok_s": sum(r["tokens"] for r in good) / wall,
        "share_within_slo": len(good) / len(records) if records else None,
    }


# ====================================================================================== client
async def _one_http(
    session: Any, url: str, body: dict[str, Any], tenant: str, t_base: float, timeout_s: float
) -> dict[str, Any]:
    t0 = time.monotonic()
    rec: dict[str, Any] = {
        "sent": t0 - t_base,
        "status": 0,
        "tokens": 0,
        "ttft": None,
        "tpot": None,
        "e2e": None,
        "adapter": body["model"],
    }
    first = last = None
    n = 0
    try:
        async with session.post(
            url + "/v1/completions",
            json=body,
            headers={"x-tenant-id": tenant, "x-request-timeout": str(timeout_s)},
        ) as resp:
            rec["status"] = resp.status
            if resp.status != 200:
                await resp.read()
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"] = chunk["error"].get("code") or "stream_error"
                    break
                if chunk["choices"]:
                    now = time.monotonic()
                    n += 1
                    first = first or now
                    last = now
    except Exception as exc:  # a failed request is a data point, not a crash
        rec["status"] = type(exc).__name__
    rec["tokens"] = n
    if first is not None and last is not None:
        rec["ttft"] = first - t0
        rec["e2e"] = last - t0
        rec["tpot"] = (last - first) / (n - 1) if n > 1 else None
    return rec


async def client_main(args: argparse.Namespace) -> None:
    import aiohttp

    spec = json.loads(args.client)
    if spec["mode"] in ("mix_closed", "mix_open"):
        await mix_client_main(spec)
        return
    rng = random.Random(spec["seed"])
    adapters = spec["adapters"]
    t_base = time.monotonic()

    def body(i: int) -> dict[str, Any]:
        return {
            "model": adapters[i % len(adapters)]
            if spec["mode"] == "closed"
            else rng.choice(adapters),
            "prompt": prompt_ids(spec["seed"] * 100003 + i, spec["prompt_len"]),
            "max_tokens": spec["max_tokens"],
            "temperature": 0,
            "stream": True,
        }

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=spec["timeout_s"] + 30)
    records: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if spec["mode"] == "open":
            tasks = []
            t = 0.0
            i = 0
            while True:
                t += rng.expovariate(spec["rate"])
                if t >= spec["duration"]:
                    break
                delay = t_base + t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                b = body(i)
                tasks.append(
                    asyncio.create_task(
                        _one_http(session, spec["url"], b, b["model"], t_base, spec["timeout_s"])
                    )
                )
                i += 1
            records = list(await asyncio.gather(*tasks))
        else:
            queue = list(range(spec["requests"]))

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    b = body(i)
                    records.append(
                        await _one_http(
                            session, spec["url"], b, f"c{i % 4}", t_base, spec["timeout_s"]
                        )
                    )

            await asyncio.gather(*[worker() for _ in range(spec["concurrency"])])
    json.dump({"records": records, "wall_s": time.monotonic() - t_base}, sys.stdout)


# ================================================================================= mix client
@functools.lru_cache(maxsize=8)
def zipf_cumulative_weights(count: int, exponent: float) -> tuple[float, ...]:
    """Cumulative weights of ranks 1..count under Zipf(exponent): rank k has weight k**-exponent."""
    return tuple(itertools.accumulate((k + 1) ** -exponent for k in range(count)))


def pick_adapter(rng: random.Random, spec: dict[str, Any]) -> str:
    """One adapter of ``spec["adapters"]``: uniform, or with ``spec["zipf"]`` set, Zipf over the
    list's order (the first name is the most popular)."""
    adapters = spec["adapters"]
    exponent = spec.get("zipf")
    if exponent is None:
        return str(rng.choice(adapters))
    weights = zipf_cumulative_weights(len(adapters), float(exponent))
    return str(rng.choices(adapters, cum_weights=weights)[0])


def mix_body(spec: dict[str, Any], i: int) -> dict[str, Any]:
    """Request ``i`` of a mix phase, drawn from (seed, i) alone: the same index gives the same
    request whatever order the workers take them in."""
    rng = random.Random(spec["seed"] * 1_000_003 + i)
    plen = rng.randint(*spec["prompt_range"])
    olen = rng.randint(*spec["output_range"])
    # No temperature/top_p: the API's default sampling.
    return {
        "model": pick_adapter(rng, spec),
        "prompt": prompt_ids(spec["seed"] * 100003 + i, plen),
        "max_tokens": olen,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one_mix(
    session: Any, spec: dict[str, Any], body: dict[str, Any], rec: dict[str, Any], t_base: float
) -> None:
    """Stream one completion into ``rec`` (times in seconds since ``t_base``). A request still
    running when its phase is cut keeps what it received, with ``cut`` set."""
    w0, w1 = spec["window"]
    rec.update(
        sent=time.monotonic() - t_base,
        prompt_tokens=len(body["prompt"]),
        max_tokens=body["max_tokens"],
        adapter=body["model"],
        status=0,
        chunks=0,
        in_window=0,
        in_first_half=0,
        first=None,
        last=None,
        usage_tokens=None,
        done=False,
        cut=False,
    )
    try:
        async with session.post(
            spec["url"] + "/v1/completions",
            json=body,
            headers={"x-tenant-id": body["model"], "x-request-timeout": str(spec["timeout_s"])},
        ) as resp:
            rec["status"] = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"] = chunk["error"].get("code") or "stream_error"
                    break
                if chunk.get("usage"):
                    rec["usage_tokens"] = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:  # one chunk per generated token
                    now = time.monotonic() - t_base
                    rec["chunks"] += 1
                    if rec["first"] is None:
                        rec["first"] = now
                    rec["last"] = now
                    if w0 <= now <= w1:
                        rec["in_window"] += 1
                        if now < (w0 + w1) / 2:
                            rec["in_first_half"] += 1
        rec["done"] = True
    except asyncio.CancelledError:
        rec["cut"] = True
        raise
    except Exception as exc:  # a failed request is a data point, not a crash
        rec["status"] = type(exc).__name__


async def mix_client_main(spec: dict[str, Any]) -> None:
    """``mix_closed``: ``concurrency`` workers, each sending its next request as soon as the
    previous one ends, cut at the end of the window. ``mix_open``: Poisson arrivals at ``rate``
    for ``duration`` seconds, every request served to its end. ``t_base`` is on the monotonic
    clock the server shares, so the server can read its own counters over the same window."""
    import aiohttp

    t_base = spec["t_base"]
    records: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=spec["timeout_s"] + 30)
    await asyncio.sleep(max(0.0, t_base - time.monotonic()))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if spec["mode"] == "mix_closed":
            counter = iter(range(1 << 62))
            end = spec["window"][1]

            async def worker() -> None:
                while time.monotonic() - t_base < end:
                    i = next(counter)
                    rec: dict[str, Any] = {"i": i}
                    records.append(rec)
                    await _one_mix(session, spec, mix_body(spec, i), rec, t_base)

            tasks = [asyncio.create_task(worker()) for _ in range(spec["concurrency"])]
            await asyncio.sleep(max(0.0, t_base + end - time.monotonic()))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            rng = random.Random(spec["seed"] + 1)
            pending = []
            t, i = 0.0, 0
            while True:
                t += rng.expovariate(spec["rate"])
                if t >= spec["duration"]:
                    break
                delay = t_base + t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                rec = {"i": i, "scheduled": t}
                records.append(rec)
                pending.append(
                    asyncio.create_task(_one_mix(session, spec, mix_body(spec, i), rec, t_base))
                )
                i += 1
            # Requests still running max_tail_s after the last arrival are cut (and counted as
            # such), so an overloaded server cannot stretch the phase to the request timeout.
            _, late = await asyncio.wait(pending, timeout=spec["max_tail_s"])
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
    json.dump({"records": records, "t_end": time.monotonic() - t_base}, sys.stdout)


async def run_client(spec: dict[str, Any]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"client failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


# ====================================================================================== server
def random_weights(cfg: dict[str, Any], device: str, dtype: Any, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])

    def rnd(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype)

    w = {
        "model.embed_tokens.weight": rnd(v, h),
        "lm_head.weight": rnd(v, h),
        "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        for name, shape in (
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (kvd, h)),
            ("self_attn.v_proj", (kvd, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (inter, h)),
            ("mlp.up_proj", (inter, h)),
            ("mlp.down_proj", (h, inter)),
        ):
            w[p + name + ".weight"] = rnd(*shape)
    return w


def write_model_skeleton(model_dir: Path, cfg: dict[str, Any]) -> None:
    """A Llama ``config.json`` of shape ``cfg`` and the test kit's byte-level tokenizer (no
    weights: an in-process engine takes them as a dict, a worker process reads safetensors)."""
    from adaptermesh_testkit.checkpoints import make_model_config, make_tokenizer

    make_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(make_model_config("llama", **cfg)))


def write_adapter(
    root: Path,
    name: str,
    cfg: dict[str, Any],
    rank: int,
    seed: int,
    device: str,
    targets: tuple[str, ...] = ATTN,
) -> None:
    import torch
    from safetensors.torch import save_file

    # Drawn on the device: 64 adapters of a 7B shape are ~1 G random numbers.
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    # module -> (in features, out features)
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kvd),
        "v_proj": (h, kvd),
        "o_proj": (h, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            fi, fo = shapes[m]
            p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTN else 'mlp'}.{m}"
            t[p + ".lora_A.weight"] = (
                (torch.randn(rank, fi, generator=g, device=device) * fi**-0.5).bfloat16().cpu()
            )
            t[p + ".lora_B.weight"] = (
                (torch.randn(fo, rank, generator=g, device=device) * 0.02).bfloat16().cpu()
            )
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(targets),
                "use_rslora": False,
                "bias": "none",
                "task_type": "CAUSAL_LM",
            }
        )
    )


async def direct_one(
    engine: Any, i: int, adapter: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    from adaptermesh.worker.types import GenerationRequest, SamplingParams

    req = GenerationRequest(
        f"d{seed}-{i}",
        tuple(prompt_ids(seed * 100003 + i, args.prompt_len)),
        adapter,
        SamplingParams(max_tokens=args.max_tokens),
    )
    t0 = time.monotonic()
    first = last = None
    n = 0
    async for ev in engine.submit(req):
        if ev.token_id is not None:
            now = time.monotonic()
            n += 1
            first = first or now
            last = now
    assert first is not None
    assert last is not None
    return {
        "status": 200,
        "tokens": n,
        "ttft": first - t0,
        "e2e": last - t0,
        "tpot": (last - first) / (n - 1) if n > 1 else None,
    }


async def direct_closed(
    engine: Any,
    adapters: list[str],
    concurrency: int,
    requests: int,
    seed: int,
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], float]:
    queue = list(range(requests))
    out: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            out.append(await direct_one(engine, i, adapters[i % len(adapters)], seed, args))

    t0 = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return out, time.monotonic() - t0


def rejected(service: Any) -> dict[str, float]:
    """429s the service gave so far, by queue bound, from its own Prometheus counters."""
    return {
        reason: service.metrics.registry.get_sample_value(
            "adaptermesh_requests_rejected_total", {"reason": reason}
        )
        or 0.0
        for reason in ("tenant_queue_full", "global_queue_full")
    }


def med(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in records if r[key] is not None)


async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

    device = args.device
    cfg = dict(SHAPE_7B if device == "cuda" else SHAPE_TINY)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    model_dir, root = work / "model", work / "adapters"
    model_dir.mkdir()
    root.mkdir()
    write_model_skeleton(model_dir, cfg)
    adapters = [f"ad{i:02d}" for i in range(args.adapters)]
    t = time.monotonic()
    for i, name in enumerate(adapters):
        write_adapter(root, name, cfg, args.rank, seed=i, device=device)
    log(f"wrote {len(adapters)} adapters in {time.monotonic() - t:.1f}s")
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
        model_name="bench-base",
        weights=random_weights(cfg, device, dtype),
    )
    await asyncio.gather(*engine.prefetch(adapters))
    service = WorkerService(
        engine,
        ServiceConfig(
            max_running=2 * args.batch,
            max_waiting_per_tenant=args.queue_per_tenant,
            max_waiting_total=args.queue_total,
            request_timeout_s=args.timeout,
        ),
    )
    runner, port = await serve(service, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {
        "bench": "bench_service",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": __import__("os").cpu_count(),
        },
        "model": {"shape": cfg, "dtype": str(dtype), "weights": "random"},
        "adapters": {"count": len(adapters), "rank": args.rank, "targets": list(ATTN)},
        "workload": {
            "prompt_tokens": args.prompt_len,
            "max_tokens": args.max_tokens,
            "engine_batch": args.batch,
            "service_max_running": 2 * args.batch,
            "queue_per_tenant": args.queue_per_tenant,
            "queue_total": args.queue_total,
            "tenant": "one per adapter (x-tenant-id)",
            "adapter_choice": "uniform",
        },
        "slo": {
            "ttft_s": args.slo_ttft,
            "tpot_s": args.slo_tpot,
            "definition": "a request meets the SLO when it got 200, its first token within "
            "ttft_s of sending, and a mean inter-token time within tpot_s",
        },
    }
    try:
        if hasattr(engine, "describe"):
            result["engine"] = engine.describe()
        # Warm-up (CUDA graphs for the length buckets used below).
        await direct_closed(engine, adapters, args.batch, 2 * args.batch, 1, args)
        # 1. Capacity with a full batch, called directly.
        recs, wall = await direct_closed(
            engine, adapters, args.batch, args.batch * args.cal_waves, 2, args
        )
        capacity = len(recs) / wall
        result["capacity"] = {
            "req_s": capacity,
            "tok_s": sum(r["tokens"] for r in recs) / wall,
            "requests": len(recs),
            "wall_s": wall,
        }
        log(f"capacity {capacity:.1f} req/s ({result['capacity']['tok_s']:.0f} tok/s)")

        # 3. HTTP overhead against direct calls, same engine, same prompts.
        overhead = []
        for conc in (1, 16):
            n = max(conc * 2, 8)
            direct, _ = await direct_closed(engine, adapters, conc, n, 3, args)
            spec = {
                "mode": "closed",
                "url": url,
                "concurrency": conc,
                "requests": n,
                "seed": 3,
                "adapters": adapters,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "timeout_s": args.timeout,
            }
            http = (await run_client(spec))["records"]
            assert all(r["status"] == 200 for r in http), http[:3]
            row = {
                "concurrency": conc,
                "requests": n,
                "direct": {"ttft_p50_s": med(direct, "ttft"), "tpot_p50_s": med(direct, "tpot")},
                "http": {"ttft_p50_s": med(http, "ttft"), "tpot_p50_s": med(http, "tpot")},
            }
            row["overhead_per_token_us"] = 1e6 * (
                row["http"]["tpot_p50_s"] - row["direct"]["tpot_p50_s"]
            )
            row["overhead_ttft_ms"] = 1e3 * (
                row["http"]["ttft_p50_s"] - row["direct"]["ttft_p50_s"]
            )
            row["overhead_per_token_ratio"] = (
                row["http"]["tpot_p50_s"] / row["direct"]["tpot_p50_s"]
            )
            overhead.append(row)
            log(
                f"overhead conc={conc}: {row['overhead_per_token_us']:.0f} us/token, "
                f"ttft +{row['overhead_ttft_ms']:.1f} ms"
            )
        result["http_overhead"] = overhead

        # 2. Open-loop sweep.
        sweep = []
        for k, frac in enumerate(args.fractions):
            rate = frac * capacity
            spec = {
                "mode": "open",
                "url": url,
                "rate": rate,
                "duration": args.duration,
                "seed": 100 + k,
                "adapters": adapters,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "timeout_s": args.timeout,
            }
            before = rejected(service)
            out = await run_client(spec)
            row = {
                "load_fraction": frac,
                "rate_req_s": rate,
                "duration_s": args.duration,
                **summarize(
                    out["records"], args.duration, out["wall_s"], args.slo_ttft, args.slo_tpot
                ),
            }
            row["rejected_by_queue_bounds"] = {
                k: v - before[k] for k, v in rejected(service).items()
            }
            sweep.append(row)
            log(
                f"{frac:.2f}x ({rate:.1f} req/s): ttft p50 {row['ttft_s']['p50']} p99 "
                f"{row['ttft_s']['p99']}, tpot p50 {row['tpot_s']['p50']}, "
                f"goodput {row['goodput_req_s']:.1f} req/s, within SLO "
                f"{row['share_within_slo']}, codes {row['status_counts']}"
            )
            result["sweep"] = sweep
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
            while service.inflight:  # the next rate starts from an empty server
                await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
        await engine.shutdown()
    return result


# ================================================================================= mix server
def matmul_rate(device: str) -> dict[str, Any]:
    """bf16 (fp32 on CPU) square matmul on random data: TFLOP/s, median of 10 after 3 warm-ups."""
    import torch

    n = 8192 if device == "cuda" else 512
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        if device == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"TFLOP_s": 2 * n**3 / med / 1e12, "n": n, "dtype": str(dtype), "median_s": med}


def mix_floor(
    cfg: dict[str, int],
    dtype_bytes: int,
    prompt: float,
    output: float,
    batch: int,
    adapters: int,
    adapter_bytes: int,
    copy_Bps: float,
    flops: float,
) -> dict[str, Any]:
    """What one request of mean prompt/output length costs the GPU at least, per output token:
    prefill FLOPs (linear layers + causal attention), the KV every decode step reads, and the
    weights and adapters each step reads, shared by ``batch`` rows."""
    from bench_engine_speed import kv_bytes_per_token, weight_bytes_per_step

    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    linear = layers * (2 * h * h + 2 * kvd * h + 3 * h * inter)
    prefill_flops = 2 * linear * prompt + layers * 2 * h * prompt * prompt  # QK^T + PV, causal
    decode_flops = output * 2 * (linear + cfg["vocab_size"] * h)
    kv_bytes = output * (prompt + output / 2) * kv_bytes_per_token(cfg, dtype_bytes)
    step_bytes = (
        weight_bytes_per_step(cfg, dtype_bytes, batch) + min(adapters, batch) * adapter_bytes
    )
    shared_bytes = output * step_bytes / batch
    t_flops = (prefill_flops + decode_flops) / flops
    t_bytes = (kv_bytes + shared_bytes) / copy_Bps
    return {
        "mean_prompt_tokens": prompt,
        "mean_output_tokens": output,
        "rows_per_step": batch,
        "flops_per_request": prefill_flops + decode_flops,
        "bytes_per_request": kv_bytes + shared_bytes,
        "kv_bytes_per_request": kv_bytes,
        "bound_output_tok_s": output / max(t_flops, t_bytes),
        "serial_estimate_output_tok_s": output / (t_flops + t_bytes),
        "note": "bound: FLOPs and bytes fully overlapped (no server does better); serial estimate: "
        "prefill compute and decode memory traffic one after the other",
    }


def _halves(records: list[dict[str, Any]], window_s: float) -> list[float] | None:
    if window_s <= 0:
        return None
    first = sum(r.get("in_first_half", 0) for r in records)
    second = sum(r.get("in_window", 0) for r in records) - first
    return [2 * first / window_s, 2 * second / window_s]


def mix_summary(records: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.get("status") == 200 and r.get("done") and r.get("chunks")]
    ttft = [1e3 * (r["first"] - r["sent"]) for r in ok]
    tpot = [1e3 * (r["last"] - r["first"]) / (r["chunks"] - 1) for r in ok if r["chunks"] > 1]
    codes: dict[str, int] = {}
    for r in records:
        key = "cut" if r.get("cut") else str(r.get("status"))
        codes[key] = codes.get(key, 0) + 1

    def dist(v: list[float]) -> dict[str, float | None]:
        return {
            "p50": pct(v, 50),
            "p95": pct(v, 95),
            "p99": pct(v, 99),
            "mean": statistics.fmean(v) if v else None,
        }

    completion = [r["usage_tokens"] if r["usage_tokens"] is not None else r["chunks"] for r in ok]
    return {
        "requests": len(records),
        "completed": len(ok),
        "status_counts": codes,
        "ttft_ms": dist(ttft),
        "tpot_ms": dist(tpot),
        "window_s": window_s,
        "window_output_tokens": sum(r.get("in_window", 0) for r in records),
        "output_tok_s": sum(r.get("in_window", 0) for r in records) / window_s,
        # The window's two halves: far apart, the window held a transient (the closed loop's
        # first prefill burst, kernels compiling) rather than a steady state.
        "output_tok_s_halves": _halves(records, window_s),
        "completed_output_tokens": sum(completion),
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
        "mean_completion_tokens": statistics.fmean(completion) if completion else None,
        "completion_over_max_tokens": (sum(completion) / sum(r["max_tokens"] for r in ok))
        if ok
        else None,
    }


async def sample_engine(
    engine: Any, t_base: float, window: tuple[float, float], stop: asyncio.Event
) -> dict[str, Any]:
    """The engine's generated-token counter at the window's ends, and its batch every 0.25 s."""
    marks: dict[str, int] = {}
    running: list[int] = []
    waiting: list[int] = []
    while not stop.is_set():
        now = time.monotonic() - t_base
        st = engine.stats()
        if window[0] <= now <= window[1]:
            marks.setdefault("start", st.generated_tokens)
            marks["end"] = st.generated_tokens
            marks.setdefault("t_start", now)  # type: ignore[arg-type]
            marks["t_end"] = now  # type: ignore[assignment]
            running.append(st.num_running)
            waiting.append(st.num_waiting)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
    span = marks.get("t_end", 0) - marks.get("t_start", 0)
    return {
        "engine_output_tok_s": (marks["end"] - marks["start"]) / span if span > 0 else None,
        "mean_running": statistics.fmean(running) if running else None,
        "max_running": max(running, default=None),
        "mean_waiting": statistics.fmean(waiting) if waiting else None,
    }


async def mix_phase(
    engine: Any | None, spec: dict[str, Any], window: tuple[float, float]
) -> dict[str, Any]:
    """One client phase; with an in-process ``engine``, its counters sampled over ``window``
    (``engine`` None: a server in another process, read by the caller; ``"engine"`` is empty)."""
    spec = {**spec, "t_base": time.monotonic() + 2.0, "window": list(window)}
    if engine is None:
        return {"client": await run_client(spec), "engine": {}}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_engine(engine, spec["t_base"], window, stop))
    try:
        out = await run_client(spec)
    finally:
        stop.set()
    return {"client": out, "engine": await sampler}


@dataclasses.dataclass(frozen=True)
class MixSchedule:
    """The timed part of a mix run: a closed loop of ``concurrency`` requests counted over
    [ramp_s, ramp_s + capacity_s], then Poisson arrivals at ``load`` x that rate for ``run_s``."""

    concurrency: int
    ramp_s: float
    capacity_s: float
    run_s: float
    load: float
    max_tail_s: float
    output_range: tuple[int, int]


async def capacity_then_load(
    engine: Any | None,
    base: dict[str, Any],
    schedule: MixSchedule,
    result: dict[str, Any],
    save: Callable[[], None],
    settle: Callable[[], Awaitable[None]],
) -> None:
    """Fill ``result["capacity"]`` and ``result["load"]``; ``settle`` runs between the phases
    (the cut closed-loop requests wind down), ``save`` after the first."""
    # 1. Capacity: closed loop, counted over [ramp, ramp + capacity_s], then cut.
    w = (schedule.ramp_s, schedule.ramp_s + schedule.capacity_s)
    cap = await mix_phase(
        engine, {**base, "mode": "mix_closed", "seed": 11, "concurrency": schedule.concurrency}, w
    )
    summ = mix_summary(cap["client"]["records"], schedule.capacity_s)
    result["capacity"] = {
        **summ,
        "concurrency": schedule.concurrency,
        **cap["engine"],
        "requests_detail": _compact(cap["client"]["records"]),
    }
    log(
        f"capacity: {summ['output_tok_s']:.0f} output tok/s (engine counter "
        f"{cap['engine'].get('engine_output_tok_s')}), mean running "
        f"{cap['engine'].get('mean_running')}"
    )
    save()
    await settle()

    # 2. Poisson load at a fraction of that capacity.
    if summ["output_tok_s"] <= 0:
        raise RuntimeError(f"the capacity phase completed no tokens: {summ['status_counts']}")
    lo_o, hi_o = schedule.output_range
    per_req = (lo_o + hi_o) / 2 * (summ["completion_over_max_tokens"] or 1.0)
    rate = schedule.load * summ["output_tok_s"] / per_req
    ramp = min(schedule.ramp_s, schedule.run_s / 4)
    run = await mix_phase(
        engine,
        {
            **base,
            "mode": "mix_open",
            "seed": 12,
            "rate": rate,
            "duration": schedule.run_s,
            "max_tail_s": schedule.max_tail_s,
        },
        (ramp, schedule.run_s),
    )
    lsum = mix_summary(run["client"]["records"], schedule.run_s - ramp)
    result["load"] = {
        **lsum,
        "load_fraction": schedule.load,
        "rate_req_s": rate,
        "expected_output_tokens_per_request": per_req,
        "offered_output_tok_s": rate * per_req,
        "duration_s": schedule.run_s,
        "tail_s": run["client"]["t_end"] - schedule.run_s,
        **run["engine"],
        "requests_detail": _compact(run["client"]["records"]),
    }
    log(
        f"load {schedule.load:.0%} ({rate:.2f} req/s): ttft p95 {lsum['ttft_ms']['p95']} ms, "
        f"tpot p95 {lsum['tpot_ms']['p95']} ms, {lsum['output_tok_s']:.0f} output tok/s"
    )


def _compact(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Per-request rows for the JSON: sent, ttft, last, chunks, usage tokens, prompt, max_tokens,
    status (times in seconds since the phase's base)."""
    return [
        [
            r.get("sent"),
            r.get("first"),
            r.get("last"),
            r.get("chunks"),
            r.get("usage_tokens"),
            r.get("prompt_tokens"),
            r.get("max_tokens"),
            "cut" if r.get("cut") else r.get("status"),
        ]
        for r in records
    ]


async def mix_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine_speed import adapter_bytes, copy_bandwidth, driver_version, versions

    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
    from adaptermesh.worker.types import SamplingParams

    device = args.device
    gpu = device == "cuda"
    cfg = dict(SHAPE_7B if gpu else SHAPE_TINY)
    dtype = torch.bfloat16 if gpu else torch.float32
    dtype_bytes = 2 if gpu else 4
    out_path = Path(args.out) if args.out else None
    result: dict[str, Any] = {
        "bench": "bench_service --mix",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "device": device,
            "gpu": torch.cuda.get_device_name(0) if gpu else None,
            "driver": driver_version() if gpu else None,
            "hostname": socket.gethostname(),
            "versions": versions(),
            "cpu_count": os.cpu_count(),
        },
        "model": {"shape": cfg, "dtype": str(dtype), "weights": "random"},
        "adapters": {"count": args.adapters, "rank": args.rank, "targets": list(ALL7)},
    }

    def save() -> None:
        if out_path is not None:
            out_path.write_text(json.dumps(result, indent=2, default=str))

    result["machine"]["copy_bandwidth"] = copy_bandwidth(device, (2 << 30) if gpu else (64 << 20))
    result["machine"]["matmul"] = matmul_rate(device)
    if gpu:
        torch.cuda.empty_cache()
    work = Path(tempfile.mkdtemp(prefix="bench-service-mix-"))
    model_dir, root = work / "model", work / "adapters"
    model_dir.mkdir()
    root.mkdir()
    write_model_skeleton(model_dir, cfg)
    adapters = [f"ad{i:02d}" for i in range(args.adapters)]
    t = time.monotonic()
    for i, name in enumerate(adapters):
        write_adapter(root, name, cfg, args.rank, seed=i, device=device, targets=ALL7)
    log(f"wrote {len(adapters)} adapters in {time.monotonic() - t:.1f}s")
    ekw: dict[str, Any] = {
        "max_model_len": args.mix_max_model_len,
        "max_num_seqs": args.mix_max_num_seqs,
        "max_loras": len(adapters),
        "max_lora_rank": args.rank,
        "max_num_batched_tokens": 2048,
        "max_prefill_chunk": 2048,
    }
    if args.gpu_memory_fraction is not None:
        ekw["gpu_memory_fraction"] = args.gpu_memory_fraction
    if args.no_lora_overlap:
        ekw["lora_overlap"] = False
    ecfg = EngineConfig(**ekw)
    t = time.monotonic()
    engine = Engine(
        model_dir,
        root,
        device=device,
        dtype=dtype,
        config=ecfg,
        model_name="bench-base",
        weights=random_weights(cfg, device, dtype),
    )
    await asyncio.gather(*engine.prefetch(adapters))
    log(f"engine built and adapters loaded in {time.monotonic() - t:.1f}s")
    service = WorkerService(
        engine,
        ServiceConfig(
            max_running=args.mix_max_num_seqs,
            max_waiting_per_tenant=args.mix_max_num_seqs,
            max_waiting_total=4096,
            request_timeout_s=args.timeout,
        ),
    )
    runner, port = await serve(service, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    lo_p, hi_p = args.mix_prompt
    lo_o, hi_o = args.mix_output
    result["engine_config"] = {k: getattr(ecfg, k) for k in ekw}
    result["workload"] = {
        "prompt_tokens": f"uniform [{lo_p}, {hi_p}]",
        "max_tokens": f"uniform [{lo_o}, {hi_o}]",
        "max_model_len": args.mix_max_model_len,
        "sampling": "API default (no temperature sent)",
        "stream": True,
        "arrivals": "closed loop, then Poisson",
        "tenant": "one per adapter (x-tenant-id)",
        "adapter_choice": "uniform",
        "closed_concurrency": args.mix_concurrency,
        "load": args.mix_load,
        "ramp_s": args.mix_ramp_s,
        "capacity_s": args.mix_capacity_s,
        "run_s": args.mix_run_s,
        "max_tail_s": args.mix_max_tail_s,
        "service_max_running": args.mix_max_num_seqs,
    }
    result["floor"] = mix_floor(
        cfg,
        dtype_bytes,
        (lo_p + hi_p) / 2,
        (lo_o + hi_o) / 2,
        args.mix_max_num_seqs,
        len(adapters),
        adapter_bytes(cfg, args.rank, dtype_bytes),
        result["machine"]["copy_bandwidth"]["GB_s"] * 1e9,
        result["machine"]["matmul"]["TFLOP_s"] * 1e12,
    )
    base = {
        "url": url,
        "adapters": adapters,
        "prompt_range": [lo_p, hi_p],
        "output_range": [lo_o, hi_o],
        "timeout_s": args.timeout,
    }
    try:
        result["engine"] = engine.describe()
        # Warm-up, in process: every decode batch bucket once (the graph of each is captured
        # now, not inside the timed phases), with sampling at temperature 1 like the API's
        # default, plus a few full-size prefill chunks.
        t = time.monotonic()
        listed = (
            result["engine"].get("decode_buckets") or result["engine"].get("graph_buckets") or ()
        )
        buckets = sorted(
            {x for x in listed if isinstance(x, int)}
            or {1 << k for k in range(args.mix_max_num_seqs.bit_length())} | {args.mix_max_num_seqs}
        )
        # Short prompts and 16 tokens: every request of a bucket is admitted within a step or
        # two, so all of them decode together for a while.
        sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
        for bsz in (x for x in buckets if 0 < x <= args.mix_max_num_seqs):
            await direct_batch(engine, adapters, bsz, min(lo_p, 16), sp)
        await direct_batch(engine, adapters, 4, min(hi_p, args.mix_max_model_len - 16), sp)
        result["warmup_s"] = time.monotonic() - t
        log(f"warm-up over {len(buckets)} batch buckets in {result['warmup_s']:.1f}s")

        async def settle() -> None:  # the cut requests wind down
            t = time.monotonic()
            while service.inflight and time.monotonic() - t < 60:
                await asyncio.sleep(0.1)

        schedule = MixSchedule(
            args.mix_concurrency,
            args.mix_ramp_s,
            args.mix_capacity_s,
            args.mix_run_s,
            args.mix_load,
            args.mix_max_tail_s,
            (lo_o, hi_o),
        )
        await capacity_then_load(engine, base, schedule, result, save, settle)
        result["engine_at_end"] = engine.describe()
    finally:
        result["targets"] = mix_targets(result)
        save()
        await runner.cleanup()
        await engine.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return result


async def direct_batch(engine: Any, adapters: list[str], n: int, prompt_len: int, sp: Any) -> None:
    from adaptermesh.worker.types import GenerationRequest

    async def one(i: int) -> None:
        req = GenerationRequest(
            f"warm-{n}-{prompt_len}-{i}",
            tuple(prompt_ids(7_000_000 + n * 1000 + i, prompt_len)),
            adapters[i % len(adapters)],
            sp,
        )
        async for _ in engine.submit(req):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))


def mix_targets(r: dict[str, Any]) -> dict[str, Any]:
    cap = (r.get("capacity") or {}).get("output_tok_s")
    load = r.get("load") or {}
    tpot = (load.get("tpot_ms") or {}).get("p95")
    ttft = (load.get("ttft_ms") or {}).get("p95")

    def row(value: float | None, target: str, ok: bool) -> dict[str, Any]:
        return {"value": value, "target": target, "met": None if value is None else ok}

    return {
        "http_capacity_output_tok_s": row(cap, ">= 6000", cap is not None and cap >= 6000),
        "http_tpot_p95_at_80pct_ms": row(tpot, "<= 25", tpot is not None and tpot <= 25),
        "http_ttft_p95_at_80pct_ms": row(ttft, "<= 400", ttft is not None and ttft <= 400),
    }


def print_mix_table(r: dict[str, Any]) -> None:
    print("\n== bench_service --mix ==")
    for name, t in r.get("targets", {}).items():
        v = t["value"]
        print(
            f"{name:32s} {('n/a' if v is None else f'{v:.1f}'):>10s} {t['target']:>8s} {t['met']}"
        )
    load = r.get("load") or {}
    if load:
        print(
            f"load {load.get('load_fraction')}: {load.get('rate_req_s', 0):.2f} req/s, "
            f"ttft p50/p95/p99 {[round(x or 0) for x in load['ttft_ms'].values()][:3]} ms, "
            f"tpot p50/p95/p99 {[round(x or 0, 1) for x in load['tpot_ms'].values()][:3]} ms, "
            f"{load.get('output_tok_s', 0):.0f} output tok/s, codes {load.get('status_counts')}"
        )
    fl = r.get("floor") or {}
    if fl:
        print(
            f"floor: bound {fl['bound_output_tok_s']:.0f} output tok/s, serial estimate "
            f"{fl['serial_estimate_output_tok_s']:.0f}"
        )
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="engine decode batch (max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds per load level")
    p.add_argument("--cal-waves", type=int, default=None)
    p.add_argument("--fractions", type=float, nargs="+", default=list(LOAD_FRACTIONS))
    p.add_argument("--slo-ttft", type=float, default=None)
    p.add_argument("--slo-tpot", type=float, default=None)
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="per-request deadline (s); default 60, with --mix 120",
    )
    p.add_argument("--queue-per-tenant", type=int, default=8)
    p.add_argument("--queue-total", type=int, default=256)
    mix = p.add_argument_group("--mix mode (defaults: GPU / CPU)")
    mix.add_argument(
        "--mix", action="store_true", help="the serving-mix benchmark instead of the sweep"
    )
    mix.add_argument(
        "--mix-concurrency",
        type=int,
        default=None,
        help="closed-loop requests in flight (256 / 16)",
    )
    mix.add_argument(
        "--mix-ramp-s", type=float, default=None, help="seconds before counting starts (8 / 1)"
    )
    mix.add_argument(
        "--mix-capacity-s", type=float, default=None, help="closed-loop counting window (60 / 3)"
    )
    mix.add_argument(
        "--mix-run-s", type=float, default=None, help="Poisson arrival window (60 / 3)"
    )
    mix.add_argument(
        "--mix-load", type=float, default=0.8, help="Poisson rate as a fraction of capacity"
    )
    mix.add_argument(
        "--mix-max-tail-s",
        type=float,
        default=None,
        help="after the last arrival, cut requests still running after this (30 / 10)",
    )
    mix.add_argument(
        "--mix-prompt",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="prompt tokens, uniform (64 2048 / 16 128)",
    )
    mix.add_argument(
        "--mix-output",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="max_tokens, uniform (16 512 / 4 32)",
    )
    mix.add_argument(
        "--mix-max-model-len", type=int, default=None, help="context limit (2576 / 176)"
    )
    mix.add_argument(
        "--mix-max-num-seqs", type=int, default=None, help="engine max_num_seqs (256 / 32)"
    )
    mix.add_argument(
        "--no-lora-overlap",
        action="store_true",
        help="LoRA terms after each matmul instead of beside it (EngineConfig.lora_overlap)",
    )
    mix.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=None,
        help="EngineConfig.gpu_memory_fraction (default: the engine's)",
    )
    args = p.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return 0
    gpu = args.device == "cuda"
    if args.mix:
        for name, on_gpu, on_cpu in (
            ("rank", 16, 16),
            ("timeout", 120.0, 60.0),
            ("mix_concurrency", 256, 16),
            ("mix_ramp_s", 8.0, 1.0),
            ("mix_capacity_s", 60.0, 3.0),
            ("mix_run_s", 60.0, 3.0),
            ("mix_prompt", [64, 2048], [16, 128]),
            ("mix_output", [16, 512], [4, 32]),
            ("mix_max_model_len", 2576, 176),
            ("mix_max_num_seqs", 256, 32),
            ("mix_max_tail_s", 30.0, 10.0),
        ):
            if getattr(args, name) is None:
                setattr(args, name, on_gpu if gpu else on_cpu)
        if args.mix_prompt[1] + args.mix_output[1] > args.mix_max_model_len:
            p.error("--mix-prompt HI + --mix-output HI must fit in --mix-max-model-len")
        result = asyncio.run(mix_main(args))
        print_mix_table(result)
        return 0
    if args.timeout is None:
        args.timeout = 60.0
    # Defaults: a 7B-shaped run on the GPU; a small smoke run on CPU.
    for name, on_gpu, on_cpu in (
        ("rank", 16, 4),
        ("batch", 64, 8),
        ("prompt_len", 128, 16),
        ("max_tokens", 64, 16),
        ("duration", 12.0, 3.0),
        ("cal_waves", 3, 2),
        ("slo_ttft", 1.0, 2.0),
        ("slo_tpot", 0.05, 0.25),
    ):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    result = asyncio.run(server_main(args))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
