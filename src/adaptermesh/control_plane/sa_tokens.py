"""Kubernetes ServiceAccount tokens as node credentials, verified offline.

A node agent's pod mounts a projected ServiceAccount token (audience ``adaptermesh``, a few
minutes' lifetime, rotated by the kubelet) and sends it as its bearer token. The control plane
checks it without calling the API server: the signature against the cluster's
service-account issuer keys (a JWKS document in a file, e.g. a Secret filled from
``kubectl get --raw /openid/v1/jwks``; re-read when it changes, so a rotated key is picked up
without a restart), then the claims (``check_claims``, pure): issuer, audience, expiry, a
lifetime no longer than ``max_lifetime_s``, and a subject among the allowed
``namespace:serviceaccount`` pairs. The node name comes from the ``kubernetes.io.node.name``
claim (Kubernetes 1.30+ puts it in tokens bound to a pod); the caller gets ``read,report``
bound to that node. A token without it can read but reports for no node.

RS256/384/512 and ES256/384/512 are accepted (the key types kube-apiserver signs with); RSA
keys shorter than 2048 bits are ignored. Every refusal is UNAUTHENTICATED with a small fixed
reason (the denial counter's label), except a valid token of a service account that is not
allowed, which is PERMISSION_DENIED.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from adaptermesh.control_plane.auth import READ, REPORT, AuthError, Denied, Principal, token_digest

__all__ = [
    "DEFAULT_AUDIENCE",
    "JwksFile",
    "ServiceAccountPolicy",
    "ServiceAccountVerifier",
    "check_claims",
    "parse_allowed",
    "parse_jwks",
]

DEFAULT_AUDIENCE = "adaptermesh"
# Projected tokens last 10 minutes to a few hours; a longer one is a legacy Secret token or
# a leaked long-lived one.
DEFAULT_MAX_LIFETIME_S = 24 * 3600.0
_MAX_TOKEN_BYTES = 16 * 1024
_MIN_RSA_BITS = 2048
_HASHES: Mapping[str, Callable[[], hashes.HashAlgorithm]] = {
    "256": hashes.SHA256,
    "384": hashes.SHA384,
    "512": hashes.SHA512,
}
_CURVES: Mapping[str, tuple[type[ec.EllipticCurve], int, str]] = {
    "P-256": (ec.SECP256R1, 32, "ES256"),
    "P-384": (ec.SECP384R1, 48, "ES384"),
    "P-521": (ec.SECP521R1, 66, "ES512"),
}
_SA_PREFIX = "system:serviceaccount:"


def _unauthenticated(reason: str, message: str, token: str = "") -> Denied:
    caller = f"unverified-token:{token_digest(token)}" if token else "unauthenticated"
    return Denied(grpc.StatusCode.UNAUTHENTICATED, reason, message, caller)


def _b64url(text: str) -> bytes:
    if not isinstance(text, str) or not text.isascii() or "=" in text:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _b64_int(text: Any, where: str) -> int:
    try:
        return int.from_bytes(_b64url(text), "big")
    except (ValueError, binascii.Error):
        raise AuthError(f"{where}: not a base64url integer") from None


@dataclass(frozen=True, slots=True)
class _Key:
    kid: str
    alg: str  # what the key signs with: "RS*" for RSA, "ES256"... for EC
    public: rsa.RSAPublicKey | ec.EllipticCurvePublicKey
    size: int = 0  # EC: bytes per coordinate


def parse_jwks(text: str, source: str = "jwks") -> tuple[_Key, ...]:
    """The signing keys of a JWKS document; AuthError when it lists keys and none is usable
    (an empty list is a valid document: no token verifies until keys arrive)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise AuthError(f"{source}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise AuthError(f"{source}: expected an object with a 'keys' list")
    keys: list[_Key] = []
    for i, jwk in enumerate(doc["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig":
            continue
        kid = jwk.get("kid", "")
        kid = kid if isinstance(kid, str) else ""
        if jwk.get("kty") == "RSA":
            n, e = _b64_int(jwk.get("n"), where + ".n"), _b64_int(jwk.get("e"), where + ".e")
            if n.bit_length() < _MIN_RSA_BITS:
                continue
            keys.append(_Key(kid, "RS", rsa.RSAPublicNumbers(e, n).public_key()))
        elif jwk.get("kty") == "EC" and jwk.get("crv") in _CURVES:
            curve, size, alg = _CURVES[jwk["crv"]]
            x, y = _b64_int(jwk.get("x"), where + ".x"), _b64_int(jwk.get("y"), where + ".y")
            try:
                public = ec.EllipticCurvePublicNumbers(x, y, curve()).public_key()
            except ValueError as exc:
                raise AuthError(f"{where}: {exc}") from None
            keys.append(_Key(kid, alg, public, size))
    if not keys and doc["keys"]:
        raise AuthError(f"{source}: no RSA (2048+ bits) or EC signing keys")
    return tuple(keys)


class JwksFile:
    """The issuer's keys from a file, re-read when it changes (one ``stat`` per token).

    A file that no longer parses is logged and the last good keys kept: a bad edit of the
    Secret must not lock every node out."""

    def __init__(self, path: str | Path, logger: logging.Logger | None = None) -> None:
        self.path = Path(path)
        self.log = logger or logging.getLogger("adaptermesh.control_plane.sa_tokens")
        self._signature: tuple[int, int, int, int] | None = self._stat()
        self._keys = parse_jwks(self.path.read_text(), str(self.path))
        self.reloads = 0
        self.reload_failures = 0
        self._warn_if_empty()

    def _warn_if_empty(self) -> None:
        if not self._keys:
            self.log.warning(
                "JWKS %s holds no keys: no ServiceAccount token verifies until it does "
                "(it is re-read when it changes)",
                self.path,
            )

    def _stat(self) -> tuple[int, int, int, int]:
        st = os.stat(self.path)
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def keys(self) -> tuple[_Key, ...]:
        try:
            signature: tuple[int, int, int, int] | None = self._stat()
        except OSError:
            signature = None
        if signature is not None and signature != self._signature:
            self._signature = signature
            try:
                self._keys = parse_jwks(self.path.read_text(), str(self.path))
            except (OSError, AuthError) as exc:
                self.reload_failures += 1
                self.log.warning("JWKS %s: %s; keeping the last good keys", self.path, exc)
            else:
                self.reloads += 1
                self.log.info("JWKS %s reloaded: %d keys", self.path, len(self._keys))
                self._warn_if_empty()
        return self._keys


def _verify_signature(alg: str, key: _Key, signed: bytes, signature: bytes) -> bool:
    digest = _HASHES[alg[2:]]()
    try:
        if alg.startswith("RS") and isinstance(key.public, rsa.RSAPublicKey):
            key.public.verify(signature, signed, padding.PKCS1v15(), digest)
            return True
        if isinstance(key.public, ec.EllipticCurvePublicKey) and key.alg == alg:
            if len(signature) != 2 * key.size:
                return False
            r = int.from_bytes(signature[: key.size], "big")
            s = int.from_bytes(signature[key.size :], "big")
            key.public.verify(encode_dss_signature(r, s), signed, ec.ECDSA(digest))
            return True
    except InvalidSignature:
        return False
    return False


def decode_verified(token: str, keys: Iterable[_Key]) -> dict[str, Any]:
    """The claims of a JWT whose signature one of ``keys`` verifies; Denied otherwise."""
    if len(token) > _MAX_TOKEN_BYTES:
        raise _unauthenticated("malformed_token", f"token longer than {_MAX_TOKEN_BYTES} bytes")
    parts = token.split(".")
    if len(parts) != 3:
        raise _unauthenticated("malformed_token", "not a JWT (header.payload.signature)", token)
    try:
        header = json.loads(_b64url(parts[0]))
        claims = json.loads(_b64url(parts[1]))
        signature = _b64url(parts[2])
    except (ValueError, binascii.Error):
        raise _unauthenticated(
            "malformed_token", "not a JWT (bad base64url or JSON)", token
        ) from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise _unauthenticated("malformed_token", "JWT header and claims must be objects", token)
    alg = header.get("alg")
    if alg not in ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512"):
        raise _unauthenticated("malformed_token", f"JWT alg {alg!r} is not accepted", token)
    if "crit" in header:
        raise _unauthenticated("malformed_token", "JWT crit headers are not supported", token)
    kid = header.get("kid")
    candidates = [k for k in keys if not isinstance(kid, str) or not kid or k.kid == kid]
    if not candidates:
        raise _unauthenticated("unknown_key", f"no issuer key with kid {kid!r}", token)
    signed = f"{parts[0]}.{parts[1]}".encode()
    if not any(_verify_signature(alg, k, signed, signature) for k in candidates):
        raise _unauthenticated("bad_signature", "token signature does not verify", token)
    return claims


def parse_allowed(items: Iterable[str]) -> frozenset[tuple[str, str]]:
    """``namespace:serviceaccount`` pairs; AuthError naming a bad one."""
    out: set[tuple[str, str]] = set()
    for item in items:
        ns, sep, sa = item.partition(":")
        if not sep or not ns or not sa or ":" in sa:
            raise AuthError(f"{item!r}: expected NAMESPACE:SERVICEACCOUNT")
        out.add((ns, sa))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class ServiceAccountPolicy:
    issuer: str
    allowed: frozenset[tuple[str, str]]
    audience: str = DEFAULT_AUDIENCE
    max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S
    # Clock skew tolerated on exp, nbf and iat.
    leeway_s: float = 30.0
    scopes: frozenset[str] = field(default_factory=lambda: frozenset({READ, REPORT}))

    def validate(self) -> None:
        if not self.issuer:
            raise AuthError("the ServiceAccount token issuer is required")
        if not self.allowed:
            raise AuthError("at least one NAMESPACE:SERVICEACCOUNT must be allowed")
        if not self.audience:
            raise AuthError("the audience must not be empty")
        if not (self.max_lifetime_s > 0 and math.isfinite(self.max_lifetime_s)):
            raise AuthError(f"max lifetime {self.max_lifetime_s} must be > 0")
        if not (0 <= self.leeway_s < 600):
            raise AuthError(f"leeway {self.leeway_s} must be in 0..600 s")


def _number(claims: Mapping[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _unauthenticated("malformed_token", f"claim {name} is not a number")
    return float(value)


def check_claims(claims: Mapping[str, Any], now: float, policy: ServiceAccountPolicy) -> Principal:
    """The caller a verified token's claims name; Denied when they do not hold. Pure."""
    if claims.get("iss") != policy.issuer:
        raise _unauthenticated("wrong_issuer", "token issuer is not the cluster's")
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if policy.audience not in audiences:
        raise _unauthenticated("wrong_audience", f"token audience is not {policy.audience!r}")
    exp, iat, nbf = _number(claims, "exp"), _number(claims, "iat"), _number(claims, "nbf")
    if exp is None or iat is None:
        raise _unauthenticated("malformed_token", "token needs exp and iat claims")
    if now >= exp + policy.leeway_s:
        raise _unauthenticated("expired", "token expired")
    if max(iat, nbf or iat) > now + policy.leeway_s:
        raise _unauthenticated("not_yet_valid", "token is not valid yet")
    if exp - iat > policy.max_lifetime_s:
        raise _unauthenticated(
            "long_lived",
            f"token lifetime {exp - iat:.0f} s is above {policy.max_lifetime_s:.0f} s "
            "(use a projected token with a short expirationSeconds)",
        )
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.startswith(_SA_PREFIX):
        raise _unauthenticated("malformed_token", "token subject is not a service account")
    ns, _, sa = sub[len(_SA_PREFIX) :].partition(":")
    name = f"sa:{ns}/{sa}"
    k8s = claims.get("kubernetes.io")
    node = None
    if isinstance(k8s, dict) and isinstance(k8s.get("node"), dict):
        node = k8s["node"].get("name")
    if isinstance(node, str) and node:
        name += f"@{node}"
    if (ns, sa) not in policy.allowed:
        raise Denied(
            grpc.StatusCode.PERMISSION_DENIED,
            "service_account",
            f"service account {ns}/{sa} may not call the control plane",
            name,
        )
    nodes = frozenset({node}) if isinstance(node, str) and node else frozenset()
    return Principal(name, policy.scopes, nodes)


class ServiceAccountVerifier:
    """``auth.BearerVerifier`` for projected ServiceAccount tokens."""

    def __init__(
        self, jwks: JwksFile, policy: ServiceAccountPolicy, clock: Callable[[], float]
    ) -> None:
        policy.validate()
        self.jwks = jwks
        self.policy = policy
        self.clock = clock

    def accepts(self, token: str) -> bool:
        return token.count(".") == 2 and token.startswith("eyJ")

    def verify(self, token: str) -> Principal:
        claims = decode_verified(token, self.jwks.keys())
        return check_claims(claims, self.clock(), self.policy)
