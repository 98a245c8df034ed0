"""``adaptermesh dev``: what it refuses before it touches the machine (the mesh it starts is
exercised by test_doc_commands.py)."""

from __future__ import annotations

import os

import pytest

from adaptermesh.cli import dev
from adaptermesh.cli.main import main as adaptermesh_main


@pytest.mark.parametrize("command", ["up", "down"])
def test_up_and_down_need_root(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert adaptermesh_main(["dev", command]) == 2
    assert f"adaptermesh dev {command}: needs root" in capsys.readouterr().err


def test_a_prefix_longer_than_an_interface_name_allows_is_refused() -> None:
    with pytest.raises(dev.DevError, match="--prefix"):
        dev.DevMesh(dev.DEFAULT_WORKDIR, "p" * 14)


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        adaptermesh_main(["dev", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("make-model", "up", "down"):
        assert command in out
