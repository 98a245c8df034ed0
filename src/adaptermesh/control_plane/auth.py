"""Who may call the control plane's gRPC API, and TLS credentials.

Scopes (a caller holds a set; none implies another):

- ``read``: every listing, ``GetAssignment``, ``WatchAssignments``, ``GetStatus``,
  ``ListAudit``.
- ``report``: ``ReportLoad`` only, and only for the node names the credential is bound to.
- ``write``: the state changes (shards, overrides, pins, adapter instances, ``Apply``).
- ``rollout``: gray releases and routing rules (``StartRollout``, ``ControlRollout``,
  ``ApplyRules``): what changes which version of an adapter a request reaches.

Node agents hold ``read,report`` bound to their own node, so a compromised node can watch the
mesh and report its own load, and nothing more.

Credentials, tried in this order:

1. A bearer token (``authorization: Bearer <token>``) found in the static tokens file. One
   line per token, ``TOKEN SCOPES [NAME] [nodes=NODE,...]``, scopes comma-separated; ``#``
   starts a comment::

       3f9c...e1  read,write,rollout  alice
       9a0b...77  read                grafana
       77aa...02  read,report         node-a  nodes=node-a

   A ``report`` token must say which nodes it reports for (``nodes=*``: any node, for a
   fleet that still shares one agent token). The file is re-read when it changes (a mounted
   Secret's update included); a file that no longer parses is logged and the last good one
   kept.
2. Any other bearer token that looks like a JWT, when ServiceAccount tokens are enabled
   (``control_plane/sa_tokens.py``): a pod's projected token, verified offline; the node name
   comes from its claims.
3. Without a bearer token, an mTLS client certificate with a SAN ``<node>`` +
   ``cert_san_suffix`` (default ``.node.adaptermesh``): ``read,report`` bound to that node.

No valid credential: UNAUTHENTICATED. A credential without the method's scope, or a report for
a node it is not bound to: PERMISSION_DENIED. Each refusal is counted
(``adaptermesh_cp_denied_total{method,reason}``) and, for a write, audited. Static tokens are
compared with ``hmac.compare_digest`` on SHA-256 digests, every entry on every call, so neither
the match position nor the token length leaks through timing. Health checking and reflection
need no credential (probes and discovery tools carry none).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

__all__ = [
    "ANONYMOUS",
    "AUDITED_METHODS",
    "DEFAULT_CERT_SAN_SUFFIX",
    "METHOD_SCOPES",
    "READ",
    "REPORT",
    "ROLLOUT",
    "SCOPES",
    "WRITE",
    "AuthError",
    "AuthInterceptor",
    "Authenticator",
    "BearerVerifier",
    "CertIdentity",
    "Denied",
    "Principal",
    "TokenFile",
    "TokenTable",
    "current_principal",
    "load_tokens",
    "method_scope",
    "parse_tokens",
    "server_credentials",
    "token_digest",
]

READ = "read"
REPORT = "report"
WRITE = "write"
ROLLOUT = "rollout"
SCOPES = frozenset({READ, REPORT, WRITE, ROLLOUT})
_SERVICE = "/adaptermesh.v1.ControlPlane/"
# Every ControlPlane method and the scope it needs (a test holds this to the service's
# methods). A method missing here needs ``write``: a new call is closed until it is listed.
METHOD_SCOPES: Mapping[str, str] = {
    "ListShards": READ,
    "ListOverrides": READ,
    "ListPins": READ,
    "ListAdapterInstances": READ,
    "GetAssignment": READ,
    "WatchAssignments": READ,
    "ListHistory": READ,
    "GetRules": READ,
    "ListRules": READ,
    "ListRollouts": READ,
    "GetStatus": READ,
    "ListAudit": READ,
    "ReportLoad": REPORT,
    "Apply": WRITE,
    "UpsertShard": WRITE,
    "DeleteShard": WRITE,
    "SetOverride": WRITE,
    "ClearOverride": WRITE,
    "PinTenant": WRITE,
    "UnpinTenant": WRITE,
    "UpsertAdapterInstance": WRITE,
    "DeleteAdapterInstance": WRITE,
    "ApplyRules": ROLLOUT,
    "StartRollout": ROLLOUT,
    "ControlRollout": ROLLOUT,
}
# Calls that leave an audit row (control_plane/audit.py): every write, accepted or refused.
# ReportLoad is audited only when refused (an accepted one is a node's periodic report).
AUDITED_METHODS = frozenset(m for m, s in METHOD_SCOPES.items() if s != READ)
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_MIN_TOKEN = 16
DEFAULT_CERT_SAN_SUFFIX = ".node.adaptermesh"


class AuthError(ValueError):
    """A tokens file, JWKS or policy that cannot be used (at start or on a reload)."""


class Denied(Exception):
    """A refused call: ``code`` is UNAUTHENTICATED or PERMISSION_DENIED, ``reason`` a small
    fixed label (the denial counter's), ``caller`` who asked as far as is known."""

    def __init__(
        self, code: grpc.StatusCode, reason: str, message: str, caller: str = "unauthenticated"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.caller = caller


@dataclass(frozen=True, slots=True)
class Principal:
    """A verified caller. ``nodes``: the node names it may report for; None: any node."""

    name: str
    scopes: frozenset[str]
    nodes: frozenset[str] | None = frozenset()

    def may_report(self, node_id: str) -> bool:
        if REPORT not in self.scopes:
            return False
        return self.nodes is None or node_id in self.nodes


# The caller of a call without authentication (``--no-auth``): every scope, any node.
ANONYMOUS = Principal("anonymous", SCOPES, None)
_PRINCIPAL: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "adaptermesh_principal", default=ANONYMOUS
)


def current_principal() -> Principal:
    """The caller of the RPC being served (set by AuthInterceptor for the call's task)."""
    return _PRINCIPAL.get()


def token_digest(token: str) -> str:
    """A short digest naming a presented token in logs and the audit (never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def method_scope(method: str) -> str | None:
    """The scope a full method name needs; None for the open services."""
    if method.startswith(_OPEN_PREFIXES):
        return None
    if method.startswith(_SERVICE):
        return METHOD_SCOPES.get(method[len(_SERVICE) :], WRITE)
    return READ


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


# -- static tokens -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    principal: Principal


class TokenTable:
    def __init__(self, entries: Mapping[str, Principal]) -> None:
        self._entries = tuple(
            _Entry(hashlib.sha256(tok.encode()).digest(), p) for tok, p in entries.items()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        presented = hashlib.sha256(token.encode()).digest()
        found: _Entry | None = None
        for entry in self._entries:
            # No early exit: every entry is compared on every call.
            if hmac.compare_digest(entry.digest, presented):
                found = entry
        return found.principal if found is not None else None


def _parse_scopes(text: str, where: str) -> frozenset[str]:
    scopes = frozenset(s.strip() for s in text.split(",") if s.strip())
    unknown = scopes - SCOPES
    if unknown or not scopes:
        raise AuthError(
            f"{where}: scopes must be some of {', '.join(sorted(SCOPES))}, got {text!r}"
        )
    return scopes


def parse_tokens(text: str, source: str = "tokens") -> TokenTable:
    """The tokens file's text as a table; AuthError naming the line otherwise."""
    entries: dict[str, Principal] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        parts = line.split()
        if len(parts) < 2:
            raise AuthError(f"{where}: expected 'TOKEN SCOPES [NAME] [nodes=NODE,...]'")
        token, scopes_text, rest = parts[0], parts[1], parts[2:]
        if len(token) < _MIN_TOKEN:
            raise AuthError(f"{where}: token shorter than {_MIN_TOKEN} characters")
        scopes = _parse_scopes(scopes_text, where)
        name: str | None = None
        nodes: frozenset[str] | None = frozenset()
        bound = False
        for item in rest:
            if item.startswith("nodes="):
                if bound:
                    raise AuthError(f"{where}: nodes= given twice")
                bound = True
                listed = [n for n in item[len("nodes=") :].split(",") if n]
                if not listed:
                    raise AuthError(f"{where}: nodes= names no node")
                nodes = None if listed == ["*"] else frozenset(listed)
                if nodes is not None and "*" in nodes:
                    raise AuthError(f"{where}: nodes=* stands alone")
            elif name is None:
                name = item
            else:
                raise AuthError(f"{where}: expected 'TOKEN SCOPES [NAME] [nodes=NODE,...]'")
        if REPORT in scopes and not bound:
            raise AuthError(
                f"{where}: a report token needs nodes=NODE,... (the nodes it reports for; "
                "nodes=* for any node)"
            )
        if bound and REPORT not in scopes:
            raise AuthError(f"{where}: nodes= binds report tokens only; add the report scope")
        if token in entries:
            raise AuthError(f"{where}: duplicate token")
        entries[token] = Principal(f"token:{name or f'line{lineno}'}", scopes, nodes)
    if not entries:
        raise AuthError(f"{source}: no tokens")
    return TokenTable(entries)


def load_tokens(path: str | Path) -> TokenTable:
    return parse_tokens(Path(path).read_text(), str(path))


def _file_signature(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)  # follows symlinks: a Secret volume swaps its ..data link
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class TokenFile:
    """The tokens file, re-read when it changes (checked with one ``stat`` per call).

    A file that cannot be read or parsed after a change is logged and counted
    (``reload_failures``); the last good table stays in force, so a half-written edit never
    locks every caller out."""

    def __init__(self, path: str | Path, logger: logging.Logger | None = None) -> None:
        self.path = Path(path)
        self.log = logger or logging.getLogger("adaptermesh.control_plane.auth")
        self._signature: tuple[int, int, int, int] | None = _file_signature(self.path)
        self._table = load_tokens(self.path)
        self.reloads = 0
        self.reload_failures = 0

    def table(self) -> TokenTable:
        try:
            signature = _file_signature(self.path)
        except OSError as exc:
            if self._signature is not None:
                self.reload_failures += 1
                self.log.warning("tokens file %s: %s; keeping the last good one", self.path, exc)
                self._signature = None
            return self._table
        if signature != self._signature:
            self._signature = signature
            try:
                self._table = load_tokens(self.path)
            except (OSError, AuthError) as exc:
                self.reload_failures += 1
                self.log.warning("tokens file %s: %s; keeping the last good one", self.path, exc)
            else:
                self.reloads += 1
                self.log.info("tokens file %s reloaded: %d tokens", self.path, len(self._table))
        return self._table


# -- other credentials ---------------------------------------------------------------------


class BearerVerifier(Protocol):
    """Verifies a bearer token that is not a static one (sa_tokens.ServiceAccountVerifier)."""

    def accepts(self, token: str) -> bool:
        """Whether the token has this verifier's form (a JWT)."""
        ...

    def verify(self, token: str) -> Principal:
        """The token's caller; Denied otherwise."""
        ...


@dataclass(frozen=True, slots=True)
class CertIdentity:
    """mTLS client certificates as node credentials: a SAN ``<node><suffix>`` binds the node."""

    suffix: str = DEFAULT_CERT_SAN_SUFFIX
    scopes: frozenset[str] = frozenset({READ, REPORT})

    def principal(self, sans: Iterable[str]) -> Principal | None:
        nodes = frozenset(
            s[: -len(self.suffix)]
            for s in sans
            if s.endswith(self.suffix) and len(s) > len(self.suffix)
        )
        if not nodes:
            return None
        return Principal(f"cert:{','.join(sorted(nodes))}", self.scopes, nodes)


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""
    return None


def _sans(context: Any) -> list[str]:
    try:
        auth = context.auth_context() or {}
    except Exception:  # no transport security on this call
        return []
    out: list[str] = []
    for value in auth.get("x509_subject_alternative_name", ()):
        out.append(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
    return out


class Authenticator:
    """A call's credentials to its Principal, or Denied (UNAUTHENTICATED)."""

    def __init__(
        self,
        tokens: TokenTable | TokenFile | None = None,
        bearer: BearerVerifier | None = None,
        certs: CertIdentity | None = None,
    ) -> None:
        self.tokens = tokens
        self.bearer = bearer
        self.certs = certs

    def _table(self) -> TokenTable | None:
        return self.tokens.table() if isinstance(self.tokens, TokenFile) else self.tokens

    def authenticate(self, metadata: Any, context: Any = None) -> Principal:
        token = _bearer(metadata)
        if token == "":
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                "malformed_credentials",
                "authorization metadata is not 'Bearer <token>'",
            )
        if token is not None:
            table = self._table()
            found = table.lookup(token) if table is not None else None
            if found is not None:
                return found
            if self.bearer is not None and self.bearer.accepts(token):
                return self.bearer.verify(token)
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                "unknown_token",
                "unknown bearer token",
                f"unknown-token:{token_digest(token)}",
            )
        if self.certs is not None and context is not None:
            found = self.certs.principal(_sans(context))
            if found is not None:
                return found
        raise Denied(grpc.StatusCode.UNAUTHENTICATED, "missing_credentials", "missing bearer token")


# -- the interceptor -----------------------------------------------------------------------

# (method, caller, the refusal) for every refused call; the server counts and audits it.
DeniedHook = Callable[[str, Denied], None]


def _check_scope(principal: Principal, scope: str, method: str) -> None:
    if scope not in principal.scopes:
        raise Denied(
            grpc.StatusCode.PERMISSION_DENIED,
            "scope",
            f"{principal.name} lacks the {scope!r} scope for {_short(method)}",
            principal.name,
        )


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates each call when it runs (the handler's context carries the peer's
    certificate) and serves it with its Principal as ``current_principal()``."""

    def __init__(
        self,
        authenticator: Authenticator | TokenTable | TokenFile,
        on_denied: DeniedHook | None = None,
    ) -> None:
        if not isinstance(authenticator, Authenticator):
            authenticator = Authenticator(authenticator)
        self.authenticator = authenticator
        self.on_denied = on_denied

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        scope = method_scope(method)
        if handler is None or scope is None:
            return handler
        metadata = handler_call_details.invocation_metadata

        def admit(context: Any) -> Principal:
            principal = self.authenticator.authenticate(metadata, context)
            _check_scope(principal, scope, method)
            return principal

        return _guarded(handler, admit, self._denied(method))

    def _denied(self, method: str) -> Callable[[Denied], None]:
        def hook(denied: Denied) -> None:
            if self.on_denied is not None:
                self.on_denied(_short(method), denied)

        return hook


def _guarded(
    handler: grpc.RpcMethodHandler,
    admit: Callable[[Any], Principal],
    denied: Callable[[Denied], None],
) -> Any:
    async def enter(context: Any) -> contextvars.Token[Principal]:
        try:
            principal = admit(context)
        except Denied as exc:
            denied(exc)
            await context.abort(exc.code, exc.message)
            raise AssertionError("abort returned") from None
        return _PRINCIPAL.set(principal)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            mark = await enter(context)
            try:
                return await inner_uu(request, context)
            finally:
                _PRINCIPAL.reset(mark)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            await enter(context)
            async for item in inner_us(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: Any) -> Any:
            mark = await enter(context)
            try:
                return await inner_su(requests, context)
            finally:
                _PRINCIPAL.reset(mark)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
        await enter(context)
        async for item in inner_ss(requests, context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


def server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS; with ``client_ca_file``, mTLS that requires a client certificate from that CA."""
    cert = Path(cert_file).read_bytes()
    key = Path(key_file).read_bytes()
    ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )
