"""Injected faults, to rehearse a rollback: a share of one adapter's requests answered 500.

An operator (or a game-day script) sets ``POST /v1/admin/faults {"adapter": "credit-risk@2.0.0",
"error_rate": 0.3}`` on a worker (admin token), and that adapter's requests fail at that rate
with ``code: injected_fault`` and count as errors in the per-adapter series the rollout
controller reads (``docs/rollout.md``). Rate 0 clears it. The pattern is deterministic: the
n-th request fails when floor(n * rate) moves, so any window of requests holds the rate to
within one request.

:class:`StepFault` is the fault-injection suite's engine-step error (``docs/faults.md``): off
unless the worker's environment names a trigger file.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_FAULTS", "STEP_FAULT_ENV", "FaultTable", "InjectedStepError", "StepFault"]

MAX_FAULTS = 1024


@dataclass(slots=True)
class _Fault:
    rate: float
    seen: int = 0


class FaultTable:
    def __init__(self) -> None:
        self._faults: dict[str, _Fault] = {}

    def set(self, adapter: str, rate: float) -> None:
        """Fail ``rate`` of ``adapter``'s requests from now on; 0 clears. ValueError names
        the field for a rate outside 0-1 or too many adapters."""
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ValueError(f"error_rate: {rate} is not a fraction in 0-1")
        if rate == 0.0:
            self._faults.pop(adapter, None)
            return
        if adapter not in self._faults and len(self._faults) >= MAX_FAULTS:
            raise ValueError(f"adapter: at most {MAX_FAULTS} adapters may have faults")
        self._faults[adapter] = _Fault(rate)

    def rates(self) -> dict[str, float]:
        return {name: f.rate for name, f in sorted(self._faults.items())}

    def should_fail(self, adapter: str | None) -> bool:
        if not self._faults or adapter is None:
            return False
        fault = self._faults.get(adapter)
        if fault is None:
            return False
        before = math.floor(fault.seen * fault.rate)
        fault.seen += 1
        return math.floor(fault.seen * fault.rate) > before


# ---- an injected engine-step error, for the fault-injection suite ----------------------------

STEP_FAULT_ENV = "ADAPTERMESH_FAULT_STEP_ERROR"


class InjectedStepError(RuntimeError):
    """The error an engine step raises when a test asked for one (see :class:`StepFault`)."""


class StepFault:
    """A one-shot error inside an engine step, armed from outside the process.

    Off unless the worker was started with ``ADAPTERMESH_FAULT_STEP_ERROR=<path>`` in its
    environment (only the fault-injection suite sets it). Then, before each step, the engine
    looks for the file ``<path>.<pid>``: when it exists, the step raises
    :class:`InjectedStepError` with the file's text as its message (a CUDA-style message, say)
    and the file is removed, so one file fails one step. Without the variable the check is a
    single attribute test.
    """

    def __init__(self, base: str | None = None) -> None:
        base = os.environ.get(STEP_FAULT_ENV) if base is None else base
        self._trigger = Path(f"{base}.{os.getpid()}") if base else None

    @classmethod
    def from_environment(cls) -> StepFault | None:
        """The fault the worker's environment arms, or None (the engine then checks nothing)."""
        return cls() if os.environ.get(STEP_FAULT_ENV) else None

    @property
    def armed_path(self) -> Path | None:
        return self._trigger

    def check(self) -> None:
        """Raise :class:`InjectedStepError` once per trigger file; else nothing."""
        if self._trigger is None:
            return
        try:
            message = self._trigger.read_text().strip()
        except FileNotFoundError:
            return
        with contextlib.suppress(FileNotFoundError):
            self._trigger.unlink()
        raise InjectedStepError(message or "injected engine step error")
