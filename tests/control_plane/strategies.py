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
    chosen = (
        draw(st.lists(st.sampled_from(active), unique=True, max_size=len(active) - 1))
        if len(active) > 1
        else []
    )
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


# -- API messages: any value of the right type, biased towards the edges of the rules ------

from google.protobuf import message_factory  # noqa: E402
from google.protobuf.descriptor import Descriptor, FieldDescriptor  # noqa: E402
from google.protobuf.message import Message  # noqa: E402

_EDGE_TEXT = [
    "",
    "s0",
    "s1",
    "ghost",
    "10.0.0.1",
    "999.1.1.1",
    "fe80::1",
    "fe80::1%eth0",
    "10.0.0.0/8",
    "10.0.0.1/8",
    "fe80::1%eth0/128",
    "::/0",
    "0.0.0.0/0",
    " 10.1.0.0/16",
    "host.example",
    "10.0.0.1:80",
    "aa:bb:cc:dd:ee:ff",
    "zz:00:00:00:00:00",
    "eth0",
    "x" * 300,
    "[/]",
    "[bold]x[/bold]",
    "round_robin",
    "least_request",
    "adaptermesh.io/lb-policy",
    "\x00",
    "é",
]
_EDGE_INT = [
    0,
    1,
    2,
    255,
    256,
    1000,
    9999,
    10_000,
    10_001,
    65535,
    65536,
    (1 << 24) - 1,
    1 << 24,
    2**31,
    2**32 - 1,
]
_INT_RANGE = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def _scalar(f: FieldDescriptor) -> st.SearchStrategy[object]:
    if f.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(_EDGE_TEXT), st.text(max_size=20))
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(
            allow_nan=True,
            allow_infinity=True,
            width=64 if f.type == FieldDescriptor.TYPE_DOUBLE else 32,
        )
    if f.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [7])
    if f.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=8)
    lo, hi = _INT_RANGE[f.type]
    return st.one_of(st.sampled_from([v for v in _EDGE_INT if lo <= v <= hi]), st.integers(lo, hi))


@st.composite
def messages(draw: st.DrawFn, cls: type[Message], depth: int = 0) -> Message:
    """A well-typed ``cls`` with random fields (well typed: every value fits its field)."""
    msg = cls()
    desc: Descriptor = cls.DESCRIPTOR
    for f in desc.fields:
        if f.message_type is not None and f.message_type.full_name.startswith("google.protobuf"):
            continue
        if not draw(st.booleans()):
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            keys = draw(st.lists(_scalar(f.message_type.fields_by_name["key"]), max_size=3))
            vals = f.message_type.fields_by_name["value"]
            for k in keys:
                getattr(msg, f.name)[k] = draw(_scalar(vals))
            continue
        if f.message_type is not None:
            if depth > 3:
                continue
            sub_cls = message_factory.GetMessageClass(f.message_type)
            n = draw(st.integers(0, 3)) if f.is_repeated else 1
            subs = [draw(messages(sub_cls, depth + 1)) for _ in range(n)]
            if f.is_repeated:
                getattr(msg, f.name).extend(subs)
            else:
                getattr(msg, f.name).CopyFrom(subs[0])
            continue
        if f.is_repeated:
            getattr(msg, f.name).extend(draw(st.lists(_scalar(f), max_size=3)))
        else:
            setattr(msg, f.name, draw(_scalar(f)))
    return msg
