"""Latency the ext_proc filter (adapter by body) adds to a request through Envoy.

Two real Envoys get the same one-shard Assignment from one xDS server each and front the same
fake upstream (aiohttp, answering a fixed completion): one with the listener's ext_proc filter
(``BuildOptions(ext_proc=...)``, buffered body) calling the agent's processor in a process of
its own, as in the agent; one without. A third Envoy routes by the body natively
(``BuildOptions(route_by_body=True)``: Envoy's json_to_metadata filter, no processor). Requests alternate between the two on one keep-alive connection each, so drift
(CPU frequency, other load) hits both alike. Each request is an OpenAI completion body naming
an adapter (``{"model": "sql", ...}``) with no adapter header; the filtered path must reach the
adapter's worker with ``x-adapter-id`` set, which is checked on every request.

Reported: p50/p90/p99 of each path, the differences of those percentiles from the plain path
(the added latency), and percentiles of the paired per-request differences.

    .venv/bin/python bench/bench_extproc.py [--requests 5000] [--warmup 300] \\
        [--out bench/results/extproc.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import http.client
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import grpc
from aiohttp import web

from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap, find_envoy
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import BuildOptions, ExtProcOptions
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh_testkit.cpusample import cpu_seconds

LOOPBACK = "127.0.0.1"
BODY = json.dumps(
    {
        "model": "sql",
        "prompt": "Write a query that counts the rows of t.",
        "max_tokens": 16,
        "temperature": 0,
    }
).encode()


class Upstream:
    """A fake worker on its own thread: answers every POST with a fixed completion that names
    the adapter header it got."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def answer(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(
                {
                    "object": "text_completion",
                    "adapter": request.headers.get("x-adapter-id"),
                    "choices": [{"index": 0, "text": "SELECT count(*) FROM t;"}],
                }
            )

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, LOOPBACK, 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        self.loop.run_forever()


def serve_processor(assignment: bytes, conn: Connection, port: int) -> None:
    """Child process: the agent's ext_proc server over ``assignment``; sends its port, then
    serves until the parent closes the pipe."""
    book = EndpointBook()
    book.set_assignment(ap.Assignment.FromString(assignment))
    server = ExtProcServer(book, ExtProcConfig(base_model="base"), port=port)
    conn.send(server.start())
    with contextlib.suppress(EOFError):
        conn.recv()
    server.stop()


def process_cpu_s(pid: int | None) -> float:
    used = None if pid is None else cpu_seconds(pid)
    if used is None:
        raise RuntimeError(f"the external processor (pid {pid}) is gone")
    return used


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def start_path(
    upstream: int,
    options: BuildOptions,
    ext_proc_port: int | None,
) -> tuple[XdsServer, EnvoyProcess, int, ap.Assignment]:
    cache = SnapshotCache(options=options)
    server = XdsServer(cache)
    xds_port = server.start()
    port = free_port()
    assignment = ap.Assignment(
        version=1,
        reason="bench",
        shards=[
            ap.Shard(
                id="s0",
                index=0,
                weight=10_000,
                state=ap.SHARD_STATE_ACTIVE,
                service_address=LOOPBACK,
                service_port=port,
                endpoints=[
                    ap.Endpoint(address=LOOPBACK, port=upstream, weight=1, adapters=["sql"])
                ],
            )
        ],
    )
    cache.set_assignment("bench", assignment)
    envoy = EnvoyProcess(build_bootstrap("bench", xds_port, ext_proc_port=ext_proc_port))
    envoy.start(ready_timeout=30)
    return server, envoy, port, assignment


def one(conn: http.client.HTTPConnection) -> tuple[float, dict[str, object]]:
    t0 = time.perf_counter_ns()
    conn.request("POST", "/v1/completions", body=BODY, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = (time.perf_counter_ns() - t0) / 1e3
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
    return elapsed, json.loads(data)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(percentile(values, 50), 1),
        "p90_us": round(percentile(values, 90), 1),
        "p99_us": round(percentile(values, 99), 1),
        "mean_us": round(statistics.fmean(values), 1),
    }


def machine() -> dict[str, object]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    envoy_version = (
        subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, check=False)
        .stdout.strip()
        .split("version:")[-1]
        .strip()
    )
    # Other work on the machine shows in both paths, but the filtered one has two more
    # process hops (Envoy -> processor -> Envoy), each a scheduling wait when cores are busy.
    return {
        "cpu": cpu_model,
        "cores": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "envoy": envoy_version,
        "gpu": None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--out", default="bench/results/extproc.json")
    args = parser.parse_args()

    info = machine()
    upstream = Upstream()
    plain_opts = BuildOptions()
    filtered_opts = dataclasses.replace(plain_opts, ext_proc=ExtProcOptions())
    plain = start_path(upstream.port, plain_opts, None)
    # The processor's port must be in the bootstrap before Envoy starts: reserve one.
    ext_port = free_port()
    parent, child = multiprocessing.get_context("spawn").Pipe()
    assignment = ap.Assignment(
        version=1,
        shards=[
            ap.Shard(
                id="s0",
                endpoints=[
                    ap.Endpoint(address=LOOPBACK, port=upstream.port, weight=1, adapters=["sql"])
                ],
            )
        ],
    )
    processor = multiprocessing.get_context("spawn").Process(
        target=serve_processor, args=(assignment.SerializeToString(), child, ext_port), daemon=True
    )
    processor.start()
    if parent.recv() != ext_port:
        raise RuntimeError("processor did not bind its port")
    filtered = start_path(upstream.port, filtered_opts, ext_port)
    native = start_path(upstream.port, dataclasses.replace(plain_opts, route_by_body=True), None)
    try:
        conns = {
            name: http.client.HTTPConnection(LOOPBACK, path[2], timeout=10)
            for name, path in (("plain", plain), ("ext_proc", filtered), ("native", native))
        }
        # Until the first health check passes, Envoy has no healthy host.
        deadline = time.monotonic() + 20
        for conn in conns.values():
            while True:
                try:
                    one(conn)
                    break
                except (RuntimeError, OSError, http.client.HTTPException):
                    if time.monotonic() > deadline:
                        raise
                    conn.close()
                    time.sleep(0.1)
        times: dict[str, list[float]] = {"plain": [], "ext_proc": [], "native": []}
        cpu_before = process_cpu_s(processor.pid)
        for i in range(args.warmup + args.requests):
            names = ("plain", "ext_proc", "native")
            for k in range(3):
                name = names[(i + k) % 3]
                elapsed, answer = one(conns[name])
                # The native path routes without setting the header: its upstream holds the
                # adapter either way, so only the ext_proc path is checked here.
                expected = "sql" if name == "ext_proc" else None
                if answer["adapter"] != expected:
                    raise RuntimeError(f"{name}: upstream saw adapter {answer['adapter']!r}")
                if i >= args.warmup:
                    times[name].append(elapsed)
        processor_cpu_us = (
            (process_cpu_s(processor.pid) - cpu_before) * 1e6 / (args.warmup + args.requests)
        )
        paired = [b - a for a, b in zip(times["plain"], times["ext_proc"], strict=True)]
        plain_s, ext_s = summary(times["plain"]), summary(times["ext_proc"])
        native_s = summary(times["native"])
        added = {k: round(ext_s[k] - plain_s[k], 1) for k in plain_s}
        native_added = {k: round(native_s[k] - plain_s[k], 1) for k in plain_s}
        native_paired = [b - a for a, b in zip(times["plain"], times["native"], strict=True)]
        load_after = os.getloadavg()[0]
        results = {
            "benchmark": "ext_proc added latency per request through Envoy",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {**info, "loadavg_1m_after": load_after},
            "setup": {
                "processor": "agent.extproc.ExtProcServer in its own process",
                "requests_per_path": args.requests,
                "warmup_per_path": args.warmup,
                "body_bytes": len(BODY),
                "envoy_concurrency": 1,
                "processing_mode": "request headers SEND, request body BUFFERED, response SKIP",
                "connections": "one keep-alive HTTP/1.1 connection per path, requests alternating",
            },
            "target": {"added_p99_us": 1000},
            "plain": plain_s,
            "ext_proc": ext_s,
            "added": added,
            "paired_difference": summary(paired),
            "native": native_s,
            "native_added": native_added,
            "native_paired_difference": summary(native_paired),
            # CPU time of the processor process (all its threads) per filtered request.
            "processor_cpu_us_per_request": round(processor_cpu_us, 1),
            "target_met": added["p99_us"] <= 1000,
            "native_target_met": native_added["p99_us"] <= 1000,
        }
    finally:
        for server, envoy, _, _ in (plain, filtered, native):
            envoy.cleanup()
            server.stop()
        parent.close()
        processor.join(10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
