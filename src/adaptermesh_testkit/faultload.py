"""Open-loop load through the local mesh, and the fault scenarios run under it.

:class:`OpenLoad` sends streaming completions from the tenant addresses (tenant -> eBPF
classifier -> Envoy -> CPU worker, a new connection each time) at a fixed rate, whether or not
earlier ones have finished, and keeps one :class:`RequestRecord` per request: when it was due,
when its first byte and each later chunk came, how it ended. :func:`kill_scenario`,
:func:`drain_scenario` and :func:`step_error_scenario` inject one kind of fault under that load
and :func:`summarize` turns the records into the figures ``bench/bench_faults.py`` writes and
``tests/e2e/test_faults.py`` asserts (``docs/faults.md`` defines each one).

Outcomes: ``ok`` (the stream ended with ``[DONE]``), ``http_<status>`` (an error status before
any token), ``error_event`` (an ``error`` event inside the stream), ``closed`` (the connection
closed before ``[DONE]``), ``timeout`` (no byte for the read timeout: a hang),
``connect_error``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from adaptermesh_testkit.cpusample import CpuSampler
from adaptermesh_testkit.localmesh import SERVICE_PORT, LocalMesh, plain_http_client
from adaptermesh_testkit.netns import inside

__all__ = [
    "IN_FLIGHT_END_BOUND_S",
    "KILL_ALLOWED_AFTER_S",
    "SCENARIOS",
    "FaultEvent",
    "OpenLoad",
    "RequestRecord",
    "drain_scenario",
    "dump_records",
    "held",
    "kill_scenario",
    "run_scenario",
    "stall_scenario",
    "step_error_scenario",
    "summarize",
    "warm_workers",
]

PROMPT = "The quick brown fox"


@dataclass
class RequestRecord:
    source: str
    adapter: str
    due: float  # monotonic time the open-loop schedule sent it
    started: float = 0.0
    first_byte: float | None = None
    ended: float = 0.0
    status: int = 0
    chunks: int = 0
    outcome: str = ""
    detail: str = ""
    retry_after: str | None = None
    # The longest wait without a byte: from the start, between chunks, or until the end.
    max_gap_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


@dataclass
class FaultEvent:
    kind: str  # kill, drain, step_error
    target: str
    at: float  # monotonic time of the injection
    # When the fault was over (the worker back and healthy in Envoy); None: never.
    recovered_at: float | None = None
    # Requests in flight at any moment from ``at`` to this may fail (None: the scenario's
    # ``allowed_after_s`` after ``at``).
    allowed_until: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)


def _stream_once(
    record: RequestRecord, base: str, max_tokens: int, read_timeout_s: float, stream: bool = True
) -> None:
    record.started = time.monotonic()
    last = record.started

    def progress() -> None:
        nonlocal last
        now = time.monotonic()
        record.max_gap_s = max(record.max_gap_s, now - last)
        last = now

    body = {
        "model": record.adapter,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    timeout = httpx.Timeout(read_timeout_s, connect=5.0)
    try:
        with (
            plain_http_client(record.source, timeout) as client,
            client.stream(
                "POST",
                f"{base}/v1/completions",
                json=body,
                headers={"x-adapter-id": record.adapter},
            ) as response,
        ):
            record.status = response.status_code
            record.first_byte = time.monotonic()
            progress()
            if response.status_code != 200:
                record.retry_after = response.headers.get("retry-after")
                record.detail = response.read().decode(errors="replace")[:1000]
                record.outcome = f"http_{response.status_code}"
                return
            if not stream:  # one JSON body: ok when it carries a choice
                raw = response.read()
                progress()
                try:
                    choices = json.loads(raw).get("choices")
                except ValueError:
                    choices = None
                record.outcome = "ok" if choices else "closed"
                if not choices:
                    record.detail = raw.decode(errors="replace")[:1000]
                return
            done = False
            for line in response.iter_lines():
                progress()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    continue
                record.chunks += 1
                if '"error"' in payload:
                    with contextlib.suppress(ValueError):
                        event = json.loads(payload)
                        if "error" in event:
                            record.outcome = "error_event"
                            record.detail = json.dumps(event["error"])[:300]
            if not record.outcome:
                record.outcome = "ok" if done else "closed"
    except httpx.TimeoutException as exc:
        record.outcome = "timeout"
        record.detail = repr(exc)[:300]
    except httpx.ConnectError as exc:
        record.outcome = "connect_error"
        record.detail = repr(exc)[:300]
    except (httpx.HTTPError, OSError) as exc:
        record.outcome = "closed"
        record.detail = repr(exc)[:300]
    finally:
        record.ended = time.monotonic()
        record.max_gap_s = max(record.max_gap_s, record.ended - last)


class OpenLoad:
    """Streaming completions (plain ones with ``stream`` False) at ``rate_per_s`` from ``sources`` in turn, open loop: each is
    due at start + k / rate and sent then, however many are still running.

    ``read_timeout_s`` bounds the wait for any one byte: a request that waits longer ends as
    ``timeout`` (a hang) instead of blocking the run.
    """

    def __init__(
        self,
        mesh: LocalMesh,
        rate_per_s: float,
        sources: Sequence[str],
        adapters: Sequence[str],
        max_tokens: int = 32,
        read_timeout_s: float = 20.0,
        max_in_flight: int = 128,
        stream: bool = True,
    ) -> None:
        self.mesh = mesh
        self.stream = stream
        self.rate_per_s = rate_per_s
        self.sources = list(sources)
        self.adapters = list(adapters)
        self.max_tokens = max_tokens
        self.read_timeout_s = read_timeout_s
        self.records: list[RequestRecord] = []
        # Due requests that found every sender busy (the schedule still counts them).
        self.skipped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._in_flight = threading.Semaphore(max_in_flight)
        self._senders: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._schedule, daemon=True)
        self.started_at = 0.0

    def _send(self, record: RequestRecord) -> None:
        # One short thread per request, entering and leaving the tenants' namespace itself:
        # ``inside`` restores the namespace of the thread that closes it, so it must never be
        # left for the garbage collector to close from another thread.
        try:
            with inside(self.mesh.tenant_ns):
                _stream_once(
                    record,
                    f"http://{self.mesh.vip}:{SERVICE_PORT}",
                    self.max_tokens,
                    self.read_timeout_s,
                    self.stream,
                )
        finally:
            self._in_flight.release()

    def _schedule(self) -> None:
        period = 1.0 / self.rate_per_s
        k = 0
        while not self._stop.is_set():
            due = self.started_at + k * period
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            i = k % (len(self.sources) * len(self.adapters))
            record = RequestRecord(
                self.sources[i % len(self.sources)],
                self.adapters[(i // len(self.sources)) % len(self.adapters)],
                due,
            )
            k += 1
            if not self._in_flight.acquire(blocking=False):
                self.skipped += 1
                continue
            sender = threading.Thread(target=self._send, args=(record,), daemon=True)
            with self._lock:
                self.records.append(record)
                self._senders.append(sender)
            sender.start()

    def start(self) -> OpenLoad:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[RequestRecord]:
        """Stop sending; wait for the requests in flight (each bounded by its read timeout)."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            senders = list(self._senders)
        for sender in senders:
            sender.join()
        with self._lock:
            return list(self.records)

    def __enter__(self) -> OpenLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def completed(self) -> int:
        with self._lock:
            return sum(1 for r in self.records if r.ended and r.ok)


# ---- figures -----------------------------------------------------------------------------------


def _percentiles(values: Iterable[float]) -> dict[str, float | None]:
    data = sorted(values)
    if not data:
        return {"n": 0, "p50_s": None, "p99_s": None}
    if len(data) == 1:
        return {"n": 1, "p50_s": round(data[0], 4), "p99_s": round(data[0], 4)}
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    return {"n": len(data), "p50_s": round(cuts[49], 4), "p99_s": round(cuts[98], 4)}


def _failure_row(record: RequestRecord, first: float) -> dict[str, Any]:
    """A failed request as the results JSON samples it."""
    return {
        "outcome": record.outcome,
        "status": record.status,
        "detail": record.detail,
        "started_after_first_fault_s": round(record.started - first, 3),
    }


def summarize(
    records: Sequence[RequestRecord],
    faults: Sequence[FaultEvent],
    allowed_after_s: float | None,
) -> dict[str, Any]:
    """Per-scenario figures.

    A failed request is *allowed* when it was in flight at some moment between a fault and
    ``allowed_after_s`` seconds after it (the fault's own ``allowed_until`` when set): in flight
    at the fault, or started within that window. ``None`` allows none (a drain must fail
    nothing). Phases: ``before`` (due before the first fault), ``during``
    (due between a fault and its recovery), ``after`` (due after the last recovery); latency
    is start to end of the requests that succeeded.
    """
    first = min((f.at for f in faults), default=float("inf"))
    last_recovery = max(
        (f.recovered_at if f.recovered_at is not None else float("inf") for f in faults),
        default=float("-inf"),
    )

    def during(r: RequestRecord) -> bool:
        return any(
            f.at <= r.due <= (f.recovered_at if f.recovered_at is not None else float("inf"))
            for f in faults
        )

    def allowed(r: RequestRecord) -> bool:
        for f in faults:
            if f.allowed_until is not None:
                until = f.allowed_until
            elif allowed_after_s is not None:
                until = f.at + allowed_after_s
            else:
                continue
            if r.started <= until and r.ended >= f.at:
                return True
        return False

    failed = [r for r in records if not r.ok]
    outside = [r for r in failed if not allowed(r)]
    # How long a request that was in flight at a fault and failed took to end after it.
    fault_to_end = [r.ended - f.at for r in failed for f in faults if r.started <= f.at <= r.ended]
    phases = {
        "before": [r for r in records if r.ok and r.due < first],
        "during": [r for r in records if r.ok and during(r)],
        "after": [r for r in records if r.ok and r.due > last_recovery],
    }
    return {
        "requests_sent": len(records),
        "requests_ok": len(records) - len(failed),
        "failed": len(failed),
        "failed_outside_allowed_window": len(outside),
        "allowed_after_fault_s": allowed_after_s,
        "outcomes": dict(Counter(r.outcome for r in records)),
        "latency": {name: _percentiles(r.latency_s for r in rs) for name, rs in phases.items()},
        "worst_hang_s": round(max((r.max_gap_s for r in records), default=0.0), 4),
        "in_flight_failed_fault_to_end_max_s": round(max(fault_to_end), 4)
        if fault_to_end
        else None,
        "timeouts": sum(1 for r in records if r.outcome == "timeout"),
        "failures_sample": [
            {**_failure_row(r, first), "retry_after": r.retry_after} for r in failed[:8]
        ],
        "failures_outside_sample": [_failure_row(r, first) for r in outside[:8]],
        "faults": [
            {
                "kind": f.kind,
                "target": f.target,
                "at_s": round(f.at - first, 3),
                "recovered_after_s": round(f.recovered_at - f.at, 3)
                if f.recovered_at is not None
                else None,
                **f.notes,
            }
            for f in faults
        ],
    }


def dump_records(path: Path, records: Sequence[RequestRecord], origin: float) -> None:
    """Every record as one JSON line, times relative to ``origin`` (for a closer look)."""
    with open(path, "w") as fh:
        for r in records:
            row = asdict(r)
            for key in ("due", "started", "first_byte", "ended"):
                if row[key] is not None:
                    row[key] = round(row[key] - origin, 4)
            fh.write(json.dumps(row) + "\n")


# ---- scenarios -----------------------------------------------------------------------------


def _wait(cond: Callable[[], bool], timeout: float, interval: float = 0.1) -> float | None:
    """Poll ``cond``; the monotonic time it first held, None when ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return time.monotonic()
        time.sleep(interval)
    return None


def _running_on(mesh: LocalMesh, shard_id: str, j: int) -> int:
    """Requests in worker ``j``'s running batch (its ``vllm:num_requests_running``)."""
    addr, port = mesh.worker_endpoints(shard_id)[j]
    text = mesh.in_node(_http_text, f"http://{addr}:{port}/metrics")
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _http_text(url: str) -> str:
    return httpx.get(url, timeout=2).text


def _when_busy(mesh: LocalMesh, shard_id: str, j: int, timeout: float = 90.0) -> int:
    """Wait (up to ``timeout``) until worker ``j`` of ``shard_id`` is generating, so that the
    fault meets a stream in flight; returns how many it runs (0 when it never did).

    The wait may be long: the control plane may weigh a worker that queued or ran slow (just
    restarted by an earlier scenario, or on a busy machine) down to 5 % of its shard's best
    and back up over several rounds, and at one request a second such a worker sees about
    one request every 20 s. In one CI-form run on a loaded machine 30 s passed without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            running = _running_on(mesh, shard_id, j)
            if running:
                return running
        time.sleep(0.02)
    return 0


def _back_in_envoy(mesh: LocalMesh, shard_id: str, j: int, timeout: float) -> float | None:
    return _wait(lambda: mesh.envoy_host_flags(shard_id, j) == [], timeout, 0.2)


def kill_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    victim: tuple[str, int],
    kills: int,
    period_s: float,
    warmup_s: float,
    cooldown_s: float,
) -> list[FaultEvent]:
    """Every ``period_s``, SIGKILL the victim worker mid-stream and start it again at once;
    each fault is over when Envoy lists the worker healthy again."""
    shard_id, j = victim
    time.sleep(warmup_s)
    faults: list[FaultEvent] = []
    for _ in range(kills):
        cycle_start = time.monotonic()
        # A scenario run before this one may have left the victim just restarted: Envoy must
        # route to it again before a stream can be in flight there.
        _back_in_envoy(mesh, shard_id, j, 60)
        on_victim = _when_busy(mesh, shard_id, j)
        in_flight = sum(1 for r in list(load.records) if r.started and not r.ended)
        at = mesh.kill_worker(shard_id, j)
        event = FaultEvent(
            "kill",
            f"{shard_id}/{j}",
            at,
            notes={"in_flight_at_kill": in_flight, "victim_running_at_kill": on_victim},
        )
        faults.append(event)
        ejected = _wait(lambda: bool(mesh.envoy_host_flags(shard_id, j)), 30, 0.1)
        event.notes["envoy_flagged_after_s"] = round(ejected - at, 3) if ejected else None
        mesh.start_worker_again(shard_id, j)
        event.notes["worker_healthy_after_s"] = round(time.monotonic() - at, 3)
        event.recovered_at = _back_in_envoy(mesh, shard_id, j, 60)
        rest = period_s - (time.monotonic() - cycle_start)
        if rest > 0:
            time.sleep(rest)
    time.sleep(cooldown_s)
    return faults


def drain_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    victim: tuple[str, int],
    warmup_s: float,
    cooldown_s: float,
    drains: int = 1,
    drain_timeout_s: float = 60.0,
) -> list[FaultEvent]:
    """``drains`` times: SIGTERM the victim while it generates (its drain), wait for it to
    exit, start it again and wait until Envoy lists it healthy."""
    shard_id, j = victim
    time.sleep(warmup_s)
    faults: list[FaultEvent] = []
    for _ in range(drains):
        flagged: list[float] = []
        stop = threading.Event()

        def watch(flagged: list[float] = flagged, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    if mesh.envoy_host_flags(shard_id, j):
                        flagged.append(time.monotonic())
                        return
                stop.wait(0.1)

        on_victim = _when_busy(mesh, shard_id, j)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        at, code = mesh.drain_worker(shard_id, j, timeout=drain_timeout_s)
        exited = time.monotonic()
        stop.set()
        watcher.join()
        event = FaultEvent(
            "drain",
            f"{shard_id}/{j}",
            at,
            notes={
                "victim_running_at_signal": on_victim,
                "exit_code": code,
                "exited_after_s": round(exited - at, 3),
                "envoy_flagged_after_s": round(flagged[0] - at, 3) if flagged else None,
            },
        )
        faults.append(event)
        mesh.start_worker_again(shard_id, j)
        event.recovered_at = _back_in_envoy(mesh, shard_id, j, 60)
        time.sleep(cooldown_s)
    return faults


def step_error_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    victim: tuple[str, int],
    trigger_base: str,
    warmup_s: float,
    cooldown_s: float,
    message: str = "CUDA error: an illegal memory access was encountered (injected)",
) -> list[FaultEvent]:
    """Arm one injected error in the victim's next engine step (``worker/faults.py``'s
    trigger file; the workers were started with ``ADAPTERMESH_FAULT_STEP_ERROR``)."""
    shard_id, j = victim
    time.sleep(warmup_s)
    proc = mesh.worker_proc(shard_id, j)
    trigger = Path(f"{trigger_base}.{proc.popen.pid}")
    on_victim = _when_busy(mesh, shard_id, j)
    # Written whole under another name, then renamed: the worker checks for the trigger
    # before every step and must never read it empty (its message is what the test checks).
    staged = trigger.with_name(f".{trigger.name}.staged")
    staged.write_text(message)
    at = time.monotonic()
    staged.rename(trigger)
    consumed = _wait(lambda: not trigger.exists(), 30, 0.02)
    event = FaultEvent(
        "step_error",
        f"{shard_id}/{j}",
        at,
        notes={
            "message": message,
            "victim_running_at_arming": on_victim,
            "consumed_after_s": round(consumed - at, 3) if consumed else None,
            "worker_alive_after": proc.alive,
        },
    )
    # Over once the step has failed (the engine serves on; nothing to restart); the requests
    # in flight from arming to then are the ones that may be in the failed step.
    event.recovered_at = consumed
    event.allowed_until = consumed
    time.sleep(cooldown_s)
    event.notes["worker_alive_after"] = proc.alive
    return [event]


def stall_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    stalled_load: OpenLoad,
    stall_s: float,
    warmup_s: float,
    cooldown_s: float,
    recover_timeout_s: float = 60.0,
) -> list[FaultEvent]:
    """The adapter store stalls (every shard's StallProxy accepts and never answers) while
    ``load`` runs on the resident adapters; after ``warmup_s`` (the ``before`` phase)
    ``stalled_load`` starts asking for an adapter only that store holds. After ``stall_s`` the
    store answers again; the fault is over at the first request for that adapter that
    succeeds (its load finished). ``stalled_load`` runs on through ``cooldown_s``."""
    proxies = list(mesh.store_proxies.values())
    if not proxies:
        raise ValueError("stall: the mesh has no adapter store (MeshConfig.store_adapters)")
    for proxy in proxies:
        proxy.stall()
    time.sleep(warmup_s)
    at = time.monotonic()
    stalled_load.start()
    time.sleep(stall_s)
    released = time.monotonic()
    for proxy in proxies:
        proxy.forward()

    def loaded() -> bool:
        with stalled_load._lock:
            return any(r.ok and r.started >= released for r in stalled_load.records)

    first_ok = _wait(loaded, recover_timeout_s, 0.1)
    event = FaultEvent(
        "stall",
        f"store {', '.join(p.url for p in proxies)}",
        at,
        # Set from the records once the stalled load has stopped (_stall_recovery): each
        # worker loads the adapter on its own, so the first success is not yet the end.
        recovered_at=None,
        allowed_until=float("inf"),
        notes={
            "stall_s": round(released - at, 3),
            "released_at": released,
            "first_ok_after_release_s": round(first_ok - released, 3) if first_ok else None,
            "connections_held": sum(p.held for p in proxies),
        },
    )
    time.sleep(cooldown_s)
    return [event]


def _stall_recovery(event: FaultEvent, stalled: Sequence[RequestRecord]) -> None:
    """The stall is over at the first success for the stalled adapter after the store
    answers again that no failure follows (every worker has loaded it); requests for it may
    fail (503) until then. None when it never got there."""
    released = float(event.notes.pop("released_at"))
    last_failure = max((r.started for r in stalled if not r.ok), default=released)
    later = sorted(r.started for r in stalled if r.ok and r.started > max(last_failure, released))
    recovered = later[0] if later else None
    event.recovered_at = recovered
    event.allowed_until = recovered if recovered is not None else float("inf")
    event.notes["recovered_after_release_s"] = (
        round(recovered - released, 3) if recovered is not None else None
    )


# ---- packets through the classifier: sent vs arrived at the right shard ------------------------

PROBE_UDP_PORT = 7000


class UdpProbe:
    """UDP datagrams from ``sources`` (tenant-namespace addresses) to the VIP at ``rate_pps``
    per source, each numbered; a receiver in every shard namespace records which arrived
    where. :meth:`summary` counts, for the packets sent in a window, those that reached the
    shard the classifier steers their source to (``expected``: source -> shard id), those that
    reached another shard (misclassified) and those that reached none (lost)."""

    def __init__(self, mesh: LocalMesh, sources: Sequence[str], rate_pps: float) -> None:
        from adaptermesh_testkit.netns import UdpReceiver

        self.mesh = mesh
        self.sources = list(sources)
        self.rate_pps = rate_pps
        self.sent: list[tuple[str, int, float]] = []  # (source, seq, monotonic time)
        self.receivers = {
            shard_id: UdpReceiver(mesh.shard_ns(shard_id), mesh.vip, PROBE_UDP_PORT)
            for shard_id in mesh.shard_ids
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        import socket

        with inside(self.mesh.tenant_ns):
            socks = []
            for source in self.sources:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((source, 0))
                socks.append(sock)
            try:
                period = 1.0 / self.rate_pps
                start = time.monotonic()
                k = 0
                while not self._stop.is_set():
                    delay = start + k * period - time.monotonic()
                    if delay > 0 and self._stop.wait(delay):
                        break
                    for source, sock in zip(self.sources, socks, strict=True):
                        now = time.monotonic()
                        with contextlib.suppress(OSError):
                            sock.sendto(f"{source}|{k}".encode(), (self.mesh.vip, PROBE_UDP_PORT))
                            self.sent.append((source, k, now))
                    k += 1
            finally:
                for sock in socks:
                    sock.close()

    def start(self) -> UdpProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        time.sleep(0.5)  # the last datagrams land
        for receiver in self.receivers.values():
            receiver.close()

    def arrivals(self) -> dict[tuple[str, int], list[str]]:
        """(source, seq) -> the shards it arrived at."""
        out: dict[tuple[str, int], list[str]] = {}
        for shard_id, receiver in self.receivers.items():
            for _src, data in list(receiver.received):
                source, _, seq = data.decode(errors="replace").partition("|")
                with contextlib.suppress(ValueError):
                    out.setdefault((source, int(seq)), []).append(shard_id)
        return out

    def summary(
        self, expected: dict[str, str], start: float = float("-inf"), end: float = float("inf")
    ) -> dict[str, Any]:
        arrivals = self.arrivals()
        sent = [(src, seq) for src, seq, t in self.sent if start <= t <= end]
        right = wrong = lost = 0
        for key in sent:
            where = arrivals.get(key, [])
            if not where:
                lost += 1
            elif all(shard == expected.get(key[0]) for shard in where):
                right += 1
            else:
                wrong += 1
        return {
            "packets_sent": len(sent),
            "arrived_at_expected_shard": right,
            "misclassified": wrong,
            "lost": lost,
        }


def _agent_counters(mesh: LocalMesh) -> dict[str, float]:
    """The classifier's counters as the agent exports them (pinned maps: they carry on
    across agent restarts): packets per shard and packets passed untouched, by reason."""
    text = mesh.in_node(_http_text, mesh.agent_url("/metrics"))
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(
            ("adaptermesh_agent_shard_packets_total", "adaptermesh_agent_classifier_passed")
        ):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def agent_restart_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    probe: UdpProbe,
    restarts: int,
    warmup_s: float,
    cooldown_s: float,
    gap_s: float = 5.0,
    expected: dict[str, str] | None = None,
) -> tuple[list[FaultEvent], dict[str, Any]]:
    """Restart the agent ``restarts`` times (SIGTERM, then SIGKILL, alternately) under the
    HTTP ``load`` and the UDP ``probe``; each fault is over when the new agent has applied
    the control plane's current Assignment. Returns the faults and the packet counts: every
    probe packet sent from each signal to one second after its recovery, by where it went.
    ``expected``: each probe source's shard (pinned ones, say); by default the shard the
    agent's flow table names for it after the warm-up."""
    time.sleep(warmup_s)
    if expected is None:
        expected = {src: mesh.agent_flow(src) or "" for src in probe.sources}
    counters_before = _agent_counters(mesh)
    faults: list[FaultEvent] = []
    for i in range(restarts):
        kill = i % 2 == 1
        at, healthy = mesh.restart_agent(kill=kill)
        applied = mesh.wait_agent_applied(timeout=60)
        event = FaultEvent(
            "agent_restart",
            "agent (SIGKILL)" if kill else "agent (SIGTERM)",
            at,
            recovered_at=time.monotonic(),
            notes={
                "signal": "SIGKILL" if kill else "SIGTERM",
                "healthy_after_s": round(healthy - at, 3),
                "applied_version": applied,
            },
        )
        faults.append(event)
        time.sleep(gap_s)
    time.sleep(cooldown_s)
    counters_after = _agent_counters(mesh)
    windows = [(f.at, (f.recovered_at or f.at) + 1.0) for f in faults]
    per_fault = [probe.summary(expected, a, b) for a, b in windows]
    for f, counts in zip(faults, per_fault, strict=True):
        f.notes["packets"] = counts
    packets = {
        "sources": len(probe.sources),
        "rate_pps_per_source": probe.rate_pps,
        "expected_shard": expected,
        "during_restarts": {
            k: sum(c[k] for c in per_fault)
            for k in ("packets_sent", "arrived_at_expected_shard", "misclassified", "lost")
        },
        "whole_run": probe.summary(expected),
        "classifier_counters_delta": {
            k: counters_after.get(k, 0.0) - counters_before.get(k, 0.0)
            for k in sorted(set(counters_before) | set(counters_after))
        },
    }
    return faults, packets


def control_plane_scenario(
    mesh: LocalMesh,
    load: OpenLoad,
    down_s: float,
    warmup_s: float,
    cooldown_s: float,
) -> list[FaultEvent]:
    """SIGKILL the control plane under load; it stays down ``down_s`` (the agents keep the
    last Assignment, traffic flows); start it again on its state, then change something (a
    pin of the first tenant to the first shard, undone after) and measure how long until the
    agent has applied it."""
    time.sleep(warmup_s)
    shard_id = mesh.shard_ids[0]
    version_before = mesh.current_version()
    at = mesh.stop_control_plane(kill=True)
    time.sleep(0.5)
    status_down = mesh.agent_status()
    time.sleep(max(0.0, down_s - 0.5))
    mesh.start_control_plane_again()
    restarted = time.monotonic()
    version_after_restart = mesh.current_version()
    changed = time.monotonic()
    cidr = f"{mesh.tenants[0]}/32"
    version = mesh.pin(cidr, shard_id)
    applied = mesh.wait_agent_applied(version, timeout=120)
    reached = time.monotonic()
    mesh.unpin(cidr)
    event = FaultEvent(
        "control_plane_down",
        "control plane (SIGKILL)",
        at,
        recovered_at=reached,
        notes={
            "down_s": round(restarted - at, 3),
            "version_before": version_before,
            "version_after_restart": version_after_restart,
            "agent_applied_while_down": status_down.get("applied_version"),
            "agent_connected_while_down": status_down.get("control_plane_connected"),
            "change_version": version,
            "change_applied_by_agent_after_s": round(reached - changed, 3),
            "agent_applied": applied,
        },
    )
    time.sleep(cooldown_s)
    return [event]


# ---- one scenario under load, and the bounds -----------------------------------------

# A request that started later than this after a kill must not fail.
KILL_ALLOWED_AFTER_S = 2.0
# A stream in flight at a kill ends (error event or closed connection) within this.
IN_FLIGHT_END_BOUND_S = 1.0
SCENARIOS = ("kill", "drain", "step_error", "stall", "control_plane", "agent_restart")
# Others' p99 during a store stall: within this factor of their p99 before it.
STALL_OTHERS_P99_FACTOR = 1.2
# A stalled adapter's request gets its 503 within the worker's --adapter-load-wait plus the
# larger of this and the other adapters' p99 before the stall (the path through Envoy and the
# worker on a shared machine).
STALL_WAIT_SLACK_S = 1.5
STEP_ERROR_MESSAGE = "CUDA error: an illegal memory access was encountered (injected)"


def warm_workers(mesh: LocalMesh) -> None:
    """Every worker serves every adapter once (a cold first request is not a fault)."""
    for shard_id in mesh.shard_ids:
        for j in range(mesh.config.workers_per_shard):
            for adapter in mesh.config.adapters:
                mesh.complete_direct(shard_id, j, adapter, "warm up", max_tokens=4)


def held(name: str, summary: dict[str, Any]) -> dict[str, bool]:
    """Which of the issue's bounds held in scenario ``name``'s ``summary``."""
    no_hang = summary["timeouts"] == 0
    if name == "kill":
        end = summary["in_flight_failed_fault_to_end_max_s"]
        return {
            "in_flight_end_within_1s": end is None or end <= IN_FLIGHT_END_BOUND_S,
            "no_failure_later_than_2s_after_a_kill": summary["failed_outside_allowed_window"] == 0,
            "no_hang": no_hang,
        }
    fault = summary["faults"][0]
    if name == "stall":
        stalled = summary["stalled_adapter"]
        others = summary["other_adapters"]
        before = others["latency"]["before"]["p99_s"]
        during = others["latency"]["during"]["p99_s"]
        return {
            "stalled_requests_get_503_with_retry_after": stalled["failed"] > 0
            and stalled["failed"] == stalled["http_503_with_retry_after"],
            "stalled_wait_bounded": stalled["failed_wait_max_s"] is not None
            and stalled["failed_wait_max_s"] <= stalled["wait_bound_s"],
            "others_zero_failed": others["failed"] == 0,
            "others_p99_within_1_2x": before is not None
            and during is not None
            and during <= STALL_OTHERS_P99_FACTOR * before,
            "recovers_and_loads": fault["recovered_after_s"] is not None
            and stalled["ok_after_recovery"] > 0,
            "no_hang": no_hang,
        }
    if name == "control_plane":
        return {
            "zero_failed": summary["failed"] == 0,
            "agent_kept_the_last_assignment": (fault["agent_applied_while_down"] or 0)
            >= fault["version_before"]
            > 0,
            "change_after_restart_reached_the_agent": fault["agent_applied"]
            >= fault["change_version"],
            "no_hang": no_hang,
        }
    if name == "agent_restart":
        during = summary["packets"]["during_restarts"]
        passed = {
            k: v
            for k, v in summary["packets"]["classifier_counters_delta"].items()
            if k.startswith("adaptermesh_agent_classifier_passed") and v
        }
        return {
            "zero_failed": summary["failed"] == 0,
            "no_packet_misclassified": during["packets_sent"] > 0
            and during["misclassified"] == 0
            and during["lost"] == 0,
            "classifier_passed_nothing_unsteered": not passed,
            "no_hang": no_hang,
        }
    if name == "drain":
        return {
            "zero_failed": summary["failed"] == 0,
            "exited_within_drain_timeout": all(f["exit_code"] == 0 for f in summary["faults"]),
            "no_hang": no_hang,
        }
    failures = summary["failures_sample"]
    return {
        "failures_only_in_the_failed_step": summary["failed_outside_allowed_window"] == 0,
        "failures_are_5xx_naming_the_cause": all(
            (f["status"] >= 500 or f["outcome"] == "error_event")
            and "illegal memory access" in f["detail"]
            for f in failures
        ),
        "engine_keeps_serving": bool(fault["worker_alive_after"])
        and summary["latency"]["after"]["n"] > 0,
        "no_hang": no_hang,
    }


def run_scenario(
    mesh: LocalMesh,
    name: str,
    *,
    victim: tuple[str, int] = ("s0", 0),
    rate_per_s: float = 1.0,
    max_tokens: int = 24,
    warmup_s: float = 6.0,
    cooldown_s: float = 6.0,
    read_timeout_s: float = 20.0,
    kills: int = 1,
    kill_period_s: float = 20.0,
    drains: int = 1,
    trigger_base: str | None = None,
    records_path: Path | None = None,
    stall_s: float = 20.0,
    stalled_rate_per_s: float = 0.5,
    load_wait_s: float | None = None,
    down_s: float = 15.0,
    restarts: int = 2,
    probe_pps: float = 50.0,
    probe_expected: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Scenario ``name`` (kill, drain, step_error or stall) under a fresh :class:`OpenLoad`;
    its :func:`summarize` figures with ``held`` (the bounds) and the load's settings.

    ``stall``: ``stall_s`` of a stalled store, ``stalled_rate_per_s`` requests per second
    for the adapter only the store holds, ``load_wait_s`` the workers' --adapter-load-wait.
    ``control_plane``: down ``down_s``. ``agent_restart``: ``restarts`` restarts, with
    ``probe_pps`` UDP packets per second from each of the mesh's probe sources."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario: {name!r} is not one of {', '.join(SCENARIOS)}")
    if name in ("control_plane", "agent_restart"):
        return _run_node_fault(
            mesh,
            name,
            rate_per_s=rate_per_s,
            max_tokens=max_tokens,
            warmup_s=warmup_s,
            cooldown_s=cooldown_s,
            read_timeout_s=read_timeout_s,
            down_s=down_s,
            restarts=restarts,
            probe_pps=probe_pps,
            probe_expected=probe_expected,
            records_path=records_path,
        )
    if name == "stall":
        return _run_stall(
            mesh,
            rate_per_s=rate_per_s,
            max_tokens=max_tokens,
            warmup_s=warmup_s,
            cooldown_s=cooldown_s,
            read_timeout_s=read_timeout_s,
            stall_s=stall_s,
            stalled_rate_per_s=stalled_rate_per_s,
            load_wait_s=load_wait_s,
            records_path=records_path,
        )
    load = OpenLoad(
        mesh,
        rate_per_s,
        mesh.tenants,
        list(mesh.config.adapters),
        max_tokens=max_tokens,
        read_timeout_s=read_timeout_s,
    )
    with load:
        if name == "kill":
            faults = kill_scenario(
                mesh,
                load,
                victim,
                kills=kills,
                period_s=kill_period_s,
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
            )
        elif name == "drain":
            faults = drain_scenario(
                mesh, load, victim, warmup_s=warmup_s, cooldown_s=cooldown_s, drains=drains
            )
        else:
            if trigger_base is None:
                raise ValueError("step_error: trigger_base (ADAPTERMESH_FAULT_STEP_ERROR) unset")
            faults = step_error_scenario(
                mesh,
                load,
                victim,
                trigger_base,
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
                message=STEP_ERROR_MESSAGE,
            )
    records = load.records
    if records_path is not None:
        records_path.parent.mkdir(parents=True, exist_ok=True)
        dump_records(records_path, records, load.started_at)
    allowed = {"kill": KILL_ALLOWED_AFTER_S, "drain": None, "step_error": 0.0}[name]
    summary = summarize(records, faults, allowed)
    summary["open_loop_skipped"] = load.skipped
    summary["load"] = {
        "rate_per_s": rate_per_s,
        "max_tokens": max_tokens,
        "read_timeout_s": read_timeout_s,
    }
    summary["held"] = held(name, summary)
    return summary


def _run_stall(
    mesh: LocalMesh,
    *,
    rate_per_s: float,
    max_tokens: int,
    warmup_s: float,
    cooldown_s: float,
    read_timeout_s: float,
    stall_s: float,
    stalled_rate_per_s: float,
    load_wait_s: float | None,
    records_path: Path | None,
) -> dict[str, Any]:
    if load_wait_s is None:
        raise ValueError("stall: load_wait_s (the workers' --adapter-load-wait) unset")
    if not mesh.config.store_adapters:
        raise ValueError("stall: the mesh has no adapter store (MeshConfig.store_adapters)")
    load = OpenLoad(
        mesh,
        rate_per_s,
        mesh.tenants,
        list(mesh.config.adapters),
        max_tokens=max_tokens,
        read_timeout_s=read_timeout_s,
    )
    stalled_load = OpenLoad(
        mesh,
        stalled_rate_per_s,
        mesh.tenants,
        [mesh.config.store_adapters[0]],
        max_tokens=max_tokens,
        read_timeout_s=read_timeout_s,
    )
    # Which process is busy when: the stall's figures hinge on the machine's CPU.
    cpu = CpuSampler(lambda: {**mesh.pids(), "bench": os.getpid()}).start()
    with load:
        try:
            faults = stall_scenario(
                mesh, load, stalled_load, stall_s, warmup_s=warmup_s, cooldown_s=cooldown_s
            )
        finally:
            stalled = stalled_load.stop() if stalled_load.started_at else []
            cpu.stop()
    _stall_recovery(faults[0], stalled)
    records = [*load.records, *stalled]
    if records_path is not None:
        records_path.parent.mkdir(parents=True, exist_ok=True)
        dump_records(records_path, records, load.started_at)
    summary = summarize(records, faults, None)
    others = summarize(load.records, faults, None)
    # The wait's bound: the load wait plus what a whole request of the other adapters took
    # before the stall (p99; at least STALL_WAIT_SLACK_S): on a loaded machine the path to
    # the worker and back alone takes that long.
    before_p99 = others["latency"]["before"]["p99_s"] or 0.0
    bound = round(load_wait_s + max(STALL_WAIT_SLACK_S, before_p99), 4)
    recovered = faults[0].recovered_at
    failed = [r for r in stalled if not r.ok]
    summary["other_adapters"] = {
        k: others[k]
        for k in ("requests_sent", "failed", "outcomes", "latency", "worst_hang_s", "timeouts")
    }
    summary["stalled_adapter"] = {
        "adapter": mesh.config.store_adapters[0],
        "requests_sent": len(stalled),
        "failed": len(failed),
        "outcomes": dict(Counter(r.outcome for r in stalled)),
        "http_503_with_retry_after": sum(
            1 for r in failed if r.status == 503 and r.retry_after is not None
        ),
        "load_wait_s": load_wait_s,
        "wait_bound_s": bound,
        "failed_wait_max_s": round(max(r.latency_s for r in failed), 4) if failed else None,
        "failed_wait_p50_s": _percentiles(r.latency_s for r in failed)["p50_s"],
        "failed_after_recovery": sum(
            1 for r in failed if recovered is not None and r.started > recovered
        ),
        "ok_after_recovery": sum(
            1 for r in stalled if r.ok and recovered is not None and r.started >= recovered
        ),
        "error_codes": dict(Counter(_error_code(r.detail) for r in failed)),
    }
    summary["open_loop_skipped"] = load.skipped + stalled_load.skipped
    summary["load"] = {
        "rate_per_s": rate_per_s,
        "stalled_rate_per_s": stalled_rate_per_s,
        "max_tokens": max_tokens,
        "read_timeout_s": read_timeout_s,
        "stall_s": stall_s,
    }
    fault = faults[0]
    ended = time.monotonic()
    recovered_at = fault.recovered_at if fault.recovered_at is not None else ended
    summary["cpu_by_phase"] = cpu.by_phase(
        {
            "before": (load.started_at, fault.at),
            "during": (fault.at, recovered_at),
            "after": (recovered_at, ended),
        }
    )
    summary["held"] = held("stall", summary)
    return summary


def _error_code(detail: str) -> str:
    """The ``code`` of an OpenAI-style error body (its first 300 characters are kept)."""
    found = re.search(r'"code":\s*"([^"]+)"', detail)
    return found.group(1) if found else "-"


def _run_node_fault(
    mesh: LocalMesh,
    name: str,
    *,
    rate_per_s: float,
    max_tokens: int,
    warmup_s: float,
    cooldown_s: float,
    read_timeout_s: float,
    down_s: float,
    restarts: int,
    probe_pps: float,
    records_path: Path | None,
    probe_expected: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``control_plane`` or ``agent_restart`` under the HTTP load (no failure allowed); the
    agent restart also under the UDP probe from the mesh's probe sources."""
    load = OpenLoad(
        mesh,
        rate_per_s,
        mesh.tenants,
        list(mesh.config.adapters),
        max_tokens=max_tokens,
        read_timeout_s=read_timeout_s,
    )
    packets: dict[str, Any] | None = None
    if name == "agent_restart":
        if not mesh.probe_sources:
            raise ValueError("agent_restart: the mesh has no probe sources (probe_sources)")
        probe = UdpProbe(mesh, mesh.probe_sources, probe_pps)
        probe.start()
        try:
            with load:
                faults, packets = agent_restart_scenario(
                    mesh,
                    load,
                    probe,
                    restarts,
                    warmup_s=warmup_s,
                    cooldown_s=cooldown_s,
                    expected=probe_expected,
                )
        finally:
            probe.stop()
    else:
        with load:
            faults = control_plane_scenario(
                mesh, load, down_s, warmup_s=warmup_s, cooldown_s=cooldown_s
            )
    records = load.records
    if records_path is not None:
        records_path.parent.mkdir(parents=True, exist_ok=True)
        dump_records(records_path, records, load.started_at)
    summary = summarize(records, faults, None)
    if packets is not None:
        summary["packets"] = packets
    summary["open_loop_skipped"] = load.skipped
    summary["load"] = {
        "rate_per_s": rate_per_s,
        "max_tokens": max_tokens,
        "read_timeout_s": read_timeout_s,
        **({"down_s": down_s} if name == "control_plane" else {"restarts": restarts}),
    }
    summary["held"] = held(name, summary)
    return summary
