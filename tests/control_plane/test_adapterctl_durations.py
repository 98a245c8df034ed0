"""The one duration parser behind every adapterctl duration flag (--ttl, --interval,
--max-p95-ttft, --timeout): the forms it takes give the right number of seconds, and
anything else is refused with one line naming the flag, never a traceback."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app
from adaptermesh.cliargs import DURATION_UNITS, MAX_DURATION_S, parse_duration

VALID = re.compile(r"\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)(ms|s|m|h|d)?\s*", re.IGNORECASE)

numbers = st.one_of(
    st.integers(0, 10**9).map(str),
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(lambda p: f"{p[0]}.{p[1]}"),
    st.integers(0, 10**6).map(lambda n: f".{n}"),
    st.integers(0, 10**6).map(lambda n: f"{n}."),
)
units = st.sampled_from(["", "ms", "s", "m", "h", "d", "MS", "S", "M", "H"])


@given(numbers, units)
def test_valid_forms_parse_to_the_right_seconds(number: str, unit: str) -> None:
    text = number + unit
    seconds = Fraction(number) * DURATION_UNITS[unit.lower() or "s"]
    if seconds > MAX_DURATION_S:
        with pytest.raises(ValueError, match=r"^--ttl: .* is longer than 10 years$"):
            parse_duration(text, "--ttl", zero_ok=True)
    elif seconds == 0:
        with pytest.raises(ValueError, match=r"^--ttl: .* must be longer than 0$"):
            parse_duration(text, "--ttl")
        assert parse_duration(text, "--ttl", zero_ok=True) == 0
    else:
        assert parse_duration(text, "--ttl") == float(seconds)
        in_ms = parse_duration(text, "--max-p95-ttft", unit="ms") if unit else None
        if in_ms is not None:
            assert in_ms == float(seconds * 1000)
        if seconds.denominator == 1:
            assert parse_duration(text, "--interval", whole=True) == int(seconds)
        else:
            with pytest.raises(ValueError, match="not a whole number of seconds"):
                parse_duration(text, "--interval", whole=True)


@given(st.text(max_size=30))
def test_anything_else_is_refused_with_one_line(text: str) -> None:
    if VALID.fullmatch(text):
        return
    with pytest.raises(ValueError) as info:
        parse_duration(text, "--interval")
    message = str(info.value)
    assert message.startswith("--interval: ")
    assert "\n" not in message
    assert "\r" not in message


@pytest.mark.parametrize(
    "text", ["-1", "-0", "+5", "1e3", "inf", "nan", "Infinity", "1_000", "5 m", "1h30m", "2w", ""]
)
def test_signs_exponents_and_non_numbers_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--ttl: .* is not a duration such as"):
        parse_duration(text, "--ttl", zero_ok=True)


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.text(max_size=20).filter(lambda t: not VALID.fullmatch(t)),
        st.integers(MAX_DURATION_S + 1, 2**80).map(str),
        st.sampled_from(["inf", "nan", "-5", "1.5", "0.5s", str(2**40)]),
    )
)
def test_the_command_line_refuses_with_exit_2_and_one_line(text: str) -> None:
    r = CliRunner().invoke(
        app,
        ["override", "set", "s0", "10", f"--ttl={text}"],
        env={"ADAPTERMESH_SERVER": "127.0.0.1:1"},
    )
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "--ttl" in r.output
    assert "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
