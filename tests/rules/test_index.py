"""The rule index against the linear walk: same outcome on generated rule sets and requests,
the index never drops a rule whose screen is not false, and the budget counts visited rules."""

from __future__ import annotations

import datetime as dt

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.rules import (
    Action,
    Budget,
    Evaluator,
    RequestFacts,
    Rule,
    RuleSet,
    compile_rule_set,
    in_cidr,
)
from adaptermesh.rules.guards import parse, screen
from adaptermesh.rules.index import build_index, members

TENANTS = ["acme", "acme-eu", "globex", ""]
ADAPTERS = ["fin-risk", "fin-", "fi", "ops-sum", "x-fin-risk", ""]
PREFIXES = ["", "fin-", "fin-r", "ops", "acme", "x"]
SUFFIXES = ["", "risk", "-sum", "-eu"]
KEYS = ["x-tier", "x-team", "x-debug"]
VALUES = ["gold", "silver", ""]
CIDRS = [
    "10.0.0.0/8",
    "10.1.0.0/16",
    "10.1.2.0/24",
    "10.1.2.3/32",
    "192.168.0.0/16",
    "0.0.0.0/0",
    "2001:db8::/32",
    "2001:db8:1::/48",
    "::/0",
]
IPS = [
    "10.1.2.3",
    "10.1.9.9",
    "10.200.0.1",
    "192.168.4.4",
    "8.8.8.8",
    "2001:db8::7",
    "2001:db8:1::1",
    "::ffff:10.1.2.3",
    "bad",
    "",
    "10.1.2.3/8",
    "300.1.1.1",
]


def _q(s: str) -> str:
    return f'"{s}"'


# Every atom kind the screens read, and parts that only CEL can decide.
atoms = st.one_of(
    st.sampled_from(ADAPTERS).map(lambda a: f"adapter == {_q(a)}"),
    st.sampled_from(TENANTS).map(lambda t: f"request.tenant == {_q(t)}"),
    st.sampled_from(IPS[:6]).map(lambda ip: f"request.source_ip == {_q(ip)}"),
    st.tuples(
        st.sampled_from(["adapter", "request.tenant"]),
        st.sampled_from(["startsWith", "endsWith"]),
        st.sampled_from(PREFIXES + SUFFIXES),
    ).map(lambda f: f"{f[0]}.{f[1]}({_q(f[2])})"),
    st.sampled_from(KEYS).map(lambda k: f"{_q(k)} in request.headers"),
    st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)).map(
        lambda kv: f"request.headers[{_q(kv[0])}] == {_q(kv[1])}"
    ),
    st.sampled_from(CIDRS).map(lambda c: f"inCidr(request.source_ip, {_q(c)})"),
    st.tuples(st.sampled_from(["<", ">=", "==", "!=", "<=", ">"]), st.integers(-1, 24)).map(
        lambda on: f"now.getHours() {on[0]} {on[1]}"
    ),
    st.sampled_from([*KEYS, "x-t", ""]).map(
        lambda p: f"request.headers.exists(k, k.startsWith({_q(p)}))"
    ),
    st.sampled_from(KEYS).map(lambda k: f"request.headers.exists(h, h == {_q(k)})"),
    st.sampled_from(["true", "false"]),
    # CEL only: a size(), a minute, a contains, a header read that errors when absent.
    st.integers(0, 6).map(lambda n: f"size(adapter) > {n}"),
    st.integers(0, 59).map(lambda n: f"now.getMinutes() < {n}"),
    st.sampled_from(["risk", "-"]).map(lambda s: f"adapter.contains({_q(s)})"),
    st.sampled_from(KEYS).map(lambda k: f'request.headers[{_q(k)}].startsWith("g")'),
    st.sampled_from(ADAPTERS).map(lambda a: f"(adapter == {_q(a)} ? true : false)"),
)


def _combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, children).map(lambda ab: f"({ab[0]}) && ({ab[1]})"),
        st.tuples(children, children).map(lambda ab: f"({ab[0]}) || ({ab[1]})"),
        st.lists(children, min_size=3, max_size=3).map(" && ".join),
        st.lists(children, min_size=3, max_size=3).map(" || ".join),
        children.map(lambda a: f"!({a})"),
    )


expressions = st.recursive(atoms, _combine, max_leaves=6)

times = st.one_of(
    st.datetimes(
        min_value=dt.datetime(2026, 1, 1),
        max_value=dt.datetime(2027, 1, 1),
        timezones=st.just(dt.UTC),
    ),
    # A `now` without a time zone: the evaluator takes no hour and hour atoms go to CEL.
    st.datetimes(min_value=dt.datetime(2026, 1, 1), max_value=dt.datetime(2027, 1, 1)),
)

requests = st.builds(
    RequestFacts,
    source_ip=st.sampled_from(IPS),
    tenant=st.sampled_from(TENANTS),
    headers=st.dictionaries(st.sampled_from([*KEYS, "x-other"]), st.sampled_from(VALUES)),
    adapter=st.sampled_from(ADAPTERS),
    now=times,
)


def _rules(exprs: list[str]) -> tuple[Rule, ...]:
    return tuple(Rule(f"r{i}", src, Action("shard", f"s{i}")) for i, src in enumerate(exprs))


def _key(out: object) -> tuple[object, ...]:
    return (out.action, out.rule, out.errors, out.over_budget)  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(st.lists(expressions, min_size=1, max_size=10), st.lists(requests, min_size=1, max_size=8))
def test_indexed_agrees_with_linear(exprs: list[str], reqs: list[RequestFacts]) -> None:
    compiled = compile_rule_set(RuleSet(_rules(exprs)))
    # A still clock: agreement, not the time budget, is under test.
    indexed = Evaluator(compiled, clock=lambda: 0)
    linear = Evaluator(compiled, index=False, clock=lambda: 0)
    for req in reqs:
        got, want = indexed.evaluate(req), linear.evaluate(req)
        assert _key(got) == _key(want), (exprs, req)
        assert got.evaluated <= want.evaluated
    assert indexed.stats == linear.stats


@settings(max_examples=300, deadline=None)
@given(expressions, requests)
def test_a_rule_left_out_is_one_its_screen_calls_false(src: str, req: RequestFacts) -> None:
    index = build_index([parse(src)])
    hour = -1 if req.now is None or req.now.tzinfo is None else req.now.hour
    if index.candidates(req.source_ip, req.tenant, req.headers, req.adapter, hour) & 1:
        return
    decide = screen(src, in_cidr).decide
    assert decide is not None, src
    assert decide(req.source_ip, req.tenant, req.headers, req.adapter, hour) is False, src


@settings(max_examples=100, deadline=None)
@given(
    st.lists(expressions, min_size=1, max_size=10),
    st.lists(requests, min_size=1, max_size=6),
    st.integers(1, 10),
)
def test_budget_within_linear_means_the_same_outcome(
    exprs: list[str], reqs: list[RequestFacts], max_rules: int
) -> None:
    fallback = Action("reject", status=503, message="over budget")
    compiled = compile_rule_set(RuleSet(_rules(exprs), Budget(max_rules=max_rules), fallback))
    indexed = Evaluator(compiled, clock=lambda: 0)
    linear = Evaluator(compiled, index=False, clock=lambda: 0)
    for req in reqs:
        got, want = indexed.evaluate(req), linear.evaluate(req)
        assert got.evaluated <= max_rules
        if not want.over_budget:
            assert _key(got) == _key(want)
        # Skipped rules cost nothing, so the indexed walk is over budget only where the
        # linear one is too, and then both fall back.
        if got.over_budget:
            assert want.over_budget
            assert got.action == want.action == fallback


# -- what the index finds, by example ---------------------------------------------------------


def _visits(srcs: list[str], req: RequestFacts) -> list[int]:
    index = build_index([parse(s) for s in srcs])
    return members(index.candidates(req.source_ip, req.tenant, req.headers, req.adapter, -1))


def test_conjunctions_disjunctions_and_negations_are_indexed() -> None:
    srcs = [
        'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")',
        'request.tenant == "acme" || adapter == "ops-sum"',
        '!(!(adapter.endsWith("-sum")))',
        'size(adapter) > 3 && "x-debug" in request.headers',
        "false",
        "!true && size(adapter) > 1",
        "size(adapter) > 3",  # nothing to look up: always a candidate
        'request.tenant == "acme" || size(adapter) > 3',  # one branch opaque: always
    ]
    index = build_index([parse(s) for s in srcs])
    assert index.indexed == 6
    req = RequestFacts(tenant="globex", adapter="fin-risk", headers={"x-tier": "silver"})
    assert _visits(srcs, req) == [6, 7]
    assert _visits(srcs, RequestFacts(adapter="ops-sum")) == [0, 1, 2, 6, 7]
    assert _visits(srcs, RequestFacts(tenant="acme", headers={"x-debug": ""})) == [0, 1, 3, 6, 7]


def test_missing_header_key_keeps_the_rule_and_counts_its_error() -> None:
    rules = _rules(['request.headers["x-tier"] == "gold"', 'adapter == "a"'])
    ev = Evaluator(compile_rule_set(RuleSet(rules)))
    absent = ev.evaluate(RequestFacts(adapter="a"))
    assert (absent.rule, absent.errors, absent.evaluated) == ("r1", 1, 2)
    other = ev.evaluate(RequestFacts(adapter="a", headers={"x-tier": "silver"}))
    assert (other.rule, other.errors, other.evaluated) == ("r1", 0, 1)
    gold = ev.evaluate(RequestFacts(adapter="b", headers={"x-tier": "gold"}))
    assert (gold.rule, gold.errors, gold.evaluated) == ("r0", 0, 1)


def test_cidrs_by_prefix_length_both_families() -> None:
    srcs = [f"inCidr(request.source_ip, {_q(c)})" for c in CIDRS]
    assert _visits(srcs, RequestFacts(source_ip="10.1.2.3")) == [0, 1, 2, 3, 5]
    assert _visits(srcs, RequestFacts(source_ip="10.1.3.1")) == [0, 1, 5]
    assert _visits(srcs, RequestFacts(source_ip="2001:db8:1::9")) == [6, 7, 8]
    assert _visits(srcs, RequestFacts(source_ip="2001:db9::1")) == [8]
    assert _visits(srcs, RequestFacts(source_ip="not-an-ip")) == []


def test_a_hundred_rule_set_visits_a_few() -> None:
    srcs = []
    for i in range(100):
        srcs += [
            f'request.headers["x-tier"] == "t{i}" && adapter.startsWith("fin-{i}-")',
            f'inCidr(request.source_ip, "10.{i}.0.0/16")',
            f'request.tenant == "tenant{i}" || adapter == "adapter{i}"',
            f'request.tenant == "tenant{i}" && now.getHours() >= 0',
            f'"x-debug-{i}" in request.headers && request.headers.exists(k, k.startsWith("x"))',
        ]
    index = build_index([parse(s) for s in srcs])
    assert index.indexed == len(srcs)
    req = RequestFacts("10.7.1.1", "tenant7", {"x-tier": "t9"}, "fin-7-risk")
    # Rule 7's three that can match, and rule 9's header rule: its conjunction is indexed by
    # the header value (narrower than the adapter prefix), and x-tier is t9.
    assert [i // 5 for i in members(index.candidates(*_args(req)))] == [7, 7, 7, 9]


def _args(req: RequestFacts) -> tuple[str, str, dict[str, str], str, int]:
    return req.source_ip, req.tenant, dict(req.headers), req.adapter, 5


@given(
    st.one_of(
        st.integers(0, 2**12), st.integers(0, 2**1000), st.integers(0, 999).map(lambda i: 1 << i)
    )
)
def test_members_are_the_set_bits_ascending(mask: int) -> None:
    assert members(mask) == [i for i in range(mask.bit_length()) if mask >> i & 1]
