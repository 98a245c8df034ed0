"""Bearer-token authorisation for the control plane's gRPC API, and TLS credentials.

Tokens file: one token per line, ``TOKEN SCOPES [NAME]``, scopes comma-separated from
``read`` and ``write``; ``#`` starts a comment. For example::

    # operators
    3f9c...e1  read,write  alice
    # node agents: watch Assignments (read) and report load (write)
    77aa...02  read,write  agents

Scopes do not imply each other: an operator who changes state and looks at it needs both.
``ReportLoad`` needs ``write``: a report never changes routing, but each new ``node_id`` is a
row in the control plane's node table, and a read-only token (a dashboard's) must not be able
to grow it. Node agents therefore hold ``read,write`` tokens (as the Helm chart gives them).

A call without a valid ``authorization: Bearer <token>`` gets UNAUTHENTICATED; a valid token
without the method's scope gets PERMISSION_DENIED. Every configured token is compared against
the presented one with ``hmac.compare_digest`` on SHA-256 digests, all of them every time, so
neither the match position nor the token length leaks through timing. Health checking and
reflection need no token (probes and discovery tools carry none).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "READ",
    "SCOPES",
    "WRITE",
    "AuthError",
    "AuthInterceptor",
    "TokenTable",
    "load_tokens",
    "method_scope",
    "server_credentials",
]

READ = "read"
WRITE = "write"
SCOPES = frozenset({READ, WRITE})
_SERVICE = "/adaptermesh.v1.ControlPlane/"
_WRITE_METHODS = frozenset(
    {
        "Apply",
        "UpsertShard",
        "DeleteShard",
        "SetOverride",
        "ClearOverride",
        "PinTenant",
        "UnpinTenant",
        "UpsertAdapterInstance",
        "DeleteAdapterInstance",
        "ApplyRules",
        "StartRollout",
        "ControlRollout",
        # Not a routing change, but it writes a node row (see the module's docstring).
        "ReportLoad",
    }
)
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class AuthError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    scopes: frozenset[str]
    name: str


class TokenTable:
    def __init__(self, entries: Mapping[str, tuple[frozenset[str], str]]) -> None:
        self._entries = tuple(
            _Entry(hashlib.sha256(tok.encode()).digest(), scopes, name)
            for tok, (scopes, name) in entries.items()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> tuple[frozenset[str], str] | None:
        presented = hashlib.sha256(token.encode()).digest()
        found: _Entry | None = None
        for entry in self._entries:
            # No early exit: every entry is compared on every call.
            if hmac.compare_digest(entry.digest, presented):
                found = entry
        return (found.scopes, found.name) if found is not None else None


def load_tokens(path: str | Path) -> TokenTable:
    entries: dict[str, tuple[frozenset[str], str]] = {}
    text = Path(path).read_text()
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise AuthError(f"{path}:{lineno}: expected 'TOKEN SCOPES [NAME]'")
        token, scopes_text = parts[0], parts[1]
        if len(token) < 16:
            raise AuthError(f"{path}:{lineno}: token shorter than 16 characters")
        scopes = frozenset(s.strip() for s in scopes_text.split(",") if s.strip())
        unknown = scopes - SCOPES
        if unknown or not scopes:
            raise AuthError(f"{path}:{lineno}: scopes must be read and/or write, got {scopes_text}")
        if token in entries:
            raise AuthError(f"{path}:{lineno}: duplicate token")
        entries[token] = (scopes, parts[2] if len(parts) == 3 else f"line{lineno}")
    if not entries:
        raise AuthError(f"{path}: no tokens")
    return TokenTable(entries)


def method_scope(method: str) -> str | None:
    """The scope a full method name needs; None for the open services."""
    if method.startswith(_OPEN_PREFIXES):
        return None
    if method.startswith(_SERVICE) and method[len(_SERVICE) :] in _WRITE_METHODS:
        return WRITE
    return READ


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    async def abort(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(abort, **kwargs)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

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
        token = _bearer(handler_call_details.invocation_metadata)
        if token is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        found = self.tokens.lookup(token)
        if found is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        scopes, name = found
        if scope not in scopes:
            return _deny(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"token {name!r} lacks the {scope!r} scope for {method.rsplit('/', 1)[-1]}",
            )
        return handler


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
