"""``adaptermesh worker`` start-up: a port in use fails the start at once, in one line, before
the model loads."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptermesh.clisetup import QUIET_LOGGERS
from adaptermesh.worker import cli


@pytest.fixture(autouse=True)
def _logging_as_before() -> Iterator[None]:
    yield
    for name in QUIET_LOGGERS:  # the command line's logging setup quiets these
        logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.fixture
def dirs(tmp_path: Path) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "adapters").mkdir()
    return ["--model", str(tmp_path / "model"), "--adapter-root", str(tmp_path / "adapters")]


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*_args: object) -> None:
        raise AssertionError("the model was loaded although the start could not listen")

    monkeypatch.setattr(cli, "_build_engine", load)


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_port_in_use_fails_before_the_model_loads(
    dirs: list[str], held_port: int, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    other = ["--port", "0"] if flag == "--grpc-port" else []
    started = time.monotonic()
    assert cli.main([*dirs, *other, flag, str(held_port)]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"adaptermesh worker: cannot listen on 127.0.0.1:{held_port} ({flag}): ")
    assert "in use" in err


@pytest.mark.usefixtures("no_model_load")
def test_an_address_this_host_lacks_fails_before_the_model_loads(
    dirs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this host.
    assert cli.main([*dirs, "--host", "192.0.2.7", "--port", "8123"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("adaptermesh worker: cannot listen on 192.0.2.7:8123 (--port): ")


def test_check_port_free_releases_what_it_binds() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli.check_port_free("127.0.0.1", port)
    cli.check_port_free("127.0.0.1", port)  # released: a second check (and the listener) binds
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(OSError):
            cli.check_port_free("127.0.0.1", port)
    cli.check_port_free("127.0.0.1", 0)  # 0 and None are not checked
    cli.check_port_free("127.0.0.1", None)


def test_the_help_states_the_engine_defaults() -> None:
    from adaptermesh.worker.engine_config import EngineConfig

    config = EngineConfig()
    helps = {a.dest: a.help or "" for a in cli.build_parser()._actions}
    assert f"default {config.block_size})" in helps["block_size"]
    assert f"(default {config.max_lora_rank})" in helps["max_lora_rank"]
    assert f"(default {config.gpu_memory_fraction})" in helps["gpu_memory_fraction"]
    assert f"(default {config.max_prefill_chunk})" in helps["max_prefill_chunk"]
    assert f"(default: {config.adapter_eviction}," in helps["adapter_eviction"]
