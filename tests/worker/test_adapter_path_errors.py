"""Adapter path errors say what is wrong: a path that does not exist, a directory without
adapter_config.json, a path that escapes the adapter root; never a traceback."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.cli import LoraModule, load_lora_modules
from adaptermesh.worker.peft_adapter import AdapterValidationError, resolve_in_root
from adaptermesh.worker.types import AdapterNotFoundError

from .conftest import Tiny, request

# Every refusal resolve_in_root gives, as "lora_path: <message>".
REFUSALS = (
    re.compile(r"must not contain '\.\.'$"),
    re.compile(r"must not contain NUL$"),
    re.compile(r"cannot be resolved: "),
    re.compile(r" does not exist$"),
    re.compile(r"resolves outside the adapter root "),
)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An adapter root with an adapter, an inner alias, an escaping link, a dangling escaping
    link and a link loop; and a directory beside it."""
    base = tmp_path_factory.mktemp("paths")
    root, outside = base / "root", base / "outside"
    (root / "inner" / "deep").mkdir(parents=True)
    (root / "inner" / "adapter_config.json").write_text("{}")
    (root / "empty").mkdir()
    outside.mkdir()
    (outside / "file").write_text("x")
    os.symlink(root / "inner", root / "alias")
    os.symlink(outside, root / "out")
    os.symlink(outside / "missing", root / "dangling")
    os.symlink(root / "loop", root / "loop")
    return root, outside


def _refusal(exc: AdapterValidationError) -> str:
    assert exc.field == "lora_path", exc
    return str(exc).split("lora_path: ", 1)[1]


def test_a_missing_path_is_reported_missing_by_name(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    missing = outside / "typo" / "adapter"
    with pytest.raises(AdapterValidationError) as err:
        resolve_in_root(root, "sql", str(missing))
    assert _refusal(err.value) == f"{missing} does not exist"
    assert "outside the adapter root" not in str(err.value)


def test_real_escapes_are_still_refused(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    for path in (str(outside), str(outside / "file"), "out", "out/file"):
        with pytest.raises(AdapterValidationError, match="resolves outside the adapter root"):
            resolve_in_root(root, "sql", path)
    with pytest.raises(AdapterValidationError, match=re.escape("must not contain '..'")):
        resolve_in_root(root, "sql", "../outside")


def test_paths_inside_the_root_resolve(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    assert resolve_in_root(root, "x", "alias") == (root / "inner").resolve()
    assert resolve_in_root(root, "inner") == (root / "inner").resolve()
    # Inside the root, a missing directory resolves; reading it says it is missing.
    assert resolve_in_root(root, "x", "nope") == root.resolve() / "nope"


_PARTS = st.sampled_from(
    ["inner", "deep", "alias", "out", "dangling", "loop", "empty", "file", "missing", "..", "."]
) | st.text(max_size=12)


@settings(max_examples=400, deadline=None)
@given(
    prefix=st.sampled_from(["", "/", "ROOT/", "OUTSIDE/", "ROOT/../"]),
    parts=st.lists(_PARTS, max_size=5),
    nul=st.booleans(),
)
def test_any_path_resolves_inside_or_gets_a_specific_refusal(
    tree: tuple[Path, Path], prefix: str, parts: list[str], nul: bool
) -> None:
    root, outside = tree
    path = (
        prefix.replace("ROOT", str(root)).replace("OUTSIDE", str(outside))
        + "/".join(parts)
        + ("\x00" if nul else "")
    )
    try:
        resolved = resolve_in_root(root, "name", path)
    except AdapterValidationError as exc:
        message = _refusal(exc)
        assert any(r.search(message) for r in REFUSALS), message
        rel = Path(path)
        candidate = rel if rel.is_absolute() else root.resolve() / rel
        if message.endswith(" does not exist"):
            assert not os.path.lexists(candidate)
        if message.startswith("resolves outside"):
            assert os.path.lexists(candidate)  # a real escape, not a typo
        return
    assert resolved.is_relative_to(root.resolve())


async def test_a_directory_without_adapter_config_is_named(
    tiny: Tiny, tmp_path: Path, make_engine: Any
) -> None:
    bare = tmp_path / "bare-root"
    bare.mkdir()
    (bare / "notes").mkdir()
    eng = make_engine(root=bare)
    with pytest.raises(AdapterNotFoundError) as err:
        eng.submit(request("r", tiny.encode("hi"), "notes"))
    assert "has no adapter_config.json" in str(err.value)
    assert "no adapter with this name" not in str(err.value)
    with pytest.raises(AdapterNotFoundError, match="no adapter with this name"):
        eng.submit(request("r2", tiny.encode("hi"), "absent"))
    # An explicit load of that directory says the same.
    with pytest.raises(AdapterNotFoundError, match=r"has no adapter_config\.json"):
        await eng.load_adapter("notes", "notes")


async def test_lora_modules_report_a_missing_path(
    tiny: Tiny, tmp_path: Path, make_engine: Any
) -> None:
    eng = make_engine()
    missing = tmp_path / "adapters" / "sql"
    with pytest.raises(ValueError) as err:
        await load_lora_modules(eng, [LoraModule("sql", str(missing))])
    message = str(err.value)
    assert message.startswith(f"--lora-modules: cannot load 'sql' from {missing}: ")
    assert message.endswith(f"{missing} does not exist")
    assert "outside the adapter root" not in message
