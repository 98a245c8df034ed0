"""Hypothesis strategies for the policy's inputs."""

from __future__ import annotations

from hypothesis import strategies as st

from adaptermesh.control_plane.policy import (
    Observation,
    OverrideSpec,
    ShardObservation,
    WorkerObservation,
)

from .plant import Plant

shard_ids = st.lists(
    st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=12, unique=True
)


@st.composite
def workers(draw: st.DrawFn, sid: str) -> tuple[WorkerObservation, ...]:
    n = draw(st.integers(0, 3))
    out = []
    for k in range(n):
        known = draw(st.booleans()) or draw(st.booleans())
        out.append(
            WorkerObservation(
                address=f"10.9.{abs(hash(sid)) % 250}.{k + 1}",
                port=8000,
                known=known,
                waiting=draw(st.floats(0, 50)),
                running=draw(st.floats(0, 64)),
                kv_cache_usage=draw(st.floats(0, 1)),
                latency_s=draw(st.none() | st.floats(0.001, 20)),
                tokens_per_s=draw(st.floats(0, 1e5)),
                gpu_free_bytes=draw(st.none() | st.floats(0, 8e10)),
                resident_adapters=frozenset(draw(st.lists(st.sampled_from("xyz"), max_size=3))),
                requested_adapters=frozenset(draw(st.lists(st.sampled_from("xyzw"), max_size=3))),
            )
        )
    return tuple(out)


@st.composite
def observations(draw: st.DrawFn, ids: list[str] | None = None) -> Observation:
    ids = ids if ids is not None else draw(shard_ids)
    shards = {}
    for sid in ids:
        active = draw(st.integers(0, 5)) > 0
        shards[sid] = ShardObservation(sid, active, draw(workers(sid)))
    return Observation(shards, {})


@st.composite
def feasible_overrides(
    draw: st.DrawFn, obs: Observation, min_weight: int, budget: int = 10_000
) -> dict[str, OverrideSpec]:
    active = sorted(s for s, o in obs.shards.items() if o.active)
    chosen = draw(st.lists(st.sampled_from(active), unique=True, max_size=len(active) - 1)) if len(active) > 1 else []
    free = len(active) - len(chosen)
    room = budget - min(min_weight, budget // max(1, len(active))) * free
    out: dict[str, OverrideSpec] = {}
    left = room
    for sid in chosen:
        w = draw(st.integers(0, max(0, left)))
        left -= w
        out[sid] = OverrideSpec(sid, w, None)
    return out


@st.composite
def plants(draw: st.DrawFn, noise: float = 0.0) -> Plant:
    n = draw(st.integers(2, 8))
    ids = [f"s{i}" for i in range(n)]
    capacity = {sid: draw(st.floats(50, 1000)) for sid in ids}
    util = draw(st.floats(0.2, 0.85))
    total = util * sum(capacity.values())
    pinned_frac = draw(st.floats(0, 0.3))
    pinned = {}
    for sid in ids:
        if draw(st.booleans()):
            pinned[sid] = min(capacity[sid] * 0.5, pinned_frac * total / n)
    steerable = total - sum(pinned.values())
    return Plant(capacity, steerable, pinned, noise=noise)
