"""The locks in requirements/ against pyproject.toml, against each other, and against the
environment the suite runs in (scripts/lock.py writes them; docs/setup.md says how)."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK_DIR = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


lock = _load("adaptermesh_lock", REPO / "scripts" / "lock.py")
lock_env = _load("adaptermesh_lock_env", REPO / "scripts" / "lock_env.py")

_ENTRY = re.compile(r"^(\S+)==(\S+) \\$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) for each requirement of a lock."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        m = _ENTRY.match(line)
        if m:
            current = canonical(m.group(1))
            out[current] = (m.group(2), [])
            continue
        h = re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line)
        if h and current:
            out[current][1].append(h.group(1))
        elif not line.startswith((" ", "#")) and line.strip():
            pytest.fail(f"{path.name}: a line that is neither a pin nor a hash: {line!r}")
    return out


def requirements_of(extra: str) -> list[Requirement]:
    """pyproject's requirements for adaptermesh[extra], its own extras expanded."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for text in project["optional-dependencies"][e]:
            r = Requirement(text)
            if canonical(r.name) == "adaptermesh":
                todo.extend(r.extras)
            else:
                reqs.append(r)
    build_in = (LOCK_DIR / "build.in").read_text().splitlines()
    reqs += [Requirement(x) for x in build_in if x.strip() and not x.startswith("#")]
    reqs += [Requirement(x) for x in PYPROJECT["build-system"]["requires"]]
    return reqs


LOCK_NAMES = sorted(lock.LOCKS)


def test_every_environment_has_a_lock() -> None:
    assert set(LOCK_NAMES) == {
        "dev",
        "agent",
        "control-plane",
        "bridge",
        "worker-cpu",
        "worker-cuda",
    }
    on_disk = {p.stem for p in LOCK_DIR.glob("*.lock")}
    assert on_disk == set(LOCK_NAMES), on_disk ^ set(LOCK_NAMES)


@pytest.mark.parametrize("name", LOCK_NAMES)
def test_the_lock_satisfies_pyprojects_ranges(name: str) -> None:
    extra, python, torch = lock.LOCKS[name]
    pins = entries(LOCK_DIR / f"{name}.lock")
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    for req in requirements_of(extra):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        got = pins.get(canonical(req.name))
        assert got is not None, f"{name}.lock pins nothing for {req}"
        assert req.specifier.contains(got[0], prereleases=True), (
            f"{name}.lock pins {req.name}=={got[0]}, outside pyproject's {req}: run `make lock`"
        )
    if torch:
        assert pins["torch"][0] == torch.split("==")[1]


@pytest.mark.parametrize("name", LOCK_NAMES)
def test_every_pin_is_exact_and_hashed(name: str) -> None:
    pins = entries(LOCK_DIR / f"{name}.lock")
    assert pins
    for pkg, (version, hashes) in pins.items():
        Version(version)  # an exact release, not a range
        assert hashes, f"{name}.lock: {pkg}=={version} has no hash"


@pytest.mark.parametrize("name", [n for n in LOCK_NAMES if lock.LOCKS[n][1] == "3.11"])
def test_environments_on_one_python_share_the_dev_versions(name: str) -> None:
    """An image runs the versions the suite ran with: every package an image's lock shares
    with dev.lock has dev.lock's version and hashes."""
    dev = entries(LOCK_DIR / "dev.lock")
    for pkg, pin in entries(LOCK_DIR / f"{name}.lock").items():
        assert pkg in dev, f"{name}.lock: {pkg} is not in dev.lock, so the suite never ran it"
        assert pin == dev[pkg], f"{name}.lock: {pkg}=={pin[0]} against dev.lock's {dev[pkg][0]}"


def test_the_cuda_worker_differs_from_dev_only_where_its_torch_or_python_asks() -> None:
    dev = entries(LOCK_DIR / "dev.lock")
    cuda = entries(LOCK_DIR / "worker-cuda.lock")
    assert cuda["torch"][0] == lock.TORCH_CUDA.split("==")[1]
    for pkg, (version, _) in cuda.items():
        if lock._NOT_SHARED.match(f"{pkg}=="):
            continue
        assert pkg in dev, f"worker-cuda.lock: {pkg} is not in dev.lock"
        assert version == dev[pkg][0], f"worker-cuda.lock: {pkg}=={version}, dev {dev[pkg][0]}"


def test_this_environment_is_exactly_the_dev_lock() -> None:
    """The suite runs in what dev.lock pins, nothing more (scripts/setup.sh installs it and
    removes strays): a drift between the lock and what was tested fails here."""
    assert lock_env.differences(LOCK_DIR / "dev.lock") == []


def test_the_differences_name_each_drift(tmp_path: Path) -> None:
    installed = lock_env.installed()
    (name, version), *_ = sorted(installed.items())
    fake = tmp_path / "x.lock"
    fake.write_text(f"{name}==0.0.0 \\\n    --hash=sha256:{'0' * 64}\nnot-here==1.0 \\\n")
    diffs = lock_env.differences(fake)
    assert f"{name}==0.0.0: {version} installed" in diffs
    assert "not-here==1.0: not installed" in diffs
    others = [d for d in diffs if d.endswith("not in x.lock")]
    assert len(others) == len(set(installed) - {name} - lock_env._OWN)


def test_setup_keeps_the_testkit_distribution_it_installs() -> None:
    """scripts/setup.sh installs the test kit (testkit/) beside the lock, then prunes what the
    lock does not name: the distribution testkit/ builds is one the pruning keeps, and the
    name the commands that load it ask for."""
    from adaptermesh.cli.testkit import TESTKIT_DISTRIBUTION

    name = tomllib.loads((REPO / "testkit" / "pyproject.toml").read_text())["project"]["name"]
    assert canonical(name) == canonical(TESTKIT_DISTRIBUTION)
    assert canonical(name) in lock_env._OWN
    assert "-e ./testkit" in (REPO / "scripts" / "setup.sh").read_text()


def test_generated_grpc_modules_come_from_the_locked_grpcio_tools() -> None:
    tools = entries(LOCK_DIR / "dev.lock")["grpcio-tools"][0]
    generated = REPO / "src" / "adaptermesh" / "proto" / "adaptermesh" / "v1"
    for path in sorted(generated.glob("*_pb2_grpc.py")):
        m = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", path.read_text(), re.M)
        assert m, path.name
        assert m.group(1) == tools, (
            f"{path.name} was generated by grpcio-tools {m.group(1)}, the lock has {tools}: "
            "run `make proto` and commit the result"
        )
    # grpcio itself must be at least the generator's release (the modules check at import).
    assert SpecifierSet(f">={tools}").contains(entries(LOCK_DIR / "dev.lock")["grpcio"][0])


def test_setup_installs_from_the_lock_with_hashes() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "pip install -q --require-hashes --no-deps -r requirements/dev.lock" in setup
    assert "--no-deps --no-build-isolation -e ." in setup
    assert "lock_env.py prune requirements/dev.lock" in setup
    # No install step of the setup resolves a dependency by itself.
    for line in re.findall(r"-m pip install[^\n]*", setup):
        assert "--no-deps" in line, line
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^lock: setup\n\t\$\(PY\) scripts/lock\.py", makefile, re.M)


@pytest.mark.parametrize("name", LOCK_NAMES)
def test_a_lock_names_no_temporary_path(name: str) -> None:
    """Written again from the same inputs, a lock is the same file (`lock.py --check`)."""
    text = (LOCK_DIR / f"{name}.lock").read_text()
    assert "/tmp" not in text
    assert str(REPO) not in text
