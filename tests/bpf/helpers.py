"""Shared builders for the classifier tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from adaptermesh.proto import assignment_pb2 as pb

_versions = itertools.count(1)


def next_version() -> int:
    return next(_versions)


@dataclass
class S:
    """A shard spec for make_assignment: steer is ('mark', m) / ('tunnel', ip, vni, mac) /
    ('redirect', ifname, mac) / None."""

    id: str
    index: int
    weight: int
    steer: tuple[object, ...] | None = None
    draining: bool = False


def make_assignment(
    shards: list[S], pins: dict[str, str] | None = None, version: int | None = None
) -> pb.Assignment:
    a = pb.Assignment(version=next_version() if version is None else version)
    for s in shards:
        sh = a.shards.add(
            id=s.id,
            index=s.index,
            weight=s.weight,
            state=pb.SHARD_STATE_DRAINING if s.draining else pb.SHARD_STATE_ACTIVE,
        )
        if s.steer is None:
            continue
        kind = s.steer[0]
        if kind == "mark":
            sh.steer.mark.mark = int(s.steer[1])  # type: ignore[call-overload]
        elif kind == "tunnel":
            sh.steer.tunnel.remote_ipv4 = str(s.steer[1])
            sh.steer.tunnel.vni = int(s.steer[2])  # type: ignore[call-overload]
            sh.steer.tunnel.inner_dst_mac = str(s.steer[3])
        elif kind == "redirect":
            sh.steer.redirect.ifname = str(s.steer[1])
            sh.steer.redirect.dst_mac = str(s.steer[2])
    for cidr, shard_id in (pins or {}).items():
        a.pins.add(cidr=cidr, shard_id=shard_id)
    return a
