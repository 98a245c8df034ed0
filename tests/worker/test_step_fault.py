"""The fault-injection suite's engine-step error (worker/faults.py ``StepFault``): off without
its environment variable, one trigger file fails one step, and the engine fails that step's
requests with an error naming the cause and serves the next ones."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from adaptermesh.worker.faults import STEP_FAULT_ENV, InjectedStepError, StepFault
from adaptermesh.worker.types import EngineError

from .conftest import Tiny, collect, request, tokens


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STEP_FAULT_ENV, raising=False)
    assert StepFault.from_environment() is None  # an engine then checks nothing per step
    fault = StepFault()
    assert fault.armed_path is None
    fault.check()  # nothing to raise


def test_one_trigger_file_fails_one_check(tmp_path: Path) -> None:
    fault = StepFault(str(tmp_path / "trigger"))
    assert fault.armed_path == tmp_path / f"trigger.{os.getpid()}"
    fault.check()  # not armed yet
    fault.armed_path.write_text("CUDA error: an illegal memory access was encountered\n")
    with pytest.raises(InjectedStepError, match="illegal memory access"):
        fault.check()
    assert not fault.armed_path.exists()
    fault.check()  # one file, one error


async def test_engine_fails_the_step_naming_the_cause_and_serves_on(
    make_engine: Any, tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STEP_FAULT_ENV, str(tmp_path / "trigger"))
    engine = make_engine()
    assert engine.step_fault is not None  # armed from the environment
    prompt = tiny.encode("The quick brown fox")
    before = tokens(await collect(engine.submit(request("a", prompt, "alpha"))))
    assert engine.step_fault.armed_path is not None
    engine.step_fault.armed_path.write_text("CUDA error: device-side assert triggered")
    with pytest.raises(EngineError, match="step failed: CUDA error: device-side assert"):
        await collect(engine.submit(request("b", prompt, "alpha")))
    after = tokens(await collect(engine.submit(request("c", prompt, "alpha"))))
    assert after == before
