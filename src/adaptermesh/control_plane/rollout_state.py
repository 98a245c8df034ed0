"""Gray release per adapter version: the rollout's rules, its pure decision, and the splits it
puts in the Assignment.

A rollout moves an adapter's traffic from one version to another by share, step by step
(``RolloutSpec.steps_percent``). ``decide`` is the whole policy, with no I/O and no clock:
given the rollout, the new version's figures over the current step and the time, it holds,
advances a step, completes (the new version becomes the stable one) or rolls back (share 0,
the broken bound named in the reason). ``control_plane/rollout.py`` runs it in a loop;
``splits`` turns the stored rollouts into the ``Assignment.adapter_splits`` that agents apply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from adaptermesh import assignment_rules as rules
from adaptermesh.assignment_rules import RuleError
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_MIN_REQUESTS",
    "ERROR_FREE_OUTCOMES",
    "MAX_INTERVAL_S",
    "MAX_STEPS",
    "Step",
    "Window",
    "check_spec",
    "decide",
    "p95",
    "splits",
    "stable_version",
]

S = control_plane_pb2
RUNNING = S.ROLLOUT_STATE_RUNNING
PAUSED = S.ROLLOUT_STATE_PAUSED
ACTIVE_STATES = frozenset({RUNNING, PAUSED})
MAX_STEPS = 20
MAX_INTERVAL_S = 7 * 24 * 3600
DEFAULT_MIN_REQUESTS = 20
# Worker request outcomes that are not the version's fault: finished, or the client left.
ERROR_FREE_OUTCOMES = frozenset({"stop", "length", "disconnected", "cancelled"})


def check_spec(spec: control_plane_pb2.RolloutSpec, field: str = "spec") -> None:
    """Everything a rollout's spec must satisfy; RuleError names the field."""
    rules.check_adapter_name(spec.adapter, f"{field}.adapter")
    rules.check_version(spec.from_version, f"{field}.from_version")
    rules.check_version(spec.to_version, f"{field}.to_version", allow_empty=False)
    steps = list(spec.steps_percent)
    if not 1 <= len(steps) <= MAX_STEPS:
        raise RuleError(f"{field}.steps_percent", f"1-{MAX_STEPS} steps, got {len(steps)}")
    for i, step in enumerate(steps):
        if not 1 <= step <= 100:
            raise RuleError(f"{field}.steps_percent[{i}]", f"{step} is outside 1-100")
        if i and step <= steps[i - 1]:
            raise RuleError(
                f"{field}.steps_percent[{i}]",
                f"{step} is not above the step before ({steps[i - 1]})",
            )
    if steps[-1] != 100:
        raise RuleError(f"{field}.steps_percent", f"the last step is 100, not {steps[-1]}")
    if not 1 <= spec.interval_seconds <= MAX_INTERVAL_S:
        raise RuleError(
            f"{field}.interval_seconds", f"{spec.interval_seconds} is outside 1-{MAX_INTERVAL_S}"
        )
    if not (math.isfinite(spec.max_error_rate) and 0 <= spec.max_error_rate <= 1):
        raise RuleError(
            f"{field}.max_error_rate",
            f"{spec.max_error_rate} is not a fraction in 0-1 (0: no bound)",
        )
    if not (math.isfinite(spec.max_p95_ttft_ms) and 0 <= spec.max_p95_ttft_ms <= 3_600_000):
        raise RuleError(
            f"{field}.max_p95_ttft_ms",
            f"{spec.max_p95_ttft_ms} is outside 0-3600000 ms (0: no bound)",
        )
    if spec.min_requests > 1_000_000:
        raise RuleError(f"{field}.min_requests", f"{spec.min_requests} exceeds 1000000")


def stable_version(rollout: control_plane_pb2.Rollout) -> str:
    """The version that serves what the rollout's share does not."""
    if rollout.state == S.ROLLOUT_STATE_COMPLETED:
        return rollout.spec.to_version
    return rollout.spec.from_version


def splits(latest: Iterable[control_plane_pb2.Rollout]) -> list[assignment_pb2.AdapterSplit]:
    """The Assignment's splits from each adapter's newest rollout, sorted by adapter.

    A rollout in progress splits between its two versions; a finished one leaves its stable
    version serving everything (no split at all when that is the adapter's own name)."""
    out = []
    for r in sorted(latest, key=lambda r: r.spec.adapter):
        active = r.state in ACTIVE_STATES
        stable = stable_version(r)
        if not active and not stable:
            continue
        out.append(
            assignment_pb2.AdapterSplit(
                adapter=r.spec.adapter,
                stable_version=stable,
                canary_version=r.spec.to_version if active else "",
                canary_share=r.share if active else 0,
                rollout_id=r.id,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Window:
    """The new version's requests over the current step, summed over every worker.

    ``ttft_buckets`` holds (edge in seconds, first tokens within it), edges ascending and
    counts cumulative as Prometheus buckets are; ``ttft_count`` counts all of them (+Inf)."""

    requests: int = 0
    errors: int = 0
    ttft_buckets: tuple[tuple[float, int], ...] = ()
    ttft_count: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def p95(window: Window) -> float | None:
    """The 95th percentile TTFT in ms, interpolated inside its bucket (as Prometheus'
    histogram_quantile); None without observations, inf past the last edge."""
    total = window.ttft_count
    if total <= 0:
        return None
    rank = 0.95 * total
    lower_edge, lower_count = 0.0, 0
    for edge, count in window.ttft_buckets:
        if count >= rank:
            span = count - lower_count
            frac = (rank - lower_count) / span if span > 0 else 1.0
            return (lower_edge + (edge - lower_edge) * frac) * 1000.0
        lower_edge, lower_count = edge, count
    return math.inf


Kind = Literal["hold", "advance", "complete", "rollback"]


@dataclass(frozen=True, slots=True)
class Step:
    kind: Kind
    reason: str


def _pct(share: int) -> str:
    return f"{share / 100:g}%"


def decide(rollout: control_plane_pb2.Rollout, window: Window, now: float) -> Step:
    """What a RUNNING rollout does now. Bounds are judged once the step has min_requests of
    the new version; the step advances when its interval passed and the bounds hold."""
    spec = rollout.spec
    need = spec.min_requests or DEFAULT_MIN_REQUESTS
    if window.requests >= need:
        if spec.max_error_rate > 0 and window.error_rate > spec.max_error_rate:
            return Step(
                "rollback",
                (
                    f"error rate {window.error_rate:.1%} > {spec.max_error_rate:.1%} over "
                    f"{window.requests} requests of {spec.to_version} at {_pct(rollout.share)}"
                ),
            )
        latency = p95(window)
        if spec.max_p95_ttft_ms > 0 and latency is not None and latency > spec.max_p95_ttft_ms:
            return Step(
                "rollback",
                (
                    f"p95 TTFT {latency:.0f} ms > {spec.max_p95_ttft_ms:g} ms over "
                    f"{window.ttft_count} requests of {spec.to_version} at {_pct(rollout.share)}"
                ),
            )
    elapsed = now - rollout.step_started_at.ToNanoseconds() / 1e9
    if elapsed < spec.interval_seconds:
        return Step(
            "hold", f"step {rollout.step + 1} for {spec.interval_seconds - elapsed:.0f}s more"
        )
    if window.requests < need:
        return Step(
            "hold", f"waiting for {need} requests of {spec.to_version} (have {window.requests})"
        )
    health = f"error rate {window.error_rate:.1%}"
    latency = p95(window)
    if latency is not None:
        health += f", p95 TTFT {latency:.0f} ms"
    health += f" over {window.requests} requests"
    if rollout.step + 1 >= len(spec.steps_percent):
        return Step("complete", f"{spec.to_version} promoted ({health})")
    nxt = spec.steps_percent[rollout.step + 1] * 100
    return Step("advance", f"{_pct(rollout.share)} -> {_pct(nxt)} ({health})")


def share_of(steps: Sequence[int], step: int) -> int:
    return int(steps[step]) * 100
