"""The shared argument types (ports, shares, positive numbers), and every process's command
line using them."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.agent.cli import build_parser as agent_parser
from adaptermesh.bridge.cli import build_parser as bridge_parser
from adaptermesh.cliargs import (
    fraction,
    non_negative_int,
    percent,
    port,
    positive_float,
    positive_int,
    read_secret,
)
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


@given(st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
def test_fraction_and_percent_take_their_range_and_name_anything_else(value: object) -> None:
    text = repr(value) if isinstance(value, float) else str(value)
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    for parse, hi in ((fraction, 1.0), (percent, 100.0)):
        if math.isfinite(number) and 0.0 <= number <= hi:
            assert parse(text) == number
        else:
            with pytest.raises(argparse.ArgumentTypeError, match="is not"):
                parse(text)


@pytest.mark.parametrize(
    ("content", "says"), [(None, "cannot read"), ("", "is empty"), (" \n\t", "is empty")]
)
def test_read_secret_refuses_a_missing_or_empty_file_naming_the_flag(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"--x-file: .*{says}"):
        read_secret(path, "--x-file")


def test_read_secret_strips_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  s3cret\n")
    assert read_secret(path, "--x-file") == "s3cret"


@given(st.integers() | st.text(max_size=8))
def test_whole_number_types_take_their_range_and_name_anything_else(value: object) -> None:
    text = str(value)
    try:
        number: int | None = int(text)
    except ValueError:
        number = None
    for parse, low in ((positive_int, 1), (non_negative_int, 0)):
        if number is not None and number >= low:
            assert parse(text) == number
        else:
            with pytest.raises(
                argparse.ArgumentTypeError,
                match=r"is not a whole number|is not at least 1|is negative",
            ):
                parse(text)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
def test_positive_float_takes_finite_numbers_above_zero_only(value: object) -> None:
    text = repr(value) if isinstance(value, float) else str(value)
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if math.isfinite(number) and number > 0:
        assert positive_float(text) == number
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="is not a positive number"):
            positive_float(text)


@pytest.mark.parametrize(("parser", "required", "flag", "says"), [
    (agent_parser, ["--node-id", "n1", "--control-plane", "127.0.0.1:1"], "--report-interval",
     "is not a positive number"),
    (control_plane_parser, [], "--interval", "is not a positive number"),
    (bridge_parser, ["--broker", "mqtt:1883", "--request-topic", "req",
                     "--base-url", "http://x:1", "--state-dir", "/tmp/s"], "--max-in-flight",
     "0 is not at least 1"),
    (worker_parser, [], "--max-num-seqs", "0 is not at least 1"),
    (worker_parser, [], "--drain-timeout", "is not a positive number"),
])  # fmt: skip
def test_each_process_refuses_a_zero_where_it_wants_a_positive_number(  # type: ignore[no-untyped-def]
    parser, required, flag, says, capsys
) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args([*required, flag, "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err
    assert says in err
