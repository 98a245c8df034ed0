"""Properties of the pure parts of access control: scope checks, the tokens file, token claim
validation and the audit's bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane import auth
from adaptermesh.control_plane.audit import MAX_STATE_BYTES, bounded_json
from adaptermesh.control_plane.auth import (
    METHOD_SCOPES,
    READ,
    REPORT,
    ROLLOUT,
    SCOPES,
    WRITE,
    AuthError,
    Denied,
    Principal,
    method_scope,
    parse_tokens,
)
from adaptermesh.control_plane.sa_tokens import ServiceAccountPolicy, check_claims
from adaptermesh.control_plane.store import AuditRow, Store
from adaptermesh.proto import control_plane_pb2 as cp_pb2

from . import sa_issuer as sa

SERVICE = cp_pb2.DESCRIPTOR.services_by_name["ControlPlane"]
METHODS = sorted(m.name for m in SERVICE.methods)
scope_sets = st.frozensets(st.sampled_from(sorted(SCOPES)))
node_names = st.text("abcdn-0123", min_size=1, max_size=6)


def test_every_method_has_a_scope_and_only_report_load_needs_report() -> None:
    assert set(METHOD_SCOPES) == set(METHODS)
    assert [m for m, s in METHOD_SCOPES.items() if s == REPORT] == ["ReportLoad"]
    assert {m for m, s in METHOD_SCOPES.items() if s == ROLLOUT} == {
        "StartRollout",
        "ControlRollout",
        "ApplyRules",
    }
    # Every method that stores anything needs more than read.
    for m in METHODS:
        if m.startswith(("Upsert", "Delete", "Set", "Clear", "Pin", "Unpin", "Apply", "Start")):
            assert METHOD_SCOPES[m] in (WRITE, ROLLOUT), m
    # A method nobody listed is closed.
    assert method_scope("/adaptermesh.v1.ControlPlane/SomethingNew") == WRITE
    assert method_scope("/grpc.health.v1.Health/Check") is None


@given(st.sampled_from(METHODS), scope_sets)
def test_a_call_is_admitted_exactly_when_the_caller_holds_its_scope(
    method: str, scopes: frozenset[str]
) -> None:
    principal = Principal("token:t", scopes, None)
    needed = method_scope(f"/adaptermesh.v1.ControlPlane/{method}")
    assert needed is not None
    refusal: Denied | None = None
    try:
        auth._check_scope(principal, needed, method)
    except Denied as exc:
        refusal = exc
    assert (refusal is None) == (needed in scopes)
    if refusal is not None:
        assert refusal.code == grpc.StatusCode.PERMISSION_DENIED
        assert refusal.reason == "scope"
        assert method in refusal.message
    # The agent's scopes admit watching and reporting, and no write.
    agent = {READ, REPORT}
    assert (needed in agent) == (method not in auth.AUDITED_METHODS or method == "ReportLoad")


@given(
    scope_sets,
    st.one_of(st.none(), st.frozensets(node_names, max_size=4)),
    node_names,
)
def test_a_report_is_allowed_only_for_a_bound_node(
    scopes: frozenset[str], nodes: frozenset[str] | None, node_id: str
) -> None:
    p = Principal("x", scopes, nodes)
    assert p.may_report(node_id) == (REPORT in scopes and (nodes is None or node_id in nodes))


token_text = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=16, max_size=24)


@st.composite
def token_lines(draw: st.DrawFn) -> list[tuple[str, frozenset[str], str, frozenset[str] | None]]:
    tokens = draw(st.lists(token_text, min_size=1, max_size=5, unique=True))
    out = []
    for i, tok in enumerate(tokens):
        scopes = draw(scope_sets.filter(bool))
        nodes: frozenset[str] | None = frozenset()
        if REPORT in scopes:
            nodes = draw(st.one_of(st.none(), st.frozensets(node_names, min_size=1, max_size=3)))
        out.append((tok, scopes, f"n{i}", nodes))
    return out


def _line(tok: str, scopes: frozenset[str], name: str, nodes: frozenset[str] | None) -> str:
    text = f"{tok} {','.join(sorted(scopes))} {name}"
    if REPORT in scopes:
        text += " nodes=" + ("*" if nodes is None else ",".join(sorted(nodes)))
    return text


@given(token_lines())
def test_the_tokens_file_reads_back_what_it_says(lines: list[Any]) -> None:
    table = parse_tokens("# tokens\n" + "\n".join(_line(*line) for line in lines) + "\n")
    for tok, scopes, name, nodes in lines:
        assert table.lookup(tok) == Principal(f"token:{name}", scopes, nodes)
    assert table.lookup("z" * 40) is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("abcdefghijklmnop read,report agent", "needs nodes="),
        ("abcdefghijklmnop read agent nodes=a", "binds report tokens only"),
        ("abcdefghijklmnop report a nodes=", "names no node"),
        ("abcdefghijklmnop report a nodes=*,b", "stands alone"),
        ("abcdefghijklmnop admin a", "scopes must be some of"),
        ("short read a", "shorter than 16"),
        ("abcdefghijklmnop read a b", "expected"),
    ],
)
def test_a_bad_tokens_line_is_named(text: str, needle: str) -> None:
    with pytest.raises(AuthError) as err:
        parse_tokens(text + "\n", "tokens")
    assert str(err.value).startswith("tokens:1: ")
    assert needle in str(err.value)


POLICY = ServiceAccountPolicy(
    issuer=sa.ISSUER, allowed=frozenset({(sa.NAMESPACE, sa.SERVICE_ACCOUNT)}), leeway_s=30
)


@settings(max_examples=300)
@given(
    now=st.integers(1_600_000_000, 1_900_000_000),
    age=st.integers(-120, 100_000),
    lifetime=st.integers(1, 200_000),
    iss=st.sampled_from([sa.ISSUER, "https://other.test", ""]),
    aud=st.sampled_from([["adaptermesh"], "adaptermesh", ["x", "adaptermesh"], ["x"], "x", []]),
    sa_name=st.sampled_from([sa.SERVICE_ACCOUNT, "default"]),
    node=st.one_of(st.none(), node_names),
)
def test_claims_are_accepted_exactly_when_every_rule_holds(
    now: int,
    age: int,
    lifetime: int,
    iss: str,
    aud: Any,
    sa_name: str,
    node: str | None,
) -> None:
    claims = sa.claims(
        now, node=node, iss=iss, aud=aud, lifetime=lifetime, age=age, service_account=sa_name
    )
    iat, exp = claims["iat"], claims["exp"]
    audiences = [aud] if isinstance(aud, str) else aud
    reasons = []
    if iss != POLICY.issuer:
        reasons.append("wrong_issuer")
    elif "adaptermesh" not in audiences:
        reasons.append("wrong_audience")
    elif now >= exp + 30:
        reasons.append("expired")
    elif iat > now + 30:
        reasons.append("not_yet_valid")
    elif exp - iat > POLICY.max_lifetime_s:
        reasons.append("long_lived")
    elif sa_name != sa.SERVICE_ACCOUNT:
        reasons.append("service_account")
    try:
        p = check_claims(claims, float(now), POLICY)
    except Denied as exc:
        refusal = exc
    else:
        refusal = None
    if refusal is not None:
        assert [refusal.reason] == reasons
        want = "PERMISSION_DENIED" if refusal.reason == "service_account" else "UNAUTHENTICATED"
        assert refusal.code.name == want
        return
    assert reasons == []
    assert p.scopes == {READ, REPORT}
    assert p.nodes == (frozenset({node}) if node else frozenset())
    assert p.may_report(node or "") == bool(node)


@given(st.sampled_from(["exp", "iat"]), st.sampled_from([None, "soon", True, float("nan")]))
def test_a_token_without_numeric_times_is_refused(name: str, value: Any) -> None:
    claims = sa.claims(1_700_000_000)
    claims[name] = value
    if value is None:
        del claims[name]
    with pytest.raises(Denied) as err:
        check_claims(claims, 1_700_000_000.0, POLICY)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=50),
    lambda inner: (
        st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=8)
    ),
    max_leaves=200,
)


@given(
    st.dictionaries(
        st.text(max_size=40) | st.text(min_size=300, max_size=3000), json_values, max_size=40
    )
)
def test_an_audit_state_is_bounded_and_exact_when_it_fits(state: dict[str, Any]) -> None:
    text = bounded_json(state)
    assert len(text.encode()) <= MAX_STATE_BYTES
    decoded = json.loads(text)
    full = json.dumps(state, sort_keys=True, separators=(",", ":"))
    if len(full.encode()) <= MAX_STATE_BYTES:
        assert decoded == state
    else:
        assert decoded["truncated"] is True
        assert decoded["bytes"] == len(full.encode())


@settings(max_examples=25, deadline=None)
@given(limit=st.integers(1, 20), writes=st.integers(0, 60))
def test_the_audit_keeps_the_newest_rows_up_to_its_limit(
    tmp_path_factory: pytest.TempPathFactory, limit: int, writes: int
) -> None:
    path: Path = tmp_path_factory.mktemp("audit") / "db"
    store = Store(path, synchronous="OFF", audit_limit=limit)
    try:
        for i in range(writes):
            seq = store.append_audit(
                AuditRow(0, float(i), f"c{i}", "SetOverride", "OK", "", "{}", "{}")
            )
            assert seq == i + 1
            assert store.audit_count() == min(i + 1, limit)
        kept = store.audit(1000)
        assert [r.caller for r in kept] == [
            f"c{i}" for i in range(writes - 1, max(-1, writes - limit - 1), -1)
        ]
    finally:
        store.close()
