"""Faults of the node's own processes on the local mesh (docs/faults.md), under steady open-loop
streaming load: the control plane killed and started again (traffic flows while it is down,
the agent keeps the last Assignment, a change made after the restart reaches the agent), and
the agent restarted (SIGTERM, then SIGKILL) while UDP probes from two more sources, one pinned
to each of the two shards, are counted at every shard: none may reach another shard or none
at all, and no request may fail.

Full forms with longer outages and more restarts: ``bench/bench_faults.py``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest

from adaptermesh_testkit.faultload import run_scenario, warm_workers
from adaptermesh_testkit.localmesh import LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

LOAD = {"rate_per_s": 1.0, "max_tokens": 16, "warmup_s": 4.0, "cooldown_s": 4.0}


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    m = LocalMesh(
        MeshConfig(
            prefix=f"amn{secrets.token_hex(2)}",
            shards=2,
            workers_per_shard=1,
            tenants=2,
            probe_sources=2,
            adapters=("support", "sql"),
            interval_s=2.0,
            report_interval_s=0.5,
        ),
        progress=lambda msg: print(f"[node-faults] {msg}", flush=True),
    )
    try:
        m.start()
        warm_workers(m)
        yield m
    finally:
        m.stop()


def test_control_plane_down_traffic_flows_and_a_later_change_reaches_the_agent(
    mesh: LocalMesh,
) -> None:
    summary = run_scenario(mesh, "control_plane", down_s=8.0, **LOAD)
    print(f"\n[node-faults] control_plane: {json.dumps(summary['faults'])}", flush=True)
    held = summary["held"]
    fault = summary["faults"][0]
    assert held["zero_failed"], summary["failures_sample"]
    assert held["no_hang"]
    assert fault["agent_connected_while_down"] is False
    assert held["agent_kept_the_last_assignment"], fault
    assert held["change_after_restart_reached_the_agent"], fault
    assert summary["latency"]["during"]["n"] > 0  # traffic flowed while it was down


def test_agent_restart_misclassifies_no_packet(mesh: LocalMesh) -> None:
    # One probe source pinned to each shard: a packet the classifier steered anywhere else
    # during a restart would show as misclassified.
    expected = dict(zip(mesh.probe_sources, mesh.shard_ids, strict=True))
    for source, shard_id in expected.items():
        version = mesh.pin(f"{source}/32", shard_id)
    mesh.wait_agent_applied(version, timeout=60)
    summary = run_scenario(
        mesh, "agent_restart", restarts=2, probe_pps=50.0, probe_expected=expected, **LOAD
    )
    packets = summary["packets"]
    print(f"\n[node-faults] agent_restart: {json.dumps(packets)}", flush=True)
    held = summary["held"]
    assert set(packets["expected_shard"].values()) == {"s0", "s1"}
    assert packets["whole_run"]["arrived_at_expected_shard"] > 0
    assert packets["during_restarts"]["packets_sent"] >= 100
    assert held["no_packet_misclassified"], packets
    assert held["classifier_passed_nothing_unsteered"], packets["classifier_counters_delta"]
    assert held["zero_failed"], summary["failures_sample"]
    assert held["no_hang"]
    assert [f["signal"] for f in summary["faults"]] == ["SIGTERM", "SIGKILL"]
