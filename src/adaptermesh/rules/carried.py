"""The routing-rule set as an Assignment carries it to the agents.

The control plane puts its live set into ``Assignment.routing_rules`` (version, canonical JSON,
SHA-256) and merges the set's source-CIDR-only rules into the pins; every agent compiles the
carried set before its external processor uses it. Both sides go through :func:`carried_rules`,
so a set the agent would refuse is never published. Compiling runs CEL's probe evaluations, so
results are cached by the document (the rebalancer re-validates every Assignment it publishes).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from adaptermesh.assignment_rules import RuleError as AssignmentRuleError
from adaptermesh.assignment_rules import check_routing_rules
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
from adaptermesh.rules.engine import CompiledRuleSet, compile_rule_set
from adaptermesh.rules.model import RuleError, RuleSet, parse_rule_set, rule_set_document
from adaptermesh.rules.pins import cidr_pins

__all__ = ["canonical_document", "carried_pins", "carried_rules", "routing_rules_message"]


def canonical_document(rule_set: RuleSet) -> str:
    """The one spelling of a rule set: what the store keeps, digests and carries."""
    return json.dumps(rule_set_document(rule_set), sort_keys=True, separators=(",", ":"))


def routing_rules_message(version: int, document: Any) -> assignment_pb2.RoutingRules:
    """The carried form of a stored set (``document``: its parsed JSON); RuleError if bad."""
    text = canonical_document(parse_rule_set(document))
    raw = text.encode()
    return assignment_pb2.RoutingRules(
        version=version, document_json=text, digest=hashlib.sha256(raw).digest()
    )


@functools.lru_cache(maxsize=8)
def _compile(text: str) -> tuple[RuleSet, CompiledRuleSet]:
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise RuleError("<set>", f"document_json: not JSON: {exc}") from None
    rule_set = parse_rule_set(document)
    return rule_set, compile_rule_set(rule_set)


def carried_rules(message: assignment_pb2.RoutingRules) -> CompiledRuleSet | None:
    """The compiled set an Assignment carries (None: it carries none).

    Raises RuleError for an envelope that breaks assignment_rules (size, version, digest) or a
    set that does not parse or compile; the caller keeps what it had.
    """
    try:
        check_routing_rules(message)
    except AssignmentRuleError as exc:
        raise RuleError("<set>", str(exc)) from None
    if not message.document_json:
        return None
    return _compile(message.document_json)[1]


def carried_pins(
    message: assignment_pb2.RoutingRules, active_shards: frozenset[str]
) -> list[assignment_pb2.Pin]:
    """The pins the carried set's leading source-CIDR-only rules compile to, for shards that
    are ACTIVE (a pin must target one; the processor still applies the rule for the others)."""
    if not message.document_json:
        return []
    rule_set = _compile(message.document_json)[0]
    return [p for p in cidr_pins(rule_set) if p.shard_id in active_shards]
