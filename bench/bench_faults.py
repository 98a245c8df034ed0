"""Fault injection on the local mesh under steady open-loop load: a worker killed (kill -9) and
started again, a worker drained (SIGTERM), an error injected inside an engine step, the adapter
store stalled, the control plane stopped, the agent restarted; and a soak.

    sudo .venv/bin/python bench/bench_faults.py --out bench/results/faults_cpu.json
    sudo .venv/bin/python bench/bench_faults.py --short --out bench/results/faults_cpu_short.json
    sudo .venv/bin/python bench/bench_faults.py --soak --soak-minutes 30 \
        --out bench/results/faults_soak_cpu.json

Each run builds the testkit's LocalMesh (needs root: network namespaces, eBPF): one shard of two
CPU workers (tiny model), the real classifier, Envoy, agent and control plane as processes, and
an S3 store (moto behind a proxy that can stall) holding one adapter the workers do not have.
Tenants behind the classifier send streaming completions at a fixed rate, open loop (a request
is sent when it is due, whatever is still running), a new connection each time. One scenario
at a time runs under that load; the mesh is shared, and each scenario leaves it healthy. The
full form kills the victim every ``--kill-period`` seconds for ``--kill-duration`` seconds (the
issue's 20 s for 3 minutes), drains it ``--drains`` times, stalls the store for ``--stall``
seconds, stops the control plane for ``--cp-down`` seconds and restarts the agent
``--agent-restarts`` times (with UDP probes counted per shard); ``--short`` is one kill, one
drain, one stall and one step error, the CI form of tests/e2e/test_faults.py.

``--soak`` runs the soak instead (src/adaptermesh_testkit/soak.py): two shards of one worker,
the agent's external processor (rollouts), mixed streaming and plain traffic for
``--soak-minutes``, an override, a pin or a rollout changing every minute, RSS and descriptors
of every process sampled. ``--heap-probe`` adds the control plane's heap sampled from inside
(bench/heap_probe: RSS, malloc's bytes in use and free bytes held, SQLite's bytes) as
``soak.control_plane_heap``.

The figures per scenario (src/adaptermesh_testkit/faultload.py, docs/faults.md): requests sent,
failed, failed outside the allowed window, p50/p99 latency before, during and after the faults,
the worst hang (the longest any request went without a byte), and for requests in flight at a
fault, how long they took to end after it. The bounds each is checked against are in
``bounds`` and ``held``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import provenance, source_revision, write_results

from adaptermesh.worker.faults import STEP_FAULT_ENV
from adaptermesh_testkit.faultload import (
    IN_FLIGHT_END_BOUND_S,
    KILL_ALLOWED_AFTER_S,
    SCENARIOS,
    STALL_OTHERS_P99_FACTOR,
    run_scenario,
    warm_workers,
)
from adaptermesh_testkit.localmesh import LocalMesh, MeshConfig

# bench/heap_probe/sitecustomize.py: the control plane's heap, sampled from inside (--heap-probe)
HEAP_PROBE_DIR = Path(__file__).resolve().parent / "heap_probe"
from adaptermesh_testkit.soak import FD_SLACK, RSS_GROWTH_BOUND, run_soak

SHORT = ("kill", "drain", "stall", "step_error")
STORE_ADAPTER = "remote"


def _done_with(workdir: Path, keep: bool) -> None:
    if keep:
        print(f"[faults] kept {workdir} (logs in {workdir / 'mesh' / 'logs'})", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="bench/results/faults_cpu.json")
    p.add_argument(
        "--short", action="store_true", help="one kill, one drain, one stall, one step error"
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (open loop)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--drain-max-tokens",
        type=int,
        default=96,
        help="longer streams in the drain, so that requests arrive while it waits for them",
    )
    p.add_argument("--kill-period", type=float, default=20.0)
    p.add_argument("--kill-duration", type=float, default=180.0)
    p.add_argument("--drains", type=int, default=3, help="drains in the full form")
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--cooldown", type=float, default=6.0)
    p.add_argument("--records-dir", default=None, help="also write every request, per scenario")
    p.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the mesh's work directory (every process's log under mesh/logs) and print it",
    )
    p.add_argument("--stall", type=float, default=30.0, help="seconds the store stalls (full)")
    p.add_argument("--load-wait", type=float, default=5.0, help="the workers' --adapter-load-wait")
    p.add_argument("--store-timeout", type=float, default=3.0, help="--adapter-store-timeout")
    p.add_argument(
        "--worker-cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="each worker's --cpu-threads (default: its share of the machine's CPUs, as the "
        "local mesh gives it; the cores' count reproduces workers that each use every core)",
    )
    p.add_argument("--cp-down", type=float, default=30.0, help="seconds the control plane is down")
    p.add_argument("--agent-restarts", type=int, default=4, help="agent restarts (full)")
    p.add_argument("--probe-pps", type=float, default=50.0, help="UDP probes per second per source")
    p.add_argument("--soak", action="store_true", help="run the soak instead of the scenarios")
    p.add_argument("--soak-minutes", type=float, default=30.0)
    p.add_argument(
        "--control-plane-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the control plane's process (repeatable), "
        "e.g. MALLOC_ARENA_MAX=2",
    )
    p.add_argument(
        "--heap-probe",
        action="store_true",
        help="soak: sample the control plane's heap from inside (RSS, malloc's in-use and "
        "free-held bytes, SQLite's) every 15 s into soak.control_plane_heap",
    )
    args = p.parse_args(argv)
    if args.soak:
        if args.out == "bench/results/faults_cpu.json":
            args.out = "bench/results/faults_soak_cpu.json"
        return soak(args)
    if args.short and args.scenarios == ",".join(SCENARIOS):
        args.scenarios = ",".join(SHORT)
    if os.geteuid() != 0:
        print("bench_faults: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    source = source_revision()
    workdir = Path(tempfile.mkdtemp(prefix="amf-"))
    trigger_base = str(workdir / "step-fault")
    # The workers inherit it: the engine-step trigger file is <base>.<worker pid>.
    os.environ[STEP_FAULT_ENV] = trigger_base
    mesh = LocalMesh(
        MeshConfig(
            prefix=f"amf{secrets.token_hex(2)}",
            shards=1,
            workers_per_shard=2,
            tenants=4,
            probe_sources=2,
            interval_s=2.0,
            report_interval_s=0.5,
            workdir=workdir / "mesh",
            store_adapters=(STORE_ADAPTER,),
            worker_args=(
                "--adapter-load-wait",
                str(args.load_wait),
                "--adapter-store-timeout",
                str(args.store_timeout),
                *(
                    ()
                    if args.worker_cpu_threads is None
                    else ("--cpu-threads", str(args.worker_cpu_threads))
                ),
            ),
        ),
        progress=lambda msg: print(f"[faults] {msg}", flush=True),
    )
    kills = 1 if args.short else max(1, int(args.kill_duration // args.kill_period))
    scenarios: dict[str, Any] = {}
    started = time.monotonic()
    try:
        mesh.start()
        print(f"[faults] mesh up in {time.monotonic() - started:.1f}s", flush=True)
        warm_workers(mesh)
        stall_s = min(args.stall, 10.0) if args.short else args.stall
        for name in args.scenarios.split(","):
            print(f"[faults] scenario {name}", flush=True)
            summary = run_scenario(
                mesh,
                name,
                # The stall compares the other adapters' p99 before and during: more samples.
                rate_per_s=2 * args.rate if name == "stall" else args.rate,
                max_tokens=args.drain_max_tokens if name == "drain" else args.max_tokens,
                # The stall's "before" is at least as long as the stall, so that the two p99s
                # compared come from about as many requests: the p99 of 25 requests is their
                # slowest, and the slowest of 72 from the same distribution is slower.
                warmup_s=max(2 * args.warmup, stall_s) if name == "stall" else args.warmup,
                cooldown_s=args.cooldown,
                kills=kills,
                kill_period_s=args.kill_period,
                drains=1 if args.short else args.drains,
                trigger_base=trigger_base,
                records_path=Path(args.records_dir) / f"{name}.jsonl" if args.records_dir else None,
                stall_s=stall_s,
                stalled_rate_per_s=args.rate,
                load_wait_s=args.load_wait,
                down_s=min(args.cp_down, 10.0) if args.short else args.cp_down,
                restarts=1 if args.short else args.agent_restarts,
                probe_pps=args.probe_pps,
            )
            scenarios[name] = summary
            print(
                f"[faults] {name}: sent {summary['requests_sent']}, failed {summary['failed']} "
                f"(outside window {summary['failed_outside_allowed_window']}), "
                f"held {summary['held']}",
                flush=True,
            )
    finally:
        mesh.stop()
        os.environ.pop(STEP_FAULT_ENV, None)
        _done_with(workdir, args.keep_workdir)
    doc = {
        **provenance("httpx", load_start=load_start, source=source),
        "topology": "1 shard x 2 CPU workers (tiny Llama), real classifier, Envoy, agent and "
        "control plane as processes; tenants send streaming completions, a new connection each",
        "load": {
            "rate_per_s": args.rate,
            "max_tokens": args.max_tokens,
            "drain_max_tokens": args.drain_max_tokens,
            "open_loop": True,
            "stream": True,
        },
        "form": "short" if args.short else "full",
        "kills": kills,
        "drains": 1 if args.short else args.drains,
        "kill_period_s": args.kill_period,
        "scenarios_run": args.scenarios.split(","),
        "bounds": {
            "kill": f"in-flight streams end (error event or closed) within "
            f"{IN_FLIGHT_END_BOUND_S:g} s; no request that started later than "
            f"{KILL_ALLOWED_AFTER_S:g} s after a kill fails; no hang",
            "drain": "0 failed requests; the worker exits within its drain timeout; no hang",
            "step_error": "only the requests of the failed step fail, with a 5xx naming the "
            "cause; the engine keeps serving; no hang",
            "stall": "requests for the stalled adapter get 503 with Retry-After within the "
            "workers' --adapter-load-wait plus the larger of 1.5 s and the others' p99 before; "
            "the other adapters fail nothing and their p99 during the stall is within "
            f"{STALL_OTHERS_P99_FACTOR:g}x of before; the adapter loads once the store answers; "
            "no hang",
            "control_plane": "0 failed requests while the control plane is down; the agent "
            "keeps the last Assignment; a change made after the restart reaches the agent; "
            "no hang",
            "agent_restart": "0 failed requests; every UDP probe sent from the signal to 1 s "
            "after the new agent applied arrives at the shard its source is steered to (none "
            "misclassified, none lost); the classifier passes nothing unsteered; no hang",
        },
        "worker_cpu_threads": args.worker_cpu_threads or mesh.worker_cpu_share(),
        "store": {
            "adapter": STORE_ADAPTER,
            "adapter_load_wait_s": args.load_wait,
            "adapter_store_timeout_s": args.store_timeout,
        },
        "scenarios": scenarios,
    }
    write_results(args.out, doc)
    return 0 if all(all(s["held"].values()) for s in scenarios.values()) else 1


def _env_pairs(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--control-plane-env: {item[:64]!r} is not KEY=VALUE")
        env[key] = value
    return env


def soak(args: argparse.Namespace) -> int:
    """The soak (module docstring): two shards of one worker, rollouts through the agent's
    external processor, ``--soak-minutes`` of mixed traffic."""
    if os.geteuid() != 0:
        print("bench_faults: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    source = source_revision()
    workdir = Path(tempfile.mkdtemp(prefix="ams-"))
    cp_env = _env_pairs(args.control_plane_env)
    heap_log = workdir / "control-plane-heap.jsonl"
    if args.heap_probe:
        # Ahead of any PYTHONPATH given with --control-plane-env (e.g. another source tree).
        path = [str(HEAP_PROBE_DIR), *filter(None, [cp_env.get("PYTHONPATH")])]
        cp_env |= {"PYTHONPATH": os.pathsep.join(path), "HEAP_PROBE_OUT": str(heap_log)}
    heap: list[dict[str, float]] = []
    mesh = LocalMesh(
        MeshConfig(
            prefix=f"ams{secrets.token_hex(2)}",
            shards=2,
            workers_per_shard=1,
            tenants=4,
            interval_s=2.0,
            report_interval_s=0.5,
            max_running=8,
            ext_proc=True,
            extra_adapters=("support@2.0.0",),
            workdir=workdir / "mesh",
            control_plane_env=cp_env,
        ),
        progress=lambda msg: print(f"[soak] {msg}", flush=True),
    )
    started = time.monotonic()
    try:
        mesh.start()
        print(f"[soak] mesh up in {time.monotonic() - started:.1f}s", flush=True)
        warm_workers(mesh)
        result = run_soak(
            mesh,
            args.soak_minutes,
            rate_per_s=2 * args.rate,
            plain_rate_per_s=args.rate,
            max_tokens=args.max_tokens,
            progress=lambda msg: print(f"[soak] {msg}", flush=True),
        )
    finally:
        mesh.stop()
        if heap_log.exists():
            heap = [json.loads(line) for line in heap_log.read_text().splitlines() if line]
        _done_with(workdir, args.keep_workdir)
    if args.heap_probe:
        result["control_plane_heap"] = heap
    doc = {
        **provenance("httpx", load_start=load_start, source=source),
        "topology": "2 shards x 1 CPU worker (tiny Llama), real classifier, Envoy with the "
        "agent's external processor, agent and control plane as processes",
        "form": "soak",
        "control_plane_env": _env_pairs(args.control_plane_env),
        "heap_probe": bool(args.heap_probe),
        "soak_minutes_asked": args.soak_minutes,
        "soak_minutes_run": result["minutes"],
        "bounds": {
            "soak": f"0 failed requests (nothing injected); RSS of every process grows under "
            f"{RSS_GROWTH_BOUND:.0%} after the first 5 minutes (half the run when shorter); "
            f"open descriptors flat (at the end at most {FD_SLACK} above the baseline); no hang",
        },
        "soak": result,
    }
    write_results(args.out, doc)
    print(f"[soak] held {result['held']}", flush=True)
    return 0 if all(result["held"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
