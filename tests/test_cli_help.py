"""``adaptermesh`` help: every subcommand's every flag has a description and shows its default,
``-h`` works everywhere, ``--version`` prints the package version."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata

import pytest

from adaptermesh.cli import main as entry
from adaptermesh.clisetup import DefaultsHelpFormatter, shows_default

# Every subcommand, and the sub-subcommands that have a parser of their own.
INVOCATIONS = [[name] for name in entry.COMMANDS] + [["demo", "classifier"]]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _parser_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``adaptermesh ARGV`` parses its flags with (stopped before it parses)."""

    def capture(self: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        raise _Captured(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Captured) as caught:
            entry.main(argv)
    return caught.value.parser


def _flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def _with_subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _with_subparsers(sub)


def test_the_walk_covers_every_command() -> None:
    assert {argv[0] for argv in INVOCATIONS} == set(entry.COMMANDS)
    assert {"agent", "control-plane", "worker", "mqtt-bridge", "adafuse-train", "demo"} <= set(
        entry.COMMANDS
    )


@pytest.mark.parametrize("argv", INVOCATIONS, ids=" ".join)
def test_every_flag_has_help_and_shows_its_default(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for parser in _with_subparsers(_parser_of(argv, monkeypatch)):
        _check_parser(parser)


def _check_parser(parser: argparse.ArgumentParser) -> None:
    # A flag's default shows through DefaultsHelpFormatter or in its own help text.
    formatter = parser._get_formatter()
    missing_help, missing_default = [], []
    for action in _flags(parser):
        name = "/".join(action.option_strings)
        if not (action.help or "").strip():
            missing_help.append(name)
            continue
        text = formatter._expand_help(action)
        if shows_default(action) and "default" not in text:
            missing_default.append(name)
    assert not missing_help, f"{parser.prog}: no help for {missing_help}"
    assert not missing_default, f"{parser.prog}: no default shown for {missing_default}"
    # A default the formatter adds appears with its value.
    if issubclass(parser.formatter_class, DefaultsHelpFormatter):
        rendered = " ".join(parser.format_help().split())
        for action in _flags(parser):
            if shows_default(action) and "default" not in (action.help or ""):
                assert f"(default: {action.default}" in rendered, action.dest


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("argv", INVOCATIONS, ids=" ".join)
def test_help_flags_work_everywhere(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        entry.main([*argv, flag])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: adaptermesh " + " ".join(argv))
    assert "show this help message and exit" in out


def test_control_plane_help_shows_policy_flags_and_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        entry.main(["control-plane", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1:7400)" in out
    for flag in ("--min-weight", "--max-step", "--publish-threshold", "--ewma-alpha"):
        assert flag in out
    for default in ("(default: 50)", "(default: 1500)", "(default: 0.5)"):
        assert default in out


def test_agent_help_names_the_scopes_its_calls_need(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptermesh.control_plane.auth import READ, REPORT, method_scope

    # The agent calls these two control-plane methods and no other (agent/watch.py).
    needed = {
        method_scope(f"/adaptermesh.v1.ControlPlane/{method}")
        for method in ("WatchAssignments", "ReportLoad")
    }
    with pytest.raises(SystemExit):
        entry.main(["agent", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "WatchAssignments and ReportLoad" in out
    assert needed == {READ, REPORT}
    assert "the read and report scopes" in out
    assert "write" not in out.split("--token-file", 1)[1].split("--iface", 1)[0]


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_top_level_help(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main([flag]) == 0
    out = capsys.readouterr().out
    for name in entry.COMMANDS:
        assert f"  {name} " in out
    assert "--version" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main([]) == 2
    assert capsys.readouterr().out.startswith("usage: adaptermesh")


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main([flag]) == 0
    assert capsys.readouterr().out == f"adaptermesh {metadata.version('adaptermesh')}\n"


def test_installed_entry_point_prints_the_version() -> None:
    script = (
        "import sys; from adaptermesh.cli.main import app; "
        "sys.argv = ['adaptermesh', '--version']; app()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"adaptermesh {metadata.version('adaptermesh')}"
