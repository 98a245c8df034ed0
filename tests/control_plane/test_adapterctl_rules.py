"""`adapterctl rules apply -f / list / get` against a control plane of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from .test_adapterctl import run, server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

RULES = """\
rules:
  - name: gold-fin
    when: 'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")'
    shard: gold
  - name: lab
    when: 'inCidr(request.source_ip, "10.8.0.0/16")'
    priority: 2
"""


def test_rules_apply_list_get(server: str, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    r = run(server, "rules", "apply", "-f", str(path), "--reason", "first rules")
    assert r.exit_code == 0, r.output
    assert "rules v1 applied (2 rules)" in r.output
    r = run(server, "rules", "apply", "-f", str(path))
    assert "unchanged" in r.output

    path.write_text(RULES.replace('startsWith("fin-")', 'startsWith("fin-"'))
    r = run(server, "rules", "apply", "-f", str(path))
    assert r.exit_code != 0
    assert "INVALID_ARGUMENT" in r.output
    assert "rule 'gold-fin' at 1:" in r.output

    r = run(server, "rules", "list")
    assert r.exit_code == 0, r.output
    assert "first rules" in r.output
    r = run(server, "rules", "get")
    assert r.exit_code == 0, r.output
    doc = yaml.safe_load(r.output.split("\n", 1)[1])
    assert [x["name"] for x in doc["rules"]] == ["gold-fin", "lab"]
    assert doc["rules"][1]["priority"] == 2
