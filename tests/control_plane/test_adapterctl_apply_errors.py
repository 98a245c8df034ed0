"""`adapterctl apply -f` and `rules apply -f` refusing a file: duplicates named with both
positions, YAML errors with their line and column, dangling references caught before any
plan line is printed, and "nothing applied" whenever apply refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import Result

from .test_adapterctl import run, server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

WEB = """\
kind: Shard
metadata: {name: web}
spec: {endpoints: ["10.0.5.1:8000"], steer: {mark: 5}}
"""


def _apply(target: str, tmp_path: Path, text: str, *flags: str) -> Result:
    path = tmp_path / "mesh.yaml"
    path.write_text(text)
    return run(target, "apply", "-f", str(path), *flags)


def _refused(r: Result, *expected: str) -> None:
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output  # no plan lines before the error
    assert "nothing applied" in lines[0], r.output
    for text in expected:
        assert text in lines[0], (text, r.output)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            WEB + "---\n" + WEB.replace("10.0.5.1", "10.0.5.9"),
            ["document 2", "Shard 'web'", "document 1"],
        ),
        (
            WEB
            + "---\nkind: Pin\nspec: {cidr: 10.8.0.0/16, shard: web}\n"
            + "---\nkind: Pin\nspec: {cidr: 10.8.0.0/16, shard: web}\n",
            ["document 3", "Pin '10.8.0.0/16'", "document 2"],
        ),
        (
            WEB
            + "---\nkind: Pin\nspec: {cidr: 10.8.0.0/16, shard: web}\n"
            + "---\nkind: Pin\nspec: {cidr: 10.8.0.1/16, shard: web}\n",
            ["document 3", "Pin '10.8.0.0/16'", "document 2"],
        ),
        (
            WEB
            + "---\nkind: Override\nspec: {shard: web, weight: 100}\n"
            + "---\nkind: Override\nspec: {shard: web, weight: 200}\n",
            ["document 3", "Override 'web'", "document 2"],
        ),
        (
            "kind: List\nitems:\n"
            + "- {kind: Shard, metadata: {name: a}, spec: {endpoints: ['10.0.1.1:80'], steer: {mark: 1}}}\n"
            + "- {kind: Shard, metadata: {name: a}, spec: {endpoints: ['10.0.1.2:80'], steer: {mark: 1}}}\n",
            ["document 1.items[1]", "document 1.items[0]"],
        ),
    ],
    ids=["shard", "pin", "pin-spelled-differently", "override", "list-items"],
)
def test_the_same_object_twice_is_refused_naming_both(
    server: str,  # noqa: F811
    tmp_path: Path,
    text: str,
    expected: list[str],
) -> None:
    before = run(server, "get", "all", "-o", "json").output
    r = _apply(server, tmp_path, text)
    _refused(r, *expected)
    assert r.exit_code == 2
    assert run(server, "get", "all", "-o", "json").output == before


def test_a_yaml_error_names_its_line_and_column(server: str, tmp_path: Path) -> None:  # noqa: F811
    text = "kind: Shard\nmetadata:\n  name: web\n spec: {}\n"
    r = _apply(server, tmp_path, text)
    _refused(r, "line 4, column", "mesh.yaml")
    assert r.exit_code == 2
    assert "^" not in r.output
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: a\n   when: 'true'\n")
    r = run(server, "rules", "apply", "-f", str(rules))
    assert r.exit_code == 2, r.output
    assert "line 3, column" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_missing_file_is_one_line(server: str, tmp_path: Path) -> None:  # noqa: F811
    r = run(server, "apply", "-f", str(tmp_path / "absent.yaml"))
    _refused(r, "absent.yaml")
    r = run(server, "rules", "apply", "-f", str(tmp_path / "absent.yaml"))
    assert r.exit_code == 2, r.output
    assert "absent.yaml" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (WEB + "---\nkind: Pin\nspec: {cidr: 10.9.0.0/16, shard: nowhere}\n", "spec.shard"),
        (WEB + "---\nkind: Override\nspec: {shard: nowhere, weight: 100}\n", "spec.shard"),
        (
            WEB
            + "---\nkind: AdapterInstance\nmetadata: {name: bot}\n"
            + "spec: {modelRef: {baseModel: m}, routes: [{shard: nowhere}]}\n",
            "spec.routes[0].shard",
        ),
    ],
    ids=["pin", "override", "route"],
)
def test_a_dangling_reference_is_refused_before_any_plan_line(
    server: str,  # noqa: F811
    tmp_path: Path,
    text: str,
    field: str,
) -> None:
    before = run(server, "get", "all", "-o", "json").output
    r = _apply(server, tmp_path, text)
    _refused(r, field, "'nowhere'")
    assert "+ Shard/web" not in r.output
    r = _apply(server, tmp_path, text, "--dry-run")
    _refused(r, field)
    assert run(server, "get", "all", "-o", "json").output == before


def test_a_reference_to_a_shard_created_by_the_same_file_is_fine(
    server: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    r = _apply(server, tmp_path, WEB + "---\nkind: Pin\nspec: {cidr: 10.9.0.0/16, shard: web}\n")
    assert r.exit_code == 0, r.output
    assert "2 change(s) applied" in r.output


def test_a_server_refusal_says_nothing_applied(server: str, tmp_path: Path) -> None:  # noqa: F811
    r = _apply(server, tmp_path, WEB.replace("mark: 5", "mark: 0"))
    assert r.exit_code == 2, r.output
    assert "steer.mark.mark" in r.output
    assert "nothing applied" in r.output.strip().splitlines()[-1]
