"""The chart renders with the real Helm engine, lints clean, and every object is a valid
Kubernetes object (strictly: unknown fields fail) for the defaults and many value sets."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from .chart import (
    CHART_DIR,
    EXAMPLES_DIR,
    NAMESPACE,
    RELEASE,
    Obj,
    chart,
    find,
    load_values_file,
    pod_specs,
    render,
    strict_errors,
)

# Value sets written for the tests; every deploy/examples/values-*.yaml is added below, so a
# broken example fails CI too.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "tls-server-only": {
        "controlPlane": {"tls": {"enabled": True, "secretName": "cp-tls"}},
    },
    "existing-state-claim": {"controlPlane": {"persistence": {"existingClaim": "cp-state"}}},
    "external-control-plane": {
        "controlPlane": {"enabled": False},
        "auth": {"existingSecret": "am-tokens"},
        "agent": {"controlPlaneAddress": "control-plane.mesh-system.svc:50051"},
    },
    "agents-only-no-workers": {"worker": {"enabled": False}},
    "privileged-agent": {"agent": {"privileged": True}},
    "agent-reads-nodes": {"agent": {"rbac": {"readNodes": True}}},
    "adapterinstance-watch": {"controlPlane": {"rbac": {"watchAdapterInstances": True}}},
    "registry-digest-upstream-envoy": {
        "image": {"registry": "registry.example.com/ml/"},
        "worker": {"image": {"digest": "sha256:" + "ab" * 32}},
        "envoy": {"image": {"repository": "envoyproxy/envoy", "tag": "v1.36.2"}},
    },
    "mqtt-bridge": {
        "bridge": {
            "enabled": True,
            "broker": {"host": "mqtt.messaging.svc", "existingSecret": "mqtt-creds"},
            "baseUrl": "http://am-envoy:8080",
            "extraEnv": [{"name": "AM_DEBUG", "value": "1"}],
        },
    },
    "mqtt-bridge-ephemeral": {
        "bridge": {
            "enabled": True,
            "broker": {"host": "10.0.0.5"},
            "baseUrl": "http://10.0.0.6:8000",
            "persistence": {"enabled": False},
        },
    },
    "adapter-edge": {
        "edge": {
            "auth": {
                "jwksSecret": "edge-jwks",
                "issuer": "https://id.example.com",
                "audiences": ["adaptermesh"],
            },
            "tlsSecret": "edge-tls",
            "grpcPortOffset": 1,
        },
    },
    "extra-args-env-and-pull-secrets": {
        "imagePullSecrets": ["regcred"],
        "commonLabels": {"team": "ml-platform"},
        "agent": {
            "extraArgs": ["--log-level=DEBUG"],
            "extraEnv": [{"name": "AM_DEBUG", "value": "1"}],
        },
        "worker": {"extraEnv": [{"name": "CUDA_MODULE_LOADING", "value": "LAZY"}]},
    },
}
for _path in sorted(EXAMPLES_DIR.glob("values-*.yaml")):
    VALUE_SETS[f"example:{_path.stem}"] = load_values_file(_path)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS), ids=str)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    name: str = request.param
    return name, render(copy.deepcopy(VALUE_SETS[name]))


def test_examples_exist() -> None:
    assert len([k for k in VALUE_SETS if k.startswith("example:")]) >= 4


def test_lint_is_clean() -> None:
    report = helm.lint(CHART_DIR, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == []
    # Severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    "example", sorted(EXAMPLES_DIR.glob("values-*.yaml")), ids=lambda p: p.stem
)
def test_lint_with_example_values(example: Path) -> None:
    report = helm.lint(CHART_DIR, load_values_file(example), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report


def test_every_object_is_strictly_valid(rendered: tuple[str, list[Obj]]) -> None:
    name, objs = rendered
    assert objs, f"{name}: nothing rendered"
    problems = {f"{o.kind}/{o.name}": errs for o in objs if (errs := strict_errors(o.doc))}
    assert problems == {}, f"{name}: {problems}"


def test_strict_validation_rejects_what_the_api_server_would() -> None:
    """The validator itself: a misspelled field, a wrong type and a missing required field
    each fail, on a real rendered object."""
    deployment = find(render(), "Deployment", "-control-plane").doc
    assert strict_errors(deployment) == []
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    assert any("readinessProbes" in e for e in strict_errors(typo))
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "1"
    assert any("replicas" in e for e in strict_errors(wrong_type))
    missing = copy.deepcopy(deployment)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    assert strict_errors(missing) != []
    nested = copy.deepcopy(deployment)
    nested["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]["typ"] = "x"
    assert strict_errors(nested) != []


def test_objects_are_namespaced_and_labelled(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    names = [(o.kind, o.name) for o in objs]
    assert len(names) == len(set(names)), "duplicate objects"
    for o in objs:
        meta = o.doc["metadata"]
        assert len(o.name) <= 63, o.name
        if o.kind not in ("ClusterRole", "ClusterRoleBinding"):
            assert meta["namespace"] == NAMESPACE, f"{o.kind}/{o.name}"
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/part-of"] == "adaptermesh"


def test_default_render_has_every_component() -> None:
    objs = render()
    kinds = {(o.kind, o.name) for o in objs}
    prefix = f"{RELEASE}-adaptermesh"
    for want in [
        ("DaemonSet", f"{prefix}-agent"),
        ("ConfigMap", f"{prefix}-envoy"),
        ("Deployment", f"{prefix}-control-plane"),
        ("Service", f"{prefix}-control-plane"),
        ("PersistentVolumeClaim", f"{prefix}-control-plane-state"),
        ("Secret", f"{prefix}-tokens"),
        ("Deployment", f"{prefix}-worker-shard-0"),
        ("Service", f"{prefix}-worker-shard-0"),
        ("ServiceAccount", f"{prefix}-agent"),
        ("ServiceAccount", f"{prefix}-worker"),
    ]:
        assert want in kinds, want
    assert not any(o.kind == "ServiceMonitor" for o in objs), "ServiceMonitor must be opt-in"
    assert not any(o.kind == "ClusterRole" for o in objs), "agent needs no API access by default"


def test_servicemonitors_cover_every_component() -> None:
    objs = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    monitors = [o for o in objs if o.kind == "ServiceMonitor"]
    assert {o.doc["metadata"]["labels"]["app.kubernetes.io/component"] for o in monitors} == {
        "agent",
        "control-plane",
        "worker",
    }
    services = [o for o in objs if o.kind == "Service"]
    for sm in monitors:
        assert sm.doc["metadata"]["labels"]["release"] == "prom"
        selector = sm.doc["spec"]["selector"]["matchLabels"]
        port = sm.doc["spec"]["endpoints"][0]["port"]
        matched = [
            s
            for s in services
            if selector.items() <= s.doc["metadata"]["labels"].items()
            and port in {p["name"] for p in s.doc["spec"]["ports"]}
        ]
        assert matched, f"{sm.name} selects no Service with port {port}"


def test_services_select_pods_and_target_named_ports(rendered: tuple[str, list[Obj]]) -> None:
    name, objs = rendered
    pods = [
        (o, spec, o.doc["spec"]["template"]["metadata"]["labels"]) for o, spec in pod_specs(objs)
    ]
    for svc in (o for o in objs if o.kind == "Service"):
        selector = svc.doc["spec"]["selector"]
        backing = [(o, spec) for o, spec, labels in pods if selector.items() <= labels.items()]
        assert backing, f"{name}: Service {svc.name} selects no pods"
        for port in svc.doc["spec"]["ports"]:
            target = port["targetPort"]
            for o, spec in backing:
                names = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
                assert target in names, f"{name}: {svc.name} targets {target}, {o.name} has {names}"


def test_workload_selectors_match_templates(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    for o, _spec in pod_specs(objs):
        sel = o.doc["spec"]["selector"]["matchLabels"]
        labels = o.doc["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), o.name
    # Two workloads with overlapping selectors would fight over pods.
    workloads = [o for o, _ in pod_specs(objs)]
    for a in workloads:
        for b in workloads:
            if a is not b:
                la = b.doc["spec"]["template"]["metadata"]["labels"]
                assert not a.doc["spec"]["selector"]["matchLabels"].items() <= la.items(), (
                    f"{a.name} selects {b.name}'s pods"
                )


def test_volume_mounts_reference_volumes_and_secrets_exist(rendered: tuple[str, list[Obj]]) -> None:
    name, objs = rendered
    if VALUE_SETS[name].get("auth", {}).get("existingSecret"):
        # The tokens Secret is the operator's; the chart must not create its own.
        assert not any(o.kind == "Secret" and o.name.endswith("-tokens") for o in objs)
    secrets = {o.name for o in objs if o.kind == "Secret"}
    configmaps = {o.name for o in objs if o.kind == "ConfigMap"}
    claims = {o.name for o in objs if o.kind == "PersistentVolumeClaim"}
    for o, spec in pod_specs(objs):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{o.name}/{c['name']}: no volume {m['name']}"
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps
            if "secret" in v and v["secret"]["secretName"].startswith(f"{RELEASE}-adaptermesh"):
                assert v["secret"]["secretName"] in secrets, v
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"].startswith(
                f"{RELEASE}-adaptermesh"
            ):
                assert v["persistentVolumeClaim"]["claimName"] in claims


def test_probes_use_declared_ports(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    for o, spec in pod_specs(objs):
        for c in spec["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            numbers = {p["containerPort"] for p in c.get("ports", [])}
            assert "readinessProbe" in c, f"{o.name}/{c['name']}"
            assert "livenessProbe" in c, f"{o.name}/{c['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = c.get(probe)
                if not handler:
                    continue
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in handler:
                        port = handler[kind]["port"]
                        # Envoy's admin port is loopback-only, so it is probed on 127.0.0.1
                        # and is deliberately not a declared (exposed) port.
                        if handler[kind].get("host") == "127.0.0.1":
                            continue
                        assert port in names or port in numbers, f"{o.name}/{c['name']} {probe}"


def test_chart_sdk_sees_crd_and_schema() -> None:
    c = chart()
    assert [crd["filename"] for crd in c.crds] == [
        "adaptermesh/crds/adapterinstances.adaptermesh.io.yaml"
    ]
    assert c.schema is not None
    assert c.schema["additionalProperties"] is False
    assert c.metadata["appVersion"] == "0.1.0"


def test_envoy_bootstrap_validates_with_real_envoy(tmp_path: Path) -> None:
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent))
    assert envoy is not None, "envoy binary missing from the venv"
    objs = render({"agent": {"xdsPort": 18123}, "envoy": {"adminPort": 19123}})
    bootstrap = yaml.safe_load(find(objs, "ConfigMap", "-envoy").doc["data"]["envoy.yaml"])
    xds = bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
    addr = xds["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr == {"address": "127.0.0.1", "port_value": 18123}
    assert bootstrap["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 19123,
    }
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    ds = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    envoy_c = next(c for c in ds["containers"] if c["name"] == "envoy")
    args = [a.replace("$(NODE_NAME)", "node-1") for a in envoy_c["args"]]
    args[args.index("--config-path") + 1] = str(path)
    proc = subprocess.run(
        [envoy, "--mode", "validate", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout + proc.stderr


def test_edge_values_reach_the_agent_envoy_and_workers() -> None:
    objs = render(copy.deepcopy(VALUE_SETS["adapter-edge"]))
    specs = {o.name: spec for o, spec in pod_specs(objs)}
    (agent_spec,) = [s for n, s in specs.items() if n.endswith("-agent")]
    containers = {c["name"]: c for c in agent_spec["containers"]}
    args = containers["agent"]["args"]
    for arg in (
        "--edge-jwks=/etc/adaptermesh/edge-jwks/jwks.json",
        "--edge-issuer=https://id.example.com",
        "--edge-audience=adaptermesh",
        "--edge-tls-cert=/etc/adaptermesh/edge-tls/tls.crt",
        "--edge-tls-key=/etc/adaptermesh/edge-tls/tls.key",
        "--grpc-port-offset=1",
    ):
        assert arg in args
    # Envoy reads the certificate, so the secret is mounted there; the agent reads the JWKS.
    assert {m["name"] for m in containers["envoy"]["volumeMounts"]} >= {"edge-tls"}
    assert {m["name"] for m in containers["agent"]["volumeMounts"]} >= {"edge-jwks"}
    (worker_spec,) = [s for n, s in specs.items() if "-worker-" in n]
    (worker,) = worker_spec["containers"]
    port = next(p["containerPort"] for p in worker["ports"] if p["name"] == "http")
    assert f"--grpc-port={port + 1}" in worker["args"]
    plain = render({})
    for _obj, spec in pod_specs(plain):
        for c in spec["containers"]:
            assert not [a for a in c.get("args", []) if "edge" in str(a) or "grpc-port" in str(a)]
