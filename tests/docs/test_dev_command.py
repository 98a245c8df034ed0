"""``adaptermesh dev``: what it refuses before it touches the machine, and the layout of the
shards it starts (the mesh itself is exercised by test_doc_commands.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shards", "0"], "--shards: 1 to 8, not 0"),
        (["--shards", "9"], "--shards: 1 to 8, not 9"),
        (["--workers-per-shard", "0"], "--workers-per-shard: 1 to 4, not 0"),
        (["--workers-per-shard", "5"], "--workers-per-shard: 1 to 4, not 5"),
    ],
)
def test_up_refuses_a_layout_out_of_range_before_it_starts_anything(
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    started: list[object] = []
    monkeypatch.setattr(dev.DevMesh, "start", lambda self: started.append(self))
    workdir = tmp_path / "dev"
    assert adaptermesh_main(["dev", "up", "--workdir", str(workdir), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not started
    assert not workdir.exists()


@given(st.integers(1, dev.MAX_SHARDS), st.integers(1, dev.MAX_WORKERS_PER_SHARD))
def test_every_shard_gets_its_own_ports(shards: int, per_shard: int) -> None:
    mesh = dev.DevMesh(dev.DEFAULT_WORKDIR, "amx", shards=shards, workers_per_shard=per_shard)
    assert mesh.shard_ids == [f"s{i}" for i in range(shards)]
    workers = mesh.all_worker_ports
    assert all(len(mesh.worker_ports(i)) == per_shard for i in range(shards))
    services = [dev.SERVICE_PORT + i for i in range(shards)]
    admins = [dev.ENVOY_ADMIN_PORT + i for i in range(shards)]
    fixed = [dev.XDS_PORT, dev.AGENT_METRICS_PORT, dev.EXT_PROC_PORT, 7400]
    ports = [*workers, *services, *admins, *fixed]
    assert len(set(ports)) == len(ports)
    assert workers[:2] == [8101, 8102][: len(workers[:2])]  # the ports the guide names


def test_two_shards_of_one_worker_by_default() -> None:
    mesh = dev.DevMesh(dev.DEFAULT_WORKDIR, dev.DEFAULT_PREFIX)
    assert (mesh.shard_ids, mesh.worker_ports(0), mesh.worker_ports(1)) == (
        ["s0", "s1"],
        [8101],
        [8102],
    )
    text = mesh.instructions()
    assert "s0 (Envoy 127.0.0.1:8080, worker(s) :8101)" in text
    assert "s1 (Envoy 127.0.0.1:8081, worker(s) :8102)" in text
