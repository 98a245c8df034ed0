"""What every ``adaptermesh`` command line shares: help that shows each flag's default, and
logging that keeps the HTTP client's per-request lines out of INFO.

The agent scrapes every worker's ``/metrics`` each second and the control plane every worker
each rebalance interval; httpx logs each of those requests at INFO, which buried everything
else in the logs. Those lines are kept for ``--log-level DEBUG``.
"""

from __future__ import annotations

import argparse
import logging

__all__ = [
    "LOG_FORMAT",
    "QUIET_LOGGERS",
    "DefaultsHelpFormatter",
    "RawDescriptionDefaultsHelpFormatter",
    "setup_logging",
    "shows_default",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that log one line per HTTP request (the periodic worker scrapes).
QUIET_LOGGERS = ("httpx", "httpcore")


def shows_default(action: argparse.Action) -> bool:
    """Whether ``action`` has a default worth printing: an optional flag whose default is a
    value (not None, not an on/off flag's False, not an empty list)."""
    if not action.option_strings or action.default is argparse.SUPPRESS:
        return False
    if isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return False
    default = action.default
    return default is not None and default is not False and default != [] and default != ()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help, unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


class RawDescriptionDefaultsHelpFormatter(
    DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """``DefaultsHelpFormatter`` that prints the description as written."""


def setup_logging(level: str) -> None:
    """Configure the root logger at ``level`` (a name, any case). Below DEBUG the HTTP client's
    per-request lines (httpx, httpcore) are logged from WARNING only."""
    level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    quiet = logging.getLevelName(level) != logging.DEBUG
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)
