"""Overhead of OpenTelemetry tracing on the worker's request path, at 100% sampling.

The worker service (HTTP parsing, fair queue, metrics, and with tracing on the W3C context
extraction and the request's four spans batched to OTLP/gRPC) in front of an engine that
answers at once (the tests' deterministic fake), so the figure is the service's own cost and
not the model's. Requests go one at a time over a kept-alive connection; tracing off and on
alternate in rounds so drift on the shared box hits both. Spans go to a real OTLP/gRPC receiver
in this process (its decoding runs on the same cores, so the figure is an upper bound).

    PYTHONPATH=src python bench/bench_tracing.py [--requests 3000] [--out bench/results/tracing_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import httpx
from _results import provenance, write_results
from otlp import OtlpReceiver
from worker_service.fakes import FakeEngine

from adaptermesh.tracing import Tracing
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

BODY = {"model": "alpha", "prompt": "a b c d", "max_tokens": 4}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def _round(tracing: Tracing, n: int, headers: dict[str, str]) -> list[float]:
    service = WorkerService(FakeEngine(), ServiceConfig(), tracing)
    runner, port = await serve(service, "127.0.0.1", 0)
    out = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(20):
                await client.post("/v1/completions", json=BODY, headers=headers)
            for _ in range(n):
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=BODY, headers=headers)
                out.append((time.perf_counter() - t0) * 1e6)
                assert r.status_code == 200, r.text
    finally:
        await runner.cleanup()
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    receiver = OtlpReceiver()
    port = receiver.start()
    on = Tracing.from_config(f"127.0.0.1:{port}", 1.0, "bench-worker")
    off = Tracing.off()
    per = max(args.requests // args.rounds, 1)
    lat: dict[str, list[float]] = {"off": [], "on_100pct": [], "on_100pct_with_parent": []}
    for _ in range(args.rounds):
        lat["off"] += await _round(off, per, {})
        lat["on_100pct"] += await _round(on, per, {})
        lat["on_100pct_with_parent"] += await _round(on, per, {"traceparent": TRACEPARENT})
    # The tracing work itself, without the HTTP round trip around it: context extraction,
    # attributes, and the four spans handed to the batch processor, per request.
    service = WorkerService(FakeEngine(), ServiceConfig(), on)
    headers = {"traceparent": TRACEPARENT, "x-tenant-id": "acme"}
    now = time.monotonic()
    job = SimpleNamespace(
        kind="completion",
        adapter="alpha@2.0.0",
        prompt_ids=[1] * 32,
        tenant="id-acme",
        arrived=now - 0.01,
        trace_context=None,
        trace_attrs={"adaptermesh.model": "alpha@2.0.0"},
    )
    ticket = SimpleNamespace(enqueued_at=now - 0.01, admitted_at=now - 0.009)
    reps = args.requests * 5
    t0 = time.perf_counter()
    for _ in range(reps):
        job.trace_context = Tracing.extract(headers)
        service._record_spans(job, ticket, now - 0.005, now - 0.001, "length")  # type: ignore[arg-type]
    direct_us = (time.perf_counter() - t0) * 1e6 / reps
    on.shutdown()
    receiver.stop()
    results = {
        k: {
            "p50_us": _pct(v, 0.5),
            "p90_us": _pct(v, 0.9),
            "p99_us": _pct(v, 0.99),
            "mean_us": round(statistics.fmean(v), 1),
            "n": len(v),
        }
        for k, v in lat.items()
    }
    base = statistics.median(lat["off"])
    for k in ("on_100pct", "on_100pct_with_parent"):
        results[k]["p50_overhead_us"] = round(statistics.median(lat[k]) - base, 1)
    return {
        "results": results,
        "tracing_work_per_request_us": round(direct_us, 1),
        "spans_received": len(receiver.spans),
        "exports": receiver.requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results/tracing_cpu.json")
    args = ap.parse_args()
    got = asyncio.run(main_async(args))
    out = {
        "bench": "bench_tracing",
        "requests_per_setting": args.requests,
        **got,
        **provenance("opentelemetry-sdk"),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
