"""adapterctl: the operator CLI for the adaptermesh control plane.

Connection options also come from the environment: ``ADAPTERMESH_SERVER``,
``ADAPTERMESH_TOKEN``, ``ADAPTERMESH_TOKEN_FILE``.

Exit codes: 0 success, 1 server-side failure, 2 bad input (usage, invalid values, rejected
arguments), 3 not found, 4 already exists or failed precondition, 5 not authenticated or not
permitted, 6 server unreachable or timed out.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import grpc
import typer
import yaml
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from adaptermesh.assignment_rules import WEIGHT_BUDGET
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)

__all__ = ["app", "node_state", "parse_weight"]

T = TypeVar("T")
KINDS = ("Shard", "AdapterInstance", "Pin", "Override")

app = typer.Typer(help=__doc__.split("\n")[0], no_args_is_help=True, add_completion=False)
shard_app = typer.Typer(help="Create, change or delete shards.", no_args_is_help=True)
override_app = typer.Typer(help="Operator weight overrides.", no_args_is_help=True)
app.add_typer(shard_app, name="shard")
app.add_typer(override_app, name="override")
rules_app = typer.Typer(help="Routing rules (CEL): apply, list, show.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")

out = Console()
err = Console(stderr=True)

_EXIT = {
    grpc.StatusCode.INVALID_ARGUMENT: 2,
    grpc.StatusCode.OUT_OF_RANGE: 2,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 2,
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.ALREADY_EXISTS: 4,
    grpc.StatusCode.FAILED_PRECONDITION: 4,
    grpc.StatusCode.UNAUTHENTICATED: 5,
    grpc.StatusCode.PERMISSION_DENIED: 5,
    grpc.StatusCode.UNAVAILABLE: 6,
    grpc.StatusCode.DEADLINE_EXCEEDED: 6,
}


def _die(message: str, code: int) -> NoReturn:
    # One line: server messages quote user text, which must show as written.
    line = " ".join(message.split())
    err.print(f"[red]error:[/red] {escape(line)}", highlight=False)
    raise typer.Exit(code)


@dataclass
class Ctx:
    server: str
    token: str | None
    ca: Path | None
    cert: Path | None
    key: Path | None
    timeout: float
    _stub: control_plane_pb2_grpc.ControlPlaneStub | None = None
    _channel: grpc.Channel | None = None

    @property
    def stub(self) -> control_plane_pb2_grpc.ControlPlaneStub:
        if self._stub is None:
            if self.ca:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=self.ca.read_bytes(),
                    private_key=self.key.read_bytes() if self.key else None,
                    certificate_chain=self.cert.read_bytes() if self.cert else None,
                )
                self._channel = grpc.secure_channel(self.server, creds)
            else:
                self._channel = grpc.insecure_channel(self.server)
            self._stub = control_plane_pb2_grpc.ControlPlaneStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        try:
            return getattr(self.stub, method)(
                request, metadata=self.metadata, timeout=timeout or self.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            _die(f"{method}: {code.name}: {exc.details()}", _EXIT.get(code, 1))


def _ctx(ctx: typer.Context) -> Ctx:
    obj = ctx.find_root().obj
    assert isinstance(obj, Ctx)
    return obj


@app.callback()
def main(
    ctx: typer.Context,
    server: Annotated[
        str, typer.Option(envvar="ADAPTERMESH_SERVER", help="control plane HOST:PORT")
    ] = "127.0.0.1:7400",
    token: Annotated[
        str | None, typer.Option(envvar="ADAPTERMESH_TOKEN", help="bearer token")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(envvar="ADAPTERMESH_TOKEN_FILE", help="file holding the bearer token"),
    ] = None,
    tls_ca: Annotated[
        Path | None, typer.Option(help="CA to verify the server (enables TLS)")
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="client certificate for mTLS")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="client key for mTLS")] = None,
    timeout: Annotated[float, typer.Option(help="per-call timeout in seconds")] = 10.0,
) -> None:
    if token and token_file:
        _die("--token and --token-file are exclusive", 2)
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            _die(f"--token-file: {exc}", 2)
    if (tls_cert or tls_key) and not tls_ca:
        _die("--tls-cert/--tls-key need --tls-ca", 2)
    ctx.obj = Ctx(server, token, tls_ca, tls_cert, tls_key, timeout)


# -- input parsing -----------------------------------------------------------------------


def parse_weight(text: str | float | int, field: str = "weight") -> int:
    """Parts per 10,000 from ``2500``, ``2500.0`` or ``25%``; rejects negative, NaN, inf."""
    raw = str(text).strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{field}: {text!r} is not finite")
    if value < 0:
        raise ValueError(f"{field}: {text!r} is negative")
    parts = value * 100 if percent else value
    if parts != round(parts):
        raise ValueError(f"{field}: {text!r} is not a whole number of parts per 10,000")
    if parts > WEIGHT_BUDGET:
        raise ValueError(f"{field}: {text!r} is above {WEIGHT_BUDGET} parts (100%)")
    return round(parts)


def _hostport(text: str, field: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{field}: {text!r} is not ADDRESS:PORT")
    return host.strip("[]"), int(port)


def _ts(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return datetime.fromtimestamp(ts.seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _state(value: int) -> str:
    return assignment_pb2.ShardState.Name(value).removeprefix("SHARD_STATE_")


# -- documents (apply / get) -------------------------------------------------------------


def _shard_doc(s: assignment_pb2.Shard) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "endpoints": [
            {"address": e.address, "port": e.port} | ({"draining": True} if e.draining else {})
            for e in s.endpoints
        ],
        "state": _state(s.state) if s.state else "ACTIVE",
    }
    steer = MessageToDict(s.steer)
    if steer:
        spec["steer"] = steer
    if s.service_address or s.service_port:
        spec["service"] = {"address": s.service_address, "port": s.service_port}
    meta: dict[str, Any] = {"name": s.id}
    if s.labels:
        meta["labels"] = dict(s.labels)
    return {"kind": "Shard", "metadata": meta, "spec": spec}


def _instance_doc(i: control_plane_pb2.AdapterInstance) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": i.name}
    if i.labels:
        meta["labels"] = dict(i.labels)
    spec: dict[str, Any] = {"modelRef": MessageToDict(i.model_ref)}
    if i.protocol:
        spec["protocol"] = i.protocol
    spec["routes"] = [
        {"path": r.path}
        if r.path
        else {"shard": r.shard_id} | ({"weight": r.weight} if r.weight else {})
        for r in i.routes
    ]
    sec = MessageToDict(i.security)
    if sec:
        spec["security"] = {
            "scopes": sec.get("scopes", []),
            "allowedCIDRs": sec.get("allowedCidrs", []),
        }
        if i.security.tls:
            spec["security"]["tls"] = True
    place = MessageToDict(i.placement)
    if place:
        spec["placement"] = place
    return {"kind": "AdapterInstance", "metadata": meta, "spec": spec}


def _pin_doc(p: assignment_pb2.Pin) -> dict[str, Any]:
    return {"kind": "Pin", "spec": {"cidr": p.cidr, "shard": p.shard_id}}


def _override_doc(o: assignment_pb2.Override) -> dict[str, Any]:
    spec: dict[str, Any] = {"shard": o.shard_id, "weight": o.weight, "reason": o.reason}
    if o.expires_at.seconds:
        spec["expiresAt"] = _ts(o.expires_at)
    return {"kind": "Override", "spec": spec}


def _need(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping or mapping[key] is None:
        raise ValueError(f"{where}.{key}: required")
    return mapping[key]


def _map(value: Any, where: str, allowed: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A YAML mapping (None: empty) with only the ``allowed`` keys."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    if allowed is not None:
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]}: unknown field (expected one of {', '.join(allowed)})"
            )
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _str(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
    return str(value)


def _int(value: Any, where: str, hi: int = 2**32 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected a whole number, got {value!r}")
    if not 0 <= value <= hi:
        raise ValueError(f"{where}: {value} is not in 0..{hi}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value


def _labels(meta: dict[str, Any], where: str) -> dict[str, str]:
    labels = _map(meta.get("labels"), f"{where}.labels")
    return {_str(k, f"{where}.labels"): _str(v, f"{where}.labels.{k}") for k, v in labels.items()}


_TOP = ("kind", "apiVersion", "metadata", "spec")


def _shard_from_doc(doc: dict[str, Any], where: str) -> assignment_pb2.Shard:
    _map(doc, where, _TOP)
    meta = _map(doc.get("metadata"), f"{where}.metadata", ("name", "labels"))
    spec = _map(doc.get("spec"), f"{where}.spec", ("endpoints", "state", "steer", "service"))
    s = assignment_pb2.Shard(
        id=_str(_need(meta, "name", f"{where}.metadata"), f"{where}.metadata.name")
    )
    s.labels.update(_labels(meta, f"{where}.metadata"))
    for i, ep in enumerate(_list(spec.get("endpoints"), f"{where}.spec.endpoints")):
        ew = f"{where}.spec.endpoints[{i}]"
        if isinstance(ep, str):
            addr, port = _hostport(ep, ew)
            s.endpoints.add(address=addr, port=port)
        else:
            ep = _map(ep, ew, ("address", "port", "draining"))
            s.endpoints.add(
                address=_str(_need(ep, "address", ew), f"{ew}.address"),
                port=_int(_need(ep, "port", ew), f"{ew}.port", 65535),
                draining=_bool(ep.get("draining", False), f"{ew}.draining"),
            )
    state = _str(spec.get("state", "ACTIVE"), f"{where}.spec.state").upper()
    if state not in ("ACTIVE", "DRAINING"):
        raise ValueError(f"{where}.spec.state: {state!r} is not ACTIVE or DRAINING")
    s.state = (
        assignment_pb2.SHARD_STATE_DRAINING
        if state == "DRAINING"
        else assignment_pb2.SHARD_STATE_ACTIVE
    )
    sw = f"{where}.spec.steer"
    steer = _map(spec.get("steer"), sw, ("tunnel", "redirect", "mark"))
    if len(steer) > 1:
        raise ValueError(f"{sw}: one of tunnel, redirect or mark, not {', '.join(steer)}")
    if "tunnel" in steer:
        t = _map(
            steer["tunnel"], f"{sw}.tunnel", ("remoteIpv4", "remoteIPv4", "vni", "innerDstMac")
        )
        s.steer.tunnel.remote_ipv4 = _str(
            t.get("remoteIpv4", t.get("remoteIPv4", "")), f"{sw}.tunnel.remoteIpv4"
        )
        s.steer.tunnel.vni = _int(t.get("vni", 0), f"{sw}.tunnel.vni")
        s.steer.tunnel.inner_dst_mac = _str(t.get("innerDstMac", ""), f"{sw}.tunnel.innerDstMac")
    elif "redirect" in steer:
        r = _map(steer["redirect"], f"{sw}.redirect", ("ifname", "ifindex", "dstMac", "ingress"))
        s.steer.redirect.ifname = _str(r.get("ifname", ""), f"{sw}.redirect.ifname")
        s.steer.redirect.ifindex = _int(r.get("ifindex", 0), f"{sw}.redirect.ifindex")
        s.steer.redirect.dst_mac = _str(r.get("dstMac", ""), f"{sw}.redirect.dstMac")
        s.steer.redirect.ingress = _bool(r.get("ingress", False), f"{sw}.redirect.ingress")
    elif "mark" in steer:
        m = steer["mark"]
        if isinstance(m, dict):
            m = _map(m, f"{sw}.mark", ("mark",)).get("mark", 0)
        s.steer.mark.mark = _int(m, f"{sw}.mark")
    service = _map(spec.get("service"), f"{where}.spec.service", ("address", "port"))
    s.service_address = _str(service.get("address", ""), f"{where}.spec.service.address")
    s.service_port = _int(service.get("port", 0), f"{where}.spec.service.port", 65535)
    return s


def _instance_from_doc(doc: dict[str, Any], where: str) -> control_plane_pb2.AdapterInstance:
    """An AdapterInstance document in the CRD's shape (deploy/crds/) or adapterctl's own
    (``modelRef.adapterPath``); a route's ``tenantCIDRs`` become pins (see ``_tenant_pins``)."""
    _map(doc, where, _TOP)
    meta = _map(doc.get("metadata"), f"{where}.metadata", ("name", "namespace", "labels"))
    spec = _map(
        doc.get("spec"),
        f"{where}.spec",
        ("modelRef", "adapter", "protocol", "routes", "security", "placement"),
    )
    adapter = _map(spec.get("adapter"), f"{where}.spec.adapter", ("name", "path"))
    name = adapter.get("name") or _need(meta, "name", f"{where}.metadata")
    i = control_plane_pb2.AdapterInstance(name=_str(name, f"{where}.metadata.name"))
    i.labels.update(_labels(meta, f"{where}.metadata"))
    rw = f"{where}.spec.modelRef"
    ref = _map(
        _need(spec, "modelRef", f"{where}.spec"), rw, ("baseModel", "adapterPath", "revision")
    )
    i.model_ref.base_model = _str(_need(ref, "baseModel", rw), f"{rw}.baseModel")
    if "path" in adapter and "adapterPath" in ref:
        raise ValueError(
            f"{where}.spec.adapter.path: give it there or in modelRef.adapterPath, not both"
        )
    i.model_ref.adapter_path = _str(
        adapter.get("path", ref.get("adapterPath", "")), f"{rw}.adapterPath"
    )
    i.model_ref.revision = _str(ref.get("revision", ""), f"{rw}.revision")
    i.protocol = _str(spec.get("protocol", ""), f"{where}.spec.protocol")
    for n, route in enumerate(_list(spec.get("routes"), f"{where}.spec.routes")):
        rtw = f"{where}.spec.routes[{n}]"
        route = _map(route, rtw, ("shard", "weight", "tenantCIDRs", "path"))
        if "path" in route:
            if set(route) != {"path"}:
                raise ValueError(f"{rtw}: a path route has only a path")
            i.routes.add(path=_str(route["path"], f"{rtw}.path"))
            continue
        w = route.get("weight", 0)
        i.routes.add(
            shard_id=_str(_need(route, "shard", rtw), f"{rtw}.shard"),
            weight=parse_weight(w, f"{rtw}.weight") if w else 0,
        )
    pw = f"{where}.spec.placement"
    place = _map(spec.get("placement"), pw, ("shards", "replicas", "preload", "pinnedShards"))
    i.placement.shards.extend(
        _str(x, f"{pw}.shards[{k}]")
        for k, x in enumerate(_list(place.get("shards"), f"{pw}.shards"))
    )
    i.placement.pinned_shards.extend(
        _str(x, f"{pw}.pinnedShards[{k}]")
        for k, x in enumerate(_list(place.get("pinnedShards"), f"{pw}.pinnedShards"))
    )
    i.placement.replicas = _int(place.get("replicas", 0), f"{pw}.replicas")
    i.placement.preload = _bool(place.get("preload", False), f"{pw}.preload")
    sw = f"{where}.spec.security"
    sec = _map(spec.get("security"), sw, ("scopes", "allowedCIDRs", "tls"))
    i.security.tls = _bool(sec.get("tls", False), f"{sw}.tls")
    i.security.scopes.extend(
        _str(x, f"{sw}.scopes[{k}]") for k, x in enumerate(_list(sec.get("scopes"), f"{sw}.scopes"))
    )
    i.security.allowed_cidrs.extend(
        _str(x, f"{sw}.allowedCIDRs[{k}]")
        for k, x in enumerate(_list(sec.get("allowedCIDRs"), f"{sw}.allowedCIDRs"))
    )
    return i


def _tenant_pins(doc: dict[str, Any], where: str) -> list[assignment_pb2.Pin]:
    """The pins an AdapterInstance's routes ask for (``routes[].tenantCIDRs``)."""
    pins = []
    spec = doc.get("spec") or {}
    for n, route in enumerate(_list(spec.get("routes"), f"{where}.spec.routes")):
        rtw = f"{where}.spec.routes[{n}]"
        for k, cidr in enumerate(_list(route.get("tenantCIDRs"), f"{rtw}.tenantCIDRs")):
            pins.append(
                assignment_pb2.Pin(
                    cidr=_str(cidr, f"{rtw}.tenantCIDRs[{k}]"),
                    shard_id=_str(route["shard"], f"{rtw}.shard"),
                )
            )
    return pins


@dataclass
class _Change:
    kind: str
    name: str
    verb: str  # create | update | unchanged
    detail: str
    add: Callable[[control_plane_pb2.ApplyRequest], None] | None


def _diff_dicts(before: Any, after: Any, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        lines: list[str] = []
        for k in sorted(set(before) | set(after)):
            lines += _diff_dicts(before.get(k), after.get(k), f"{prefix}.{k}" if prefix else k)
        return lines
    if before != after:
        return [f"{prefix}: {json.dumps(before)} -> {json.dumps(after)}"]
    return []


def _load_documents(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"-f {path}: {exc}") from None
    outd: list[tuple[str, dict[str, Any]]] = []
    for n, doc in enumerate(docs):
        where = f"document {n + 1}"
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: not a mapping")
        if doc.get("kind") == "List":
            items = _list(doc.get("items"), f"{where}.items")
            outd += [
                (f"{where}.items[{k}]", _map(d, f"{where}.items[{k}]")) for k, d in enumerate(items)
            ]
        else:
            outd.append((where, doc))
    for where, doc in outd:
        kind = doc.get("kind")
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    return outd


def _plan(c: Ctx, docs: list[tuple[str, dict[str, Any]]]) -> list[_Change]:
    shards = {s.id: s for s in c.call("ListShards", control_plane_pb2.ListShardsRequest()).shards}
    insts = {
        i.name: i
        for i in c.call(
            "ListAdapterInstances", control_plane_pb2.ListAdapterInstancesRequest()
        ).instances
    }
    pins = {
        p.cidr: p.shard_id for p in c.call("ListPins", control_plane_pb2.ListPinsRequest()).pins
    }
    overrides = {
        o.shard_id: o
        for o in c.call("ListOverrides", control_plane_pb2.ListOverridesRequest()).overrides
    }
    changes: list[_Change] = []
    order = {k: n for n, k in enumerate(KINDS)}
    for where, doc in sorted(docs, key=lambda d: order[d[1]["kind"]]):
        kind = doc["kind"]
        if kind == "Shard":
            s = _shard_from_doc(doc, where)
            old = shards.get(s.id)
            lines = _diff_dicts(_shard_doc(old), _shard_doc(s)) if old is not None else []
            verb = "create" if old is None else "update" if lines else "unchanged"
            changes.append(
                _Change(
                    kind,
                    s.id,
                    verb,
                    "; ".join(lines),
                    None if verb == "unchanged" else _adder("shards", s),
                )
            )
        elif kind == "AdapterInstance":
            i = _instance_from_doc(doc, where)
            old_i = insts.get(i.name)
            lines = _diff_dicts(_instance_doc(old_i), _instance_doc(i)) if old_i is not None else []
            verb = "create" if old_i is None else "update" if lines else "unchanged"
            changes.append(
                _Change(
                    kind,
                    i.name,
                    verb,
                    "; ".join(lines),
                    None if verb == "unchanged" else _adder("instances", i),
                )
            )
            # Pins go after the instances in the server's transaction (ApplyRequest order).
            changes += [_pin_change(pins, p.cidr, p.shard_id) for p in _tenant_pins(doc, where)]
        elif kind == "Pin":
            _map(doc, where, _TOP)
            spec = _map(doc.get("spec"), f"{where}.spec", ("cidr", "shard"))
            cidr = _str(_need(spec, "cidr", f"{where}.spec"), f"{where}.spec.cidr")
            shard_id = _str(_need(spec, "shard", f"{where}.spec"), f"{where}.spec.shard")
            changes.append(_pin_change(pins, cidr, shard_id))
        else:
            _map(doc, where, _TOP)
            sw = f"{where}.spec"
            spec = _map(doc.get("spec"), sw, ("shard", "weight", "ttlSeconds", "reason"))
            shard_id = _str(_need(spec, "shard", sw), f"{sw}.shard")
            weight = parse_weight(_need(spec, "weight", sw), f"{sw}.weight")
            ttl = _int(spec.get("ttlSeconds", 0), f"{sw}.ttlSeconds")
            reason = _str(spec.get("reason", "applied from file"), f"{sw}.reason")
            req_o = control_plane_pb2.SetOverrideRequest(
                shard_id=shard_id, weight=weight, ttl_seconds=ttl, reason=reason
            )
            old_o = overrides.get(shard_id)
            if old_o is not None and old_o.weight == weight and old_o.reason == reason:
                # Same weight and reason: unchanged (re-applying does not extend a TTL).
                changes.append(_Change(kind, shard_id, "unchanged", "", None))
            else:
                detail = f"weight: {old_o.weight} -> {weight}" if old_o else f"weight {weight}"
                changes.append(
                    _Change(
                        kind,
                        shard_id,
                        "update" if old_o else "create",
                        detail,
                        _adder("overrides", req_o),
                    )
                )
    return changes


def _pin_change(pins: dict[str, str], cidr: str, shard_id: str) -> _Change:
    current = pins.get(cidr)
    pin = assignment_pb2.Pin(cidr=cidr, shard_id=shard_id)
    if current is None:
        return _Change("Pin", cidr, "create", f"-> {shard_id}", _adder("pins", pin))
    if current == shard_id:
        return _Change("Pin", cidr, "unchanged", "", None)
    return _Change("Pin", cidr, "update", f"shard: {current} -> {shard_id}", _adder("pins", pin))


def _adder(field: str, item: Any) -> Callable[[control_plane_pb2.ApplyRequest], None]:
    def add(req: control_plane_pb2.ApplyRequest) -> None:
        getattr(req, field).append(item)

    return add


def _guard(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except (ValueError, TypeError, OverflowError) as exc:
        _die(str(exc), 2)


# -- commands ----------------------------------------------------------------------------


@app.command("shards")
def shards_cmd(ctx: typer.Context) -> None:
    """List shards with their published weights and endpoints."""
    resp = _ctx(ctx).call("ListShards", control_plane_pb2.ListShardsRequest())
    t = Table("SHARD", "INDEX", "STATE", "WEIGHT", "ENDPOINTS", "STEER")
    for s in resp.shards:
        eps = ", ".join(f"{e.address}:{e.port}({e.weight})" for e in s.endpoints)
        kind = s.steer.WhichOneof("target") or "-"
        t.add_row(
            escape(s.id),
            str(s.index),
            _state(s.state),
            f"{s.weight / 100:.2f}%",
            escape(eps) or "-",
            kind,
        )
    out.print(t)


@shard_app.command("upsert")
def shard_upsert(
    ctx: typer.Context,
    shard_id: Annotated[str, typer.Argument(metavar="SHARD")],
    endpoint: Annotated[
        list[str] | None, typer.Option("--endpoint", "-e", help="ADDRESS:PORT")
    ] = None,
    tunnel: Annotated[str | None, typer.Option(help="VXLAN remote IPv4")] = None,
    vni: Annotated[int, typer.Option(help="VXLAN VNI")] = 0,
    ifname: Annotated[str | None, typer.Option(help="redirect to this local interface")] = None,
    mark: Annotated[int | None, typer.Option(help="steer by skb mark")] = None,
    service: Annotated[str | None, typer.Option(help="Envoy listener ADDRESS:PORT")] = None,
    draining: Annotated[bool, typer.Option(help="mark the shard DRAINING")] = False,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE")] = None,
) -> None:
    """Create or replace a shard (its index is kept)."""

    def build() -> assignment_pb2.Shard:
        s = assignment_pb2.Shard(id=shard_id)
        for i, e in enumerate(endpoint or []):
            addr, port = _hostport(e, f"--endpoint[{i}]")
            s.endpoints.add(address=addr, port=port)
        if sum(x is not None for x in (tunnel, ifname, mark)) > 1:
            raise ValueError("--tunnel, --ifname and --mark are exclusive")
        if tunnel is not None:
            s.steer.tunnel.remote_ipv4, s.steer.tunnel.vni = tunnel, vni
        elif ifname is not None:
            s.steer.redirect.ifname = ifname
        elif mark is not None:
            s.steer.mark.mark = mark
        if service:
            s.service_address, s.service_port = _hostport(service, "--service")
        s.state = (
            assignment_pb2.SHARD_STATE_DRAINING if draining else assignment_pb2.SHARD_STATE_ACTIVE
        )
        for kv in label or []:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ValueError(f"--label: {kv!r} is not KEY=VALUE")
            s.labels[k] = v
        return s

    s = _guard(build)
    stored = _ctx(ctx).call("UpsertShard", control_plane_pb2.UpsertShardRequest(shard=s))
    out.print(f"shard {stored.id} stored (index {stored.index})", markup=False, highlight=False)


@shard_app.command("delete")
def shard_delete(
    ctx: typer.Context, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Delete a shard (unpin its tenants first)."""
    _ctx(ctx).call("DeleteShard", control_plane_pb2.DeleteShardRequest(id=shard_id))
    out.print(f"shard {shard_id} deleted", markup=False, highlight=False)


@override_app.command("set")
def override_set(
    ctx: typer.Context,
    shard_id: Annotated[str, typer.Argument(metavar="SHARD")],
    weight: Annotated[str, typer.Argument(metavar="WEIGHT", help="parts per 10,000, or N%")],
    ttl: Annotated[int, typer.Option(help="seconds until it expires (0: never)")] = 0,
    reason: Annotated[str, typer.Option(help="why; recorded in the history")] = "",
) -> None:
    """Fix a shard's weight; the other shards re-normalise."""
    parts = _guard(lambda: parse_weight(weight))
    if ttl < 0:
        _die(f"--ttl: {ttl} is negative", 2)
    o = _ctx(ctx).call(
        "SetOverride",
        control_plane_pb2.SetOverrideRequest(
            shard_id=shard_id, weight=parts, ttl_seconds=ttl, reason=reason
        ),
    )
    out.print(
        f"override {o.shard_id} = {o.weight} parts, expires {_ts(o.expires_at)}",
        markup=False,
        highlight=False,
    )


@override_app.command("clear")
def override_clear(
    ctx: typer.Context, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Remove a shard's override."""
    _ctx(ctx).call("ClearOverride", control_plane_pb2.ClearOverrideRequest(shard_id=shard_id))
    out.print(f"override on {shard_id} cleared", markup=False, highlight=False)


@override_app.command("list")
def override_list(ctx: typer.Context) -> None:
    """List active overrides."""
    resp = _ctx(ctx).call("ListOverrides", control_plane_pb2.ListOverridesRequest())
    t = Table("SHARD", "WEIGHT", "EXPIRES", "REASON")
    for o in resp.overrides:
        t.add_row(escape(o.shard_id), str(o.weight), _ts(o.expires_at), escape(o.reason))
    out.print(t)


@app.command("pin")
def pin_cmd(
    ctx: typer.Context, cidr: str, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Pin a tenant CIDR to a shard (the longest prefix wins)."""
    p = _ctx(ctx).call(
        "PinTenant", control_plane_pb2.PinTenantRequest(cidr=cidr, shard_id=shard_id)
    )
    out.print(f"pinned {p.cidr} -> {p.shard_id}", markup=False, highlight=False)


@rules_app.command("apply")
def rules_apply_cmd(
    ctx: typer.Context,
    file: Annotated[Path, typer.Option("-f", "--file", help="rule set YAML ('-': stdin)")],
    reason: Annotated[
        str, typer.Option(help="why, kept in the history")
    ] = "adapterctl rules apply",
) -> None:
    """Apply a routing-rule set; a bad rule is refused with its name and position."""
    text = sys.stdin.read() if str(file) == "-" else file.read_text()
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        out.print(f"error: {file}: not YAML: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    resp = _ctx(ctx).call(
        "ApplyRules",
        control_plane_pb2.ApplyRulesRequest(document_json=json.dumps(document), reason=reason),
    )
    r = resp.rule_set
    what = "unchanged" if resp.unchanged else "applied"
    out.print(f"rules v{r.version} {what} ({r.rules} rules)", markup=False, highlight=False)


@rules_app.command("list")
def rules_list_cmd(ctx: typer.Context, limit: int = 20) -> None:
    """Rule set versions, newest first (the first row is live)."""
    resp = _ctx(ctx).call("ListRules", control_plane_pb2.ListRulesRequest(limit=limit))
    t = Table("VERSION", "RULES", "CREATED", "REASON")
    for r in resp.rule_sets:
        t.add_row(str(r.version), str(r.rules), _ts(r.created_at), escape(r.reason))
    out.print(t)


@rules_app.command("get")
def rules_get_cmd(ctx: typer.Context, version: int = 0) -> None:
    """A rule set as YAML (default: the live one)."""
    r = _ctx(ctx).call("GetRules", control_plane_pb2.GetRulesRequest(version=version))
    out.print(f"# rules v{r.version}: {r.reason}", markup=False, highlight=False)
    out.print(
        yaml.safe_dump(json.loads(r.document_json), sort_keys=False), markup=False, highlight=False
    )


_ROLLOUT_STATES = {
    control_plane_pb2.ROLLOUT_STATE_RUNNING: "RUNNING",
    control_plane_pb2.ROLLOUT_STATE_PAUSED: "PAUSED",
    control_plane_pb2.ROLLOUT_STATE_COMPLETED: "COMPLETED",
    control_plane_pb2.ROLLOUT_STATE_ROLLED_BACK: "ROLLED_BACK",
    control_plane_pb2.ROLLOUT_STATE_ABORTED: "ABORTED",
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, field: str, default_unit: str = "s") -> float:
    """``90s``, ``2m``, ``1h``, ``800ms`` (a bare number is in ``default_unit``) -> that unit."""
    t = text.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h") if t.endswith(u)), default_unit)
    number = t[: -len(unit)] if t.endswith(unit) else t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a duration such as 90s, 2m or 800ms") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{field}: {text!r} must be a finite duration >= 0")
    return value * _DURATION_UNITS[unit] / _DURATION_UNITS[default_unit]


def parse_fraction(text: str, field: str) -> float:
    """``1%`` or ``0.01`` -> 0.01."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a rate such as 1% or 0.01") from None
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"{field}: {text!r} is not between 0% and 100%")
    return value


def parse_steps(text: str) -> list[int]:
    try:
        return [int(p.strip().rstrip("%")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--steps: {text!r} is not a list of percentages such as 5,25,50,100"
        ) from None


def _rollouts_table(rollouts: Any, title: str = "rollouts") -> Table:
    t = Table(
        "ADAPTER",
        "FROM",
        "TO",
        "STATE",
        "STEP",
        "SHARE",
        "REQS",
        "ERRORS",
        "P95 TTFT",
        "REASON",
        title=title,
    )
    for r in rollouts:
        spec = r.spec
        step = f"{r.step + 1}/{len(spec.steps_percent)}"
        p95 = f"{r.window_p95_ttft_ms:.0f} ms" if r.window_requests else "-"
        t.add_row(
            escape(spec.adapter),
            escape(spec.from_version or "(unversioned)"),
            escape(spec.to_version),
            _ROLLOUT_STATES.get(r.state, "?"),
            step,
            f"{r.share / 100:g}%",
            str(r.window_requests),
            str(r.window_errors),
            p95,
            escape(r.reason),
        )
    return t


@app.command("rollout", context_settings={"allow_interspersed_args": True})
def rollout_cmd(
    ctx: typer.Context,
    args: Annotated[
        list[str],
        typer.Argument(
            metavar="ADAPTER | pause ADAPTER | resume ADAPTER | abort ADAPTER | status [ADAPTER] "
            "| history ADAPTER"
        ),
    ],
    to: Annotated[str, typer.Option("--to", help="the new version")] = "",
    from_version: Annotated[
        str,
        typer.Option("--from", help="the version now serving (default: the adapter's stable one)"),
    ] = "",
    steps: Annotated[
        str, typer.Option(help="canary shares in percent, the last 100")
    ] = "5,25,50,100",
    interval: Annotated[str, typer.Option(help="least time per step (90s, 2m, 1h)")] = "2m",
    max_error_rate: Annotated[
        str, typer.Option(help="roll back above this error rate (1%; 0: none)")
    ] = "0",
    max_p95_ttft: Annotated[
        str, typer.Option(help="roll back above this p95 TTFT (800ms; 0: none)")
    ] = "0",
    min_requests: Annotated[
        int, typer.Option(help="requests of the new version a step needs")
    ] = 20,
    reason: Annotated[str, typer.Option(help="why; recorded with the rollout")] = "",
) -> None:
    """Gray release of an adapter version by traffic share, promoted step by step and rolled
    back when the new version breaks a bound; or pause / resume / abort / status / history."""
    c = _ctx(ctx)
    verb = args[0] if args else ""
    if verb in ("pause", "resume", "abort"):
        if len(args) != 2:
            _die(f"usage: adapterctl rollout {verb} ADAPTER", 2)
        r = c.call(
            "ControlRollout",
            control_plane_pb2.ControlRolloutRequest(adapter=args[1], action=verb, reason=reason),
        )
        out.print(
            f"rollout {r.spec.adapter} -> {r.spec.to_version}: "
            f"{_ROLLOUT_STATES.get(r.state, '?')} at {r.share / 100:g}%",
            markup=False,
            highlight=False,
        )
        return
    if verb in ("status", "history"):
        if len(args) > 2 or (verb == "history" and len(args) != 2):
            _die(
                f"usage: adapterctl rollout {verb} {'ADAPTER' if verb == 'history' else '[ADAPTER]'}",
                2,
            )
        resp = c.call(
            "ListRollouts",
            control_plane_pb2.ListRolloutsRequest(
                adapter=args[1] if len(args) == 2 else "", history=verb == "history"
            ),
        )
        out.print(_rollouts_table(resp.rollouts))
        if verb == "history":
            t = Table("AT", "ADAPTER", "TO", "EVENT", "SHARE", "REASON", title="events")
            for r in resp.rollouts:
                for e in r.events:
                    t.add_row(
                        _ts(e.at),
                        escape(r.spec.adapter),
                        escape(r.spec.to_version),
                        e.kind,
                        f"{e.share / 100:g}%",
                        escape(e.reason),
                    )
            out.print(t)
        return
    if len(args) != 1:
        _die("usage: adapterctl rollout ADAPTER --to VERSION [--steps ...]", 2)
    if not to:
        _die("--to: the new version is required", 2)

    def spec() -> control_plane_pb2.RolloutSpec:
        seconds = parse_duration(interval, "--interval")
        if seconds != int(seconds) or seconds < 1:
            raise ValueError(f"--interval: {interval!r} must be a whole number of seconds >= 1")
        return control_plane_pb2.RolloutSpec(
            adapter=args[0],
            from_version=from_version,
            to_version=to,
            steps_percent=parse_steps(steps),
            interval_seconds=int(seconds),
            max_error_rate=parse_fraction(max_error_rate, "--max-error-rate"),
            max_p95_ttft_ms=parse_duration(max_p95_ttft, "--max-p95-ttft", "ms"),
            min_requests=min_requests,
        )

    r = c.call(
        "StartRollout", control_plane_pb2.StartRolloutRequest(spec=_guard(spec), reason=reason)
    )
    out.print(
        f"rollout {r.spec.adapter} {r.spec.from_version or '(unversioned)'} -> "
        f"{r.spec.to_version} started at {r.share / 100:g}% (id {r.id})",
        markup=False,
        highlight=False,
    )


@app.command("unpin")
def unpin_cmd(ctx: typer.Context, cidr: str) -> None:
    """Remove a tenant pin."""
    _ctx(ctx).call("UnpinTenant", control_plane_pb2.UnpinTenantRequest(cidr=cidr))
    out.print(f"unpinned {cidr}", markup=False, highlight=False)


def _status_table(st: control_plane_pb2.StatusResponse) -> Table:
    a = st.assignment
    t = Table(
        "SHARD",
        "STATE",
        "WEIGHT",
        "UTIL",
        "QUEUE",
        "RUNNING",
        "TTFT ms",
        "TOK/s",
        "KV",
        "WORKERS",
        title=f"assignment v{a.version} at {_ts(a.generated_at)}: {escape(a.reason)}",
    )
    loads = {ld.shard_id: ld for ld in st.loads}
    for s in a.shards:
        ld = loads.get(s.id)
        if ld is None or not ld.known:
            cells = ["unknown"] + ["-"] * 5
        else:
            cells = [
                f"{ld.utilization:.2f}",
                f"{ld.queue_depth:.0f}",
                f"{ld.running:.0f}",
                f"{ld.latency_ms:.0f}",
                f"{ld.tokens_per_s:.0f}",
                f"{ld.kv_cache_usage:.0%}",
            ]
        workers = f"{ld.workers_known}/{ld.workers}" if ld else f"?/{len(s.endpoints)}"
        t.add_row(escape(s.id), _state(s.state), f"{s.weight / 100:.2f}%", *cells, workers)
    return t


def node_state(n: control_plane_pb2.NodeStatus, version: int) -> str:
    """DEGRADED: the node refused an Assignment and serves an older one; LAGGING: it has not
    applied the newest yet; OK otherwise."""
    if n.apply_error:
        return "DEGRADED"
    return "LAGGING" if n.applied_version < version else "OK"


def _nodes_table(st: control_plane_pb2.StatusResponse) -> Table:
    t = Table("NODE", "STATE", "APPLIED", "LAG", "LAST REPORT", "ERROR", title="nodes")
    for n in st.nodes:
        lag = st.assignment.version - n.applied_version
        state = node_state(n, st.assignment.version)
        style = "" if state == "OK" else "red"
        t.add_row(
            escape(n.node_id),
            state,
            str(n.applied_version),
            str(lag),
            _ts(n.last_report),
            escape(n.apply_error),
            style=style,
        )
    return t


@app.command("status")
def status_cmd(ctx: typer.Context) -> None:
    """Weights, loads, and the version each node applied (lagging nodes show in red)."""
    st = _ctx(ctx).call("GetStatus", control_plane_pb2.GetStatusRequest())
    out.print(_status_table(st))
    out.print(_nodes_table(st))
    rollouts = _ctx(ctx).call("ListRollouts", control_plane_pb2.ListRolloutsRequest())
    if rollouts.rollouts:
        out.print(_rollouts_table(rollouts.rollouts))


@app.command("watch")
def watch_cmd(
    ctx: typer.Context,
    from_version: Annotated[int, typer.Option(help="resume after this version")] = 0,
    count: Annotated[int, typer.Option(help="stop after this many Assignments (0: never)")] = 0,
) -> None:
    """Live table of Assignments as they are published."""
    if from_version < 0 or count < 0:
        _die("--from-version and --count must be >= 0", 2)
    c = _ctx(ctx)
    stream = c.stub.WatchAssignments(
        control_plane_pb2.WatchAssignmentsRequest(from_version=from_version, node_id="adapterctl"),
        metadata=c.metadata,
    )
    seen = 0
    try:
        with Live(Table(), console=out, auto_refresh=False, transient=not out.is_terminal) as live:
            for a in stream:
                st = control_plane_pb2.StatusResponse(assignment=a)
                with _quiet():
                    st.loads.extend(
                        c.stub.GetStatus(
                            control_plane_pb2.GetStatusRequest(),
                            metadata=c.metadata,
                            timeout=c.timeout,
                        ).loads
                    )
                live.update(_status_table(st), refresh=True)
                if not out.is_terminal:
                    out.print(f"v{a.version} {a.reason}", highlight=False, markup=False)
                seen += 1
                if count and seen >= count:
                    stream.cancel()
                    break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            _die(f"WatchAssignments: {exc.code().name}: {exc.details()}", _EXIT.get(exc.code(), 1))
    except KeyboardInterrupt:
        stream.cancel()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], grpc.RpcError)  # type: ignore[arg-type]


@app.command("history")
def history_cmd(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="how many versions")] = 20,
    before: Annotated[int, typer.Option(help="only versions below this one")] = 0,
) -> None:
    """Published Assignment versions with their reasons, newest first."""
    if not 0 < limit <= 1000:
        _die(f"--limit: {limit} is not in 1..1000", 2)
    if before < 0:
        _die(f"--before: {before} is negative", 2)
    resp = _ctx(ctx).call(
        "ListHistory", control_plane_pb2.ListHistoryRequest(limit=limit, before_version=before)
    )
    t = Table("VERSION", "GENERATED", "WEIGHTS", "REASON")
    for r in resp.records:
        w = " ".join(f"{s.id}={s.weight}" for s in r.assignment.shards if s.weight)
        t.add_row(str(r.version), _ts(r.generated_at), escape(w), escape(r.reason))
    out.print(t)


@app.command("get")
def get_cmd(
    ctx: typer.Context,
    what: Annotated[
        str, typer.Argument(help="all | shards | pins | overrides | adapters | assignment")
    ] = "all",
    output: Annotated[str, typer.Option("--output", "-o", help="yaml | json")] = "yaml",
) -> None:
    """Print objects as documents that `apply -f` accepts."""
    if output not in ("yaml", "json"):
        _die(f"--output: {output!r} is not yaml or json", 2)
    valid = ("all", "shards", "pins", "overrides", "adapters", "assignment")
    if what not in valid:
        _die(f"WHAT: {what!r} is not one of {', '.join(valid)}", 2)
    c = _ctx(ctx)
    docs: list[dict[str, Any]] = []
    if what == "assignment":
        a = c.call("GetAssignment", control_plane_pb2.GetAssignmentRequest())
        payload: Any = MessageToDict(a)
    else:
        if what in ("all", "shards"):
            docs += [
                _shard_doc(s)
                for s in c.call("ListShards", control_plane_pb2.ListShardsRequest()).shards
            ]
        if what in ("all", "adapters"):
            docs += [
                _instance_doc(i)
                for i in c.call(
                    "ListAdapterInstances", control_plane_pb2.ListAdapterInstancesRequest()
                ).instances
            ]
        if what in ("all", "pins"):
            docs += [
                _pin_doc(p) for p in c.call("ListPins", control_plane_pb2.ListPinsRequest()).pins
            ]
        if what in ("all", "overrides"):
            docs += [
                _override_doc(o)
                for o in c.call("ListOverrides", control_plane_pb2.ListOverridesRequest()).overrides
            ]
        payload = {"kind": "List", "items": docs}
    if output == "json":
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    elif isinstance(payload, dict) and payload.get("kind") == "List":
        sys.stdout.write(yaml.safe_dump_all(payload["items"], sort_keys=False))
    else:
        sys.stdout.write(yaml.safe_dump(payload, sort_keys=False))


@app.command("apply")
def apply_cmd(
    ctx: typer.Context,
    filename: Annotated[Path, typer.Option("--filename", "-f", help="YAML file ('-': stdin)")],
    dry_run: Annotated[bool, typer.Option(help="print the diff only")] = False,
) -> None:
    """Make the server match Shard, AdapterInstance, Pin and Override documents; idempotent."""
    c = _ctx(ctx)
    docs = _guard(lambda: _load_documents(filename))
    changes = _guard(lambda: _plan(c, docs))  # everything validated before anything is sent
    marks = {"create": "[green]+[/green]", "update": "[yellow]~[/yellow]", "unchanged": "="}
    for ch in changes:
        detail = f"  ({escape(ch.detail)})" if ch.detail else ""
        out.print(
            f"{marks[ch.verb]} {escape(ch.kind)}/{escape(ch.name)} {ch.verb}{detail}",
            highlight=False,
        )
    todo = [ch for ch in changes if ch.add is not None]
    if dry_run:
        out.print(f"{len(todo)} change(s) (dry run: nothing sent)")
        return
    if not todo:
        out.print(f"0 change(s) applied, {len(changes)} unchanged")
        return
    # One request, one server-side transaction: every change is made, or none is.
    req = control_plane_pb2.ApplyRequest(reason=_guard(lambda: f"apply -f {filename.name}"))
    for ch in todo:
        assert ch.add is not None
        ch.add(req)
    resp = c.call("Apply", req)
    version = f" (assignment v{resp.version})" if resp.version else ""
    out.print(f"{len(todo)} change(s) applied{version}, {len(changes) - len(todo)} unchanged")


if __name__ == "__main__":
    app()
