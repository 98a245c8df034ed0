"""The credit-risk-v2 AdapterInstance (deploy/examples/credit-risk-v2.yaml) on the local mesh:
`adapterctl apply -f` of the example, then a tenant calls the adapter by its path through the
eBPF classifier and the shard's Envoy, as JSON transcoded to KServe v2 gRPC, over TLS with a
bearer token; every security rule refuses at Envoy with the worker untouched.

Real control plane, agent, Envoys and CPU workers in network namespaces prefixed ``amai``.
The example is applied as written except for the names this topology has: shard-b is ``s1``,
the pinned and allowed tenant networks are the mesh's tenant network, and the adapter's path
is the one the workers see (relative to their adapter root).
"""

from __future__ import annotations

import base64
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from edge_tokens import ISSUER, JWKS, token

from adaptermesh_testkit.localmesh import SERVICE_PORT, LocalMesh, MeshConfig
from adaptermesh_testkit.netns import NodeTopology

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "deploy" / "examples" / "credit-risk-v2.yaml"
SCOPES = "risk:evaluate tenant-acme"
PROMPT = "The quick brown fox"
GRPC_OFFSET = 100  # workers listen on 8101..; gRPC on 8201..


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    work = tmp_path_factory.mktemp("amai")
    (work / "jwks.json").write_text(JWKS)
    prefix = f"amai{secrets.token_hex(2)}"
    vip = NodeTopology.vip  # the service address every shard listener serves
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "edge.key",
            "-out",
            "edge.pem",
            "-days",
            "1",
            "-subj",
            f"/CN={vip}",
            "-addext",
            f"subjectAltName=IP:{vip}",
        ],
        cwd=work,
        check=True,
        capture_output=True,
    )
    m = LocalMesh(
        MeshConfig(
            prefix=prefix,
            shards=2,
            workers_per_shard=1,
            tenants=2,
            interval_s=2.0,
            report_interval_s=0.5,
            workdir=work / "mesh",
            grpc_port_offset=GRPC_OFFSET,
            agent_args=(
                "--edge-jwks",
                str(work / "jwks.json"),
                "--edge-issuer",
                ISSUER,
                "--edge-tls-cert",
                str(work / "edge.pem"),
                "--edge-tls-key",
                str(work / "edge.key"),
            ),
        ),
        progress=lambda msg: print(f"[e2e] {msg}", flush=True),
    )
    m.ca = work / "edge.pem"  # type: ignore[attr-defined]
    try:
        m.start()
        m.make_adapter("credit-risk-v2", seed=42)
        doc = (
            EXAMPLE.read_text()
            .replace("shard-b", "s1")
            .replace("10.40.0.0/16", f"{m.tenants[0]}/32")
            .replace("10.20.0.0/16", "10.77.0.0/16")
            .replace("path: /adapters/risk/credit-risk-v2", "path: credit-risk-v2")
        )
        (work / "credit-risk-v2.yaml").write_text(doc)
        out = m.adapterctl("apply", "-f", str(work / "credit-risk-v2.yaml"))
        assert "AdapterInstance/credit-risk-v2 create" in out.stdout, out.stdout
        m.wait_agent_applied(timeout=30)
        yield m
    finally:
        m.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


V2_JSON = {
    "inputs": [
        {
            "name": "text_input",
            "datatype": "BYTES",
            "shape": [1],
            "contents": {"bytes_contents": [_b64(PROMPT)]},
        }
    ],
    "parameters": {"max_tokens": {"int64_param": 6}, "temperature": {"double_param": 0.0}},
}


def _post(source: str, url: str, ca: str, headers: dict[str, str]) -> tuple[int, Any]:
    transport = httpx.HTTPTransport(local_address=source, verify=ca)
    with httpx.Client(transport=transport, timeout=30) as client:
        r = client.post(url, json=V2_JSON, headers=headers)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text


def _call(mesh: LocalMesh, scheme: str, headers: dict[str, str]) -> tuple[int, Any]:
    url = f"{scheme}://{mesh.vip}:{SERVICE_PORT}/v1/evaluate"
    return mesh.in_tenant(_post, mesh.tenants[0], url, str(mesh.ca), headers)  # type: ignore[attr-defined]


def _upstream(mesh: LocalMesh) -> int:
    stats = mesh.envoy_stats("s1", r"cluster\.shard-s1-grpc\.upstream_rq_total$")
    return sum(stats.values())


def _models(url: str) -> dict[str, tuple[bool, bool]]:
    body = httpx.get(url, timeout=10).json()
    return {m["id"]: (m["resident"], m["pinned"]) for m in body["data"] if m["parent"]}


def test_the_control_plane_pins_the_example_on_its_shard(mesh: LocalMesh) -> None:
    # placement: preload, pinnedShards [shard-b]: the control plane's placement loop loads it
    # pinned onto s1's worker with no request for it (docs/adapter-instance.md).
    ((addr, port),) = mesh.worker_endpoints("s1")
    deadline = time.monotonic() + 30
    while True:
        models = mesh.in_node(_models, f"http://{addr}:{port}/v1/models")
        if models.get("credit-risk-v2") == (True, True) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert models.get("credit-risk-v2") == (True, True), models


def test_the_example_is_served_by_path_over_tls_with_a_token(mesh: LocalMesh) -> None:
    deadline = time.monotonic() + 30
    while True:  # the snapshot reaches Envoy a moment after the agent applied it
        status, body = _call(mesh, "https", {"authorization": f"Bearer {token(SCOPES)}"})
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200, body
    assert body["model_name"] == "credit-risk-v2"
    names = [o["name"] for o in body["outputs"]]
    out = body["outputs"][names.index("text_output")]
    if out.get("contents", {}).get("bytes_contents"):
        text = base64.b64decode(out["contents"]["bytes_contents"][0]).decode()
    else:  # raw_output_contents: a 4-byte little-endian length, then the UTF-8 text
        text = base64.b64decode(body["raw_output_contents"][names.index("text_output")])[
            4:
        ].decode()
    direct = mesh.complete_direct("s1", 0, "credit-risk-v2", PROMPT, max_tokens=6)
    assert text == direct["choices"][0]["text"]


@pytest.mark.parametrize(
    ("scheme", "bearer", "status"),
    [
        ("https", None, 401),
        ("https", "not.a.jwt", 401),
        ("https", "scope:risk:evaluate", 403),
        ("http", f"scope:{SCOPES}", 403),
    ],
)
def test_each_security_rule_refuses_at_envoy(
    mesh: LocalMesh, scheme: str, bearer: str | None, status: int
) -> None:
    # A token is minted when the test runs, not when it is collected: its 10 minutes would
    # run out before a late test in a long session.
    if bearer is not None and bearer.startswith("scope:"):
        bearer = token(bearer.removeprefix("scope:"))
    headers = {} if bearer is None else {"authorization": f"Bearer {bearer}"}
    before = _upstream(mesh)
    got, body = _call(mesh, scheme, headers)
    assert got == status, body
    assert _upstream(mesh) == before, "a refused request reached a worker"
