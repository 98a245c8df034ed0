"""The last applied Assignment, kept on disk so that a restarted agent serves it at once.

Without it a restarted agent would start its xDS server empty, and every Envoy that reconnects
would lose its listeners until the control plane answered. The file is written atomically
(temporary file, fsync, rename) so a crash leaves either the old or the new Assignment.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from google.protobuf.message import DecodeError

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = ["AssignmentStore"]

_log = logging.getLogger(__name__)


class AssignmentStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load(self) -> assignment_pb2.Assignment | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            assignment = assignment_pb2.Assignment.FromString(self.path.read_bytes())
        except (OSError, DecodeError) as exc:
            # A corrupt cache is not fatal: the control plane resends the current Assignment.
            _log.warning("ignoring unreadable assignment cache %s: %s", self.path, exc)
            return None
        return assignment if assignment.version > 0 else None

    def save(self, assignment: assignment_pb2.Assignment) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".assignment.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(assignment.SerializeToString())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
