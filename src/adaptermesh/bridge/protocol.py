"""Request and reply messages of the MQTT bridge (pure: no I/O, no clock).

A request is one JSON object::

    {"id": "<idempotency key>", "reply_to": "<topic>", "endpoint": "completions",
     "body": {...OpenAI request body...}, "correlation": <any JSON, optional>}

``reply_to`` may instead come from the MQTT v5 Response Topic property (the field wins when
both are set); MQTT v5 Correlation Data is echoed on the reply as a property. Every reply
carries the request's ``id`` so that a consumer can drop the rare duplicate (docs/bridge.md,
"Guarantees")::

    {"id": ..., "ok": true, "status": 200, "endpoint": ..., "response": {...}}
    {"id": ..., "ok": false, "status": 400, "error": {"type", "field", "message"}}

``parse_request`` never raises: a malformed message becomes an ``Invalid`` that names the first
offending field with a JSON-path-like name (``id``, ``body.stream``, ``$`` for the message as a
whole) and keeps what is needed to address an error reply.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptermesh.assignment_rules import MAX_QUOTED, quote

__all__ = [
    "ENDPOINTS",
    "FIELDS",
    "MAX_ID_CHARS",
    "Invalid",
    "Request",
    "answer_reply",
    "error_reply",
    "parse_request",
    "valid_reply_topic",
]

# Request endpoint name -> the mesh's HTTP path.
ENDPOINTS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat.completions": "/v1/chat/completions",
}
FIELDS = ("id", "reply_to", "endpoint", "body", "correlation")
MAX_ID_CHARS = 256
# MQTT topic names are UTF-8 strings of at most 65,535 bytes.
_MAX_TOPIC_BYTES = 65535


@dataclass(frozen=True)
class Request:
    id: str
    reply_to: str
    endpoint: str
    body: dict[str, Any]
    correlation: Any = None
    correlation_data: bytes | None = None

    @property
    def digest(self) -> str:
        """What makes two messages with one id the same request (the reply address and the
        correlation are not part of it: a redelivery carries the same ones anyway)."""
        canonical = json.dumps(
            [self.endpoint, self.body], sort_keys=True, separators=(",", ":"), ensure_ascii=True
        )
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Invalid:
    """A message that is not a valid request; ``reply_to`` is None when no usable reply topic
    was found (the message is then only logged and counted)."""

    field: str
    message: str
    id: str | None = None
    reply_to: str | None = None
    correlation: Any = None
    correlation_data: bytes | None = None


def valid_reply_topic(topic: object, loops_back: Callable[[str], bool]) -> str | None:
    """Why ``topic`` cannot be a reply topic, or None when it can. ``loops_back(topic)`` is
    true when the bridge's own subscription matches it: a reply there would come back as a
    request, and an error reply to that one again, forever."""
    if not isinstance(topic, str):
        return "must be a string"
    if not topic:
        return "must not be empty"
    if len(topic.encode("utf-8", "surrogatepass")) > _MAX_TOPIC_BYTES:
        return f"must be at most {_MAX_TOPIC_BYTES} bytes"
    if any(c in topic for c in "+#\x00"):
        return "must be a topic name, without wildcards (+, #) or NUL"
    if any(_refused_in_topic(c) for c in topic):
        return "must be valid UTF-8 without control characters or non-characters"
    if topic.startswith("$"):
        return "must not start with '$' (broker-reserved topics)"
    if loops_back(topic):
        return "matches the bridge's request topic (the reply would come back as a request)"
    return None


def _refused_in_topic(c: str) -> bool:
    """Code points MQTT says a topic should not hold, which brokers (mosquitto among them)
    answer by closing the connection: a reply published to such a topic would be resent on
    every reconnect and cut the bridge off each time."""
    o = ord(c)
    return (
        o <= 0x1F
        or 0x7F <= o <= 0x9F
        or 0xD800 <= o <= 0xDFFF
        or 0xFDD0 <= o <= 0xFDEF
        or (o & 0xFFFE) == 0xFFFE
    )


def _valid_id(value: object) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_CHARS:
        return f"must have at most {MAX_ID_CHARS} characters, got {len(value)}"
    if any(ord(c) < 0x20 or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        return "must not contain control characters or lone surrogates"
    return None


def parse_request(
    payload: bytes,
    *,
    loops_back: Callable[[str], bool],
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
    max_bytes: int = 1 << 20,
) -> Request | Invalid:
    """The request in ``payload``, or the first reason it is not one."""
    fallback = response_topic if valid_reply_topic(response_topic, loops_back) is None else None

    def bad(field: str, message: str, **found: Any) -> Invalid:
        return Invalid(field, message, correlation_data=correlation_data, **found)

    if len(payload) > max_bytes:
        return bad(
            "$",
            f"message is {len(payload)} bytes, over the limit of {max_bytes}",
            reply_to=fallback,
        )
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return bad("$", f"must be a UTF-8 JSON object ({type(exc).__name__})", reply_to=fallback)
    if not isinstance(doc, dict):
        return bad("$", f"must be a JSON object, got {type(doc).__name__}", reply_to=fallback)

    # What an error reply needs, taken before anything else is checked.
    raw_id = doc.get("id")
    found: dict[str, Any] = {
        "id": raw_id if _valid_id(raw_id) is None else None,
        "correlation": doc.get("correlation"),
        "reply_to": fallback,
    }
    if "reply_to" in doc and valid_reply_topic(doc["reply_to"], loops_back) is None:
        found["reply_to"] = doc["reply_to"]

    for key in doc:
        if key not in FIELDS:
            name = str(key) if len(str(key)) <= MAX_QUOTED else quote(str(key))
            return bad(name, f"unknown field (a request has {', '.join(FIELDS)})", **found)
    if "id" not in doc:
        return bad("id", "is required (the idempotency key)", **found)
    if (why := _valid_id(raw_id)) is not None:
        return bad("id", why, **found)
    if "reply_to" in doc:
        if (why := valid_reply_topic(doc["reply_to"], loops_back)) is not None:
            return bad("reply_to", why, **found)
        reply_to: str = doc["reply_to"]
    elif fallback is not None:
        reply_to = fallback
    else:
        why = "is required (or the MQTT v5 Response Topic property)"
        if response_topic is not None:
            why = f"is required; the Response Topic property {valid_reply_topic(response_topic, loops_back)}"
        return bad("reply_to", why, **found)
    endpoint = doc.get("endpoint")
    if endpoint is None:
        return bad("endpoint", f"is required: one of {', '.join(ENDPOINTS)}", **found)
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        return bad(
            "endpoint", f"must be one of {', '.join(ENDPOINTS)}, got {quote(endpoint)}", **found
        )
    body = doc.get("body")
    if body is None:
        return bad("body", "is required (the OpenAI request body)", **found)
    if not isinstance(body, dict):
        return bad("body", f"must be a JSON object, got {type(body).__name__}", **found)
    if body.get("stream") not in (None, False):
        return bad(
            "body.stream",
            "streaming is not available over the bridge (one reply per "
            "request); leave it out or set false",
            **found,
        )
    assert isinstance(raw_id, str)
    return Request(
        id=raw_id,
        reply_to=reply_to,
        endpoint=endpoint,
        body=body,
        correlation=doc.get("correlation"),
        correlation_data=correlation_data,
    )


def _dump(doc: dict[str, Any]) -> bytes:
    # ASCII with escapes: a lone surrogate from the request's JSON stays valid on the wire.
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def _head(req_id: str | None, correlation: Any) -> dict[str, Any]:
    head: dict[str, Any] = {"id": req_id}
    if correlation is not None:
        head["correlation"] = correlation
    return head


def answer_reply(req_id: str, correlation: Any, endpoint: str, status: int, response: Any) -> bytes:
    """The reply for a request the mesh answered with 2xx."""
    return _dump(
        {
            **_head(req_id, correlation),
            "ok": True,
            "status": status,
            "endpoint": endpoint,
            "response": response,
        }
    )


def error_reply(
    req_id: str | None,
    correlation: Any,
    *,
    status: int,
    kind: str,
    message: str,
    field: str | None = None,
    response: Any = None,
) -> bytes:
    """The reply for a request that failed: ``kind`` is ``invalid_request`` (the message),
    ``conflict`` (an id reused for a different request), ``mesh_error`` (the mesh refused it;
    ``response`` holds the mesh's body) or ``mesh_unavailable`` (retries ran out)."""
    error: dict[str, Any] = {"type": kind, "message": message}
    if field is not None:
        error["field"] = field
    doc = {**_head(req_id, correlation), "ok": False, "status": status, "error": error}
    if response is not None:
        doc["response"] = response
    return _dump(doc)
