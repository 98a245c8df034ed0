"""Update-to-ACK latency of the xDS server with real Envoy processes.

For each update: publish a new Assignment (endpoint weights change, as the rebalancer does
every 5 s) with ``SnapshotCache.set_assignment`` and time until the server has received the
ACK of every Envoy (``NodeStatus.acked_at``, recorded on the server's loop when the ACK
arrives). Scenarios:

- ``one_envoy``: one Envoy, weight updates (EDS only) and structural updates (a shard added
  or removed: CDS, EDS, LDS and RDS).
- ``twenty_envoys``: twenty Envoy processes, each with its own node id and snapshot; one
  update publishes to all twenty keys and waits for all twenty ACKs.

Server CPU per update is the process CPU time (all threads of this process: builders, cache,
gRPC server) over the update loop, divided by the number of updates. Envoy runs with
``--concurrency 1``.

    .venv/bin/python bench/bench_xds.py [--updates 300] [--envoys 20] [--out bench/results/xds.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import grpc

from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap, find_envoy
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.proto import assignment_pb2 as ap


def make_assignment(version: int, shards: int, step: int, base_port: int) -> ap.Assignment:
    out = ap.Assignment(version=version, reason="bench")
    for s in range(shards):
        shard = out.shards.add(
            id=f"s{s}",
            index=s,
            weight=10_000 // shards,
            service_address="127.0.0.1",
            service_port=base_port + s,
            state=ap.SHARD_STATE_ACTIVE,
        )
        for e in range(4):
            shard.endpoints.add(
                address="127.0.0.1",
                port=40_000 + 10 * s + e,
                weight=1 + (step + e) % 7,
                adapters=[f"adapter-{s}-{e}-{k}" for k in range(8)],
            )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(latencies_s: list[float], cpu_s: float) -> dict[str, float | int]:
    ms = [x * 1000 for x in latencies_s]
    return {
        "updates": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "server_cpu_ms_per_update": round(cpu_s * 1000 / len(ms), 3),
    }


def run_updates(
    cache: SnapshotCache,
    nodes: list[str],
    updates: int,
    shards: int,
    base_ports: dict[str, int],
    first_version: int,
    structural: bool,
    gap_s: float,
) -> tuple[list[float], float]:
    latencies = []
    cpu0 = time.process_time()
    version = first_version
    for i in range(updates):
        version += 1
        count = shards + (i % 2) if structural else shards
        start = time.monotonic()
        for node in nodes:
            published = cache.set_assignment(
                node, make_assignment(version, count, i + 1, base_ports[node])
            )
        if not cache.wait_for_version(nodes, published, 10):
            raise RuntimeError(f"update {version} not ACKed by all of {len(nodes)} Envoys")
        acked = max(cache.node_status(n).acked_at for n in nodes)  # type: ignore[union-attr]
        latencies.append(acked - start)
        time.sleep(gap_s)
    # Includes the sleeps' zero CPU and the waiting thread's negligible share.
    cpu = time.process_time() - cpu0
    return latencies, cpu


def scenario(
    n_envoys: int, updates: int, shards: int, structural_updates: int, gap_s: float
) -> dict[str, object]:
    cache = SnapshotCache()
    server = XdsServer(cache)
    port = server.start()
    envoys: list[EnvoyProcess] = []
    nodes = [f"bench-{n_envoys}-{i}" for i in range(n_envoys)]
    base_ports = {node: 30_000 + 10 * i for i, node in enumerate(nodes)}
    try:
        for node in nodes:
            cache.set_assignment(node, make_assignment(1, shards, 0, base_ports[node]))
        started = time.monotonic()
        for node in nodes:
            envoy = EnvoyProcess(build_bootstrap(node, port))
            envoys.append(envoy)
            envoy.start(ready_timeout=None)
        for envoy in envoys:
            envoy.wait_ready(60)
        if not cache.wait_for_version(nodes, "1", 30):
            raise RuntimeError("initial config not ACKed")
        startup_s = time.monotonic() - started
        warmup = 10  # not measured: first pushes allocate connection and parser state
        run_updates(cache, nodes, warmup, shards, base_ports, 1, False, gap_s)
        lat, cpu = run_updates(cache, nodes, updates, shards, base_ports, 1 + warmup, False, gap_s)
        result: dict[str, object] = {
            "envoys": n_envoys,
            "shards_per_envoy": shards,
            "endpoints_per_shard": 4,
            "startup_to_all_ready_s": round(startup_s, 3),
            "weight_updates": summary(lat, cpu),
        }
        if structural_updates:
            lat, cpu = run_updates(
                cache,
                nodes,
                structural_updates,
                shards,
                base_ports,
                1 + warmup + updates,
                True,
                gap_s,
            )
            result["structural_updates"] = summary(lat, cpu)
        return result
    finally:
        for envoy in envoys:
            envoy.cleanup()
        server.stop()


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
    return {
        "cpu": cpu_model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "envoy": envoy_version,
        "gpu": None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--structural", type=int, default=100)
    parser.add_argument("--envoys", type=int, default=20)
    parser.add_argument("--updates-many", type=int, default=100)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--out", default="bench/results/xds.json")
    args = parser.parse_args()
    results = {
        "benchmark": "xds update-to-ACK",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "targets": {"one_envoy_p99_ms": 20, "twenty_envoys_p99_ms": 100},
        "one_envoy": scenario(1, args.updates, args.shards, args.structural, args.gap_ms / 1000),
        "many_envoys": scenario(args.envoys, args.updates_many, args.shards, 0, args.gap_ms / 1000),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
