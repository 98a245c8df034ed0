"""Fixtures of the bridge tests: a mosquitto broker, the fake mesh, an in-process bridge."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adaptermesh.backoff import Backoff
from adaptermesh.bridge.mesh import MeshClient
from adaptermesh.bridge.mqtt import Bridge, BridgeConfig

from .support import FakeMesh, Mosquitto, Replies, mqtt_client


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker")
    b.start()
    yield b
    b.stop()


@pytest.fixture
def mesh() -> Iterator[FakeMesh]:
    m = FakeMesh().start()
    yield m
    m.stop()


@pytest.fixture
def replies(broker: Mosquitto) -> Iterator[Replies]:
    r = Replies(broker.port)
    yield r
    r.close()


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Any]:
    c = mqtt_client(broker.port)
    yield c
    c.disconnect()
    c.loop_stop()


class RunningBridge:
    """A Bridge on its own event loop thread."""

    def __init__(self, config: BridgeConfig, fast_backoff: bool = True) -> None:
        self.ready = threading.Event()
        mesh = MeshClient(
            config.base_url,
            timeout=config.request_timeout_s,
            max_attempts=config.max_attempts,
            backoff=(lambda: Backoff(initial=0.01, maximum=0.05)) if fast_backoff else Backoff,
        )
        self.bridge = Bridge(config, mesh=mesh, on_ready=self.ready.set)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, daemon=True, name="bridge")
        self._thread.start()
        assert self.ready.wait(10), "the bridge did not subscribe"

    def _main(self) -> None:
        async def go() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.bridge.run(self._stop)

        asyncio.run(go())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive()


@pytest.fixture
def start_bridge(
    broker: Mosquitto, mesh: FakeMesh, tmp_path: Path
) -> Iterator[Callable[..., RunningBridge]]:
    started: list[RunningBridge] = []

    def start(**overrides: Any) -> RunningBridge:
        config = BridgeConfig(
            broker_host="127.0.0.1",
            broker_port=broker.port,
            request_topic="requests/#",
            base_url=mesh.url,
            state_dir=tmp_path / "state",
            max_in_flight=4,
            drain_s=2.0,
            client_id="bridge-under-test",
        )
        rb = RunningBridge(replace(config, **overrides))
        started.append(rb)
        return rb

    yield start
    for rb in started:
        rb.stop()
