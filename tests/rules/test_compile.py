"""Write-time checks: a bad rule is refused naming the rule and, where CEL gives one, the
position; a good set compiles."""

from __future__ import annotations

import pytest

from adaptermesh.rules import RuleError, compile_rule_set, parse_rule_set


def _one(when: str, **action: object) -> None:
    doc = {
        "rules": [
            {"name": "ok", "when": "true", "shard": "a"},
            {"name": "bad-rule", "when": when, **(action or {"shard": "gold"})},
        ]
    }
    compile_rule_set(parse_rule_set(doc))


@pytest.mark.parametrize(
    ("when", "line", "column", "fragment"),
    [
        ('request.tenant == "a" &&& adapter == "b"', 1, 25, "syntax error"),
        ('request.tenant == "a" &&\n  adapter.startsWith(', 2, 22, "syntax error"),
        ('tier == "gold"', 1, 1, "undeclared variable 'tier'"),
        ('request.tenant == "a" || request.source == "b"', 1, 34, "no field 'source'"),
        ('adapter == "a" && lookup(adapter)', 1, 19, "unknown function 'lookup'"),
        ('inCidr(request.source_ip, "10.0.0.0/33")', 1, 27, "not a CIDR"),
        ("request.headers.exists(k, k == other)", 1, 32, "undeclared variable 'other'"),
    ],
)
def test_refused_with_position(when: str, line: int, column: int, fragment: str) -> None:
    with pytest.raises(RuleError) as info:
        _one(when)
    err = info.value
    assert err.rule == "bad-rule"
    assert (err.line, err.column) == (line, column)
    assert fragment in err.message
    assert f"at {line}:{column}" in str(err)


@pytest.mark.parametrize(
    ("when", "fragment"),
    [
        ("request.tenant", "must give a bool"),
        ("request.tenant + 1 == 2", "type error"),
        ("size(adapter) + adapter == 1", "type error"),
    ],
)
def test_type_errors_refused(when: str, fragment: str) -> None:
    with pytest.raises(RuleError, match=fragment) as info:
        _one(when)
    assert info.value.rule == "bad-rule"


@pytest.mark.parametrize(
    "when",
    [
        'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")',
        '"x-tier" in request.headers && request.headers["x-tier"] in ["gold", "silver"]',
        'inCidr(request.source_ip, "10.0.0.0/8") || inCidr(request.source_ip, "2001:db8::/32")',
        'now.getHours() >= 9 && now < timestamp("2027-01-01T00:00:00Z")',
        'request.headers.exists(k, k.startsWith("x-debug"))',
        '!(request.tenant == "acme") && size(adapter) > 3',
        'adapter.matches("^fin-[a-z]+$")',
    ],
)
def test_valid_rules_compile(when: str) -> None:
    _one(when)


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"rules": [{"name": "r", "when": "true"}]}, "exactly one action"),
        (
            {"rules": [{"name": "r", "when": "true", "shard": "a", "priority": 1}]},
            "exactly one action",
        ),
        ({"rules": [{"name": "r", "when": "true", "priority": 12}]}, "priority"),
        ({"rules": [{"name": "r", "when": "true", "reject": {"status": 200}}]}, "reject.status"),
        ({"rules": [{"name": "r", "when": "true", "shard": "Bad Shard"}]}, "shard"),
        (
            {
                "rules": [
                    {"name": "r", "when": "true", "shard": "a"},
                    {"name": "r", "when": "true", "shard": "b"},
                ]
            },
            "used twice",
        ),
        ({"rules": [{"name": "R!", "when": "true", "shard": "a"}]}, "name"),
        ({"rules": [], "budget": {"max_us": 0}}, "budget.max_us"),
        ({"rules": [], "fallback": "drop"}, "fallback"),
    ],
)
def test_shape_refused(doc: dict[str, object], fragment: str) -> None:
    with pytest.raises(RuleError, match=fragment):
        compile_rule_set(parse_rule_set(doc))
