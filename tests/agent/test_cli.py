"""``adaptermesh agent`` argument handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adaptermesh.agent import cli as agent_cli
from adaptermesh.agent.cli import build_parser, config_from_args, main
from adaptermesh.agent.extproc import MetricsPoller
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.clisetup import QUIET_LOGGERS

BASE = ["--node-id", "n1", "--control-plane", "cp:50051", "--iface", "eth0"]


def test_full_flag_set_builds_the_config(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = build_parser().parse_args(
        [
            *BASE,
            "--token-file",
            str(token),
            "--pin-dir",
            str(tmp_path / "pins"),
            "--xds-port",
            "18001",
            "--metrics-port",
            "9465",
            "--detach",
        ]
    )
    config = config_from_args(args)
    assert config.token == "s3cret"
    assert config.xds_port == 18001
    assert config.metrics_port == 9465
    assert config.detach is True
    assert config.pin_dir == tmp_path / "pins"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--xds-port", "70000"], "--xds-port"),
        (["--report-interval", "0"], "--report-interval"),
    ],
)
def test_bad_values_name_the_flag(capsys, extra, field):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, *extra])
    assert field in capsys.readouterr().err


def test_control_plane_needs_host_and_port(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--node-id", "n", "--control-plane", "cp", "--iface", "e"])
    assert "--control-plane" in capsys.readouterr().err


def test_empty_or_missing_token_file_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing"):
        args = build_parser().parse_args([*BASE, "--token-file", str(path)])
        with pytest.raises(SystemExit, match="--token-file"):
            config_from_args(args)


def test_mtls_flags_go_together(tmp_path):
    args = build_parser().parse_args([*BASE, "--tls-cert", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="--tls-key"):
        config_from_args(args)


def test_unix_socket_control_plane_is_accepted():
    args = build_parser().parse_args(
        ["--node-id", "n", "--control-plane", "unix:/run/cp.sock", "--iface", "e"]
    )
    assert config_from_args(args).control_plane == "unix:/run/cp.sock"


NO_IFACE = "amnoiface0"


@pytest.fixture(autouse=True)
def _logging_as_before() -> Iterator[None]:
    yield
    for name in QUIET_LOGGERS:  # the command line's logging setup quiets these
        logging.getLogger(name).setLevel(logging.NOTSET)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def fresh_root_logger() -> Iterator[logging.Logger]:
    """The root logger as a fresh process has it (pytest's capture handlers set aside), so
    the command line's own logging setup takes effect; restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers, root.level
    root.handlers = []
    try:
        yield root
    finally:
        root.handlers = handlers
        root.setLevel(level)
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)


def _scrape_once() -> int:
    """One round of the agent's worker scrape (MetricsPoller) against a stub worker."""
    requests = []

    def worker(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, text="# no samples\n")

    async def scrape() -> None:
        book = EndpointBook()
        book.set_endpoints("shard-a", [("10.0.0.1", 8000), ("10.0.0.2", 8000)])
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker)) as client:
            await MetricsPoller(book, client=client).step(client)

    asyncio.run(scrape())
    return len(requests)


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_a_worker_scrape_logs_no_info_line(capsys, level):
    records = _Records()
    with fresh_root_logger() as root:
        # The agent's logging setup, as its command line runs it (it stops at the missing iface).
        assert main([*BASE[:-1], NO_IFACE, "--log-level", level]) == 1
        assert root.getEffectiveLevel() == logging.getLevelName(level)
        root.addHandler(records)
        assert _scrape_once() == 2
    capsys.readouterr()
    loud = [r for r in records.records if r.levelno >= logging.INFO]
    assert loud == [], [r.getMessage() for r in loud]


def test_debug_keeps_the_scrape_lines(capsys):
    records = _Records()
    with fresh_root_logger() as root:
        assert main([*BASE[:-1], NO_IFACE, "--log-level", "DEBUG"]) == 1
        root.addHandler(records)
        assert _scrape_once() == 2
    capsys.readouterr()
    assert any(r.name == "httpx" and "/metrics" in r.getMessage() for r in records.records)


def test_control_plane_scrape_lines_are_debug_too(tmp_path, capsys):
    from adaptermesh.control_plane import cli as cp_cli

    records = _Records()
    with fresh_root_logger() as root:
        # Its logging setup runs first; an unreadable tokens file then stops the start.
        argv = ["--state-dir", str(tmp_path), "--tokens-file", str(tmp_path / "missing")]
        assert cp_cli.main(argv) == 1
        assert root.getEffectiveLevel() == logging.INFO
        root.addHandler(records)
        assert _scrape_once() == 2
    capsys.readouterr()
    assert [r for r in records.records if r.levelno >= logging.INFO] == []


def test_a_missing_iface_is_one_line_and_nothing_starts(capsys, monkeypatch):
    def no_start(*_args, **_kw):
        raise AssertionError("the agent started with a missing --iface")

    monkeypatch.setattr(agent_cli, "_run", no_start)
    assert main([*BASE[:-1], NO_IFACE]) == 1
    err = capsys.readouterr().err
    assert err == f"adaptermesh agent: --iface {NO_IFACE}: no such network interface\n"


@pytest.fixture
def pin_dir():
    path = Path(f"/sys/fs/bpf/amcli-test-{secrets.token_hex(4)}")
    try:
        yield path
    finally:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (eBPF)")
def test_an_iface_that_vanishes_before_attach_leaves_no_pins(
    capsys, monkeypatch, pin_dir, tmp_path
):
    # Past the command line's check (as when the interface goes away while the classifier
    # compiles): the attach fails, the start ends with one line and its pins are removed.
    monkeypatch.setattr(agent_cli.socket, "if_nametoindex", lambda _name: 1)
    argv = [
        *BASE[:-1],
        NO_IFACE,
        "--pin-dir",
        str(pin_dir),
        "--state-file",
        str(tmp_path / "assignment.pb"),
        "--xds-port",
        "0",
        "--metrics-port",
        "0",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("adaptermesh agent: ")
    assert NO_IFACE in err
    assert not pin_dir.exists() or list(pin_dir.iterdir()) == []
