"""Fault injection on the whole local mesh, short form (docs/faults.md): one worker kill -9
(started again at once), one drain (SIGTERM), one stalled adapter store and one injected
engine-step error, each under steady open-loop streaming load from the tenants (classifier ->
Envoy -> CPU workers).

The assertions are the issue's bounds: never a hang (no request waits ``read_timeout_s``
without a byte), streams in flight at a kill end within 1 s, no request that started later
than 2 s after a kill fails, 0 failed requests in a drain, a stalled store answers requests
for its adapter with 503 and Retry-After after a bounded wait while the other adapters fail
nothing, and a step error fails only the requests of that step, with a 5xx naming the cause,
while the engine serves on. The long form (a kill every 20 s for 3 minutes, and the
control-plane and agent faults) is ``bench/bench_faults.py``. The figures are printed (``-s``)
and written to ``$AME_FAULTS_REPORT`` when that is set.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptermesh.worker.faults import STEP_FAULT_ENV
from adaptermesh_testkit.faultload import run_scenario, warm_workers
from adaptermesh_testkit.localmesh import LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

REPORT: dict[str, Any] = {}
# Light enough that two CPU workers on a shared 2-core machine keep up when one is away.
LOAD = {"rate_per_s": 1.0, "max_tokens": 16, "warmup_s": 5.0, "cooldown_s": 5.0}
# The stall: an adapter only the (stalled) S3 store holds; the workers answer a request that
# waited LOAD_WAIT_S on its load with 503, and each S3 attempt times out after STORE_TIMEOUT_S.
STORE_ADAPTER = "remote"
LOAD_WAIT_S = 4.0
STORE_TIMEOUT_S = 3.0


def _report(name: str, summary: dict[str, Any]) -> None:
    REPORT[name] = summary
    brief = {k: summary[k] for k in ("requests_sent", "failed", "held")}
    print(f"\n[faults] {name}: {json.dumps(brief)}", flush=True)
    path = os.environ.get("AME_FAULTS_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=2))


@pytest.fixture(scope="module")
def trigger_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = str(tmp_path_factory.mktemp("faults") / "step-fault")
    before = os.environ.get(STEP_FAULT_ENV)
    os.environ[STEP_FAULT_ENV] = base  # the workers inherit it
    yield base
    if before is None:
        os.environ.pop(STEP_FAULT_ENV, None)
    else:
        os.environ[STEP_FAULT_ENV] = before


@pytest.fixture(scope="module")
def mesh(trigger_base: str) -> Iterator[LocalMesh]:
    m = LocalMesh(
        MeshConfig(
            prefix=f"amt{secrets.token_hex(2)}",
            shards=1,
            workers_per_shard=2,
            tenants=4,
            interval_s=2.0,
            report_interval_s=0.5,
            store_adapters=(STORE_ADAPTER,),
            worker_args=(
                "--adapter-load-wait",
                str(LOAD_WAIT_S),
                "--adapter-store-timeout",
                str(STORE_TIMEOUT_S),
            ),
        ),
        progress=lambda msg: print(f"[faults] {msg}", flush=True),
    )
    try:
        m.start()
        warm_workers(m)
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def kill(mesh: LocalMesh) -> dict[str, Any]:
    summary = run_scenario(mesh, "kill", kills=1, **LOAD)
    _report("kill", summary)
    return summary


def test_worker_kill_mid_stream_fails_nothing_after_2s_and_never_hangs(
    kill: dict[str, Any],
) -> None:
    assert kill["faults"][0]["victim_running_at_kill"] > 0, "no stream on the victim at the kill"
    held = kill["held"]
    assert held["no_hang"], kill["failures_sample"]
    assert held["no_failure_later_than_2s_after_a_kill"], kill["failures_outside_sample"]


def test_worker_kill_in_flight_streams_end_within_1s(kill: dict[str, Any]) -> None:
    assert kill["held"]["in_flight_end_within_1s"], kill["in_flight_failed_fault_to_end_max_s"]


@pytest.fixture(scope="module")
def drain(mesh: LocalMesh) -> dict[str, Any]:
    # Streams long enough that the drain waits for some and new requests arrive meanwhile.
    summary = run_scenario(mesh, "drain", **{**LOAD, "max_tokens": 64})
    _report("drain", summary)
    return summary


def test_worker_drain_finishes_in_flight_requests_and_never_hangs(drain: dict[str, Any]) -> None:
    held = drain["held"]
    assert held["no_hang"], drain["failures_sample"]
    assert held["exited_within_drain_timeout"], drain["faults"]


def test_worker_drain_fails_nothing(drain: dict[str, Any]) -> None:
    assert drain["held"]["zero_failed"], drain["failures_sample"]


def test_adapter_store_stall_gives_503_with_retry_after_and_spares_the_others(
    mesh: LocalMesh,
) -> None:
    # More requests for the others than the default, so that their p99 is not one sample.
    summary = run_scenario(
        mesh,
        "stall",
        **{**LOAD, "rate_per_s": 2.0, "warmup_s": 10.0},
        stall_s=10.0,
        stalled_rate_per_s=1.0,
        load_wait_s=LOAD_WAIT_S,
    )
    _report("stall", summary)
    held = summary["held"]
    stalled = summary["stalled_adapter"]
    others = summary["other_adapters"]
    assert held["no_hang"], summary["failures_sample"]
    assert held["stalled_requests_get_503_with_retry_after"], summary["failures_sample"]
    assert held["stalled_wait_bounded"], stalled
    assert set(stalled["error_codes"]) <= {"adapter_load_timeout", "adapter_store_unavailable"}
    assert held["others_zero_failed"], others
    assert held["recovers_and_loads"], (summary["faults"], stalled)
    # Back within the store's three timed-out attempts, the 5 s memory of its failure and one
    # load wait (and as much again for a loaded machine) after it answers again.
    recovered = summary["faults"][0]["recovered_after_release_s"]
    assert recovered <= 2 * (3 * STORE_TIMEOUT_S + 5.0 + LOAD_WAIT_S), summary["faults"]
    # The others' median, not their p99: with ~20 requests a phase, a p99 is the slowest one,
    # which on a shared 2-core machine moves with whatever else runs. The bench records the
    # issue's p99 ratio in its ``held``; tests/worker/test_adapter_store_stall.py checks
    # without that noise that a stalled load holds nothing the other adapters need.
    before = others["latency"]["before"]["p50_s"]
    during = others["latency"]["during"]["p50_s"]
    assert during <= 1.5 * before + 0.1, others["latency"]


def test_engine_step_error_fails_only_its_step(mesh: LocalMesh, trigger_base: str) -> None:
    started = time.monotonic()
    summary = run_scenario(mesh, "step_error", trigger_base=trigger_base, **LOAD)
    _report("step_error", summary)
    held = summary["held"]
    assert summary["faults"][0]["consumed_after_s"] is not None, "no step ran after arming"
    assert held["no_hang"], summary["failures_sample"]
    assert held["failures_are_5xx_naming_the_cause"], summary["failures_sample"]
    assert held["failures_only_in_the_failed_step"], summary["failures_outside_sample"]
    assert held["engine_keeps_serving"], summary["faults"]
    assert time.monotonic() - started < 60
