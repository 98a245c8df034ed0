"""Per-protocol cost of AdapterInstance edges, against the HTTP path, through a real Envoy.

One worker (``WorkerService`` with its KServe v2 gRPC listener, around ``InstantEngine`` from
``bench_ws.py``: tokens cost one event-loop turn, so the service, the transports and Envoy
are what is measured) behind one shard listener built by ``mesh/snapshot.py`` with these
AdapterInstance edges (docs/adapter-instance.md):

- ``http_path``: ``http-json`` path ``/v1/plain`` (rewritten to ``/v1/completions``);
- ``http_path_jwt``: the same with scopes: Envoy verifies an HS256 JWT and checks its scope;
- ``http_path_tls``: the same with ``tls``, over one kept-alive TLS connection;
- ``grpc_path``: ``grpc`` service prefix ``/bench.v2.Inference/`` (rewritten to the v2 service);
- ``grpc_json``: ``grpc-json`` path ``/v1/json`` through Envoy's gRPC-JSON transcoder;
- ``grpc_json_jwt``: the same with scopes.

``http_direct`` is the HTTP request straight to the worker, without Envoy. Baselines through
the same Envoy: ``http`` (``POST /v1/completions`` naming the model, the
HTTP path of the mesh) and ``grpc`` (``ModelInfer`` on the v2 service, adapter header set).
"added" is each transport's median minus each baseline's median. One request in flight from a separate client process,
transports interleaved in blocks so drift on a shared machine falls on all alike.

Usage:
    python bench/bench_adapter_protocols.py --out bench/results/adapter_protocols_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from bench_ws import MODEL, PROMPT, InstantEngine, quantiles
from edge_tokens import ISSUER, JWKS, token

SCOPE = "bench:call"
TRANSPORTS = (
    "http_direct",
    "http",
    "http_path",
    "http_path_jwt",
    "http_path_tls",
    "grpc",
    "grpc_path",
    "grpc_json",
    "grpc_json_jwt",
)


def _edges() -> list[Any]:
    from adaptermesh.proto import assignment_pb2 as ap

    return [
        ap.AdapterEdge(name="plain", paths=["/v1/plain"]),
        ap.AdapterEdge(name="scoped", paths=["/v1/scoped"], scopes=[SCOPE]),
        ap.AdapterEdge(name="tls-only", paths=["/v1/tls"], tls=True),
        ap.AdapterEdge(name="grpc-path", protocol="grpc", paths=["/bench.v2.Inference/"]),
        ap.AdapterEdge(name="json-path", protocol="grpc-json", paths=["/v1/json"]),
        ap.AdapterEdge(
            name="json-scoped", protocol="grpc-json", paths=["/v1/json-scoped"], scopes=[SCOPE]
        ),
    ]


# ------------------------------------------------------------------------------------ client
async def client_main(
    port: int, worker: int, ca: str, args: argparse.Namespace
) -> dict[str, list[float]]:
    import aiohttp
    import grpc

    from adaptermesh.proto.adaptermesh.v1 import open_inference_pb2 as pb

    base = f"http://127.0.0.1:{port}"
    tls_base = f"https://127.0.0.1:{port}"
    body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    v2_json = {
        "inputs": [
            {
                "name": "text_input",
                "datatype": "BYTES",
                "shape": [1],
                "contents": {"bytes_contents": [base64.b64encode(PROMPT.encode()).decode()]},
            }
        ],
        "parameters": {
            "max_tokens": {"int64_param": args.max_tokens},
            "temperature": {"double_param": 0.0},
        },
    }
    auth = {"authorization": f"Bearer {token(SCOPE, exp_in=3600)}"}
    req = pb.ModelInferRequest()
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        PROMPT.encode()
    )
    req.parameters["max_tokens"].int64_param = args.max_tokens
    req.parameters["temperature"].double_param = 0.0
    named = pb.ModelInferRequest()
    named.CopyFrom(req)
    named.model_name = MODEL
    context = ssl.create_default_context(cafile=ca)

    samples: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    async with (
        aiohttp.ClientSession() as session,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as tls_session,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        infer_path = channel.unary_unary(
            "/bench.v2.Inference/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )

        async def post(
            s: Any, url: str, payload: Any, headers: dict[str, str] | None = None
        ) -> None:
            async with s.post(url, json=payload, headers=headers) as r:
                text = await r.read()
                assert r.status == 200, (url, r.status, text[:300])

        runs = {
            "http_direct": lambda: post(
                session, f"http://127.0.0.1:{worker}/v1/completions", {**body, "model": MODEL}
            ),
            "http": lambda: post(session, base + "/v1/completions", {**body, "model": MODEL}),
            "http_path": lambda: post(session, base + "/v1/plain", body),
            "http_path_jwt": lambda: post(session, base + "/v1/scoped", body, auth),
            "http_path_tls": lambda: post(tls_session, tls_base + "/v1/tls", body),
            "grpc": lambda: infer(named, metadata=(("x-adapter-id", MODEL),), timeout=30),
            "grpc_path": lambda: infer_path(req, timeout=30),
            "grpc_json": lambda: post(session, base + "/v1/json", v2_json),
            "grpc_json_jwt": lambda: post(session, base + "/v1/json-scoped", v2_json, auth),
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
    return samples


# ------------------------------------------------------------------------------------ server
async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
    from adaptermesh.mesh.cache import SnapshotCache
    from adaptermesh.mesh.edge import EdgeAuthOptions, EdgeTlsOptions
    from adaptermesh.mesh.server import XdsServer
    from adaptermesh.mesh.snapshot import BuildOptions
    from adaptermesh.proto import assignment_pb2 as ap
    from adaptermesh.worker.grpc_v2 import GrpcV2Server
    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "edge.key",
                "-out",
                "edge.pem",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ],
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        engine = InstantEngine()
        service = WorkerService(engine, ServiceConfig(max_running=64))
        runner, http_port = await serve(service, "127.0.0.1", 0)
        grpc_server = GrpcV2Server(service)
        gport = await grpc_server.start("127.0.0.1", 0)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options = dataclasses.replace(
            BuildOptions(),
            grpc_port_offset=gport - http_port,
            edge_auth=EdgeAuthOptions(ISSUER, JWKS),
            edge_tls=EdgeTlsOptions(f"{tmp}/edge.pem", f"{tmp}/edge.key"),
        )
        assignment = ap.Assignment(
            version=1,
            reason="bench",
            adapters=_edges(),
            shards=[
                ap.Shard(
                    id="s0",
                    index=0,
                    weight=10_000,
                    state=ap.SHARD_STATE_ACTIVE,
                    service_address="127.0.0.1",
                    service_port=port,
                    endpoints=[ap.Endpoint(address="127.0.0.1", port=http_port, weight=1)],
                )
            ],
        )
        cache = SnapshotCache(options=options)
        xds = XdsServer(cache)
        xds_port = xds.start()
        cache.set_assignment("bench", assignment)
        envoy = EnvoyProcess(
            build_bootstrap("bench", xds_port, initial_fetch_timeout_s=5.0),
            concurrency=args.envoy_concurrency,
        )
        try:
            envoy.start(ready_timeout=30.0)
            await _wait_routable(port)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--client",
                str(port),
                "--worker",
                str(http_port),
                "--ca",
                f"{tmp}/edge.pem",
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
            envoy_version = envoy.admin_get("/server_info")
        finally:
            envoy.cleanup()
            xds.stop(grace=0.1)
            await grpc_server.stop()
            await runner.cleanup()
    medians = {name: statistics.median(s) for name, s in measured.items()}
    transports = {
        name: {
            "total": quantiles(s),
            "added_p50_ms": {
                base: round((medians[name] - medians[base]) * 1e3, 3) for base in ("http", "grpc")
            },
        }
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
            # A shared box: the load during the run says how much noise to expect.
            "load_average_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
        },
        "versions": {
            "envoy": json.loads(envoy_version).get("version", ""),
            **{n: _version(n) for n in ("aiohttp", "grpcio", "protobuf")},
        },
        "engine": "instant (tokens cost one event-loop turn)",
        "workload": {
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "requests_per_transport": args.rounds * args.block,
            "rounds": args.rounds,
            "block": args.block,
            "warmup": args.warmup,
            "concurrency": 1,
            "envoy_concurrency": args.envoy_concurrency,
        },
        "transports": transports,
        "summary_ms": {
            name: {
                "p50": r["total"]["p50_ms"],
                "p99": r["total"]["p99_ms"],
                "added_p50_vs_http": r["added_p50_ms"]["http"],
                "added_p50_vs_grpc": r["added_p50_ms"]["grpc"],
            }
            for name, r in transports.items()
        },
    }


async def _wait_routable(port: int) -> None:
    import aiohttp

    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the worker never became routable through Envoy")
            await asyncio.sleep(0.1)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="bench/results/adapter_protocols_cpu.json")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--client", metavar="PORT", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        json.dump(asyncio.run(client_main(args.client, args.worker, args.ca, args)), sys.stdout)
        return
    result = asyncio.run(server_main(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary_ms"], indent=2))


if __name__ == "__main__":
    main()
