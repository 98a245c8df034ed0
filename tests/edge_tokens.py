"""Bearer tokens for the edge tests: HS256 JWTs signed with the standard library, and the JWKS
that Envoy verifies them with (``BuildOptions.edge_auth``, the agent's ``--edge-jwks``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

ISSUER = "https://issuer.adaptermesh.test"
KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


JWKS = json.dumps({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": b64url(KEY)}]})


def token(scope: str, *, key: bytes = KEY, iss: str = ISSUER, exp_in: float = 600) -> str:
    """A JWT for ``scope`` (space-separated scopes) from ``iss``, valid for ``exp_in`` s."""
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    claims = {"iss": iss, "sub": "client-1", "scope": scope, "exp": int(time.time() + exp_in)}
    payload = b64url(json.dumps(claims).encode())
    signed = f"{header}.{payload}".encode()
    return f"{header}.{payload}.{b64url(hmac.new(key, signed, hashlib.sha256).digest())}"


def bearer(tok: str) -> dict[str, str]:
    return {"authorization": f"Bearer {tok}"}
