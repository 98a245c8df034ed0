"""Protocol buffers of the adaptermesh.v1 API and their generated modules.

Import the generated modules from here::

    from adaptermesh.proto import assignment_pb2, control_plane_pb2, control_plane_pb2_grpc

They load lazily, so ``python -m adaptermesh.proto.generate`` works before they exist.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["assignment_pb2", "control_plane_pb2", "control_plane_pb2_grpc"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"adaptermesh.proto.adaptermesh.v1.{name}")
    raise AttributeError(f"module 'adaptermesh.proto' has no attribute {name!r}")
