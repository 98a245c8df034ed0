"""The control plane's memory under the soak's workload, accelerated.

    .venv/bin/python bench/bench_control_plane_memory.py [--cycles 60] [--speed 40] \
        [--compare-src /tmp/before/src] [--tracemalloc] [--malloc-arena-max N] \
        [--out bench/results/control_plane_memory_cpu.json]

What runs: the control plane as a subprocess (``ControlPlaneServer`` with bearer tokens and
INFO logs as in the soak, SQLite ``synchronous=FULL`` as deployed, the rebalancing, rollout
and placement loops on), two shards of one fake worker each (this process serves each
worker's real ``/metrics`` exposition,
``adaptermesh.worker.metrics.ServiceMetrics`` over a stub engine, with requests finishing
between scrapes, so the rebalancer and the rollout controller read moving counters), and
the soak's clients (``bench/bench_faults.py --soak``), all ``--speed`` times faster:

- the rebalancer steps every ``2 s / speed`` (the soak's ``--interval 2``); it scrapes both
  workers on every step;
- one node agent: a WatchAssignments stream open throughout and a ReportLoad every
  ``0.5 s / speed``;
- one change every ``60 s / speed`` in the soak's order, each on a fresh connection as
  adapterctl makes it: override set, pin, rollout start (50 %) and its abort half a change
  later, override clear, unpin, rollout start and abort. One *cycle* is those six changes
  (six soak minutes); the rollout controller ticks every ``1 s / speed`` while a rollout
  runs and scrapes the workers on each tick.

Every ``--sample-every`` cycles the bench signals the server, which writes its RSS (VmRSS,
and its anonymous and file-backed parts), Python's small-object allocator (arenas held,
bytes in use), glibc's heap figures (``mallinfo2``: bytes in use, free bytes held in the heaps, bytes in
mmap'd chunks; ``malloc_info``: the number of heaps, i.e. arenas), its thread count, its
loop counters and, with ``--tracemalloc``, the Python heap (``tracemalloc`` traced bytes)
and the top allocation sites by growth since the first sample after the warm-up. Growth is
measured from the end of the warm-up (``--warmup-cycles``, like the soak's first 5 minutes)
to the last sample, and as a least-squares slope over the samples after the warm-up.
Between samples the bench reads the server's VmRSS every ``--rss-every-s`` seconds, as the
soak's sampler does (``rss_series``).

``--compare-src DIR`` runs the workload first with the server from another source tree (the
code before a change: ``git archive REV src | tar -x -C /tmp/before``, then ``--compare-src
/tmp/before/src``), as run ``before``; ``--tracemalloc`` adds a traced run of each tree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The server subprocess imports the package from BENCH_CP_SRC (set by --src/--compare-src).
sys.path.insert(0, str(Path(os.environ.get("BENCH_CP_SRC") or ROOT / "src")))
sys.path.insert(0, str(ROOT / "bench"))

from _results import provenance, write_results
from heap_probe.heap_figures import malloc_heap_figures

SOAK_INTERVAL_S = 2.0  # bench_faults.py --soak: MeshConfig(interval_s=2.0)
SOAK_REPORT_S = 0.5  # ... report_interval_s=0.5
SOAK_CHANGE_S = 60.0  # soak.run_soak(change_every_s=60)
SOAK_ABORT_S = 30.0  # the rollout's abort, half a minute after its start
SOAK_ROLLOUT_TICK_S = 1.0  # ServerConfig.rollout_tick_s
ADAPTER, TO_VERSION = "support", "2.0.0"
TENANT = "10.0.0.1/32"
# The soak's control plane checks bearer tokens (--tokens-file): so does this one.
TOKEN = "bench-memory-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)


# -- server side (a subprocess: --serve) -------------------------------------------------------


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _malloc_figures(libc: Any, scratch: Path) -> dict[str, int]:
    """glibc's view of the heap: in use, free but held, mmap'd, and the number of arenas."""
    out = malloc_heap_figures(libc)
    if not out:
        return out
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    fp = libc.fopen(str(scratch).encode(), b"w")
    if fp:
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        out["arenas"] = len(re.findall(r"<heap nr=", scratch.read_text()))
    return out


def _rss(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and its anonymous, file-backed and shared parts, in KiB."""
    keys = {"VmRSS:": "rss_kib", "RssAnon:": "rss_anon_kib", "RssFile:": "rss_file_kib"}
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(maxsplit=1)[0] if line else ""
        if key in keys:
            out[keys[key]] = int(line.split()[1])
    return out


def _pymalloc_figures(scratch: Path) -> dict[str, int]:
    """Python's small-object allocator (its arenas are mmap'd, outside glibc's heaps):
    arenas held now and bytes in allocated blocks (``sys._debugmallocstats``)."""
    saved = os.dup(2)
    try:
        with scratch.open("w") as fh:
            os.dup2(fh.fileno(), 2)
            sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    text = scratch.read_text()
    out = {}
    arenas = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    if arenas:
        out["pymalloc_arenas"] = int(arenas.group(1).replace(",", ""))
    if used:
        out["pymalloc_used_kib"] = int(used.group(1).replace(",", "")) // 1024
    return out


async def _serve(args: argparse.Namespace) -> None:
    from adaptermesh.clisetup import setup_logging
    from adaptermesh.control_plane.auth import load_tokens
    from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig

    setup_logging("INFO")  # as the soak's: --log-level INFO, to the log file

    frames = args.serve_tracemalloc
    if frames:
        tracemalloc.start(frames)
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    (state / "tokens").write_text(f"{TOKEN} read,write,rollout,report bench nodes=*\n")
    config = ServerConfig(
        state_dir=state,
        listen="127.0.0.1:0",
        tokens=load_tokens(state / "tokens"),
        interval_s=args.interval,
        rollout_tick_s=args.rollout_tick,
    )
    server = ControlPlaneServer(config)
    port = await server.start()
    libc = _libc()
    samples = Path(args.samples)
    scratch = state / "malloc_info.xml"
    count = 0

    def sample() -> None:
        nonlocal count
        row: dict[str, Any] = {
            **_rss(),
            **_malloc_figures(libc, scratch),
            **_pymalloc_figures(state / "pymalloc.txt"),
            "threads": threading.active_count(),
            "os_threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")),
            "rebalance_steps": server.rebalancer.steps,
            "publishes": server.rebalancer.publishes,
            "rollout_steps": server.rollouts.steps,
            "version": server.store.last_version(),
            "db_kib": sum(p.stat().st_size for p in state.glob("*.sqlite3*")) // 1024,
        }
        if frames:
            gc.collect()
            traced, _peak = tracemalloc.get_traced_memory()
            row["traced_kib"] = traced // 1024
            tracemalloc.take_snapshot().dump(str(samples.with_suffix(f".{count}.snap")))
        count += 1
        with samples.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, sample)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop()


# -- the fake workers ----------------------------------------------------------------------------


class _StubEngine:
    """What ServiceMetrics reads of an engine, with load that moves."""

    model_name = "tiny"
    max_model_len = 2048
    on_gpu = False

    def __init__(self, adapters: tuple[str, ...]) -> None:
        from adaptermesh.worker.types import AdapterInfo

        self.adapters = [AdapterInfo(a, f"/adapters/{a}", 8, True) for a in adapters]
        self.tokens = 0
        self.running = 0

    def stats(self) -> Any:
        from adaptermesh.worker.types import EngineStats

        return EngineStats(
            num_waiting=0,
            num_running=self.running,
            kv_cache_usage=min(1.0, self.running / 16),
            gpu_slots_used=len(self.adapters),
            gpu_slots_total=4,
            adapter_hits=0,
            adapter_misses=0,
            adapter_evictions=0,
            free_gpu_bytes=0,
            generated_tokens=self.tokens,
            running_adapters=tuple(a.name for a in self.adapters[: self.running % 3]),
            max_loras=4,
        )

    def list_adapters(self) -> list[Any]:
        return list(self.adapters)

    def knows_adapter(self, name: str) -> bool:
        return any(a.name == name for a in self.adapters)

    async def locate_adapter(self, name: str) -> str | None:
        return "resident" if self.knows_adapter(name) else None


@dataclass
class FakeWorker:
    """One worker's /metrics, with a few requests finished between scrapes."""

    index: int
    port: int = 0
    scrapes: int = 0

    def __post_init__(self) -> None:
        from adaptermesh.worker.fair_queue import FairQueue
        from adaptermesh.worker.metrics import ServiceMetrics

        self.engine = _StubEngine((ADAPTER, f"{ADAPTER}@{TO_VERSION}"))
        queue = FairQueue(max_running=8, max_waiting_per_tenant=16, max_waiting_total=64)
        self.metrics = ServiceMetrics(self.engine, queue)  # type: ignore[arg-type]

    def advance(self) -> None:
        """Requests that finished since the last scrape: the load swings slowly, so the
        rebalancer moves weight now and then, as with real traffic."""
        self.scrapes += 1
        phase = (self.scrapes // 40 + self.index) % 4
        n = 1 + phase
        self.engine.running = 2 * phase
        now = time.monotonic()
        for i in range(n):
            ttft = 0.02 * (1 + phase) * (1 + (i % 3) / 10)
            adapter = ADAPTER if i % 2 else f"{ADAPTER}@{TO_VERSION}"
            self.metrics.observe_finished(
                outcome="stop",
                arrived=now - ttft - 0.1,
                first_token=now - 0.1,
                last_token=now,
                completion_tokens=8,
                adapter=adapter,
            )
        self.engine.tokens += 8 * n

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        self.advance()
        return generate_latest(self.metrics.registry)


async def _start_workers(n: int, slow: float) -> tuple[list[FakeWorker], list[Any]]:
    """``slow``: the fraction of scrapes answered only after the control plane's 2 s scrape
    timeout, as a CPU worker busy with requests sometimes answers (every 1/slow-th one)."""
    from aiohttp import web

    workers, runners = [], []
    for i in range(n):
        worker = FakeWorker(i)

        async def handler(_: web.Request, w: FakeWorker = worker) -> web.Response:
            body = w.render()
            if slow > 0 and int(w.scrapes * slow) != int((w.scrapes - 1) * slow):
                await asyncio.sleep(2.5)
            return web.Response(body=body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        worker.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        workers.append(worker)
        runners.append(runner)
    return workers, runners


# -- the driver ----------------------------------------------------------------------------------


def _shard(sid: str, port: int) -> Any:
    from adaptermesh.proto import assignment_pb2

    s = assignment_pb2.Shard(id=sid, state=assignment_pb2.SHARD_STATE_ACTIVE)
    s.endpoints.add(address="127.0.0.1", port=port)
    s.steer.tunnel.remote_ipv4 = "192.0.2.10"
    s.steer.tunnel.vni = 100 + int(sid[1:])
    return s


class Driver:
    def __init__(self, target: str, speed: float) -> None:
        import grpc

        from adaptermesh.proto import control_plane_pb2_grpc

        self.target = target
        self.speed = speed
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = control_plane_pb2_grpc.ControlPlaneStub(self.channel)
        self.reports = 0
        self.received = 0
        self.changes = 0
        self.failed: list[str] = []

    async def watch(self, stop: asyncio.Event) -> None:
        from adaptermesh.proto import control_plane_pb2 as cp

        call = self.stub.WatchAssignments(cp.WatchAssignmentsRequest(node_id="node-0"), metadata=MD)
        with contextlib.suppress(asyncio.CancelledError):
            async for assignment in call:
                self.received += 1
                self.applied = assignment.version
                if stop.is_set():
                    break
        call.cancel()

    async def report(self, stop: asyncio.Event) -> None:
        from adaptermesh.proto import control_plane_pb2 as cp

        period = SOAK_REPORT_S / self.speed
        i = 0
        while not stop.is_set():
            report = cp.LoadReport(node_id="node-0", applied_version=getattr(self, "applied", 0))
            report.observed_at.GetCurrentTime()
            for sid in ("s0", "s1"):
                report.shards.add(
                    shard_id=sid,
                    packets_per_s=100.0 + i % 7,
                    bytes_per_s=5e4 + i % 11,
                    new_flows_per_s=1.0,
                    active_flows=4,
                )
            await self.stub.ReportLoad(report, timeout=10, metadata=MD)
            self.reports += 1
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    async def change(self, k: int) -> None:
        """The soak's k-th change (0-based; six per cycle), on a fresh connection."""
        import grpc

        from adaptermesh.proto import control_plane_pb2 as cp
        from adaptermesh.proto import control_plane_pb2_grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
            step, second_half = k % 3, (k % 6) >= 3
            if step == 0:
                if second_half:
                    await stub.ClearOverride(
                        cp.ClearOverrideRequest(shard_id="s0"), timeout=10, metadata=MD
                    )
                else:
                    await stub.SetOverride(
                        cp.SetOverrideRequest(shard_id="s0", weight=3000, reason="soak"),
                        timeout=10,
                        metadata=MD,
                    )
            elif step == 1:
                if second_half:
                    await stub.UnpinTenant(
                        cp.UnpinTenantRequest(cidr=TENANT), timeout=10, metadata=MD
                    )
                else:
                    await stub.PinTenant(
                        cp.PinTenantRequest(cidr=TENANT, shard_id="s1"), timeout=10, metadata=MD
                    )
            else:
                spec = cp.RolloutSpec(
                    adapter=ADAPTER,
                    to_version=TO_VERSION,
                    steps_percent=[50, 100],
                    interval_seconds=600,
                    max_error_rate=0.5,
                    min_requests=1,
                )
                await stub.StartRollout(
                    cp.StartRolloutRequest(spec=spec, reason="soak"), timeout=10, metadata=MD
                )
        self.changes += 1

    async def abort(self) -> None:
        import grpc

        from adaptermesh.proto import control_plane_pb2 as cp
        from adaptermesh.proto import control_plane_pb2_grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
            await stub.ControlRollout(
                cp.ControlRolloutRequest(adapter=ADAPTER, action="abort"), timeout=10, metadata=MD
            )
        self.changes += 1


class Server:
    def __init__(self, args: argparse.Namespace, workdir: Path, src: Path, traced: bool) -> None:
        self.samples = workdir / "samples.jsonl"
        env = {**os.environ, "BENCH_CP_SRC": str(src)}
        env.pop("PYTHONTRACEMALLOC", None)
        env.pop("MALLOC_ARENA_MAX", None)
        if args.malloc_arena_max:
            env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve",
            "--state-dir",
            str(workdir / "state"),
            "--samples",
            str(self.samples),
            "--interval",
            str(SOAK_INTERVAL_S / args.speed),
            "--rollout-tick",
            str(SOAK_ROLLOUT_TICK_S / args.speed),
            "--serve-tracemalloc",
            str(args.tracemalloc_frames if traced else 0),
        ]
        self.log = (workdir / "server.log").open("w+")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r}\n{self.log.read()[-3000:]}")
        self.target = line.split()[-1]
        self.rows: list[dict[str, Any]] = []

    async def sample(self) -> dict[str, Any]:
        before = len(self.rows)
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.samples.exists():
                lines = self.samples.read_text().splitlines()
                if len(lines) > before:
                    self.rows.append(json.loads(lines[before]))
                    return self.rows[-1]
            await asyncio.sleep(0.05)
        raise RuntimeError("the server wrote no sample")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _slope_per_cycle(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def _top_growth(first: Path, last: Path, limit: int) -> list[dict[str, Any]]:
    a = tracemalloc.Snapshot.load(str(first))
    b = tracemalloc.Snapshot.load(str(last))
    filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = b.filter_traces(filters).compare_to(a.filter_traces(filters), "traceback")
    out = []
    for s in stats[:limit]:
        if s.size_diff <= 0:
            break
        out.append(
            {
                "size_diff_kib": round(s.size_diff / 1024, 1),
                "count_diff": s.count_diff,
                "size_kib": round(s.size / 1024, 1),
                "traceback": [
                    f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in s.traceback
                ][-6:],
            }
        )
    return out


async def _drive(
    args: argparse.Namespace, workdir: Path, src: Path, traced: bool
) -> dict[str, Any]:
    workers, runners = await _start_workers(2, args.slow_scrapes)
    server = Server(args, workdir, src, traced)
    driver = Driver(server.target, args.speed)
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    rss_series: list[tuple[float, int]] = []
    started = time.monotonic()
    try:
        for i, w in enumerate(workers):
            await driver.stub.UpsertShard(
                __import__(
                    "adaptermesh.proto", fromlist=["control_plane_pb2"]
                ).control_plane_pb2.UpsertShardRequest(shard=_shard(f"s{i}", w.port)),
                timeout=10,
                metadata=MD,
            )

        async def rss_sampler() -> None:
            while not stop.is_set():
                rss_series.append(
                    (round(time.monotonic() - started, 1), _rss(server.proc.pid)["rss_kib"])
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.rss_every_s)

        tasks = [
            asyncio.create_task(driver.watch(stop)),
            asyncio.create_task(driver.report(stop)),
            asyncio.create_task(rss_sampler()),
        ]
        change_s = SOAK_CHANGE_S / args.speed
        origin = time.monotonic()
        aborts: list[asyncio.Task[None]] = []

        async def abort_later(at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await driver.abort()

        async def take(cycle: int) -> None:
            row = await server.sample()
            row["cycle"] = cycle
            row["elapsed_s"] = round(time.monotonic() - started, 1)
            row["reports"] = driver.reports
            row["received"] = driver.received
            samples.append(row)
            print(f"[memory] cycle {cycle}: {json.dumps(row)}", flush=True)

        await take(0)
        for k in range(args.cycles * 6):
            await asyncio.sleep(max(0.0, origin + k * change_s - time.monotonic()))
            await driver.change(k)
            if k % 3 == 2:
                aborts.append(asyncio.create_task(abort_later(time.monotonic() + change_s / 2)))
            if k % 6 == 5:
                await asyncio.gather(*aborts)
                aborts.clear()
                cycle = k // 6 + 1
                if (
                    cycle == args.warmup_cycles
                    or cycle % args.sample_every == 0
                    or cycle == args.cycles
                ):
                    await asyncio.sleep(max(0.0, origin + (k + 1) * change_s - time.monotonic()))
                    await take(cycle)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await driver.channel.close()
        server.stop()
        for r in runners:
            await r.cleanup()
    after = [s for s in samples if s["cycle"] >= args.warmup_cycles]
    result: dict[str, Any] = {"samples": samples, "rss_series": rss_series}
    if len(after) >= 2:
        base, last = after[0], after[-1]
        growth: dict[str, Any] = {}
        for key in (
            "rss_kib",
            "rss_anon_kib",
            "rss_file_kib",
            "traced_kib",
            "pymalloc_used_kib",
            "pymalloc_arenas",
            "in_use_kib",
            "heap_kib",
            "free_held_kib",
            "mmap_kib",
        ):
            if base.get(key):
                growth[key] = {
                    "at_warmup": base[key],
                    "last": last[key],
                    "max": max(s[key] for s in after),
                    "growth": round(max(s[key] for s in after) / base[key] - 1.0, 4),
                    "slope_kib_per_cycle": _round(
                        _slope_per_cycle([s["cycle"] for s in after], [s[key] for s in after])
                    ),
                }
        result["growth_after_warmup"] = growth
    if traced and len(after) >= 2:
        first_i = samples.index(after[0])
        last_i = len(samples) - 1
        snaps = (
            server.samples.with_suffix(f".{first_i}.snap"),
            server.samples.with_suffix(f".{last_i}.snap"),
        )
        result["tracemalloc_top_growth"] = _top_growth(*snaps, limit=args.top)
    result["loops"] = {
        "reports": driver.reports,
        "assignments_received": driver.received,
        "changes": driver.changes,
        "wall_s": round(time.monotonic() - started, 1),
    }
    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--cycles", type=int, default=60, help="change cycles (six soak minutes each)")
    p.add_argument("--warmup-cycles", type=int, default=5)
    p.add_argument("--sample-every", type=int, default=5, help="cycles between samples")
    p.add_argument("--speed", type=float, default=40.0, help="how many times faster than the soak")
    p.add_argument("--rss-every-s", type=float, default=15.0, help="seconds between RSS reads")
    p.add_argument("--tracemalloc", action="store_true", help="trace the Python heap too")
    p.add_argument("--tracemalloc-frames", type=int, default=12)
    p.add_argument("--top", type=int, default=15, help="allocation sites to list")
    p.add_argument(
        "--malloc-arena-max", type=int, default=0, help="MALLOC_ARENA_MAX for the server (0: unset)"
    )
    p.add_argument(
        "--slow-scrapes",
        type=float,
        default=0.0,
        help="fraction of worker scrapes that time out (answered after 2.5 s)",
    )
    p.add_argument("--src", type=Path, help="run the server from this source tree")
    p.add_argument(
        "--compare-src",
        type=Path,
        help="run first from this source tree too (the code before a change), as 'before'",
    )
    p.add_argument("--out", default=None, help="results JSON (default: print only)")
    p.add_argument("--label", default="", help="a note stored with the results")
    # The server subprocess.
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--state-dir", help=argparse.SUPPRESS)
    p.add_argument("--samples", help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, help=argparse.SUPPRESS)
    p.add_argument("--rollout-tick", type=float, help=argparse.SUPPRESS)
    p.add_argument("--serve-tracemalloc", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args))
        return 0
    current = (args.src or ROOT / "src").resolve()
    plan = [("after", current, False)]
    if args.compare_src is not None:
        plan.insert(0, ("before", args.compare_src.resolve(), False))
    if args.tracemalloc:
        plan += [(f"{label}_tracemalloc", src, True) for label, src, _ in list(plan)]
    load_start = os.getloadavg()[0]
    runs: dict[str, Any] = {}
    for label, src, traced in plan:
        print(f"[memory] run {label}: server from {src}", flush=True)
        with tempfile.TemporaryDirectory(prefix="cpmem-") as tmp:
            runs[label] = {"source": str(src), "tracemalloc": traced}
            runs[label].update(asyncio.run(_drive(args, Path(tmp), src, traced)))
    doc = {
        **provenance("grpcio", "httpx", "protobuf", load_start=load_start),
        "label": args.label,
        "workload": {
            "speed": args.speed,
            "cycles": args.cycles,
            "warmup_cycles": args.warmup_cycles,
            "rebalance_interval_s": SOAK_INTERVAL_S / args.speed,
            "report_interval_s": SOAK_REPORT_S / args.speed,
            "change_every_s": SOAK_CHANGE_S / args.speed,
            "rollout_tick_s": SOAK_ROLLOUT_TICK_S / args.speed,
            "soak_minutes_equivalent": args.cycles * 6,
            "malloc_arena_max": args.malloc_arena_max or None,
            "slow_scrapes": args.slow_scrapes,
        },
        "summary": {
            label: {
                "growth_after_warmup": {
                    k: {f: g[f] for f in ("at_warmup", "last", "growth", "slope_kib_per_cycle")}
                    for k, g in run.get("growth_after_warmup", {}).items()
                },
                "tracemalloc_top_growth": [
                    {"size_diff_kib": t["size_diff_kib"], "where": t["traceback"][-1]}
                    for t in run.get("tracemalloc_top_growth", [])[:5]
                ],
            }
            for label, run in runs.items()
        },
        "runs": runs,
    }
    if args.out:
        write_results(args.out, doc)
    else:
        print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
