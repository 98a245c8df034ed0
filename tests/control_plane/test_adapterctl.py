"""adapterctl against a control plane subprocess on an ephemeral 127.0.0.1 port."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app, parse_weight

from .conftest import RO_TOKEN, RW_TOKEN, write_tokens

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A control plane of the test's own: no test sees what another one stored."""
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
            "--interval",
            "0.5",
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


def run(server: str, *args: str, token: str | None = RW_TOKEN, input: str | None = None):
    env = {"ADAPTERMESH_SERVER": server, "COLUMNS": "200"}
    if token:
        env["ADAPTERMESH_TOKEN"] = token
    return CliRunner().invoke(app, list(args), env=env, input=input)


MANIFEST = """\
kind: Shard
metadata: {name: web}
spec:
  endpoints: [{address: 10.0.5.1, port: 8000}, "10.0.5.2:8000"]
  steer: {tunnel: {remoteIpv4: 192.0.2.5, vni: 5}}
---
kind: Shard
metadata: {name: batch, labels: {tier: low}}
spec:
  endpoints: [{address: 10.0.6.1, port: 8000}]
  steer: {mark: 6}
---
kind: AdapterInstance
metadata: {name: support-bot}
spec:
  modelRef: {baseModel: tiny-llama, adapterPath: /adapters/support}
  routes: [{shard: web, weight: 2}, {shard: batch}]
  security: {scopes: [tenant-a], allowedCIDRs: [10.8.0.0/16]}
---
kind: Pin
spec: {cidr: 10.8.0.0/16, shard: web}
---
kind: Override
spec: {shard: batch, weight: 1000, reason: cheap tier}
"""


def test_shard_pin_override_status_history(server: str) -> None:
    r = run(
        server,
        "shard",
        "upsert",
        "alpha",
        "-e",
        "10.0.1.1:8000",
        "-e",
        "10.0.1.2:8000",
        "--tunnel",
        "192.0.2.1",
        "--vni",
        "7",
    )
    assert r.exit_code == 0, r.output
    assert "index" in r.output
    assert (
        run(server, "shard", "upsert", "beta", "-e", "10.0.2.1:8000", "--mark", "2").exit_code == 0
    )
    r = run(server, "shards")
    assert "alpha" in r.output
    assert "beta" in r.output
    assert run(server, "pin", "10.20.0.0/16", "alpha").exit_code == 0
    r = run(server, "pin", "10.20.0.0/16", "beta")
    assert r.exit_code == 4
    assert "ALREADY_EXISTS" in r.output
    r = run(server, "override", "set", "beta", "30%", "--ttl", "600", "--reason", "drill")
    assert r.exit_code == 0, r.output
    r = run(server, "status")
    assert r.exit_code == 0
    assert "30.00%" in r.output
    assert "70.00%" in r.output
    r = run(server, "history", "--limit", "3")
    assert "drill" in r.output
    assert run(server, "override", "clear", "beta").exit_code == 0
    assert run(server, "unpin", "10.20.0.0/16").exit_code == 0


@pytest.mark.parametrize("weight", ["-5", "nan", "inf", "-inf", "1e9", "12.5", "abc"])
def test_bad_weights_are_rejected_before_sending(server: str, weight: str) -> None:
    r = run(server, "override", "set", "alpha", "--", weight)
    assert r.exit_code == 2, r.output
    assert "weight" in r.output


def test_error_exit_codes(server: str, tmp_path: Path) -> None:
    r = run(server, "override", "set", "nope", "100")
    assert r.exit_code == 3
    assert "shard_id" in r.output
    r = run(server, "pin", "10.0.0.1/8", "alpha")
    assert r.exit_code == 2
    assert "cidr" in r.output
    r = run(server, "shards", token=None)
    assert r.exit_code == 5
    assert "UNAUTHENTICATED" in r.output
    r = run(server, "shard", "delete", "alpha", token=RO_TOKEN)
    assert r.exit_code == 5
    assert "PERMISSION_DENIED" in r.output
    r = run("127.0.0.1:1", "--timeout", "1", "shards")
    assert r.exit_code == 6
    token_file = tmp_path / "tok"
    token_file.write_text(RW_TOKEN + "\n")
    r = CliRunner().invoke(app, ["--server", server, "--token-file", str(token_file), "shards"])
    assert r.exit_code == 0, r.output


def test_apply_is_idempotent_prints_a_diff_and_round_trips(server: str, tmp_path: Path) -> None:
    f = tmp_path / "mesh.yaml"
    f.write_text(MANIFEST)
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 0, r.output
    assert "+ Shard/web create" in r.output
    assert "5 change(s) applied" in r.output
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 0
    assert "0 change(s) applied, 5 unchanged" in r.output
    f.write_text(MANIFEST.replace("vni: 5", "vni: 9").replace("shard: web}", "shard: batch}"))
    r = run(server, "apply", "-f", str(f), "--dry-run")
    assert "~ Shard/web update" in r.output
    assert "vni" in r.output
    assert "nothing sent" in r.output
    assert "~ Pin/10.8.0.0/16 update" in r.output
    r = run(server, "apply", "-f", str(f))
    assert "2 change(s) applied" in r.output
    r = run(server, "get", "all", "-o", "yaml")
    docs = list(yaml.safe_load_all(r.output))
    inst = next(d for d in docs if d["kind"] == "AdapterInstance")
    assert inst["spec"]["modelRef"]["baseModel"] == "tiny-llama"
    assert inst["spec"]["security"]["scopes"] == ["tenant-a"]
    # What get prints, apply accepts, and it changes nothing.
    (tmp_path / "back.yaml").write_text(r.output)
    r2 = run(server, "apply", "-f", str(tmp_path / "back.yaml"))
    assert r2.exit_code == 0, r2.output
    assert "0 change(s) applied" in r2.output, r2.output
    j = json.loads(run(server, "get", "assignment", "-o", "json").output)
    assert (
        sum(s.get("weight", 0) for s in j["shards"] if s.get("state") == "SHARD_STATE_ACTIVE")
        == 10_000
    )


def test_apply_rejects_bad_documents_without_changing_anything(server: str, tmp_path: Path) -> None:
    before = run(server, "get", "all", "-o", "json").output
    f = tmp_path / "bad.yaml"
    f.write_text(MANIFEST + "---\nkind: Override\nspec: {shard: web, weight: -3}\n")
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 2
    assert "weight" in r.output
    f.write_text("kind: Gadget\n")
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 2
    assert "kind" in r.output
    assert run(server, "get", "all", "-o", "json").output == before


def test_watch_prints_new_versions(server: str) -> None:
    run(server, "shard", "upsert", "gamma", "-e", "10.0.3.1:8000", "--mark", "3")
    r = run(server, "watch", "--count", "1")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("v") or "\nv" in r.output


def test_parse_weight() -> None:
    assert parse_weight("2500") == 2500
    assert parse_weight("25%") == 2500
    assert parse_weight("0.5%") == 50
    for bad in ("-1", "nan", "inf", "10001", "1.5"):
        with pytest.raises(ValueError, match="weight"):
            parse_weight(bad)


BAD_DOCUMENTS = [
    (
        "kind: Shard\nmetadata: {name: w1}\nspec: {endpoints: [{address: 10.0.9.1, port: abc}]}\n",
        "spec.endpoints[0].port",
    ),
    ("kind: Shard\nmetadata: {name: w1}\nspec: {endpoints: 5}\n", "spec.endpoints"),
    ("kind: Shard\nmetadata: {name: w1}\nspec: {endpoint: [10.0.9.1:80]}\n", "spec.endpoint"),
    ("kind: Shard\nmetadata: {name: w1}\nspec: {steer: {mark: [1]}}\n", "spec.steer.mark"),
    ("kind: Shard\nmetadata: {name: w1}\nspec: {steer: {tunnel: 7}}\n", "spec.steer.tunnel"),
    ("kind: Shard\nmetadata: {name: [w1]}\n", "metadata.name"),
    ("kind: Shard\nmetadata: {name: w1}\nspec: {service: {port: -1}}\n", "spec.service.port"),
    ("kind: Pin\nspec: {cidr: 10.0.0.0/8, shard: web, extra: 1}\n", "spec.extra"),
    ("kind: Override\nspec: {shard: web, weight: 10, ttlSeconds: soon}\n", "spec.ttlSeconds"),
    ("kind: List\nitems: [3]\n", "items[0]"),
    ("kind: AdapterInstance\nmetadata: {name: x}\nspec: {modelRef: tiny}\n", "spec.modelRef"),
    ("kind: [Shard]\n", "kind"),
]


@pytest.mark.parametrize(("text", "field"), BAD_DOCUMENTS, ids=[f for _, f in BAD_DOCUMENTS])
def test_wrong_yaml_types_and_unknown_fields_are_one_line_errors(
    server: str, tmp_path: Path, text: str, field: str
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert field in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_apply_sends_one_transaction_so_a_refused_object_changes_nothing(
    server: str, tmp_path: Path
) -> None:
    before = run(server, "get", "all", "-o", "json").output
    f = tmp_path / "half.yaml"
    f.write_text(
        "kind: Shard\nmetadata: {name: good-one}\n"
        "spec: {endpoints: [10.0.40.1:8000], steer: {mark: 40}}\n"
        "---\n"
        "kind: Pin\nspec: {cidr: 10.40.0.0/16, shard: good-one}\n"
        "---\n"
        "kind: Shard\nmetadata: {name: bad-one}\n"
        "spec: {endpoints: [10.0.41.1:8000], steer: {mark: 0}}\n"
    )
    r = run(server, "apply", "-f", str(f))
    assert r.exit_code == 2, r.output
    assert "steer.mark.mark" in r.output
    assert run(server, "get", "all", "-o", "json").output == before


@pytest.mark.parametrize(
    "args",
    [
        ["history", "--limit", "-1"],
        ["history", "--limit", "5000"],
        ["history", "--before", "-3"],
        ["watch", "--count", "-1"],
        ["shard", "upsert", "x1", "--mark", "-1"],
        ["shard", "upsert", "x1", "--tunnel", "10.0.0.1", "--vni", "-5"],
        ["history", "--limit", "many"],
    ],
)
def test_bad_flags_exit_2_without_a_traceback(server: str, args: list[str]) -> None:
    r = run(server, *args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


def test_user_text_is_shown_literally(server: str) -> None:
    from adaptermesh.proto import control_plane_pb2, control_plane_pb2_grpc

    # Two shards: an override of the only active shard would have to hold the whole budget.
    assert (
        run(server, "shard", "upsert", "plain", "-e", "10.0.51.1:8000", "--mark", "51").exit_code
        == 0
    )
    assert (
        run(server, "shard", "upsert", "markup", "-e", "10.0.50.1:8000", "--mark", "50").exit_code
        == 0
    )
    reason = "[/] [bold]loud[/bold] [link=http://x]y[/link]"
    r = run(server, "override", "set", "markup", "10", "--reason", reason)
    assert r.exit_code == 0, r.output
    channel = grpc.insecure_channel(server)
    stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
    stub.ReportLoad(
        control_plane_pb2.LoadReport(
            node_id="[bold]n1[/]", applied_version=1, apply_error="version 9: [/] rules: [red]x"
        ),
        metadata=[("authorization", f"Bearer {RW_TOKEN}")],
    )
    channel.close()
    for args, expected in (
        (["override", "list"], "[bold]loud[/bold]"),
        (["history", "--limit", "3"], "[bold]loud[/bold]"),
        (["status"], "[bold]n1[/]"),
        (["status"], "version 9: [/] rules: [red]x"),
    ):
        r = run(server, *args)
        assert r.exit_code == 0, r.output
        flat = " ".join(r.output.split())
        assert expected in flat, (args, r.output)
    assert "DEGRADED" in run(server, "status").output
    assert run(server, "override", "clear", "markup").exit_code == 0
