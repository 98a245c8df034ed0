"""The audit of writes (issue 46): every write the operator guide shows leaves a row naming its
caller; rows hold the state before and after; the store stays bounded under a write loop."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app
from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.audit import MAX_STATE_BYTES
from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import control_plane_pb2 as cp_pb2

from .conftest import RO_TOKEN, RW_TOKEN, Harness, StaticSource, shard, write_tokens

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"

# adapterctl's commands by what they call: each write and the method it calls, and the reads.
WRITES = {
    "apply": "Apply",
    "shard upsert": "UpsertShard",
    "shard delete": "DeleteShard",
    "override set": "SetOverride",
    "override clear": "ClearOverride",
    "pin": "PinTenant",
    "unpin": "UnpinTenant",
    "rules apply": "ApplyRules",
    "rollout start": "StartRollout",
    "rollout pause": "ControlRollout",
    "rollout resume": "ControlRollout",
    "rollout promote": "ControlRollout",
    "rollout abort": "ControlRollout",
}
READS = {
    "shards",
    "status",
    "history",
    "get",
    "watch",
    "override list",
    "rules list",
    "rules get",
    "rollout status",
    "rollout history",
}
_GROUPS = {"shard", "override", "rules", "rollout"}
_ROLLOUT_VERBS = {"start", "status", "history", "pause", "resume", "promote", "abort"}


def guide_commands() -> list[str]:
    """The adapterctl commands the operator guide shows (``shard upsert``, ``rollout start``)."""
    found: list[str] = []
    in_block = False
    for line in GUIDE.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        text = line.strip().removeprefix("$ ")
        if not in_block and "`adapterctl " in line:
            found += [m.group(1) for m in re.finditer(r"`(adapterctl [^`]+)`", line)]
            continue
        if in_block and text.startswith("adapterctl "):
            found.append(text)
    out = []
    for command in found:
        words = [w for w in shlex.split(command.split("#", 1)[0].rstrip("\\ "))[1:]]
        words = [w for w in words if not w.startswith("-")][:2] or ["--help"]
        if words[0] == "rollout" and len(words) > 1 and words[1] not in _ROLLOUT_VERBS:
            words = ["rollout", "start"]
        name = " ".join(words[:2]) if words[0] in _GROUPS and len(words) > 1 else words[0]
        out.append(name)
    return out


def test_the_guide_shows_only_commands_this_test_knows() -> None:
    shown = set(guide_commands())
    assert shown - {"--help"} <= set(WRITES) | READS, shown - set(WRITES) - READS
    # The guide's writes, as the scenario below covers them.
    assert {"apply", "override set", "pin", "rules apply", "rollout start"} <= shown


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("cp")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adaptermesh.control_plane.cli",
            "--state-dir",
            str(tmp / "state"),
            "--listen",
            "127.0.0.1:0",
            "--tokens-file",
            str(write_tokens(tmp / "tokens")),
            "--no-rebalance",
            "--synchronous",
            "NORMAL",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    try:
        assert line.startswith("listening on"), line
        yield line.split()[-1]
    finally:
        p.terminate()
        p.wait(10)
        p.stdout.close()


MANIFEST = """\
kind: Shard
metadata: {name: s0}
spec:
  endpoints: [{address: 10.0.5.1, port: 8000}]
  steer: {tunnel: {remoteIpv4: 192.0.2.5, vni: 5}}
---
kind: Shard
metadata: {name: s1}
spec:
  endpoints: [{address: 10.0.6.1, port: 8000}]
  steer: {mark: 6}
---
kind: AdapterInstance
metadata: {name: support}
spec:
  modelRef: {baseModel: tiny-llama, adapterPath: /adapters/support}
"""
RULES = """\
rules:
  - name: gold
    when: 'request.headers["x-tier"] == "gold"'
    shard: s0
"""


def adapterctl(server: str, *args: str, token: str | None = RW_TOKEN) -> tuple[int, str]:
    env = {"ADAPTERMESH_SERVER": server, "COLUMNS": "200"}
    if token:
        env["ADAPTERMESH_TOKEN"] = token
    r = CliRunner().invoke(app, list(args), env=env)
    return r.exit_code, r.output


def newest_audit(server: str) -> dict[str, object]:
    code, out = adapterctl(
        server, "history", "--audit", "--limit", "1", "-o", "json", token=RO_TOKEN
    )
    assert code == 0, out
    rows = json.loads(out)
    assert len(rows) == 1
    return rows[0]


@pytest.mark.slow
def test_every_write_in_the_guide_leaves_an_audit_row_naming_its_caller(
    server: str, tmp_path: Path
) -> None:
    (tmp_path / "mesh.yaml").write_text(MANIFEST)
    (tmp_path / "rules.yaml").write_text(RULES)
    # One call per write command, in an order each one can run in (rollouts may be refused by
    # their own preconditions: refused calls are audited just the same).
    steps: list[tuple[str, list[str], bool]] = [
        ("apply", ["apply", "-f", str(tmp_path / "mesh.yaml")], True),
        ("shard upsert", ["shard", "upsert", "s2", "-e", "10.0.7.1:8000", "--mark", "7"], True),
        ("override set", ["override", "set", "s0", "60%", "--reason", "canary s0"], True),
        ("override clear", ["override", "clear", "s0"], True),
        ("pin", ["pin", "10.77.0.16/32", "s1"], True),
        ("unpin", ["unpin", "10.77.0.16/32"], True),
        ("shard delete", ["shard", "delete", "s2"], True),
        (
            "rules apply",
            ["rules", "apply", "-f", str(tmp_path / "rules.yaml"), "--reason", "r"],
            True,
        ),
        (
            "rollout start",
            ["rollout", "support", "--to", "2.0.0", "--steps", "50,100", "--interval", "1m"],
            False,
        ),
        ("rollout pause", ["rollout", "pause", "support"], False),
        ("rollout resume", ["rollout", "resume", "support"], False),
        ("rollout promote", ["rollout", "promote", "support"], False),
        ("rollout abort", ["rollout", "abort", "support"], False),
    ]
    assert {name for name, _, _ in steps} == set(WRITES)
    assert set(guide_commands()) & set(WRITES) <= {name for name, _, _ in steps}
    seen = 0
    for name, args, must_succeed in steps:
        code, out = adapterctl(server, *args)
        if must_succeed:
            assert code == 0, (name, out)
        row = newest_audit(server)
        assert row["method"] == WRITES[name], (name, row)
        assert row["caller"] == "token:operator", row
        assert row["outcome"] == ("OK" if code == 0 else row["outcome"]) != "", row
        assert isinstance(row["seq"], int)
        assert row["seq"] > seen
        seen = row["seq"]
    # The override's row says what it changed.
    code, out = adapterctl(server, "history", "--audit", "--limit", "50", "-o", "json")
    rows = json.loads(out)
    override = next(r for r in rows if r["method"] == "SetOverride")
    assert override["before"] == {"override/s0": None}
    assert override["after"]["override/s0"]["weight"] == 6000
    # Refused writes are audited too: by their caller, or as unauthenticated.
    code, _ = adapterctl(server, "override", "set", "nope", "10%")
    assert code != 0
    row = newest_audit(server)
    assert (row["method"], row["caller"], row["outcome"]) == (
        "SetOverride",
        "token:operator",
        "NOT_FOUND",
    )
    code, _ = adapterctl(server, "pin", "10.1.0.0/16", "s0", token=RO_TOKEN)
    assert code != 0
    row = newest_audit(server)
    assert (row["method"], row["caller"], row["outcome"]) == (
        "PinTenant",
        "token:viewer",
        "PERMISSION_DENIED",
    )
    code, _ = adapterctl(server, "pin", "10.1.0.0/16", "s0", token="not-a-token-0123456789")
    assert code != 0
    row = newest_audit(server)
    assert row["outcome"] == "UNAUTHENTICATED"
    assert str(row["caller"]).startswith("unknown-token:")
    code, out = adapterctl(server, "history", "--audit", "--limit", "3")
    assert code == 0
    assert "UNAUTHENTICATED" in out
    assert "token:viewer" in out


async def test_audit_rows_hold_the_state_before_and_after(cp: Harness) -> None:
    await cp.stub.UpsertShard(
        cp_pb2.UpsertShardRequest(shard=shard("s0", ("10.0.0.1", 8000))), metadata=cp.md
    )
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.8.0.0/16", shard_id="s0"), metadata=cp.md
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await cp.stub.DeleteShard(cp_pb2.DeleteShardRequest(id="s0"), metadata=cp.md)
    rows = (await cp.stub.ListAudit(cp_pb2.ListAuditRequest(limit=10), metadata=cp.md)).records
    assert [(r.method, r.outcome) for r in rows] == [
        ("DeleteShard", "FAILED_PRECONDITION"),
        ("PinTenant", "OK"),
        ("UpsertShard", "OK"),
    ]
    delete, pin, upsert = rows
    assert json.loads(pin.before_json) == {"pin/10.8.0.0/16": None}
    assert json.loads(pin.after_json) == {"pin/10.8.0.0/16": "s0"}
    assert json.loads(upsert.before_json)["shard/s0"] is None
    assert json.loads(upsert.after_json)["shard/s0"]["id"] == "s0"
    assert delete.before_json == delete.after_json  # refused: nothing changed
    assert "still has pins" in delete.message
    assert {r.caller for r in rows} == {"token:operator"}
    assert rows[0].at.ToSeconds() == int(cp.clock.time())
    # Paging backwards, and the limit's field named.
    older = await cp.stub.ListAudit(cp_pb2.ListAuditRequest(before_seq=rows[0].seq), metadata=cp.md)
    assert [r.seq for r in older.records] == [rows[1].seq, rows[2].seq]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.ListAudit(cp_pb2.ListAuditRequest(limit=5000), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("limit: ")


@pytest.fixture
async def small_audit(tmp_path: Path) -> AsyncIterator[Harness]:
    clock = FakeClock()
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(write_tokens(tmp_path / "tokens")),
        rebalance=False,
        synchronous="NORMAL",
        audit_limit=25,
    )
    source = StaticSource()
    server = ControlPlaneServer(config, source=source, clock=clock)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Harness(server, channel, source, clock)
    finally:
        await channel.close()
        await server.stop(0)


async def test_the_audit_store_stays_bounded_under_a_write_loop(small_audit: Harness) -> None:
    cp = small_audit
    for i in range(2):
        s = shard(f"s{i}", (f"10.0.{i}.1", 8000))
        await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=s), metadata=cp.md)
    # Writes that pass, writes that are refused, and calls with no credential, in a loop; and
    # Applies whose state is far above a row's bound.
    big = cp_pb2.ApplyRequest(reason="big")
    for i in range(200):
        s = big.shards.add()
        s.CopyFrom(shard(f"b{i}", (f"10.1.{i}.1", 8000)))
        s.labels["note"] = "x" * 200
    for i in range(150):
        if i % 3 == 0:
            await cp.stub.SetOverride(
                cp_pb2.SetOverrideRequest(shard_id="s0", weight=100 + i % 40), metadata=cp.md
            )
        elif i % 3 == 1:
            with pytest.raises(grpc.aio.AioRpcError):
                await cp.stub.ClearOverride(
                    cp_pb2.ClearOverrideRequest(shard_id="s1"), metadata=cp.md
                )
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await cp.stub.UnpinTenant(cp_pb2.UnpinTenantRequest(cidr="10.0.0.0/8"))
        if i % 50 == 0:
            await cp.stub.Apply(big, metadata=cp.md)
    big.shards[0].labels["note"] = "changed"
    await cp.stub.Apply(big, metadata=cp.md)
    store = cp.server.store
    assert store.audit_count() == 25
    rows = store.audit(1000)
    seqs = [r.seq for r in rows]
    total = 2 + 150 + 3 + 1
    assert seqs == list(range(total, total - 25, -1))  # the newest, none lost in between
    assert all(len(r.before) <= MAX_STATE_BYTES and len(r.after) <= MAX_STATE_BYTES for r in rows)
    listed = await cp.stub.ListAudit(cp_pb2.ListAuditRequest(limit=1000), metadata=cp.md)
    assert [r.seq for r in listed.records] == seqs
    # A state too large for a row keeps its size and digest.
    assert rows[0].method == "Apply"
    after = json.loads(rows[0].after)
    assert after["truncated"] is True
    assert after["bytes"] > MAX_STATE_BYTES


def test_the_audit_rows_survive_a_restart(tmp_path: Path) -> None:
    from adaptermesh.control_plane.store import AuditRow, Store

    store = Store(tmp_path / "db", audit_limit=3)
    for i in range(5):
        store.append_audit(
            AuditRow(0, float(i), f"token:t{i}", "SetOverride", "OK", "", "{}", "{}")
        )
    store.close()
    again = Store(tmp_path / "db", audit_limit=3)
    assert [r.caller for r in again.audit(10)] == ["token:t4", "token:t3", "token:t2"]
    again.close()
