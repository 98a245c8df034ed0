"""The chart's MQTT bridge: off by default; when on, one Recreate Deployment on a persistent
state volume whose arguments parse with the bridge's own CLI."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from adaptermesh.bridge import cli as bridge_cli

from .chart import find, render, strict_errors

ON: dict[str, Any] = {
    "bridge": {
        "enabled": True,
        "broker": {"host": "mqtt.messaging.svc", "port": 8883},
        "baseUrl": "http://am-envoy:8080",
        "requestTopic": "$share/am/requests/#",
        "maxInFlight": 32,
    }
}


def _spec(values: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = find(render(values), "Deployment", "-bridge").doc["spec"]
    return spec


def test_off_by_default() -> None:
    objs = render()
    assert not [
        o
        for o in objs
        if o.doc["metadata"]["labels"].get("app.kubernetes.io/component") == "bridge"
    ]


def test_deployment_args_parse_with_the_bridge_cli() -> None:
    objs = render(ON)
    dep = find(objs, "Deployment", "-bridge")
    assert strict_errors(dep.doc) == []
    spec = dep.doc["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 15
    (c,) = pod["containers"]
    assert c["image"] == "adaptermesh/bridge:0.1.0"
    assert c["args"][0] == "mqtt-bridge"
    args = bridge_cli.build_parser().parse_args(c["args"][1:])
    assert args.broker == ("mqtt.messaging.svc", 8883)
    assert args.request_topic == "$share/am/requests/#"
    assert args.base_url == "http://am-envoy:8080"
    assert args.max_in_flight == 32
    assert args.client_id == "am-adaptermesh-bridge"
    assert str(args.state_dir) == "/var/lib/adaptermesh"
    assert args.username is None
    assert {"name": "metrics", "containerPort": args.metrics_port, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    claim = next(v for v in pod["volumes"] if v["name"] == "state")["persistentVolumeClaim"]
    pvc = find(objs, "PersistentVolumeClaim", "-bridge-state")
    assert claim["claimName"] == pvc.name
    assert pvc.doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_broker_credentials_come_from_a_secret() -> None:
    values = {"bridge": {**ON["bridge"], "broker": {"host": "mqtt", "existingSecret": "creds"}}}
    pod = _spec(values)["template"]["spec"]
    (c,) = pod["containers"]
    args = bridge_cli.build_parser().parse_args(c["args"][1:])
    assert args.username == "$(BROKER_USERNAME)"  # expanded by the kubelet from the env below
    assert str(args.password_file) == "/etc/adaptermesh/broker/password"
    (env,) = c["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "username"}
    broker = next(v for v in pod["volumes"] if v["name"] == "broker")
    assert broker["secret"]["items"] == [{"key": "password", "path": "password"}]


def test_existing_claim_and_ephemeral_state() -> None:
    claim = {"bridge": {**ON["bridge"], "persistence": {"existingClaim": "bridge-state"}}}
    objs = render(claim)
    assert not [o for o in objs if o.kind == "PersistentVolumeClaim" and "bridge" in o.name]
    pod = find(objs, "Deployment", "-bridge").doc["spec"]["template"]["spec"]
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["persistentVolumeClaim"]["claimName"] == "bridge-state"
    ephemeral = {"bridge": {**ON["bridge"], "persistence": {"enabled": False}}}
    pod = _spec(ephemeral)["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "state") == {
        "name": "state",
        "emptyDir": {},
    }


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"bridge": {"enabled": True, "baseUrl": "http://x:1"}}, "bridge.broker.host"),
        ({"bridge": {"enabled": True, "broker": {"host": "mqtt"}}}, "bridge.baseUrl"),
        ({"bridge": {**ON["bridge"], "maxInFlight": 0}}, "/bridge/maxInFlight"),
        ({"bridge": {**ON["bridge"], "baseUrl": "envoy:8080"}}, "/bridge/baseUrl"),
        (
            {"bridge": {**ON["bridge"], "broker": {"host": "mqtt", "port": 0}}},
            "/bridge/broker/port",
        ),
        ({"bridge": {**ON["bridge"], "maxInflight": 3}}, "maxInflight"),
    ],
)
def test_bad_bridge_values_fail_naming_the_field(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert needle in str(err.value)
