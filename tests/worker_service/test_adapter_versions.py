"""Adapter versions on the worker: ``x-adapter-version`` serves ``<adapter>@<version>``, the
per-adapter series the rollout controller reads, and injected faults."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from adaptermesh.control_plane.rollout import parse_adapter_series

from .conftest import Server, StartServer

BODY = {"model": "alpha", "prompt": "hello", "max_tokens": 2}


async def test_the_version_header_picks_the_versioned_adapter(server: Server) -> None:
    server.engine.on_disk.add("alpha@2.0.0")
    r = await server.client.post(
        "/v1/completions", json=BODY, headers={"x-adapter-version": "2.0.0"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "alpha@2.0.0"
    assert server.engine.submitted[-1].adapter == "alpha@2.0.0"
    # The base model has no versions; a name that already carries one keeps it.
    r = await server.client.post(
        "/v1/completions",
        json={**BODY, "model": "tiny-base"},
        headers={"x-adapter-version": "2.0.0"},
    )
    assert r.status_code == 200, r.text
    assert server.engine.submitted[-1].adapter is None
    r = await server.client.post(
        "/v1/completions", json={**BODY, "model": "alpha@2.0.0"}, headers={"x-adapter-version": "9"}
    )
    assert r.status_code == 200, r.text
    assert server.engine.submitted[-1].adapter == "alpha@2.0.0"


async def test_a_bad_version_header_names_the_header(server: Server) -> None:
    before = len(server.engine.submitted)
    r = await server.client.post(
        "/v1/completions", json=BODY, headers={"x-adapter-version": "../etc"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "x-adapter-version"
    assert len(server.engine.submitted) == before


async def test_per_adapter_series_and_injected_faults(server: Server) -> None:
    server.engine.on_disk.add("alpha@2.0.0")
    r = await server.client.post(
        "/v1/admin/faults", json={"adapter": "alpha@2.0.0", "error_rate": 0.25}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"faults": {"alpha@2.0.0": 0.25}}
    codes = []
    for _ in range(20):
        r = await server.client.post(
            "/v1/completions", json=BODY, headers={"x-adapter-version": "2.0.0"}
        )
        codes.append(r.status_code)
        if r.status_code != 200:
            assert r.json()["error"]["code"] == "injected_fault"
    assert codes.count(500) == 5  # exactly the rate, deterministically
    assert codes.count(200) == 15
    for _ in range(3):  # another version of the same adapter is unaffected
        r = await server.client.post("/v1/completions", json=BODY)
        assert r.status_code == 200
    text = (await server.client.get("/metrics")).text
    got = parse_adapter_series(text, ["alpha@2.0.0", "alpha"])
    assert (got["alpha@2.0.0"].requests, got["alpha@2.0.0"].errors) == (20, 5)
    assert got["alpha@2.0.0"].ttft_count == 15
    assert (got["alpha"].requests, got["alpha"].errors) == (3, 0)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "adaptermesh_adapter_requests",
        "adaptermesh_adapter_time_to_first_token_seconds",
    } <= names
    r = await server.client.post(
        "/v1/admin/faults", json={"adapter": "alpha@2.0.0", "error_rate": 0}
    )
    assert r.json() == {"faults": {}}


async def test_fault_input_is_checked_and_needs_the_admin_token(start_server: StartServer) -> None:
    s = await start_server(admin_token="sekret")
    r = await s.client.post("/v1/admin/faults", json={"adapter": "a", "error_rate": 0.5})
    assert r.status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    for body, param in [
        ({"adapter": "", "error_rate": 0.5}, "adapter"),
        ({"adapter": "a", "error_rate": 1.5}, "error_rate"),
        ({"adapter": "a", "error_rate": "x"}, "error_rate"),
        ({"adapter": "a", "error_rate": True}, "error_rate"),
    ]:
        r = await s.client.post("/v1/admin/faults", json=body, headers=auth)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param
    r = await s.client.get("/v1/admin/faults", headers=auth)
    assert r.json() == {"faults": {}}
