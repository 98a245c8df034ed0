"""The chart's extProc and gie values: agent flags, Envoy's ext_proc cluster (validated by a
real Envoy), and the InferencePool + picker Service of GIE mode."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parents[1]))

from deploy.chart import CHART_DIR, find, load_values_file, render, strict_errors

GIE_VALUES = CHART_DIR / "values-gie.yaml"

# The inference.networking.k8s.io/v1 InferencePool fields the chart sets, closed like the
# API server's strict validation.
INFERENCE_POOL_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {
                            "number": {"type": "integer", "minimum": 1, "maximum": 65535}
                        },
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "port"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"const": "Service"},
                        "name": {"type": "string", "minLength": 1},
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": {"type": "integer"}},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def test_default_render_has_no_ext_proc() -> None:
    objs = render()
    assert not [o for o in objs if o.kind == "InferencePool"]
    agent = next(
        c
        for c in find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]["containers"]
        if c["name"] == "agent"
    )
    assert not [a for a in agent["args"] if a.startswith("--ext-proc")]


def test_gie_values_render_the_pool_picker_and_agent_flags() -> None:
    objs = render(load_values_file(GIE_VALUES))
    problems = {
        f"{o.kind}/{o.name}": strict_errors(o.doc)
        for o in objs
        if o.kind != "InferencePool" and strict_errors(o.doc)
    }
    assert problems == {}
    pool = find(objs, "InferencePool", "adaptermesh-pool").doc
    jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    epp = find(objs, "Service", "-epp").doc
    assert pool["spec"]["endpointPickerRef"]["name"] == epp["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == epp["spec"]["ports"][0]["port"]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    worker = next(o for o in objs if o.kind == "Deployment" and "-worker-" in o.name).doc
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    assert {
        "--ext-proc-port=18001",
        "--ext-proc-host=0.0.0.0",
        "--base-model=base",
        "--ext-proc-max-body-bytes=4194304",
    } <= set(agent["args"])
    assert {"name": "ext-proc", "containerPort": 18001, "protocol": "TCP"} in agent["ports"]
    agent_labels = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["metadata"]["labels"]
    assert epp["spec"]["selector"].items() <= agent_labels.items()


def test_native_value_passes_the_flag_without_the_processor() -> None:
    objs = render({"extProc": {"native": True}})
    agent = next(
        c
        for c in find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]["containers"]
        if c["name"] == "agent"
    )
    assert "--route-by-body" in agent["args"]
    assert not [a for a in agent["args"] if a.startswith("--ext-proc")]


def test_gie_without_ext_proc_fails_the_render() -> None:
    with pytest.raises(Exception, match=r"gie\.enabled needs extProc\.enabled"):
        render({"gie": {"enabled": True}})


def test_bootstrap_with_ext_proc_validates_with_real_envoy(tmp_path: Path) -> None:
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent))
    assert envoy is not None
    objs = render({"extProc": {"enabled": True, "port": 18555}})
    bootstrap = yaml.safe_load(find(objs, "ConfigMap", "-envoy").doc["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    ext = clusters["adaptermesh_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert ext["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 18555,
    }
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    proc = subprocess.run(
        [
            envoy,
            "--mode",
            "validate",
            "-c",
            str(path),
            "--service-node",
            "n",
            "--use-dynamic-base-id",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
