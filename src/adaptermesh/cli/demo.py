"""``adaptermesh demo``: the whole mesh on one machine, in network namespaces.

``adaptermesh demo`` builds tenants, a node with the agent and the control plane, and shards of
Envoy + CPU workers, then tells the story: tenant traffic flows, an ``adapterctl`` override and
a tenant pin take effect, and a load spike on one shard makes the rebalancer move weight away
(:mod:`adaptermesh_testkit.localmesh`).

``adaptermesh demo classifier`` is the datapath alone. It builds a node namespace with the classifier on its tenant-facing interface, a tenant namespace
with several tenant addresses and three shard namespaces (one steered by VXLAN tunnel, one by
mark + policy routing, one by redirect). Tenants send UDP and HTTP to the service address; the
demo applies a pin and a weight change and prints per-shard counts after each step. Everything
is torn down on exit, Ctrl-C included (:mod:`adaptermesh_testkit.classifier_demo`).

Both demos live in the test kit ``adaptermesh_testkit`` (namespace topologies, tiny
checkpoints), its own distribution, ``adaptermesh-testkit``, loaded when a demo runs
(:mod:`adaptermesh.cli.testkit`); without it the demo stops and says what to install.
"""

from __future__ import annotations

import sys

from adaptermesh.cli.testkit import NoTestkitError, load_testkit

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    classifier = args[:1] == ["classifier"]
    try:
        if classifier:
            demo = load_testkit("classifier_demo", "adaptermesh demo classifier")
        else:
            demo = load_testkit("localmesh", "adaptermesh demo")
    except NoTestkitError as exc:
        print(exc, file=sys.stderr)
        return 2
    code: int = demo.main(args[1:] if classifier else args)
    return code


if __name__ == "__main__":
    sys.exit(main())
