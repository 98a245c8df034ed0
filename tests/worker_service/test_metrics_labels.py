"""The adapter label of a request: the engine's lookups, not its adapter list, per request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.worker.fair_queue import FairQueue
from adaptermesh.worker.metrics import OTHER_ADAPTER_LABEL, ServiceMetrics
from adaptermesh.worker.types import AdapterInfo

from .fakes import FakeEngine

NAMES = st.sampled_from(["alpha", "beta", "gamma"])
VERSIONS = st.sampled_from(["", "@1.0.0", "@2.0.0"])
ADAPTER = st.builds(lambda n, v: n + v, NAMES, VERSIONS)


def _metrics(held: set[str]) -> tuple[FakeEngine, ServiceMetrics]:
    engine = FakeEngine()
    for name in held:
        engine.adapters[name] = AdapterInfo(name, "ok", 8, True)
    queue = FairQueue(max_running=1, max_waiting_per_tenant=1, max_waiting_total=1)
    return engine, ServiceMetrics(engine, queue)


def _known_by_list(held: set[str], adapter: str) -> bool:
    """The rule stated over the whole list: the name, or a version of a held base name."""
    if adapter in held:
        return True
    base, sep, _ = adapter.partition("@")
    return bool(sep) and any(name.partition("@")[0] == base for name in held)


@given(st.sets(ADAPTER, max_size=4), st.lists(ADAPTER, min_size=1, max_size=8))
def test_labels_follow_the_held_adapters(held: set[str], asked: list[str]) -> None:
    _engine, metrics = _metrics(held)
    for adapter in asked:
        want = adapter if _known_by_list(held, adapter) else OTHER_ADAPTER_LABEL
        assert metrics.adapter_label(adapter) == want


def test_an_unknown_plain_name_is_looked_up_not_listed() -> None:
    engine, metrics = _metrics({"alpha"})
    for _ in range(100):
        assert metrics.adapter_label("nope") == OTHER_ADAPTER_LABEL
    assert metrics.adapter_label("alpha") == "alpha"
    assert metrics.adapter_label("alpha@2.0.0") == "alpha@2.0.0"  # its base is held
    assert engine.list_adapters_calls == 0
    assert engine.knows_adapter_calls >= 100
