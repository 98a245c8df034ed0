"""The AdapterInstance CRD: a valid apiextensions/v1 object with a structural schema, the same
in deploy/crds and in the chart, accepting the examples and rejecting bad documents."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml

from .chart import CHART_CRD_FILE, CRD_FILE, EXAMPLES_DIR, strict_errors


def _crd() -> dict[str, Any]:
    doc = yaml.safe_load(CRD_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


def _schema() -> dict[str, Any]:
    (version,) = _crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server applies it under strict field validation: objects with
    declared properties accept no other field (metadata is checked by the server itself)."""
    out = copy.deepcopy(schema)

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("type") == "object" and "properties" in node and path != "metadata":
            node["additionalProperties"] = False
        for key, child in node.get("properties", {}).items():
            walk(child, key)
        if isinstance(node.get("items"), dict):
            walk(node["items"], path)

    walk(out, "")
    return out


def _validator() -> jsonschema.protocols.Validator:
    return jsonschema.Draft7Validator(_strict(_schema()))


def test_chart_copy_is_identical() -> None:
    assert CHART_CRD_FILE.read_bytes() == CRD_FILE.read_bytes()


def test_crd_is_a_strictly_valid_apiextensions_object() -> None:
    crd = _crd()
    assert strict_errors(crd) == []
    spec = crd["spec"]
    assert spec["group"] == "adaptermesh.io"
    assert spec["names"]["kind"] == "AdapterInstance"
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["served"]
    assert version["storage"]
    assert version["subresources"] == {"status": {}}


def test_schema_is_structural() -> None:
    """The rules the API server enforces on CRD schemas (structural schema)."""
    problems: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "type" not in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties with additionalProperties")
        for banned in ("$ref", "oneOf", "anyOf", "allOf", "not"):
            if banned in node and path.count(".") < 1:
                problems.append(f"{path}: {banned} at the root")
        if node.get("x-kubernetes-list-type") == "map":
            keys = node.get("x-kubernetes-list-map-keys", [])
            required = node.get("items", {}).get("required", [])
            if not set(keys) <= set(required):
                problems.append(f"{path}: list-map keys must be required")
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    schema = _schema()
    walk(schema, "$")
    assert problems == []
    jsonschema.Draft7Validator.check_schema(schema)


@pytest.mark.parametrize(
    "path",
    [*sorted(EXAMPLES_DIR.glob("adapterinstance-*.yaml")), EXAMPLES_DIR / "credit-risk-v2.yaml"],
    ids=lambda p: p.stem,
)
def test_examples_are_valid(path: Any) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "adaptermesh.io/v1alpha1"
    assert doc["kind"] == "AdapterInstance"
    errors = [f"{list(e.path)}: {e.message}" for e in _validator().iter_errors(doc)]
    assert errors == []


def _tenant_example() -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES_DIR / "adapterinstance-tenant.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def _without(path: list[Any]) -> Any:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


def _set(path: list[Any], value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


BAD_DOCUMENTS = [
    ("no spec", _without(["spec"])),
    ("no base model", _without(["spec", "modelRef", "baseModel"])),
    ("no adapter path", _without(["spec", "adapter", "path"])),
    ("empty base model", _set(["spec", "modelRef", "baseModel"], "")),
    ("route without shard or path", _without(["spec", "routes", 0, "shard"])),
    ("unknown protocol", _set(["spec", "protocol"], "soap")),
    ("path without its slash", _set(["spec", "routes", 0], {"path": "v1/evaluate"})),
    ("tls as string", _set(["spec", "security", "tls"], "yes")),
    ("uppercase placement shard", _set(["spec", "placement", "shards"], ["Shard-B"])),
    ("zero weight", _set(["spec", "routes", 0, "weight"], 0)),
    ("weight as string", _set(["spec", "routes", 0, "weight"], "3")),
    ("CIDR without prefix", _set(["spec", "routes", 0, "tenantCIDRs"], ["10.20.0.0"])),
    ("CIDR octet > 255", _set(["spec", "security", "allowedCIDRs"], ["10.300.0.0/16"])),
    ("prefix > 32", _set(["spec", "security", "allowedCIDRs"], ["10.0.0.0/33"])),
    ("scope with spaces", _set(["spec", "security", "scopes"], ["tenant acme"])),
    ("zero replicas", _set(["spec", "placement", "replicas"], 0)),
    ("uppercase shard", _set(["spec", "placement", "pinnedShards"], ["Shard-A"])),
    ("unknown spec field", _set(["spec", "adapterPath"], "/x")),
    ("misspelled nested field", _set(["spec", "routes", 0, "tenantCidrs"], ["10.0.0.0/8"])),
    ("bad status phase", _set(["status"], {"phase": "Running"})),
]


@pytest.mark.parametrize(("label", "change"), BAD_DOCUMENTS, ids=[b[0] for b in BAD_DOCUMENTS])
def test_bad_documents_are_rejected(label: str, change: Any) -> None:
    doc = _tenant_example()
    assert list(_validator().iter_errors(doc)) == []
    change(doc)
    assert list(_validator().iter_errors(doc)) != [], label


def test_status_with_conditions_is_accepted() -> None:
    doc = _tenant_example()
    doc["status"] = {
        "phase": "Ready",
        "observedGeneration": 3,
        "loadedOn": [
            {
                "shard": "shard-a",
                "worker": "am-adaptermesh-worker-shard-a-0",
                "since": "2026-01-01T00:00:00Z",
            }
        ],
        "conditions": [
            {
                "type": "Loaded",
                "status": "True",
                "reason": "AdapterResident",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    assert list(_validator().iter_errors(doc)) == []
