"""Follows the routing-rule set the Assignment carries into the external processor.

Every applied Assignment is offered to :meth:`RuleSync.on_assignment`. A set it has not seen
is compiled with ``adaptermesh.rules.carried_rules`` (the same check the control plane ran
before publishing) and installed into every attached processor at once. A set that fails
(a control plane of another version, a corrupted cache) is refused: the last good set keeps
serving and the error is reported with the node's load reports (``adapterctl status`` shows
the node DEGRADED) until a good set arrives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
from adaptermesh.rules import Evaluator, RuleError, carried_rules

__all__ = ["RuleSync"]

_log = logging.getLogger(__name__)

Install = Callable[[Evaluator | None], None]


class RuleSync:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: list[Install] = []
        self.evaluator: Evaluator | None = None
        self.version = 0  # the installed set's version (0: none)
        self._digest = b""
        self._refused = b""  # the digest of the last refused set, not compiled again
        self.error = ""

    def attach(self, install: Install) -> None:
        """Add a processor's ``set_rules``; it gets the current set at once."""
        with self._lock:
            self._targets.append(install)
            install(self.evaluator)

    def on_assignment(self, assignment: assignment_pb2.Assignment) -> None:
        carried = assignment.routing_rules
        digest = carried.digest
        if digest == self._digest or (digest and digest == self._refused):
            return
        try:
            compiled = carried_rules(carried)
        except RuleError as exc:
            self._refused = digest
            self.error = f"routing rules version {carried.version}: {exc}"
            _log.error("%s (still serving rules version %d)", self.error, self.version)
            return
        evaluator = None if compiled is None else Evaluator(compiled)
        with self._lock:
            self.evaluator = evaluator
            self.version = carried.version
            self._digest = digest
            self._refused = b""
            self.error = ""
            for install in self._targets:
                install(evaluator)
        _log.info(
            "routing rules version %d installed (%d rules)",
            carried.version,
            0 if compiled is None else len(compiled.programs),
        )
