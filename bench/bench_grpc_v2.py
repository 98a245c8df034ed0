"""Per-request cost of KServe v2 gRPC (``ModelInfer``, ``ModelStreamInfer``) against HTTP.

Server side (this process): the ``WorkerService`` and its ``GrpcV2Server`` on 127.0.0.1,
around an engine: ``InstantEngine`` from ``bench_ws.py`` by default (tokens cost one
event-loop turn, so the service and transport alone are measured), or ``--engine tiny``, the
real ``Engine`` with a tiny random Llama (``--device cuda`` on a GPU). Client side: a separate
process (this file with ``--client``), so load generation does not share the server's loop.

Measured, one request in flight, transports interleaved in blocks so drift on a shared
machine falls on all of them alike:
- ``engine_direct``: the same request through ``engine.submit`` in the server process;
- ``http_json``: ``POST /v1/completions`` (aiohttp client, keep-alive);
- ``http_sse``: the same with ``stream: true``;
- ``grpc_infer``: ``ModelInfer`` with tritonclient's asyncio client (one channel);
- ``grpc_stream``: ``ModelStreamInfer`` on one open stream (grpc.aio with tritonclient's
  messages), until the response flagged ``triton_final_response``.
"added" is each request's latency minus the engine-direct median: what the transport adds.

Usage:
    python bench/bench_grpc_v2.py --out bench/results/grpc_v2_cpu.json
    python bench/bench_grpc_v2.py --engine tiny --device cuda --out bench/results/grpc_v2_cuda.json
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_ws import MODEL, PROMPT, build_engine, direct_latencies, quantiles

TRANSPORTS = ("http_json", "http_sse", "grpc_infer", "grpc_stream")


# ------------------------------------------------------------------------------------ client
async def client_main(http_url: str, grpc_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import grpc
    import numpy as np
    import tritonclient.grpc.aio as tca
    from tritonclient.grpc import InferInput, service_pb2, service_pb2_grpc

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    tensor = InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    params = {"max_tokens": args.max_tokens, "temperature": 0.0}
    raw = service_pb2.ModelInferRequest(model_name=MODEL)
    raw.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    raw.raw_input_contents.append(len(PROMPT).to_bytes(4, "little") + PROMPT.encode())
    raw.parameters["max_tokens"].int64_param = args.max_tokens
    raw.parameters["temperature"].double_param = 0.0

    samples: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(grpc_url) as ch:
        client = tca.InferenceServerClient(grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        requests: asyncio.Queue[Any] = asyncio.Queue()

        async def feed() -> Any:
            while True:
                yield await requests.get()

        call = stub.ModelStreamInfer(feed())

        async def http_json() -> None:
            async with session.post(http_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        async def http_sse() -> None:
            async with session.post(
                http_url + "/v1/completions", json={**body, "stream": True}
            ) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content:
                    pass

        async def grpc_infer() -> None:
            result = await client.infer(MODEL, [tensor], parameters=params)
            assert result.as_numpy("token_ids") is not None

        async def grpc_stream() -> None:
            requests.put_nowait(raw)
            while True:
                message = await call.read()
                assert not message.error_message, message.error_message
                if message.infer_response.parameters["triton_final_response"].bool_param:
                    return

        runs = {
            "http_json": http_json,
            "http_sse": http_sse,
            "grpc_infer": grpc_infer,
            "grpc_stream": grpc_stream,
        }
        for run in runs.values():
            for _ in range(args.warmup):
                await run()
        for _ in range(args.rounds):
            for name, run in runs.items():
                for _ in range(args.block):
                    started = time.perf_counter()
                    await run()
                    samples[name].append(time.perf_counter() - started)
        call.cancel()
        await client.close()
    return samples


# ------------------------------------------------------------------------------------ server
async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    from adaptermesh.worker.grpc_v2 import GrpcV2Server
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

    with tempfile.TemporaryDirectory() as tmp:
        engine, engine_info = build_engine(args, Path(tmp))
        service = WorkerService(engine, ServiceConfig(max_running=64))
        runner, port = await serve(service, "127.0.0.1", 0)
        grpc_server = GrpcV2Server(service)
        gport = await grpc_server.start("127.0.0.1", 0)
        try:
            direct = await direct_latencies(engine, args)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--client",
                f"http://127.0.0.1:{port}",
                "--grpc",
                f"127.0.0.1:{gport}",
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
            await grpc_server.stop()
            await runner.cleanup()
            await engine.shutdown()
    direct_median = statistics.median(direct)
    transports = {
        name: {"total": quantiles(s), "added": quantiles([t - direct_median for t in s])}
        for name, s in measured.items()
    }
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": {
            name: _version(name) for name in ("aiohttp", "grpcio", "tritonclient", "protobuf")
        },
        **engine_info,
        "workload": {
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "requests_per_transport": args.rounds * args.block,
            "rounds": args.rounds,
            "block": args.block,
            "warmup": args.warmup,
            "concurrency": 1,
        },
        "engine_direct": quantiles(direct),
        "transports": transports,
        "summary_added_ms": {
            name: {"p50": r["added"]["p50_ms"], "p99": r["added"]["p99_ms"]}
            for name, r in transports.items()
        },
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="bench/results/grpc_v2_cpu.json")
    parser.add_argument("--engine", choices=["instant", "tiny"], default="instant")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--grpc", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        json.dump(asyncio.run(client_main(args.client, args.grpc, args)), sys.stdout)
        return
    result = asyncio.run(server_main(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("engine_direct", "summary_added_ms")}, indent=2))


if __name__ == "__main__":
    main()
