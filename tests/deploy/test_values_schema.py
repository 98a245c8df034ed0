"""values.schema.json: bad values fail the render (as `helm install` would) and name the field;
every documented value in values.yaml is typed in the schema and vice versa."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import pytest

from .chart import CHART_DIR, render

BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("latest tag", {"image": {"tag": "latest"}}, "/image/tag"),
    ("latest component tag", {"worker": {"image": {"tag": "latest"}}}, "/worker/image/tag"),
    ("bad digest", {"agent": {"image": {"digest": "sha256:xyz"}}}, "/agent/image/digest"),
    ("typo in a key", {"agent": {"tolerations_": []}}, "tolerations_"),
    ("unknown top-level key", {"agnet": {}}, "agnet"),
    ("two SQLite writers", {"controlPlane": {"replicas": 2}}, "/controlPlane/replicas"),
    ("port out of range", {"agent": {"xdsPort": 70000}}, "/agent/xdsPort"),
    ("port as string", {"worker": {"port": "8000"}}, "/worker/port"),
    ("missing limits", {"worker": {"resources": {"limits": None}}}, "/worker/resources"),
    ("missing memory request", {"agent": {"resources": {"requests": {"memory": None}}}}, "memory"),
    ("bad quantity", {"envoy": {"resources": {"limits": {"memory": "lots"}}}}, "/envoy/resources"),
    ("hostPath without path", {"worker": {"model": {"volume": {"type": "hostPath"}}}}, "hostPath"),
    (
        "unknown volume type",
        {"worker": {"adapters": {"volume": {"type": "nfs"}}}},
        "/worker/adapters/volume/type",
    ),
    ("TLS without secret", {"controlPlane": {"tls": {"enabled": True}}}, "secretName"),
    ("unknown scope", {"auth": {"agentScopes": ["admin"]}}, "/auth/agentScopes"),
    (
        "shard id not a DNS label",
        {"worker": {"shards": [{"id": "Shard_A", "replicas": 1}]}},
        "/worker/shards/0/id",
    ),
    ("interface name too long", {"agent": {"iface": "a-very-long-ifname0"}}, "/agent/iface"),
    ("bad toleration operator", {"agent": {"tolerations": [{"operator": "In"}]}}, "operator"),
    ("bad scrape interval", {"serviceMonitor": {"interval": "fast"}}, "/serviceMonitor/interval"),
    ("bad device", {"worker": {"device": "tpu"}}, "/worker/device"),
    ("negative gpus", {"worker": {"gpus": -1}}, "/worker/gpus"),
    ("zero ranks", {"worker": {"tensorParallelSize": 0}}, "/worker/tensorParallelSize"),
    (
        "relative mount path",
        {"worker": {"model": {"mountPath": "models"}}},
        "/worker/model/mountPath",
    ),
]


@pytest.mark.parametrize(("label", "values", "field"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_fail_the_render_naming_the_field(
    label: str, values: dict[str, Any], field: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert field in str(info.value), f"{label}: {info.value}"


def test_template_level_checks_fail_with_a_clear_message() -> None:
    """Cross-field rules the schema cannot express fail in the templates, naming the value."""
    cases = [
        (
            {"controlPlane": {"tls": {"enabled": True, "secretName": "s", "clientAuth": True}}},
            "agent.tls.clientSecretName",
        ),
        # A shared agent token must come from somewhere when the chart has no control plane
        # (ServiceAccount tokens need none).
        (
            {"controlPlane": {"enabled": False}, "auth": {"agentCredential": "token"}},
            "auth.existingSecret",
        ),
        ({"auth": {"agentCredential": "certificate"}}, "controlPlane.tls.clientAuth"),
        ({"envoy": {"image": {"repository": "envoyproxy/envoy"}}}, "envoy.image.tag"),
    ]
    for values, field in cases:
        with pytest.raises(helm.HelmError) as info:
            render(values)
        assert field in str(info.value), info.value


def _leaf_paths(node: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the values file down to objects that are free-form maps or lists."""
    paths: set[str] = set()
    if isinstance(node, dict) and node:
        for key, value in node.items():
            paths |= _leaf_paths(value, f"{prefix}.{key}" if prefix else key)
    else:
        paths.add(prefix)
    return paths


def _schema_has(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in path.split("."):
        props = node.get("properties", {})
        if part in props:
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return True


def test_every_value_is_in_the_schema_and_documented() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    defaults = helm.Chart.load(CHART_DIR).values
    missing = sorted(p for p in _leaf_paths(defaults) if not _schema_has(schema, p))
    assert missing == []
    # Every key in values.yaml has a comment on the line(s) above it (or a section comment).
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if not m:
            continue
        above = lines[i - 1].strip() if i else ""
        parent_comment = above.startswith("#")
        if not parent_comment:
            undocumented.append(f"{i + 1}: {line.strip()}")
    # Keys of example list entries and sub-keys of resources are described by their parent.
    allowed = re.compile(
        r": (requests|limits|cpu|memory|key|operator|effect|value|id|replicas|"
        r"nodeSelector|repository|tag|digest|volume|type|claimName|hostPath|"
        r"rbac|tls|service|persistence|image|model|adapters):"
    )
    assert [u for u in undocumented if not allowed.search(": " + u.split(": ", 1)[1])] == []


def test_defaults_pass_the_schema() -> None:
    helm.Chart.load(CHART_DIR).validate_schema(None)
