"""The evaluator against a plain-Python reference on generated rule sets and requests, the
budget and its fallback, and source-CIDR-only rules as pins."""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.rules import (
    Action,
    Budget,
    Evaluator,
    RequestFacts,
    Rule,
    RuleSet,
    cidr_pins,
    compile_rule_set,
    in_cidr,
    parse_rule_set,
    rule_set_document,
)
from adaptermesh.rules.guards import Screen, screen

TENANTS = ["acme", "globex", ""]
ADAPTERS = ["fin-risk", "fin-fraud", "ops-sum", ""]
KEYS = ["x-tier", "x-team"]
VALUES = ["gold", "silver"]
CIDRS = ["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "192.168.0.0/16", "2001:db8::/32"]
IPS = ["10.1.2.3", "10.1.9.9", "10.200.0.1", "192.168.4.4", "8.8.8.8", "2001:db8::7", "bad"]

ERR = "error"  # CEL's error value: a missing map key
Ref = Callable[[RequestFacts], Any]


def _atoms() -> st.SearchStrategy[tuple[str, Ref]]:
    def eq_tenant(t: str) -> tuple[str, Ref]:
        return f'request.tenant == "{t}"', lambda r: r.tenant == t

    def starts(p: str) -> tuple[str, Ref]:
        return f'adapter.startsWith("{p}")', lambda r: r.adapter.startswith(p)

    def has_key(k: str) -> tuple[str, Ref]:
        return f'"{k}" in request.headers', lambda r: k in r.headers

    def header_eq(kv: tuple[str, str]) -> tuple[str, Ref]:
        k, v = kv
        return (
            f'request.headers["{k}"] == "{v}"',
            lambda r: (r.headers[k] == v) if k in r.headers else ERR,
        )

    def cidr(c: str) -> tuple[str, Ref]:
        return f'inCidr(request.source_ip, "{c}")', lambda r: in_cidr(r.source_ip, c)

    def longer(n: int) -> tuple[str, Ref]:
        return f"size(adapter) > {n}", lambda r: len(r.adapter) > n

    def key_prefix(p: str) -> tuple[str, Ref]:
        return (
            f'request.headers.exists(k, k.startsWith("{p}"))',
            lambda r: any(k.startswith(p) for k in r.headers),
        )

    def hour(on: tuple[str, int]) -> tuple[str, Ref]:
        op, n = on
        compare = {"<": int.__lt__, ">=": int.__ge__, "==": int.__eq__, "!=": int.__ne__}[op]
        return f"now.getHours() {op} {n}", lambda r: compare(r.now.hour, n)

    return st.one_of(
        st.sampled_from(TENANTS).map(eq_tenant),
        st.sampled_from(["fin-", "ops", "x"]).map(starts),
        st.sampled_from(KEYS).map(has_key),
        st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)).map(header_eq),
        st.sampled_from(CIDRS).map(cidr),
        st.integers(0, 9).map(longer),
        st.sampled_from(["x-t", "x-tier", "y"]).map(key_prefix),
        st.tuples(st.sampled_from(["<", ">=", "==", "!="]), st.integers(0, 24)).map(hour),
        st.sampled_from([("true", lambda r: True), ("false", lambda r: False)]),
    )


def _and(a: Any, b: Any) -> Any:
    # CEL's commutative logic: false absorbs an error, otherwise an error stays an error.
    if a is False or b is False:
        return False
    if a is ERR or b is ERR:
        return ERR
    return True


def _or(a: Any, b: Any) -> Any:
    if a is True or b is True:
        return True
    if a is ERR or b is ERR:
        return ERR
    return False


def _both(
    children: st.SearchStrategy[tuple[str, Ref]], op: str, fn: Callable[[Any, Any], Any]
) -> st.SearchStrategy[tuple[str, Ref]]:
    return st.tuples(children, children).map(
        lambda ab: (f"({ab[0][0]}) {op} ({ab[1][0]})", lambda r: fn(ab[0][1](r), ab[1][1](r)))
    )


def _negate(a: tuple[str, Ref]) -> tuple[str, Ref]:
    def ref(r: RequestFacts) -> Any:
        v = a[1](r)
        return ERR if v is ERR else not v

    return f"!({a[0]})", ref


def _combine(children: st.SearchStrategy[tuple[str, Ref]]) -> st.SearchStrategy[tuple[str, Ref]]:
    # No closure over ``children``: Hypothesis checks that ``extend`` reads its argument, and
    # does not see a read through a nested function's cell.
    return st.one_of(_both(children, "&&", _and), _both(children, "||", _or), children.map(_negate))


expressions = st.recursive(_atoms(), _combine, max_leaves=6)

requests = st.builds(
    RequestFacts,
    source_ip=st.sampled_from(IPS),
    tenant=st.sampled_from(TENANTS),
    headers=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=2),
    adapter=st.sampled_from(ADAPTERS),
    now=st.datetimes(
        min_value=dt.datetime(2026, 1, 1),
        max_value=dt.datetime(2027, 1, 1),
        timezones=st.just(dt.UTC),
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(expressions, min_size=1, max_size=8), st.lists(requests, min_size=1, max_size=6))
def test_first_match_agrees_with_reference(
    exprs: list[tuple[str, Ref]], reqs: list[RequestFacts]
) -> None:
    rules = tuple(Rule(f"r{i}", src, Action("shard", f"s{i}")) for i, (src, _) in enumerate(exprs))
    # A still clock: agreement, not the time budget, is under test (a loaded CI box can
    # pass 1 ms between two readings).
    evaluator = Evaluator(compile_rule_set(RuleSet(rules)), clock=lambda: 0)
    for req in reqs:
        values = [ref(req) for _, ref in exprs]
        want = next((i for i, v in enumerate(values) if v is True), None)
        got = evaluator.evaluate(req)
        assert got.rule == (None if want is None else f"r{want}"), (values, req)
        assert got.errors == sum(
            v is ERR for v in values[: (len(values) if want is None else want + 1)]
        )
        assert not got.over_budget


# `!(adapter == "")` is false for a request without an adapter, but has no index lookup: every
# request visits it, indexed or not, so the budget sees the same walk both ways.
VISITED_FALSE = '!(adapter == "")'


@pytest.mark.parametrize("index", [True, False])
def test_budget_rules_fall_back_and_count(index: bool) -> None:
    reject = Action("reject", status=503, message="rules over budget")
    rules = tuple(Rule(f"r{i}", VISITED_FALSE, Action("shard", "a")) for i in range(5))
    ev = Evaluator(compile_rule_set(RuleSet(rules, Budget(max_rules=3), reject)), index=index)
    out = ev.evaluate(RequestFacts())
    assert out.over_budget
    assert out.action == reject
    assert out.evaluated == 3
    assert ev.stats.over_budget == 1
    # Within budget the same set passes the request unchanged.
    ok = Evaluator(compile_rule_set(RuleSet(rules, Budget(max_rules=5), reject)), index=index)
    assert ok.evaluate(RequestFacts()).action is None
    assert ok.stats.over_budget == 0


def test_budget_counts_only_rules_the_index_lets_through() -> None:
    # `false` is never a candidate: max_rules bounds rules visited, not list positions.
    rules = tuple(Rule(f"r{i}", "false", Action("shard", "a")) for i in range(5))
    rules += (Rule("last", "true", Action("shard", "b")),)
    compiled = compile_rule_set(RuleSet(rules, Budget(max_rules=3)))
    out = Evaluator(compiled).evaluate(RequestFacts())
    assert (out.rule, out.evaluated, out.over_budget) == ("last", 1, False)
    linear = Evaluator(compiled, index=False).evaluate(RequestFacts())
    assert (linear.rule, linear.evaluated, linear.over_budget) == (None, 3, True)


@pytest.mark.parametrize("index", [True, False])
def test_budget_time_falls_back(index: bool) -> None:
    ticks = iter(range(0, 10**9, 40_000))  # each clock read is 40 us later
    # The clock is read at the start and before rules 0, 8, 16, ...: 40, 80, 120 us.
    rules = tuple(Rule(f"r{i}", VISITED_FALSE, Action("shard", "a")) for i in range(20))
    ev = Evaluator(
        compile_rule_set(RuleSet(rules, Budget(max_us=100))),
        index=index,
        clock=lambda: next(ticks),
    )
    out = ev.evaluate(RequestFacts())
    assert out.over_budget
    assert out.action is None
    assert out.evaluated == 16
    assert ev.stats.over_budget == 1


@settings(max_examples=50, deadline=None)
@given(st.lists(expressions, max_size=5))
def test_document_round_trip(exprs: list[tuple[str, Ref]]) -> None:
    doc = {
        "rules": [
            {"name": f"r{i}", "when": s, "priority": i % 10} for i, (s, _) in enumerate(exprs)
        ],
        "budget": {"max_rules": 7, "max_us": 300},
        "fallback": {"reject": {"status": 503, "message": "busy"}},
    }
    rs = parse_rule_set(doc)
    assert rule_set_document(rs) == doc
    assert parse_rule_set(rule_set_document(rs)) == rs


# -- source-CIDR-only rules as pins ----------------------------------------------------------

prefixes = st.tuples(st.sampled_from([8, 12, 16, 20, 24]), st.integers(0, 3), st.integers(0, 3))


def _cidr(p: tuple[int, int, int]) -> str:
    length, a, b = p
    return str(ipaddress.ip_network(f"10.{a * 64}.{b * 64}.0/{length}", strict=False))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(prefixes, min_size=1, max_size=2), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), min_size=1, max_size=20),
)
def test_cidr_pins_agree_with_first_match(
    groups: list[list[tuple[int, int, int]]], hosts: list[tuple[int, int]]
) -> None:
    rules = tuple(
        Rule(
            f"r{i}",
            " || ".join(f'inCidr(request.source_ip, "{_cidr(p)}")' for p in g),
            Action("shard", f"s{i % 3}"),
        )
        for i, g in enumerate(groups)
    )
    rule_set = RuleSet(rules)
    pins = cidr_pins(rule_set)
    evaluator = Evaluator(compile_rule_set(rule_set))
    nets = [(ipaddress.ip_network(p.cidr), p.shard_id) for p in pins]
    for a, b in hosts:
        ip = f"10.{a}.{b}.1"
        covering = [(n, s) for n, s in nets if ipaddress.ip_address(ip) in n]
        lpm = max(covering, key=lambda ns: ns[0].prefixlen)[1] if covering else None
        out = evaluator.evaluate(RequestFacts(source_ip=ip))
        assert lpm == (out.action.value if out.action else None), (ip, pins)


def test_only_the_leading_cidr_run_becomes_pins() -> None:
    rs = parse_rule_set(
        {
            "rules": [
                {"name": "a", "when": 'inCidr(request.source_ip, "10.0.0.0/8")', "shard": "s1"},
                {"name": "b", "when": 'inCidr(request.source_ip, "10.9.0.0/16")', "shard": "s2"},
                {
                    "name": "c",
                    "when": 'inCidr(request.source_ip, "192.168.0.0/16") || '
                    'inCidr(request.source_ip, "172.16.0.0/12")',
                    "shard": "s3",
                },
                {"name": "d", "when": 'request.tenant == "acme"', "shard": "s4"},
                {"name": "e", "when": 'inCidr(request.source_ip, "11.0.0.0/8")', "shard": "s5"},
            ]
        }
    )
    assert [(p.cidr, p.shard_id) for p in cidr_pins(rs)] == [
        ("10.0.0.0/8", "s1"),
        ("192.168.0.0/16", "s3"),
        ("172.16.0.0/12", "s3"),
    ]
    reject_first = parse_rule_set(
        {
            "rules": [
                {
                    "name": "a",
                    "when": 'inCidr(request.source_ip, "10.0.0.0/8")',
                    "reject": {"status": 403},
                },
                {"name": "b", "when": 'inCidr(request.source_ip, "11.0.0.0/8")', "shard": "s2"},
            ]
        }
    )
    assert cidr_pins(reject_first) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(expressions, min_size=1, max_size=8), st.lists(requests, min_size=1, max_size=6))
def test_python_screens_agree_with_cel_alone(
    exprs: list[tuple[str, Ref]], reqs: list[RequestFacts]
) -> None:
    rules = tuple(
        Rule(f"r{i}", s, Action("priority", str(i % 10))) for i, (s, _) in enumerate(exprs)
    )
    compiled = compile_rule_set(RuleSet(rules))
    cel_only = dataclasses.replace(
        compiled,
        screens=tuple(Screen(None, False) for _ in rules),
        whole_headers=tuple(True for _ in rules),
    )
    # Both walk every rule (the index would leave the same rules out of both; test_index.py
    # holds it to this walk).
    fast = Evaluator(compiled, index=False, clock=lambda: 0)
    slow = Evaluator(cel_only, index=False, clock=lambda: 0)
    for req in reqs:
        assert fast.evaluate(req) == slow.evaluate(req)


def test_screens_decide_known_trees() -> None:
    s = screen(
        '(adapter == "a") && request.headers["x-tier"] == "gold" && '
        '!inCidr(request.source_ip, "10.0.0.0/8")',
        in_cidr,
    )
    assert s.complete
    assert s.decide is not None
    assert s.decide("192.0.2.1", "", {"x-tier": "gold"}, "a", -1) is True
    assert s.decide("10.0.0.1", "", {"x-tier": "gold"}, "a", -1) is False
    assert s.decide("192.0.2.1", "", {}, "a", -1) is None  # missing key: CEL decides
    assert s.decide("192.0.2.1", "", {}, "b", -1) is False  # a false side decides anyway
    either = screen('adapter == "a" || request.tenant.startsWith("t-")', in_cidr)
    assert either.complete
    assert either.decide is not None
    assert either.decide("", "t-1", {}, "b", -1) is True
    partial = screen('adapter == "a" && now.getMinutes() > 3', in_cidr)
    assert not partial.complete
    assert partial.decide is not None
    assert partial.decide("", "", {}, "b", 5) is False
    assert partial.decide("", "", {}, "a", 5) is None
    # The UTC hour and a key macro are decided in Python; an hour not taken (-1) is unknown.
    timed = screen('now.getHours() < 6 && request.headers.exists(k, k.startsWith("x-b"))', in_cidr)
    assert timed.complete
    assert timed.decide is not None
    assert timed.decide("", "", {"x-block": "1"}, "", 5) is True
    assert timed.decide("", "", {"x-block": "1"}, "", 6) is False
    assert timed.decide("", "", {"x-a": "1"}, "", 5) is False
    assert timed.decide("", "", {"x-block": "1"}, "", -1) is None
    assert screen("size(adapter) > 3", in_cidr).decide is None
    assert screen('adapter == "a" ? true : false', in_cidr).decide is None
