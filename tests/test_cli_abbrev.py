"""No command line matches a flag by its prefix: ``adaptermesh dev up --shard 3`` is an error,
not ``--shards 3``. Every argparse parser (and sub-parser) in the package, the test kit and
the benchmarks says ``allow_abbrev=False``; click (adapterctl) never matches prefixes."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adaptermesh.agent.cli import build_parser as agent_parser
from adaptermesh.cli import dev
from adaptermesh.cli.adapterctl import app
from adaptermesh.cli.main import main as adaptermesh_main

REPO = Path(__file__).resolve().parents[1]


def _parser_calls(path: Path) -> list[tuple[int, bool]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("ArgumentParser", "add_parser"):
                off = any(
                    k.arg == "allow_abbrev"
                    and isinstance(k.value, ast.Constant)
                    and k.value.value is False
                    for k in node.keywords
                )
                out.append((node.lineno, off))
    return out


def test_every_argparse_parser_refuses_abbreviations() -> None:
    files = [p for d in ("src", "bench", "scripts") for p in (REPO / d).rglob("*.py")]
    calls = {p: _parser_calls(p) for p in files}
    assert sum(len(c) for c in calls.values()) >= 40  # the walk found the parsers
    missing = [
        f"{p.relative_to(REPO)}:{line}"
        for p, found in calls.items()
        for line, off in found
        if not off
    ]
    assert not missing, "ArgumentParser/add_parser without allow_abbrev=False: " + ", ".join(
        missing
    )


def test_dev_up_does_not_take_shard_for_shards(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    started: list[object] = []

    def start(mesh: object) -> None:  # never a real mesh from a unit test
        started.append(mesh)
        raise KeyboardInterrupt

    monkeypatch.setattr(dev.DevMesh, "start", start)
    monkeypatch.setattr(dev.DevMesh, "stop", lambda _mesh: None)
    with pytest.raises(SystemExit) as exit_info:
        adaptermesh_main(["dev", "up", "--shard", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --shard 3" in capsys.readouterr().err
    assert not started


def test_the_agent_does_not_take_a_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        agent_parser().parse_args(["--node", "n", "--control-plane", "h:1", "--iface", "lo"])
    assert "--node" in capsys.readouterr().err


def test_adapterctl_does_not_take_a_prefix() -> None:
    r = CliRunner().invoke(app, ["shards", "--out", "json"], env={"COLUMNS": "200"})
    assert r.exit_code == 2
    assert "No such option: --out" in r.output
