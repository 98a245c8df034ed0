"""Fault injection on the local mesh under steady open-loop load: a worker killed (kill -9) and
started again, a worker drained (SIGTERM), an error injected inside an engine step.

    sudo .venv/bin/python bench/bench_faults.py --out bench/results/faults_cpu.json
    sudo .venv/bin/python bench/bench_faults.py --short --out bench/results/faults_cpu_short.json

Each run builds the testkit's LocalMesh (needs root: network namespaces, eBPF): one shard of two
CPU workers (tiny model), the real classifier, Envoy, agent and control plane as processes.
Tenants behind the classifier send streaming completions at a fixed rate, open loop (a request
is sent when it is due, whatever is still running), a new connection each time. One scenario
at a time runs under that load; the mesh is shared, and each scenario leaves both workers
healthy in Envoy. The full form kills the victim every ``--kill-period`` seconds for
``--kill-duration`` seconds (the issue's 20 s for 3 minutes) and drains it ``--drains`` times;
``--short`` is one kill, one drain and one step error, the CI form of tests/e2e/test_faults.py.

The figures per scenario (src/adaptermesh_testkit/faultload.py, docs/faults.md): requests sent,
failed, failed outside the allowed window, p50/p99 latency before, during and after the faults,
the worst hang (the longest any request went without a byte), and for requests in flight at a
fault, how long they took to end after it. The bounds each is checked against are in
``bounds`` and ``held``.
"""

from __future__ import annotations

import argparse
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

from _results import provenance, write_results

from adaptermesh.worker.faults import STEP_FAULT_ENV
from adaptermesh_testkit.faultload import (
    IN_FLIGHT_END_BOUND_S,
    KILL_ALLOWED_AFTER_S,
    SCENARIOS,
    run_scenario,
    warm_workers,
)
from adaptermesh_testkit.localmesh import LocalMesh, MeshConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="bench/results/faults_cpu.json")
    p.add_argument("--short", action="store_true", help="one kill, one drain, one step error")
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
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_faults: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
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
            interval_s=2.0,
            report_interval_s=0.5,
            workdir=workdir / "mesh",
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
        for name in args.scenarios.split(","):
            print(f"[faults] scenario {name}", flush=True)
            summary = run_scenario(
                mesh,
                name,
                rate_per_s=args.rate,
                max_tokens=args.drain_max_tokens if name == "drain" else args.max_tokens,
                warmup_s=args.warmup,
                cooldown_s=args.cooldown,
                kills=kills,
                kill_period_s=args.kill_period,
                drains=1 if args.short else args.drains,
                trigger_base=trigger_base,
                records_path=Path(args.records_dir) / f"{name}.jsonl" if args.records_dir else None,
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
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        **provenance("httpx", load_start=load_start),
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
        "bounds": {
            "kill": f"in-flight streams end (error event or closed) within "
            f"{IN_FLIGHT_END_BOUND_S:g} s; no request that started later than "
            f"{KILL_ALLOWED_AFTER_S:g} s after a kill fails; no hang",
            "drain": "0 failed requests; the worker exits within its drain timeout; no hang",
            "step_error": "only the requests of the failed step fail, with a 5xx naming the "
            "cause; the engine keeps serving; no hang",
        },
        "scenarios": scenarios,
    }
    write_results(args.out, doc)
    return 0 if all(all(s["held"].values()) for s in scenarios.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
