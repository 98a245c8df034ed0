"""The test kit, for the commands that run it: ``adaptermesh demo`` and ``adaptermesh dev``.

The test kit (``adaptermesh_testkit``: namespace topologies, tiny checkpoints, the local mesh)
is its own distribution, ``adaptermesh-testkit`` (``testkit/`` in the repository), and is not in
the ``adaptermesh`` wheel: a worker, agent or control-plane image never carries it. The package
imports it in this one place, by name and only when such a command runs; without it the
command stops with a message naming what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["TESTKIT_DISTRIBUTION", "NoTestkitError", "load_testkit"]

TESTKIT_DISTRIBUTION = "adaptermesh-testkit"
_PACKAGE = "adaptermesh_testkit"


class NoTestkitError(RuntimeError):
    """The test kit is not installed; the message says what to install."""


def load_testkit(name: str, command: str) -> ModuleType:
    """``adaptermesh_testkit.<name>``, for ``command`` (named in the error when it is absent)."""
    try:
        return importlib.import_module(f"{_PACKAGE}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in (_PACKAGE, f"{_PACKAGE}.{name}"):
            raise  # the test kit is there; something it imports is not
        raise NoTestkitError(
            f"{command} runs the test kit, which is not installed: install the "
            f"{TESTKIT_DISTRIBUTION} distribution from a clone of the repository "
            "(`pip install ./testkit`; `make setup` installs it in .venv)"
        ) from None
