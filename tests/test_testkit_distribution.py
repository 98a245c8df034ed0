"""The test kit is its own distribution: the adaptermesh wheel leaves it out, testkit/ builds
it, and the commands that run it (``adaptermesh demo``, ``adaptermesh dev``) stop with a
message naming what to install when it is absent."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from adaptermesh.cli import demo, dev
from adaptermesh.cli import testkit as testkit_loader
from adaptermesh.cli.testkit import NoTestkitError, load_testkit

REPO = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def _wheel_files(project: Path, out: Path) -> list[str]:
    """The file list of the wheel pip builds from ``project`` (offline: no build isolation,
    no dependencies), built from a copy so the checkout gets no build folders."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(project),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.mark.slow
def test_the_adaptermesh_wheel_has_no_testkit(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO / "pyproject.toml", tree)
    shutil.copy(REPO / "README.md", tree)
    shutil.copytree(REPO / "src", tree / "src", ignore=_IGNORE)
    files = _wheel_files(tree, tmp_path / "out")
    assert "adaptermesh/__init__.py" in files
    assert "adaptermesh/cli/testkit.py" in files
    assert [f for f in files if f.startswith("adaptermesh_testkit")] == []


@pytest.mark.slow
def test_testkit_builds_its_own_wheel_with_every_module(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "testkit", tree / "testkit", ignore=_IGNORE)
    shutil.copytree(
        REPO / "src" / "adaptermesh_testkit", tree / "src" / "adaptermesh_testkit", ignore=_IGNORE
    )
    files = _wheel_files(tree / "testkit", tmp_path / "out")
    sources = sorted(
        f"adaptermesh_testkit/{p.name}"
        for p in (REPO / "src" / "adaptermesh_testkit").iterdir()
        if p.suffix == ".py" or p.name == "py.typed"
    )
    assert sorted(f for f in files if f.startswith("adaptermesh_testkit/")) == sources
    assert not [f for f in files if f.startswith("adaptermesh/")]


@pytest.fixture
def no_testkit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test kit absent, as in an environment that installed adaptermesh alone."""
    for name in list(sys.modules):
        if name == "adaptermesh_testkit" or name.startswith("adaptermesh_testkit."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "adaptermesh_testkit", None)


@pytest.mark.usefixtures("no_testkit")
@pytest.mark.parametrize(
    ("argv", "command"),
    [(["classifier"], "adaptermesh demo classifier"), ([], "adaptermesh demo")],
)
def test_demo_without_testkit_names_what_to_install(
    argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{command} runs the test kit, which is not installed")
    assert "adaptermesh-testkit" in err
    assert "pip install ./testkit" in err


@pytest.mark.usefixtures("no_testkit")
def test_dev_without_testkit_names_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(NoTestkitError, match=r"adaptermesh dev up .*adaptermesh-testkit"):
        dev.make_model(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.usefixtures("no_testkit")
def test_dev_make_model_without_testkit_exits_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dev.main(["make-model", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptermesh dev make-model runs the test kit, which is not installed")
    assert "pip install ./testkit" in err
    assert not (tmp_path / "m").exists()


def test_a_missing_dependency_of_the_testkit_is_not_reported_as_the_testkit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test kit is installed but something it imports is not: that module's own error."""

    def import_module(name: str) -> object:
        raise ModuleNotFoundError("No module named 'scapy'", name="scapy")

    monkeypatch.setattr(testkit_loader.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="scapy"):
        load_testkit("netns", "adaptermesh demo")


def test_the_testkit_loads_when_installed() -> None:
    checkpoints = load_testkit("checkpoints", "adaptermesh dev up")
    assert checkpoints.__name__ == "adaptermesh_testkit.checkpoints"
    assert callable(checkpoints.make_tiny_model)
