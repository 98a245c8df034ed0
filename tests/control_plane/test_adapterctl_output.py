"""adapterctl's read commands: `-o table|wide|json|yaml`, and tables that are never cut when
stdout is not a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import RW_TOKEN
from .test_adapterctl import run, server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

LONG_REASON = "canary " + "x" * 300 + " end-of-reason"

MESH = """\
kind: Shard
metadata: {name: web, labels: {tier: gold}}
spec:
  endpoints: [{address: 10.0.5.1, port: 8000}, "10.0.5.2:8000"]
  steer: {tunnel: {remoteIpv4: 192.0.2.5, vni: 5}}
---
kind: Shard
metadata: {name: batch}
spec:
  endpoints: [{address: 10.0.6.1, port: 8000}]
  steer: {mark: 6}
---
kind: AdapterInstance
metadata: {name: credit-risk}
spec:
  modelRef: {baseModel: tiny-llama, adapterPath: /adapters/credit-risk}
  routes: [{shard: web}]
"""

RULES = """\
rules:
  - name: lab
    when: 'inCidr(request.source_ip, "10.8.0.0/16")'
    shard: web
"""


@pytest.fixture
def mesh(server: str, tmp_path: Path) -> str:  # noqa: F811
    """Two shards, an adapter instance, an override with a long reason, a rule set and a
    rollout."""
    path = tmp_path / "mesh.yaml"
    path.write_text(MESH)
    r = run(server, "apply", "-f", str(path))
    assert r.exit_code == 0, r.output
    r = run(server, "override", "set", "batch", "10%", "--ttl", "1h", "--reason", LONG_REASON)
    assert r.exit_code == 0, r.output
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    assert run(server, "rules", "apply", "-f", str(rules), "--reason", "lab").exit_code == 0
    r = run(
        server,
        "rollout",
        "start",
        "credit-risk",
        "--to",
        "2.0.0",
        "--interval",
        "90s",
        "--max-p95-ttft",
        "1.5s",
    )
    assert r.exit_code == 0, r.output
    return server


def _json(target: str, *args: str) -> Any:
    r = run(target, *args, "-o", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _yaml(target: str, *args: str) -> Any:
    r = run(target, *args, "-o", "yaml")
    assert r.exit_code == 0, r.output
    return yaml.safe_load(r.output)


def test_every_read_command_prints_json_and_yaml_with_the_same_rows(mesh: str) -> None:
    shards = _json(mesh, "shards")
    assert isinstance(shards, list)
    web = next(s for s in shards if s["shard"] == "web")
    assert set(web) == {
        "shard",
        "index",
        "state",
        "weight",
        "endpoints",
        "steer",
        "steer_target",
        "service",
        "labels",
    }
    assert web["steer"] == "tunnel"
    assert web["steer_target"] == "192.0.2.5 vni 5"
    assert web["labels"] == {"tier": "gold"}
    assert [e["address"] for e in web["endpoints"]] == ["10.0.5.1", "10.0.5.2"]
    assert sum(s["weight"] for s in shards) == 10_000
    assert _yaml(mesh, "shards") == shards

    overrides = _json(mesh, "override", "list")
    assert overrides == _yaml(mesh, "override", "list")
    assert [(o["shard"], o["weight"], o["reason"]) for o in overrides] == [
        ("batch", 1000, LONG_REASON)
    ]
    assert overrides[0]["expires"].endswith("Z")

    status = _json(mesh, "status")
    assert set(status) == {"assignment", "shards", "nodes", "rollouts"}
    assert status["assignment"]["version"] >= 1
    assert {s["shard"]: s["weight"] for s in status["shards"]}["batch"] == 1000
    assert all(s["known"] is False and s["utilization"] is None for s in status["shards"])
    assert [r["adapter"] for r in status["rollouts"]] == ["credit-risk"]
    assert _yaml(mesh, "status")["shards"] == status["shards"]

    history = _json(mesh, "history", "--limit", "50")
    assert history[0]["reason"].startswith("override batch") or any(
        LONG_REASON in h["reason"] for h in history
    ), history
    assert all(set(h) == {"version", "generated", "weights", "reason", "shards"} for h in history)
    assert [h["version"] for h in history] == sorted((h["version"] for h in history), reverse=True)

    rules = _json(mesh, "rules", "list")
    assert [(r["version"], r["rules"], r["reason"]) for r in rules] == [(1, 1, "lab")]
    got = _json(mesh, "rules", "get")
    assert got["version"] == 1
    assert got["document"]["rules"][0]["name"] == "lab"
    assert _yaml(mesh, "rules", "get") == got

    rollouts = _json(mesh, "rollout", "status")
    assert len(rollouts) == 1
    ro = rollouts[0]
    assert (ro["adapter"], ro["to"], ro["state"], ro["step"], ro["share_percent"]) == (
        "credit-risk",
        "2.0.0",
        "RUNNING",
        1,
        5,  # percent, as --steps and steps_percent (and the table's SHARE) say it
    )
    assert ro["interval_s"] == 90
    assert ro["max_p95_ttft_ms"] == 1500
    assert ro["steps_percent"] == [5, 25, 50, 100]
    assert _json(mesh, "rollout", "status", "credit-risk") == rollouts
    unknown = run(mesh, "rollout", "status", "nothing-here", "-o", "json")
    assert unknown.exit_code == 3, unknown.output
    hist = _json(mesh, "rollout", "history", "credit-risk")
    assert hist[0]["events"][0]["event"] == "start"
    assert _yaml(mesh, "rollout", "history", "credit-risk") == hist


def test_wide_adds_columns_and_the_default_table_does_not(mesh: str) -> None:
    for args, extra in (
        (["shards"], "LABELS"),
        (["status"], "FREE GPU GiB"),
        (["override", "list"], "CREATED"),
        (["history"], "SHARDS"),
        (["rollout", "status"], "MIN REQS"),
    ):
        table = run(mesh, *args)
        wide = run(mesh, *args, "-o", "wide")
        assert table.exit_code == 0, table.output
        assert wide.exit_code == 0, wide.output
        assert extra not in table.output, args
        assert extra in wide.output, args
    assert "tier=gold" in run(mesh, "shards", "-o", "wide").output


def test_an_unknown_output_format_is_one_line_and_exit_2(mesh: str) -> None:
    r = run(mesh, "status", "-o", "xml")
    assert r.exit_code == 2
    assert "--output" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_piped_tables_print_every_cell_whole(mesh: str) -> None:
    r = run(mesh, "override", "list")
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    assert any(LONG_REASON in line for line in r.output.splitlines()), r.output
    r = run(mesh, "history", "--limit", "50")
    assert "…" not in r.output
    assert any(LONG_REASON in line for line in r.output.splitlines()), r.output
    r = run(mesh, "status")
    assert "…" not in r.output
    assert "ACTIVE" in r.output


def test_a_piped_subprocess_is_not_cut_to_80_columns(mesh: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env |= {"ADAPTERMESH_SERVER": mesh, "ADAPTERMESH_TOKEN": RW_TOKEN}
    adapterctl = Path(sys.executable).parent / "adapterctl"
    proc = subprocess.run(
        [str(adapterctl), "override", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert any(LONG_REASON in line for line in proc.stdout.splitlines()), proc.stdout
    proc = subprocess.run(
        [str(adapterctl), "shards", "-o", "wide"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert "ACTIVE" in proc.stdout
    assert "…" not in proc.stdout
    assert "192.0.2.5 vni 5" in proc.stdout
