"""Test and demo support for adaptermesh: nothing in ``adaptermesh`` imports it (except the
``adaptermesh demo`` command, lazily).

* :mod:`adaptermesh_testkit.netns`: network-namespace topologies (a node, tenants, shards) and
  traffic helpers, for the classifier's tests and the demos.
* :mod:`adaptermesh_testkit.checkpoints`: tiny local checkpoints, PEFT adapters and AdaFuse
  expert sets, for tests, demos and benches.
* :mod:`adaptermesh_testkit.localmesh`: the whole mesh on one machine (``adaptermesh demo``
  and the end-to-end tests).
* :mod:`adaptermesh_testkit.classifier_demo`: ``adaptermesh demo classifier``.
"""
