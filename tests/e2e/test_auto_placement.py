"""Automatic homes on the local mesh: with ``adaptermesh control-plane --auto-placement``, an
AdapterInstance that names no shards gets a home shard, the control plane preloads it on the
home's worker, and a tenant steered to the other shard has its request for the adapter
forwarded by that shard's Envoy to the home's worker, which already holds it (a cache hit).

Real control plane, agent, Envoys and CPU workers in network namespaces prefixed ``amap``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2
from adaptermesh_testkit.localmesh import BASE_MODEL, LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

PROMPT = "The quick brown fox"
ADAPTERS = ("support", "sql", "legal", "poetry")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    m = LocalMesh(
        MeshConfig(
            prefix=f"amap{secrets.token_hex(2)}",
            shards=2,
            workers_per_shard=1,
            tenants=1,
            interval_s=1.0,
            report_interval_s=0.5,
            workdir=tmp_path_factory.mktemp("amap") / "mesh",
            control_plane_args=("--auto-placement",),
            worker_args=("--max-loras", "4"),
        ),
        progress=lambda msg: print(f"[e2e] {msg}", flush=True),
    )
    try:
        m.start()
        request = control_plane_pb2.ApplyRequest(reason="e2e: instances without placement")
        for name in ADAPTERS:
            inst = request.instances.add(name=name)
            inst.model_ref.base_model = BASE_MODEL
            inst.model_ref.adapter_path = name
        m.cp.Apply(request, metadata=m._md(), timeout=30)
        yield m
    finally:
        m.stop()


def _homes(mesh: LocalMesh) -> dict[str, str]:
    assignment = mesh.cp.GetAssignment(
        control_plane_pb2.GetAssignmentRequest(), metadata=mesh._md(), timeout=5
    )
    return {e.name: e.shards[0] for e in assignment.adapters if len(e.shards) == 1}


def _counters(url: str) -> dict[str, float]:
    """The worker's cache hits and misses and its served requests per adapter."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(
            ("adaptermesh_adapter_cache_hits_total ", "adaptermesh_adapter_cache_misses_total ")
        ):
            name, value = line.split()
            out[name] = float(value)
        elif line.startswith("adaptermesh_adapter_time_to_first_token_seconds_count{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('adapter="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def _resident(url: str) -> set[str]:
    body = httpx.get(url, timeout=5).json()
    return {m["id"] for m in body["data"] if m["parent"] and m["resident"]}


def test_a_request_for_an_adapter_homed_elsewhere_is_forwarded_to_its_home(
    mesh: LocalMesh,
) -> None:
    deadline = time.monotonic() + 60
    while set(homes := _homes(mesh)) != set(ADAPTERS) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert set(homes) == set(ADAPTERS), homes
    assert set(homes.values()) <= {"s0", "s1"}
    # A home on each side: four adapters over two equal shards (rendezvous hash; fixed names).
    remote = next((a for a, h in sorted(homes.items()) if h == "s1"), None)
    assert remote is not None, homes
    ((addr0, port0),) = mesh.worker_endpoints("s0")
    ((addr1, port1),) = mesh.worker_endpoints("s1")
    url0, url1 = f"http://{addr0}:{port0}", f"http://{addr1}:{port1}"
    # The control plane preloads it on its home's worker before any request names it.
    while remote not in mesh.in_node(_resident, f"{url1}/v1/models"):
        assert time.monotonic() < deadline, f"{remote} not preloaded on s1"
        time.sleep(0.3)
    assert remote not in mesh.in_node(_resident, f"{url0}/v1/models")
    mesh.wait_agent_applied(timeout=30)
    # The tenant is steered to s0; its request for the adapter homed on s1 is served there.
    tenant = mesh.tenants[0]
    mesh.wait_agent_applied(mesh.pin(f"{tenant}/32", "s0"), timeout=30)
    forwarded = r"cluster\.shard-s1\.upstream_rq_total$"
    before0 = mesh.in_node(_counters, f"{url0}/metrics")
    before1 = mesh.in_node(_counters, f"{url1}/metrics")
    sent_before = sum(mesh.envoy_stats("s0", forwarded).values())
    got = mesh.complete(tenant, remote, PROMPT, max_tokens=6)
    assert mesh.agent_flow(tenant) == "s0"
    after0 = mesh.in_node(_counters, f"{url0}/metrics")
    after1 = mesh.in_node(_counters, f"{url1}/metrics")
    # s0's Envoy sent it to s1's cluster; s1's worker served it from a slot (a hit); s0's
    # worker never saw it.
    assert sum(mesh.envoy_stats("s0", forwarded).values()) == sent_before + 1
    assert after1.get(remote, 0.0) == before1.get(remote, 0.0) + 1
    hits = "adaptermesh_adapter_cache_hits_total"
    assert after1[hits] == before1[hits] + 1
    assert after0.get(remote, 0.0) == before0.get(remote, 0.0)
    assert after0[hits] == before0[hits]
    # The same greedy tokens as asking s1's worker directly.
    direct = mesh.complete_direct("s1", 0, remote, PROMPT, max_tokens=6)
    assert got["choices"][0]["text"] == direct["choices"][0]["text"]
    mesh.unpin(f"{tenant}/32")
