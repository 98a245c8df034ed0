"""No key twice in one JSON object: what a context-free grammar cannot say, enforced on the
grammar's next-token mask.

A schema's grammar keeps each listed property to one occurrence, but an object that admits
other keys (``additionalProperties`` not false, ``patternProperties``, ``{"type":
"object"}``) can repeat one (``{"x1":true,"x1":true}``): parsed, the object then loses a
member and may fall below ``minProperties``. For such grammars each sequence carries a
``KeyTracker`` that follows the output byte by byte (the grammar guarantees well-formed JSON
without free whitespace, so a small state machine suffices) and knows the keys of every open
object. ``KeyGuard.restrict`` clears, from a row's mask, each allowed token that would
complete a key its object already has; only tokens holding a ``"`` can, so the work is a
vectorised pick of the allowed quote tokens and a short simulation of each.

A key language can be finite (``patternProperties: {"^x[12]$": ...}``): once ``x1`` and ``x2``
are used, a sequence that writes ``"x`` has no way on. With ``lookahead`` (set when some
object's keys may be finite), a token that leaves the output inside or before a key that
could still become a used one is kept only if a search through the grammar finds a new key
from there (a bounded search; past its budget the token is kept). If nothing is left at all
(a schema that asks for more distinct keys than it admits), the stop token is allowed: the
output ends there, cut, rather than repeat a key.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

__all__ = ["KeyGuard", "KeyTracker", "KeyVocab"]

_VALUE, _KEY, _IN_KEY, _COLON, _IN_STRING, _SCALAR, _AFTER = range(7)
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY = 0x7B, 0x7D, 0x5B, 0x5D
_COMMA, _COLON_BYTE = 0x2C, 0x3A
_SPACE = frozenset(b" \t\r\n")
_SCALAR_END = frozenset(b",}]")
# Matcher states one lookahead may visit before it gives up and keeps the token.
_LOOKAHEAD_BUDGET = 64


class _Duplicate(Exception):
    pass


def _decode_key(raw: bytes) -> str | bytes:
    try:
        value = json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


def _lenient_key(raw: bytes) -> str:
    """The text of a key written so far (a trailing partial escape or UTF-8 sequence off)."""
    for cut in range(len(raw), max(-1, len(raw) - 7), -1):
        try:
            value = json.loads(b'"' + raw[:cut] + b'"')
        except ValueError:
            continue
        if isinstance(value, str):
            return value
    return ""


class KeyTracker:
    """Where a whitespace-free JSON output stands: a stack of open containers (a set of the
    keys written so far per object, None per array), the lexical mode, and the key being
    written. ``feed`` raises nothing; ``try_feed`` says whether bytes would repeat a key."""

    __slots__ = ("buf", "escape", "mode", "stack")

    def __init__(self) -> None:
        self.stack: list[set[str | bytes] | None] = []
        self.mode = _VALUE
        self.buf = b""
        self.escape = False

    def copy(self) -> KeyTracker:
        other = KeyTracker()
        other.stack = list(self.stack)  # frames are copied when a simulation writes to them
        other.mode, other.buf, other.escape = self.mode, self.buf, self.escape
        return other

    @property
    def has_keys(self) -> bool:
        return any(self.stack)

    def feed(self, data: bytes) -> bool:
        """Advance over ``data``; False (and the state undefined) when it repeats a key."""
        try:
            self._run(data, None)
        except _Duplicate:
            return False
        return True

    def simulate(self, data: bytes) -> KeyTracker | None:
        """The state after ``data``, or None when it would repeat a key; self is unchanged."""
        other = self.copy()
        try:
            other._run(data, set())
        except _Duplicate:
            return None
        return other

    def key_could_repeat(self) -> bool:
        """The output is before or inside a key of an object with keys, and the key written
        so far could still become one of them."""
        if not self.stack or not self.stack[-1]:
            return False
        if self.mode == _KEY:
            return True
        if self.mode != _IN_KEY:
            return False
        prefix = _lenient_key(self.buf)
        return any(isinstance(k, str) and k.startswith(prefix) for k in self.stack[-1])

    def _run(self, data: bytes, copied: set[int] | None) -> None:
        stack = self.stack
        mode, buf, escape = self.mode, self.buf, self.escape
        start = 0
        for i, byte in enumerate(data):
            if mode in (_IN_STRING, _IN_KEY):
                # In a string value or a key: only an unescaped quote ends it.
                if escape:
                    escape = False
                elif byte == _BACKSLASH:
                    escape = True
                elif byte == _QUOTE:
                    if mode == _IN_STRING:
                        mode = _AFTER
                        continue
                    key = _decode_key(buf + data[start:i])
                    if stack and stack[-1] is not None:
                        frame = stack[-1]
                        if key in frame:
                            raise _Duplicate
                        if copied is not None and id(frame) not in copied:
                            frame = set(frame)
                            stack[-1] = frame
                            copied.add(id(frame))
                        frame.add(key)
                    mode, buf = _COLON, b""
                continue
            if mode == _SCALAR:
                if byte not in _SCALAR_END:
                    continue
                mode = _AFTER
            if byte in _SPACE:
                continue
            if mode == _VALUE:
                if byte == _OPEN_OBJECT:
                    frame = set()
                    if copied is not None:
                        copied.add(id(frame))
                    stack.append(frame)
                    mode = _KEY
                elif byte == _OPEN_ARRAY:
                    stack.append(None)
                elif byte == _CLOSE_ARRAY:
                    if stack:
                        stack.pop()
                    mode = _AFTER
                elif byte == _QUOTE:
                    mode = _IN_STRING
                else:
                    mode = _SCALAR
            elif mode == _KEY:
                if byte == _QUOTE:
                    mode, buf, start = _IN_KEY, b"", i + 1
                elif byte == _CLOSE_OBJECT:
                    if stack:
                        stack.pop()
                    mode = _AFTER
            elif mode == _COLON:
                if byte == _COLON_BYTE:
                    mode = _VALUE
            elif mode == _AFTER:
                if byte == _COMMA:
                    mode = _KEY if stack and stack[-1] is not None else _VALUE
                elif byte in (_CLOSE_OBJECT, _CLOSE_ARRAY) and stack:
                    stack.pop()
        if mode == _IN_KEY:
            buf += data[start:]
        self.mode, self.buf, self.escape = mode, buf, escape


class KeyVocab:
    """A vocabulary's token bytes, and the tokens that hold a ``"`` (the only ones that can
    complete a key)."""

    def __init__(self, token_bytes: list[bytes], stop_token_ids: list[int]) -> None:
        self.token_bytes = token_bytes
        self.quote_ids = np.array(
            [i for i, data in enumerate(token_bytes) if b'"' in data], dtype=np.int64
        )
        # Tokens that can leave a value for the next key (a comma) or complete a key.
        self.structural_ids = np.array(
            [i for i, data in enumerate(token_bytes) if b'"' in data or b"," in data],
            dtype=np.int64,
        )
        self.all_ids = np.arange(len(token_bytes), dtype=np.int64)
        self.stop_token_ids = stop_token_ids


class KeyGuard:
    """One sequence's key tracking; ``lookahead``: its keys may come from a finite set."""

    __slots__ = ("lookahead", "tracker", "vocab")

    def __init__(self, vocab: KeyVocab, lookahead: bool) -> None:
        self.vocab = vocab
        self.lookahead = lookahead
        self.tracker = KeyTracker()

    def advance(self, token_id: int) -> None:
        if token_id < len(self.vocab.token_bytes):
            self.tracker.feed(self.vocab.token_bytes[token_id])

    def restrict(self, bitmask: torch.Tensor, row: int, matcher: Any) -> None:
        """Clear from row ``row`` of ``bitmask`` ([R, W] int32, host) every allowed token
        that would repeat a key (or, with lookahead, lead where no new key can follow)."""
        tracker = self.tracker
        if not tracker.has_keys:
            return
        words = bitmask[row].numpy().view(np.uint32)
        vocab = self.vocab
        if not self.lookahead:
            ids = vocab.quote_ids
        elif tracker.mode in (_KEY, _IN_KEY):
            ids = vocab.all_ids
        else:
            ids = vocab.structural_ids
        if ids.size == 0:
            return
        ids = ids[ids < words.size * 32]
        allowed = ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]
        cleared = 0
        for token in allowed.tolist():
            after = tracker.simulate(vocab.token_bytes[token])
            keep = after is not None
            if keep and self.lookahead and after is not None and after.key_could_repeat():
                keep = _new_key_reachable(matcher, token, after, vocab, [_LOOKAHEAD_BUDGET])
            if not keep:
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
                cleared += 1
        if cleared and cleared == len(allowed) and not words.any():
            for stop in vocab.stop_token_ids:  # a dead end: end the output, cut
                words[stop >> 5] |= np.uint32(1 << (stop & 31))


def _new_key_reachable(
    matcher: Any, token: int, state: KeyTracker, vocab: KeyVocab, budget: list[int]
) -> bool:
    """Whether, after ``token``, the grammar lets the output complete a key its object does
    not have (searching at most ``budget[0]`` matcher states in all; True past that)."""
    if budget[0] <= 0:
        return True
    budget[0] -= 1
    probe = matcher.deep_copy()
    if not probe.consume_token(token):
        return False
    mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint32)
    limit = min(len(vocab.token_bytes), mask.size * 32)
    ids = np.arange(limit, dtype=np.int64)
    allowed = ids[(mask[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]
    deferred = []
    for nxt in allowed.tolist():
        after = state.simulate(vocab.token_bytes[nxt])
        if after is None:
            continue
        if not after.key_could_repeat():
            return True
        deferred.append((nxt, after))
    for nxt, after in deferred:
        if budget[0] <= 0:
            return True
        if _new_key_reachable(probe, nxt, after, vocab, budget):
            return True
    return False
