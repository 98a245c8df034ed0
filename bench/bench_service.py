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

Usage:
    python bench/bench_service.py --device cuda --out bench/results/service_h200.json
    python bench/bench_service.py --device cpu --out /tmp/service_cpu.json   # small smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
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

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
SHAPE_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096}
SHAPE_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 384,
              "max_position_embeddings": 512}
LOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# Prompt token ids are drawn from the tokenizer's byte-level range, so they decode.
PROMPT_ID_RANGE = (3, 384)


def log(msg: str) -> None:
    print(f"[bench_service {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(length)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def summarize(records: list[dict[str, Any]], duration: float, wall: float, slo_ttft: float,
              slo_tpot: float) -> dict[str, Any]:
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
async def _one_http(session: Any, url: str, body: dict[str, Any], tenant: str,
                    t_base: float, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    rec: dict[str, Any] = {"sent": t0 - t_base, "status": 0, "tokens": 0, "ttft": None,
                           "tpot": None, "e2e": None, "adapter": body["model"]}
    first = last = None
    n = 0
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"x-tenant-id": tenant,
                                         "x-request-timeout": str(timeout_s)}) as resp:
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
    rng = random.Random(spec["seed"])
    adapters = spec["adapters"]
    t_base = time.monotonic()

    def body(i: int) -> dict[str, Any]:
        return {"model": adapters[i % len(adapters)] if spec["mode"] == "closed"
                else rng.choice(adapters), "prompt": prompt_ids(spec["seed"] * 100003 + i,
                                                                  spec["prompt_len"]),
                "max_tokens": spec["max_tokens"], "temperature": 0, "stream": True}

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
                tasks.append(asyncio.create_task(_one_http(
                    session, spec["url"], b, b["model"], t_base, spec["timeout_s"])))
                i += 1
            records = list(await asyncio.gather(*tasks))
        else:
            queue = list(range(spec["requests"]))

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    b = body(i)
                    records.append(await _one_http(session, spec["url"], b, f"c{i % 4}",
                                                   t_base, spec["timeout_s"]))

            await asyncio.gather(*[worker() for _ in range(spec["concurrency"])])
    json.dump({"records": records, "wall_s": time.monotonic() - t_base}, sys.stdout)


async def run_client(spec: dict[str, Any]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", json.dumps(spec),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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

    w = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
         "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kvd, h)),
                            ("self_attn.v_proj", (kvd, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            w[p + name + ".weight"] = rnd(*shape)
    return w


def write_adapter(root: Path, name: str, cfg: dict[str, Any], rank: int, seed: int,
                  device: str) -> None:
    import torch
    from safetensors.torch import save_file

    # Drawn on the device: 64 adapters of a 7B shape are ~1 G random numbers.
    g = torch.Generator(device=device).manual_seed(seed)
    h = cfg["hidden_size"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    outs = {"q_proj": h, "k_proj": kvd, "v_proj": kvd, "o_proj": h}
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in ATTN:
            p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            t[p + ".lora_A.weight"] = (torch.randn(rank, h, generator=g, device=device)
                                       * h**-0.5).bfloat16().cpu()
            t[p + ".lora_B.weight"] = (torch.randn(outs[m], rank, generator=g, device=device)
                                       * 0.02).bfloat16().cpu()
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(ATTN),
        "use_rslora": False, "bias": "none", "task_type": "CAUSAL_LM"}))


async def direct_one(engine: Any, i: int, adapter: str, seed: int, args: argparse.Namespace
                     ) -> dict[str, Any]:
    from adaptermesh.worker.types import GenerationRequest, SamplingParams

    req = GenerationRequest(f"d{seed}-{i}", tuple(prompt_ids(seed * 100003 + i, args.prompt_len)),
                            adapter, SamplingParams(max_tokens=args.max_tokens))
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
    return {"status": 200, "tokens": n, "ttft": first - t0, "e2e": last - t0,
            "tpot": (last - first) / (n - 1) if n > 1 else None}


async def direct_closed(engine: Any, adapters: list[str], concurrency: int, requests: int,
                        seed: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
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
    return {reason: service.metrics.registry.get_sample_value(
        "adaptermesh_requests_rejected_total", {"reason": reason}) or 0.0
        for reason in ("tenant_queue_full", "global_queue_full")}


def med(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in records if r[key] is not None)


async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
    from adaptermesh.worker.testing import make_model_config, make_tokenizer

    device = args.device
    cfg = dict(SHAPE_7B if device == "cuda" else SHAPE_TINY)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    model_dir, root = work / "model", work / "adapters"
    model_dir.mkdir()
    root.mkdir()
    make_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(make_model_config("llama", **cfg)))
    adapters = [f"ad{i:02d}" for i in range(args.adapters)]
    t = time.monotonic()
    for i, name in enumerate(adapters):
        write_adapter(root, name, cfg, args.rank, seed=i, device=device)
    log(f"wrote {len(adapters)} adapters in {time.monotonic() - t:.1f}s")
    ecfg = EngineConfig(max_model_len=args.prompt_len + args.max_tokens + 64,
                        max_num_seqs=args.batch, max_loras=len(adapters), max_lora_rank=args.rank,
                        max_num_batched_tokens=max(2048, args.batch + 2 * args.prompt_len),
                        max_prefill_chunk=max(512, args.prompt_len))
    engine = Engine(model_dir, root, device=device, dtype=dtype, config=ecfg,
                    model_name="bench-base", weights=random_weights(cfg, device, dtype))
    await asyncio.gather(*engine.prefetch(adapters))
    service = WorkerService(engine, ServiceConfig(
        max_running=2 * args.batch, max_waiting_per_tenant=args.queue_per_tenant,
        max_waiting_total=args.queue_total, request_timeout_s=args.timeout))
    runner, port = await serve(service, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {
        "bench": "bench_service",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda"
                    else None, "torch": torch.__version__, "python": platform.python_version(),
                    "cpu_count": __import__("os").cpu_count()},
        "model": {"shape": cfg, "dtype": str(dtype), "weights": "random"},
        "adapters": {"count": len(adapters), "rank": args.rank, "targets": list(ATTN)},
        "workload": {"prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens,
                     "engine_batch": args.batch, "service_max_running": 2 * args.batch,
                     "queue_per_tenant": args.queue_per_tenant, "queue_total": args.queue_total,
                     "tenant": "one per adapter (x-tenant-id)", "adapter_choice": "uniform"},
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot,
                "definition": "a request meets the SLO when it got 200, its first token within "
                              "ttft_s of sending, and a mean inter-token time within tpot_s"},
    }
    try:
        if hasattr(engine, "describe"):
            result["engine"] = engine.describe()
        # Warm-up (CUDA graphs for the length buckets used below).
        await direct_closed(engine, adapters, args.batch, 2 * args.batch, 1, args)
        # 1. Capacity with a full batch, called directly.
        recs, wall = await direct_closed(engine, adapters, args.batch, args.batch * args.cal_waves,
                                         2, args)
        capacity = len(recs) / wall
        result["capacity"] = {"req_s": capacity, "tok_s": sum(r["tokens"] for r in recs) / wall,
                              "requests": len(recs), "wall_s": wall}
        log(f"capacity {capacity:.1f} req/s ({result['capacity']['tok_s']:.0f} tok/s)")

        # 3. HTTP overhead against direct calls, same engine, same prompts.
        overhead = []
        for conc in (1, 16):
            n = max(conc * 2, 8)
            direct, _ = await direct_closed(engine, adapters, conc, n, 3, args)
            spec = {"mode": "closed", "url": url, "concurrency": conc, "requests": n, "seed": 3,
                    "adapters": adapters, "prompt_len": args.prompt_len,
                    "max_tokens": args.max_tokens, "timeout_s": args.timeout}
            http = (await run_client(spec))["records"]
            assert all(r["status"] == 200 for r in http), http[:3]
            row = {
                "concurrency": conc, "requests": n,
                "direct": {"ttft_p50_s": med(direct, "ttft"), "tpot_p50_s": med(direct, "tpot")},
                "http": {"ttft_p50_s": med(http, "ttft"), "tpot_p50_s": med(http, "tpot")},
            }
            row["overhead_per_token_us"] = 1e6 * (row["http"]["tpot_p50_s"]
                                                   - row["direct"]["tpot_p50_s"])
            row["overhead_ttft_ms"] = 1e3 * (row["http"]["ttft_p50_s"]
                                             - row["direct"]["ttft_p50_s"])
            row["overhead_per_token_ratio"] = (row["http"]["tpot_p50_s"]
                                               / row["direct"]["tpot_p50_s"])
            overhead.append(row)
            log(f"overhead conc={conc}: {row['overhead_per_token_us']:.0f} us/token, "
                f"ttft +{row['overhead_ttft_ms']:.1f} ms")
        result["http_overhead"] = overhead

        # 2. Open-loop sweep.
        sweep = []
        for k, frac in enumerate(args.fractions):
            rate = frac * capacity
            spec = {"mode": "open", "url": url, "rate": rate, "duration": args.duration,
                    "seed": 100 + k, "adapters": adapters, "prompt_len": args.prompt_len,
                    "max_tokens": args.max_tokens, "timeout_s": args.timeout}
            before = rejected(service)
            out = await run_client(spec)
            row = {"load_fraction": frac, "rate_req_s": rate, "duration_s": args.duration,
                   **summarize(out["records"], args.duration, out["wall_s"], args.slo_ttft,
                             args.slo_tpot)}
            row["rejected_by_queue_bounds"] = {k: v - before[k]
                                               for k, v in rejected(service).items()}
            sweep.append(row)
            log(f"{frac:.2f}x ({rate:.1f} req/s): ttft p50 {row['ttft_s']['p50']} p99 "
                f"{row['ttft_s']['p99']}, tpot p50 {row['tpot_s']['p50']}, "
                f"goodput {row['goodput_req_s']:.1f} req/s, within SLO "
                f"{row['share_within_slo']}, codes {row['status_counts']}")
            result["sweep"] = sweep
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
            while service.inflight:  # the next rate starts from an empty server
                await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
        await engine.shutdown()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    p.add_argument("--timeout", type=float, default=60.0, help="per-request deadline (s)")
    p.add_argument("--queue-per-tenant", type=int, default=8)
    p.add_argument("--queue-total", type=int, default=256)
    args = p.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return 0
    gpu = args.device == "cuda"
    # Defaults: a 7B-shaped run on the GPU; a small smoke run on CPU.
    for name, on_gpu, on_cpu in (("rank", 16, 4), ("batch", 64, 8), ("prompt_len", 128, 16),
                                 ("max_tokens", 64, 16), ("duration", 12.0, 3.0),
                                 ("cal_waves", 3, 2), ("slo_ttft", 1.0, 2.0),
                                 ("slo_tpot", 0.05, 0.25)):
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
