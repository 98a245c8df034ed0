"""adapterctl against a control plane subprocess on an ephemeral 127.0.0.1 port."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from adaptermesh.cli.adapterctl import app, parse_weight

from .conftest import RO_TOKEN, RW_TOKEN, write_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("cp")
    p = subprocess.Popen(
        [sys.executable, "-m", "adaptermesh.control_plane.cli", "--state-dir", str(tmp / "state"),
         "--listen", "127.0.0.1:0", "--tokens-file", str(write_tokens(tmp / "tokens")),
         "--interval", "0.5", "--synchronous", "NORMAL", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
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
    r = run(server, "shard", "upsert", "alpha", "-e", "10.0.1.1:8000", "-e", "10.0.1.2:8000",
            "--tunnel", "192.0.2.1", "--vni", "7")
    assert r.exit_code == 0, r.output
    assert "index" in r.output
    assert run(server, "shard", "upsert", "beta", "-e", "10.0.2.1:8000").exit_code == 0
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
    assert sum(s.get("weight", 0) for s in j["shards"] if s.get("state") == "SHARD_STATE_ACTIVE") == 10_000


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
    run(server, "shard", "upsert", "gamma", "-e", "10.0.3.1:8000")
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
