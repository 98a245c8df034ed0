"""The ``adaptermesh.v1.ControlPlane`` gRPC servicer (grpc.aio).

Every write is validated completely before anything is stored; a rejected call names the
offending field in its status message (``field: problem``) and leaves the state unchanged.
Writes that change routing publish a new Assignment at once, in the same transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from adaptermesh import adapter_edge
from adaptermesh import assignment_rules as rules
from adaptermesh.assignment_rules import RuleError
from adaptermesh.control_plane.audit import AuditLog, record_message
from adaptermesh.control_plane.auth import ANONYMOUS, current_principal
from adaptermesh.control_plane.policy import BUDGET
from adaptermesh.control_plane.rebalancer import PublishError, Rebalancer
from adaptermesh.control_plane.rollout_api import RolloutApi
from adaptermesh.control_plane.store import (
    AlreadyExistsError,
    RuleSetRecord,
    StoreWriteError,
    override_message,
)
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)
from adaptermesh.rules import RuleError as RoutingRuleError
from adaptermesh.rules import canonical_document, parse_rule_set

__all__ = [
    "NODE_TTL_S",
    "ApiError",
    "ApiLimits",
    "ControlPlaneServicer",
    "add_to_server",
    "normalise_cidr",
]

# grpc ships no type information; the context is grpc.aio.ServicerContext.
_Ctx: TypeAlias = Any
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SCOPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._/-]{0,127}$")
_DRAINING = assignment_pb2.SHARD_STATE_DRAINING
# A shard spec as written (the Assignment as a whole is bounded by the rules).
MAX_SHARD_BYTES = 1 << 20
# A ListHistory answer stops before this many bytes (page on with before_version), so a
# client with gRPC's default 4 MiB receive limit can always read it.
MAX_HISTORY_BYTES = 3 << 20
# A node row not reported for this long is dropped (agents report every few seconds).
NODE_TTL_S = 15 * 60.0


@dataclass(frozen=True, slots=True)
class ApiLimits:
    """Limits of the API's own objects; what an Assignment may hold is assignment_rules'."""

    max_ttl_s: int = 30 * 24 * 3600
    max_history: int = 1000
    max_routes: int = 256
    max_scopes: int = 64
    # Node rows (ReportLoad creates one per new node_id): at most max_nodes per token and
    # max_node_rows in all (RESOURCE_EXHAUSTED beyond either); a row not reported for
    # node_ttl_s is dropped, so a node that left frees its row.
    max_nodes: int = rules.MAX_NODES
    max_node_rows: int = rules.MAX_NODES
    node_ttl_s: float = NODE_TTL_S


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.code = code
        self.field = field
        self.message = message


def _invalid(field: str, message: str) -> NoReturn:
    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, field, message)


def _edge_changed(store: Any, inst: control_plane_pb2.AdapterInstance) -> bool:
    """Writing ``inst`` changes the Assignment's edges (so it publishes a new one). Without
    shards there is no Assignment to publish: the first shard's publishes the edges."""
    if not store.list_shards():
        return False
    old = [i for i in store.list_adapter_instances() if i.name == inst.name]
    try:
        edge = adapter_edge.edge_of(inst)
    except RuleError:
        return True  # not valid yet: the write's own checks refuse it, naming the field
    return edge != (adapter_edge.edge_of(old[0]) if old else None)


@contextmanager
def _within(prefix: str, strip: str) -> Iterator[None]:
    """Re-raise an object's field error under its place in a batch (``shard.id`` ->
    ``shards[2].id``)."""
    try:
        yield
    except (ApiError, RuleError) as exc:
        code = exc.code if isinstance(exc, ApiError) else grpc.StatusCode.INVALID_ARGUMENT
        field = exc.field
        if strip and (field == strip or field.startswith(strip + ".")):
            field = field[len(strip) :]
        elif field:
            field = "." + field
        raise ApiError(code, prefix + field, exc.message) from None


def normalise_cidr(text: str, field: str = "cidr") -> str:
    """The canonical spelling (assignment_rules.normalise_cidr) or INVALID_ARGUMENT."""
    try:
        return rules.normalise_cidr(text, field)
    except RuleError as exc:
        _invalid(exc.field, exc.message)


def validate_shard(shard: assignment_pb2.Shard) -> None:
    """A shard as an operator writes it: the shared rules, plus a size bound."""
    size = shard.ByteSize()
    if size > MAX_SHARD_BYTES:
        _invalid("shard", f"{size} bytes, at most {MAX_SHARD_BYTES}")
    try:
        rules.check_shard(shard, "shard")
    except RuleError as exc:
        _invalid(exc.field, exc.message)


class ControlPlaneServicer(RolloutApi, control_plane_pb2_grpc.ControlPlaneServicer):
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
        # (method, reason) of each refusal the servicer itself makes (a report for a node the
        # caller is not bound to); the server counts them with the interceptor's.
        self.count_denied: Callable[[str, str], None] = lambda method, reason: None

    # -- helpers ---------------------------------------------------------------------------

    async def _fail(self, context: _Ctx, exc: Exception) -> NoReturn:
        code, message = self._status_of(exc)
        # The backstop behind rules.quote: a status message travels in the response's
        # trailing metadata, and one over the client's metadata limit reaches it as
        # RESOURCE_EXHAUSTED instead of this error.
        await context.abort(code, rules.bounded_message(message))
        raise AssertionError("abort returned")  # abort always raises

    def _status_of(self, exc: Exception) -> tuple[grpc.StatusCode, str]:
        if isinstance(exc, ApiError):
            return exc.code, str(exc)
        if isinstance(exc, RuleError):
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if isinstance(exc, PublishError) and isinstance(exc.__cause__, RuleError):
            # The write is fine on its own but the Assignment it leads to is not (a listener
            # address two shards share, an index past the maps): refused, nothing stored.
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{exc.__cause__} (in the Assignment this write would publish)",
            )
        if isinstance(exc, StoreWriteError):
            # Out of space: RESOURCE_EXHAUSTED (the same write may succeed once space returns);
            # another I/O error: UNAVAILABLE. The message names the cause either way.
            self.log.warning("write refused: %s", exc)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.full else grpc.StatusCode.UNAVAILABLE
            return code, str(exc)
        if isinstance(exc, PublishError) and isinstance(exc.__cause__, StoreWriteError):
            return self._status_of(exc.__cause__)
        if isinstance(exc, PublishError):
            # The change would lead to an invalid Assignment; it was rolled back.
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        self.log.exception("internal error")
        return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"

    def _now(self) -> float:
        return self.rb.clock.time()

    def _require_shard(self, shard_id: str, field: str = "shard_id") -> assignment_pb2.Shard:
        if not shard_id:
            _invalid(field, "required")
        try:
            rules.check_shard_id(shard_id, field)  # a name no shard can have is not looked up
        except RuleError as exc:
            _invalid(exc.field, exc.message)
        shard = self.store.get_shard(shard_id)
        if shard is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, field, f"no shard {rules.quote(shard_id)}")
        return shard

    # -- shards ----------------------------------------------------------------------------

    def _shard_step(self, request_shard: assignment_pb2.Shard) -> assignment_pb2.Shard | None:
        """Check one shard write against the store as it is now; None: it changes nothing."""
        spec = assignment_pb2.Shard()
        spec.CopyFrom(request_shard)
        validate_shard(spec)
        existing = self.store.get_shard(spec.id)
        if existing is None and len(self.store.list_shards()) >= rules.MAX_SHARDS:
            _invalid("shard", f"at most {rules.MAX_SHARDS} shards (the size of am_shards)")
        if spec.state == _DRAINING:
            pins = self.store.pins_for_shard(spec.id)
            if pins:
                raise ApiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "shard.state",
                    f"shard {rules.quote(spec.id)} still has pins {pins[:5]}: unpin them before draining it",
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
                return None  # idempotent: no new Assignment for a no-op
        return spec

    def _store_shard(self, spec: assignment_pb2.Shard) -> assignment_pb2.Shard:
        if spec.state == _DRAINING:
            # A DRAINING shard's weight is 0: its override goes with the drain.
            self.store.clear_override(spec.id)
        return self.store.upsert_shard(spec, self._now())

    async def UpsertShard(
        self, request: control_plane_pb2.UpsertShardRequest, context: _Ctx
    ) -> assignment_pb2.Shard:
        try:
            spec = self._shard_step(request.shard)
            if spec is None:
                existing = self.store.get_shard(request.shard.id)
                assert existing is not None
                return existing
            verb = "updated" if self.store.get_shard(spec.id) else "created"
            stored: assignment_pb2.Shard = self.rb.mutate(
                lambda: self._store_shard(spec), f"shard {spec.id} {verb}"
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
                    f"shard {rules.quote(request.id)} still has pins {pins[:5]}: unpin them first",
                )
            for inst in self.store.list_adapter_instances():
                if any(r.shard_id == request.id for r in inst.routes) or request.id in (
                    *inst.placement.shards,
                    *inst.placement.pinned_shards,
                ):
                    raise ApiError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "id",
                        f"adapter instance {rules.quote(inst.name)} routes to shard {rules.quote(request.id)}",
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
                f"shard {rules.quote(request.shard_id)} is DRAINING; its weight is 0",
            )
        weight = request.weight
        if not math.isfinite(weight) or weight < 0 or weight > BUDGET:
            _invalid("weight", f"{weight} is not in 0..{BUDGET} (parts per 10,000)")
        if request.ttl_seconds > self.limits.max_ttl_s:
            _invalid(
                "ttl_seconds",
                f"{request.ttl_seconds} is above the maximum {self.limits.max_ttl_s}",
            )
        rules.check_reason(request.reason)
        active = [
            s.id for s in self.store.list_shards() if s.state != assignment_pb2.SHARD_STATE_DRAINING
        ]
        overrides = {sid: w for sid, w, *_ in self.store.list_overrides() if sid in active}
        overrides[request.shard_id] = weight
        free = len(active) - len(overrides)
        floor = self.rb.config.policy.weight_floor(len(active))
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
            return override_message(request.shard_id, request.weight, reason, now, expires)
        except Exception as exc:
            await self._fail(context, exc)

    async def ClearOverride(
        self, request: control_plane_pb2.ClearOverrideRequest, context: _Ctx
    ) -> control_plane_pb2.ClearOverrideResponse:
        try:
            if not request.shard_id:
                _invalid("shard_id", "required")
            rules.check_shard_id(request.shard_id, "shard_id")
            if not any(sid == request.shard_id for sid, *_ in self.store.list_overrides()):
                self._require_shard(request.shard_id)  # a typo says "no shard", not "no override"
                raise ApiError(
                    grpc.StatusCode.NOT_FOUND,
                    "shard_id",
                    f"no override on shard {rules.quote(request.shard_id)}",
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
        out.overrides.extend(self.store.live_overrides(now))
        return out

    # -- pins ------------------------------------------------------------------------------

    def _pin_step(self, request: control_plane_pb2.PinTenantRequest) -> str:
        """Check a pin against the store as it is now; returns the canonical CIDR."""
        cidr = normalise_cidr(request.cidr)
        target = self._require_shard(request.shard_id)
        if target.state == _DRAINING:
            raise ApiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "shard_id",
                f"shard {rules.quote(request.shard_id)} is DRAINING; pin to an ACTIVE shard",
            )
        if len(self.store.list_pins()) >= rules.MAX_PINS:
            _invalid("cidr", f"at most {rules.MAX_PINS} pins (the size of am_pins)")
        return cidr

    async def PinTenant(
        self, request: control_plane_pb2.PinTenantRequest, context: _Ctx
    ) -> assignment_pb2.Pin:
        try:
            cidr = self._pin_step(request)
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

    # -- routing rules ---------------------------------------------------------------------

    @staticmethod
    def _rule_set_message(record: RuleSetRecord) -> control_plane_pb2.RuleSetVersion:
        msg = control_plane_pb2.RuleSetVersion(
            version=record.version,
            document_json=json.dumps(record.document, sort_keys=True),
            reason=record.reason,
            rules=len(record.document.get("rules", [])),
        )
        msg.created_at.FromNanoseconds(int(record.created_at * 1e9))
        return msg

    async def ApplyRules(
        self, request: control_plane_pb2.ApplyRulesRequest, context: _Ctx
    ) -> control_plane_pb2.ApplyRulesResponse:
        try:
            rules.check_reason(request.reason)
            try:
                document = json.loads(request.document_json)
            except ValueError as exc:
                _invalid("document_json", f"not JSON: {exc}")
            try:
                # Stored and published in one transaction: the Assignment carries the set (and
                # its source-CIDR-only rules as pins) to every agent at once. A set that would
                # make the Assignment invalid (too large, too many pins) is not stored.
                live = self.store.rule_set()
                unchanged = live is not None and canonical_document(
                    parse_rule_set(document)
                ) == canonical_document(parse_rule_set(live.document))
                record = self.rb.mutate(
                    lambda: self.store.apply_rule_set(document, request.reason, self._now()),
                    f"routing rules: {request.reason}" if request.reason else "routing rules",
                    publish=bool(self.store.list_shards()) and not unchanged,
                )
            except RoutingRuleError as exc:
                # Names the rule and where CEL gives one the line:column; nothing stored.
                _invalid("document_json", str(exc))
            if not record.unchanged:
                self.log.info("routing rules v%d applied: %s", record.version, request.reason)
            return control_plane_pb2.ApplyRulesResponse(
                rule_set=self._rule_set_message(record), unchanged=record.unchanged
            )
        except Exception as exc:
            await self._fail(context, exc)

    async def GetRules(
        self, request: control_plane_pb2.GetRulesRequest, context: _Ctx
    ) -> control_plane_pb2.RuleSetVersion:
        try:
            record = self.store.rule_set(request.version or None)
            if record is None:
                what = f"version {request.version}" if request.version else "a rule set"
                raise ApiError(grpc.StatusCode.NOT_FOUND, "version", f"no {what} stored")
            return self._rule_set_message(record)
        except Exception as exc:
            await self._fail(context, exc)

    async def ListRules(
        self, request: control_plane_pb2.ListRulesRequest, context: _Ctx
    ) -> control_plane_pb2.ListRulesResponse:
        # A listing: each version's document is left out (GetRules reads one). A set may be a
        # few MB, and a page of them would pass any client's message limit.
        limit = min(request.limit or 100, 1000)
        out = control_plane_pb2.ListRulesResponse()
        for summary in self.store.rule_set_history(limit):
            msg = out.rule_sets.add(
                version=summary.version, reason=summary.reason, rules=summary.rules
            )
            msg.created_at.FromNanoseconds(int(summary.created_at * 1e9))
        return out

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
            _invalid("instance.name", f"{rules.quote(inst.name)} must match {_NAME_RE.pattern}")
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
            if route.path:
                continue  # a path route (adapter_edge checks it below)
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
                _invalid(
                    f"instance.security.scopes[{i}]",
                    f"{rules.quote(scope)} must match {_SCOPE_RE.pattern}",
                )
        if len(inst.security.allowed_cidrs) > rules.MAX_ALLOWED_CIDRS:
            _invalid("instance.security.allowed_cidrs", f"at most {rules.MAX_ALLOWED_CIDRS}")
        for i, cidr in enumerate(inst.security.allowed_cidrs):
            normalise_cidr(cidr, f"instance.security.allowed_cidrs[{i}]")
        rules.check_labels(inst.labels, "instance.labels")
        adapter_edge.check_instance(inst, {s.id for s in self.store.list_shards()})
        paths = {r.path for r in inst.routes if r.path}
        for other in self.store.list_adapter_instances():
            taken = paths & {r.path for r in other.routes if r.path}
            if other.name != inst.name and taken:
                _invalid(
                    "instance.routes",
                    f"path {rules.quote(sorted(taken)[0])} already reaches adapter instance {rules.quote(other.name)}",
                )

    def _instance_step(
        self, request_instance: control_plane_pb2.AdapterInstance
    ) -> control_plane_pb2.AdapterInstance | None:
        """The instance as it will be stored; None: the same one is stored already."""
        inst = control_plane_pb2.AdapterInstance()
        inst.CopyFrom(request_instance)
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
                    return None
        inst.updated_at.FromNanoseconds(int(self._now() * 1e9))
        return inst

    async def UpsertAdapterInstance(
        self, request: control_plane_pb2.UpsertAdapterInstanceRequest, context: _Ctx
    ) -> control_plane_pb2.AdapterInstance:
        try:
            inst = self._instance_step(request.instance)
            if inst is None:
                for existing in self.store.list_adapter_instances():
                    if existing.name == request.instance.name:
                        return existing
                raise AssertionError("instance vanished")
            # Its edge (paths, protocol, security, placement) is part of the Assignment.
            self.rb.mutate(
                lambda: self.store.upsert_adapter_instance(inst, self._now()),
                f"adapter instance {inst.name}",
                publish=_edge_changed(self.store, inst),
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
            if not _NAME_RE.match(request.name):
                _invalid("name", f"{rules.quote(request.name)} must match {_NAME_RE.pattern}")
            gone = [i for i in self.store.list_adapter_instances() if i.name == request.name]
            if not gone:
                raise ApiError(
                    grpc.StatusCode.NOT_FOUND,
                    "name",
                    f"no adapter instance {rules.quote(request.name)}",
                )
            self.rb.mutate(
                lambda: self.store.delete_adapter_instance(request.name),
                f"adapter instance {request.name} deleted",
                publish=adapter_edge.edge_of(gone[0]) is not None
                and bool(self.store.list_shards()),
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

    # -- many writes at once -----------------------------------------------------------

    async def Apply(
        self, request: control_plane_pb2.ApplyRequest, context: _Ctx
    ) -> control_plane_pb2.ApplyResponse:
        """Every object in one transaction and at most one Assignment: all or nothing.

        Objects are written in the order shards, adapter instances, pins, overrides, each
        checked against the state the earlier ones left, so a file may create a shard and pin
        to it. A field error names the object (``shards[2].endpoints[0].address``).
        """
        try:
            for name, items, limit in (
                ("shards", request.shards, rules.MAX_SHARDS),
                ("instances", request.instances, rules.MAX_SHARDS),
                ("pins", request.pins, rules.MAX_PINS),
                ("overrides", request.overrides, rules.MAX_SHARDS),
            ):
                if len(items) > limit:
                    _invalid(name, f"at most {limit} in one Apply, got {len(items)}")
            rules.check_reason(request.reason)
            routing = bool(request.shards or request.pins or request.overrides) or any(
                _edge_changed(self.store, i) for i in request.instances
            )
            changes: list[str] = []

            def change() -> None:
                for i, sh in enumerate(request.shards):
                    with _within(f"shards[{i}]", "shard"):
                        spec = self._shard_step(sh)
                        if spec is not None:
                            self._store_shard(spec)
                            changes.append(f"shard {spec.id}")
                for i, inst in enumerate(request.instances):
                    with _within(f"instances[{i}]", "instance"):
                        stored = self._instance_step(inst)
                        if stored is not None:
                            self.store.upsert_adapter_instance(stored, self._now())
                            changes.append(f"adapter instance {stored.name}")
                for i, pin in enumerate(request.pins):
                    with _within(f"pins[{i}]", ""):
                        cidr = normalise_cidr(pin.cidr)
                        owner = dict(self.store.list_pins()).get(cidr)
                        if owner == pin.shard_id:
                            continue
                        if owner is not None:
                            self.store.remove_pin(cidr)  # a move: the new pin replaces it
                        cidr = self._pin_step(
                            control_plane_pb2.PinTenantRequest(cidr=cidr, shard_id=pin.shard_id)
                        )
                        self.store.add_pin(cidr, pin.shard_id, self._now())
                        changes.append(f"pin {cidr} -> {pin.shard_id}")
                for i, o in enumerate(request.overrides):
                    with _within(f"overrides[{i}]", ""):
                        self._check_override(o)
                        now = self._now()
                        expires = now + o.ttl_seconds if o.ttl_seconds else None
                        self.store.set_override(
                            o.shard_id, o.weight, o.reason or "operator override", expires, now
                        )
                        changes.append(f"override {o.shard_id}={o.weight}")

            reason = request.reason or "applied"
            self.rb.mutate(change, reason, publish=routing)
            latest = self.rb.hub.latest
            version = latest.version if routing and latest is not None else 0
            return control_plane_pb2.ApplyResponse(version=version, changes=len(changes))
        except Exception as exc:
            await self._fail(context, exc)

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
            size = 0
            # Records leave out the pins (ListPins has them; each record's reason says what
            # changed), and the answer stops short of MAX_HISTORY_BYTES: the caller pages on
            # with before_version.
            for a in self.store.history(limit, request.before_version, pins=False):
                rec = control_plane_pb2.AssignmentRecord(version=a.version, reason=a.reason)
                rec.generated_at.CopyFrom(a.generated_at)
                rec.assignment.CopyFrom(a)
                size += rec.ByteSize() + 8
                if out.records and size > MAX_HISTORY_BYTES:
                    break
                out.records.append(rec)
            return out
        except Exception as exc:
            await self._fail(context, exc)

    async def ListAudit(
        self, request: control_plane_pb2.ListAuditRequest, context: _Ctx
    ) -> control_plane_pb2.ListAuditResponse:
        try:
            limit = request.limit or 50
            if limit > self.limits.max_history:
                _invalid("limit", f"at most {self.limits.max_history}")
            if request.before_seq > 2**63 - 1:
                _invalid("before_seq", "at most 2^63 - 1")
            out = control_plane_pb2.ListAuditResponse()
            size = 0
            for row in self.store.audit(limit, request.before_seq):
                record = record_message(row)
                size += record.ByteSize() + 8
                if out.records and size > MAX_HISTORY_BYTES:
                    break  # the caller pages on with before_seq
                out.records.append(record)
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
            if len(request.node_id) > rules.MAX_NODE_ID:
                _invalid("node_id", f"at most {rules.MAX_NODE_ID} characters")
            if not request.node_id.isprintable():
                _invalid("node_id", "must be printable characters")
            if len(request.apply_error) > rules.MAX_APPLY_ERROR:
                _invalid("apply_error", f"at most {rules.MAX_APPLY_ERROR} characters")
            if len(request.shards) > rules.MAX_SHARDS:
                _invalid("shards", f"at most {rules.MAX_SHARDS}")
            principal = current_principal()
            if not principal.may_report(request.node_id):
                self.count_denied("ReportLoad", "node_binding")
                bound = (
                    "any node"
                    if principal.nodes is None
                    else ", ".join(sorted(principal.nodes)[:5]) or "no node"
                )
                raise ApiError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "node_id",
                    f"{principal.name} reports for {bound}, not {rules.quote(request.node_id)}",
                )
            owner = _token_owner(context) if principal is ANONYMOUS else _owner(principal.name)
            now = self._now()
            self.store.expire_nodes(now - self.limits.node_ttl_s)
            if not self.store.has_node(request.node_id):
                # Each new node id is a row: a token may create at most max_nodes of them, and
                # the table holds at most max_node_rows (rows expire after node_ttl_s).
                if self.store.count_nodes(owner) >= self.limits.max_nodes:
                    raise ApiError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "node_id",
                        f"at most {self.limits.max_nodes} nodes per token; "
                        f"{rules.quote(request.node_id)} would be a new one",
                    )
                if self.store.count_nodes() >= self.limits.max_node_rows:
                    raise ApiError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "node_id",
                        f"at most {self.limits.max_node_rows} nodes; "
                        f"{rules.quote(request.node_id)} would be a new one (a node not "
                        f"reported for {self.limits.node_ttl_s:g} s is dropped)",
                    )
            for i, t in enumerate(request.shards):
                for name in ("packets_per_s", "bytes_per_s", "new_flows_per_s"):
                    v = getattr(t, name)
                    if not math.isfinite(v) or v < 0:
                        _invalid(f"shards[{i}].{name}", f"{v} is not a finite number >= 0")
            self.store.record_report(request, now, owner)
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


def _owner(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def _token_owner(context: _Ctx) -> str:
    """A digest of the caller's bearer token ('' without one): who created a node row."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            return hashlib.sha256(text.encode()).hexdigest()[:32]
    return ""


def _parsing_handler(method: Any, behaviour: Any) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)

    async def parse(raw: bytes, context: _Ctx) -> Any:
        try:
            return request_cls.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid {method.input_type.name} ({exc})",
            )

    if method.server_streaming:

        async def stream(raw: bytes, context: _Ctx) -> AsyncIterator[Any]:
            async for item in behaviour(await parse(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, response_serializer=response_cls.SerializeToString
        )

    async def unary(raw: bytes, context: _Ctx) -> Any:
        return await behaviour(await parse(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(
        unary, response_serializer=response_cls.SerializeToString
    )


def add_to_server(
    servicer: ControlPlaneServicer, server: Any, audit: AuditLog | None = None
) -> None:
    """Register the servicer like the generated ``add_ControlPlaneServicer_to_server``, but
    parse each request inside its handler: a request that is no valid message (broken wire
    bytes, a string that is not UTF-8) is INVALID_ARGUMENT, not grpc's INTERNAL. With
    ``audit``, every write leaves an audit row."""
    service = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"]
    handlers = {}
    for m in service.methods:
        behaviour = getattr(servicer, m.name)
        if audit is not None:
            behaviour = audit.wrap(m.name, behaviour, m.server_streaming)
        handlers[m.name] = _parsing_handler(m, behaviour)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
