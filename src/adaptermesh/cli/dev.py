"""``adaptermesh dev``: the whole mesh on one machine, by hand or with one command.

``adaptermesh dev make-model DIR`` writes a tiny random Llama (``DIR/model``, served as
``tinyllama``) and two LoRA adapters for it (``DIR/adapters/support``, ``DIR/adapters/sql``),
enough for CPU workers.

``adaptermesh dev up`` starts, in the current network namespace, what docs/operator-guide.md
("One machine, by hand") starts command by command:

- a veth pair ``<prefix>0``/``<prefix>1`` whose first end carries the agent's classifier;
- the control plane on 127.0.0.1:7400 (SQLite under the work directory, bearer tokens);
- ``--shards`` shards (default 2), ``s0``, ``s1``, ...: shard ``sI`` is ``--workers-per-shard``
  CPU workers (default 1; ports from 127.0.0.1:8101 on, in shard order) serving the tiny model
  and its adapters, with an admin token for load and unload, behind its own Envoy listening on
  127.0.0.1:(8080+I), steered by mark 257+I;
- the agent (xDS on 127.0.0.1:18000, /metrics and /status on 127.0.0.1:9464, the external
  processor on 127.0.0.1:18100, pins under ``/sys/fs/bpf/<prefix>``);
- one Envoy per shard from the virtualenv, bootstrapped from the agent with the external
  processor's cluster (admin on 127.0.0.1:(9901+I)).

Two shards are the least for weight overrides (one shard always has 100%), pins to another
shard and rollouts across shards; each shard's single worker keeps ``up`` quick on two cores.

The veth pair's second end lives in a network namespace of its own, ``<prefix>-client``
(address 10.213.0.2, and .3 to .9 for fresh sources), and ``adaptermesh dev exec -- CMD``
runs a command there: its requests to ``10.213.0.1:8080`` cross the veth and the classifier,
whose mark picks the shard whose Envoy answers (``cli/devrelay.py``), so a pin or an
override visibly changes the shard that answers (``x-adaptermesh-served-by``). A request to
127.0.0.1:8080 goes straight to ``s0``'s Envoy and never meets the classifier.

It prints the commands that reach the mesh, stays up until Ctrl-C (or SIGTERM) and then
stops every process, deletes the veth pair (and with it the classifier's filter), the client
namespace and the pinned maps. The tiny model and the logs stay in the work directory;
everything else there is removed. ``adaptermesh dev down`` removes what a killed ``up`` left
behind.

One mesh at a time: ``up`` takes a lock (``/run/adaptermesh-dev/<prefix>.lock``, with its pid
and work directory) and refuses, before it touches anything, while another ``up`` holds one
for the same prefix or the same work directory; it says how to reach that mesh and how to
stop it. A port already in use is refused the same way, in one line naming the port and its
holder. Another mesh at the same time needs its own ``--prefix`` and ``--workdir`` and its own
network namespace (its ports are the same).

``up``, ``down`` and ``exec`` need root (a veth pair, eBPF, a network namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adaptermesh.cli.devrelay import MarkRelay, shard_for_mark
from adaptermesh.cli.testkit import NoTestkitError, load_testkit

__all__ = ["main"]

DEFAULT_WORKDIR = Path("/tmp/adaptermesh-dev")
DEFAULT_PREFIX = "amdev"
BASE_MODEL = "tinyllama"
ADAPTERS = ("support", "sql")
CONTROL_PLANE = "127.0.0.1:7400"
DEFAULT_SHARDS = 2
DEFAULT_WORKERS_PER_SHARD = 1
MAX_SHARDS = 8
MAX_WORKERS_PER_SHARD = 4
WORKER_BASE_PORT = 8101
SERVICE_PORT = 8080  # shard sI listens on SERVICE_PORT + I
XDS_PORT = 18000
AGENT_METRICS_PORT = 9464
EXT_PROC_PORT = 18100
ENVOY_ADMIN_PORT = 9901  # shard sI's Envoy: ENVOY_ADMIN_PORT + I
FIRST_MARK = 257
PIDS_FILE = "pids"
# What `exec` reads to find the mesh of a work directory (written once the mesh is up).
MESH_FILE = "mesh.json"
# net.ipv4.tcp_fwmark_accept before `up` turned it on (put back by `down`).
FWMARK_FILE = "tcp_fwmark_accept"
FWMARK_SYSCTL = Path("/proc/sys/net/ipv4/tcp_fwmark_accept")
# Kept across runs: building the model takes seconds, and the logs explain a failed run.
KEPT = ("model", "adapters", "logs")
LOCK_DIR = Path("/run/adaptermesh-dev")
# The veth pair's subnet: the node end (the relay listens there) and the client namespace's
# sources (the first is the default; the others are fresh sources for curl --interface).
NODE_ADDR = "10.213.0.1"
CLIENT_ADDRS = tuple(f"10.213.0.{i}" for i in range(2, 10))


class DevError(RuntimeError):
    pass


# ---- one mesh at a time ----------------------------------------------------------------------


def _lock_owner(path: Path) -> dict[str, Any] | None:
    """The owner a live ``up`` wrote into ``path``; None when no process holds the lock (a
    killed ``up`` leaves the file, not the lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner: dict[str, Any] = json.loads(os.read(fd, 4096) or b"{}")
            except ValueError:
                owner = {}
            return owner
        return None  # free: stale
    finally:
        os.close(fd)


def refusal(owner: dict[str, Any]) -> str:
    """What a second ``up`` says: whose mesh runs, how to reach it and how to stop it."""
    pid, workdir = owner.get("pid", "?"), owner.get("workdir", "?")
    return (
        f"a dev mesh is already running (pid {pid}, workdir {workdir}, prefix "
        f"{owner.get('prefix', '?')}); nothing was changed. Reach it with: export "
        f"AMDEV={workdir} ADAPTERMESH_TOKEN_FILE={workdir}/operator.token. Stop it with "
        f"Ctrl-C in its terminal, or kill {pid}"
    )


class DevLock:
    """``LOCK_DIR/<prefix>.lock``, flock-ed for the life of ``up`` (the kernel lets go when the
    process dies, however it dies)."""

    def __init__(self, prefix: str, workdir: Path, lock_dir: Path | None = None) -> None:
        lock_dir = LOCK_DIR if lock_dir is None else lock_dir
        self.path = lock_dir / f"{prefix}.lock"
        self.prefix, self.workdir, self.lock_dir = prefix, workdir, lock_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise DevError naming the mesh that holds one for this prefix
        or this work directory."""
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        for other in sorted(self.lock_dir.glob("*.lock")):
            owner = _lock_owner(other)
            if owner is not None and (
                other == self.path or owner.get("workdir") == str(self.workdir)
            ):
                raise DevError(refusal(owner))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DevError(refusal(_lock_owner(self.path) or {})) from None
        owner = {"pid": os.getpid(), "workdir": str(self.workdir), "prefix": self.prefix}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _holder(port: int) -> str:
    """Who listens on 127.0.0.1:``port`` (or any address), from /proc: "pid N (name)"."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    cmdline = (proc / "cmdline").read_bytes().split(b"\0")
                    words = [w.decode(errors="replace") for w in cmdline if w][:3]
                    shown = " ".join([Path(words[0]).name, *words[1:]]) if words else "?"
                    return f"pid {proc.name} ({shown})"
    return "a process this user cannot see"


def busy_port(ports: list[int]) -> str | None:
    """The first of ``ports`` something already listens on, as one line; None: all free."""
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return (
                    f"127.0.0.1:{port} is in use, probably by {_holder(port)}; nothing was "
                    "changed (stop it, or run the mesh in another network namespace)"
                )
    return None


def make_model(directory: Path, command: str = "adaptermesh dev up") -> tuple[Path, Path]:
    """The tiny model in ``directory/model`` and its adapters under ``directory/adapters``
    (made by the test kit; ``command`` is named when it is not installed)."""
    checkpoints = load_testkit("checkpoints", command)
    make_adapter, make_tiny_model = checkpoints.make_adapter, checkpoints.make_tiny_model
    model_dir = directory / "model"
    adapter_root = directory / "adapters"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir)
    for i, name in enumerate(ADAPTERS):
        if not (adapter_root / name / "adapter_config.json").exists():
            make_adapter(
                adapter_root,
                model_dir,
                name,
                rank=8,
                seed=i + 1,
                target_modules=("q_proj", "v_proj", "o_proj"),
                scale_b=0.5,
            )
    return model_dir, adapter_root


def _bin(name: str) -> str:
    """A console script installed next to this interpreter (the virtualenv's bin)."""
    return str(Path(sys.executable).parent / name)


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise DevError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _http_status(url: str, body: dict[str, Any] | None = None) -> int:
    import httpx

    try:
        if body is None:
            return httpx.get(url, timeout=2).status_code
        return httpx.post(url, json=body, timeout=30).status_code
    except httpx.HTTPError:
        return 0


class DevMesh:
    """The single-machine mesh: :meth:`start`, then :meth:`stop` (also after a failed start)."""

    def __init__(
        self,
        workdir: Path,
        prefix: str,
        progress: Any = print,
        shards: int = DEFAULT_SHARDS,
        workers_per_shard: int = DEFAULT_WORKERS_PER_SHARD,
    ) -> None:
        if not 1 <= len(prefix) <= 13:
            raise DevError("--prefix: 1 to 13 characters (interface names hold 15)")
        if not 1 <= shards <= MAX_SHARDS:
            raise DevError(f"--shards: 1 to {MAX_SHARDS}, not {shards}")
        if not 1 <= workers_per_shard <= MAX_WORKERS_PER_SHARD:
            raise DevError(
                f"--workers-per-shard: 1 to {MAX_WORKERS_PER_SHARD}, not {workers_per_shard}"
            )
        self.shards = shards
        self.workers_per_shard = workers_per_shard
        self.workdir = workdir
        self.prefix = prefix
        self.progress = progress
        self.pin_dir = Path(f"/sys/fs/bpf/{prefix}")
        self.iface, self.peer = f"{prefix}0", f"{prefix}1"
        self.client_ns = client_namespace(prefix)
        self.relay: MarkRelay | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.operator_token_file = workdir / "operator.token"
        self.admin_token_file = workdir / "worker-admin.token"

    # ---- the layout --------------------------------------------------------------------------

    @property
    def shard_ids(self) -> list[str]:
        return [f"s{i}" for i in range(self.shards)]

    def worker_ports(self, shard: int) -> list[int]:
        first = WORKER_BASE_PORT + shard * self.workers_per_shard
        return list(range(first, first + self.workers_per_shard))

    @property
    def all_worker_ports(self) -> list[int]:
        return [port for i in range(self.shards) for port in self.worker_ports(i)]

    @property
    def ports(self) -> list[int]:
        """Every 127.0.0.1 port the mesh listens on, in start order."""
        return [
            int(CONTROL_PLANE.rsplit(":", 1)[1]),
            *self.all_worker_ports,
            XDS_PORT,
            AGENT_METRICS_PORT,
            EXT_PROC_PORT,
            *(SERVICE_PORT + i for i in range(self.shards)),
            *(ENVOY_ADMIN_PORT + i for i in range(self.shards)),
        ]

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        down(self.workdir, self.prefix)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.progress("building the tiny model and its adapters (once)")
        model_dir, adapter_root = make_model(self.workdir)
        self._write_tokens()
        self.progress(
            f"creating the veth pair {self.iface}/{self.peer} ({self.peer} in the network "
            f"namespace {self.client_ns})"
        )
        _ip("link", "add", self.iface, "type", "veth", "peer", "name", self.peer)
        self._client_namespace()
        self.progress(
            f"starting the control plane and {self.shards} x {self.workers_per_shard} CPU worker(s)"
        )
        self._spawn(
            "control-plane",
            [
                _bin("adaptermesh"),
                "control-plane",
                "--state-dir",
                str(self.workdir / "control-plane"),
                "--listen",
                CONTROL_PLANE,
                "--tokens-file",
                str(self.workdir / "tokens"),
                "--worker-admin-token-file",
                str(self.admin_token_file),
            ],
        )
        for port in self.all_worker_ports:
            self._spawn(
                f"worker-{port}",
                [
                    _bin("adaptermesh"),
                    "worker",
                    "--model",
                    str(model_dir),
                    "--adapter-root",
                    str(adapter_root),
                    "--port",
                    str(port),
                    "--device",
                    "cpu",
                    "--served-model-name",
                    BASE_MODEL,
                    "--admin-token-file",
                    str(self.admin_token_file),
                ],
            )
        self._wait("control plane", self._control_plane_serving, 60)
        self.progress(
            "registering the shards "
            + ", ".join(
                f"{sid} (127.0.0.1:{SERVICE_PORT + i})" for i, sid in enumerate(self.shard_ids)
            )
        )
        for i in range(self.shards):
            self._register_shard(i)
        self.progress(f"starting the agent (classifier on {self.iface}) and one Envoy per shard")
        self._spawn(
            "agent",
            [
                _bin("adaptermesh"),
                "agent",
                "--node-id",
                "dev",
                "--control-plane",
                CONTROL_PLANE,
                "--token-file",
                str(self.workdir / "agent.token"),
                "--iface",
                self.iface,
                "--pin-dir",
                str(self.pin_dir),
                "--xds-port",
                str(XDS_PORT),
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(AGENT_METRICS_PORT),
                "--ext-proc-port",
                str(EXT_PROC_PORT),
                "--base-model",
                BASE_MODEL,
                "--state-file",
                str(self.workdir / "agent" / "assignment.pb"),
            ],
        )
        for i in range(self.shards):
            self._start_envoy(i)
        agent_ready = f"http://127.0.0.1:{AGENT_METRICS_PORT}/readyz"
        self._wait("agent", lambda: _http_status(agent_ready) == 200, 90)
        for port in self.all_worker_ports:
            url = f"http://127.0.0.1:{port}/health"
            self._wait(f"worker :{port}", lambda url=url: _http_status(url) == 200, 180)
        self.relay = MarkRelay(
            (NODE_ADDR, SERVICE_PORT),
            lambda mark: (
                None
                if (i := shard_for_mark(mark, FIRST_MARK, self.shards)) is None
                else ("127.0.0.1", SERVICE_PORT + i)
            ),
        )
        self.relay.start()
        self.progress("waiting for a completion through each shard's Envoy")
        request = {"model": ADAPTERS[0], "prompt": "hello", "max_tokens": 2}
        for i, sid in enumerate(self.shard_ids):
            service = f"http://127.0.0.1:{SERVICE_PORT + i}/v1/completions"
            self._wait(
                f"Envoy of {sid}",
                lambda service=service: _http_status(service, request) == 200,
                60,
            )

    def _client_namespace(self) -> None:
        """The peer end in a namespace of its own, so its packets cross the classifier."""
        _ip("netns", "add", self.client_ns)
        _ip("link", "set", self.peer, "netns", self.client_ns)
        ns = ("-n", self.client_ns)
        _ip(*ns, "link", "set", "lo", "up")
        for i, addr in enumerate(CLIENT_ADDRS):
            _ip(*ns, "addr", "add", f"{addr}/{24 if i == 0 else 32}", "dev", self.peer)
        _ip(*ns, "link", "set", self.peer, "up")
        _ip(*ns, "route", "add", "default", "via", NODE_ADDR, "src", CLIENT_ADDRS[0])
        _ip("addr", "add", f"{NODE_ADDR}/24", "dev", self.iface)
        _ip("link", "set", self.iface, "up")
        # An accepted connection keeps its SYN's mark (the classifier's shard); `down` puts
        # the old value back.
        (self.workdir / FWMARK_FILE).write_text(FWMARK_SYSCTL.read_text())
        FWMARK_SYSCTL.write_text("1\n")

    def write_mesh_file(self) -> None:
        """What `exec` (and a second `up`) read about this mesh."""
        (self.workdir / MESH_FILE).write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "prefix": self.prefix,
                    "client_netns": self.client_ns,
                    "service": f"{NODE_ADDR}:{SERVICE_PORT}",
                    "shards": self.shard_ids,
                }
            )
        )

    def _write_tokens(self) -> None:
        operator, agent, admin = (secrets.token_hex(16) for _ in range(3))
        files = {
            # adapterctl's scopes, and the agent's: it reports for its own node ("dev") only.
            "tokens": f"{operator} read,write,rollout operator\n{agent} read,report agent nodes=dev\n",
            "operator.token": operator + "\n",
            "agent.token": agent + "\n",
            "worker-admin.token": admin + "\n",
        }
        for name, text in files.items():
            path = self.workdir / name
            path.write_text(text)
            path.chmod(0o600)

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.workdir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        with open(self.workdir / PIDS_FILE, "a") as fh:
            fh.write(f"{proc.pid} {name}\n")

    def _start_envoy(self, shard: int) -> None:
        from adaptermesh.mesh.bootstrap import bootstrap_json, build_bootstrap, find_envoy

        sid = self.shard_ids[shard]
        bootstrap = build_bootstrap(
            f"dev-envoy-{sid}",
            XDS_PORT,
            node_cluster=f"shard-{sid}",
            admin_port=ENVOY_ADMIN_PORT + shard,
            ext_proc_port=EXT_PROC_PORT,
        )
        config = self.workdir / f"envoy-{sid}.json"
        config.write_text(bootstrap_json(bootstrap))
        self._spawn(
            f"envoy-{sid}",
            [
                find_envoy(),
                "-c",
                str(config),
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "--base-id-path",
                str(self.workdir / f"envoy-{sid}.base-id"),
            ],
        )

    def _call(self, method: str, request: Any) -> Any:
        import grpc

        from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2_grpc

        token = self.operator_token_file.read_text().strip()
        with grpc.insecure_channel(CONTROL_PLANE) as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            return getattr(stub, method)(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=5
            )

    def _control_plane_serving(self) -> bool:
        import grpc

        from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2

        try:
            self._call("GetAssignment", control_plane_pb2.GetAssignmentRequest())
        except grpc.RpcError as exc:
            return bool(exc.code() == grpc.StatusCode.NOT_FOUND)  # serving, nothing published
        return True

    def _register_shard(self, shard_index: int) -> None:
        """A shard as docs/operator-guide.md applies it with ``adapterctl apply -f
        shards.yaml``."""
        from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2

        shard = assignment_pb2.Shard(
            id=self.shard_ids[shard_index],
            service_address="127.0.0.1",
            service_port=SERVICE_PORT + shard_index,
            state=assignment_pb2.SHARD_STATE_ACTIVE,
        )
        for port in self.worker_ports(shard_index):
            shard.endpoints.add(address="127.0.0.1", port=port)
        shard.steer.mark.mark = FIRST_MARK + shard_index
        self._call("UpsertShard", control_plane_pb2.UpsertShardRequest(shard=shard))

    def _wait(self, what: str, ready: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise DevError(f"{what} not ready after {timeout:g}s (logs: {self.workdir}/logs)")
            time.sleep(0.3)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = self.workdir / "logs" / f"{name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise DevError(f"{name} exited ({proc.returncode}):\n{tail}")

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        self.procs.clear()
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        down(self.workdir, self.prefix)

    def instructions(self) -> str:
        """What to paste to reach the mesh (every indented line is a shell command)."""
        shards = ", ".join(
            f"{sid} (Envoy 127.0.0.1:{SERVICE_PORT + i}, worker(s) "
            + ", ".join(f":{port}" for port in self.worker_ports(i))
            + ")"
            for i, sid in enumerate(self.shard_ids)
        )
        worker = self.worker_ports(0)[0]
        return f"""\
The mesh is up: control plane {CONTROL_PLANE}, agent on {self.iface}, shards {shards}.
In another terminal, with the virtualenv active (the guide's examples expect these variables):

  export AMDEV={self.workdir} ADAPTERMESH_TOKEN_FILE={self.operator_token_file}
  export ADMIN_TOKEN=$(cat {self.admin_token_file})
  adapterctl status
  adapterctl shards
  # an OpenAI request through s0's Envoy, by adapter name (the base model is {BASE_MODEL})
  curl -s 127.0.0.1:{SERVICE_PORT}/v1/completions -H 'content-type: application/json' \\
      -d '{{"model": "{ADAPTERS[0]}", "prompt": "hello", "max_tokens": 8}}'
  # one worker directly; loading and unloading adapters needs its admin token
  curl -s 127.0.0.1:{worker}/v1/models
  curl -s -X POST 127.0.0.1:{worker}/v1/load_lora_adapter \\
      -H "authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \\
      -d '{{"lora_name": "{ADAPTERS[1]}", "lora_path": "{self.workdir}/adapters/{ADAPTERS[1]}"}}'
  curl -s -X POST 127.0.0.1:{worker}/v1/unload_lora_adapter \\
      -H "authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \\
      -d '{{"lora_name": "{ADAPTERS[1]}"}}'
  curl -s 127.0.0.1:{AGENT_METRICS_PORT}/status     # the agent
  # through the classifier, from the client namespace: the response names the shard
  adaptermesh dev exec --workdir {self.workdir} -- curl -s -D - -o /dev/null \\
      {NODE_ADDR}:{SERVICE_PORT}/v1/models

Logs: {self.workdir}/logs. Ctrl-C stops everything."""


def client_namespace(prefix: str) -> str:
    return f"{prefix}-client"


def down(workdir: Path, prefix: str) -> None:
    """Stop the processes a previous ``up`` in ``workdir`` started, delete its veth pair and
    pinned maps and its state (the model, the adapters and the logs stay)."""
    pids = workdir / PIDS_FILE
    if pids.exists():
        for line in pids.read_text().splitlines():
            pid_text, _, _name = line.partition(" ")
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                pid = int(pid_text)
                # Only a process group this run started (its leader's pid is the group id).
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGTERM)
                    for _ in range(50):
                        os.kill(pid, 0)
                        time.sleep(0.1)
                    os.killpg(pid, signal.SIGKILL)
    _ip("link", "del", f"{prefix}0", check=False)
    _ip("netns", "del", client_namespace(prefix), check=False)
    saved = workdir / FWMARK_FILE
    if saved.exists():
        with contextlib.suppress(OSError):
            FWMARK_SYSCTL.write_text(saved.read_text())
    shutil.rmtree(f"/sys/fs/bpf/{prefix}", ignore_errors=True)
    if workdir.is_dir():
        for entry in workdir.iterdir():
            if entry.name in KEPT:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adaptermesh dev",
        description="The mesh on one machine: a tiny model, then control plane, agent and "
        "two shards (each an Envoy in front of a CPU worker) in the current network namespace "
        "(docs/operator-guide.md, 'One machine, by hand').",
        allow_abbrev=False,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    make = sub.add_parser(
        "make-model",
        help="write a tiny random Llama (DIR/model) and two adapters (DIR/adapters)",
        allow_abbrev=False,
    )
    make.add_argument("dir", type=Path, metavar="DIR")
    for name, text in (
        ("up", "start the mesh, print how to reach it, stop it all on Ctrl-C (root)"),
        ("down", "remove what a killed `up` left: processes, veth pair, pinned maps (root)"),
    ):
        cmd = sub.add_parser(name, help=text, description=text, allow_abbrev=False)
        cmd.add_argument(
            "--workdir",
            type=Path,
            default=DEFAULT_WORKDIR,
            help=f"model, tokens, state and logs (default {DEFAULT_WORKDIR})",
        )
        cmd.add_argument(
            "--prefix",
            default=DEFAULT_PREFIX,
            help=f"veth pair <prefix>0/<prefix>1, pins /sys/fs/bpf/<prefix> "
            f"(default {DEFAULT_PREFIX})",
        )
        if name == "up":
            cmd.add_argument(
                "--shards",
                type=int,
                default=DEFAULT_SHARDS,
                metavar="N",
                help=f"shards s0..s<N-1>, each its own Envoy on 127.0.0.1:8080+I and CPU "
                f"worker(s) (1-{MAX_SHARDS}; default {DEFAULT_SHARDS})",
            )
            cmd.add_argument(
                "--workers-per-shard",
                type=int,
                default=DEFAULT_WORKERS_PER_SHARD,
                metavar="N",
                help=f"CPU workers behind each shard's Envoy, ports from 8101 on "
                f"(1-{MAX_WORKERS_PER_SHARD}; default {DEFAULT_WORKERS_PER_SHARD})",
            )
    run = sub.add_parser(
        "exec",
        help="run a command in the mesh's client namespace: its requests to "
        f"{NODE_ADDR}:{SERVICE_PORT} cross the classifier (root)",
        description="Run COMMAND in the client namespace of the mesh `up` runs in WORKDIR, "
        f"from source {CLIENT_ADDRS[0]} ({', '.join(CLIENT_ADDRS[1:3])}, ... with curl "
        f"--interface): a request to {NODE_ADDR}:{SERVICE_PORT} crosses the veth and the "
        "classifier, and the shard it picks answers (x-adaptermesh-served-by).",
        allow_abbrev=False,
    )
    run.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help=f"the mesh's work directory (default $AMDEV, else {DEFAULT_WORKDIR})",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return p


def _exec(workdir_arg: Path | None, argv: list[str]) -> int:
    from adaptermesh.bpf.namespace import enter

    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "adaptermesh dev exec: no command (adaptermesh dev exec -- curl ...)", file=sys.stderr
        )
        return 2
    env_workdir = os.environ.get("AMDEV")
    if workdir_arg is not None:
        workdir, named = workdir_arg, f"--workdir {workdir_arg}"
    elif env_workdir:
        workdir, named = Path(env_workdir), f"AMDEV={env_workdir}"
    else:
        workdir, named = DEFAULT_WORKDIR, f"the default work directory {DEFAULT_WORKDIR}"
    try:
        mesh = json.loads((workdir / MESH_FILE).read_text())
    except (OSError, ValueError):
        print(
            f"adaptermesh dev exec: {named}: no dev mesh is up there (start one with "
            "adaptermesh dev up)",
            file=sys.stderr,
        )
        return 2
    try:
        enter(mesh["client_netns"])
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"adaptermesh dev exec: {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp replaced this process


def _on_term(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "make-model":
        try:
            model_dir, adapter_root = make_model(args.dir, "adaptermesh dev make-model")
        except NoTestkitError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"model {model_dir} (serve it as {BASE_MODEL}), adapters {adapter_root}: ", end="")
        print(", ".join(ADAPTERS))
        return 0
    if os.geteuid() != 0:
        print(f"adaptermesh dev {args.command}: needs root (a veth pair, eBPF)", file=sys.stderr)
        return 2
    if args.command == "exec":
        return _exec(args.workdir, args.argv)
    workdir = args.workdir.resolve()
    lock = DevLock(args.prefix, workdir)
    if args.command == "down":
        owner = _lock_owner(lock.path)
        if owner is not None:
            print(
                f"adaptermesh dev down: {refusal(owner)} (down removes what a killed up left)",
                file=sys.stderr,
            )
            return 1
        down(workdir, args.prefix)
        print(f"removed the processes, {args.prefix}0 and /sys/fs/bpf/{args.prefix}")
        return 0
    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {msg}", flush=True)

    try:
        mesh = DevMesh(workdir, args.prefix, progress, args.shards, args.workers_per_shard)
    except DevError as exc:
        print(f"adaptermesh dev up: {exc}", file=sys.stderr)
        return 2
    # Refused before anything is touched: no test kit (the tiny model comes from it), another
    # up's lock, then a port in use.
    try:
        load_testkit("checkpoints", "adaptermesh dev up")
    except NoTestkitError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        lock.acquire()
    except DevError as exc:
        print(f"adaptermesh dev up: {exc}", file=sys.stderr)
        return 1
    busy = busy_port(mesh.ports)
    if busy is not None:
        lock.release()
        print(f"adaptermesh dev up: {busy}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _on_term)
    code = 0
    try:
        mesh.start()
        mesh.write_mesh_file()
        print(mesh.instructions(), flush=True)
        while True:
            mesh.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
    except (DevError, OSError) as exc:
        print(f"adaptermesh dev up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        mesh.stop()
        lock.release()
        progress("stopped: processes, veth pair, client namespace and pinned maps removed")
    return code


if __name__ == "__main__":
    sys.exit(main())
