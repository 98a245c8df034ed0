"""The routing-rule model: what an operator writes, and its limits.

A rule set is an ordered list of rules; the first rule whose ``when`` holds decides, so list
order is priority order. Each rule has one action:

- ``shard``: route to that shard (the processor sets ``x-adaptermesh-shard``);
- ``adapter_version``: serve that version of the named adapter (``x-adapter-version``);
- ``priority``: the scheduling priority, 0 (lowest) to 9 (``x-adaptermesh-priority``);
- ``reject``: answer the request at once with ``status`` (400-599) and a message.

The set also carries its per-request cost budget and the action taken when a request runs
over it (``fallback``: ``pass`` leaves the request unchanged, or a ``reject``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from adaptermesh.assignment_rules import SHARD_ID_RE, bounded_message, quote

__all__ = [
    "MAX_RULES",
    "MAX_WHEN_CHARS",
    "Action",
    "Budget",
    "Rule",
    "RuleError",
    "RuleSet",
    "parse_rule_set",
    "rule_set_document",
]

# Write-time limits: a set the agent would refuse can never be stored.
MAX_RULES = 1000
MAX_WHEN_CHARS = 2048
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")

ActionKind = Literal["shard", "adapter_version", "priority", "reject"]
_KINDS: tuple[ActionKind, ...] = ("shard", "adapter_version", "priority", "reject")


class RuleError(ValueError):
    """A rule set that cannot be stored: names the rule, and where known the position."""

    def __init__(
        self, rule: str, message: str, *, line: int | None = None, column: int | None = None
    ) -> None:
        self.rule = rule
        # A library's message may repeat the whole expression: cut, as any quoted input is.
        self.message = message = bounded_message(message, 512)
        self.line = line
        self.column = column
        where = f" at {line}:{column}" if line is not None and column is not None else ""
        super().__init__(f"rule {quote(rule)}{where}: {message}")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    # Shard id, adapter version or priority digit; empty for a reject.
    value: str = ""
    status: int = 0
    message: str = ""


@dataclass(frozen=True)
class Rule:
    name: str
    when: str
    action: Action


@dataclass(frozen=True)
class Budget:
    # Rules evaluated for one request, and wall time for all of them, before the fallback.
    max_rules: int = MAX_RULES
    max_us: int = 1000


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()
    budget: Budget = field(default_factory=Budget)
    # None passes the request unchanged.
    fallback: Action | None = None


def _action(rule: str, raw: Mapping[str, Any]) -> Action:
    present = [k for k in _KINDS if k in raw]
    if len(present) != 1:
        raise RuleError(rule, f"needs exactly one action of {', '.join(_KINDS)}; got {present}")
    kind = present[0]
    value = raw[kind]
    if kind == "shard":
        if not isinstance(value, str) or not SHARD_ID_RE.match(value):
            raise RuleError(rule, f"shard: {quote(value)} is not a shard id")
        return Action("shard", value)
    if kind == "adapter_version":
        if not isinstance(value, str) or not _VERSION.match(value):
            raise RuleError(rule, f"adapter_version: {quote(value)} is not a version")
        return Action("adapter_version", value)
    if kind == "priority":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
            raise RuleError(rule, f"priority: {quote(value)} is not an integer 0-9")
        return Action("priority", str(value))
    return _reject(rule, value)


def _reject(rule: str, value: Any) -> Action:
    if not isinstance(value, Mapping):
        raise RuleError(rule, "reject: needs {status, message}")
    status = value.get("status", 403)
    message = value.get("message", "rejected by routing rule")
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise RuleError(rule, f"reject.status: {quote(status)} is not an HTTP status 400-599")
    if not isinstance(message, str) or len(message) > 256:
        raise RuleError(rule, "reject.message: needs a string of at most 256 characters")
    return Action("reject", "", status, message)


def parse_rule_set(raw: Mapping[str, Any]) -> RuleSet:
    """Build a RuleSet from its document form (the YAML ``adapterctl rules apply`` reads).

    Checks shape and limits only; ``compile_rule_set`` checks the expressions.
    """
    if not isinstance(raw, Mapping):
        raise RuleError("<set>", "the document must be a mapping with a 'rules' list")
    items = raw.get("rules", [])
    if not isinstance(items, list):
        raise RuleError("<set>", "rules: must be a list")
    if len(items) > MAX_RULES:
        raise RuleError("<set>", f"rules: {len(items)} rules, at most {MAX_RULES}")
    rules: list[Rule] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise RuleError(f"#{i}", "each rule must be a mapping")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RuleError(f"#{i}", f"name: {quote(name)} must match {_NAME.pattern}")
        if name in seen:
            raise RuleError(name, "name: used twice")
        seen.add(name)
        when = item.get("when")
        if not isinstance(when, str) or not when.strip():
            raise RuleError(name, "when: needs a CEL expression")
        if len(when) > MAX_WHEN_CHARS:
            raise RuleError(name, f"when: {len(when)} characters, at most {MAX_WHEN_CHARS}")
        rules.append(Rule(name, when, _action(name, item)))
    budget_raw = raw.get("budget", {})
    if not isinstance(budget_raw, Mapping):
        raise RuleError("<set>", "budget: must be a mapping")
    budget = Budget()
    max_rules = budget_raw.get("max_rules", budget.max_rules)
    max_us = budget_raw.get("max_us", budget.max_us)
    for key, val in (("max_rules", max_rules), ("max_us", max_us)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise RuleError("<set>", f"budget.{key}: {quote(val)} must be a positive integer")
    fallback_raw = raw.get("fallback", "pass")
    fallback: Action | None
    if fallback_raw == "pass":
        fallback = None
    elif isinstance(fallback_raw, Mapping) and "reject" in fallback_raw:
        fallback = _reject("<fallback>", fallback_raw["reject"])
    else:
        raise RuleError("<set>", "fallback: 'pass' or {reject: {status, message}}")
    return RuleSet(tuple(rules), Budget(max_rules, max_us), fallback)


def rule_set_document(rule_set: RuleSet) -> dict[str, Any]:
    """The document form of a rule set (parse_rule_set's inverse), for storage and display."""

    def action(a: Action) -> dict[str, Any]:
        if a.kind == "reject":
            return {"reject": {"status": a.status, "message": a.message}}
        if a.kind == "priority":
            return {"priority": int(a.value)}
        return {a.kind: a.value}

    return {
        "rules": [{"name": r.name, "when": r.when, **action(r.action)} for r in rule_set.rules],
        "budget": {"max_rules": rule_set.budget.max_rules, "max_us": rule_set.budget.max_us},
        "fallback": "pass" if rule_set.fallback is None else action(rule_set.fallback),
    }
