"""Source-CIDR-only rules become the Assignment's pins, so the classifier steers them in BPF.

A rule is source-CIDR-only when its ``when`` is one ``inCidr(request.source_ip, "<cidr>")``
or an ``||`` of them, and its action is ``shard``. Only the leading run of such rules becomes
pins: a pin beats everything in the classifier, so a CIDR rule after any other kind of rule
could take packets that the earlier rule would have decided. Inside the run the classifier's
longest-prefix match must agree with first-match order, so a CIDR equal to or inside an earlier
rule's CIDR yields no pin (the earlier rule owns those addresses in both orders); a narrower
CIDR before a wider one agrees already, since the longest prefix wins.
"""

from __future__ import annotations

import ipaddress
import re

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
from adaptermesh.rules.model import RuleSet

__all__ = ["cidr_only", "cidr_pins"]

_ONE = r'\s*inCidr\(\s*request\.source_ip\s*,\s*"([^"]+)"\s*\)\s*'
_WHOLE = re.compile(rf"^\(?{_ONE}\)?(\|\|\(?{_ONE}\)?)*$")
_EACH = re.compile(_ONE)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def cidr_only(when: str) -> list[Network] | None:
    """The networks a source-CIDR-only expression names, or None for any other expression."""
    if _WHOLE.match(when) is None:
        return None
    try:
        return [ipaddress.ip_network(c, strict=False) for c in _EACH.findall(when)]
    except ValueError:
        return None


def cidr_pins(rule_set: RuleSet) -> list[assignment_pb2.Pin]:
    """The pins the rule set's leading source-CIDR-only shard rules compile to."""
    owned: list[Network] = []
    pins: list[assignment_pb2.Pin] = []
    for rule in rule_set.rules:
        nets = cidr_only(rule.when)
        if nets is None or rule.action.kind != "shard":
            break
        for net in nets:
            if any(net.version == o.version and net.subnet_of(o) for o in owned):  # type: ignore[arg-type]
                continue
            owned.append(net)
            pins.append(assignment_pb2.Pin(cidr=str(net), shard_id=rule.action.value))
    return pins
