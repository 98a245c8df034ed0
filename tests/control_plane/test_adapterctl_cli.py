"""adapterctl's command line: -h, --version, examples in every help, the rollout
sub-commands (and the original `rollout ADAPTER --to V` form), an unquoted --reason, and
flags refused with one line and exit 2 instead of a traceback."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app

from .test_adapterctl import run, server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "-h"], env={"COLUMNS": "200"}, prog_name="adapterctl")
    assert r.exit_code == 0, (args, r.output)
    return r.output


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf command's path (``("rollout", "status")``)."""
    found = []
    for name, command in group.commands.items():
        path = (*prefix, name)
        found += _commands(command, path) if hasattr(command, "commands") else [path]
    return found


LEAVES = _commands(get_command(app))


def test_dash_h_is_help_everywhere_and_every_command_has_an_example() -> None:
    assert "Usage: adapterctl" in _help()
    assert len(LEAVES) >= 20, LEAVES
    for path in LEAVES:
        text = _help(*path)
        assert f"Usage: adapterctl {' '.join(path)}" in text, text
        assert re.search(r"Examples?:", text), path
        assert f"adapterctl {' '.join(path)}" in text.split("Example", 1)[1] or path == (
            "rollout",
            "start",
        ), path


def test_version_prints_the_package_version() -> None:
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"adapterctl {version('adaptermesh')}"


def test_top_level_help_names_the_rules_commands_as_they_are() -> None:
    text = _help()
    assert "Routing rules (CEL): apply, list, get." in text
    assert "apply, list, show" not in text


def test_rollout_status_help_is_its_own() -> None:
    status = _help("rollout", "status")
    for start_flag in ("--to", "--steps", "--interval", "--max-error-rate", "--min-requests"):
        assert start_flag not in status, start_flag
    assert "--output" in status
    start = _help("rollout", "start")
    assert "--to" in start
    assert "--interval" in start
    group = _help("rollout")
    for sub in ("start", "status", "history", "pause", "resume", "promote", "abort"):
        assert sub in group


def test_the_documented_rollout_forms_still_parse(server: str, tmp_path: Path) -> None:  # noqa: F811
    # The adapter is unknown to this control plane: the server refuses, so each form reached
    # the right RPC (a usage error would be exit 2 from the command line).
    r = run(server, "rollout", "credit-risk", "--to", "2.0.0", "--steps", "5,25,50,100")
    assert r.exit_code == 4, r.output
    assert "StartRollout" in r.output
    r = run(server, "rollout", "--to", "2.0.0", "credit-risk")
    assert "StartRollout" in r.output, r.output
    for verb in ("pause", "resume", "promote", "abort"):
        r = run(server, "rollout", verb, "credit-risk")
        assert "ControlRollout" in r.output, (verb, r.output)
        assert r.exit_code in (3, 4), r.output
    r = run(server, "rollout", "status")
    assert r.exit_code == 0, r.output
    # An adapter the mesh does not know has no rollouts to list: NOT_FOUND, exit 3.
    for listing in ("status", "history"):
        r = run(server, "rollout", listing, "credit-risk", "-o", "json")
        assert r.exit_code == 3, r.output
        assert "ListRollouts" in r.output
    r = run(server, "rollout", "credit-risk")
    assert r.exit_code == 2
    assert "--to" in r.output


def test_an_unquoted_reason_takes_the_words_after_it(server: str) -> None:  # noqa: F811
    for shard, mark in (("s0", "1"), ("s1", "2")):
        r = run(server, "shard", "upsert", shard, "-e", f"10.0.7.{mark}:8000", "--mark", mark)
        assert r.exit_code == 0, r.output
    # As the demo prints it, README and the operator guide show it.
    r = run(server, "override", "set", "s0", "60%", "--reason", "demo:", "canary", "s0")
    assert r.exit_code == 0, r.output
    listed = json.loads(run(server, "override", "list", "-o", "json").output)
    assert listed[0]["reason"] == "demo: canary s0"
    r = run(server, "override", "set", "s0", "50%", "--reason", "a", "b", "--ttl", "10m")
    assert r.exit_code == 0, r.output
    listed = json.loads(run(server, "override", "list", "-o", "json").output)
    assert listed[0]["reason"] == "a b"
    assert listed[0]["expires"] is not None
    r = run(server, "override", "set", "s0", "40%", "--reason=quoted form", "more")
    assert r.exit_code == 0, r.output
    assert json.loads(run(server, "override", "list", "-o", "json").output)[0]["reason"] == (
        "quoted form more"
    )
    # Words before --reason, or with no --reason at all, are still refused.
    r = run(server, "override", "set", "s0", "40%", "stray", "--reason", "why")
    assert r.exit_code == 2, r.output
    assert "stray" in r.output
    r = run(server, "override", "set", "s0", "40%", "stray")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output


def test_a_missing_tls_file_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
        args = ["--tls-ca", str(tmp_path / "ca.pem")] if flag != "--tls-ca" else []
        if flag != "--tls-ca":
            (tmp_path / "ca.pem").write_text("not really a CA")
        r = CliRunner().invoke(app, [*args, flag, str(tmp_path / "missing.pem"), "shards"])
        assert r.exit_code == 2, r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        assert flag in r.output
        assert "missing.pem" in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(
    "args",
    [
        ["override", "set", "s0", "10", "--ttl", str(2**40)],
        ["override", "set", "s0", "10", "--ttl", "-5"],
        ["override", "set", "s0", "10", "--ttl", "1.5"],
        ["override", "set", "s0", "10", "--ttl", "inf"],
        ["override", "set", "s0", "10", "--ttl", "nan"],
        ["override", "set", "s0", "10", "--ttl", "11y"],
        ["rollout", "start", "a", "--to", "2", "--interval", "0"],
        ["rollout", "start", "a", "--to", "2", "--interval", "-2m"],
        ["rollout", "start", "a", "--to", "2", "--interval", "3651d"],
        ["rollout", "start", "a", "--to", "2", "--interval", "500ms"],
        ["rollout", "a", "--to", "2", "--max-p95-ttft", "nan"],
        ["--timeout", "0", "shards"],
        ["--timeout", "-1", "shards"],
        ["--timeout", "soon", "shards"],
    ],
)
def test_bad_durations_are_one_line_naming_the_flag(args: list[str]) -> None:
    r = CliRunner().invoke(app, args, env={"ADAPTERMESH_SERVER": "127.0.0.1:1"})
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    flag = next(a for a in args if a.startswith("--") and a not in ("--to",))
    assert flag in r.output, r.output
    assert "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_durations_take_the_same_forms_everywhere(server: str) -> None:  # noqa: F811
    assert run(server, "shard", "upsert", "s0", "-e", "10.0.8.1:8000", "--mark", "8").exit_code == 0
    assert run(server, "shard", "upsert", "s1", "-e", "10.0.8.2:8000", "--mark", "9").exit_code == 0
    for ttl in ("90", "90s", "2m", "1h", "90000ms"):
        r = run(server, "--timeout", "5s", "override", "set", "s0", "10%", "--ttl", ttl)
        assert r.exit_code == 0, (ttl, r.output)
    assert run(server, "--timeout", "1500ms", "shards").exit_code == 0


@pytest.mark.parametrize(
    ("state", "share", "line"),
    [
        ("ROLLOUT_STATE_RUNNING", 2500, "rollout support -> 3.0.0: RUNNING at 25%"),
        ("ROLLOUT_STATE_PAUSED", 2500, "rollout support -> 3.0.0: PAUSED at 25%"),
        ("ROLLOUT_STATE_ABORTED", 0, "rollout support -> 3.0.0: ABORTED at 0%"),
        (
            "ROLLOUT_STATE_COMPLETED",
            0,
            "rollout support -> 3.0.0: COMPLETED 3.0.0 serves everything",
        ),
    ],
)
def test_a_control_action_says_where_the_rollout_is(
    state: str, share: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptermesh.cli.adapterctl import _print_rollout
    from adaptermesh.proto import control_plane_pb2

    rollout = control_plane_pb2.Rollout(
        spec=control_plane_pb2.RolloutSpec(adapter="support", to_version="3.0.0"),
        state=getattr(control_plane_pb2, state),
        share=share,
    )
    _print_rollout(rollout)
    assert capsys.readouterr().out.strip() == line
