"""adapterctl: the operator CLI for the adaptermesh control plane.

Connection options also come from the environment: ADAPTERMESH_SERVER, ADAPTERMESH_TOKEN,
ADAPTERMESH_TOKEN_FILE. Read commands print a table (-o wide: more columns) or JSON / YAML
(-o json|yaml) with the table's keys and whole values.

Exit codes: 0 success, 1 server-side failure, 2 bad input (usage, invalid values, rejected
arguments), 3 not found, 4 already exists or failed precondition, 5 not authenticated or not
permitted, 6 server unreachable or timed out.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
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
from typer.core import TyperCommand, TyperGroup

from adaptermesh import cliargs
from adaptermesh.assignment_rules import WEIGHT_BUDGET
from adaptermesh.cli.adapterctl_output import (
    PIPE_WIDTH,
    Column,
    Listing,
    check_format,
    print_payload,
    print_tables,
    rfc3339,
    stdout_console,
)
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)

__all__ = ["app", "node_state", "parse_duration", "parse_fraction", "parse_steps", "parse_weight"]

T = TypeVar("T")
KINDS = ("Shard", "AdapterInstance", "Pin", "Override")
NOTHING_APPLIED = "nothing applied"


class _RolloutGroup(TyperGroup):
    """``rollout start|status|history|pause|resume|promote|abort``; an invocation that names no
    sub-command (``rollout ADAPTER --to V``, the original form) is ``rollout start``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's click Context
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["start", *args]
        return super().parse_args(ctx, args)


class _ArgvCommand(TyperCommand):
    """A command that keeps the arguments it was given (``ctx.meta[ARGV]``), in order."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's click Context
        ctx.meta[_ARGV] = list(args)
        return super().parse_args(ctx, args)


_ARGV = "adapterctl.argv"
_HELP = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    context_settings=_HELP,
)
shard_app = typer.Typer(help="Create, change or delete shards.", no_args_is_help=True)
override_app = typer.Typer(help="Operator weight overrides.", no_args_is_help=True)
app.add_typer(shard_app, name="shard")
app.add_typer(override_app, name="override")
rules_app = typer.Typer(help="Routing rules (CEL): apply, list, get.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")
rollout_app = typer.Typer(
    cls=_RolloutGroup,
    help="Gray release of an adapter version: start, status, history, pause, resume, "
    "promote, abort "
    "(`rollout ADAPTER --to V` is `rollout start`).",
    no_args_is_help=True,
)
app.add_typer(rollout_app, name="rollout")


OutputOption = Annotated[
    str,
    typer.Option(
        "--output", "-o", help="table | wide (more columns) | json | yaml", show_default=True
    ),
]

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


def _example(*lines: str) -> str:
    return (
        "Example: " + " ; ".join(lines) if len(lines) == 1 else "Examples:\n\n" + "\n\n".join(lines)
    )


def _die(message: str, code: int) -> NoReturn:
    # One line: server messages quote user text, which must show as written.
    line = " ".join(message.split())
    err = Console(stderr=True)
    if not err.is_terminal:
        err = Console(stderr=True, width=PIPE_WIDTH)  # one line, however long
    err.print(f"[red]error:[/red] {escape(line)}", highlight=False)
    raise typer.Exit(code)


def _say(text: str) -> None:
    """One plain line on stdout (user text shown literally, never cut)."""
    stdout_console().print(text, markup=False, highlight=False)


@dataclass
class Ctx:
    server: str
    token: str | None
    ca: bytes | None
    cert: bytes | None
    key: bytes | None
    timeout: float
    _stub: control_plane_pb2_grpc.ControlPlaneStub | None = None
    _channel: grpc.Channel | None = None

    @property
    def stub(self) -> control_plane_pb2_grpc.ControlPlaneStub:
        if self._stub is None:
            if self.ca is not None:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
                )
                self._channel = grpc.secure_channel(self.server, creds)
            else:
                self._channel = grpc.insecure_channel(self.server)
            self._stub = control_plane_pb2_grpc.ControlPlaneStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def call(
        self, method: str, request: Any, *, timeout: float | None = None, note: str = ""
    ) -> Any:
        """The RPC's response; on an error, one line (``note`` appended) and its exit code."""
        try:
            return getattr(self.stub, method)(
                request, metadata=self.metadata, timeout=timeout or self.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            suffix = f" ({note})" if note else ""
            _die(f"{method}: {code.name}: {exc.details()}{suffix}", _EXIT.get(code, 1))


def _ctx(ctx: typer.Context) -> Ctx:
    obj = ctx.find_root().obj
    assert isinstance(obj, Ctx)
    return obj


def _read_file(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        _die(f"{flag}: cannot read {path}: {exc.strerror or exc}", 2)


def _version_callback(value: bool) -> None:
    if value:
        try:
            number = package_version("adaptermesh")
        except PackageNotFoundError:
            number = "unknown"
        sys.stdout.write(f"adapterctl {number}\n")
        raise typer.Exit(0)


def _given(ctx: typer.Context, param: str, flag: str, env: str) -> str:
    """How the user set ``param``: its flag, or the environment variable it came from."""
    source = ctx.get_parameter_source(param)
    return env if source is not None and source.name == "ENVIRONMENT" else flag


@app.callback(
    epilog=_example(
        "adapterctl --server cp.example:7400 --token-file ~/.adaptermesh-token status -o json"
    )
)
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
    timeout: Annotated[str, typer.Option(help="per-call timeout (10, 10s, 500ms, 1m)")] = "10",
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="print the version and exit",
        ),
    ] = False,
) -> None:
    if token and token_file:
        _die(
            f"{_given(ctx, 'token', '--token', 'ADAPTERMESH_TOKEN')} and "
            f"{_given(ctx, 'token_file', '--token-file', 'ADAPTERMESH_TOKEN_FILE')} "
            "are exclusive: set one",
            2,
        )
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            _die(f"{_given(ctx, 'token_file', '--token-file', 'ADAPTERMESH_TOKEN_FILE')}: {exc}", 2)
    if (tls_cert or tls_key) and not tls_ca:
        _die("--tls-cert/--tls-key need --tls-ca", 2)
    seconds = _guard(lambda: parse_duration(timeout, "--timeout"))
    if seconds <= 0:
        _die(f"--timeout: {timeout!r} must be longer than 0", 2)
    ctx.obj = Ctx(
        server,
        token,
        _read_file(tls_ca, "--tls-ca"),
        _read_file(tls_cert, "--tls-cert"),
        _read_file(tls_key, "--tls-key"),
        seconds,
    )


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


def _tenant_pins(doc: dict[str, Any], where: str) -> list[tuple[str, assignment_pb2.Pin]]:
    """The pins an AdapterInstance's routes ask for (``routes[].tenantCIDRs``), each with its
    position in the file."""
    pins = []
    spec = doc.get("spec") or {}
    for n, route in enumerate(_list(spec.get("routes"), f"{where}.spec.routes")):
        rtw = f"{where}.spec.routes[{n}]"
        for k, cidr in enumerate(_list(route.get("tenantCIDRs"), f"{rtw}.tenantCIDRs")):
            pin = assignment_pb2.Pin(
                cidr=_str(cidr, f"{rtw}.tenantCIDRs[{k}]"),
                shard_id=_str(route["shard"], f"{rtw}.shard"),
            )
            pins.append((f"{rtw}.tenantCIDRs[{k}]", pin))
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


def _yaml_error(source: str, exc: yaml.YAMLError) -> str:
    """One line: where the YAML broke (line and column, 1-based) and why."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "not valid YAML"
        context = ""
        if exc.context and exc.context_mark is not None and exc.problem:
            cm = exc.context_mark
            context = f" ({exc.context} at line {cm.line + 1}, column {cm.column + 1})"
        hint = (
            "; check the indentation" if "block" in problem or "mapping values" in problem else ""
        )
        return f"{source}: YAML error at {where}: {problem}{context}{hint}"
    return f"{source}: not valid YAML: {' '.join(str(exc).split())}"


def _read_text(path: Path, flag: str) -> str:
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{flag} {path}: cannot read it: {reason or exc}") from None


def _load_documents(path: Path) -> list[tuple[str, dict[str, Any]]]:
    text = _read_text(path, "-f")
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(_yaml_error(f"-f {path}", exc)) from None
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


def _cidr_key(cidr: str) -> str:
    """The network a CIDR names (``10.8.0.0/16``), so two spellings of one count as one."""
    try:
        return str(ipaddress.ip_network(cidr, strict=False))
    except ValueError:
        return cidr


class _Seen:
    """Refuses a second document for the same object (the same shard, adapter instance, pin
    or override), naming both positions: a file must not depend on which one wins."""

    def __init__(self) -> None:
        self.where: dict[tuple[str, str], str] = {}

    def add(self, kind: str, name: str, where: str) -> None:
        first = self.where.setdefault((kind, name), where)
        if first != where:
            raise ValueError(f"{where}: {kind} {name!r} is also given in {first}")


def _check_shard(shard_id: str, where: str, known: set[str]) -> None:
    if shard_id not in known:
        raise ValueError(
            f"{where}: no shard {shard_id!r} on the server or in the file (a dangling reference)"
        )


def _plan(c: Ctx, docs: list[tuple[str, dict[str, Any]]]) -> list[_Change]:
    """Every change the documents ask for, each validated (fields, duplicates, references to
    shards) before the caller prints anything."""
    note = NOTHING_APPLIED
    shards = {
        s.id: s
        for s in c.call("ListShards", control_plane_pb2.ListShardsRequest(), note=note).shards
    }
    insts = {
        i.name: i
        for i in c.call(
            "ListAdapterInstances", control_plane_pb2.ListAdapterInstancesRequest(), note=note
        ).instances
    }
    pins = {
        p.cidr: p.shard_id
        for p in c.call("ListPins", control_plane_pb2.ListPinsRequest(), note=note).pins
    }
    overrides = {
        o.shard_id: o
        for o in c.call(
            "ListOverrides", control_plane_pb2.ListOverridesRequest(), note=note
        ).overrides
    }
    changes: list[_Change] = []
    seen = _Seen()
    order = {k: n for n, k in enumerate(KINDS)}
    ordered = sorted(docs, key=lambda d: order[d[1]["kind"]])
    # The shards a reference may name: the server's, and the file's (created first).
    known = set(shards)
    for where, doc in ordered:
        if doc["kind"] == "Shard":
            known.add(_shard_from_doc(doc, where).id)
    for where, doc in ordered:
        kind = doc["kind"]
        if kind == "Shard":
            s = _shard_from_doc(doc, where)
            seen.add(kind, s.id, where)
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
            seen.add(kind, i.name, where)
            for n, route in enumerate(i.routes):
                if not route.path:
                    _check_shard(route.shard_id, f"{where}.spec.routes[{n}].shard", known)
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
            for pin_where, p in _tenant_pins(doc, where):
                seen.add("Pin", _cidr_key(p.cidr), pin_where)
                changes.append(_pin_change(pins, p.cidr, p.shard_id))
        elif kind == "Pin":
            _map(doc, where, _TOP)
            spec = _map(doc.get("spec"), f"{where}.spec", ("cidr", "shard"))
            cidr = _str(_need(spec, "cidr", f"{where}.spec"), f"{where}.spec.cidr")
            shard_id = _str(_need(spec, "shard", f"{where}.spec"), f"{where}.spec.shard")
            seen.add(kind, _cidr_key(cidr), where)
            _check_shard(shard_id, f"{where}.spec.shard", known)
            changes.append(_pin_change(pins, cidr, shard_id))
        else:
            _map(doc, where, _TOP)
            sw = f"{where}.spec"
            spec = _map(doc.get("spec"), sw, ("shard", "weight", "ttlSeconds", "reason"))
            shard_id = _str(_need(spec, "shard", sw), f"{sw}.shard")
            weight = parse_weight(_need(spec, "weight", sw), f"{sw}.weight")
            ttl = _int(spec.get("ttlSeconds", 0), f"{sw}.ttlSeconds", cliargs.MAX_DURATION_S)
            reason = _str(spec.get("reason", "applied from file"), f"{sw}.reason")
            seen.add(kind, shard_id, where)
            _check_shard(shard_id, f"{sw}.shard", known)
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


def _guard(fn: Callable[[], T], note: str = "") -> T:
    """``fn()``; a ValueError (bad input) is one line (``note`` appended) and exit 2."""
    try:
        return fn()
    except (ValueError, TypeError, OverflowError) as exc:
        _die(f"{exc} ({note})" if note else str(exc), 2)


# -- parsers for flags -------------------------------------------------------------------


def parse_duration(text: str, field: str, default_unit: str = "s") -> float:
    """``90s``, ``2m``, ``1h``, ``800ms`` (a bare number is in ``default_unit``) -> that unit;
    0 allowed (the callers say what 0 means), the rest as ``cliargs.parse_duration``."""
    return cliargs.parse_duration(text, field, unit=default_unit, zero_ok=True)


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


def _format(output: str) -> str:
    return _guard(lambda: check_format(output))


def _when(ts: Any) -> str | None:
    return rfc3339(ts.seconds, ts.nanos)


def _shown_time(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "-" if value is None else str(value).replace("T", " ")


# -- commands ----------------------------------------------------------------------------


def _steer_target(s: assignment_pb2.Shard) -> str:
    kind = s.steer.WhichOneof("target")
    if kind == "tunnel":
        return f"{s.steer.tunnel.remote_ipv4} vni {s.steer.tunnel.vni}"
    if kind == "redirect":
        return s.steer.redirect.ifname or str(s.steer.redirect.ifindex)
    if kind == "mark":
        return str(s.steer.mark.mark)
    return ""


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: f"{row[key] / 100:.2f}%"


SHARD_COLUMNS = (
    Column("SHARD", "shard"),
    Column("INDEX", "index"),
    Column("STATE", "state"),
    Column("WEIGHT", "weight", _pct("weight")),
    Column(
        "ENDPOINTS",
        "endpoints",
        lambda r: (
            ", ".join(f"{e['address']}:{e['port']}({e['weight']})" for e in r["endpoints"]) or "-"
        ),
    ),
    Column("STEER", "steer"),
    Column("TARGET", "steer_target", wide=True),
    Column("SERVICE", "service", wide=True),
    Column("LABELS", "labels", wide=True),
)


@app.command("shards", epilog=_example("adapterctl shards -o wide"))
def shards_cmd(ctx: typer.Context, output: OutputOption = "table") -> None:
    """List shards with their published weights and endpoints.

    -o json|yaml: a list of {shard, index, state, weight (parts per 10,000), endpoints
    [{address, port, weight, draining}], steer, steer_target, service, labels}."""
    fmt = _format(output)
    resp = _ctx(ctx).call("ListShards", control_plane_pb2.ListShardsRequest())
    rows = [
        {
            "shard": s.id,
            "index": s.index,
            "state": _state(s.state),
            "weight": s.weight,
            "endpoints": [
                {"address": e.address, "port": e.port, "weight": e.weight, "draining": e.draining}
                for e in s.endpoints
            ],
            "steer": s.steer.WhichOneof("target"),
            "steer_target": _steer_target(s) or None,
            "service": f"{s.service_address}:{s.service_port}" if s.service_port else None,
            "labels": dict(s.labels),
        }
        for s in resp.shards
    ]
    print_tables([Listing(SHARD_COLUMNS, rows)], fmt, rows)


@shard_app.command(
    "upsert",
    epilog=_example(
        "adapterctl shard upsert web -e 10.0.5.1:8000 -e 10.0.5.2:8000 --tunnel 192.0.2.5 --vni 5"
    ),
)
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
    _say(f"shard {stored.id} stored (index {stored.index})")


@shard_app.command("delete", epilog=_example("adapterctl shard delete web"))
def shard_delete(
    ctx: typer.Context, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Delete a shard (unpin its tenants first)."""
    _ctx(ctx).call("DeleteShard", control_plane_pb2.DeleteShardRequest(id=shard_id))
    _say(f"shard {shard_id} deleted")


def _words_after_reason(ctx: typer.Context, words: list[str]) -> str:
    """The words of an unquoted ``--reason a b c``: click takes ``a`` as the value and leaves
    ``b c`` as arguments; they are the reason's only when they follow ``--reason``."""
    argv: list[str] = ctx.meta.get(_ARGV, [])
    start = None
    for n, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--reason":
            start = n + 2
        elif arg.startswith("--reason="):
            start = n + 1
    tail = iter(argv[start:] if start is not None else [])
    if start is None or not all(word in tail for word in words):  # in order, after --reason
        extra = " ".join(words)
        _die(
            f"unexpected extra argument(s): {extra!r} (words of a reason go after --reason)",
            2,
        )
    return " ".join(words)


@override_app.command(
    "set",
    cls=_ArgvCommand,
    epilog=_example("adapterctl override set s0 60% --ttl 1h --reason canary: new kernels on s0"),
)
def override_set(
    ctx: typer.Context,
    shard_id: Annotated[str, typer.Argument(metavar="SHARD")],
    weight: Annotated[str, typer.Argument(metavar="WEIGHT", help="parts per 10,000, or N%")],
    reason_words: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[REASON...]",
            help="the rest of an unquoted --reason (--reason demo: canary s0)",
            show_default=False,
        ),
    ] = None,
    ttl: Annotated[
        str, typer.Option(help="time until it expires: 600, 600s, 10m, 1h (0: never)")
    ] = "0",
    reason: Annotated[
        str, typer.Option(help="why; recorded in the history (the words after it, too)")
    ] = "",
) -> None:
    """Fix a shard's weight; the other shards re-normalise."""
    parts = _guard(lambda: parse_weight(weight))
    seconds = _guard(lambda: cliargs.parse_duration(ttl, "--ttl", zero_ok=True, whole=True))
    if reason_words:
        reason = " ".join([reason, _words_after_reason(ctx, reason_words)])
    o = _ctx(ctx).call(
        "SetOverride",
        control_plane_pb2.SetOverrideRequest(
            shard_id=shard_id, weight=parts, ttl_seconds=int(seconds), reason=reason
        ),
    )
    _say(f"override {o.shard_id} = {o.weight} parts, expires {_ts(o.expires_at)}")


@override_app.command("clear", epilog=_example("adapterctl override clear s0"))
def override_clear(
    ctx: typer.Context, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Remove a shard's override."""
    _ctx(ctx).call("ClearOverride", control_plane_pb2.ClearOverrideRequest(shard_id=shard_id))
    _say(f"override on {shard_id} cleared")


OVERRIDE_COLUMNS = (
    Column("SHARD", "shard"),
    Column("WEIGHT", "weight"),
    Column("EXPIRES", "expires", lambda r: _shown_time(r, "expires")),
    Column("REASON", "reason"),
    Column("CREATED", "created", lambda r: _shown_time(r, "created"), wide=True),
)


@override_app.command("list", epilog=_example("adapterctl override list -o json"))
def override_list(ctx: typer.Context, output: OutputOption = "table") -> None:
    """List active overrides.

    -o json|yaml: a list of {shard, weight (parts per 10,000), expires, reason, created};
    times are RFC 3339, null when unset."""
    fmt = _format(output)
    resp = _ctx(ctx).call("ListOverrides", control_plane_pb2.ListOverridesRequest())
    rows = [
        {
            "shard": o.shard_id,
            "weight": o.weight,
            "expires": _when(o.expires_at),
            "reason": o.reason,
            "created": _when(o.created_at),
        }
        for o in resp.overrides
    ]
    print_tables([Listing(OVERRIDE_COLUMNS, rows)], fmt, rows)


@app.command("pin", epilog=_example("adapterctl pin 10.8.0.0/16 web"))
def pin_cmd(
    ctx: typer.Context, cidr: str, shard_id: Annotated[str, typer.Argument(metavar="SHARD")]
) -> None:
    """Pin a tenant CIDR to a shard (the longest prefix wins)."""
    p = _ctx(ctx).call(
        "PinTenant", control_plane_pb2.PinTenantRequest(cidr=cidr, shard_id=shard_id)
    )
    _say(f"pinned {p.cidr} -> {p.shard_id}")


@app.command("unpin", epilog=_example("adapterctl unpin 10.8.0.0/16"))
def unpin_cmd(ctx: typer.Context, cidr: str) -> None:
    """Remove a tenant pin."""
    _ctx(ctx).call("UnpinTenant", control_plane_pb2.UnpinTenantRequest(cidr=cidr))
    _say(f"unpinned {cidr}")


@rules_app.command(
    "apply",
    epilog=_example('adapterctl rules apply -f rules.yaml --reason "gold tier to its shard"'),
)
def rules_apply_cmd(
    ctx: typer.Context,
    file: Annotated[Path, typer.Option("-f", "--file", help="rule set YAML ('-': stdin)")],
    reason: Annotated[
        str, typer.Option(help="why, kept in the history")
    ] = "adapterctl rules apply",
) -> None:
    """Apply a routing-rule set; a bad rule is refused with its name and position."""
    text = _guard(lambda: _read_text(file, "-f"))
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        _die(_yaml_error(f"-f {file}", exc), 2)
    resp = _ctx(ctx).call(
        "ApplyRules",
        control_plane_pb2.ApplyRulesRequest(document_json=json.dumps(document), reason=reason),
    )
    r = resp.rule_set
    what = "unchanged" if resp.unchanged else "applied"
    _say(f"rules v{r.version} {what} ({r.rules} rules)")


RULES_COLUMNS = (
    Column("VERSION", "version"),
    Column("RULES", "rules"),
    Column("CREATED", "created", lambda r: _shown_time(r, "created")),
    Column("REASON", "reason"),
)


@rules_app.command("list", epilog=_example("adapterctl rules list --limit 5 -o json"))
def rules_list_cmd(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="how many versions")] = 20,
    output: OutputOption = "table",
) -> None:
    """Rule set versions, newest first (the first row is live).

    -o json|yaml: a list of {version, rules (how many), created, reason}."""
    fmt = _format(output)
    resp = _ctx(ctx).call("ListRules", control_plane_pb2.ListRulesRequest(limit=limit))
    rows = [
        {
            "version": r.version,
            "rules": r.rules,
            "created": _when(r.created_at),
            "reason": r.reason,
        }
        for r in resp.rule_sets
    ]
    print_tables([Listing(RULES_COLUMNS, rows)], fmt, rows)


@rules_app.command("get", epilog=_example("adapterctl rules get --version 3 > rules-v3.yaml"))
def rules_get_cmd(
    ctx: typer.Context,
    version: Annotated[int, typer.Option(help="this version (0: the live one)")] = 0,
    output: OutputOption = "table",
) -> None:
    """A rule set as YAML (default: the live one), headed by a comment with its version.

    -o json|yaml: {version, rules, created, reason, document (the rule set)}."""
    fmt = _format(output)
    r = _ctx(ctx).call("GetRules", control_plane_pb2.GetRulesRequest(version=version))
    document = json.loads(r.document_json)
    if fmt in ("json", "yaml"):
        print_payload(
            {
                "version": r.version,
                "rules": r.rules,
                "created": _when(r.created_at),
                "reason": r.reason,
                "document": document,
            },
            fmt,
        )
        return
    _say(f"# rules v{r.version}: {r.reason}")
    _say(yaml.safe_dump(document, sort_keys=False))


_ROLLOUT_STATES = {
    control_plane_pb2.ROLLOUT_STATE_RUNNING: "RUNNING",
    control_plane_pb2.ROLLOUT_STATE_PAUSED: "PAUSED",
    control_plane_pb2.ROLLOUT_STATE_COMPLETED: "COMPLETED",
    control_plane_pb2.ROLLOUT_STATE_ROLLED_BACK: "ROLLED_BACK",
    control_plane_pb2.ROLLOUT_STATE_ABORTED: "ABORTED",
}

ROLLOUT_COLUMNS = (
    Column("ADAPTER", "adapter"),
    Column("FROM", "from", lambda r: r["from"] or "(unversioned)"),
    Column("TO", "to"),
    Column("STATE", "state"),
    Column("STEP", "step", lambda r: f"{r['step']}/{len(r['steps_percent'])}"),
    Column("SHARE", "share_percent", lambda r: f"{r['share_percent']:g}%"),
    Column("REQS", "requests"),
    Column("ERRORS", "errors"),
    Column(
        "P95 TTFT",
        "p95_ttft_ms",
        lambda r: "-" if r["p95_ttft_ms"] is None else f"{r['p95_ttft_ms']:.0f} ms",
    ),
    Column("REASON", "reason"),
    Column("ID", "id", wide=True),
    Column("STEPS", "steps_percent", lambda r: ",".join(map(str, r["steps_percent"])), wide=True),
    Column("INTERVAL", "interval_s", lambda r: f"{r['interval_s']}s", wide=True),
    Column(
        "MAX ERR",
        "max_error_rate",
        lambda r: f"{r['max_error_rate']:.2%}" if r["max_error_rate"] else "-",
        wide=True,
    ),
    Column(
        "MAX P95",
        "max_p95_ttft_ms",
        lambda r: f"{r['max_p95_ttft_ms']:g} ms" if r["max_p95_ttft_ms"] else "-",
        wide=True,
    ),
    Column("MIN REQS", "min_requests", wide=True),
    Column("CREATED", "created", lambda r: _shown_time(r, "created"), wide=True),
    Column("STEP STARTED", "step_started", lambda r: _shown_time(r, "step_started"), wide=True),
)

EVENT_COLUMNS = (
    Column("AT", "at", lambda r: _shown_time(r, "at")),
    Column("ADAPTER", "adapter"),
    Column("TO", "to"),
    Column("EVENT", "event"),
    Column("SHARE", "share_percent", lambda r: f"{r['share_percent']:g}%"),
    Column("REASON", "reason"),
)


def _percent(parts: int) -> int | float:
    """A rollout's share (parts per 10,000 on the wire) in percent, the unit of --steps, of
    steps_percent and of every line adapterctl prints: 5000 -> 50, 1250 -> 12.5."""
    value = parts / 100
    return int(value) if value.is_integer() else value


def _rollout_row(r: control_plane_pb2.Rollout, events: bool = False) -> dict[str, Any]:
    spec = r.spec
    row: dict[str, Any] = {
        "adapter": spec.adapter,
        "from": spec.from_version,
        "to": spec.to_version,
        "state": _ROLLOUT_STATES.get(r.state, "?"),
        "step": r.step + 1,
        "share_percent": _percent(r.share),
        "requests": r.window_requests,
        "errors": r.window_errors,
        "p95_ttft_ms": r.window_p95_ttft_ms if r.window_requests else None,
        "reason": r.reason,
        "id": r.id,
        "steps_percent": list(spec.steps_percent),
        "interval_s": spec.interval_seconds,
        "max_error_rate": spec.max_error_rate,
        "max_p95_ttft_ms": spec.max_p95_ttft_ms,
        "min_requests": spec.min_requests,
        "created": _when(r.created_at),
        "step_started": _when(r.step_started_at),
    }
    if events:
        row["events"] = [
            {
                "at": _when(e.at),
                "adapter": spec.adapter,
                "to": spec.to_version,
                "event": e.kind,
                "share_percent": _percent(e.share),
                "reason": e.reason,
            }
            for e in r.events
        ]
    return row


def _print_rollout(r: control_plane_pb2.Rollout) -> None:
    if r.state == control_plane_pb2.ROLLOUT_STATE_COMPLETED:
        # No split is left to give a share of: the new version is the stable one.
        where = f"{r.spec.to_version} serves everything"
    else:
        where = f"at {r.share / 100:g}%"
    _say(
        f"rollout {r.spec.adapter} -> {r.spec.to_version}: {_ROLLOUT_STATES.get(r.state, '?')} {where}"
    )


@rollout_app.command(
    "start",
    epilog=_example(
        "adapterctl rollout start credit-risk --to 2.0.0 --steps 5,25,50,100 --interval 2m "
        "--max-error-rate 1% --max-p95-ttft 800ms (also: adapterctl rollout credit-risk --to 2.0.0)"
    ),
)
def rollout_start_cmd(
    ctx: typer.Context,
    adapter: Annotated[str, typer.Argument(metavar="ADAPTER")],
    to: Annotated[str, typer.Option("--to", help="the new version")] = "",
    from_version: Annotated[
        str,
        typer.Option("--from", help="the version now serving (default: the adapter's stable one)"),
    ] = "",
    steps: Annotated[
        str, typer.Option(help="canary shares in percent, the last 100")
    ] = "5,25,50,100",
    interval: Annotated[str, typer.Option(help="least time per step (90, 90s, 2m, 1h)")] = "2m",
    max_error_rate: Annotated[
        str, typer.Option(help="roll back above this error rate (1%; 0: none)")
    ] = "0",
    max_p95_ttft: Annotated[
        str, typer.Option(help="roll back above this p95 TTFT (800ms, 1.5s; 0: none)")
    ] = "0",
    min_requests: Annotated[
        int, typer.Option(help="requests of the new version a step needs")
    ] = 20,
    reason: Annotated[str, typer.Option(help="why; recorded with the rollout")] = "",
) -> None:
    """Start a gray release of an adapter version by traffic share, promoted step by step and
    rolled back when the new version breaks a bound."""
    c = _ctx(ctx)
    if not to:
        _die("--to: the new version is required", 2)

    def spec() -> control_plane_pb2.RolloutSpec:
        seconds = cliargs.parse_duration(interval, "--interval", whole=True)
        return control_plane_pb2.RolloutSpec(
            adapter=adapter,
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
    _say(
        f"rollout {r.spec.adapter} {r.spec.from_version or '(unversioned)'} -> "
        f"{r.spec.to_version} started at {r.share / 100:g}% (id {r.id})"
    )


def _control(ctx: typer.Context, adapter: str, action: str, reason: str) -> None:
    r = _ctx(ctx).call(
        "ControlRollout",
        control_plane_pb2.ControlRolloutRequest(adapter=adapter, action=action, reason=reason),
    )
    _print_rollout(r)


ReasonOption = Annotated[str, typer.Option(help="why; recorded with the rollout")]
AdapterArgument = Annotated[str, typer.Argument(metavar="ADAPTER")]


@rollout_app.command("pause", epilog=_example("adapterctl rollout pause credit-risk"))
def rollout_pause_cmd(
    ctx: typer.Context, adapter: AdapterArgument, reason: ReasonOption = ""
) -> None:
    """Hold a rollout's share where it is."""
    _control(ctx, adapter, "pause", reason)


@rollout_app.command("resume", epilog=_example("adapterctl rollout resume credit-risk"))
def rollout_resume_cmd(
    ctx: typer.Context, adapter: AdapterArgument, reason: ReasonOption = ""
) -> None:
    """Resume a paused rollout (its step starts over)."""
    _control(ctx, adapter, "resume", reason)


@rollout_app.command("promote", epilog=_example("adapterctl rollout promote credit-risk"))
def rollout_promote_cmd(
    ctx: typer.Context, adapter: AdapterArgument, reason: ReasonOption = ""
) -> None:
    """Promote a rollout now, skipping its remaining steps: the new version serves everything."""
    _control(ctx, adapter, "promote", reason)


@rollout_app.command("abort", epilog=_example("adapterctl rollout abort credit-risk"))
def rollout_abort_cmd(
    ctx: typer.Context, adapter: AdapterArgument, reason: ReasonOption = ""
) -> None:
    """Abort a rollout: the old version serves everything again."""
    _control(ctx, adapter, "abort", reason)


@rollout_app.command("status", epilog=_example("adapterctl rollout status credit-risk -o json"))
def rollout_status_cmd(
    ctx: typer.Context,
    adapter: Annotated[str, typer.Argument(metavar="ADAPTER", show_default=False)] = "",
    output: OutputOption = "table",
) -> None:
    """Rollouts (all, or one adapter's): state, step, share, this step's requests, errors
    and p95 TTFT.

    -o json|yaml: a list of {adapter, from, to, state, step (1-based), share_percent (the new
    version's, in percent like steps_percent), requests, errors, p95_ttft_ms, reason, id,
    steps_percent, interval_s, max_error_rate, max_p95_ttft_ms, min_requests, created, step_started}."""
    fmt = _format(output)
    resp = _ctx(ctx).call("ListRollouts", control_plane_pb2.ListRolloutsRequest(adapter=adapter))
    rows = [_rollout_row(r) for r in resp.rollouts]
    print_tables([Listing(ROLLOUT_COLUMNS, rows, title="rollouts")], fmt, rows)


@rollout_app.command("history", epilog=_example("adapterctl rollout history credit-risk"))
def rollout_history_cmd(
    ctx: typer.Context, adapter: AdapterArgument, output: OutputOption = "table"
) -> None:
    """An adapter's rollouts, past ones included, and every event of each.

    -o json|yaml: the list rollout status prints, newest first, each with events (newest
    first) [{at, adapter, to, event, share_percent, reason}]."""
    fmt = _format(output)
    resp = _ctx(ctx).call(
        "ListRollouts", control_plane_pb2.ListRolloutsRequest(adapter=adapter, history=True)
    )
    # Newest first, as `adapterctl history` lists Assignments (the API answers oldest first).
    rows = [_rollout_row(r, events=True) for r in reversed(resp.rollouts)]
    for row in rows:
        row["events"].reverse()
    events = sorted(
        (e for row in rows for e in row["events"]), key=lambda e: e["at"] or "", reverse=True
    )
    print_tables(
        [
            Listing(ROLLOUT_COLUMNS, rows, title="rollouts"),
            Listing(EVENT_COLUMNS, events, title="events"),
        ],
        fmt,
        rows,
    )


STATUS_COLUMNS = (
    Column("SHARD", "shard"),
    Column("STATE", "state"),
    Column("WEIGHT", "weight", _pct("weight")),
    Column("UTIL", "utilization", lambda r: _known(r, "utilization", "{:.2f}", "unknown")),
    Column("QUEUE", "queue_depth", lambda r: _known(r, "queue_depth", "{:.0f}")),
    Column("RUNNING", "running", lambda r: _known(r, "running", "{:.0f}")),
    Column("TTFT ms", "ttft_ms", lambda r: _known(r, "ttft_ms", "{:.0f}")),
    Column("TOK/s", "tokens_per_s", lambda r: _known(r, "tokens_per_s", "{:.0f}")),
    Column("KV", "kv_cache_usage", lambda r: _known(r, "kv_cache_usage", "{:.0%}")),
    Column(
        "WORKERS",
        "workers",
        lambda r: f"{'?' if r['workers_known'] is None else r['workers_known']}/{r['workers']}",
    ),
    Column("LOAD AGE s", "load_age_s", lambda r: _known(r, "load_age_s", "{:.1f}"), wide=True),
    Column(
        "FREE GPU GiB",
        "free_gpu_bytes",
        lambda r: _known(r, "free_gpu_bytes", "{:.1f}", scale=2**-30),
        wide=True,
    ),
    Column(
        "ENDPOINTS",
        "endpoints",
        lambda r: ", ".join(r["endpoints"]) or "-",
        wide=True,
    ),
)

NODE_COLUMNS = (
    Column("NODE", "node"),
    Column("STATE", "state"),
    Column("APPLIED", "applied_version"),
    Column("LAG", "lag"),
    Column("LAST REPORT", "last_report", lambda r: _shown_time(r, "last_report")),
    Column("ERROR", "error"),
)


def _known(
    row: dict[str, Any], key: str, pattern: str, unknown: str = "-", scale: float = 1.0
) -> str:
    value = row.get(key)
    if not row.get("known") or value is None:
        return unknown
    return pattern.format(value * scale)


def _status_listing(st: control_plane_pb2.StatusResponse) -> Listing:
    a = st.assignment
    return Listing(
        STATUS_COLUMNS,
        _status_rows(st),
        title=f"assignment v{a.version} at {_ts(a.generated_at)}: {a.reason}",
    )


def _status_rows(st: control_plane_pb2.StatusResponse) -> list[dict[str, Any]]:
    loads = {ld.shard_id: ld for ld in st.loads}
    rows = []
    for s in st.assignment.shards:
        ld = loads.get(s.id)
        known = ld is not None and ld.known
        row: dict[str, Any] = {
            "shard": s.id,
            "state": _state(s.state),
            "weight": s.weight,
            "known": known,
            "utilization": ld.utilization if known and ld else None,
            "queue_depth": ld.queue_depth if known and ld else None,
            "running": ld.running if known and ld else None,
            "ttft_ms": ld.latency_ms if known and ld else None,
            "tokens_per_s": ld.tokens_per_s if known and ld else None,
            "kv_cache_usage": ld.kv_cache_usage if known and ld else None,
            "workers": ld.workers if ld else len(s.endpoints),
            "workers_known": ld.workers_known if ld else None,
            "load_age_s": ld.age_s if known and ld else None,
            "free_gpu_bytes": ld.free_gpu_bytes if known and ld else None,
            "endpoints": [f"{e.address}:{e.port}" for e in s.endpoints],
        }
        rows.append(row)
    return rows


def node_state(n: control_plane_pb2.NodeStatus, version: int) -> str:
    """DEGRADED: the node refused an Assignment and serves an older one; LAGGING: it has not
    applied the newest yet; OK otherwise."""
    if n.apply_error:
        return "DEGRADED"
    return "LAGGING" if n.applied_version < version else "OK"


def _nodes_listing(st: control_plane_pb2.StatusResponse) -> Listing:
    rows = [
        {
            "node": n.node_id,
            "state": node_state(n, st.assignment.version),
            "applied_version": n.applied_version,
            "lag": st.assignment.version - n.applied_version,
            "last_report": _when(n.last_report),
            "error": n.apply_error,
        }
        for n in st.nodes
    ]
    styles = ["" if row["state"] == "OK" else "red" for row in rows]
    return Listing(NODE_COLUMNS, rows, title="nodes", styles=styles)


@app.command(
    "status", epilog=_example("adapterctl status", "adapterctl status -o json | jq '.nodes'")
)
def status_cmd(ctx: typer.Context, output: OutputOption = "table") -> None:
    """Weights, loads, and the version each node applied (lagging nodes show in red).

    -o json|yaml: {assignment: {version, generated, reason}, shards: [{shard, state, weight
    (parts per 10,000), known, utilization, queue_depth, running, ttft_ms, tokens_per_s,
    kv_cache_usage, workers, workers_known, load_age_s, free_gpu_bytes, endpoints}], nodes:
    [{node, state, applied_version, lag, last_report, error}], rollouts: [as rollout status]};
    a load the control plane does not know is null."""
    fmt = _format(output)
    st = _ctx(ctx).call("GetStatus", control_plane_pb2.GetStatusRequest())
    rollouts = _ctx(ctx).call("ListRollouts", control_plane_pb2.ListRolloutsRequest())
    shards = _status_listing(st)
    nodes = _nodes_listing(st)
    rollout_rows = [_rollout_row(r) for r in rollouts.rollouts]
    a = st.assignment
    payload = {
        "assignment": {
            "version": a.version,
            "generated": _when(a.generated_at),
            "reason": a.reason,
        },
        "shards": shards.rows,
        "nodes": nodes.rows,
        "rollouts": rollout_rows,
    }
    print_tables(
        [
            shards,
            nodes,
            Listing(ROLLOUT_COLUMNS, rollout_rows, title="rollouts") if rollout_rows else None,
        ],
        fmt,
        payload,
    )


@app.command("watch", epilog=_example("adapterctl watch --count 5 -o json"))
def watch_cmd(
    ctx: typer.Context,
    from_version: Annotated[int, typer.Option(help="resume after this version")] = 0,
    count: Annotated[int, typer.Option(help="stop after this many Assignments (0: never)")] = 0,
    output: OutputOption = "table",
) -> None:
    """Live table of Assignments as they are published.

    -o json: one line per Assignment ({version, generated, reason, shards: as status});
    -o yaml: one document per Assignment."""
    fmt = _format(output)
    if from_version < 0 or count < 0:
        _die("--from-version and --count must be >= 0", 2)
    c = _ctx(ctx)
    stream = c.stub.WatchAssignments(
        control_plane_pb2.WatchAssignmentsRequest(from_version=from_version, node_id="adapterctl"),
        metadata=c.metadata,
    )
    console = stdout_console()
    seen = 0
    live: Live | None = None
    try:
        if fmt in ("table", "wide"):
            live = Live(
                Table(), console=console, auto_refresh=False, transient=not console.is_terminal
            )
            live.start()
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
            if live is not None:
                live.update(_status_listing(st).table(wide=fmt == "wide"), refresh=True)
                if not console.is_terminal:
                    console.print(f"v{a.version} {a.reason}", highlight=False, markup=False)
            else:
                payload = {
                    "version": a.version,
                    "generated": _when(a.generated_at),
                    "reason": a.reason,
                    "shards": _status_rows(st),
                }
                if fmt == "json":
                    sys.stdout.write(json.dumps(payload) + "\n")
                else:
                    sys.stdout.write(yaml.safe_dump(payload, sort_keys=False, explicit_start=True))
                sys.stdout.flush()
            seen += 1
            if count and seen >= count:
                stream.cancel()
                break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            _die(f"WatchAssignments: {exc.code().name}: {exc.details()}", _EXIT.get(exc.code(), 1))
    except KeyboardInterrupt:
        stream.cancel()
    finally:
        if live is not None:
            live.stop()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], grpc.RpcError)  # type: ignore[arg-type]


HISTORY_COLUMNS = (
    Column("VERSION", "version"),
    Column("GENERATED", "generated", lambda r: _shown_time(r, "generated")),
    Column("WEIGHTS", "weights", lambda r: " ".join(f"{k}={v}" for k, v in r["weights"].items())),
    Column("REASON", "reason"),
    Column("SHARDS", "shards", wide=True),
)


AUDIT_COLUMNS = (
    Column("SEQ", "seq"),
    Column("AT", "at", lambda r: _shown_time(r, "at")),
    Column("CALLER", "caller"),
    Column("METHOD", "method"),
    Column("OUTCOME", "outcome"),
    Column("CHANGE", "change"),
    Column("MESSAGE", "message", wide=True),
)


def _audit_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What changed, one ``object: before -> after`` per object that differs."""
    if before.get("truncated") or after.get("truncated"):
        return "(too large to show; -o json has the digests)"

    def show(value: Any) -> str:
        return "-" if value is None else json.dumps(value, sort_keys=True)

    parts = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old != new:
            parts.append(f"{name}: {show(old)} -> {show(new)}")
    return "; ".join(parts) or "-"


def _audit_rows(c: Ctx, limit: int, before: int) -> list[dict[str, Any]]:
    resp = c.call("ListAudit", control_plane_pb2.ListAuditRequest(limit=limit, before_seq=before))
    rows = []
    for r in resp.records:
        old = json.loads(r.before_json or "{}")
        new = json.loads(r.after_json or "{}")
        rows.append(
            {
                "seq": r.seq,
                "at": _when(r.at),
                "caller": r.caller,
                "method": r.method,
                "outcome": r.outcome,
                "message": r.message,
                "change": _audit_change(old, new),
                "before": old,
                "after": new,
            }
        )
    return rows


@app.command(
    "history",
    epilog=_example(
        "adapterctl history --limit 5 -o json", "adapterctl history --audit --limit 20"
    ),
)
def history_cmd(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="how many versions (audit records)")] = 20,
    before: Annotated[int, typer.Option(help="only versions (audit records) below this one")] = 0,
    audit: Annotated[
        bool,
        typer.Option("--audit", help="list the audit of writes (who, when, what changed) instead"),
    ] = False,
    output: OutputOption = "table",
) -> None:
    """Published Assignment versions with their reasons, newest first; with --audit, every
    accepted or refused write with its caller.

    -o json|yaml: a list of {version, generated, weights ({shard: parts per 10,000}, shards
    with weight only), reason, shards (how many)}; with --audit, a list of {seq, at, caller,
    method, outcome (OK or the gRPC status), message, change, before, after (the objects the
    call named, before and after it)}."""
    fmt = _format(output)
    if not 0 < limit <= 1000:
        _die(f"--limit: {limit} is not in 1..1000", 2)
    if before < 0:
        _die(f"--before: {before} is negative", 2)
    if audit:
        audit_rows = _audit_rows(_ctx(ctx), limit, before)
        print_tables([Listing(AUDIT_COLUMNS, audit_rows)], fmt, audit_rows)
        return
    resp = _ctx(ctx).call(
        "ListHistory", control_plane_pb2.ListHistoryRequest(limit=limit, before_version=before)
    )
    rows = [
        {
            "version": r.version,
            "generated": _when(r.generated_at),
            "weights": {s.id: s.weight for s in r.assignment.shards if s.weight},
            "reason": r.reason,
            "shards": len(r.assignment.shards),
        }
        for r in resp.records
    ]
    print_tables([Listing(HISTORY_COLUMNS, rows)], fmt, rows)


@app.command(
    "get",
    epilog=_example("adapterctl get all -o yaml > mesh.yaml", "adapterctl get assignment -o json"),
)
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


@app.command(
    "apply",
    epilog=_example(
        "adapterctl apply -f mesh.yaml --dry-run", "adapterctl get all | adapterctl apply -f -"
    ),
)
def apply_cmd(
    ctx: typer.Context,
    filename: Annotated[Path, typer.Option("--filename", "-f", help="YAML file ('-': stdin)")],
    dry_run: Annotated[bool, typer.Option(help="print the diff only")] = False,
) -> None:
    """Make the server match Shard, AdapterInstance, Pin and Override documents; idempotent.

    Every document is validated (fields, duplicates, references to shards) before the plan
    is printed; a refused file changes nothing and says so."""
    c = _ctx(ctx)
    docs = _guard(lambda: _load_documents(filename), NOTHING_APPLIED)
    # Everything validated before anything is printed or sent.
    changes = _guard(lambda: _plan(c, docs), NOTHING_APPLIED)
    console = stdout_console()
    marks = {"create": "[green]+[/green]", "update": "[yellow]~[/yellow]", "unchanged": "="}
    for ch in changes:
        detail = f"  ({escape(ch.detail)})" if ch.detail else ""
        console.print(
            f"{marks[ch.verb]} {escape(ch.kind)}/{escape(ch.name)} {ch.verb}{detail}",
            highlight=False,
        )
    todo = [ch for ch in changes if ch.add is not None]
    if dry_run:
        console.print(f"{len(todo)} change(s) (dry run: nothing sent)")
        return
    if not todo:
        console.print(f"0 change(s) applied, {len(changes)} unchanged")
        return
    # One request, one server-side transaction: every change is made, or none is.
    req = control_plane_pb2.ApplyRequest(
        reason=_guard(lambda: f"apply -f {filename.name}", NOTHING_APPLIED)
    )
    for ch in todo:
        assert ch.add is not None
        ch.add(req)
    resp = c.call("Apply", req, note=NOTHING_APPLIED)
    version = f" (assignment v{resp.version})" if resp.version else ""
    console.print(f"{len(todo)} change(s) applied{version}, {len(changes) - len(todo)} unchanged")


def _paragraphs(text: str) -> str:
    """Help text as typer's rich help shows it well: each paragraph one line (rich wraps it),
    brackets shown literally."""
    return "\n\n".join(escape(" ".join(p.split())) for p in text.split("\n\n") if p.strip())


def _set_help_texts() -> None:
    app.info.help = _paragraphs(__doc__ or "")
    for group in (app, shard_app, override_app, rules_app, rollout_app):
        for info in group.registered_commands:
            if info.help is None and info.callback is not None:
                info.help = _paragraphs(inspect.getdoc(info.callback) or "")


_set_help_texts()

if __name__ == "__main__":
    app()
