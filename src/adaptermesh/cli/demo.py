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

Both demos live in the test-support package ``adaptermesh_testkit`` (namespace topologies,
tiny checkpoints), imported only when a demo runs.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["classifier"]:
        from adaptermesh_testkit.classifier_demo import main as classifier_main

        return classifier_main(args[1:])
    from adaptermesh_testkit.localmesh import main as mesh_main

    return mesh_main(args)


if __name__ == "__main__":
    sys.exit(main())
