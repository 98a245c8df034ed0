"""The chart's tracing values: off by default with nothing rendered; when on, every component
whose CLI exports spans gets the collector and the ratio, the agent gets Envoy's percent and
the flow-event mode, and Envoy's bootstrap gets the collector cluster the bootstrap builder
makes; bad values fail the render naming the field (docs/tracing.md, docs/helm.md)."""

from __future__ import annotations

import argparse
import ipaddress
import re
from typing import Any

import helm_python as helm
import pytest
import yaml
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.agent import cli as agent_cli
from adaptermesh.bridge import cli as bridge_cli
from adaptermesh.control_plane import cli as cp_cli
from adaptermesh.mesh.bootstrap import build_bootstrap
from adaptermesh.worker import cli as worker_cli

from .chart import Obj, containers, find, render, strict_errors

ENDPOINT = "otel-collector.observability.svc:4317"
ON: dict[str, Any] = {"tracing": {"enabled": True, "otlpEndpoint": ENDPOINT}}
# Every container's program and the parser of its command line; the Envoy container's args
# are Envoy's own.
PARSERS: dict[str, argparse.ArgumentParser] = {
    "agent": agent_cli.build_parser(),
    "worker": worker_cli.build_parser(),
    "control-plane": cp_cli.build_parser(),
    "mqtt-bridge": bridge_cli.build_parser(),
}
TRACING_FLAGS = (
    "--otlp-endpoint",
    "--trace-sample-ratio",
    "--envoy-trace-percent",
    "--flow-events",
)
EVERY_COMPONENT: dict[str, Any] = {
    "worker": {"shards": [{"id": "s0", "replicas": 1}, {"id": "s1", "replicas": 2}]},
    "bridge": {"enabled": True, "broker": {"host": "mqtt"}, "baseUrl": "http://am-envoy:8080"},
}


def _with(tracing: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"tracing": tracing, **more}


def _programs(objs: list[Obj]) -> list[tuple[str, list[str]]]:
    """(program, arguments) of every container that runs an adaptermesh program."""
    out = []
    for o, c in containers(objs):
        args = [str(a) for a in c.get("args", [])]
        if c["name"] != "envoy":
            assert args[:1] != [], f"{o.name}/{c['name']}: no program"
            assert args[0] in PARSERS, f"{o.name}/{c['name']}: {args[0]}"
            out.append((args[0], args[1:]))
    return out


def _tracing_args(args: list[str]) -> list[str]:
    return [a for a in args if a.split("=", 1)[0] in TRACING_FLAGS]


def _clusters(objs: list[Obj]) -> dict[str, dict[str, Any]]:
    bootstrap = yaml.safe_load(find(objs, "ConfigMap", "-envoy").doc["data"]["envoy.yaml"])
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def _args(objs: list[Obj], program: str) -> list[str]:
    (args,) = [a for p, a in _programs(objs) if p == program]
    return args


def _agent(objs: list[Obj]) -> argparse.Namespace:
    return PARSERS["agent"].parse_args(_args(objs, "agent"))


def test_off_by_default_nothing_tracing_related_renders() -> None:
    for values in (
        {},
        EVERY_COMPONENT,
        # Values set but tracing off: still nothing.
        {
            **EVERY_COMPONENT,
            "tracing": {
                "otlpEndpoint": ENDPOINT,
                "sampleRatio": 0.1,
                "envoyPercent": 5,
                "flowEvents": "off",
            },
        },
        _with({"flowEvents": False}),
    ):
        objs = render(values)
        for program, args in _programs(objs):
            assert _tracing_args(args) == [], (program, values)
        assert set(_clusters(objs)) == {"adaptermesh_xds"}
        parsed = _agent(objs)
        assert (parsed.otlp_endpoint, parsed.envoy_trace_percent, parsed.flow_events) == (
            None,
            None,
            "off",
        )


def test_every_component_with_the_flags_gets_them() -> None:
    """A component's container gets the span-export flags exactly when its program has them,
    so a control plane or bridge that learns --otlp-endpoint fails here until the chart
    passes it."""
    objs = render({**EVERY_COMPONENT, **_with({**ON["tracing"], "sampleRatio": 0.25})})
    seen = []
    for program, args in _programs(objs):
        parsed = PARSERS[program].parse_args(args)
        if hasattr(parsed, "otlp_endpoint"):
            assert parsed.otlp_endpoint == ENDPOINT, program
            assert parsed.trace_sample_ratio == 0.25, program
            seen.append(program)
        else:
            assert _tracing_args(args) == [], program
    # The agent and both shards' workers; the control plane and the bridge export no spans.
    assert sorted(seen) == ["agent", "worker", "worker"]
    for o in objs:
        assert strict_errors(o.doc) == [], o.name


def test_envoy_percent_follows_the_ratio_unless_set() -> None:
    assert _agent(render(ON)).envoy_trace_percent == 100.0
    derived = _agent(render(_with({**ON["tracing"], "sampleRatio": 0.05})))
    assert (derived.envoy_trace_percent, derived.trace_sample_ratio) == (5.0, 0.05)
    explicit = _agent(render(_with({**ON["tracing"], "sampleRatio": 0.05, "envoyPercent": 0})))
    assert (explicit.envoy_trace_percent, explicit.trace_sample_ratio) == (0.0, 0.05)
    assert (
        _agent(render(_with({**ON["tracing"], "envoyPercent": 12.5}))).envoy_trace_percent == 12.5
    )


@pytest.mark.parametrize(
    ("mode", "rendered"),
    [("off", "off"), (False, "off"), ("log", "log"), ("span", "span"), ("both", "both")],
)
def test_flow_events_reach_the_agent(mode: Any, rendered: str) -> None:
    parsed = _agent(render(_with({**ON["tracing"], "flowEvents": mode})))
    assert parsed.flow_events == rendered
    # The agent's own rule (span needs a collector) holds for what the chart renders.
    agent_cli.config_from_args(argparse.Namespace(**{**vars(parsed), "token_file": None}))


def test_flow_event_log_needs_no_collector() -> None:
    objs = render(_with({"flowEvents": "log"}))
    assert _tracing_args(_args(objs, "agent")) == ["--flow-events=log"]
    assert _tracing_args(_args(objs, "worker")) == []
    assert set(_clusters(objs)) == {"adaptermesh_xds"}


@pytest.mark.parametrize("extproc", [False, True])
@pytest.mark.parametrize("endpoint", [ENDPOINT, "10.0.0.7:4318", "[fd00::7]:4317"])
def test_bootstrap_clusters_equal_the_builders(endpoint: str, extproc: bool) -> None:
    """The chart's Envoy carries the static clusters mesh/bootstrap.py builds for the same
    settings, compared as Envoy's own messages: the collector's (STRICT_DNS, HTTP/2) among
    them. The tracer itself reaches the listeners over xDS (the agent's
    --envoy-trace-percent), as on the local mesh."""
    values = _with(
        {**ON["tracing"], "otlpEndpoint": endpoint},
        agent={"xdsPort": 18123},
        extProc={"enabled": extproc, "port": 18555},
    )
    chart = _clusters(render(values))
    host, port = endpoint.rsplit(":", 1)
    built = build_bootstrap(
        "node-1",
        18123,
        otlp_host=host.strip("[]"),
        otlp_port=int(port),
        ext_proc_port=18555 if extproc else None,
    )
    want = {c.name: c for c in built.static_resources.clusters}
    assert set(chart) == set(want)
    for name, cluster in chart.items():
        got = json_format.ParseDict(cluster, type(want[name])())
        assert got == want[name], name
    agent = _agent(render(values))
    assert agent.otlp_endpoint == endpoint


def test_enabled_without_an_endpoint_fails_naming_it() -> None:
    for values in (
        _with({"enabled": True}),
        _with({"enabled": True, "otlpEndpoint": ""}),
        {**_with({"enabled": True}), "agent": {"enabled": False}},
    ):
        with pytest.raises(
            helm.HelmError,
            match=r"tracing\.otlpEndpoint is required when "
            r"tracing\.enabled is true",
        ):
            render(values)


@pytest.mark.parametrize("mode", ["span", "both"])
def test_span_flow_events_without_tracing_fail_naming_the_field(mode: str) -> None:
    with pytest.raises(
        helm.HelmError,
        match=rf"tracing\.flowEvents {mode} needs "
        r"tracing\.enabled",
    ):
        render(_with({"flowEvents": mode, "otlpEndpoint": ENDPOINT}))


BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("ratio above 1", {"sampleRatio": 1.5}, "/tracing/sampleRatio"),
    ("negative ratio", {"sampleRatio": -0.1}, "/tracing/sampleRatio"),
    ("ratio as string", {"sampleRatio": "0.5"}, "/tracing/sampleRatio"),
    ("negative percent", {"envoyPercent": -1}, "/tracing/envoyPercent"),
    ("percent above 100", {"envoyPercent": 100.5}, "/tracing/envoyPercent"),
    ("unknown flow mode", {"flowEvents": "x"}, "/tracing/flowEvents"),
    ("unquoted on", {"flowEvents": True}, "/tracing/flowEvents"),
    ("enabled as string", {"enabled": "yes"}, "/tracing/enabled"),
    ("endpoint with scheme", {"otlpEndpoint": "http://otel:4317"}, "/tracing/otlpEndpoint"),
    ("endpoint without port", {"otlpEndpoint": "otel"}, "/tracing/otlpEndpoint"),
    ("port 0", {"otlpEndpoint": "otel:0"}, "/tracing/otlpEndpoint"),
    ("port above 65535", {"otlpEndpoint": "otel:65536"}, "/tracing/otlpEndpoint"),
    ("endpoint with path", {"otlpEndpoint": "otel:4317/v1/traces"}, "/tracing/otlpEndpoint"),
    ("bare IPv6", {"otlpEndpoint": "fd00::7:4317"}, "/tracing/otlpEndpoint"),
    ("unknown key", {"ratio": 0.5}, "ratio"),
]


@pytest.mark.parametrize(("label", "tracing", "field"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_fail_the_render_naming_the_field(
    label: str, tracing: dict[str, Any], field: str
) -> None:
    for enabled in (False, True):
        values = _with({"enabled": enabled, "otlpEndpoint": ENDPOINT, **tracing})
        with pytest.raises(helm.HelmValuesError) as info:
            render(values)
        assert field in str(info.value), f"{label}: {info.value}"


# Hypothesis: drawn tracing values render, and the rendered flags parse (with each program's
# own parser) back to the values exactly; a drawn bad value fails the render naming its field.

_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
_HOSTS = st.one_of(
    st.lists(_LABEL, min_size=1, max_size=4).map(".".join),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
)
ENDPOINTS = st.builds(lambda h, p: f"{h}:{p}", _HOSTS, st.integers(1, 65535))
FLOW_MODES = st.sampled_from(["off", "log", "span", "both", False])
VALID = st.fixed_dictionaries(
    {
        "enabled": st.just(True),
        "otlpEndpoint": ENDPOINTS,
        "sampleRatio": st.floats(0, 1) | st.sampled_from([0, 1]),
        "flowEvents": FLOW_MODES,
    },
    optional={"envoyPercent": st.none() | st.floats(0, 100) | st.integers(0, 100)},
)
_FINITE = {"allow_nan": False, "allow_infinity": False}
BAD_FIELDS = st.one_of(
    st.tuples(
        st.just("sampleRatio"),
        st.floats(max_value=-1e-9, **_FINITE) | st.floats(min_value=1 + 1e-9, **_FINITE),
    ),
    st.tuples(
        st.just("envoyPercent"),
        st.floats(max_value=-1e-9, **_FINITE) | st.floats(min_value=100 + 1e-9, **_FINITE),
    ),
    st.tuples(
        st.just("flowEvents"),
        st.text(max_size=8).filter(lambda s: s not in ("off", "log", "span", "both")),
    ),
    st.tuples(
        st.just("otlpEndpoint"),
        st.one_of(
            st.builds(lambda h, p: f"{h}:{p}", _HOSTS, st.integers(65536, 10**6) | st.just(0)),
            st.builds(lambda e, s: f"{s}://{e}", ENDPOINTS, st.sampled_from(["http", "grpc"])),
            st.builds(
                lambda e, t: e + t, ENDPOINTS, st.sampled_from(["/", " ", "/v1/traces", ":1"])
            ),
            _HOSTS,
        ),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tracing=VALID)
def test_drawn_values_render_to_flags_that_parse_back(tracing: dict[str, Any]) -> None:
    objs = render({"tracing": tracing})
    mode = tracing["flowEvents"] or "off"
    agent = _agent(objs)
    assert agent.otlp_endpoint == tracing["otlpEndpoint"]
    assert agent.trace_sample_ratio == tracing["sampleRatio"]
    assert agent.flow_events == mode
    percent = tracing.get("envoyPercent")
    if percent is None:
        assert agent.envoy_trace_percent == pytest.approx(
            tracing["sampleRatio"] * 100, rel=1e-12, abs=1e-12
        )
    else:
        assert agent.envoy_trace_percent == percent
    worker = PARSERS["worker"].parse_args(_args(objs, "worker"))
    assert (worker.otlp_endpoint, worker.trace_sample_ratio) == (
        tracing["otlpEndpoint"],
        tracing["sampleRatio"],
    )
    collector = _clusters(objs)["adaptermesh_otlp"]["load_assignment"]["endpoints"][0]
    address = collector["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    host, port = tracing["otlpEndpoint"].rsplit(":", 1)
    assert address == {"address": host.strip("[]"), "port_value": int(port)}
    if host.startswith("["):
        ipaddress.IPv6Address(address["address"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(good=VALID, bad=BAD_FIELDS)
def test_a_drawn_bad_value_fails_naming_its_field(
    good: dict[str, Any], bad: tuple[str, Any]
) -> None:
    field, value = bad
    with pytest.raises(helm.HelmValuesError) as info:
        render({"tracing": {**good, field: value}})
    assert re.search(rf"at '/tracing/{field}'", str(info.value)), str(info.value)
