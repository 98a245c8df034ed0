"""Policy: resources everywhere, pinned images, explicit security contexts, and no privilege
beyond the agent's, each grant justified by a comment right above it in the rendered chart."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from adaptermesh.agent import cli as agent_cli
from adaptermesh.control_plane import auth
from adaptermesh.control_plane import cli as cp_cli
from adaptermesh.worker import cli as worker_cli

from .chart import Obj, containers, find, pod_specs, render, render_text
from .test_chart_render import VALUE_SETS

APP_VERSION = "0.1.0"
AGENT_CAPS = {"BPF", "NET_ADMIN", "SYS_ADMIN"}
AGENT_HOST_PATHS = {"/sys/fs/bpf", "/lib/modules", "/usr/src", "/var/lib/adaptermesh/agent"}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS), ids=str)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[Obj]]:
    values = copy.deepcopy(VALUE_SETS[request.param])
    return request.param, values, render(copy.deepcopy(values))


def _component(o: Obj) -> str:
    return str(o.doc["metadata"]["labels"]["app.kubernetes.io/component"])


def test_every_container_has_requests_and_limits(case: Any) -> None:
    name, _, objs = case
    for o, c in containers(objs):
        res = c.get("resources", {})
        for section in ("requests", "limits"):
            for key in ("cpu", "memory"):
                assert key in res.get(section, {}), f"{name}: {o.name}/{c['name']} {section}.{key}"


def test_images_are_pinned_never_latest(case: Any) -> None:
    name, _, objs = case
    for o, c in containers(objs):
        image = c["image"]
        ref = image.split("@", 1)[0]
        last = ref.rsplit("/", 1)[-1]
        assert ":" in last, f"{name}: {o.name}/{c['name']} untagged image {image}"
        assert last.rsplit(":", 1)[1].lower() != "latest", f"{name}: {image}"
        if "@" in image:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", image.split("@", 1)[1]), image


def test_default_images_follow_app_version() -> None:
    objs = render()
    images = {c["name"]: c["image"] for _, c in containers(objs)}
    assert images == {
        "agent": f"adaptermesh/agent:{APP_VERSION}",
        "envoy": f"adaptermesh/agent:{APP_VERSION}",
        "control-plane": f"adaptermesh/control-plane:{APP_VERSION}",
        "worker": f"adaptermesh/worker:{APP_VERSION}",
    }
    assert all(c["imagePullPolicy"] == "IfNotPresent" for _, c in containers(objs))


def test_registry_and_tag_overrides() -> None:
    objs = render({"image": {"registry": "reg.example.com/ml", "tag": "0.1.1"}})
    for _, c in containers(objs):
        assert c["image"].startswith("reg.example.com/ml/adaptermesh/"), c["image"]
        assert c["image"].endswith(":0.1.1"), c["image"]


def test_security_context_is_explicit(case: Any) -> None:
    name, _, objs = case
    for o, spec in pod_specs(objs):
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", o.name
        for c in spec["containers"]:
            sc = c.get("securityContext")
            assert sc, f"{name}: {o.name}/{c['name']} has no securityContext"
            for key in ("privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem"):
                assert key in sc, f"{name}: {o.name}/{c['name']} leaves {key} implicit"
            assert "runAsNonRoot" in sc or "runAsNonRoot" in spec["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            if not sc["privileged"]:
                assert sc["capabilities"]["drop"] == ["ALL"], f"{o.name}/{c['name']}"


def test_only_the_agent_holds_privilege(case: Any) -> None:
    name, values, objs = case
    for o, spec in pod_specs(objs):
        agent_pod = o.kind == "DaemonSet" and _component(o) == "agent"
        for key in ("hostPID", "hostIPC"):
            assert not spec.get(key), f"{name}: {o.name} sets {key}"
        assert bool(spec.get("hostNetwork")) == agent_pod, f"{name}: {o.name} hostNetwork"
        for c in spec["containers"]:
            sc = c["securityContext"]
            privileged_agent = agent_pod and c["name"] == "agent"
            if not privileged_agent:
                assert sc["privileged"] is False, f"{name}: {o.name}/{c['name']}"
                assert sc["allowPrivilegeEscalation"] is False, f"{name}: {o.name}/{c['name']}"
                assert "add" not in sc["capabilities"], f"{name}: {o.name}/{c['name']}"
                assert sc.get("runAsUser", 1) != 0
                assert sc.get("runAsNonRoot", spec["securityContext"].get("runAsNonRoot"))
                continue
            if values.get("agent", {}).get("privileged"):
                assert sc["privileged"] is True
            else:
                assert sc["privileged"] is False, f"{name}: agent privileged without opting in"
                assert set(sc["capabilities"]["add"]) == AGENT_CAPS
        # hostPath: the agent's kernel interfaces, and read-only model/adapter directories on
        # the workers when the operator chose hostPath volumes.
        mounts = {m["name"]: m for c in spec["containers"] for m in c.get("volumeMounts", [])}
        for v in spec.get("volumes", []):
            if "hostPath" not in v:
                continue
            if agent_pod:
                assert v["hostPath"]["path"] in AGENT_HOST_PATHS, v
            else:
                assert _component(o) == "worker", v
                assert v["name"] in ("model", "adapters"), v
                if v["name"] == "model":
                    assert mounts["model"]["readOnly"] is True


def _comment_block_above(lines: list[str], index: int) -> str:
    """The contiguous comment lines directly above lines[index] (same or deeper indent)."""
    block: list[str] = []
    i = index - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(reversed(block))


_GRANTS = {
    "hostNetwork: true": ("network namespace",),
    "privileged: true": ("kernels", "seccomp"),
    "allowPrivilegeEscalation: true": ("CAP_SYS_ADMIN",),
    "add: [": tuple(f"{cap}:" for cap in sorted(AGENT_CAPS)),
    "runAsUser: 0": ("uid 0",),
}


@pytest.mark.parametrize(
    "values",
    [{}, {"agent": {"privileged": True}}, {"agent": {"rbac": {"readNodes": True}}}],
    ids=str,
)
def test_every_privilege_grant_has_a_justifying_comment(values: dict[str, Any]) -> None:
    """Each privilege in the rendered manifests sits under a comment that names its reason.
    Helm keeps template comments in its output, so this checks what is installed."""
    seen: set[str] = set()
    for template, text in render_text(values).items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            for grant, words in _GRANTS.items():
                if not stripped.startswith(grant):
                    continue
                seen.add(grant)
                # The capability list sits inside a securityContext whose comment covers it.
                comment = _comment_block_above(lines, i)
                for word in words:
                    assert word in comment, (
                        f"{template}: '{stripped}' lacks a comment on {word!r}: {comment!r}"
                    )
            if stripped.startswith("- apiGroups:"):
                seen.add("rbac rule")
                assert _comment_block_above(lines, i), f"{template}: RBAC rule without a reason"
    assert {"hostNetwork: true", "allowPrivilegeEscalation: true", "runAsUser: 0"} <= seen
    if values.get("agent", {}).get("privileged"):
        assert "privileged: true" in seen
    else:
        assert "add: [" in seen


def test_agent_pod_mounts_kernel_interfaces_and_tolerates_gpus() -> None:
    ds = find(render(), "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    assert ds["hostNetwork"] is True
    assert ds["dnsPolicy"] == "ClusterFirstWithHostNet"
    agent = next(c for c in ds["containers"] if c["name"] == "agent")
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    for path in ("/sys/fs/bpf", "/lib/modules", "/usr/src"):
        assert path in mounts, path
    assert mounts["/lib/modules"]["readOnly"]
    assert mounts["/usr/src"]["readOnly"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ds[
        "tolerations"
    ]
    assert {c["name"] for c in ds["containers"]} == {"agent", "envoy"}
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_custom_tolerations_replace_defaults() -> None:
    tol = [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}]
    objs = render({"agent": {"tolerations": tol}, "worker": {"tolerations": tol}})
    for _, spec in pod_specs(objs):
        if "tolerations" in spec:
            assert spec["tolerations"] == tol


def test_workers_request_gpus_and_mount_models() -> None:
    objs = render(
        {
            "worker": {
                "gpus": 2,
                "shards": [{"id": "a", "replicas": 1}, {"id": "b", "replicas": 3}],
                "model": {
                    "subPath": "llama",
                    "volume": {"type": "hostPath", "hostPath": "/data/m"},
                },
            }
        }
    )
    workers = [o for o in objs if o.kind == "Deployment" and _component(o) == "worker"]
    assert sorted(o.doc["spec"]["replicas"] for o in workers) == [1, 3]
    for o in workers:
        spec = o.doc["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert "--model=/models/llama" in c["args"]
        assert "--adapter-root=/adapters" in c["args"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["hostPath"] == {"path": "/data/m", "type": "Directory"}
        assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "adaptermesh-adapters"
        assert o.doc["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


@pytest.mark.parametrize(
    ("gpus", "tp", "want"), [(1, 1, "1"), (1, 4, "4"), (2, 2, "2"), (8, 4, "8"), (0, 2, None)]
)
def test_tensor_parallel_workers_ask_for_a_gpu_per_rank(
    gpus: int, tp: int, want: str | None
) -> None:
    objs = render({"worker": {"gpus": gpus, "tensorParallelSize": tp}})
    for o, c in containers(objs):
        if _component(o) != "worker":
            continue
        assert c["resources"]["limits"].get("nvidia.com/gpu") == want
        assert c["resources"]["requests"].get("nvidia.com/gpu") == want
        flags = [a for a in c["args"] if a.startswith("--tensor-parallel-size")]
        assert flags == ([f"--tensor-parallel-size={tp}"] if tp > 1 else [])


def test_cpu_workers_ask_for_no_gpu() -> None:
    objs = render({"worker": {"gpus": 0, "device": "cpu"}})
    for o, c in containers(objs):
        if _component(o) == "worker":
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
            assert "--device=cpu" in c["args"]


def test_rbac_is_least_privilege() -> None:
    assert not any(o.kind in ("Role", "ClusterRole") for o in render())
    objs = render({"controlPlane": {"rbac": {"watchAdapterInstances": True}}})
    role = find(objs, "Role", "-control-plane").doc
    assert role["rules"] == [
        {
            "apiGroups": ["adaptermesh.io"],
            "resources": ["adapterinstances"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["adaptermesh.io"],
            "resources": ["adapterinstances/status"],
            "verbs": ["get", "update", "patch"],
        },
    ]
    for o in objs:
        if o.kind == "ServiceAccount":
            want = _component(o) == "control-plane"
            assert o.doc["automountServiceAccountToken"] is want, o.name
    for o, spec in pod_specs(objs):
        assert spec["automountServiceAccountToken"] is (_component(o) == "control-plane"), o.name
    nodes = render({"agent": {"rbac": {"readNodes": True}}})
    cr = find(nodes, "ClusterRole", "-agent").doc
    assert cr["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
    ]


def _tokens_table(objs: list[Obj], tmp_path: Path) -> tuple[dict[str, str], auth.TokenTable]:
    secret = find(objs, "Secret", "-tokens").doc["stringData"]
    # The control plane's own parser reads the rendered tokens file.
    path = tmp_path / "tokens"
    path.write_text(secret["tokens"])
    return secret, auth.load_tokens(path)


def _args(objs: list[Obj], kind: str, suffix: str) -> list[str]:
    spec = find(objs, kind, suffix).doc["spec"]["template"]["spec"]
    return list(spec["containers"][0]["args"])


def test_tokens_are_generated_scoped_and_split(tmp_path: Path) -> None:
    # By default: an operator token with what adapterctl needs, a read-only one for
    # dashboards, and no agent token (agents use their ServiceAccount tokens).
    secret, table = _tokens_table(render(), tmp_path)
    assert "agent-token" not in secret
    assert len(table) == 2
    assert table.lookup(secret["operator-token"]) == auth.Principal(
        "token:operator", frozenset({"read", "write", "rollout"}), frozenset()
    )
    assert table.lookup(secret["read-token"]) == auth.Principal(
        "token:read-only", frozenset({"read"}), frozenset()
    )
    # The operator token holds the scope of every method adapterctl calls, and no other.
    assert set(auth.METHOD_SCOPES.values()) - {"report"} == {"read", "write", "rollout"}
    objs = render({"auth": {"agentCredential": "token", "operatorScopes": ["write"]}})
    secret, table = _tokens_table(objs, tmp_path)
    assert len(table) == 3
    # A shared agent token reports for any node: the legacy mode, never the default.
    assert table.lookup(secret["agent-token"]) == auth.Principal(
        "token:agent", frozenset({"read", "report"}), None
    )
    assert table.lookup(secret["operator-token"]) == auth.Principal(
        "token:operator", frozenset({"write"}), frozenset()
    )
    values = [secret["agent-token"], secret["operator-token"], secret["read-token"]]
    assert len(set(values)) == 3
    assert all(len(v) >= 32 for v in values)
    # Random per install, not a constant baked into the chart.
    again = find(render({"auth": {"agentCredential": "token"}}), "Secret", "-tokens")
    assert again.doc["stringData"]["agent-token"] not in values
    # Agents mount only their own token; the control plane only the tokens file.
    for o, spec in pod_specs(objs):
        for v in spec["volumes"]:
            if v.get("secret", {}).get("secretName", "").endswith("-tokens"):
                keys = [i["key"] for i in v["secret"]["items"]]
                want = {"agent": ["agent-token"], "control-plane": ["tokens"]}[_component(o)]
                assert keys == want


def test_agents_authenticate_with_their_own_serviceaccount_token_by_default() -> None:
    objs = render()
    agent = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    volume = next(v for v in agent["volumes"] if v["name"] == "agent-token")
    assert volume["projected"]["sources"] == [
        {
            "serviceAccountToken": {
                "audience": "adaptermesh",
                "expirationSeconds": 600,
                "path": "token",
            }
        }
    ]
    # No Kubernetes API credentials for all that.
    assert agent["automountServiceAccountToken"] is False
    assert "--token-file=/etc/adaptermesh/agent/token" in _args(objs, "DaemonSet", "-agent")
    cp_args = _args(objs, "Deployment", "-control-plane")
    assert "--sa-jwks-file=/etc/adaptermesh/sa-jwks/jwks.json" in cp_args
    assert "--sa-issuer=https://kubernetes.default.svc.cluster.local" in cp_args
    assert "--sa-audience=adaptermesh" in cp_args
    # Only the agents' own service account.
    assert [a for a in cp_args if a.startswith("--sa-allow=")] == [
        "--sa-allow=inference:am-adaptermesh-agent"
    ]
    sa_name = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    assert sa_name == "am-adaptermesh-agent"
    cp_spec = find(objs, "Deployment", "-control-plane").doc["spec"]["template"]["spec"]
    jwks = next(v for v in cp_spec["volumes"] if v["name"] == "sa-jwks")
    assert jwks["secret"]["secretName"] == "am-adaptermesh-sa-jwks"
    # The flags the chart passes are the control plane's.
    parsed = cp_cli.build_parser().parse_args(cp_args[1:])
    assert parsed.sa_allow == ["inference:am-adaptermesh-agent"]
    # Token and key files are re-read: no checksum annotation restarts the control plane.
    annotations = find(objs, "Deployment", "-control-plane").doc["spec"]["template"]["metadata"]
    assert "checksum/tokens" not in (annotations.get("annotations") or {})


def test_agents_can_authenticate_with_node_certificates() -> None:
    values = {
        "auth": {"agentCredential": "certificate"},
        "controlPlane": {"tls": {"enabled": True, "secretName": "cp-tls", "clientAuth": True}},
        "agent": {"tls": {"clientSecretName": "agent-tls"}},
    }
    objs = render(values)
    agent_args = _args(objs, "DaemonSet", "-agent")
    assert not any(a.startswith("--token-file") for a in agent_args)
    assert "--tls-cert=/etc/adaptermesh/agent-tls/tls.crt" in agent_args
    assert "--node-cert-suffix=.node.adaptermesh" in _args(objs, "Deployment", "-control-plane")
    agent = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    assert not any(v["name"] == "agent-token" for v in agent["volumes"])
    with pytest.raises(Exception, match=r"needs controlPlane\.tls\.enabled"):
        render({"auth": {"agentCredential": "certificate"}})


def test_tls_wires_certificates_into_both_sides() -> None:
    objs = render(
        {
            "controlPlane": {"tls": {"enabled": True, "secretName": "cp-tls", "clientAuth": True}},
            "agent": {"tls": {"clientSecretName": "agent-tls"}},
        }
    )
    cp = find(objs, "Deployment", "-control-plane").doc["spec"]["template"]["spec"]
    args = cp["containers"][0]["args"]
    assert "--tls-cert=/etc/adaptermesh/tls/tls.crt" in args
    assert "--tls-client-ca=/etc/adaptermesh/tls/ca.crt" in args
    # The kubelet's gRPC probe cannot speak TLS.
    assert "tcpSocket" in cp["containers"][0]["readinessProbe"]
    ds = find(objs, "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in ds["volumes"]}
    assert volumes["control-plane-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert volumes["agent-tls"]["secret"]["secretName"] == "agent-tls"
    agent_args = ds["containers"][0]["args"]
    assert "--tls-ca=/etc/adaptermesh/control-plane-ca/ca.crt" in agent_args
    assert "--tls-key=/etc/adaptermesh/agent-tls/tls.key" in agent_args


def test_control_plane_is_single_writer_with_persistent_state() -> None:
    objs = render()
    dep = find(objs, "Deployment", "-control-plane").doc
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    spec = dep["spec"]["template"]["spec"]
    claim = next(v for v in spec["volumes"] if v["name"] == "state")["persistentVolumeClaim"]
    pvc = find(objs, "PersistentVolumeClaim", "-control-plane-state")
    assert claim["claimName"] == pvc.name
    assert pvc.doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    c = spec["containers"][0]
    assert c["readinessProbe"] == {"grpc": {"port": 50051}, "periodSeconds": 5}
    assert {p["name"] for p in c["ports"]} == {"grpc", "metrics"}
    ephemeral = render({"controlPlane": {"persistence": {"enabled": False}}})
    assert not any(o.kind == "PersistentVolumeClaim" for o in ephemeral)


def test_agent_args_parse_with_the_agent_cli() -> None:
    """The flags the chart passes are the agent's real flags (argparse rejects unknown ones)."""
    for values in (
        {},
        {"agent": {"vxlanDev": "vx0", "keepDatapathOnExit": False}},
        {
            "controlPlane": {"tls": {"enabled": True, "secretName": "s", "clientAuth": True}},
            "agent": {"tls": {"clientSecretName": "c"}},
        },
    ):
        ds = find(render(values), "DaemonSet", "-agent").doc["spec"]["template"]["spec"]
        args = ds["containers"][0]["args"]
        assert args[0] == "agent"
        parsed = agent_cli.build_parser().parse_args(args[1:])
        assert parsed.metrics_port == 9464
        assert parsed.xds_host == "127.0.0.1"
        assert parsed.detach is (values.get("agent", {}).get("keepDatapathOnExit") is False)


def test_control_plane_and_worker_args_parse_with_their_clis() -> None:
    tls = {"tls": {"enabled": True, "secretName": "s", "clientAuth": True}}
    for values in ({}, {"controlPlane": tls, "agent": {"tls": {"clientSecretName": "c"}}}):
        objs = render(values)
        cp = find(objs, "Deployment", "-control-plane").doc["spec"]["template"]["spec"]
        args = cp["containers"][0]["args"]
        assert args[0] == "control-plane"
        parsed = cp_cli.build_parser().parse_args(args[1:])
        assert parsed.listen == "0.0.0.0:50051"
        assert parsed.interval == 5.0
        # /metrics is served on the port the pod and Service declare as "metrics".
        assert parsed.metrics_port == 9090
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in cp["containers"][0][
            "ports"
        ]
        assert (parsed.tls_client_ca is not None) is bool(values)
    objs = render({"worker": {"model": {"subPath": "llama"}}})
    for o, c in containers(objs):
        if _component(o) == "worker":
            assert c["args"][0] == "worker"
            parsed = worker_cli.build_parser().parse_args(c["args"][1:])
            assert str(parsed.model) == "/models/llama"
            assert parsed.host == "0.0.0.0"
            assert parsed.device == "cuda"
