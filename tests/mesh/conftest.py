"""Fixtures of the mesh tests. Every Envoy, server and backend is stopped on teardown."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mesh_support import Backend

from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import BuildOptions

# Fast health checks so tests do not wait on the production interval.
TEST_OPTIONS = BuildOptions(
    health_check_interval_s=0.5, health_check_no_traffic_interval_s=0.5, health_check_timeout_s=0.5
)


class Xds:
    def __init__(self) -> None:
        self.cache = SnapshotCache(options=TEST_OPTIONS)
        self.server = XdsServer(self.cache)
        self.port = self.server.start()

    def restart(self, cache: SnapshotCache) -> None:
        """Stop the server and serve ``cache`` on the same port."""
        self.server.stop()
        self.cache = cache
        self.server = XdsServer(cache, port=self.port)
        self.server.start()


@pytest.fixture
def xds() -> Iterator[Xds]:
    state = Xds()
    try:
        yield state
    finally:
        state.server.stop(grace=0.1)


@pytest.fixture
def start_envoy(xds: Xds) -> Iterator[Callable[..., EnvoyProcess]]:
    started: list[EnvoyProcess] = []

    def start(node_id: str, *, delta: bool = False, wait_ready: bool = True) -> EnvoyProcess:
        envoy = EnvoyProcess(
            build_bootstrap(node_id, xds.port, delta=delta, initial_fetch_timeout_s=5.0)
        )
        started.append(envoy)
        envoy.start(ready_timeout=20.0 if wait_ready else None)
        return envoy

    try:
        yield start
    finally:
        for envoy in started:
            envoy.cleanup()


@pytest.fixture
def backends() -> Iterator[Callable[[int], list[Backend]]]:
    made: list[Backend] = []

    def make(n: int) -> list[Backend]:
        new = [Backend(f"b{len(made) + i}") for i in range(n)]
        made.extend(new)
        return new

    try:
        yield make
    finally:
        for backend in made:
            backend.close()
