"""Render the adaptermesh chart with the real Helm engine and check objects strictly.

Helm runs in-process through helm-python-sdk (Helm v4 as a shared library). Kubernetes objects
are checked against lightkube's generated models: decoding checks types and required fields,
and a round trip back to a dict catches what decoding silently drops (unknown or misspelled
fields), which is what the API server's strict field validation rejects.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import yaml
from lightkube.models import (
    apiextensions_v1,
    apps_v1,
    core_v1,
    rbac_v1,
)

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "adaptermesh"
EXAMPLES_DIR = REPO / "deploy" / "examples"
CRD_FILE = REPO / "deploy" / "crds" / "adapterinstances.adaptermesh.io.yaml"
CHART_CRD_FILE = CHART_DIR / "crds" / "adapterinstances.adaptermesh.io.yaml"
DOCKER_DIR = REPO / "deploy" / "docker"

# libyaml's loader when present: the same safe loader, ten times faster on rendered charts.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

RELEASE = "am"
NAMESPACE = "inference"

MODELS: dict[tuple[str, str], Any] = {
    ("apps/v1", "DaemonSet"): apps_v1.DaemonSet,
    ("apps/v1", "Deployment"): apps_v1.Deployment,
    ("v1", "Service"): core_v1.Service,
    ("v1", "ServiceAccount"): core_v1.ServiceAccount,
    ("v1", "Secret"): core_v1.Secret,
    ("v1", "ConfigMap"): core_v1.ConfigMap,
    ("v1", "PersistentVolumeClaim"): core_v1.PersistentVolumeClaim,
    ("rbac.authorization.k8s.io/v1", "Role"): rbac_v1.Role,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): rbac_v1.RoleBinding,
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): rbac_v1.ClusterRole,
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): (rbac_v1.ClusterRoleBinding),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): (
        apiextensions_v1.CustomResourceDefinition
    ),
}

# ServiceMonitor is not a core type, so lightkube has no model for it. This is the subset of
# the monitoring.coreos.com/v1 CRD's schema for the fields the chart sets, closed with
# additionalProperties: false so a misspelled field fails here as it would on the API server.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {
                                                "type": "string",
                                                "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$",
                                            },
                                        },
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "separator": {"type": "string"},
                                        "action": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@dataclass(frozen=True)
class Obj:
    """One rendered object and the template it came from (text kept for comment checks)."""

    template: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def render_text(values: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    return chart().render(
        values=dict(values) if values else None,
        name=RELEASE,
        namespace=NAMESPACE,
        is_install=True,
    )


def render(values: Mapping[str, Any] | None = None) -> list[Obj]:
    objs: list[Obj] = []
    for template, text in render_text(values).items():
        if not template.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.load_all(text, Loader=_LOADER):
            if doc:
                objs.append(Obj(template, doc))
    return objs


def find(objs: list[Obj], kind: str, suffix: str) -> Obj:
    hits = [o for o in objs if o.kind == kind and o.name.endswith(suffix)]
    assert len(hits) == 1, f"expected one {kind} named *{suffix}, got {[o.name for o in hits]}"
    return hits[0]


def load_values_file(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


def _diff(want: Any, got: Any, path: str = "$") -> list[str]:
    """Where a round-tripped object differs from its input (what the model dropped/changed)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out: list[str] = []
        for key in sorted(set(want) | set(got), key=str):
            if key not in got:
                out.append(f"{path}.{key}: unknown field (dropped by the schema)")
            elif key not in want:
                out.append(f"{path}.{key}: added by the model")
            else:
                out += _diff(want[key], got[key], f"{path}.{key}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: length {len(want)} != {len(got)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(want, got, strict=True))
            for d in _diff(a, b, f"{path}[{i}]")
        ]
    if want != got or type(want) is not type(got):
        return [f"{path}: {want!r} became {got!r}"]
    return []


def strict_errors(doc: dict[str, Any]) -> list[str]:
    """Problems with one object under strict validation; empty when it is valid."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key == ("monitoring.coreos.com/v1", "ServiceMonitor"):
        validator = jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA)
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    model = MODELS.get(key)  # type: ignore[arg-type]
    if model is None:
        return [f"no schema known for {key}"]
    try:
        obj = model.from_dict(doc)
    except Exception as exc:  # msgspec.ValidationError names the path
        return [f"does not decode: {exc}"]
    return _diff(doc, obj.to_dict())


def pod_specs(objs: list[Obj]) -> Iterator[tuple[Obj, dict[str, Any]]]:
    for o in objs:
        if o.kind in ("Deployment", "DaemonSet"):
            yield o, o.doc["spec"]["template"]["spec"]


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, dict[str, Any]]]:
    for o, spec in pod_specs(objs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield o, c
