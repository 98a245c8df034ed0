"""Overhead per request of the MQTT bridge against calling the mesh's HTTP entry directly.

    .venv/bin/python bench/bench_mqtt_bridge.py [--out bench/results/mqtt_bridge_cpu.json]

Both paths call the same fake OpenAI-compatible server (its own process; it answers at once), so
the difference is the bridge's own cost: MQTT publish -> broker -> bridge (durable accept,
PUBACK) -> HTTP -> durable answer -> publish -> broker -> subscriber. Measured in one run:

- latency: one request at a time, ``--requests`` of them; median, p90 and p99 in ms, for
  direct HTTP (a keep-alive httpx client) and through the bridge (``adaptermesh mqtt-bridge``
  as a subprocess against a mosquitto broker on a free port), with the store at
  ``synchronous=FULL`` (the default: every accept and answer is fsynced) and ``NORMAL``;
- throughput: ``--burst`` requests published at once, ``--max-in-flight`` at a time in the
  bridge, against ``--max-in-flight`` concurrent direct HTTP requests; requests per second.

The JSON records the machine, the versions, the date and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import httpx
import paho.mqtt.client as paho
from bridge.support import MOSQUITTO, FakeMesh, Mosquitto, mqtt_client, request


def _summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    q = statistics.quantiles(ms, n=100)
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(q[89], 3),
        "p99_ms": round(q[98], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "n": len(ms),
    }


def direct_latency(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client() as http:
        for i in range(n):
            body = request(f"d{i}")["body"]
            t0 = time.perf_counter()
            r = http.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def direct_throughput(url: str, n: int, concurrency: int) -> float:
    async def go() -> float:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as http:

            async def one(i: int) -> None:
                async with sem:
                    r = await http.post(url + "/v1/completions", json=request(f"t{i}")["body"])
                    r.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return n / (time.perf_counter() - t0)

    return asyncio.run(go())


class Waiter:
    """Subscribes to the reply topic; ``wait(id)`` returns when that id's reply arrived."""

    def __init__(self, port: int) -> None:
        self.arrived: dict[str, float] = {}
        self.cond = threading.Condition()
        self.client = mqtt_client(port)
        self.client.on_message = self._on_message
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe("replies/bench", qos=1)
        assert done.wait(10)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        doc = json.loads(msg.payload)
        assert doc["ok"], doc
        with self.cond:
            self.arrived.setdefault(doc["id"], time.perf_counter())
            self.cond.notify_all()

    def wait(self, ids: set[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not ids <= self.arrived.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(ids - self.arrived.keys())} replies missing")
                self.cond.wait(left)


def bridge_run(
    mesh_url: str, synchronous: str, n: int, burst: int, max_in_flight: int, workdir: Path
) -> dict[str, Any]:
    broker = Mosquitto(workdir / "broker")
    broker.start()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adaptermesh.bridge.cli",
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--request-topic",
            "requests/#",
            "--base-url",
            mesh_url,
            "--state-dir",
            str(workdir / "state"),
            "--max-in-flight",
            str(max_in_flight),
            "--synchronous",
            synchronous,
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("subscribed"), "the bridge did not start"
        waiter = Waiter(broker.port)
        pub = mqtt_client(broker.port)
        lat = []
        for i in range(n):
            rid = f"{synchronous}-l{i}"
            payload = json.dumps(request(rid, reply_to="replies/bench"))
            t0 = time.perf_counter()
            pub.publish("requests/bench", payload, qos=1)
            waiter.wait({rid})
            lat.append((waiter.arrived[rid] - t0) * 1e3)
        ids = {f"{synchronous}-b{i}" for i in range(burst)}
        t0 = time.perf_counter()
        infos = [
            pub.publish("requests/bench", json.dumps(request(rid, reply_to="replies/bench")), qos=1)
            for rid in sorted(ids)
        ]
        waiter.wait(ids)
        rate = burst / (time.perf_counter() - t0)
        for info in infos:
            assert info.is_published()
        pub.disconnect()
        waiter.client.disconnect()
        return {"latency": _summary(lat), "throughput_rps": round(rate, 1)}
    finally:
        proc.terminate()
        proc.wait(30)
        broker.stop()


def serve_mesh() -> None:
    """The fake mesh in its own process (``--serve-mesh``), so that neither path shares an
    interpreter with it: prints its URL, serves until stdin closes."""
    mesh = FakeMesh().start()
    print(mesh.url, flush=True)
    sys.stdin.read()
    mesh.stop()


def main() -> None:
    if sys.argv[1:] == ["--serve-mesh"]:
        serve_mesh()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--requests", type=int, default=300, help="sequential requests per path")
    p.add_argument("--burst", type=int, default=1000, help="requests in the throughput burst")
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mqtt_bridge_cpu.json")
    args = p.parse_args()
    load_before = os.getloadavg()

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-mesh"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        direct_latency(url, 50)  # warm-up
        direct = {
            "latency": _summary(direct_latency(url, args.requests)),
            "throughput_rps": round(direct_throughput(url, args.burst, args.max_in_flight), 1),
        }
        bridged = {}
        for sync in ("FULL", "NORMAL"):
            with tempfile.TemporaryDirectory() as tmp:
                bridged[sync] = bridge_run(
                    url, sync, args.requests, args.burst, args.max_in_flight, Path(tmp)
                )
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)
    overhead = {
        sync: round(r["latency"]["median_ms"] - direct["latency"]["median_ms"], 3)
        for sync, r in bridged.items()
    }
    mosquitto = subprocess.run([MOSQUITTO, "-h"], capture_output=True, text=True).stdout
    result = {
        "benchmark": "mqtt_bridge",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            # A shared machine: the 1/5/15-minute load averages before and after the run.
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "versions": {
            "paho-mqtt": metadata.version("paho-mqtt"),
            "httpx": metadata.version("httpx"),
            "aiohttp": metadata.version("aiohttp"),
            "mosquitto": mosquitto.splitlines()[0] if mosquitto else "unknown",
        },
        "config": {
            "requests": args.requests,
            "burst": args.burst,
            "max_in_flight": args.max_in_flight,
            "mesh": "fake OpenAI server in its own process, immediate answers",
        },
        "direct_http": direct,
        "bridge": bridged,
        "median_overhead_ms": overhead,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
