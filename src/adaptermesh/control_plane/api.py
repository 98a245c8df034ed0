"""The ``adaptermesh.v1.ControlPlane`` gRPC servicer (grpc.aio).

Every write is validated completely before anything is stored; a rejected call names the
offending field in its status message (``field: problem``) and leaves the state unchanged.
Writes that change routing publish a new Assignment at once, in the same transaction.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import grpc

from adaptermesh.control_plane.policy import BUDGET
from adaptermesh.control_plane.rebalancer import PublishError, Rebalancer
from adaptermesh.control_plane.store import AlreadyExistsError
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)

__all__ = ["ApiError", "ApiLimits", "ControlPlaneServicer", "normalise_cidr"]

# grpc ships no type information; the context is grpc.aio.ServicerContext.
_Ctx: TypeAlias = Any
_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_HOST_RE = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+$")
_SCOPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._/-]{0,127}$")
_STATES = (
    assignment_pb2.SHARD_STATE_UNSPECIFIED,
    assignment_pb2.SHARD_STATE_ACTIVE,
    assignment_pb2.SHARD_STATE_DRAINING,
)


@dataclass(frozen=True, slots=True)
class ApiLimits:
    max_shards: int = 1024
    max_endpoints: int = 1024
    max_pins: int = 100_000
    max_labels: int = 64
    max_reason: int = 512
    max_ttl_s: int = 30 * 24 * 3600
    max_history: int = 1000
    max_routes: int = 256
    max_scopes: int = 64


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.code = code
        self.field = field


def _invalid(field: str, message: str) -> NoReturn:
    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, field, message)


def normalise_cidr(text: str, field: str = "cidr") -> str:
    if not text:
        _invalid(field, "required")
    try:
        net = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        _invalid(field, f"{text!r} is not a valid CIDR ({exc})")
    return str(net)


def _check_address(value: str, field: str, *, hostname_ok: bool) -> None:
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if hostname_ok and _HOST_RE.match(value):
        return
    _invalid(field, f"{value!r} is not an IP address" + (" or host name" if hostname_ok else ""))


def _check_labels(labels: Any, field: str, limits: ApiLimits) -> None:
    if len(labels) > limits.max_labels:
        _invalid(field, f"at most {limits.max_labels} labels")
    for k, v in labels.items():
        if not k or len(k) > 63:
            _invalid(f"{field}[{k!r}]", "label keys are 1-63 characters")
        if len(v) > 256:
            _invalid(f"{field}[{k!r}]", "label values are at most 256 characters")


def _check_reason(reason: str, limits: ApiLimits) -> None:
    if len(reason) > limits.max_reason:
        _invalid("reason", f"at most {limits.max_reason} characters, got {len(reason)}")


def validate_shard(shard: assignment_pb2.Shard, limits: ApiLimits) -> None:
    if not shard.id:
        _invalid("shard.id", "required")
    if not _ID_RE.match(shard.id):
        _invalid("shard.id", f"{shard.id!r} must match {_ID_RE.pattern}")
    if shard.state not in _STATES:
        _invalid("shard.state", f"unknown state {shard.state}")
    if len(shard.endpoints) > limits.max_endpoints:
        _invalid("shard.endpoints", f"at most {limits.max_endpoints}, got {len(shard.endpoints)}")
    seen: set[tuple[str, int]] = set()
    for i, ep in enumerate(shard.endpoints):
        _check_address(ep.address, f"shard.endpoints[{i}].address", hostname_ok=True)
        if not 1 <= ep.port <= 65535:
            _invalid(f"shard.endpoints[{i}].port", f"{ep.port} is not in 1..65535")
        if (ep.address, ep.port) in seen:
            _invalid(f"shard.endpoints[{i}]", f"duplicate endpoint {ep.address}:{ep.port}")
        seen.add((ep.address, ep.port))
        if len(ep.adapters) > 4096:
            _invalid(f"shard.endpoints[{i}].adapters", "at most 4096")
    kind = shard.steer.WhichOneof("target")
    if kind == "tunnel":
        t = shard.steer.tunnel
        try:
            ipaddress.IPv4Address(t.remote_ipv4)
        except ValueError:
            _invalid("shard.steer.tunnel.remote_ipv4", f"{t.remote_ipv4!r} is not an IPv4 address")
        if t.vni >= 1 << 24:
            _invalid("shard.steer.tunnel.vni", f"{t.vni} does not fit in 24 bits")
    elif kind == "redirect":
        r = shard.steer.redirect
        if not r.ifname and not r.ifindex:
            _invalid("shard.steer.redirect", "ifname or ifindex is required")
        if len(r.ifname) > 15:
            _invalid("shard.steer.redirect.ifname", "interface names are at most 15 characters")
    if shard.service_address:
        _check_address(shard.service_address, "shard.service_address", hostname_ok=False)
    if shard.service_port > 65535:
        _invalid("shard.service_port", f"{shard.service_port} is not in 0..65535")
    _check_labels(shard.labels, "shard.labels", limits)


class ControlPlaneServicer(control_plane_pb2_grpc.ControlPlaneServicer):
    def __init__(
        self,
        rebalancer: Rebalancer,
        limits: ApiLimits | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.rb = rebalancer
        self.store = rebalancer.store
        self.limits = limits or ApiLimits()
        self.log = logger or logging.getLogger("adaptermesh.control_plane.api")

    # -- helpers ---------------------------------------------------------------------------

    async def _fail(self, context: _Ctx, exc: Exception) -> NoReturn:
        if isinstance(exc, ApiError):
            await context.abort(exc.code, str(exc))
        if isinstance(exc, PublishError):
            # The change would lead to an invalid Assignment; it was rolled back.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.log.exception("internal error")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        raise AssertionError("abort returned")  # abort always raises

    def _now(self) -> float:
        return self.rb.clock.time()

    def _require_shard(self, shard_id: str, field: str = "shard_id") -> assignment_pb2.Shard:
        if not shard_id:
            _invalid(field, "required")
        shard = self.store.get_shard(shard_id)
        if shard is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, field, f"no shard {shard_id!r}")
        return shard

    # -- shards ----------------------------------------------------------------------------

    async def UpsertShard(
        self, request: control_plane_pb2.UpsertShardRequest, context: _Ctx
    ) -> assignment_pb2.Shard:
        try:
            spec = assignment_pb2.Shard()
            spec.CopyFrom(request.shard)
            validate_shard(spec, self.limits)
            existing = self.store.get_shard(spec.id)
            if existing is None and len(self.store.list_shards()) >= self.limits.max_shards:
                raise ApiError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "shard", f"at most {self.limits.max_shards}"
                )
            if spec.state == assignment_pb2.SHARD_STATE_UNSPECIFIED:
                spec.state = assignment_pb2.SHARD_STATE_ACTIVE
            spec.weight = 0  # the policy owns weights
            for ep in spec.endpoints:
                ep.weight = 0
            if existing is not None:
                same = assignment_pb2.Shard()
                same.CopyFrom(spec)
                same.index = existing.index
                if same == existing:
                    return existing  # idempotent: no new Assignment for a no-op
            verb = "created" if existing is None else "updated"
            stored: assignment_pb2.Shard = self.rb.mutate(
                lambda: self.store.upsert_shard(spec, self._now()), f"shard {spec.id} {verb}"
            )
            return stored
        except Exception as exc:
            await self._fail(context, exc)

    async def DeleteShard(
        self, request: control_plane_pb2.DeleteShardRequest, context: _Ctx
    ) -> control_plane_pb2.DeleteShardResponse:
        try:
            self._require_shard(request.id, "id")
            pins = self.store.pins_for_shard(request.id)
            if pins:
                raise ApiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "id",
                    f"shard {request.id!r} still has pins {pins[:5]}: unpin them first",
                )
            for inst in self.store.list_adapter_instances():
                if any(r.shard_id == request.id for r in inst.routes):
                    raise ApiError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "id",
                        f"adapter instance {inst.name!r} routes to shard {request.id!r}",
                    )
            self.rb.mutate(
                lambda: self.store.delete_shard(request.id, self._now()),
                f"shard {request.id} deleted",
            )
            return control_plane_pb2.DeleteShardResponse()
        except Exception as exc:
            await self._fail(context, exc)

    async def ListShards(
        self, request: control_plane_pb2.ListShardsRequest, context: _Ctx
    ) -> control_plane_pb2.ListShardsResponse:
        try:
            shards = self.store.list_shards()
            latest = self.rb.hub.latest
            if latest is not None:
                weights = {s.id: s for s in latest.shards}
                for s in shards:
                    pub = weights.get(s.id)
                    if pub is not None:
                        s.weight = pub.weight
                        by_ep = {(e.address, e.port): e for e in pub.endpoints}
                        for ep in s.endpoints:
                            p = by_ep.get((ep.address, ep.port))
                            if p is not None:
                                ep.weight = p.weight
                                del ep.adapters[:]
                                ep.adapters.extend(p.adapters)
            return control_plane_pb2.ListShardsResponse(shards=shards)
        except Exception as exc:
            await self._fail(context, exc)

    # -- overrides -------------------------------------------------------------------------

    def _check_override(self, request: control_plane_pb2.SetOverrideRequest) -> None:
        shard = self._require_shard(request.shard_id)
        if shard.state == assignment_pb2.SHARD_STATE_DRAINING:
            raise ApiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "shard_id",
                f"shard {request.shard_id!r} is DRAINING; its weight is 0",
            )
        weight = request.weight
        if not math.isfinite(weight) or weight < 0 or weight > BUDGET:
            _invalid("weight", f"{weight} is not in 0..{BUDGET} (parts per 10,000)")
        if request.ttl_seconds > self.limits.max_ttl_s:
            _invalid(
                "ttl_seconds",
                f"{request.ttl_seconds} is above the maximum {self.limits.max_ttl_s}",
            )
        _check_reason(request.reason, self.limits)
        active = [
            s.id
            for s in self.store.list_shards()
            if s.state != assignment_pb2.SHARD_STATE_DRAINING
        ]
        overrides = {
            sid: w for sid, w, *_ in self.store.list_overrides() if sid in active
        }
        overrides[request.shard_id] = weight
        free = len(active) - len(overrides)
        floor = min(self.rb.config.policy.min_weight, BUDGET // max(1, len(active)))
        room = BUDGET - floor * free
        if free > 0 and sum(overrides.values()) > room:
            _invalid(
                "weight",
                f"overrides would total {sum(overrides.values())}, leaving less than the "
                f"minimum {floor} for each of the {free} other active shards (at most {room})",
            )
        if free == 0 and sum(overrides.values()) != BUDGET:
            _invalid(
                "weight",
                f"every active shard is overridden, so the overrides must total {BUDGET}, "
                f"not {sum(overrides.values())}",
            )

    async def SetOverride(
        self, request: control_plane_pb2.SetOverrideRequest, context: _Ctx
    ) -> assignment_pb2.Override:
        try:
            self._check_override(request)
            now = self._now()
            expires = now + request.ttl_seconds if request.ttl_seconds else None
            reason = request.reason or "operator override"
            ttl = f", ttl {request.ttl_seconds}s" if request.ttl_seconds else ""
            self.rb.mutate(
                lambda: self.store.set_override(
                    request.shard_id, request.weight, reason, expires, now
                ),
                f"override {request.shard_id}={request.weight}{ttl}: {reason}",
            )
            out = assignment_pb2.Override(
                shard_id=request.shard_id, weight=request.weight, reason=reason
            )
            out.created_at.FromNanoseconds(int(now * 1e9))
            if expires is not None:
                out.expires_at.FromNanoseconds(int(expires * 1e9))
            return out
        except Exception as exc:
            await self._fail(context, exc)

    async def ClearOverride(
        self, request: control_plane_pb2.ClearOverrideRequest, context: _Ctx
    ) -> control_plane_pb2.ClearOverrideResponse:
        try:
            if not request.shard_id:
                _invalid("shard_id", "required")
            if not any(sid == request.shard_id for sid, *_ in self.store.list_overrides()):
                raise ApiError(
                    grpc.StatusCode.NOT_FOUND,
                    "shard_id",
                    f"no override on shard {request.shard_id!r}",
                )
            self.rb.mutate(
                lambda: self.store.clear_override(request.shard_id),
                f"override on {request.shard_id} cleared",
            )
            return control_plane_pb2.ClearOverrideResponse()
        except Exception as exc:
            await self._fail(context, exc)

    async def ListOverrides(
        self, request: control_plane_pb2.ListOverridesRequest, context: _Ctx
    ) -> control_plane_pb2.ListOverridesResponse:
        out = control_plane_pb2.ListOverridesResponse()
        now = self._now()
        for sid, weight, reason, expires_at, created_at in self.store.list_overrides():
            if expires_at is not None and expires_at <= now:
                continue  # expired; the next tick removes it
            o = out.overrides.add(shard_id=sid, weight=weight, reason=reason)
            o.created_at.FromNanoseconds(int(created_at * 1e9))
            if expires_at is not None:
                o.expires_at.FromNanoseconds(int(expires_at * 1e9))
        return out

    # -- pins ------------------------------------------------------------------------------

    async def PinTenant(
        self, request: control_plane_pb2.PinTenantRequest, context: _Ctx
    ) -> assignment_pb2.Pin:
        try:
            cidr = normalise_cidr(request.cidr)
            self._require_shard(request.shard_id)
            if len(self.store.list_pins()) >= self.limits.max_pins:
                raise ApiError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "cidr", f"at most {self.limits.max_pins} pins"
                )
            try:
                self.rb.mutate(
                    lambda: self.store.add_pin(cidr, request.shard_id, self._now()),
                    f"pin {cidr} -> {request.shard_id}",
                )
            except AlreadyExistsError:
                owner = dict(self.store.list_pins()).get(cidr, "?")
                raise ApiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "cidr",
                    f"{cidr} is already pinned (to {owner}); unpin it first",
                ) from None
            return assignment_pb2.Pin(cidr=cidr, shard_id=request.shard_id)
        except Exception as exc:
            await self._fail(context, exc)

    async def UnpinTenant(
        self, request: control_plane_pb2.UnpinTenantRequest, context: _Ctx
    ) -> control_plane_pb2.UnpinTenantResponse:
        try:
            cidr = normalise_cidr(request.cidr)
            if cidr not in dict(self.store.list_pins()):
                raise ApiError(grpc.StatusCode.NOT_FOUND, "cidr", f"{cidr} is not pinned")
            self.rb.mutate(lambda: self.store.remove_pin(cidr), f"unpin {cidr}")
            return control_plane_pb2.UnpinTenantResponse()
        except Exception as exc:
            await self._fail(context, exc)

    async def ListPins(
        self, request: control_plane_pb2.ListPinsRequest, context: _Ctx
    ) -> control_plane_pb2.ListPinsResponse:
        return control_plane_pb2.ListPinsResponse(
            pins=[assignment_pb2.Pin(cidr=c, shard_id=s) for c, s in self.store.list_pins()]
        )

    # -- adapter instances -----------------------------------------------------------------

    def _check_instance(self, inst: control_plane_pb2.AdapterInstance) -> None:
        if not inst.name:
            _invalid("instance.name", "required")
        if not _NAME_RE.match(inst.name):
            _invalid("instance.name", f"{inst.name!r} must match {_NAME_RE.pattern}")
        if not inst.model_ref.base_model:
            _invalid("instance.model_ref.base_model", "required")
        for field, value in (
            ("base_model", inst.model_ref.base_model),
            ("adapter_path", inst.model_ref.adapter_path),
            ("revision", inst.model_ref.revision),
        ):
            if len(value) > 1024:
                _invalid(f"instance.model_ref.{field}", "at most 1024 characters")
        if len(inst.routes) > self.limits.max_routes:
            _invalid("instance.routes", f"at most {self.limits.max_routes}")
        seen: set[str] = set()
        for i, route in enumerate(inst.routes):
            self._require_shard(route.shard_id, f"instance.routes[{i}].shard_id")
            if route.shard_id in seen:
                _invalid(f"instance.routes[{i}].shard_id", f"duplicate route to {route.shard_id}")
            seen.add(route.shard_id)
            if route.weight > BUDGET:
                _invalid(f"instance.routes[{i}].weight", f"{route.weight} is above {BUDGET}")
        if len(inst.security.scopes) > self.limits.max_scopes:
            _invalid("instance.security.scopes", f"at most {self.limits.max_scopes}")
        for i, scope in enumerate(inst.security.scopes):
            if not _SCOPE_RE.match(scope):
                _invalid(f"instance.security.scopes[{i}]", f"{scope!r} must match {_SCOPE_RE.pattern}")
        for i, cidr in enumerate(inst.security.allowed_cidrs):
            normalise_cidr(cidr, f"instance.security.allowed_cidrs[{i}]")
        _check_labels(inst.labels, "instance.labels", self.limits)

    async def UpsertAdapterInstance(
        self, request: control_plane_pb2.UpsertAdapterInstanceRequest, context: _Ctx
    ) -> control_plane_pb2.AdapterInstance:
        try:
            inst = control_plane_pb2.AdapterInstance()
            inst.CopyFrom(request.instance)
            self._check_instance(inst)
            cidrs = [normalise_cidr(c) for c in inst.security.allowed_cidrs]
            del inst.security.allowed_cidrs[:]
            inst.security.allowed_cidrs.extend(cidrs)
            inst.ClearField("updated_at")
            for existing in self.store.list_adapter_instances():
                if existing.name == inst.name:
                    same = control_plane_pb2.AdapterInstance()
                    same.CopyFrom(existing)
                    same.ClearField("updated_at")
                    if same == inst:
                        return existing
            now = self._now()
            inst.updated_at.FromNanoseconds(int(now * 1e9))
            # Not part of the Assignment: stored, listed, and used by the policy's affinity.
            self.rb.mutate(
                lambda: self.store.upsert_adapter_instance(inst, now), "", publish=False
            )
            return inst
        except Exception as exc:
            await self._fail(context, exc)

    async def DeleteAdapterInstance(
        self, request: control_plane_pb2.DeleteAdapterInstanceRequest, context: _Ctx
    ) -> control_plane_pb2.DeleteAdapterInstanceResponse:
        try:
            if not request.name:
                _invalid("name", "required")
            if not self.store.delete_adapter_instance(request.name):
                raise ApiError(
                    grpc.StatusCode.NOT_FOUND, "name", f"no adapter instance {request.name!r}"
                )
            return control_plane_pb2.DeleteAdapterInstanceResponse()
        except Exception as exc:
            await self._fail(context, exc)

    async def ListAdapterInstances(
        self, request: control_plane_pb2.ListAdapterInstancesRequest, context: _Ctx
    ) -> control_plane_pb2.ListAdapterInstancesResponse:
        return control_plane_pb2.ListAdapterInstancesResponse(
            instances=self.store.list_adapter_instances()
        )

    # -- assignments -----------------------------------------------------------------------

    async def GetAssignment(
        self, request: control_plane_pb2.GetAssignmentRequest, context: _Ctx
    ) -> assignment_pb2.Assignment:
        latest = self.rb.hub.latest
        if latest is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, "no Assignment has been published yet (add a shard)"
            )
            raise AssertionError("abort returned")
        return latest

    async def WatchAssignments(
        self, request: control_plane_pb2.WatchAssignmentsRequest, context: _Ctx
    ) -> AsyncIterator[assignment_pb2.Assignment]:
        hub = self.rb.hub
        sent = request.from_version
        latest = hub.latest
        if latest is not None and sent > latest.version:
            # The watcher claims a version this server never issued: resynchronise it with the
            # newest one rather than leave it waiting.
            sent = latest.version - 1
        hub.watchers += 1
        try:
            while True:
                assignment = await hub.newer_than(sent)
                yield assignment
                sent = assignment.version
        finally:
            hub.watchers -= 1

    async def ListHistory(
        self, request: control_plane_pb2.ListHistoryRequest, context: _Ctx
    ) -> control_plane_pb2.ListHistoryResponse:
        try:
            limit = request.limit or 50
            if limit > self.limits.max_history:
                _invalid("limit", f"at most {self.limits.max_history}")
            out = control_plane_pb2.ListHistoryResponse()
            for a in self.store.history(limit, request.before_version):
                rec = out.records.add(version=a.version, reason=a.reason)
                rec.generated_at.CopyFrom(a.generated_at)
                rec.assignment.CopyFrom(a)
            return out
        except Exception as exc:
            await self._fail(context, exc)

    # -- node agents -----------------------------------------------------------------------

    async def ReportLoad(
        self, request: control_plane_pb2.LoadReport, context: _Ctx
    ) -> control_plane_pb2.ReportLoadResponse:
        try:
            if not request.node_id:
                _invalid("node_id", "required")
            if len(request.node_id) > 253:
                _invalid("node_id", "at most 253 characters")
            if len(request.apply_error) > 4096:
                _invalid("apply_error", "at most 4096 characters")
            if len(request.shards) > 4 * self.limits.max_shards:
                _invalid("shards", f"at most {4 * self.limits.max_shards}")
            for i, t in enumerate(request.shards):
                for name in ("packets_per_s", "bytes_per_s", "new_flows_per_s"):
                    v = getattr(t, name)
                    if not math.isfinite(v) or v < 0:
                        _invalid(f"shards[{i}].{name}", f"{v} is not a finite number >= 0")
            self.store.record_report(request, self._now())
            return control_plane_pb2.ReportLoadResponse()
        except Exception as exc:
            await self._fail(context, exc)

    async def GetStatus(
        self, request: control_plane_pb2.GetStatusRequest, context: _Ctx
    ) -> control_plane_pb2.StatusResponse:
        out = control_plane_pb2.StatusResponse()
        if self.rb.hub.latest is not None:
            out.assignment.CopyFrom(self.rb.hub.latest)
        for node_id, applied, last, error in self.store.list_nodes():
            n = out.nodes.add(node_id=node_id, applied_version=applied, apply_error=error)
            n.last_report.FromNanoseconds(int(last * 1e9))
        out.loads.extend(self.rb.status_loads())
        return out
