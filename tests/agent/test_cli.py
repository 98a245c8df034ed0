"""``adaptermesh agent`` argument handling."""

from __future__ import annotations

import pytest

from adaptermesh.agent.cli import build_parser, config_from_args

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
