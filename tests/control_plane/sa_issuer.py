"""A stand-in for a cluster's service-account issuer: keys the tests generate, the JWKS the
control plane verifies against, and projected-token-shaped JWTs signed with those keys."""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

ISSUER = "https://kubernetes.default.svc.cluster.local"
NAMESPACE = "adaptermesh"
SERVICE_ACCOUNT = "am-agent"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _uint(n: int, size: int | None = None) -> str:
    return b64url(n.to_bytes(size or (n.bit_length() + 7) // 8, "big"))


@functools.cache
def _rsa_key(seed: str) -> rsa.RSAPrivateKey:
    # One key per name for the whole run (2048-bit generation takes ~0.1 s).
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@functools.cache
def _ec_key(seed: str) -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


class SigningKey:
    """``seed`` names the key material (a forger's key reuses the real key's kid)."""

    def __init__(self, kid: str, kind: str = "RSA", seed: str | None = None) -> None:
        self.kid = kid
        self.kind = kind
        self.seed = seed or kid
        self.alg = "RS256" if kind == "RSA" else "ES256"

    def jwk(self) -> dict[str, str]:
        if self.kind == "RSA":
            numbers = _rsa_key(self.seed).public_key().public_numbers()
            return {
                "kty": "RSA",
                "kid": self.kid,
                "use": "sig",
                "alg": "RS256",
                "n": _uint(numbers.n),
                "e": _uint(numbers.e),
            }
        pub = _ec_key(self.seed).public_key().public_numbers()
        return {
            "kty": "EC",
            "kid": self.kid,
            "use": "sig",
            "crv": "P-256",
            "x": _uint(pub.x, 32),
            "y": _uint(pub.y, 32),
        }

    def sign(self, data: bytes) -> bytes:
        if self.kind == "RSA":
            return _rsa_key(self.seed).sign(data, padding.PKCS1v15(), hashes.SHA256())
        r, s = decode_dss_signature(_ec_key(self.seed).sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def jwks(*keys: SigningKey) -> str:
    return json.dumps({"keys": [k.jwk() for k in keys]})


def claims(
    now: float,
    *,
    node: str | None = "node-a",
    iss: str = ISSUER,
    aud: Any = ("adaptermesh",),
    lifetime: float = 600,
    age: float = 0,
    namespace: str = NAMESPACE,
    service_account: str = SERVICE_ACCOUNT,
) -> dict[str, Any]:
    """A projected token's claims as kube-apiserver writes them, issued ``age`` s ago."""
    iat = int(now - age)
    k8s: dict[str, Any] = {
        "namespace": namespace,
        "pod": {"name": "am-agent-x1", "uid": "p-1"},
        "serviceaccount": {"name": service_account, "uid": "s-1"},
    }
    if node is not None:
        k8s["node"] = {"name": node, "uid": "n-1"}
    return {
        "iss": iss,
        "aud": list(aud) if not isinstance(aud, str) else aud,
        "sub": f"system:serviceaccount:{namespace}:{service_account}",
        "iat": iat,
        "nbf": iat,
        "exp": int(iat + lifetime),
        "kubernetes.io": k8s,
    }


def token(key: SigningKey, body: Mapping[str, Any], *, kid: str | None = None) -> str:
    header = {"alg": key.alg, "kid": key.kid if kid is None else kid, "typ": "JWT"}
    head = b64url(json.dumps(header).encode())
    payload = b64url(json.dumps(dict(body)).encode())
    signed = f"{head}.{payload}".encode()
    return f"{head}.{payload}.{b64url(key.sign(signed))}"
