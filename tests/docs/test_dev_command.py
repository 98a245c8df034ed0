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


# ---- one mesh at a time ----------------------------------------------------------------------


def test_a_second_lock_for_the_same_prefix_or_workdir_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    locks = tmp_path / "locks"
    first = dev.DevLock("amx", tmp_path / "one", lock_dir=locks)
    first.acquire()
    try:
        for prefix, workdir in (("amx", tmp_path / "two"), ("amy", tmp_path / "one")):
            with pytest.raises(dev.DevError) as info:
                dev.DevLock(prefix, workdir, lock_dir=locks).acquire()
            text = str(info.value)
            assert f"pid {os.getpid()}, workdir {tmp_path / 'one'}, prefix amx" in text
            assert f"export AMDEV={tmp_path / 'one'}" in text
            assert f"kill {os.getpid()}" in text
        other = dev.DevLock("amz", tmp_path / "three", lock_dir=locks)
        other.acquire()  # another prefix and work directory: its own mesh
        other.release()
    finally:
        first.release()
    again = dev.DevLock("amx", tmp_path / "two", lock_dir=locks)
    again.acquire()
    again.release()
    assert not list(locks.iterdir())


def test_the_lock_of_a_killed_up_does_not_hold(tmp_path: Path) -> None:
    import subprocess
    import sys

    locks = tmp_path / "locks"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from adaptermesh.cli import dev; "
            f"dev.DevLock('amx', Path('{tmp_path / 'one'}'), lock_dir=Path('{locks}')).acquire(); "
            "print('locked', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(dev.DevError, match=f"pid {holder.pid}"):
            dev.DevLock("amx", tmp_path / "one", lock_dir=locks).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = dev.DevLock("amx", tmp_path / "one", lock_dir=locks)
    lock.acquire()  # the file is still there; the lock went with the process
    lock.release()


def test_up_refuses_a_running_mesh_before_it_touches_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(dev, "LOCK_DIR", tmp_path / "locks")
    touched: list[str] = []
    monkeypatch.setattr(dev.DevMesh, "start", lambda self: touched.append("start"))
    monkeypatch.setattr(dev, "down", lambda *a: touched.append("down"))
    first = dev.DevLock(dev.DEFAULT_PREFIX, tmp_path / "first", lock_dir=tmp_path / "locks")
    first.acquire()
    try:
        for argv in (
            ["--workdir", str(tmp_path / "first")],
            ["--workdir", str(tmp_path / "second")],
        ):
            assert adaptermesh_main(["dev", "up", *argv]) == 1
            err = capsys.readouterr().err
            assert err.startswith("adaptermesh dev up: a dev mesh is already running (pid ")
            assert err.count("\n") == 1
        assert adaptermesh_main(["dev", "down", "--workdir", str(tmp_path / "first")]) == 1
        assert "a dev mesh is already running" in capsys.readouterr().err
    finally:
        first.release()
    assert touched == []
    assert not (tmp_path / "second").exists()


def test_a_busy_port_is_one_line_naming_the_port_and_its_holder() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = dev.busy_port([port])
    assert line is not None
    assert "\n" not in line
    assert line.startswith(f"127.0.0.1:{port} is in use, probably by pid {os.getpid()} (")
    assert dev.busy_port([port]) is None  # closed: free again


def test_up_checks_every_port_it_will_listen_on() -> None:
    mesh = dev.DevMesh(dev.DEFAULT_WORKDIR, "amx", shards=3, workers_per_shard=2)
    assert sorted(mesh.ports) == sorted(
        {7400, *mesh.all_worker_ports, 8080, 8081, 8082, 9901, 9902, 9903, 18000, 9464, 18100}
    )


@given(st.integers(0, 1 << 32), st.integers(1, dev.MAX_SHARDS))
def test_a_mark_names_a_shard_only_in_the_mesh_range(mark: int, shards: int) -> None:
    from adaptermesh.cli.devrelay import shard_for_mark

    index = shard_for_mark(mark, dev.FIRST_MARK, shards)
    if dev.FIRST_MARK <= mark < dev.FIRST_MARK + shards:
        assert index == mark - dev.FIRST_MARK
    else:
        assert index is None


def test_exec_without_a_mesh_names_where_it_looked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("AMDEV", str(tmp_path / "nomesh"))
    assert adaptermesh_main(["dev", "exec", "--", "true"]) == 2
    assert f"AMDEV={tmp_path / 'nomesh'}: no dev mesh is up there" in capsys.readouterr().err
    assert adaptermesh_main(["dev", "exec", "--workdir", str(tmp_path), "--", "true"]) == 2
    assert f"--workdir {tmp_path}: no dev mesh" in capsys.readouterr().err
    assert adaptermesh_main(["dev", "exec"]) == 2
    assert "no command" in capsys.readouterr().err
