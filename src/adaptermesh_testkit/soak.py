"""A soak of the local mesh: mixed open-loop traffic for many minutes while overrides, pins and
rollouts change every minute, with the resident memory (RSS) and the open file descriptors of
every process of the mesh sampled throughout.

Traffic: streaming completions and non-streaming ones (two :class:`OpenLoad` s) over every
adapter from every tenant. Changes, one a minute in turn: an override on the first shard (set,
then cleared), a pin of the first tenant to the last shard (pinned, then unpinned), a rollout
of the first adapter to its next version (started at a 50 % split, aborted half a minute
later). Nothing is injected, so no request may fail.

:func:`run_soak` returns the figures ``bench/bench_faults.py --soak`` writes: requests sent and
failed, latency per ten-minute block, and per process the RSS and descriptor count at the end
of the warm-up (``baseline_after_s``), their maximum and last value after it, the growth,
and the RSS once a minute.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptermesh_testkit.cpusample import PeriodicSampler
from adaptermesh_testkit.faultload import OpenLoad, RequestRecord, _percentiles
from adaptermesh_testkit.localmesh import LocalMesh

__all__ = ["RSS_GROWTH_BOUND", "ProcessSampler", "rss_by_mapping", "run_soak"]

# RSS after the warm-up may grow at most this fraction; descriptors at most FD_SLACK.
RSS_GROWTH_BOUND = 0.05
FD_SLACK = 4


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# An anonymous mapping with at least this much address space counts as large.
_LARGE_ANON_KIB = 32 * 1024


def rss_by_mapping(smaps: str) -> dict[str, int]:
    """RSS (KiB) of one process by kind of mapping, from the text of ``/proc/<pid>/smaps``:
    ``heap`` (the brk heap: glibc malloc's main arena), ``anon_large`` (anonymous mappings of at
    least 32 MiB of address space: large malloc blocks), ``anon_small`` (every other anonymous
    mapping: Python's own arenas, which the kernel merges when adjacent, thread stacks, the used
    part of malloc's other arenas), ``file`` (file-backed: code, libraries, mapped files)."""
    out = {"heap": 0, "anon_large": 0, "anon_small": 0, "file": 0}
    kind = "file"
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            parts = line.split()
            lo, _, hi = parts[0].partition("-")
            try:
                size_kib = (int(hi, 16) - int(lo, 16)) // 1024
            except ValueError:
                continue
            path = parts[5] if len(parts) > 5 else ""
            if path == "[heap]":
                kind = "heap"
            elif path == "" or path.startswith("[anon") or path == "[stack]":
                kind = "anon_large" if size_kib >= _LARGE_ANON_KIB else "anon_small"
            else:
                kind = "file"
        elif line.startswith("Rss:"):
            out[kind] += int(line.split()[1])
    return out


def _mapping_kib(pid: int) -> dict[str, int] | None:
    try:
        return rss_by_mapping(Path(f"/proc/{pid}/smaps").read_text())
    except OSError:
        return None


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class ProcessSampler(PeriodicSampler):
    """Every ``interval_s``: RSS (KiB) and open descriptors of each process ``pids()``
    names, with the time since :meth:`start`."""

    def __init__(self, pids: Callable[[], dict[str, int]], interval_s: float) -> None:
        super().__init__(interval_s)
        self.pids = pids
        self.samples: list[tuple[float, dict[str, tuple[int, int, int]]]] = []
        # RSS by kind of mapping (rss_by_mapping), per sample, per process name.
        self.mappings: list[dict[str, dict[str, int]]] = []
        self.loadavg: list[float] = []  # the machine's 1-minute load average per sample

    def sample(self) -> None:
        row: dict[str, tuple[int, int, int]] = {}
        maps: dict[str, dict[str, int]] = {}
        for name, pid in self.pids().items():
            rss, fds, kinds = _rss_kib(pid), _fds(pid), _mapping_kib(pid)
            if rss is not None and fds is not None:
                row[name] = (pid, rss, fds)
                if kinds is not None:
                    maps[name] = kinds
        self.samples.append((time.monotonic() - self.started, row))
        self.mappings.append(maps)
        self.loadavg.append(os.getloadavg()[0])

    def figures(self, baseline_after_s: float) -> dict[str, Any]:
        """Per process: RSS and descriptors at the first sample at or after
        ``baseline_after_s``, the maximum and the last after it, and the growth. A process
        whose pid changed (it was restarted) is reported from its newest pid only."""
        out: dict[str, Any] = {}
        names = sorted({n for _, row in self.samples for n in row})
        for name in names:
            rows = [(t, row[name]) for t, row in self.samples if name in row]
            pid = rows[-1][1][0]
            rows = [(t, v) for t, v in rows if v[0] == pid]
            after = [(t, v) for t, v in rows if t >= baseline_after_s]
            if not after:
                continue
            base_t, (_, base_rss, base_fds) = after[0]
            max_rss = max(v[1] for _, v in after)
            max_fds = max(v[2] for _, v in after)
            last_rss, last_fds = after[-1][1][1], after[-1][1][2]
            out[name] = {
                "pid": pid,
                "samples": len(rows),
                "rss_kib_first": rows[0][1][1],
                "baseline_at_s": round(base_t, 1),
                "rss_kib_baseline": base_rss,
                "rss_kib_max_after": max_rss,
                "rss_kib_last": last_rss,
                "rss_growth": round(max_rss / base_rss - 1.0, 4) if base_rss else None,
                "fds_baseline": base_fds,
                "fds_max_after": max_fds,
                "fds_last": last_fds,
                # One (seconds, KiB) point a minute, so a plateau shows from a steady climb.
                "rss_kib_per_minute": _per_minute(rows),
                # What holds it, at the baseline and at the last sample.
                "rss_kib_by_mapping": {
                    "baseline": self._mapping_at(name, pid, base_t),
                    "last": self._mapping_at(name, pid, after[-1][0]),
                },
            }
        return out

    def _mapping_at(self, name: str, pid: int, t: float) -> dict[str, int] | None:
        for i, (ts, row) in enumerate(self.samples):
            if ts == t and name in row and row[name][0] == pid and i < len(self.mappings):
                return self.mappings[i].get(name)
        return None


def _per_minute(rows: list[tuple[float, tuple[int, int, int]]]) -> list[list[float]]:
    """The first sample of every minute (and the last one): [seconds, RSS KiB]."""
    out: list[list[float]] = []
    minute = -1
    for t, (_, rss, _) in rows:
        if int(t // 60) != minute:
            minute = int(t // 60)
            out.append([round(t, 1), rss])
    if rows and out[-1][0] != round(rows[-1][0], 1):
        out.append([round(rows[-1][0], 1), rows[-1][1][1]])
    return out


class _Changes:
    """One change a minute, in turn: override, pin, rollout (each undone the next time)."""

    def __init__(
        self,
        mesh: LocalMesh,
        rollout_adapter: str,
        rollout_to: str,
        progress: Callable[[str], None] = lambda _m: None,
    ) -> None:
        self.mesh = mesh
        self.progress = progress
        self.rollout_adapter = rollout_adapter
        self.rollout_to = rollout_to
        self.log: list[dict[str, Any]] = []
        self.override = False
        self.pinned = False
        self._abort_timer: threading.Timer | None = None

    def _record(self, at: float, kind: str, ok: bool, detail: str = "") -> None:
        self.log.append({"at_s": round(at, 1), "change": kind, "ok": ok, "detail": detail[:200]})
        self.progress(f"soak: {at / 60:.1f} min: {kind}{'' if ok else ' FAILED: ' + detail[:200]}")

    def apply(self, minute: int, at: float) -> None:
        mesh = self.mesh
        step = minute % 3
        try:
            if step == 0:
                if self.override:
                    mesh.clear_override(mesh.shard_ids[0])
                    self._record(at, "override cleared", True)
                else:
                    mesh.set_override(mesh.shard_ids[0], 3000, "soak")
                    self._record(at, "override set", True)
                self.override = not self.override
            elif step == 1:
                cidr = f"{mesh.tenants[0]}/32"
                if self.pinned:
                    mesh.unpin(cidr)
                    self._record(at, "unpinned", True)
                else:
                    mesh.pin(cidr, mesh.shard_ids[-1])
                    self._record(at, "pinned", True)
                self.pinned = not self.pinned
            else:
                self._rollout(at)
        except Exception as exc:  # a refused change is a finding, not the end of the soak
            self._record(at, ["override", "pin", "rollout"][step], False, repr(exc))

    def _rollout(self, at: float) -> None:
        result = self.mesh.adapterctl(
            "rollout",
            "start",
            self.rollout_adapter,
            "--to",
            self.rollout_to,
            "--steps",
            "50,100",
            "--interval",
            "10m",
            "--max-error-rate",
            "50%",
            "--min-requests",
            "1",
            "--reason",
            "soak",
            check=False,
        )
        ok = result.returncode == 0
        self._record(at, "rollout started (50%)", ok, (result.stdout + result.stderr).strip())
        if ok:
            started = time.monotonic()

            def abort() -> None:
                r = self.mesh.adapterctl("rollout", "abort", self.rollout_adapter, check=False)
                self._record(
                    at + time.monotonic() - started,
                    "rollout aborted",
                    r.returncode == 0,
                    (r.stdout + r.stderr).strip(),
                )

            self._abort_timer = threading.Timer(30.0, abort)
            self._abort_timer.daemon = True
            self._abort_timer.start()

    def wait(self) -> None:
        if self._abort_timer is not None:
            self._abort_timer.join()


def _block_latency(records: list[RequestRecord], origin: float, block_s: float) -> list[Any]:
    blocks: dict[int, list[float]] = {}
    for r in records:
        if r.ok:
            blocks.setdefault(int((r.due - origin) // block_s), []).append(r.latency_s)
    return [
        {"from_min": round(k * block_s / 60, 1), **_percentiles(v)}
        for k, v in sorted(blocks.items())
    ]


def run_soak(
    mesh: LocalMesh,
    minutes: float,
    *,
    rate_per_s: float = 2.0,
    plain_rate_per_s: float = 1.0,
    max_tokens: int = 16,
    baseline_after_s: float = 300.0,
    sample_interval_s: float = 15.0,
    change_every_s: float = 60.0,
    rollout_adapter: str = "support",
    rollout_to: str = "2.0.0",
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Soak ``mesh`` for ``minutes`` (module docstring); its figures."""
    adapters = list(mesh.config.adapters)
    streamed = OpenLoad(mesh, rate_per_s, mesh.tenants, adapters, max_tokens=max_tokens)
    plain = OpenLoad(
        mesh, plain_rate_per_s, mesh.tenants, adapters, max_tokens=max_tokens, stream=False
    )
    sampler = ProcessSampler(mesh.pids, sample_interval_s)
    changes = _Changes(mesh, rollout_adapter, rollout_to, progress)
    duration = minutes * 60.0
    sampler.start()
    streamed.start()
    plain.start()
    origin = streamed.started_at
    try:
        minute = 0
        while True:
            next_at = origin + (minute + 1) * change_every_s
            if next_at > origin + duration:
                break
            time.sleep(max(0.0, next_at - time.monotonic()))
            elapsed = time.monotonic() - origin
            changes.apply(minute, elapsed)
            minute += 1
            if minute % 2 == 0:
                done = len(streamed.records) + len(plain.records)
                bad = Counter(
                    r.outcome for r in [*streamed.records, *plain.records] if r.ended and not r.ok
                )
                progress(f"soak: {elapsed / 60:.1f} min, {done} requests, failed {dict(bad)}")
        time.sleep(max(0.0, origin + duration - time.monotonic()))
    finally:
        streamed_records = streamed.stop()
        records = [*streamed_records, *plain.stop()]
        streamed_ids = {id(r) for r in streamed_records}
        changes.wait()
        sampler.stop()
    failed = [r for r in records if not r.ok]
    processes = sampler.figures(min(baseline_after_s, duration / 2))
    worst_rss = max((p["rss_growth"] or 0.0 for p in processes.values()), default=0.0)
    worst_fds = max((p["fds_max_after"] - p["fds_baseline"] for p in processes.values()), default=0)
    fds_last = max((p["fds_last"] - p["fds_baseline"] for p in processes.values()), default=0)
    return {
        "minutes": round((time.monotonic() - origin) / 60.0, 2),
        "minutes_asked": minutes,
        "requests_sent": len(records),
        "requests_ok": len(records) - len(failed),
        "failed": len(failed),
        "failed_outside_allowed_window": len(failed),  # nothing injected: none allowed
        "outcomes": dict(Counter(r.outcome for r in records)),
        "open_loop_skipped": streamed.skipped + plain.skipped,
        "latency": {
            "streamed": _percentiles(r.latency_s for r in records if r.ok and r.chunks),
            "whole_run": _percentiles(r.latency_s for r in records if r.ok),
            "per_10_min": _block_latency(records, origin, 600.0),
        },
        "worst_hang_s": round(max((r.max_gap_s for r in records), default=0.0), 4),
        "timeouts": sum(1 for r in records if r.outcome == "timeout"),
        "failures_sample": [
            {
                "outcome": r.outcome,
                "status": r.status,
                "detail": r.detail[:300],
                # Beside the changes' at_s: which change, if any, it followed.
                "started_s": round(r.started - origin, 3),
                "source": r.source,
                "adapter": r.adapter,
                "stream": id(r) in streamed_ids,
            }
            for r in failed[:8]
        ],
        "changes": changes.log,
        "changes_failed": sum(1 for c in changes.log if not c["ok"]),
        "loadavg_1m": {
            "mean": round(sum(sampler.loadavg) / len(sampler.loadavg), 2),
            "max": round(max(sampler.loadavg), 2),
        },
        "baseline_after_s": min(baseline_after_s, duration / 2),
        "sample_interval_s": sample_interval_s,
        "processes": processes,
        "worst_rss_growth": worst_rss,
        "worst_fds_growth_max": worst_fds,
        "worst_fds_growth_last": fds_last,
        "load": {
            "streamed_rate_per_s": rate_per_s,
            "plain_rate_per_s": plain_rate_per_s,
            "max_tokens": max_tokens,
            "change_every_s": change_every_s,
        },
        "held": {
            "zero_failed": not failed,
            "rss_growth_under_5_percent_after_warmup": worst_rss < RSS_GROWTH_BOUND,
            "fds_flat": fds_last <= FD_SLACK,
            "no_hang": not any(r.outcome == "timeout" for r in records),
        },
    }
