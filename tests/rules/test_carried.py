"""The rule set as the Assignment carries it (Assignment.routing_rules): generated rule sets
survive the wire and compile to the same rules on the agent, the form is canonical, and every
hostile envelope (tampered text or digest, a version without text, an oversize document, text
that is not a rule set) is refused naming the field, never half-used."""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh import assignment_rules
from adaptermesh.proto import assignment_pb2
from adaptermesh.rules import (
    RuleError,
    canonical_document,
    carried_pins,
    carried_rules,
    cidr_pins,
    parse_rule_set,
    routing_rules_message,
)

WHENS = [
    'request.tenant == "acme"',
    'adapter.startsWith("fin-") && "x-tier" in request.headers',
    'inCidr(request.source_ip, "10.1.0.0/16")',
    'inCidr(request.source_ip, "10.2.0.0/16") || inCidr(request.source_ip, "10.3.0.0/24")',
    "now.getHours() < 6",
    'request.headers.exists(k, k.startsWith("x-"))',
]
ACTIONS: list[dict[str, Any]] = [
    {"shard": "s0"},
    {"shard": "s1"},
    {"adapter_version": "2.0.0"},
    {"priority": 3},
    {"reject": {"status": 403, "message": "no"}},
]

documents = st.builds(
    lambda items, max_rules, fallback: {
        "rules": [{"name": f"r{i}", "when": w, **a} for i, (w, a) in enumerate(items)],
        "budget": {"max_rules": max_rules, "max_us": 500},
        "fallback": fallback,
    },
    st.lists(st.tuples(st.sampled_from(WHENS), st.sampled_from(ACTIONS)), max_size=8),
    st.integers(1, 200),
    st.sampled_from(["pass", {"reject": {"status": 503, "message": "busy"}}]),
)


@settings(max_examples=60, deadline=None)
@given(documents, st.integers(1, 2**40))
def test_carried_form_round_trips_and_compiles_to_the_stored_rules(
    doc: dict[str, Any], version: int
) -> None:
    msg = routing_rules_message(version, doc)
    wire = assignment_pb2.Assignment(routing_rules=msg).SerializeToString()
    got = assignment_pb2.Assignment.FromString(wire).routing_rules
    assignment_rules.check_routing_rules(got)
    compiled = carried_rules(got)
    assert compiled is not None
    assert compiled.rule_set == parse_rule_set(doc)
    # Canonical: the same set written another way carries the same bytes and digest.
    shuffled = json.loads(json.dumps(doc, sort_keys=False))
    assert routing_rules_message(version, shuffled).SerializeToString() == msg.SerializeToString()
    assert msg.document_json == canonical_document(parse_rule_set(doc))
    # The pins carried are the rule set's own, restricted to the active shards.
    pins = [(p.cidr, p.shard_id) for p in cidr_pins(parse_rule_set(doc))]
    assert [(p.cidr, p.shard_id) for p in carried_pins(got, frozenset({"s0", "s1"}))] == pins
    assert all(p.shard_id == "s1" for p in carried_pins(got, frozenset({"s1"})))


@settings(max_examples=60, deadline=None)
@given(documents, st.integers(0, 10_000), st.sampled_from(string.printable))
def test_tampered_text_is_refused_by_the_digest(doc: dict[str, Any], at: int, ch: str) -> None:
    msg = routing_rules_message(1, doc)
    text = msg.document_json
    i = at % len(text)
    if text[i] == ch:
        return
    msg.document_json = text[:i] + ch + text[i + 1 :]
    with pytest.raises(RuleError, match=r"routing_rules\.digest"):
        carried_rules(msg)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda m: setattr(m, "version", 0), "routing_rules.version"),
        (
            lambda m: (setattr(m, "document_json", ""), setattr(m, "digest", b"")),
            "routing_rules: no document_json",
        ),
        (lambda m: setattr(m, "digest", b""), "routing_rules.digest"),
    ],
)
def test_hostile_envelopes_name_the_field(make: Any, field: str) -> None:
    msg = routing_rules_message(7, {"rules": [{"name": "a", "when": "true", "shard": "s0"}]})
    make(msg)
    with pytest.raises(RuleError, match=field.replace(".", r"\.")):
        carried_rules(msg)
    with pytest.raises(assignment_rules.RuleError, match=field.replace(".", r"\.")):
        assignment_rules.check_assignment(assignment_pb2.Assignment(routing_rules=msg))


def _sealed(version: int, text: str) -> assignment_pb2.RoutingRules:
    return assignment_pb2.RoutingRules(
        version=version, document_json=text, digest=hashlib.sha256(text.encode()).digest()
    )


def test_oversize_document_is_refused() -> None:
    text = json.dumps({"rules": [], "pad": "x" * assignment_rules.MAX_RULES_DOCUMENT_BYTES})
    with pytest.raises(RuleError, match=r"routing_rules\.document_json: \d+ bytes, at most"):
        carried_rules(_sealed(1, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "document_json: not JSON"),
        ('{"rules": [{"name": "a", "when": "tier", "shard": "s0"}]}', "undeclared variable"),
        ('{"rules": [{"name": "a", "when": "true"}]}', "rule 'a'"),
        ("[1, 2]", "<set>"),
    ],
)
def test_sealed_text_that_is_not_a_rule_set_is_refused(text: str, message: str) -> None:
    with pytest.raises(RuleError, match=message):
        carried_rules(_sealed(3, text))


def test_no_rules_is_none() -> None:
    assert carried_rules(assignment_pb2.RoutingRules()) is None
    assert carried_pins(assignment_pb2.RoutingRules(), frozenset({"s0"})) == []
