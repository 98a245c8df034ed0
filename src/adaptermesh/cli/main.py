"""The ``adaptermesh`` entry point: ``agent``, ``control-plane``, ``worker``,
``adafuse-train``, ``mqtt-bridge`` and ``demo``.

Each subcommand forwards its arguments to the part's own ``cli.main(argv) -> int``, so every
part owns its flags and can be run as ``python -m adaptermesh.<part>.cli`` too.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

import adaptermesh

__all__ = ["COMMANDS", "app", "main", "version"]

COMMANDS = {
    "agent": ("adaptermesh.agent.cli", "Run the node agent (eBPF classifier + xDS server)."),
    "control-plane": ("adaptermesh.control_plane.cli", "Run the control plane gRPC API."),
    "worker": ("adaptermesh.worker.cli", "Run a GPU/CPU worker with the OpenAI-compatible API."),
    "adafuse-train": (
        "adaptermesh.worker.adafuse_train_cli",
        "Train an AdaFuse expert set (router + LoRA experts) on text files.",
    ),
    "mqtt-bridge": (
        "adaptermesh.bridge.cli",
        "Answer OpenAI requests from an MQTT topic through the mesh.",
    ),
    "demo": ("adaptermesh.cli.demo", "Run the local demo mesh in network namespaces."),
    "dev": ("adaptermesh.cli.dev", "The mesh on one machine: make-model, up, down."),
}


def version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    try:
        return metadata.version("adaptermesh")
    except metadata.PackageNotFoundError:
        return adaptermesh.__version__


def _usage() -> str:
    lines = [
        "usage: adaptermesh [-h] [-V] COMMAND [ARGS]...",
        "",
        "commands (adaptermesh COMMAND -h describes each one's flags):",
    ]
    lines += [f"  {name:<14} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  -h, --help     show this help message and exit",
        "  -V, --version  print the adaptermesh version and exit",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"adaptermesh {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"adaptermesh: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result: int = module.main(rest)
    return result


def app() -> None:
    sys.exit(main())
