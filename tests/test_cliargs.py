"""The shared port argument type, and every process's command line using it."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.agent.cli import build_parser as agent_parser
from adaptermesh.bridge.cli import build_parser as bridge_parser
from adaptermesh.cliargs import port
from adaptermesh.control_plane.cli import build_parser as control_plane_parser
from adaptermesh.worker.cli import build_parser as worker_parser


@given(st.integers(0, 65535))
def test_port_accepts_the_range(value: int) -> None:
    assert port(str(value)) == value


@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=65536)))
def test_port_refuses_out_of_range(value: int) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"not in 0\.\.65535"):
        port(str(value))


@given(st.text().filter(lambda t: not t.strip().lstrip("+-").isdigit()))
def test_port_refuses_non_numbers_naming_them(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a port number"):
        port(text)


@pytest.mark.parametrize(("parser", "required"), [
    (agent_parser, ["--node-id", "n1", "--control-plane", "127.0.0.1:1"]),
    (control_plane_parser, []),
    (bridge_parser, ["--broker", "mqtt:1883", "--request-topic", "req",
                     "--base-url", "http://x:1", "--state-dir", "/tmp/s"]),
])  # fmt: skip
def test_each_process_refuses_a_bad_metrics_port(  # type: ignore[no-untyped-def]
    parser, required, capsys
) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args([*required, "--metrics-port", "70000"])
    assert exc.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_the_worker_refuses_a_bad_port(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        worker_parser().parse_args(["--port", "70000"])
    assert exc.value.code == 2
    assert "--port: 70000 is not in 0..65535" in capsys.readouterr().err
