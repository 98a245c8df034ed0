"""Per-request cost of WebSocket streaming (``GET /v1/ws``) against HTTP SSE streaming.

Server side (this process): the ``WorkerService`` with ``/v1/ws`` mounted, on 127.0.0.1,
around an engine. By default the engine is ``InstantEngine`` below, which yields its tokens
with no model work, so what is measured is the service and transport alone; ``--engine tiny``
puts the real ``Engine`` with a tiny random Llama behind it (``--device cuda`` on a GPU).
Client side: a separate process (this file with ``--client``), so load generation does not
share the server's event loop.

Measured, in one run, transports interleaved in blocks so that drift on a shared machine
falls on all of them alike:
- ``engine_direct``: the same request through ``engine.submit`` in the server process.
- ``http_sse``: ``POST /v1/completions`` with ``stream: true`` (aiohttp client, keep-alive).
- ``ws_aiohttp`` and ``ws_websockets``: ``/v1/ws``, one socket kept open, with aiohttp's
  client and with the ``websockets`` client.
Per transport and concurrency (requests in flight: 1, and 16 on one socket or 16 keep-alive
connections): time to first token and to the last token, p50 and p99; "added" is the
per-request latency minus the engine-direct median, so it is what the HTTP or WebSocket path
adds to each request.

Usage:
    python bench/bench_ws.py --out bench/results/ws_cpu.json
    python bench/bench_ws.py --engine tiny --device cuda --out bench/results/ws_cuda.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

PROMPT = "The quick brown fox jumps over the lazy dog"
MODEL = "bench-base"


# ------------------------------------------------------------------------------------ engine
class InstantEngine:
    """An ``EngineProtocol`` engine whose tokens cost nothing: one per event-loop turn."""

    model_name = MODEL
    max_model_len = 4096
    max_token_chars = 16
    on_gpu = False

    def __init__(self) -> None:
        self.generated = 0

    def submit(self, request: Any) -> Any:
        from adaptermesh.worker.types import TokenEvent

        engine = self

        class Stream:
            cancelled = False

            def cancel(self) -> None:
                self.cancelled = True

            def __aiter__(self) -> AsyncIterator[Any]:
                return self._run()

            async def _run(self) -> AsyncIterator[Any]:
                n = request.sampling.max_tokens
                prompt = len(request.prompt_token_ids)
                for i in range(n):
                    await asyncio.sleep(0)
                    if self.cancelled:
                        yield TokenEvent(None, "", "cancelled", prompt, i)
                        return
                    engine.generated += 1
                    last = i + 1 == n
                    yield TokenEvent(i % 1000, f" t{i}", "length" if last else None, prompt, i + 1)

        return Stream()

    def tokenize(self, text: str) -> list[int]:
        return [len(w) for w in text.split()] or [0]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(f" t{t}" for t in token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int] | None:
        return self.tokenize(" ".join(m["content"] for m in messages))

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> Any:
        raise NotImplementedError

    async def unload_adapter(self, name: str) -> None:
        raise NotImplementedError

    def list_adapters(self) -> list[Any]:
        return []

    def knows_adapter(self, name: str) -> bool:
        return False

    async def locate_adapter(self, name: str) -> str | None:
        return None

    def stats(self) -> Any:
        from adaptermesh.worker.types import EngineStats

        return EngineStats(
            num_waiting=0,
            num_running=0,
            kv_cache_usage=0.0,
            gpu_slots_used=0,
            gpu_slots_total=0,
            adapter_hits=0,
            adapter_misses=0,
            adapter_evictions=0,
            free_gpu_bytes=0,
            generated_tokens=self.generated,
        )

    async def shutdown(self) -> None:
        return None


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 4),
        "p99_ms": round(p99 * 1e3, 4),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 4),
    }


# ------------------------------------------------------------------------------------ client
async def one_sse(session: Any, url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, r.status
        async for line in r.content:
            if line.startswith(b"data: {"):
                if not tokens:
                    first = time.perf_counter()
                tokens += 1
            elif line.startswith(b"data: [DONE]"):
                break
    return first - started, time.perf_counter() - started, tokens


class WsClient:
    """One socket, many requests in flight; each awaits its own messages."""

    def __init__(self, send: Any, waiters: dict[int, asyncio.Queue[dict[str, Any]]]) -> None:
        self.send = send
        self.waiters = waiters
        self.next_id = 0

    async def one(self, body: dict[str, Any]) -> tuple[float, float, int]:
        cid = self.next_id
        self.next_id += 1
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.waiters[cid] = queue
        started = time.perf_counter()
        await self.send(json.dumps({"id": cid, **body}))
        first = 0.0
        tokens = 0
        while True:
            msg = await queue.get()
            if msg["type"] == "token":
                if not tokens:
                    first = time.perf_counter()
                tokens += 1
            else:
                assert msg["type"] == "done", msg
                break
        del self.waiters[cid]
        return first - started, time.perf_counter() - started, tokens


async def ws_reader(recv: Any, waiters: dict[int, asyncio.Queue[dict[str, Any]]]) -> None:
    while True:
        msg = json.loads(await recv())
        waiters[msg["id"]].put_nowait(msg)


async def run_block(
    one: Any, body: dict[str, Any], n: int, concurrency: int, out: dict[str, list[float]]
) -> None:
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            ttft, total, tokens = await one(body)
            assert tokens == body["max_tokens"], tokens
            out["ttft"].append(ttft)
            out["total"].append(total)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def client_main(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import websockets

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    ws_url = url.replace("http://", "ws://") + "/v1/ws"
    results: dict[str, Any] = {}
    for concurrency in (1, 16):
        samples = {
            name: {"ttft": [], "total": []} for name in ("http_sse", "ws_aiohttp", "ws_websockets")
        }
        # The SSE session's connection pool holds exactly ``concurrency`` connections; the
        # WebSocket has a session (and pool) of its own.
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            aiohttp.ClientSession() as ws_session,
            ws_session.ws_connect(ws_url, max_msg_size=0) as ws_a,
            websockets.connect(ws_url, max_size=None) as ws_w,
        ):
            waiters_a: dict[int, asyncio.Queue[dict[str, Any]]] = {}
            waiters_w: dict[int, asyncio.Queue[dict[str, Any]]] = {}
            readers = [
                asyncio.create_task(ws_reader(ws_a.receive_str, waiters_a)),
                asyncio.create_task(ws_reader(ws_w.recv, waiters_w)),
            ]
            clients = {
                "http_sse": lambda b: one_sse(session, url, b),
                "ws_aiohttp": WsClient(ws_a.send_str, waiters_a).one,
                "ws_websockets": WsClient(ws_w.send, waiters_w).one,
            }
            for one in clients.values():  # warm-up
                await run_block(one, body, args.warmup, concurrency, {"ttft": [], "total": []})
            for _ in range(args.rounds):
                for name, one in clients.items():
                    await run_block(one, body, args.block, concurrency, samples[name])
            for task in readers:
                task.cancel()
        results[f"concurrency_{concurrency}"] = samples
    return results


# ------------------------------------------------------------------------------------ server
async def direct_latencies(engine: Any, args: argparse.Namespace) -> list[float]:
    """The same request through ``engine.submit`` in this process, one at a time."""
    from adaptermesh.worker.types import GenerationRequest, SamplingParams

    ids = tuple(engine.tokenize(PROMPT))
    out = []
    for i in range(args.warmup + args.rounds * args.block):
        request = GenerationRequest(
            f"direct-{i}", ids, None, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        )
        started = time.perf_counter()
        async for event in engine.submit(request):
            if event.finish_reason is not None:
                break
        if i >= args.warmup:
            out.append(time.perf_counter() - started)
    return out


def build_engine(args: argparse.Namespace, tmp: Path) -> tuple[Any, dict[str, Any]]:
    if args.engine == "instant":
        return InstantEngine(), {
            "engine": "InstantEngine (no model work; tokens cost one event-loop turn)"
        }
    import torch

    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh_testkit.checkpoints import make_tiny_model

    model = make_tiny_model(tmp / "tiny", max_position_embeddings=1024)
    (tmp / "adapters").mkdir()
    engine = Engine(
        model,
        tmp / "adapters",
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        config=EngineConfig(max_num_seqs=32),
        model_name=MODEL,
    )
    info: dict[str, Any] = {
        "engine": f"Engine, tiny random Llama on {args.device}",
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return engine, info


async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
    from adaptermesh.worker.ws import mount_websocket

    with tempfile.TemporaryDirectory() as tmp:
        engine, engine_info = build_engine(args, Path(tmp))
        service = WorkerService(engine, ServiceConfig(max_running=64))
        mount_websocket(service)
        runner, port = await serve(service, "127.0.0.1", 0)
        try:
            direct = await direct_latencies(engine, args)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--client",
                f"http://127.0.0.1:{port}",
                "--max-tokens",
                str(args.max_tokens),
                "--rounds",
                str(args.rounds),
                "--block",
                str(args.block),
                "--warmup",
                str(args.warmup),
                stdout=subprocess.PIPE,
            )
            out, _ = await proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"client failed with status {proc.returncode}")
            measured = json.loads(out)
        finally:
            await runner.cleanup()
            await engine.shutdown()
    direct_median = statistics.median(direct)
    transports: dict[str, Any] = {}
    for level, samples in measured.items():
        transports[level] = {}
        for name, s in samples.items():
            transports[level][name] = {
                "ttft": quantiles(s["ttft"]),
                "total": quantiles(s["total"]),
                "added": quantiles([t - direct_median for t in s["total"]]),
            }
    c1 = transports["concurrency_1"]
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": {name: _version(name) for name in ("aiohttp", "websockets")},
        **engine_info,
        "workload": {
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "requests_per_transport_and_level": args.rounds * args.block,
            "rounds": args.rounds,
            "block": args.block,
            "warmup": args.warmup,
            "concurrency_16": "16 requests in flight: 16 keep-alive connections "
            "for SSE, one socket for each WebSocket client",
        },
        "engine_direct": quantiles(direct),
        "transports": transports,
        "summary_concurrency_1_added_ms": {
            name: {"p50": r["added"]["p50_ms"], "p99": r["added"]["p99_ms"]}
            for name, r in c1.items()
        },
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="bench/results/ws_cpu.json")
    parser.add_argument("--engine", choices=["instant", "tiny"], default="instant")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        json.dump(asyncio.run(client_main(args.client, args)), sys.stdout)
        return
    result = asyncio.run(server_main(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("engine_direct", "summary_concurrency_1_added_ms")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
