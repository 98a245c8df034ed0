"""Adapter version splits: sticky, monotone in the share, binomially right; and the ext_proc
processor routing by the versioned name over a real gRPC channel."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.agent.extproc import (
    RULE_VERSION_HEADER,
    SHARD_METADATA_KEY,
    ExtProcConfig,
    ExtProcServer,
)
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.agent.splits import SESSION_HEADER, SplitTable, bucket
from adaptermesh.proto import assignment_pb2
from adaptermesh.rules import Evaluator, compile_rule_set, parse_rule_set


def assignment(
    share: int, stable: str = "1.2.0", canary: str = "2.0.0", rollout_id: str = "r1"
) -> assignment_pb2.Assignment:
    a = assignment_pb2.Assignment(version=1)
    a.adapter_splits.add(
        adapter="credit-risk",
        stable_version=stable,
        canary_version=canary,
        canary_share=share,
        rollout_id=rollout_id,
    )
    return a


def table(share: int, **kw: str) -> SplitTable:
    t = SplitTable()
    t.refresh(assignment(share, **kw))
    return t


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.text(max_size=40), min_size=1, max_size=50),
    a=st.integers(0, 10_000),
    b=st.integers(0, 10_000),
)
def test_sticky_and_monotone_in_the_share(keys: list[str], a: int, b: int) -> None:
    lo, hi = table(min(a, b)), table(max(a, b))
    for key in keys:
        first = lo.pick("credit-risk", key)
        assert first is not None
        assert lo.pick("credit-risk", key) == first  # same client, same share: same version
        if first.canary:  # a client on the new version stays there as the share grows
            pick = hi.pick("credit-risk", key)
            assert pick is not None
            assert pick.canary


@pytest.mark.parametrize("share", [0, 1, 500, 2500, 5000, 9999, 10_000])
def test_the_split_matches_the_share_within_binomial_error(share: int) -> None:
    t = table(share)
    n = 20_000
    hits = 0
    for i in range(n):
        pick = t.pick("credit-risk", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
        assert pick is not None
        hits += pick.canary
    p = share / 10_000
    assert abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_names_and_other_adapters() -> None:
    t = table(10_000)
    pick = t.pick("credit-risk", "k")
    assert pick is not None
    assert (pick.version, pick.served) == ("2.0.0", "credit-risk@2.0.0")
    assert t.pick("other", "k") is None
    t = table(0, stable="")
    pick = t.pick("credit-risk", "k")
    assert pick is not None
    assert (pick.version, pick.served, pick.canary) == ("", "credit-risk", False)


def test_each_rollout_draws_its_clients_afresh() -> None:
    keys = [f"s{i}" for i in range(2000)]
    one = {k for k in keys if bucket("r1", k) < 5000}
    two = {k for k in keys if bucket("r2", k) < 5000}
    assert one != two
    assert 0.4 < len(one & two) / len(one) < 0.6


# -- through the processor -------------------------------------------------------------------


@pytest.fixture
def processor() -> Iterator[tuple[ExtProcServer, ep_grpc.ExternalProcessorStub, list]]:
    holder: list[assignment_pb2.Assignment | None] = [assignment(5000)]
    server = ExtProcServer(
        EndpointBook(), ExtProcConfig(base_model="base"), assignment=lambda: holder[0]
    )
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, ep_grpc.ExternalProcessorStub(channel), holder
    finally:
        channel.close()
        server.stop()


def _headers(
    stub: ep_grpc.ExternalProcessorStub, headers: dict[str, str], model: str
) -> dict[str, str]:
    hdrs = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        )
    )
    body = json.dumps({"model": model, "prompt": "x"}).encode()
    msgs = [
        ep.ProcessingRequest(request_headers=hdrs),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    ]
    out = list(stub.Process(iter(msgs), metadata=[(SHARD_METADATA_KEY, "s0")], timeout=10))
    mutation = out[-1].request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_the_processor_routes_by_the_versioned_name(processor) -> None:  # type: ignore[no-untyped-def]
    server, stub, holder = processor
    seen = {}
    for i in range(200):
        got = _headers(stub, {SESSION_HEADER: f"s{i}"}, "credit-risk")
        version = got[RULE_VERSION_HEADER]
        assert got["x-adapter-id"] == f"credit-risk@{version}"
        seen[f"s{i}"] = version
    assert set(seen.values()) == {"1.2.0", "2.0.0"}
    # The session decides, and keeps deciding the same way.
    for key in list(seen)[:20]:
        assert (
            _headers(stub, {SESSION_HEADER: key}, "credit-risk")[RULE_VERSION_HEADER] == seen[key]
        )
    # Other adapters and the base model are left alone.
    assert RULE_VERSION_HEADER not in _headers(stub, {}, "ops-sum")
    assert RULE_VERSION_HEADER not in _headers(stub, {}, "base")
    # A new Assignment applies to the very next request.
    holder[0] = assignment(10_000)
    assert all(
        _headers(stub, {SESSION_HEADER: k}, "credit-risk")[RULE_VERSION_HEADER] == "2.0.0"
        for k in list(seen)[:20]
    )
    holder[0] = None
    assert RULE_VERSION_HEADER not in _headers(stub, {}, "credit-risk")
    # An operator's adapter_version rule beats the split.
    holder[0] = assignment(10_000)
    server.set_rules(
        Evaluator(
            compile_rule_set(
                parse_rule_set(
                    {
                        "rules": [
                            {
                                "name": "acme-old",
                                "when": 'request.tenant == "acme"',
                                "adapter_version": "1.0.0",
                            }
                        ]
                    }
                )
            )
        )
    )
    got = _headers(stub, {"x-tenant-id": "acme"}, "credit-risk")
    assert (got[RULE_VERSION_HEADER], got["x-adapter-id"]) == ("1.0.0", "credit-risk@1.0.0")
