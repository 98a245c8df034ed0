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

It prints the commands that reach the mesh, stays up until Ctrl-C (or SIGTERM) and then
stops every process, deletes the veth pair (and with it the classifier's filter) and the
pinned maps. The tiny model and the logs stay in the work directory; everything else there
is removed. ``adaptermesh dev down`` removes what a killed ``up`` left behind.

``up`` and ``down`` need root (a veth pair, eBPF).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
# Kept across runs: building the model takes seconds, and the logs explain a failed run.
KEPT = ("model", "adapters", "logs")


class DevError(RuntimeError):
    pass


def make_model(directory: Path) -> tuple[Path, Path]:
    """The tiny model in ``directory/model`` and its adapters under ``directory/adapters``."""
    from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

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

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        down(self.workdir, self.prefix)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.progress("building the tiny model and its adapters (once)")
        model_dir, adapter_root = make_model(self.workdir)
        self._write_tokens()
        self.progress(f"creating the veth pair {self.iface}/{self.peer}")
        _ip("link", "add", self.iface, "type", "veth", "peer", "name", self.peer)
        _ip("link", "set", self.iface, "up")
        _ip("link", "set", self.peer, "up")
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
        self.progress("waiting for a completion through each shard's Envoy")
        request = {"model": ADAPTERS[0], "prompt": "hello", "max_tokens": 2}
        for i, sid in enumerate(self.shard_ids):
            service = f"http://127.0.0.1:{SERVICE_PORT + i}/v1/completions"
            self._wait(
                f"Envoy of {sid}",
                lambda service=service: _http_status(service, request) == 200,
                60,
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

Logs: {self.workdir}/logs. Ctrl-C stops everything."""


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
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    make = sub.add_parser(
        "make-model",
        help="write a tiny random Llama (DIR/model) and two adapters (DIR/adapters)",
    )
    make.add_argument("dir", type=Path, metavar="DIR")
    for name, text in (
        ("up", "start the mesh, print how to reach it, stop it all on Ctrl-C (root)"),
        ("down", "remove what a killed `up` left: processes, veth pair, pinned maps (root)"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
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
    return p


def _on_term(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "make-model":
        model_dir, adapter_root = make_model(args.dir)
        print(f"model {model_dir} (serve it as {BASE_MODEL}), adapters {adapter_root}: ", end="")
        print(", ".join(ADAPTERS))
        return 0
    if os.geteuid() != 0:
        print(f"adaptermesh dev {args.command}: needs root (a veth pair, eBPF)", file=sys.stderr)
        return 2
    if args.command == "down":
        down(args.workdir.resolve(), args.prefix)
        print(f"removed the processes, {args.prefix}0 and /sys/fs/bpf/{args.prefix}")
        return 0
    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {msg}", flush=True)

    try:
        mesh = DevMesh(
            args.workdir.resolve(), args.prefix, progress, args.shards, args.workers_per_shard
        )
    except DevError as exc:
        print(f"adaptermesh dev up: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_term)
    code = 0
    try:
        mesh.start()
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
        progress("stopped: processes, veth pair and pinned maps removed")
    return code


if __name__ == "__main__":
    sys.exit(main())
