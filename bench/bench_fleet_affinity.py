"""Fleet adapter affinity on the local mesh: with more adapters than one worker holds, the share
of requests served by a worker already holding their adapter, with the control plane's automatic
homes (``--auto-placement``) and without.

    sudo .venv/bin/python bench/bench_fleet_affinity.py --out bench/results/fleet_affinity_cpu.json

Each run builds the testkit's LocalMesh (needs root: network namespaces): 3 shards x 2 CPU
workers (tiny model) with ``--max-loras P`` adapter slots each, N = 4 x P adapters registered
as AdapterInstances that name no shards (the control plane's ``Apply``), the eBPF classifier
and one Envoy per shard. Tenants behind the classifier send completions naming adapters drawn
from a Zipf(s) popularity, one request in flight per tenant, a new connection each time. After a
warm-up, the workers' own ``adaptermesh_adapter_cache_hits`` and ``_misses`` counters (one per
request: was its adapter in a GPU slot when it arrived) are read before and after the measured
window; the hit share is hits / (hits + misses) over all workers.

``off``: the control plane as before: each shard's Envoy sends a request naming an adapter to a
worker of that shard holding it, else to any worker of the shard, which loads it (a miss, and
an eviction when its slots are full), so each shard's two workers see every adapter.
``on``: ``--auto-placement``: every adapter has one home shard (rendezvous hash weighted by the
shards' slots), every other shard's Envoy forwards its requests there, and the control plane
preloads it on one worker of its home, so each worker's active set is about N / 6 adapters.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import provenance, write_results

from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2
from adaptermesh_testkit.localmesh import BASE_MODEL, LocalMesh, MeshConfig

PROMPT = "The quick brown fox"


def zipf_weights(count: int, exponent: float) -> list[float]:
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _metrics(url: str) -> dict[str, Any]:
    """A worker's cache counters, resident adapters and per-adapter request counts."""
    text = httpx.get(url, timeout=5).text
    out: dict[str, Any] = {
        "hits": 0.0,
        "misses": 0.0,
        "evictions": 0.0,
        "slots": 0.0,
        "resident": [],
        "served": {},
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "adaptermesh_adapter_cache_hits_total":
                out["hits"] = sample.value
            elif name == "adaptermesh_adapter_cache_misses_total":
                out["misses"] = sample.value
            elif name == "adaptermesh_adapter_cache_evictions_total":
                out["evictions"] = sample.value
            elif name == "adaptermesh_gpu_slots_total":
                out["slots"] = sample.value
            elif name == "adaptermesh_adapter_resident" and sample.value > 0:
                out["resident"].append(sample.labels["adapter"])
            elif name == "adaptermesh_adapter_time_to_first_token_seconds_count":
                out["served"][sample.labels["adapter"]] = sample.value
    out["resident"].sort()
    return out


def scrape(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    return {
        f"{shard_id}/{j}": mesh.in_node(_metrics, f"http://{addr}:{port}/metrics")
        for shard_id in mesh.shard_ids
        for j, (addr, port) in enumerate(mesh.worker_endpoints(shard_id))
    }


class Traffic:
    """One thread per tenant: completions naming Zipf-drawn adapters, back to back."""

    def __init__(
        self, mesh: LocalMesh, adapters: Sequence[str], exponent: float, seed: int, max_tokens: int
    ) -> None:
        self.mesh = mesh
        self.adapters = list(adapters)
        self.cumulative: list[float] = []
        acc = 0.0
        for w in zipf_weights(len(adapters), exponent):
            acc += w
            self.cumulative.append(acc)
        self.seed = seed
        self.max_tokens = max_tokens
        self.ok = 0
        self.failed = 0
        self.last_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(source, seed + i), daemon=True)
            for i, source in enumerate(mesh.tenants)
        ]

    def _run(self, source: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            adapter = rng.choices(self.adapters, cum_weights=self.cumulative)[0]
            try:
                self.mesh.complete(source, adapter, PROMPT, max_tokens=self.max_tokens, timeout=30)
            except Exception as exc:  # counted and shown, the run goes on
                with self._lock:
                    self.failed += 1
                    self.last_error = str(exc)[:300]
            else:
                with self._lock:
                    self.ok += 1

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)


def _register(mesh: LocalMesh, names: Sequence[str]) -> None:
    request = control_plane_pb2.ApplyRequest(reason="bench: adapter instances")
    for name in names:
        inst = request.instances.add(name=name)
        inst.model_ref.base_model = BASE_MODEL
        inst.model_ref.adapter_path = name  # as the workers see it, inside their adapter root
    mesh.cp.Apply(request, metadata=mesh._md(), timeout=30)


def _wait_homes(mesh: LocalMesh, names: Sequence[str], timeout: float) -> dict[str, str]:
    """The published homes, once every adapter has one and is resident on its home shard."""
    deadline = time.monotonic() + timeout
    homes: dict[str, str] = {}
    while time.monotonic() < deadline:
        assignment = mesh.cp.GetAssignment(
            control_plane_pb2.GetAssignmentRequest(), metadata=mesh._md(), timeout=5
        )
        homes = {e.name: e.shards[0] for e in assignment.adapters if len(e.shards) == 1}
        if set(homes) == set(names):
            seen = scrape(mesh)
            placed = all(
                any(
                    name in seen[f"{homes[name]}/{j}"]["resident"]
                    for j in range(mesh.config.workers_per_shard)
                )
                for name in names
            )
            if placed:
                mesh.wait_agent_applied(timeout=30)
                return homes
        time.sleep(1.0)
    raise RuntimeError(f"homes not placed in {timeout:.0f} s: {len(homes)} of {len(names)}")


def run(auto: bool, args: argparse.Namespace) -> dict[str, Any]:
    names = [f"adapter-{i:02d}" for i in range(args.adapters_per_slot * args.max_loras)]
    label = "on" if auto else "off"
    config = MeshConfig(
        prefix=f"amfa{secrets.token_hex(2)}",
        shards=3,
        workers_per_shard=2,
        tenants=args.tenants,
        adapters=names,
        interval_s=2.0,
        report_interval_s=0.5,
        max_running=4,
        control_plane_args=("--auto-placement",) if auto else (),
        worker_args=("--max-loras", str(args.max_loras)),
    )
    mesh = LocalMesh(config, progress=lambda msg: print(f"[{label}] {msg}", flush=True))
    try:
        started = time.monotonic()
        mesh.start()
        _register(mesh, names)
        homes: dict[str, str] = {}
        if auto:
            homes = _wait_homes(mesh, names, timeout=90)
        else:
            mesh.wait_agent_applied(timeout=30)
        ready_s = time.monotonic() - started
        print(f"[{label}] ready after {ready_s:.0f} s; warm-up {args.warmup:.0f} s", flush=True)
        traffic = Traffic(mesh, names, args.zipf, args.seed, args.max_tokens).start()
        try:
            time.sleep(args.warmup)
            before, ok0, failed0 = scrape(mesh), traffic.ok, traffic.failed
            t0 = time.monotonic()
            time.sleep(args.duration)
            after, ok1, failed1 = scrape(mesh), traffic.ok, traffic.failed
            window = time.monotonic() - t0
        finally:
            traffic.stop()
        workers: dict[str, Any] = {}
        hits = misses = evictions = 0.0
        for key in sorted(after):
            a, b = after[key], before[key]
            dh, dm = a["hits"] - b["hits"], a["misses"] - b["misses"]
            served = sorted(n for n, c in a["served"].items() if c - b["served"].get(n, 0.0) > 0)
            workers[key] = {
                "slots": a["slots"],
                "hits": dh,
                "misses": dm,
                "evictions": a["evictions"] - b["evictions"],
                "adapters_served": len(served),
                "resident_at_end": a["resident"],
            }
            hits, misses, evictions = (
                hits + dh,
                misses + dm,
                evictions + a["evictions"] - b["evictions"],
            )
        per_shard = {s: sorted(n for n, h in homes.items() if h == s) for s in mesh.shard_ids}
        return {
            "auto_placement": auto,
            "hit_share": round(hits / (hits + misses), 4) if hits + misses else None,
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "requests_ok": ok1 - ok0,
            "requests_failed": failed1 - failed0,
            "last_error": traffic.last_error,
            "window_s": round(window, 1),
            "requests_per_s": round((ok1 - ok0) / window, 2),
            "ready_s": round(ready_s, 1),
            "homes_per_shard": {s: len(v) for s, v in per_shard.items()} if auto else None,
            "homes": per_shard if auto else None,
            "workers": workers,
        }
    finally:
        mesh.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--max-loras", type=int, default=4, help="adapter GPU slots per worker (P)")
    p.add_argument("--adapters-per-slot", type=int, default=4, help="N = this x P adapters")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of traffic not counted")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per run")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--runs", choices=["both", "on", "off"], default="both")
    p.add_argument("--out", default="bench/results/fleet_affinity_cpu.json")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    runs: dict[str, Any] = {}
    for auto in {"both": (False, True), "on": (True,), "off": (False,)}[args.runs]:
        runs["on" if auto else "off"] = run(auto, args)
    doc = {
        **provenance("aiohttp", "httpx", load_start=load_start),
        "setup": {
            "shards": 3,
            "workers_per_shard": 2,
            "slots_per_worker": args.max_loras,
            "adapters": args.adapters_per_slot * args.max_loras,
            "tenants": args.tenants,
            "zipf_exponent": args.zipf,
            "warmup_s": args.warmup,
            "measured_s": args.duration,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "hit": "adaptermesh_adapter_cache_hits / (hits + misses), deltas over the "
            "measured window, summed over the six workers",
        },
        "runs": runs,
        "hit_share": {k: v["hit_share"] for k, v in runs.items()},
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
