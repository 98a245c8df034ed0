"""The columnar policy against its scalar predecessor (``reference_policy.py``) on random inputs.

Both keep the same order of floating-point operations, so the decisions must agree exactly:
weights, endpoint weights, estimates, utilisation, the publish flag and the reason (except the
order of equally moved shards in it, which the scalar version left to set iteration).
"""

from __future__ import annotations

import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane.policy import (
    BUDGET,
    Decision,
    Observation,
    ObservationColumns,
    PolicyConfig,
    PolicyState,
    apportion,
    decide,
    desired,
)

from .plant import Plant
from .reference_policy import apportion_ref, decide_ref, desired_ref
from .strategies import feasible_overrides, observations, plants

CFG = PolicyConfig()


def _reason_kinds(reason: str) -> str:
    # "rebalance: 640 parts moved (a 1->2, b ...)": the list's order among equal moves is free.
    return re.sub(r"\(.*?\)", "(...)", reason)


def _same(fast: Decision, ref: Decision) -> None:
    assert fast.weights == ref.weights
    assert {k: dict(v) for k, v in fast.endpoint_weights.items()} == {
        k: dict(v) for k, v in ref.endpoint_weights.items()
    }
    assert fast.change == ref.change
    assert fast.publish == ref.publish
    assert _reason_kinds(fast.reason) == _reason_kinds(ref.reason)
    assert fast.expired_overrides == ref.expired_overrides
    assert fast.utilization == ref.utilization
    assert dict(fast.state.estimates) == dict(ref.state.estimates)
    assert dict(fast.state.weights) == dict(ref.state.weights)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_same_decisions_as_the_scalar_policy(data: st.DataObject) -> None:
    obs = data.draw(observations())
    overrides = data.draw(feasible_overrides(obs, CFG.min_weight))
    fast_state = ref_state = PolicyState()
    for t in range(5):
        load = data.draw(observations(sorted(obs.shards)))
        shards = {
            sid: type(o)(sid, obs.shards[sid].active, o.workers, o.routed_adapters)
            for sid, o in load.shards.items()
        }
        step = Observation(shards, overrides)
        fast = decide(step, fast_state, float(t), CFG)
        ref = decide_ref(step, ref_state, float(t), CFG)
        _same(fast, ref)
        fast_state, ref_state = fast.state, ref.state
        # The immediate-publish path too.
        w_fast, e_fast = desired(step, fast_state, float(t), CFG)
        w_ref, e_ref = desired_ref(step, ref_state, float(t), CFG)
        assert w_fast == w_ref
        assert {k: dict(v) for k, v in e_fast.items()} == e_ref


@settings(max_examples=20, deadline=None, derandomize=True)
@given(plants(noise=0.1), st.integers(0, 2**32))
def test_same_trajectory_as_the_scalar_policy_in_closed_loop(plant: Plant, seed: int) -> None:
    # Two copies of the plant with the same noise: each policy drives its own.
    twin = Plant(plant.capacity, plant.steerable, plant.pinned, noise=plant.noise)
    plant.rng, twin.rng = random.Random(seed), random.Random(seed)
    fast_state = ref_state = PolicyState()
    for t in range(40):
        fast = decide(plant.observe(fast_state.weights), fast_state, 5.0 * t, CFG)
        ref = decide_ref(twin.observe(ref_state.weights), ref_state, 5.0 * t, CFG)
        _same(fast, ref)
        fast_state, ref_state = fast.state, ref.state


def test_columns_and_objects_give_the_same_decision() -> None:
    plant = Plant({"a": 300.0, "b": 500.0, "c": 200.0}, steerable=600.0)
    obs = plant.observe({})
    a = decide(obs, PolicyState(), 0.0, CFG)
    b = decide(ObservationColumns.from_observation(obs), PolicyState(), 0.0, CFG)
    assert a.weights == b.weights
    assert dict(a.endpoint_weights) == dict(b.endpoint_weights)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text("abcd", min_size=1, max_size=3), st.floats(0, 1e6), min_size=1, max_size=40
    ),
    st.integers(0, 400),
)
def test_apportion_matches_the_scalar_version(shares: dict[str, float], floor: int) -> None:
    assert apportion(shares, BUDGET, floor) == apportion_ref(shares, BUDGET, floor)
