"""The fake control plane the agent tests run against."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .fakes import ControlPlaneServer, FakeControlPlane

TOKEN = "agent-secret"


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlaneServer]:
    server = ControlPlaneServer(FakeControlPlane(token=TOKEN))
    await server.start()
    yield server
    await server.stop()
