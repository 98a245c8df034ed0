"""TLS and mTLS on the gRPC API, with certificates made by openssl for 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import control_plane_pb2 as cp_pb2
from adaptermesh.proto import control_plane_pb2_grpc

from .conftest import RW_TOKEN, StaticSource, creds, write_tokens


def _ssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    _ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=adaptermesh-test-ca",
        cwd=d,
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )


async def test_mtls_requires_a_client_certificate(tmp_path: Path) -> None:
    make_pki(tmp_path)
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(write_tokens(tmp_path / "tokens")),
        tls_cert=tmp_path / "server.pem",
        tls_key=tmp_path / "server.key",
        tls_client_ca=tmp_path / "ca.pem",
        rebalance=False,
    )
    server = ControlPlaneServer(config, source=StaticSource())
    port = await server.start()
    ca = (tmp_path / "ca.pem").read_bytes()
    try:
        good = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.pem").read_bytes()
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", good) as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            resp = await stub.ListShards(
                cp_pb2.ListShardsRequest(), metadata=creds(RW_TOKEN), timeout=5
            )
            assert list(resp.shards) == []
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)
        ) as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListShards(
                    cp_pb2.ListShardsRequest(), metadata=creds(RW_TOKEN), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.ListShards(
                    cp_pb2.ListShardsRequest(), metadata=creds(RW_TOKEN), timeout=5
                )
    finally:
        await server.stop(0)


def make_node_cert(d: Path, node: str) -> None:
    """A client certificate from make_pki's CA with the node name in a SAN."""
    _ssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{node}.key", "-out", f"{node}.csr",
        "-subj", f"/CN={node}", cwd=d,
    )  # fmt: skip
    (d / f"{node}.ext").write_text(
        f"extendedKeyUsage=clientAuth\nsubjectAltName=DNS:{node}.node.adaptermesh\n"
    )
    _ssl(
        "x509", "-req", "-in", f"{node}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{node}.pem", "-days", "1", "-extfile", f"{node}.ext", cwd=d,
    )  # fmt: skip


async def test_a_node_certificate_is_a_credential_for_its_node_only(tmp_path: Path) -> None:
    make_pki(tmp_path)
    make_node_cert(tmp_path, "node-a")
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(write_tokens(tmp_path / "tokens")),
        tls_cert=tmp_path / "server.pem",
        tls_key=tmp_path / "server.key",
        tls_client_ca=tmp_path / "ca.pem",
        node_cert_suffix=".node.adaptermesh",
        rebalance=False,
    )
    server = ControlPlaneServer(config, source=StaticSource())
    port = await server.start()
    ca = (tmp_path / "ca.pem").read_bytes()

    def channel(name: str) -> grpc.aio.Channel:
        key, cert = (tmp_path / f"{name}.key").read_bytes(), (tmp_path / f"{name}.pem").read_bytes()
        return grpc.aio.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert)
        )

    try:
        async with channel("node-a") as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            # No bearer token: the certificate's SAN names the caller.
            await stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a"), timeout=5)
            await stub.ListShards(cp_pb2.ListShardsRequest(), timeout=5)
            for call in (
                stub.ReportLoad(cp_pb2.LoadReport(node_id="node-b"), timeout=5),
                stub.SetOverride(cp_pb2.SetOverrideRequest(shard_id="s0", weight=1), timeout=5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "cert:node-a" in (err.value.details() or "")
        async with channel("client") as ch:
            # A certificate without a node SAN names nobody: a bearer token is still needed.
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportLoad(cp_pb2.LoadReport(node_id="client"), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        nodes = server.store.list_nodes()
        assert [n[0] for n in nodes] == ["node-a"]
    finally:
        await server.stop(0)
