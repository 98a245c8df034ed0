"""Datapath liveness without root: the pure decision, and the whole agent in front of a fake
datapath whose interface, filter and pins a test takes away and gives back (the kernel
version of the same story is tests/agent/test_liveness_kernel.py)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from waiting import async_wait_until as wait_until

from adaptermesh.agent.liveness import decide, missing
from adaptermesh.bpf.loader import MAP_NAMES
from adaptermesh.bpf.table import Attachment

from .fakes import FakeAttachedDatapath, make_assignment
from .test_agent import Harness, running

attachments = st.builds(
    Attachment,
    interface=st.booleans(),
    filter=st.booleans(),
    unpinned=st.lists(st.sampled_from(MAP_NAMES), unique=True).map(tuple),
)


@given(attachments)
def test_the_decision_and_the_words_agree_with_what_is_missing(att: Attachment) -> None:
    words = missing(att, "eth9", "/sys/fs/bpf/am/")
    action = decide(att)
    assert (action == "none") == att.ok == (not words)
    assert action != "reattach" or att.interface  # nothing to attach to without it
    assert ("interface eth9" in words) == (not att.interface)
    assert ("tc filter on eth9 ingress" in words) == (att.interface and not att.filter)
    for name in att.unpinned:
        assert f"pinned map /sys/fs/bpf/am/{name}" in words


def _metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name}")


async def test_lost_interface_fails_healthz_holds_assignments_and_replays_on_return(tmp_path, cp):
    cp.servicer.publish(make_assignment(1))
    h = Harness(tmp_path, cp.target)
    h.dp = dp = FakeAttachedDatapath()
    h.config.liveness_interval_s = 0.05
    async with running(h):
        await wait_until(lambda: dp.applied == [1], what="v1 applied")
        assert (await h.get("/healthz"))[0] == 200

        dp.interface = dp.filter = False  # the filter goes with its interface
        await wait_until(
            lambda: h.agent.monitor is not None and not h.agent.monitor.attached,
            what="loss noticed",
        )
        status, body = await h.get("/healthz")
        assert status == 503
        health = json.loads(body)
        assert health["error"] == "datapath: interface lo missing"
        assert health["datapath"]["missing"] == ["interface lo"]

        # A pin that arrives now has no datapath to go to: held, never reported applied.
        cp.servicer.publish(make_assignment(2, pins={"10.9.0.0/24": "b"}))
        await wait_until(
            lambda: any("version 2 not applied" in r.apply_error for r in cp.servicer.reports),
            what="a report of the held version",
        )
        assert dp.applied == [1]
        assert all(r.applied_version <= 1 for r in cp.servicer.reports)
        status, body = await h.get("/status")
        assert json.loads(body)["apply_error"].startswith("version 2 not applied: datapath: ")

        dp.interface = True  # a new interface of the same name, without our filter
        await wait_until(lambda: h.agent.monitor.attached, what="re-attached")
        assert (await h.get("/healthz"))[0] == 200
        # The held pin reached the maps before the filter saw a packet.
        assert dp.calls[-2:] == ["apply 2", "reattach"]
        assert [p.cidr for p in dp.current.pins] == ["10.9.0.0/24"]
        await wait_until(
            lambda: (
                cp.servicer.reports[-1].applied_version == 2
                and cp.servicer.reports[-1].apply_error == ""
            ),
            what="v2 reported applied",
        )
        _, metrics = await h.get("/metrics")
        assert _metric(metrics, "adaptermesh_agent_datapath_detaches_total") == 1
        assert _metric(metrics, "adaptermesh_agent_datapath_reattaches_total") == 1
        assert _metric(metrics, "adaptermesh_agent_datapath_attached") == 1


async def test_a_removed_filter_or_pin_is_put_back_with_the_current_assignment(tmp_path, cp):
    cp.servicer.publish(make_assignment(1, pins={"10.9.0.0/24": "a"}))
    h = Harness(tmp_path, cp.target)
    h.dp = dp = FakeAttachedDatapath()
    h.config.liveness_interval_s = 0.05
    async with running(h):
        await wait_until(lambda: dp.applied == [1], what="v1 applied")
        dp.filter, dp.unpinned = False, ("am_pins",)
        await wait_until(lambda: h.agent.monitor.detaches == 1, what="loss noticed")
        await wait_until(lambda: h.agent.monitor.attached, what="re-attached")
        # The interface never left, so the agent repaired it in the same look: the current
        # Assignment written again, then the pin and the filter.
        assert dp.calls == ["apply 1", "apply 1", "reattach"]
        assert (await h.get("/healthz"))[0] == 200
        assert h.agent.monitor.reattaches == 1
