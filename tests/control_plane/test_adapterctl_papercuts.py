"""What a new operator met on the first day: errors that name what the user set (a variable,
not a flag never given), "no shard" for a typo, a rollout share in one unit everywhere, the
rollout history newest first, and an unknown adapter's rollout listing a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app

from .conftest import RW_TOKEN
from .test_adapterctl import run, server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

MESH = """\
kind: Shard
metadata: {name: s0}
spec:
  endpoints: ["127.0.0.1:9"]
  steer: {mark: 7}
---
kind: AdapterInstance
metadata: {name: support}
spec:
  modelRef: {baseModel: tiny}
"""


def _cli(env: dict[str, str], *args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **env})


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        (
            {"ADAPTERMESH_TOKEN": "t", "ADAPTERMESH_TOKEN_FILE": "/etc/hostname"},
            [],
            "ADAPTERMESH_TOKEN and ADAPTERMESH_TOKEN_FILE are exclusive",
        ),
        (
            {"ADAPTERMESH_TOKEN": "t"},
            ["--token-file", "/etc/hostname"],
            "ADAPTERMESH_TOKEN and --token-file are exclusive",
        ),
        ({}, ["--token", "t", "--token-file", "/x"], "--token and --token-file are exclusive"),
        (
            {"ADAPTERMESH_TOKEN_FILE": "/nonexistent/am-token"},
            [],
            "ADAPTERMESH_TOKEN_FILE: [Errno 2]",
        ),
        ({}, ["--token-file", "/nonexistent/am-token"], "--token-file: [Errno 2]"),
    ],
)
def test_connection_errors_name_what_the_user_set(env, flags, message) -> None:
    r = _cli({"ADAPTERMESH_SERVER": "127.0.0.1:9", **env}, *flags, "status")
    assert r.exit_code == 2, r.output
    assert message in r.output
    if not flags:
        assert "--token" not in r.output


@pytest.fixture
def mesh(server: str, tmp_path: Path) -> str:  # noqa: F811
    path = tmp_path / "mesh.yaml"
    path.write_text(MESH)
    r = run(server, "apply", "-f", str(path))
    assert r.exit_code == 0, r.output
    return server


def test_clearing_an_override_of_a_shard_that_does_not_exist_says_no_shard(mesh: str) -> None:
    r = run(mesh, "override", "clear", "s9")
    assert r.exit_code == 3, r.output
    assert "no shard 's9'" in r.output
    r = run(mesh, "override", "clear", "s0")
    assert r.exit_code == 3, r.output
    assert "no override on shard 's0'" in r.output


@pytest.mark.parametrize("command", ["status", "history"])
def test_rollouts_of_an_unknown_adapter_are_not_found(mesh: str, command: str) -> None:
    r = run(mesh, "rollout", command, "nosuch")
    assert r.exit_code == 3, r.output
    assert "'nosuch': no rollout of it" in r.output
    known = run(mesh, "rollout", command, "support", "-o", "json")
    assert known.exit_code == 0, known.output
    assert json.loads(known.output) == []


def test_shares_in_percent_everywhere_and_history_newest_first(mesh: str) -> None:
    r = run(mesh, "rollout", "start", "support", "--to", "2.0.0", "--steps", "12.5,100")
    assert r.exit_code != 0  # steps are whole percents
    r = run(mesh, "rollout", "start", "support", "--to", "2.0.0", "--steps", "25,100")
    assert r.exit_code == 0, r.output
    assert "started at 25%" in r.output
    (row,) = json.loads(run(mesh, "rollout", "status", "support", "-o", "json").output)
    assert row["share_percent"] == 25
    assert "share" not in row
    table = run(mesh, "rollout", "status", "support").output
    assert " 25% " in table
    assert "2500" not in table
    assert run(mesh, "rollout", "abort", "support").exit_code == 0
    r = run(mesh, "rollout", "start", "support", "--to", "3.0.0", "--steps", "50,100")
    assert r.exit_code == 0, r.output
    history = json.loads(run(mesh, "rollout", "history", "support", "-o", "json").output)
    assert [h["to"] for h in history] == ["3.0.0", "2.0.0"]  # newest first, as documented
    assert [e["event"] for e in history[1]["events"]] == ["abort", "start"]
    assert [e["share_percent"] for e in history[1]["events"]] == [0, 25]
    lines = run(mesh, "rollout", "history", "support").output.splitlines()
    rows = [line for line in lines if "support" in line and ("3.0.0" in line or "2.0.0" in line)]
    assert "3.0.0" in rows[0], lines
    status = json.loads(run(mesh, "status", "-o", "json").output)
    assert status["rollouts"][0]["share_percent"] == 50


def test_token_from_the_environment_still_works(mesh: str) -> None:
    r = _cli({"ADAPTERMESH_SERVER": mesh, "ADAPTERMESH_TOKEN": RW_TOKEN}, "shards")
    assert r.exit_code == 0, r.output
