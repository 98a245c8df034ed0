"""Errors never echo a huge input: every refusal that quotes client input quotes a bounded
prefix and the length (``assignment_rules.quote``), and every message that leaves a process is
cut (``assignment_rules.bounded_message``).

Without that, a megabyte shard id or CIDR came back whole in the gRPC status, which travels in
the trailing metadata: the client then saw ``RESOURCE_EXHAUSTED: received metadata size
exceeds hard limit`` instead of the INVALID_ARGUMENT meant for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_service.fakes import FakeEngine

from adaptermesh.assignment_rules import (
    MAX_ERROR_MESSAGE,
    MAX_QUOTED,
    RuleError,
    bounded_message,
    check_shard_id,
    normalise_cidr,
    quote,
)
from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import assignment_pb2, control_plane_pb2, control_plane_pb2_grpc
from adaptermesh.rules import RuleError as RoutingRuleError
from adaptermesh.rules import parse_rule_set
from adaptermesh.worker.http_errors import ENGINE_FIELD_TO_PARAM
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

CP = control_plane_pb2
TOKEN = "echo-token-0123456789abcdef"
MD = [("authorization", f"Bearer {TOKEN}")]
# A refusal's message, UTF-8, whatever the input: well under gRPC's 8 KiB metadata limit.
LIMIT = 1024

# Pieces a hostile string is made of: plain, multi-byte, non-printable, separators, a
# right-to-left override. A long string repeats one; 4-byte pieces stay under the 4 MiB
# request limit (a request over it is refused by the transport, which is not this test's).
PIECES = ["a", "Z9", "é", "\x00", "%", "/", " ", "🙂", "\u202e", "\n", "..", "@", "-"]
# Drawn as (piece, count) so that a failing example prints short; ``_grow`` builds the string.
huge = st.tuples(st.sampled_from(PIECES), st.integers(5000, 800_000))


def _grow(drawn: tuple[str, int]) -> str:
    piece, count = drawn
    return piece * count


SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- the helper ------------------------------------------------------------------------------


@given(st.text(max_size=200) | huge.map(_grow))
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_quote_is_bounded_and_keeps_short_values_whole(value: str) -> None:
    quoted = quote(value)
    if len(value) <= MAX_QUOTED:
        assert quoted == repr(value)
    else:
        head = repr(value[:MAX_QUOTED])
        assert quoted == f"{head[:-1]}…{head[-1]} ({len(value)} characters)"
    assert len(quoted) <= 10 * MAX_QUOTED + 40


def test_quote_words_it_as_documented() -> None:
    assert quote("a" * 1_048_576) == repr("a" * 64)[:-1] + "…' (1048576 characters)"


@given(st.text(max_size=3000))
@settings(max_examples=60, deadline=None)
def test_bounded_message_is_a_prefix_within_the_limit(text: str) -> None:
    out = bounded_message(text)
    assert len(out.encode("utf-8", "surrogatepass")) <= MAX_ERROR_MESSAGE
    if out != text:
        head = out.rsplit("… (", 1)[0]
        assert text.startswith(head)


@given(huge)
@SETTINGS
def test_rule_errors_quote_a_bounded_prefix(drawn: tuple[str, int]) -> None:
    value = _grow(drawn)
    for check in (
        lambda: check_shard_id(value, "shard.id"),
        lambda: normalise_cidr(value, "cidr"),
    ):
        with pytest.raises(RuleError) as err:
            check()
        assert len(str(err.value).encode()) < LIMIT
    rule_set = {"rules": [{"name": "r", "when": value, "then": {"shard": "s0"}}]}
    with pytest.raises(RoutingRuleError) as rerr:
        parse_rule_set(rule_set)
    assert len(str(rerr.value).encode()) < LIMIT


# -- the control plane -----------------------------------------------------------------------


def _shard(sid: str) -> assignment_pb2.Shard:
    shard = assignment_pb2.Shard(id=sid)
    shard.endpoints.add(address="10.0.0.1", port=8000)
    shard.steer.tunnel.remote_ipv4 = "192.0.2.10"
    shard.steer.tunnel.vni = 100
    return shard


def _instance(**fields: Any) -> CP.AdapterInstance:
    inst = CP.AdapterInstance(
        name=fields.pop("name", "inst"), model_ref=CP.ModelRef(base_model="m")
    )
    for scope in fields.pop("scopes", ()):
        inst.security.scopes.append(scope)
    for path in fields.pop("paths", ()):
        inst.routes.add(path=path)
    return inst


def _rules(name: str = "r", when: str = "true") -> str:
    return json.dumps({"rules": [{"name": name, "when": when, "then": {"shard": "s0"}}]})


def _spec(adapter: str) -> CP.RolloutSpec:
    return CP.RolloutSpec(
        adapter=adapter, to_version="2.0.0", steps_percent=[50, 100], interval_seconds=60
    )


# (method, the field the refusal names, request built around the hostile value)
WRITES: list[tuple[str, str, Callable[[str], Any]]] = [
    ("UpsertShard", "shard", lambda v: CP.UpsertShardRequest(shard=_shard(v))),
    (
        "UpsertShard",
        "shard",
        lambda v: CP.UpsertShardRequest(
            shard=assignment_pb2.Shard(
                id="s9", endpoints=[assignment_pb2.Endpoint(address=v, port=1)]
            )
        ),
    ),
    ("DeleteShard", "id", lambda v: CP.DeleteShardRequest(id=v)),
    ("SetOverride", "shard_id", lambda v: CP.SetOverrideRequest(shard_id=v, weight=100)),
    (
        "SetOverride",
        "reason",
        lambda v: CP.SetOverrideRequest(shard_id="s0", weight=100, reason=v),
    ),
    ("ClearOverride", "shard_id", lambda v: CP.ClearOverrideRequest(shard_id=v)),
    ("PinTenant", "cidr", lambda v: CP.PinTenantRequest(cidr=v, shard_id="s0")),
    (
        "PinTenant",
        "shard_id",
        lambda v: CP.PinTenantRequest(cidr="192.0.2.0/24", shard_id=v),
    ),
    ("UnpinTenant", "cidr", lambda v: CP.UnpinTenantRequest(cidr=v)),
    (
        "UpsertAdapterInstance",
        "instance.name",
        lambda v: CP.UpsertAdapterInstanceRequest(instance=_instance(name=v)),
    ),
    (
        "UpsertAdapterInstance",
        "instance.security.scopes[0]",
        lambda v: CP.UpsertAdapterInstanceRequest(instance=_instance(scopes=[v])),
    ),
    (
        "UpsertAdapterInstance",
        "instance.routes[0].path",
        lambda v: CP.UpsertAdapterInstanceRequest(instance=_instance(paths=[v])),
    ),
    ("DeleteAdapterInstance", "name", lambda v: CP.DeleteAdapterInstanceRequest(name=v)),
    ("ApplyRules", "reason", lambda v: CP.ApplyRulesRequest(document_json=_rules(), reason=v)),
    ("ApplyRules", "document_json", lambda v: CP.ApplyRulesRequest(document_json=_rules(when=v))),
    ("ApplyRules", "document_json", lambda v: CP.ApplyRulesRequest(document_json=_rules(name=v))),
    ("StartRollout", "spec.adapter", lambda v: CP.StartRolloutRequest(spec=_spec(v))),
    (
        "ControlRollout",
        "adapter",
        lambda v: CP.ControlRolloutRequest(adapter=v, action="pause"),
    ),
    (
        "ControlRollout",
        "action",
        lambda v: CP.ControlRolloutRequest(adapter="credit-risk", action=v),
    ),
    ("ReportLoad", "node_id", lambda v: CP.LoadReport(node_id=v)),
    ("ReportLoad", "apply_error", lambda v: CP.LoadReport(node_id="n1", apply_error=v)),
]


def _state(stub: Any) -> tuple[bytes, ...]:
    return tuple(
        reply.SerializeToString(deterministic=True)
        for reply in (
            stub.ListShards(CP.ListShardsRequest(), metadata=MD),
            stub.ListPins(CP.ListPinsRequest(), metadata=MD),
            stub.ListOverrides(CP.ListOverridesRequest(), metadata=MD),
            stub.ListAdapterInstances(CP.ListAdapterInstancesRequest(), metadata=MD),
            stub.ListRules(CP.ListRulesRequest(), metadata=MD),
            stub.ListRollouts(CP.ListRolloutsRequest(history=True), metadata=MD),
            CP.StatusResponse(nodes=stub.GetStatus(CP.GetStatusRequest(), metadata=MD).nodes),
        )
    )


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[int]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} read,write,rollout,report operator nodes=*\n")
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(tokens),
        rebalance=False,
        synchronous="NORMAL",
    )

    class Idle:
        async def collect(self, targets: Any, now: float) -> dict[str, Any]:
            return {}

    server = ControlPlaneServer(config, source=Idle(), clock=FakeClock())
    port = await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


@pytest.mark.slow
async def test_every_write_refuses_a_huge_value_briefly_naming_its_field(
    control_plane: int,
) -> None:
    def body() -> None:
        # The client's default metadata limit: the one the huge echo used to exceed.
        with grpc.insecure_channel(f"127.0.0.1:{control_plane}") as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
            stub.UpsertShard(CP.UpsertShardRequest(shard=_shard("s0")), metadata=MD)
            stub.ReportLoad(CP.LoadReport(node_id="n1"), metadata=MD)

            @SETTINGS
            @given(write=st.sampled_from(WRITES), drawn=huge)
            def prop(write: tuple[str, str, Callable[[str], Any]], drawn: tuple[str, int]) -> None:
                method, field, build = write
                value = _grow(drawn)
                seen.append(method)
                before = _state(stub)
                call = channel.unary_unary(f"/adaptermesh.v1.ControlPlane/{method}")
                with pytest.raises(grpc.RpcError) as err:
                    call(build(value).SerializeToString(), metadata=MD, timeout=30)
                code, details = err.value.code(), err.value.details() or ""
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, field, code, details)
                assert details.startswith(field), (method, field, details[:200])
                assert len(details.encode()) < LIMIT, (method, field, len(details.encode()))
                assert _state(stub) == before, (method, field)

            seen: list[str] = []
            prop()
            assert len(seen) >= 40
            # Each write once with the longest value the transport takes of one-byte pieces.
            for method, field, build in WRITES:
                call = channel.unary_unary(f"/adaptermesh.v1.ControlPlane/{method}")
                with pytest.raises(grpc.RpcError) as err:
                    call(build("x" * 1_048_576).SerializeToString(), metadata=MD, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field)
                assert len((err.value.details() or "").encode()) < LIMIT

    await asyncio.to_thread(body)


# -- the worker ------------------------------------------------------------------------------


@pytest.fixture
async def worker() -> AsyncIterator[httpx.AsyncClient]:
    service = WorkerService(FakeEngine(), ServiceConfig())
    runner, port = await serve(service, "127.0.0.1", 0)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        yield client
    finally:
        await client.aclose()
        await runner.cleanup()


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}


# (path, the param the error names (None: any), body built around the hostile value, whether
# a short value is refused too: a short model or adapter name is looked up and not found)
HTTP_INPUTS: list[tuple[str, str | None, Callable[[str], dict[str, Any]], bool]] = [
    ("/v1/completions", "model", lambda v: _completion(model=v), True),
    (
        "/v1/chat/completions",
        "model",
        lambda v: {"model": v, "messages": [{"role": "user", "content": "hi"}]},
        True,
    ),
    ("/v1/completions", "stop", lambda v: _completion(stop=v), False),
    ("/v1/completions", "stop", lambda v: _completion(stop=["a", v]), False),
    ("/v1/completions", None, lambda v: {**_completion(), v: 1}, True),
    ("/v1/completions", "user", lambda v: _completion(user=[v]), True),
    (
        "/v1/load_lora_adapter",
        "lora_name",
        lambda v: {"lora_name": v, "lora_path": "ok"},
        False,
    ),
    (
        "/v1/load_lora_adapter",
        "lora_path",
        lambda v: {"lora_name": "x", "lora_path": v},
        True,
    ),
    ("/v1/unload_lora_adapter", "lora_name", lambda v: {"lora_name": v}, True),
]


@pytest.mark.slow
@given(data=st.data())
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
async def test_worker_errors_are_short_json_naming_the_field(
    worker: httpx.AsyncClient, data: st.DataObject
) -> None:
    path, param, build, short_refused = data.draw(st.sampled_from(HTTP_INPUTS))
    # Up to 255 characters a name passes the length check and reaches the lookup (a 404 that
    # names it); beyond, the length check refuses it.
    longer = st.integers(300, 200_000)
    count = st.integers(1, 255) | longer if short_refused else longer
    value = _grow(data.draw(st.tuples(st.sampled_from(PIECES), count)))
    response = await worker.post(path, json=build(value))
    assert 400 <= response.status_code < 500, (path, param, response.status_code)
    assert len(response.content) < LIMIT, (path, param, len(response.content))
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, (path, error)
        # The message leads with the field, in the engine's name for it where that differs.
        named = error["message"].split(":", 1)[0]
        assert named in (param, *(k for k, v in ENGINE_FIELD_TO_PARAM.items() if v == param))
    else:
        assert error["code"] == "unknown_field"


def test_an_adapter_error_carries_a_bounded_prefix_of_a_long_name() -> None:
    from adaptermesh.worker.types import AdapterNotFoundError

    err = AdapterNotFoundError("a" * 100_000)
    assert len(str(err)) < 200
    assert "(100000 characters)" in str(err)
    assert err.name == "a" * 100_000  # the full name stays on the error for the code
    assert str(AdapterNotFoundError("alpha")) == "alpha: adapter not found"
