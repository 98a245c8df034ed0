"""Control-plane benchmarks: policy decision time, WatchAssignments fan-out, override latency.

    .venv/bin/python bench/bench_control_plane.py [--out bench/results/control_plane.json]

1. ``policy.decide`` for 1,000 shards x 8 workers (target <= 10 ms), on the columnar
   observation it computes on. Also measured: building those columns from 8,000
   ``WorkerObservation`` objects (``ObservationColumns.from_observation``), and ``decide``
   called with the objects (conversion included), which is what the rebalancer does today.
2. One Assignment fanned out to 1,000 WatchAssignments streams: per-stream delay from the
   Assignment's ``generated_at`` to its arrival (target p99 <= 500 ms).
3. ``SetOverride`` call start to the new version arriving at a watcher (target p99 <= 50 ms).

The server runs as a subprocess (``adaptermesh control-plane``, SQLite synchronous=FULL, the
default) with the loop off, so only the measured calls publish. Clients run in this process
and share the machine's cores with the server: the figures include client-side work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from adaptermesh.control_plane.policy import (
    Observation,
    ObservationColumns,
    PolicyConfig,
    PolicyState,
    ShardObservation,
    WorkerObservation,
    decide,
)
from adaptermesh.proto import assignment_pb2, control_plane_pb2_grpc
from adaptermesh.proto import control_plane_pb2 as cp

TOKEN = "bench-token-0123456789abcdef"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "min": min(xs),
        "mean": statistics.fmean(xs),
        "p50": pct(xs, 50),
        "p90": pct(xs, 90),
        "p99": pct(xs, 99),
        "max": max(xs),
    }


def observation(rng: random.Random, shards: int, workers: int) -> Observation:
    out = {}
    for i in range(shards):
        ws = []
        for k in range(workers):
            ws.append(
                WorkerObservation(
                    address=f"10.{i // 250}.{i % 250}.{k + 1}",
                    port=8000,
                    known=rng.random() > 0.02,
                    waiting=rng.choice([0, 0, 0, rng.uniform(0, 20)]),
                    running=rng.uniform(0, 64),
                    kv_cache_usage=rng.uniform(0, 1),
                    latency_s=rng.uniform(0.05, 2.0),
                    tokens_per_s=rng.uniform(100, 5000),
                    gpu_free_bytes=rng.uniform(1e9, 8e10),
                    resident_adapters=frozenset(f"a{rng.randrange(50)}" for _ in range(4)),
                    requested_adapters=frozenset(f"a{rng.randrange(50)}" for _ in range(3)),
                )
            )
        out[f"shard-{i}"] = ShardObservation(f"shard-{i}", True, tuple(ws))
    return Observation(out)


def bench_policy(repeats: int) -> dict[str, object]:
    rng = random.Random(7)
    cfg = PolicyConfig(min_weight=5)  # 1,000 shards x 50 would exceed the budget's half
    obs = [observation(rng, 1000, 8) for _ in range(4)]
    cols = [ObservationColumns.from_observation(o) for o in obs]

    def run(inputs: list[Observation] | list[ObservationColumns]) -> list[float]:
        state = decide(inputs[0], PolicyState(), 0.0, cfg).state  # warm: estimates exist
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            d = decide(inputs[i % len(inputs)], state, 5.0 * (i + 1), cfg)
            times.append((time.perf_counter() - t0) * 1000)
            state = d.state
        return times

    columns = run(cols)
    convert = []
    for i in range(repeats):
        t0 = time.perf_counter()
        ObservationColumns.from_observation(obs[i % len(obs)])
        convert.append((time.perf_counter() - t0) * 1000)
    objects = run(obs)
    return {
        "shards": 1000,
        "workers_per_shard": 8,
        "ms": summary(columns),
        "target_ms": 10.0,
        "input": "ObservationColumns (numpy columns, one row per worker)",
        "columns_from_objects_ms": summary(convert),
        "decide_from_objects_ms": summary(objects),
    }


class MemorySource:
    """An in-memory load source: every ``collect`` builds fresh ``WorkerObservation`` objects
    from stored readings, as a scrape would, with +-2 % noise on a stationary load. Like
    ``ScrapeSource``, it hands back the previous adapter frozenset of a worker while that set
    is unchanged. No network."""

    def __init__(self, rng: random.Random, keys: list[tuple[str, int]]) -> None:
        self.rng = rng
        self.base = [
            (
                addr,
                port,
                rng.random() > 0.02,
                rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 20)]),
                rng.uniform(0, 64),
                rng.uniform(0, 1),
                rng.uniform(0.05, 2.0),
                rng.uniform(100, 5000),
                rng.uniform(1e9, 8e10),
                frozenset(f"a{rng.randrange(50)}" for _ in range(4)),
                frozenset(f"a{rng.randrange(50)}" for _ in range(3)),
            )
            for addr, port in keys
        ]
        self.build_ms: list[float] = []

    async def collect(self, targets: object, now: float) -> dict[str, WorkerObservation]:
        t0 = time.perf_counter()
        noise = [1.0 + self.rng.uniform(-0.02, 0.02) for _ in range(64)]
        out = {}
        for i, (a, p, known, wait, run, kv, lat, tok, free, res, req) in enumerate(self.base):
            f = noise[i & 63]
            out[f"{a}:{p}"] = WorkerObservation(
                a,
                p,
                known,
                wait * f,
                run * f,
                min(1.0, kv * f),
                lat * f,
                tok * f,
                free,
                res,
                req,
            )
        self.build_ms.append((time.perf_counter() - t0) * 1000)
        return out


def bench_rebalancer(repeats: int) -> dict[str, object]:
    """A whole ``Rebalancer.step()`` at the largest publishable Assignment (``MAX_SHARDS`` = 256
    shards, the BPF maps' size) x 8 workers through a real store (SQLite, FULL sync). The pure
    decision above keeps its 1,000-shard case."""
    from adaptermesh.assignment_rules import MAX_SHARDS
    from adaptermesh.clock import FakeClock
    from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
    from adaptermesh.control_plane.store import Store

    rng = random.Random(11)
    cfg = PolicyConfig(min_weight=5)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "cp.sqlite3")
        clock = FakeClock()
        keys = []
        with store.transaction():
            for i in range(MAX_SHARDS):
                s = assignment_pb2.Shard(
                    id=f"shard-{i:04d}", state=assignment_pb2.SHARD_STATE_ACTIVE
                )
                for k in range(8):
                    addr = f"10.{i // 250}.{i % 250}.{k + 1}"
                    s.endpoints.add(address=addr, port=8000)
                    keys.append((addr, 8000))
                s.steer.tunnel.remote_ipv4 = "192.0.2.1"
                s.steer.tunnel.vni = i + 1
                store.upsert_shard(s, clock.time())
        source = MemorySource(rng, keys)
        rb = Rebalancer(store, source, clock=clock, config=RebalancerConfig(policy=cfg))
        loop = asyncio.new_event_loop()
        for _ in range(40):  # converge: weights stop moving, so most steps publish nothing
            loop.run_until_complete(rb.step())
            clock.step(5)
        source.build_ms.clear()
        steps: list[float] = []
        published: list[float] = []
        quiet: list[float] = []
        for _ in range(repeats):
            before = rb.publishes
            t0 = time.perf_counter()
            loop.run_until_complete(rb.step())
            ms = (time.perf_counter() - t0) * 1000
            clock.step(5)
            steps.append(ms)
            (published if rb.publishes > before else quiet).append(ms)
        # The decision path alone: readings -> columns on the cached layout -> decide.
        workers = [loop.run_until_complete(source.collect(None, 0.0)) for _ in range(4)]
        path: list[float] = []
        state = rb.state
        for i in range(repeats):
            t0 = time.perf_counter()
            cols, _ = rb.columns(workers[i % 4])
            d = decide(cols, state, clock.time() + 5.0 * i, cfg)
            path.append((time.perf_counter() - t0) * 1000)
            state = d.state
        build = list(source.build_ms[:repeats])
        loop.close()
        store.close()
    return {
        "shards": MAX_SHARDS,
        "workers_per_shard": 8,
        "source": f"in-memory fake: builds {8 * MAX_SHARDS:,} fresh WorkerObservation objects per collect",
        "store": "SQLite WAL, synchronous=FULL",
        "step_ms": summary(steps),
        "step_without_publish_ms": summary(quiet) if quiet else None,
        "step_with_publish_ms": summary(published) if published else None,
        "publishing_steps": len(published),
        "source_collect_ms": summary(build),
        "observation_to_decision_ms": summary(path),
        "observation_to_decision_note": "Rebalancer.columns (readings into the cached column "
        "layout, overrides read from the store) + policy.decide; excludes the source",
        "target_ms": 10.0,
    }


def start_server(state_dir: Path) -> tuple[subprocess.Popen[str], str]:
    tokens = state_dir / "tokens"
    tokens.write_text(f"{TOKEN} read,write,rollout,report bench nodes=*\n")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adaptermesh.control_plane.cli",
            "--state-dir",
            str(state_dir / "db"),
            "--listen",
            "127.0.0.1:0",
            "--tokens-file",
            str(tokens),
            "--no-rebalance",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT / "src")},
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("listening on"):
        p.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return p, line.split()[-1]


MD = [("authorization", f"Bearer {TOKEN}")]


async def seed(stub: control_plane_pb2_grpc.ControlPlaneStub, shards: int) -> None:
    for i in range(shards):
        s = assignment_pb2.Shard(id=f"s{i}")
        for k in range(4):
            s.endpoints.add(address=f"10.0.{i}.{k + 1}", port=8000)
        s.steer.tunnel.remote_ipv4 = "192.0.2.1"
        s.steer.tunnel.vni = i + 1
        await stub.UpsertShard(cp.UpsertShardRequest(shard=s), metadata=MD)


async def bench_fanout(addr: str, streams: int, rounds: int, channels: int) -> dict[str, object]:
    chans = [grpc.aio.insecure_channel(addr) for _ in range(channels)]
    stubs = [control_plane_pb2_grpc.ControlPlaneStub(c) for c in chans]
    await seed(stubs[0], 16)
    current = (await stubs[0].GetAssignment(cp.GetAssignmentRequest(), metadata=MD)).version
    arrivals: dict[int, list[float]] = {}
    ready = 0
    all_ready = asyncio.Event()

    async def watcher(stub: control_plane_pb2_grpc.ControlPlaneStub) -> None:
        nonlocal ready
        call = stub.WatchAssignments(cp.WatchAssignmentsRequest(from_version=0), metadata=MD)
        first = True
        async for a in call:
            now = time.time()
            if first:
                first = False
                ready += 1
                if ready == streams:
                    all_ready.set()
                continue
            gen = a.generated_at.seconds + a.generated_at.nanos / 1e9
            arrivals.setdefault(a.version, []).append(now - gen)
            if (
                len(arrivals) >= rounds
                and all(len(v) >= 1 for v in arrivals.values())
                and a.version >= current + rounds
            ):
                call.cancel()
                return

    tasks = [asyncio.create_task(watcher(stubs[i % channels])) for i in range(streams)]
    await asyncio.wait_for(all_ready.wait(), 120)
    delays: list[float] = []
    completes: list[float] = []
    for r in range(rounds):
        await stubs[0].SetOverride(
            cp.SetOverrideRequest(shard_id="s0", weight=1000 + 10 * (r % 50), reason=f"bench {r}"),
            metadata=MD,
        )
        v = current + r + 1
        deadline = time.time() + 30
        while len(arrivals.get(v, [])) < streams and time.time() < deadline:
            await asyncio.sleep(0.005)
        got = arrivals.get(v, [])
        delays += [d * 1000 for d in got]
        completes.append(max(got) * 1000 if got else float("inf"))
        if len(got) < streams:
            raise RuntimeError(f"round {r}: only {len(got)} of {streams} streams got version {v}")
        await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in chans:
        await c.close()
    return {
        "streams": streams,
        "rounds": rounds,
        "client_channels": channels,
        "shards_in_assignment": 16,
        "per_stream_delay_ms": summary(delays),
        "last_stream_delay_ms": summary(completes),
        "target_p99_ms": 500.0,
    }


async def bench_override(addr: str, calls: int) -> dict[str, object]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
        version = (await stub.GetAssignment(cp.GetAssignmentRequest(), metadata=MD)).version
        call = stub.WatchAssignments(cp.WatchAssignmentsRequest(from_version=version), metadata=MD)
        it = call.__aiter__()
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            await stub.SetOverride(
                cp.SetOverrideRequest(shard_id="s1", weight=500 + (i % 2) * 100, reason="bench"),
                metadata=MD,
            )
            a = await asyncio.wait_for(it.__anext__(), 10)
            times.append((time.perf_counter() - t0) * 1000)
            assert a.version == version + i + 1, (a.version, version + i + 1)
        call.cancel()
    return {
        "calls": calls,
        "ms": summary(times),
        "target_p99_ms": 50.0,
        "note": "SetOverride start to the watcher receiving the new version; includes one "
        "SQLite transaction with synchronous=FULL (fsync)",
    }


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane.json"))
    ap.add_argument("--policy-repeats", type=int, default=200)
    ap.add_argument("--policy-only", action="store_true", help="skip the gRPC benchmarks")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--channels", type=int, default=20)
    ap.add_argument("--override-calls", type=int, default=200)
    args = ap.parse_args()
    result: dict[str, object] = {
        "benchmark": "control_plane",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "grpcio": grpc.__version__,
            # Other work shares these cores; a load above the core count inflates every figure.
            "loadavg_at_start": list(os.getloadavg()),
        },
    }
    print("policy...", file=sys.stderr)
    result["policy_decide"] = bench_policy(args.policy_repeats)
    print("rebalancer step...", file=sys.stderr)
    result["rebalancer_step"] = bench_rebalancer(args.policy_repeats)
    if args.policy_only:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())  # type: ignore[index]
        print(json.dumps(result, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_server(Path(tmp))
        try:
            print("fan-out...", file=sys.stderr)
            result["watch_fanout"] = asyncio.run(
                bench_fanout(addr, args.streams, args.rounds, args.channels)
            )
            print("override...", file=sys.stderr)
            result["override_to_watcher"] = asyncio.run(bench_override(addr, args.override_calls))
        finally:
            proc.terminate()
            proc.wait(10)
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())  # type: ignore[index]
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
