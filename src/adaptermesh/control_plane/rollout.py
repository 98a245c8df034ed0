"""The rollout controller: starts, steps, pauses and ends gray releases of adapter versions.

Every change of a rollout (start, a step, completion, rollback, pause, resume, promote,
abort) is one ``Rebalancer.mutate``: the rollout row, its event and the Assignment carrying
the new split are written in one transaction and published at once, like an override. ``step()`` is one
read -> decide -> write: it scrapes the new versions' per-adapter series from every worker
(``adaptermesh_adapter_requests``, ``adaptermesh_adapter_time_to_first_token_seconds``),
sums them over the workers since the current step began, and asks ``rollout_state.decide``.
``run()`` repeats ``step()`` every ``tick_s``; a failed step is logged and retried.

The window of a step starts at the first scrape after the step began (a control plane that
restarts starts the window afresh: the step is judged on what it sees, never on nothing).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from adaptermesh import assignment_rules as rules
from adaptermesh.backoff import Backoff
from adaptermesh.clock import Clock, sleep_or_stop
from adaptermesh.control_plane.http_client import KeptClient, plain_http_client_options
from adaptermesh.control_plane.metrics_source import Target
from adaptermesh.control_plane.rebalancer import Rebalancer
from adaptermesh.control_plane.rollout_state import (
    ACTIVE_STATES,
    ERROR_FREE_OUTCOMES,
    Step,
    Window,
    check_spec,
    decide,
    p95,
    share_of,
    stable_version,
)
from adaptermesh.control_plane.tables import keep_only
from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2

__all__ = [
    "AdapterCounters",
    "AdapterSource",
    "RolloutController",
    "RolloutError",
    "ScrapeAdapterSource",
    "parse_adapter_series",
]

S = control_plane_pb2
_REQUESTS = "adaptermesh_adapter_requests"
_TTFT = "adaptermesh_adapter_time_to_first_token_seconds"
ACTIONS = ("pause", "resume", "promote", "abort")


class RolloutError(Exception):
    """A rollout request the current state refuses; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.code = code
        self.field = field
        self.message = message


@dataclass(slots=True)
class AdapterCounters:
    """One worker's cumulative per-adapter series."""

    requests: int = 0
    errors: int = 0
    ttft: dict[float, int] = field(default_factory=dict)  # le -> cumulative count
    ttft_count: int = 0


def parse_adapter_series(text: str, adapters: Iterable[str]) -> dict[str, AdapterCounters]:
    """The per-adapter series of one worker's /metrics for ``adapters`` (served names)."""
    wanted = set(adapters)
    out: dict[str, AdapterCounters] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (_REQUESTS, _TTFT):
            continue
        for sample in family.samples:
            adapter = sample.labels.get("adapter")
            if adapter not in wanted:
                continue
            c = out.setdefault(adapter, AdapterCounters())
            if sample.name == _REQUESTS + "_total":
                n = int(sample.value)
                c.requests += n
                if sample.labels.get("outcome") not in ERROR_FREE_OUTCOMES:
                    c.errors += n
            elif sample.name == _TTFT + "_bucket":
                le = float(sample.labels["le"])
                if math.isinf(le):
                    c.ttft_count = int(sample.value)
                else:
                    c.ttft[le] = int(sample.value)
    return out


class AdapterSource(Protocol):
    async def collect(
        self, targets: list[Target], adapters: Iterable[str]
    ) -> dict[str, dict[str, AdapterCounters]]:
        """worker key -> served adapter name -> counters; a worker that fails is absent."""
        ...


class ScrapeAdapterSource:
    """Reads each worker's ``GET /metrics`` directly."""

    def __init__(self, timeout_s: float = 2.0, concurrency: int = 64) -> None:
        self.timeout_s = timeout_s
        self.errors: dict[str, str] = {}
        self._kept = KeptClient(**plain_http_client_options(concurrency))

    async def aclose(self) -> None:
        await self._kept.aclose()

    async def collect(
        self, targets: list[Target], adapters: Iterable[str]
    ) -> dict[str, dict[str, AdapterCounters]]:
        names = list(adapters)
        out: dict[str, dict[str, AdapterCounters]] = {}
        client = self._kept.get()

        async def one(t: Target) -> None:
            host = f"[{t.address}]" if ":" in t.address else t.address
            try:
                resp = await client.get(f"http://{host}:{t.port}/metrics", timeout=self.timeout_s)
                resp.raise_for_status()
                out[t.key] = parse_adapter_series(resp.text, names)
                self.errors.pop(t.key, None)
            except (httpx.HTTPError, ValueError) as exc:
                self.errors[t.key] = str(exc) or type(exc).__name__

        await asyncio.gather(*(one(t) for t in targets))
        keep_only(self.errors, {t.key for t in targets})  # a worker no longer listed goes
        return out


def _window(now: Mapping[str, AdapterCounters], base: Mapping[str, AdapterCounters]) -> Window:
    """The counts since ``base``, summed over workers; a worker whose counters went down
    restarted, and counts from zero."""
    requests = errors = count = 0
    buckets: dict[float, int] = {}
    for key, c in now.items():
        b = base.get(key)
        if b is None or c.requests < b.requests or c.ttft_count < b.ttft_count:
            b = AdapterCounters()
        requests += c.requests - b.requests
        errors += max(c.errors - b.errors, 0)
        count += c.ttft_count - b.ttft_count
        for le, n in c.ttft.items():
            buckets[le] = buckets.get(le, 0) + max(n - b.ttft.get(le, 0), 0)
    return Window(requests, min(errors, requests), tuple(sorted(buckets.items())), count)


class RolloutController:
    def __init__(
        self,
        rebalancer: Rebalancer,
        source: AdapterSource | None = None,
        *,
        tick_s: float = 1.0,
        logger: logging.Logger | None = None,
    ) -> None:
        self.rb = rebalancer
        self.store = rebalancer.store
        self.source: AdapterSource = source or ScrapeAdapterSource()
        self.tick_s = tick_s
        self.log = logger or logging.getLogger("adaptermesh.control_plane.rollout")
        # rollout id -> worker key -> counters at the window's start (None: the next scrape).
        self._base: dict[str, dict[str, AdapterCounters] | None] = {}
        self._windows: dict[str, Window] = {}
        self.steps = 0
        self.failures = 0

    @property
    def clock(self) -> Clock:
        return self.rb.clock

    # -- operator actions --------------------------------------------------------------------

    def start(self, spec: control_plane_pb2.RolloutSpec, reason: str) -> control_plane_pb2.Rollout:
        rules.check_reason(reason)
        check_spec(spec)
        current = self.store.rollouts(spec.adapter)
        if current and current[-1].state in ACTIVE_STATES:
            raise RolloutError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "spec.adapter",
                f"{spec.adapter!r} already has a rollout in progress "
                f"(to {current[-1].spec.to_version}); abort it first",
            )
        spec_ = control_plane_pb2.RolloutSpec()
        spec_.CopyFrom(spec)
        if not spec_.from_version and current:
            spec_.from_version = stable_version(current[-1])
        if spec_.from_version == spec_.to_version:
            raise RolloutError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "spec.to_version",
                f"{spec.adapter!r} already serves {spec_.to_version}",
            )
        now = self.clock.time()
        rollout = control_plane_pb2.Rollout(
            id=secrets.token_hex(8),
            spec=spec_,
            state=S.ROLLOUT_STATE_RUNNING,
            step=0,
            share=share_of(spec_.steps_percent, 0),
            reason=reason or "started",
        )
        rollout.created_at.FromNanoseconds(int(now * 1e9))
        rollout.step_started_at.FromNanoseconds(int(now * 1e9))
        what = (
            f"rollout {spec_.adapter} {spec_.from_version or '(unversioned)'} -> "
            f"{spec_.to_version}: {rollout.share / 100:g}%"
        )
        self._write(rollout, "start", f"{what}{': ' + reason if reason else ''}", now)
        return rollout

    def control(self, adapter: str, action: str, reason: str) -> control_plane_pb2.Rollout:
        rules.check_reason(reason)
        if action not in ACTIONS:
            raise RolloutError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "action",
                f"{action!r} is not one of {', '.join(ACTIONS)}",
            )
        current = self.store.rollouts(adapter) if adapter else []
        if not current or current[-1].state not in ACTIVE_STATES:
            raise RolloutError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "adapter",
                f"{adapter!r} has no rollout in progress",
            )
        rollout = current[-1]
        now = self.clock.time()
        why = reason or f"operator {action}"
        if action == "pause":
            if rollout.state == S.ROLLOUT_STATE_PAUSED:
                return rollout
            rollout.state = S.ROLLOUT_STATE_PAUSED
        elif action == "resume":
            if rollout.state == S.ROLLOUT_STATE_RUNNING:
                return rollout
            # The step starts again: what it saw before the pause is not evidence for now.
            rollout.state = S.ROLLOUT_STATE_RUNNING
            rollout.step_started_at.FromNanoseconds(int(now * 1e9))
            self._base[rollout.id] = None
        elif action == "promote":
            # What completing the last step does, now: the new version is the stable one.
            rollout.state = S.ROLLOUT_STATE_COMPLETED
            rollout.share = 0
        else:
            rollout.state = S.ROLLOUT_STATE_ABORTED
            rollout.share = 0
        rollout.reason = why
        self._write(rollout, action, f"rollout {adapter} {action}: {why}", now)
        return rollout

    def listing(self, adapter: str = "", history: bool = False) -> list[control_plane_pb2.Rollout]:
        out = self.store.rollouts(adapter or None, latest_only=not history, events=True)
        for r in out:
            w = self._windows.get(r.id)
            if w is not None and r.state in ACTIVE_STATES:
                r.window_requests, r.window_errors = w.requests, w.errors
                r.window_p95_ttft_ms = p95(w) or 0.0
        return out

    def _write(
        self, rollout: control_plane_pb2.Rollout, kind: str, publish_reason: str, now: float
    ) -> None:
        event = control_plane_pb2.RolloutEvent(
            kind=kind, share=rollout.share, reason=rollout.reason
        )
        event.at.FromNanoseconds(int(now * 1e9))
        self.rb.mutate(lambda: self.store.put_rollout(rollout, event), publish_reason)
        if rollout.state not in ACTIVE_STATES:
            self._base.pop(rollout.id, None)
            self._windows.pop(rollout.id, None)
        self.log.info("%s", publish_reason)

    # -- the loop --------------------------------------------------------------------------------

    async def step(self) -> list[tuple[str, Step]]:
        """One read -> decide -> write over the running rollouts; returns what each did.

        The scrape is awaited, so an operator's pause, abort or promote may land while it
        runs: only the rollouts still stored exactly as read before it are decided (the
        operator's change wins, and nothing is written over it). Afterwards the per-rollout
        window state is kept for the rollouts in progress only."""
        self.steps += 1
        running = [r for r in self.store.rollouts() if r.state == S.ROLLOUT_STATE_RUNNING]
        if not running:
            self._keep_windows_of_active()
            return []
        names = {rules.served_name(r.spec.adapter, r.spec.to_version): r for r in running}
        seen = await self.source.collect(self.rb.targets(), names)
        out = self._decide_all(names, seen)
        self._keep_windows_of_active()
        return out

    def _keep_windows_of_active(self) -> None:
        """Forget the window state of every rollout no longer in progress: one entry per
        rollout in progress (at most one per adapter), whatever ended the others."""
        if not (self._base or self._windows):
            return
        active = {r.id for r in self.store.rollouts() if r.state in ACTIVE_STATES}
        keep_only(self._base, active)
        keep_only(self._windows, active)

    def _decide_all(
        self,
        names: Mapping[str, control_plane_pb2.Rollout],
        seen: Mapping[str, Mapping[str, AdapterCounters]],
    ) -> list[tuple[str, Step]]:
        current = {r.id: r for r in self.store.rollouts()}
        now = self.clock.time()
        out = []
        for name, rollout in names.items():
            if current.get(rollout.id) != rollout:
                continue  # changed while the scrape ran (paused, aborted, promoted)
            counters = {key: per[name] for key, per in seen.items() if name in per}
            base = self._base.get(rollout.id)
            if base is None:
                self._base[rollout.id] = base = counters
            window = _window(counters, base)
            self._windows[rollout.id] = window
            step = decide(rollout, window, now)
            out.append((rollout.spec.adapter, step))
            if step.kind == "hold":
                continue
            if step.kind == "advance":
                rollout.step += 1
                rollout.share = share_of(rollout.spec.steps_percent, rollout.step)
                rollout.step_started_at.FromNanoseconds(int(now * 1e9))
                self._base[rollout.id] = counters
            elif step.kind == "complete":
                rollout.state = S.ROLLOUT_STATE_COMPLETED
                rollout.share = 0
            else:
                rollout.state = S.ROLLOUT_STATE_ROLLED_BACK
                rollout.share = 0
            rollout.reason = step.reason
            self._write(
                rollout,
                step.kind,
                f"rollout {rollout.spec.adapter} {step.kind}: {step.reason}",
                now,
            )
        return out

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Repeat ``step()`` every ``tick_s`` until ``stop`` is set; back off after failures."""
        stop = stop or asyncio.Event()
        backoff = Backoff(2 * self.tick_s, max(30 * self.tick_s, 30.0), jitter=0.0)
        while not stop.is_set():
            delay = self.tick_s
            try:
                await self.step()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.failures += 1
                delay = backoff.next()
                self.log.exception("rollout step failed; retry in %.1fs", delay)
            await sleep_or_stop(self.clock, delay, stop)
