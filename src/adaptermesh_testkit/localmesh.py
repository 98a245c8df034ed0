"""The whole mesh on one machine, in network namespaces: the demo's and the e2e tests' topology.

::

    tenant ns (10.77.0.11.. one address per tenant)
        | veth
    node ns: classifier on the tenant link (mark steering) + agent (xDS :18000, /metrics :9464)
             + control plane (SQLite in a temporary directory, gRPC on a unix socket)
        | veth per shard: fwmark 0x100+i -> table 100+i -> VIP via shard i
    shard ns i: VIP on lo; Envoy on VIP:8080 (xDS from the agent, cluster shard-s<i>)
                -> two CPU workers on 10.78.i.2:8101, :8102 (tiny Llama, several adapters)

Every shard's Envoy listens on the same VIP: the classifier, not the destination address,
decides the shard. Processes are started from threads that entered the target namespace
(``setns`` is per thread and a child inherits its thread's namespace), so nothing runs
through ``ip netns exec`` and the agent still sees the host's bpffs for its pins.

Nothing listens in the host's namespace: every port (8080 service, 8101+ workers, 9464 agent,
9901 Envoy admin, 18000 xDS) is inside the mesh's own namespaces, and the control plane's
socket is a file in the work directory. Names start with the prefix (``ammesh`` for the
demo, ``ame`` for the e2e tests), so runs with different prefixes never collide.

``adaptermesh demo`` runs :func:`main` (the story: traffic, an override and a pin through
``adapterctl``, a load spike the rebalancer moves weight away from); ``tests/e2e`` drive
:class:`LocalMesh` directly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx

from adaptermesh.bpf.namespace import enter
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)
from adaptermesh_testkit.netns import NodeTopology, delete_namespaces
from adaptermesh_testkit.stallproxy import StallProxy

T = TypeVar("T")

ADAPTERS = ("support", "sql", "legal", "poetry")
BASE_MODEL = "tinyllama"
SERVICE_PORT = 8080
XDS_PORT = 18000
AGENT_METRICS_PORT = 9464
WORKER_BASE_PORT = 8101
ENVOY_ADMIN_PORT = 9901
EXT_PROC_PORT = 18100


@dataclass
class MeshConfig:
    prefix: str = "ammesh"
    shards: int = 3
    workers_per_shard: int = 2
    tenants: int = 6
    # Extra source addresses in the tenant namespace, for probes that need fresh flows.
    probe_sources: int = 0
    adapters: Sequence[str] = ADAPTERS
    interval_s: float = 5.0
    report_interval_s: float = 1.0
    # Worker concurrency: small, so that a burst queues and the rebalancer sees it.
    max_running: int = 4
    workdir: Path | None = None
    keep_workdir: bool = False
    # Workers also serve KServe v2 gRPC at their HTTP port plus this; the agent routes it.
    grpc_port_offset: int | None = None
    # More agent flags (edge token and TLS settings, say).
    agent_args: Sequence[str] = ()
    # The agent's external processor in front of every shard (adapter by body, routing
    # rules, adapter version splits).
    ext_proc: bool = False
    # Adapters made on disk but not listed as resident: the workers load them on demand
    # (versions for a rollout, "<adapter>@<version>").
    extra_adapters: Sequence[str] = ()
    # More control-plane flags (``--auto-placement``, say) and worker flags (``--max-loras``).
    control_plane_args: Sequence[str] = ()
    # Extra environment of the control plane's process (say MALLOC_ARENA_MAX=2).
    control_plane_env: Mapping[str, str] = field(default_factory=dict)
    worker_args: Sequence[str] = ()
    # Adapters that only an S3 store holds (not the adapter root): each shard namespace runs a
    # moto S3 server behind a StallProxy (stallproxy.py) on 127.0.0.1, and its workers look
    # unknown names up there (``--adapter-resolver s3://STORE_BUCKET/STORE_PREFIX``).
    store_adapters: Sequence[str] = ()


STORE_BUCKET = "adapters"
STORE_PREFIX = "lib"
_STORE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    ns: str

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class _NsPools:
    """One thread pool per namespace; its threads enter the namespace once and stay."""

    def __init__(self) -> None:
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def pool(self, ns: str) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(ns)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=32,
                    thread_name_prefix=f"ns-{ns}",
                    initializer=enter,  # for good: the thread lives in ns until shutdown
                    initargs=(ns,),
                )
                self._pools[ns] = pool
            return pool

    def run(self, ns: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.pool(ns).submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


class MeshError(RuntimeError):
    pass


class LocalMesh:
    """Build with :meth:`start`, tear down with :meth:`stop` (also on Ctrl-C)."""

    def __init__(self, config: MeshConfig, progress: Callable[[str], None] | None = None):
        self.config = config
        self.progress = progress or (lambda _msg: None)
        p = config.prefix
        n_sources = config.tenants + config.probe_sources
        if n_sources > 200:
            raise ValueError("tenants + probe_sources: at most 200 addresses")
        self.tenants = [f"10.77.0.{11 + i}" for i in range(config.tenants)]
        self.probe_sources = [
            f"10.77.0.{11 + config.tenants + i}" for i in range(config.probe_sources)
        ]
        self.topo = NodeTopology(
            prefix=p, n_shards=config.shards, tenant_addrs=self.tenants + self.probe_sources
        )
        self.vip = self.topo.vip
        self.pin_dir = Path(f"/sys/fs/bpf/{p}")
        self._own_workdir = config.workdir is None
        self.workdir = Path(config.workdir or tempfile.mkdtemp(prefix=f"{p}-mesh-"))
        self.ns = _NsPools()
        self.procs: dict[str, Proc] = {}
        self.envoys: dict[str, Any] = {}
        self.shard_ids = [f"s{i}" for i in range(config.shards)]
        self.cp_socket = self.workdir / "cp.sock"
        self.operator_token = "operator-" + os.urandom(12).hex()
        self.agent_token = "agent-" + os.urandom(12).hex()
        self.model_dir = self.workdir / "model"
        self.adapter_root = self.workdir / "adapters"
        self._channel: grpc.Channel | None = None
        self._stopped = False
        # Per shard: its S3 store's proxy, and the moto servers behind them.
        self.store_proxies: dict[str, StallProxy] = {}
        self._store_servers: list[subprocess.Popen[bytes]] = []

    # ---- names -----------------------------------------------------------------------------

    @property
    def node_ns(self) -> str:
        return self.topo.node_ns

    @property
    def tenant_ns(self) -> str:
        return self.topo.tenant_ns

    def shard_ns(self, shard_id: str) -> str:
        return self.topo.shards[self.shard_ids.index(shard_id)].ns

    def worker_endpoints(self, shard_id: str) -> list[tuple[str, int]]:
        s = self.topo.shards[self.shard_ids.index(shard_id)]
        return [(s.addr, WORKER_BASE_PORT + j) for j in range(self.config.workers_per_shard)]

    @property
    def cp_target(self) -> str:
        return f"unix:{self.cp_socket}"

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        cfg = self.config
        self.cleanup_leftovers(cfg.prefix)
        self.progress("building the tiny model and its adapters")
        self._make_model()
        self.progress(f"creating namespaces ({cfg.shards} shards, {len(self.tenants)} tenants)")
        self.topo.create()
        self.progress("starting the control plane, the workers and the agent")
        self._write_tokens()
        self._start_control_plane()
        if self.config.store_adapters:
            self._start_stores()
        for shard_id in self.shard_ids:
            for j, (addr, port) in enumerate(self.worker_endpoints(shard_id)):
                self._start_worker(shard_id, j, addr, port)
        self._wait_control_plane()
        self._register_shards()
        self.start_agent()
        self.wait_agent_applied(timeout=60)
        self.progress("starting one Envoy per shard")
        for shard_id in self.shard_ids:
            self._start_envoy(shard_id)
        self.progress("waiting for the workers")
        self._wait_workers(timeout=180)
        for shard_id in self.shard_ids:
            self._wait_envoy_endpoints(shard_id, timeout=60)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for name, envoy in list(self.envoys.items()):
            with contextlib.suppress(Exception):
                self.ns.run(self.shard_ns(name), envoy.cleanup)
        self.envoys.clear()
        # Everything gets SIGTERM at once (workers drain in parallel), then stragglers SIGKILL.
        procs = [p for p in self.procs.values() if p.alive]
        for proc in procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            if proc.alive:
                proc.kill()
        if self._channel is not None:
            self._channel.close()
        for proxy in self.store_proxies.values():
            proxy.close()
        for server in self._store_servers:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self.ns.shutdown()
        self.topo.destroy()
        shutil.rmtree(self.pin_dir, ignore_errors=True)
        if self._own_workdir and not self.config.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def cleanup_leftovers(prefix: str) -> None:
        """Remove what a crashed run with this prefix left (namespaces, pins)."""
        delete_namespaces(f"{prefix}-")
        shutil.rmtree(f"/sys/fs/bpf/{prefix}", ignore_errors=True)

    # ---- pieces ------------------------------------------------------------------------------

    def _make_model(self) -> None:
        from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

        if not (self.model_dir / "config.json").exists():
            make_tiny_model(self.model_dir)
        names = [*self.config.adapters, *self.config.extra_adapters]
        for i, name in enumerate(names):
            if not (self.adapter_root / name / "adapter_config.json").exists():
                self.make_adapter(name, seed=i + 1, rank=4 + 4 * (i % 4))
        del make_adapter

    def make_adapter(self, name: str, seed: int, rank: int = 8) -> Path:
        from adaptermesh_testkit.checkpoints import make_adapter

        return make_adapter(
            self.adapter_root,
            self.model_dir,
            name,
            rank=rank,
            seed=seed,
            target_modules=("q_proj", "v_proj", "o_proj"),
            scale_b=0.5,
        )

    def _start_stores(self) -> None:
        """A moto S3 server and a StallProxy in front of it in each shard namespace, holding
        ``config.store_adapters`` under ``s3://STORE_BUCKET/STORE_PREFIX/<name>/``."""
        from adaptermesh_testkit.checkpoints import make_adapter

        made = self.workdir / "store-adapters"
        offset = len(self.config.adapters) + len(self.config.extra_adapters)
        for i, name in enumerate(self.config.store_adapters):
            if not (made / name / "adapter_config.json").exists():
                make_adapter(
                    made,
                    self.model_dir,
                    name,
                    rank=8,
                    seed=offset + i + 1,
                    target_modules=("q_proj", "v_proj", "o_proj"),
                    scale_b=0.5,
                )
        for shard_id in self.shard_ids:

            def start(made: Path = made) -> tuple[Any, StallProxy]:
                import boto3

                server, port = _start_moto_server()
                s3 = boto3.client(
                    "s3",
                    endpoint_url=f"http://127.0.0.1:{port}",
                    region_name=_STORE_ENV["AWS_DEFAULT_REGION"],
                    aws_access_key_id=_STORE_ENV["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=_STORE_ENV["AWS_SECRET_ACCESS_KEY"],
                )
                s3.create_bucket(Bucket=STORE_BUCKET)
                for name in self.config.store_adapters:
                    for file in sorted((made / name).iterdir()):
                        s3.put_object(
                            Bucket=STORE_BUCKET,
                            Key=f"{STORE_PREFIX}/{name}/{file.name}",
                            Body=file.read_bytes(),
                        )
                return server, StallProxy(("127.0.0.1", port)).start()

            server, proxy = self.ns.run(self.shard_ns(shard_id), start)
            self._store_servers.append(server)
            self.store_proxies[shard_id] = proxy

    def _store_args(self, shard_id: str) -> list[str]:
        proxy = self.store_proxies.get(shard_id)
        if proxy is None:
            return []
        return [
            "--s3-endpoint-url",
            proxy.url,
            "--adapter-resolver",
            f"s3://{STORE_BUCKET}/{STORE_PREFIX}",
            "--adapter-cache-dir",
            str(self.workdir / "adapter-cache" / shard_id),
        ]

    def _write_tokens(self) -> None:
        (self.workdir / "tokens").write_text(
            # The operator's scopes are adapterctl's; the agent reports for its own node only.
            f"{self.operator_token} read,write,rollout operator\n"
            f"{self.agent_token} read,report agent nodes={self.node_ns}\n"
        )
        (self.workdir / "agent.token").write_text(self.agent_token + "\n")
        for path in (self.workdir / "tokens", self.workdir / "agent.token"):
            path.chmod(0o600)

    def _spawn(
        self, name: str, ns: str, argv: list[str], env: dict[str, str] | None = None
    ) -> Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)

        def spawn() -> subprocess.Popen[bytes]:
            with open(log, "ab") as fh:
                return subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **(env or {})},
                )

        popen = self.ns.run(ns, spawn)
        proc = Proc(name, popen, log, argv, ns)
        self.procs[name] = proc
        return proc

    def _adaptermesh(self) -> list[str]:
        # The console script next to this interpreter (the package's entry point).
        return [str(Path(sys.executable).parent / "adaptermesh")]

    def _start_control_plane(self) -> Proc:
        state = self.workdir / "control-plane"
        state.mkdir(exist_ok=True)
        return self._spawn(
            "control-plane",
            self.node_ns,
            [
                *self._adaptermesh(),
                "control-plane",
                "--state-dir",
                str(state),
                "--listen",
                self.cp_target,
                "--tokens-file",
                str(self.workdir / "tokens"),
                "--interval",
                str(self.config.interval_s),
                "--log-level",
                "INFO",
                *self.config.control_plane_args,
            ],
            env=dict(self.config.control_plane_env),
        )

    def stop_control_plane(self, kill: bool = False) -> float:
        """Stop the control plane (SIGTERM, or SIGKILL with ``kill``); returns the monotonic
        time of the signal. Its state directory stays for :meth:`start_control_plane_again`."""
        proc = self.procs["control-plane"]
        at = time.monotonic()
        if kill:
            proc.kill()
        else:
            proc.stop()
        return at

    def start_control_plane_again(self) -> Proc:
        """Start the control plane on its state directory and socket; wait until it serves."""
        if self.procs["control-plane"].alive:
            raise MeshError("the control plane is still running")
        proc = self._start_control_plane()
        self._wait_control_plane()
        return proc

    def restart_agent(self, kill: bool = False) -> tuple[float, float]:
        """Stop the agent (SIGTERM, or SIGKILL with ``kill``) and start it again with the same
        flags (pin directory, state file); returns the monotonic times of the signal and of
        the new agent's healthy /healthz."""
        proc = self.procs["agent"]
        at = time.monotonic()
        if kill:
            proc.kill()
        else:
            proc.stop()
        self.start_agent()
        return at, time.monotonic()

    def restart_control_plane(self) -> Proc:
        self.procs["control-plane"].stop()
        proc = self._start_control_plane()
        self._wait_control_plane()
        return proc

    def _wait_control_plane(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs["control-plane"]
            if not proc.alive:
                raise MeshError(f"control plane exited:\n{proc.log_tail()}")
            try:
                self.cp.GetAssignment(
                    control_plane_pb2.GetAssignmentRequest(), metadata=self._md(), timeout=2
                )
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # serving, nothing published yet
                if time.monotonic() > deadline:
                    raise MeshError(f"control plane not serving: {exc}") from exc
            time.sleep(0.2)

    def _start_worker(self, shard_id: str, j: int, addr: str, port: int) -> Proc:
        return self._spawn(
            f"worker-{shard_id}-{j}",
            self.shard_ns(shard_id),
            [
                *self._adaptermesh(),
                "worker",
                "--model",
                str(self.model_dir),
                "--adapter-root",
                str(self.adapter_root),
                "--host",
                addr,
                "--port",
                str(port),
                "--device",
                "cpu",
                "--served-model-name",
                BASE_MODEL,
                "--max-running",
                str(self.config.max_running),
                "--log-level",
                "WARNING",
                *(
                    ()
                    if self.config.grpc_port_offset is None
                    else ("--grpc-port", str(port + self.config.grpc_port_offset))
                ),
                *self._store_args(shard_id),
                *self._cpu_threads_args(),
                *self.config.worker_args,
            ],
            env=_STORE_ENV if shard_id in self.store_proxies else None,
        )

    def pids(self) -> dict[str, int]:
        """The running processes of the mesh by name: its workers, agent and control plane,
        each shard's Envoy (``envoy-<shard>``) and S3 store server (``store-<n>``)."""
        pids = {name: proc.popen.pid for name, proc in self.procs.items() if proc.alive}
        for shard_id, envoy in self.envoys.items():
            process = getattr(envoy, "process", None)
            if process is not None and process.poll() is None:
                pids[f"envoy-{shard_id}"] = process.pid
        for i, server in enumerate(self._store_servers):
            if server.poll() is None:
                pids[f"store-{i}"] = server.pid
        return pids

    def _cpu_threads_args(self) -> list[str]:
        """Each worker's share of the machine's CPUs, as a pod's CPU limit would give it
        (``--cpu-threads``; unless ``worker_args`` sets it). Every worker of the mesh runs on
        this one machine, and a worker sizes torch's threads from the CPUs it may use: without
        a share, each worker starts a thread per core, their spinning OpenMP threads take turns
        on the same cores, and a step slows by an order of magnitude whenever two workers step
        at once (docs/faults.md)."""
        if "--cpu-threads" in self.config.worker_args:
            return []
        return ["--cpu-threads", str(self.worker_cpu_share())]

    def worker_cpu_share(self) -> int:
        """The machine's CPUs (its affinity mask) over the mesh's workers, at least 1."""
        workers = len(self.shard_ids) * self.config.workers_per_shard
        return max(1, len(os.sched_getaffinity(0)) // max(1, workers))

    def restart_worker(self, shard_id: str, j: int) -> Proc:
        addr, port = self.worker_endpoints(shard_id)[j]
        self.procs[f"worker-{shard_id}-{j}"].stop()
        proc = self._start_worker(shard_id, j, addr, port)
        self._wait_workers(timeout=120, only=[(shard_id, j)])
        return proc

    # ---- faults: one worker killed, drained, started again (the fault-injection suite) --------

    def worker_proc(self, shard_id: str, j: int) -> Proc:
        return self.procs[f"worker-{shard_id}-{j}"]

    def kill_worker(self, shard_id: str, j: int) -> float:
        """SIGKILL worker ``j`` of ``shard_id`` (no drain, no goodbye); returns the monotonic
        time the signal was sent. Waits (up to 5 s) until the process is gone."""
        proc = self.worker_proc(shard_id, j)
        at = time.monotonic()
        proc.kill()
        return at

    def drain_worker(
        self, shard_id: str, j: int, timeout: float = 60.0
    ) -> tuple[float, int | None]:
        """SIGTERM worker ``j`` of ``shard_id`` and wait for it to exit (its own drain: /health
        turns 503, in-flight requests finish); returns (monotonic time of the signal, its exit
        code, None when it still ran after ``timeout``)."""
        proc = self.worker_proc(shard_id, j)
        at = time.monotonic()
        proc.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout)
        return at, proc.popen.returncode

    def start_worker_again(self, shard_id: str, j: int, timeout: float = 120.0) -> Proc:
        """Start worker ``j`` of ``shard_id`` again after a kill or a drain (same address,
        port and flags) and wait until its /health answers 200."""
        old = self.worker_proc(shard_id, j)
        if old.alive:
            raise MeshError(f"worker {shard_id}/{j} is still running")
        addr, port = self.worker_endpoints(shard_id)[j]
        proc = self._start_worker(shard_id, j, addr, port)
        self._wait_workers(timeout=timeout, only=[(shard_id, j)])
        return proc

    def envoy_host_flags(self, shard_id: str, j: int) -> list[str] | None:
        """Envoy's health flags for worker ``j`` of ``shard_id`` ([] = healthy; None when
        Envoy does not list it)."""
        addr, port = self.worker_endpoints(shard_id)[j]
        return self.envoy_hosts(shard_id).get(f"{addr}:{port}")

    def _wait_workers(self, timeout: float, only: Sequence[tuple[str, int]] | None = None) -> None:
        pending = list(
            only or [(s, j) for s in self.shard_ids for j in range(self.config.workers_per_shard)]
        )
        deadline = time.monotonic() + timeout
        while pending:
            shard_id, j = pending[0]
            proc = self.procs[f"worker-{shard_id}-{j}"]
            if not proc.alive:
                raise MeshError(f"worker {shard_id}/{j} exited:\n{proc.log_tail()}")
            addr, port = self.worker_endpoints(shard_id)[j]
            try:
                status = self.in_node(_http_status, f"http://{addr}:{port}/health")
            except httpx.HTTPError:
                status = 0
            if status == 200:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise MeshError(f"worker {shard_id}/{j} not healthy:\n{proc.log_tail()}")
            time.sleep(0.3)

    def _register_shards(self) -> None:
        for i, shard_id in enumerate(self.shard_ids):
            s = self.topo.shards[i]
            shard = assignment_pb2.Shard(
                id=shard_id,
                service_address=self.vip,
                service_port=SERVICE_PORT,
                state=assignment_pb2.SHARD_STATE_ACTIVE,
                labels={"demo": "localmesh"},
            )
            for addr, port in self.worker_endpoints(shard_id):
                shard.endpoints.add(
                    address=addr, port=port, weight=1, adapters=list(self.config.adapters)
                )
            shard.steer.mark.mark = s.mark
            self.cp.UpsertShard(
                control_plane_pb2.UpsertShardRequest(shard=shard), metadata=self._md(), timeout=10
            )

    def agent_argv(self) -> list[str]:
        return [
            *self._adaptermesh(),
            "agent",
            "--node-id",
            self.node_ns,
            "--control-plane",
            self.cp_target,
            "--token-file",
            str(self.workdir / "agent.token"),
            "--iface",
            self.topo.node_tenant_if,
            "--pin-dir",
            str(self.pin_dir),
            "--xds-host",
            "0.0.0.0",
            "--xds-port",
            str(XDS_PORT),
            "--metrics-host",
            "0.0.0.0",
            "--metrics-port",
            str(AGENT_METRICS_PORT),
            "--state-file",
            str(self.workdir / "agent" / "assignment.pb"),
            "--report-interval",
            str(self.config.report_interval_s),
            *(
                ()
                if self.config.grpc_port_offset is None
                else ("--grpc-port-offset", str(self.config.grpc_port_offset))
            ),
            *self.config.agent_args,
            *(
                [
                    "--ext-proc-host",
                    "0.0.0.0",
                    "--ext-proc-port",
                    str(EXT_PROC_PORT),
                    "--base-model",
                    BASE_MODEL,
                ]
                if self.config.ext_proc
                else []
            ),
        ]

    def start_agent(self) -> Proc:
        proc = self._spawn("agent", self.node_ns, self.agent_argv())
        deadline = time.monotonic() + 90
        while True:
            if not proc.alive:
                raise MeshError(f"agent exited:\n{proc.log_tail()}")
            try:
                if self.in_node(_http_status, self.agent_url("/healthz")) == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise MeshError(f"agent not healthy:\n{proc.log_tail()}")
            time.sleep(0.2)

    def _start_envoy(self, shard_id: str) -> None:
        from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap

        s = self.topo.shards[self.shard_ids.index(shard_id)]
        bootstrap = build_bootstrap(
            f"{shard_id}-envoy",
            XDS_PORT,
            xds_host=s.node_addr,
            node_cluster=f"shard-{shard_id}",
            admin_port=ENVOY_ADMIN_PORT,
            ext_proc_port=EXT_PROC_PORT if self.config.ext_proc else None,
            ext_proc_host=s.node_addr,
        )
        workdir = self.workdir / f"envoy-{shard_id}"
        envoy = EnvoyProcess(bootstrap, workdir=workdir, concurrency=1)
        self.envoys[shard_id] = envoy
        # Started (and later queried) from a thread inside the shard namespace: Envoy runs
        # there, and its admin interface on 127.0.0.1 is that namespace's loopback.
        self.ns.run(s.ns, envoy.start, 60.0)

    def envoy_clusters(self, shard_id: str) -> dict[str, Any]:
        return self.ns.run(self.shard_ns(shard_id), self.envoys[shard_id].clusters)

    def envoy_stats(self, shard_id: str, regex: str) -> dict[str, int]:
        return self.ns.run(self.shard_ns(shard_id), self.envoys[shard_id].stats, regex)

    def envoy_hosts(self, shard_id: str) -> dict[str, list[str]]:
        """``host:port`` -> health flags of the shard cluster's hosts, as Envoy sees them."""
        out: dict[str, list[str]] = {}
        for cluster in self.envoy_clusters(shard_id).get("cluster_statuses", []):
            if cluster.get("name") != f"shard-{shard_id}":
                continue
            for host in cluster.get("host_statuses", []):
                sa = host["address"]["socket_address"]
                flags = [
                    k
                    for k, v in host.get("health_status", {}).items()
                    if v is True or (k == "eds_health_status" and v != "HEALTHY")
                ]
                out[f"{sa['address']}:{sa['port_value']}"] = flags
        return out

    def _wait_envoy_endpoints(self, shard_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = {f"{a}:{p}" for a, p in self.worker_endpoints(shard_id)}
        while True:
            hosts = self.envoy_hosts(shard_id)
            healthy = {h for h, flags in hosts.items() if not flags}
            if want <= healthy:
                return
            if time.monotonic() > deadline:
                raise MeshError(f"Envoy of {shard_id} sees {hosts}, want {sorted(want)} healthy")
            time.sleep(0.25)

    # ---- control plane and agent views --------------------------------------------------------

    def _md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.operator_token}"),)

    @property
    def cp(self) -> control_plane_pb2_grpc.ControlPlaneStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.cp_target)
        return control_plane_pb2_grpc.ControlPlaneStub(self._channel)  # type: ignore[no-untyped-call]

    def cp_status(self) -> control_plane_pb2.StatusResponse:
        status: control_plane_pb2.StatusResponse = self.cp.GetStatus(
            control_plane_pb2.GetStatusRequest(), metadata=self._md(), timeout=5
        )
        return status

    def set_override(self, shard_id: str, weight: int, reason: str = "") -> int:
        """Set an override through the API; returns the version that carries it."""
        self.cp.SetOverride(
            control_plane_pb2.SetOverrideRequest(shard_id=shard_id, weight=weight, reason=reason),
            metadata=self._md(),
            timeout=10,
        )
        return self.current_version()

    def clear_override(self, shard_id: str) -> int:
        self.cp.ClearOverride(
            control_plane_pb2.ClearOverrideRequest(shard_id=shard_id),
            metadata=self._md(),
            timeout=10,
        )
        return self.current_version()

    def pin(self, cidr: str, shard_id: str) -> int:
        self.cp.PinTenant(
            control_plane_pb2.PinTenantRequest(cidr=cidr, shard_id=shard_id),
            metadata=self._md(),
            timeout=10,
        )
        return self.current_version()

    def unpin(self, cidr: str) -> int:
        self.cp.UnpinTenant(
            control_plane_pb2.UnpinTenantRequest(cidr=cidr), metadata=self._md(), timeout=10
        )
        return self.current_version()

    def current_version(self) -> int:
        return int(
            self.cp.GetAssignment(
                control_plane_pb2.GetAssignmentRequest(), metadata=self._md(), timeout=5
            ).version
        )

    def adapterctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # The token travels in the environment, not on the command line (ps shows argv).
        env = {
            **os.environ,
            "ADAPTERMESH_SERVER": self.cp_target,
            "ADAPTERMESH_TOKEN": self.operator_token,
            "COLUMNS": "120",
        }
        argv = [str(Path(sys.executable).parent / "adapterctl"), *args]
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=60, check=False
        )
        if check and proc.returncode != 0:
            raise MeshError(
                f"adapterctl {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        return proc

    def agent_url(self, path: str) -> str:
        return f"http://127.0.0.1:{AGENT_METRICS_PORT}{path}"

    def agent_status(self) -> dict[str, Any]:
        return self.in_node(_http_json, self.agent_url("/status"))

    def agent_flows(self) -> dict[str, str]:
        """Source address -> shard id for the flows that started within the agent's window,
        from its view of the ring buffer."""
        data = self.in_node(_http_json, self.agent_url("/flows"))
        return {f["source"]: f["shard_id"] for f in data["flows"]}

    def agent_flow(self, source: str) -> str | None:
        """The shard id ``source`` is steered to, as the agent sees it (its recent flows, then
        the datapath's sticky flow table); None when it has no flow."""
        data = self.in_node(_http_json, self.agent_url(f"/flows?source={source}"))
        flows = data["flows"]
        return str(flows[0]["shard_id"]) if flows else None

    def wait_agent_applied(self, version: int | None = None, timeout: float = 30) -> int:
        """Wait until the agent applied ``version`` (default: the control plane's current)."""
        deadline = time.monotonic() + timeout
        while True:
            want = version
            if want is None:
                try:
                    want = self.cp.GetAssignment(
                        control_plane_pb2.GetAssignmentRequest(), metadata=self._md(), timeout=2
                    ).version
                except grpc.RpcError:
                    want = None
            try:
                applied = int(self.agent_status()["applied_version"])
            except (httpx.HTTPError, KeyError):
                applied = -1
            if want is not None and applied >= want > 0:
                return applied
            if time.monotonic() > deadline:
                raise MeshError(
                    f"agent applied {applied}, want {want}:\n{self.procs['agent'].log_tail()}"
                )
            time.sleep(0.05)

    # ---- traffic -------------------------------------------------------------------------------

    def in_node(self, fn: Callable[..., T], *args: Any) -> T:
        return self.ns.run(self.node_ns, fn, *args)

    def in_tenant(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` in the tenants' namespace (bind a tenant address to send as that tenant)."""
        return self.ns.run(self.tenant_ns, fn, *args)

    def complete(
        self,
        source: str,
        adapter: str,
        prompt: str,
        max_tokens: int = 8,
        timeout: float = 30.0,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """One completion from tenant address ``source`` through classifier -> Envoy -> worker.

        A new connection each time: the classifier's sticky flow is per source address, so
        every request is steered again (a kept-alive connection would hide a broken path).
        """
        return self.ns.run(
            self.tenant_ns,
            _complete,
            source,
            f"http://{self.vip}:{SERVICE_PORT}",
            adapter,
            prompt,
            max_tokens,
            timeout,
            headers,
        )

    def complete_direct(
        self, shard_id: str, j: int, adapter: str, prompt: str, max_tokens: int = 8
    ) -> dict[str, Any]:
        addr, port = self.worker_endpoints(shard_id)[j]
        return self.in_node(
            _complete, None, f"http://{addr}:{port}", adapter, prompt, max_tokens, 30.0
        )

    def worker_post(self, shard_id: str, j: int, path: str, body: dict[str, Any]) -> int:
        addr, port = self.worker_endpoints(shard_id)[j]
        return self.in_node(_http_post_status, f"http://{addr}:{port}{path}", body)


def _http_status(url: str) -> int:
    return httpx.get(url, timeout=2).status_code


def _http_json(url: str) -> Any:
    r = httpx.get(url, timeout=5)
    r.raise_for_status()
    return r.json()


def plain_http_client(source: str | None, timeout: float | httpx.Timeout) -> httpx.Client:
    """A client for one plain-HTTP request to the mesh, from ``source`` when given.

    It builds no TLS context: httpx builds one per transport by default and loads the CA store
    into it, about 20 ms of the interpreter on this machine, and a load generator that starts a
    client per request would delay every other request's timestamps in the process by that
    much each time (more requests a second, more delay: a load that rises mid-run would look
    slower for it)."""
    transport = httpx.HTTPTransport(local_address=source, verify=False) if source else None
    return httpx.Client(transport=transport, timeout=timeout, verify=False)


def _http_post_status(url: str, body: dict[str, Any]) -> int:
    return httpx.post(url, json=body, timeout=30).status_code


def _complete(
    source: str | None,
    base: str,
    adapter: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    with plain_http_client(source, timeout) as client:
        r = client.post(
            f"{base}/v1/completions",
            json={"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            headers={"x-adapter-id": adapter, **(headers or {})},
        )
        if r.status_code != 200:
            raise MeshError(f"{source} -> {adapter}: HTTP {r.status_code}: {r.text[:300]}")
        result: dict[str, Any] = r.json()
        return result


# ---- the demo's story ------------------------------------------------------------------------


class TenantTraffic:
    """Each tenant sends completions in a loop (its own adapter); counts per tenant."""

    def __init__(
        self,
        mesh: LocalMesh,
        sources: Sequence[str],
        adapters: Sequence[str],
        max_tokens: int = 8,
        concurrency: int = 1,
        pause_s: float = 0.05,
    ) -> None:
        self.mesh = mesh
        self.ok: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.last_error = ""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(src, adapters[i % len(adapters)], max_tokens, pause_s),
                daemon=True,
            )
            for i, src in enumerate(sources)
            for _ in range(concurrency)
        ]

    def _run(self, source: str, adapter: str, max_tokens: int, pause_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.mesh.complete(
                    source, adapter, "Tell me about adapters", max_tokens, timeout=60
                )
                self.ok[source] += 1
            except Exception as exc:
                self.failed[source] += 1
                self.last_error = str(exc)[:200]
            self._stop.wait(pause_s)

    def start(self) -> TenantTraffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)


class Story:
    """Runs the demo's steps and renders the per-shard table."""

    def __init__(self, mesh: LocalMesh, console: Any, live: bool) -> None:
        self.mesh = mesh
        self.console = console
        self.live = live
        self.traffic: list[TenantTraffic] = []
        self.weights_seen: list[tuple[float, dict[str, int], str]] = []

    # -- views --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        agent = self.mesh.agent_status()
        try:
            cp = self.mesh.cp_status()
            loads = {ld.shard_id: ld for ld in cp.loads}
        except grpc.RpcError:
            loads = {}
        flows = self.mesh.agent_flows()
        hosts = {s: self.mesh.envoy_hosts(s) for s in self.mesh.shard_ids}
        return {"agent": agent, "loads": loads, "flows": flows, "hosts": hosts}

    def table(self, title: str) -> Any:
        from rich.table import Table

        snap = self.snapshot()
        agent, loads, flows, hosts = snap["agent"], snap["loads"], snap["flows"], snap["hosts"]
        overrides = {o["shard_id"]: o["weight"] for o in agent["overrides"]}
        pins: dict[str, list[str]] = {}
        for p in agent["pins"]:
            pins.setdefault(p["shard_id"], []).append(p["cidr"])
        tenants: dict[str, list[str]] = {}
        for src in self.mesh.tenants:
            if src in flows:
                tenants.setdefault(flows[src], []).append(src.rsplit(".", 1)[1])
        t = Table(
            title=f"{title}  (assignment v{agent['applied_version']}: {agent['reason'] or '-'})",
            title_justify="left",
        )
        for col in (
            "shard",
            "weight",
            "override",
            "pins",
            "tenants (.x)",
            "pkt/s",
            "new flows/s",
            "queue",
            "running",
            "util",
            "workers up",
        ):
            t.add_column(
                col, justify="left" if col in ("shard", "pins", "tenants (.x)") else "right"
            )
        for s in agent["shards"]:
            ld = loads.get(s["id"])
            up = sum(1 for flags in hosts.get(s["id"], {}).values() if not flags)
            t.add_row(
                s["id"],
                f"{s['weight'] / 100:.1f}%",
                f"{overrides[s['id']] / 100:.0f}%" if s["id"] in overrides else "",
                ",".join(pins.get(s["id"], [])),
                ",".join(tenants.get(s["id"], [])),
                f"{s['packets_per_s']:.0f}",
                f"{s['new_flows_per_s']:.1f}",
                f"{ld.queue_depth:.1f}" if ld and ld.known else "?",
                f"{ld.running:.1f}" if ld and ld.known else "?",
                f"{ld.utilization:.2f}" if ld and ld.known else "?",
                f"{up}/{len(hosts.get(s['id'], {}))}",
            )
        ok = sum(sum(tr.ok.values()) for tr in self.traffic)
        failed = sum(sum(tr.failed.values()) for tr in self.traffic)
        t.caption = f"requests: {ok} ok, {failed} failed"
        return t

    def show(self, title: str, seconds: float) -> None:
        """Refresh the table for ``seconds`` (live) or print it once at the end."""
        if self.live:
            from rich.live import Live

            with Live(self.table(title), console=self.console, refresh_per_second=2) as live:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    time.sleep(1.0)
                    live.update(self.table(title))
        else:
            time.sleep(seconds)
            self.console.print(self.table(title))

    def step(self, text: str) -> None:
        self.console.print(f"\n[bold cyan]==>[/bold cyan] [bold]{text}[/bold]")

    def run_adapterctl(self, *args: str) -> None:
        # Quoted as a shell needs it, so the printed command works when pasted.
        self.console.print(f"[dim]$ adapterctl {shlex.join(args)}[/dim]", highlight=False)
        out = self.mesh.adapterctl(*args)
        for line in out.stdout.strip().splitlines():
            self.console.print(f"  {line}", highlight=False)

    def weights(self) -> dict[str, int]:
        return {s["id"]: int(s["weight"]) for s in self.mesh.agent_status()["shards"]}

    # -- the story ------------------------------------------------------------------------------

    def run(self, spike_timeout_cycles: int = 2) -> dict[str, Any]:
        mesh, cfg = self.mesh, self.mesh.config
        results: dict[str, Any] = {}
        adapters = list(cfg.adapters)
        steady = mesh.tenants[:-1]
        spiker = mesh.tenants[-1]

        self.step(
            f"1. Tenant traffic: {len(steady)} tenants, each with its own adapter, "
            f"through classifier -> Envoy -> workers"
        )
        # Light and steady: the rebalancer should see calm shards and hold the weights.
        self.traffic.append(TenantTraffic(mesh, steady, adapters, pause_s=0.5).start())
        self.show("steady traffic", 3 * cfg.interval_s / 2 + 2)

        self.step("2. An operator override: s0 takes 60% of new flows")
        self.run_adapterctl("override", "set", "s0", "60%", "--reason", "demo: canary s0")
        # From the control plane's answer to the node's maps and xDS holding it.
        t0 = time.monotonic()
        mesh.wait_agent_applied(timeout=10)
        results["override_applied_s"] = time.monotonic() - t0
        self.console.print(
            "  on the node (maps + xDS) "
            f"{results['override_applied_s'] * 1000:.0f} ms after adapterctl returned"
        )
        fresh = mesh.probe_sources[:20]
        for src in fresh:
            mesh.complete(src, adapters[0], "hello", 2)
        flows = mesh.agent_flows()
        arrivals = Counter(flows.get(src, "?") for src in fresh)
        results["override_new_flows"] = dict(arrivals)
        self.console.print(
            f"  {len(fresh)} new tenants arrive: "
            + ", ".join(f"{sid} {arrivals.get(sid, 0)}" for sid in mesh.shard_ids)
        )
        self.show("override set", 3)
        self.run_adapterctl("override", "clear", "s0")
        mesh.wait_agent_applied(timeout=10)

        last = mesh.shard_ids[-1]
        self.step(f"3. Pin tenant {spiker} to {last} (pins beat sticky flows and Maglev)")
        self.run_adapterctl("pin", f"{spiker}/32", last)
        t0 = time.monotonic()
        mesh.wait_agent_applied(timeout=10)
        mesh.complete(spiker, adapters[0], "hello", 4)
        results["pin_first_request_s"] = time.monotonic() - t0
        landed = mesh.agent_flows().get(spiker)
        self.console.print(
            f"  {spiker} now goes to {landed} "
            f"(its next request was served {results['pin_first_request_s'] * 1000:.0f} ms "
            "after adapterctl returned)"
        )
        results["pin_landed"] = landed
        self.show("tenant pinned", 3)

        self.step(f"4. Load spike: {spiker} floods {last} (rebalance every {cfg.interval_s:g}s)")
        before = self.weights()[last]
        spike = TenantTraffic(
            mesh, [spiker], adapters[:1], max_tokens=48, concurrency=16, pause_s=0.0
        ).start()
        self.traffic.append(spike)
        t0 = time.monotonic()
        deadline = t0 + spike_timeout_cycles * cfg.interval_s + cfg.interval_s
        moved_at = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            w = self.weights()[last]
            if w < before * 0.9 and moved_at is None:
                moved_at = time.monotonic() - t0
                break
        results["spike_weight_before"] = before
        results["spike_weight_after"] = self.weights()[last]
        results["spike_moved_s"] = moved_at
        if moved_at is not None:
            self.console.print(
                f"  weight of {last}: {before / 100:.1f}% -> "
                f"{results['spike_weight_after'] / 100:.1f}% after {moved_at:.1f}s "
                f"({moved_at / cfg.interval_s:.1f} rebalance intervals)"
            )
        else:
            self.console.print(
                f"  [red]weight of {last} did not move within {spike_timeout_cycles} cycles[/red]"
            )
        self.show("during the spike", cfg.interval_s)
        spike.stop()
        for tr in self.traffic:
            tr.stop()
        results["requests_ok"] = sum(sum(tr.ok.values()) for tr in self.traffic)
        results["requests_failed"] = sum(sum(tr.failed.values()) for tr in self.traffic)
        self.step(
            f"Done: {results['requests_ok']} requests served, {results['requests_failed']} failed"
        )
        return results


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rich.console import Console

    from adaptermesh.clisetup import DefaultsHelpFormatter

    p = argparse.ArgumentParser(
        prog="adaptermesh demo",
        formatter_class=DefaultsHelpFormatter,
        description="The whole mesh in network namespaces: traffic, an override, a pin and a "
        "load spike. `adaptermesh demo classifier` shows the datapath alone.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--shards", type=int, default=3, choices=[2, 3], help="shards of Envoy + CPU workers"
    )
    p.add_argument("--interval", type=float, default=5.0, help="rebalance interval (s)")
    p.add_argument("--prefix", default="ammesh", help="namespace/interface prefix (<= 8 chars)")
    p.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live-refreshing tables (default: when stdout is a terminal)",
    )
    p.add_argument("--keep-workdir", action="store_true", help="keep logs and state")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        print("adaptermesh demo: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=132)  # logs and READMEs get the whole table
    live = console.is_terminal if args.live is None else args.live
    started = time.monotonic()

    def progress(msg: str) -> None:
        console.print(f"[dim][{time.monotonic() - started:5.1f}s][/dim] {msg}")

    def on_term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    mesh = LocalMesh(
        MeshConfig(
            prefix=args.prefix,
            shards=args.shards,
            probe_sources=20,
            interval_s=args.interval,
            keep_workdir=args.keep_workdir,
        ),
        progress=progress,
    )
    code = 0
    try:
        console.rule("[bold]adaptermesh: a local mesh in network namespaces")
        mesh.start()
        progress(
            f"mesh up: {args.shards} shards x {mesh.config.workers_per_shard} workers, "
            f"{len(mesh.tenants)} tenants, VIP {mesh.vip}:{SERVICE_PORT}"
        )
        results = Story(mesh, console, live).run()
        if results["requests_failed"] or results["spike_moved_s"] is None:
            code = 1
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: tearing down[/yellow]")
        code = 130
    except (MeshError, RuntimeError, OSError, grpc.RpcError) as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        code = 1
    finally:
        mesh.stop()
        if args.keep_workdir:
            console.print(f"logs and state kept in {mesh.workdir}")
        progress("torn down: namespaces, processes and pins removed")
    return code


def _start_moto_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen[bytes], int]:
    """A moto S3 server as its own process on 127.0.0.1 (in the calling thread's network
    namespace), and its port, once it accepts connections. Its own process, not a thread of
    the process that runs the load and times every stream: when a stalled store is released it
    answers every held connection and retry at once, and in the measuring process that work
    delayed every stream's timestamps (docs/faults.md)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server, port
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                server.wait()
                raise MeshError(f"the moto S3 server did not start on port {port}") from None
            time.sleep(0.05)
