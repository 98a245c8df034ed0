"""The routing-rule RPCs: apply (write scope), get, list; a bad rule is refused with
INVALID_ARGUMENT naming the rule and the position, and the live set stays as it was."""

from __future__ import annotations

import json

import grpc
import pytest

from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2 as cp_pb2

from .conftest import RO_TOKEN, Harness, creds

GOLD = {
    "rules": [
        {
            "name": "gold-fin",
            "when": 'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")',
            "shard": "gold",
        }
    ]
}


async def test_apply_get_list_and_refuse(cp: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.GetRules(cp_pb2.GetRulesRequest(), metadata=cp.md)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    out = await cp.stub.ApplyRules(
        cp_pb2.ApplyRulesRequest(document_json=json.dumps(GOLD), reason="gold tier"), metadata=cp.md
    )
    assert out.rule_set.version == 1
    assert out.rule_set.rules == 1
    assert not out.unchanged
    again = await cp.stub.ApplyRules(
        cp_pb2.ApplyRulesRequest(document_json=json.dumps(GOLD), reason="again"), metadata=cp.md
    )
    assert again.unchanged

    bad = {
        "rules": [*GOLD["rules"], {"name": "typo", "when": 'adapter.startWith("x")', "shard": "a"}]
    }
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.ApplyRules(
            cp_pb2.ApplyRulesRequest(document_json=json.dumps(bad), reason="oops"), metadata=cp.md
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rule 'typo' at 1:9" in (info.value.details() or "")
    assert "unknown function 'startWith'" in (info.value.details() or "")

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.ApplyRules(
            cp_pb2.ApplyRulesRequest(document_json="{", reason="x"), metadata=cp.md
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    live = await cp.stub.GetRules(cp_pb2.GetRulesRequest(), metadata=cp.md)
    assert live.version == 1
    assert json.loads(live.document_json)["rules"] == GOLD["rules"]
    listed = await cp.stub.ListRules(cp_pb2.ListRulesRequest(), metadata=cp.md)
    assert [r.version for r in listed.rule_sets] == [1]
    assert listed.rule_sets[0].reason == "gold tier"
    assert listed.rule_sets[0].rules == 1
    assert listed.rule_sets[0].document_json == ""  # a listing; GetRules reads the document


async def test_apply_needs_the_write_scope(cp: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp.stub.ApplyRules(
            cp_pb2.ApplyRulesRequest(document_json=json.dumps(GOLD), reason="r"),
            metadata=creds(RO_TOKEN),
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    listed = await cp.stub.ListRules(cp_pb2.ListRulesRequest(), metadata=creds(RO_TOKEN))
    assert list(listed.rule_sets) == []


async def test_listing_many_large_sets_stays_small(cp: Harness) -> None:
    """Twenty versions of a 1,000-rule set (about 1.4 MB each): the listing carries none of
    the documents, so it fits a client's default 4 MiB limit and the control plane builds no
    28 MB reply; each version is still read whole with GetRules."""
    for n in range(20):
        doc = {
            "rules": [
                {"name": f"r{i}", "when": f'adapter == "{"a" * 1300}{n}-{i}"', "shard": "s"}
                for i in range(1000)
            ]
        }
        await cp.stub.ApplyRules(
            cp_pb2.ApplyRulesRequest(document_json=json.dumps(doc), reason=f"v{n}"),
            metadata=cp.md,
        )
    listed = await cp.stub.ListRules(cp_pb2.ListRulesRequest(limit=1000), metadata=cp.md)
    assert [r.version for r in listed.rule_sets] == list(range(20, 0, -1))
    assert all(r.rules == 1000 and not r.document_json for r in listed.rule_sets)
    assert listed.ByteSize() < 4096
    first = await cp.stub.GetRules(cp_pb2.GetRulesRequest(version=1), metadata=cp.md)
    assert len(json.loads(first.document_json)["rules"]) == 1000
