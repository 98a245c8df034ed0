"""Routing rules: CEL conditions over request attributes that pick a shard, an adapter
version, a priority or a rejection. One module owns them; the control plane compiles on write,
the agent's external processor evaluates per request, and source-CIDR-only rules become the
Assignment's pins."""

from adaptermesh.rules.carried import (
    canonical_document,
    carried_pins,
    carried_rules,
    routing_rules_message,
)
from adaptermesh.rules.engine import (
    CompiledRuleSet,
    Evaluator,
    Outcome,
    RequestFacts,
    compile_rule_set,
    in_cidr,
)
from adaptermesh.rules.model import (
    Action,
    Budget,
    Rule,
    RuleError,
    RuleSet,
    parse_rule_set,
    rule_set_document,
)
from adaptermesh.rules.pins import cidr_pins

__all__ = [
    "Action",
    "Budget",
    "CompiledRuleSet",
    "Evaluator",
    "Outcome",
    "RequestFacts",
    "Rule",
    "RuleError",
    "RuleSet",
    "canonical_document",
    "carried_pins",
    "carried_rules",
    "cidr_pins",
    "compile_rule_set",
    "in_cidr",
    "parse_rule_set",
    "routing_rules_message",
    "rule_set_document",
]
