"""Grammar-constrained decoding: what a request may generate, compiled once per request against
the model's vocabulary, and a matcher per engine sequence that says, token by token, which next
tokens keep the output inside the grammar.

The grammar engine is llguidance (``docs/structured-outputs.md`` says why: measured compile
and mask times and schema coverage, ``bench/bench_grammar_engines.py``). This module is the
only place that imports it.

* ``GrammarSpec``: a request's constraint, as the request named it: a JSON schema, any JSON
  object, a regular expression, a choice among strings, or a grammar (Lark, or GBNF/EBNF with
  ``::=`` rules, converted to Lark); ``param`` is the field it came from, for errors.
* ``GrammarCompiler.compile(spec)``: a ``CompiledGrammar`` (checked against the vocabulary,
  cached by spec, bounded); an invalid schema, regex or grammar raises ``GrammarError``
  naming ``spec.param``.
* ``CompiledGrammar.matcher()``: a fresh ``RowMatcher``. ``advance(token)`` accepts a sampled
  token; ``only_stop_left`` says the grammar is complete and nothing but a stop token may
  follow, which finishes the sequence without another step.
* ``fill_masks(rows, bitmask)``: the next-token masks of many sequences at once, computed in
  parallel on llguidance's own threads (outside the GIL) into a host bitmask; the step
  launcher calls it while it stages a step (on a worker thread on CUDA).
* ``apply_bitmask(logits, bitmask)``: the packed mask applied to [N, V] logits on their own
  device (-inf where a bit is 0): a handful of tensor ops with fixed shapes, so a CUDA graph
  captures it. Bit ``i % 32`` of word ``i // 32`` of a row allows token ``i``.

JSON schemas are compiled without free whitespace between JSON tokens, so a model cannot pad
an answer with unbounded spaces, and objects that list their properties admit only those
(``closed_objects``) unless the schema sets ``additionalProperties``. Before a schema compiles,
``schema_rules.enforceable_schema`` checks it (depth, formats, satisfiable bounds; a
``GrammarError`` naming the schema path) and replaces each ``format`` with exact patterns. A
grammar whose objects may hold keys beyond a fixed list (a schema's open objects, JSON mode)
gives each matcher a ``json_keys.KeyGuard``, which takes the tokens that would repeat a key
out of the mask.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from adaptermesh.worker.json_keys import KeyGuard, KeyVocab
from adaptermesh.worker.schema_rules import SchemaError, closed_objects, enforceable_schema
from adaptermesh.worker.types import ParamError

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "RowMatcher",
    "apply_bitmask",
    "bitmask_words",
    "choice_grammar",
    "closed_objects",
    "fill_masks",
]

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# Compiled grammars kept per engine (a schema sent again compiles once).
_CACHE_ENTRIES = 256
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_executor: Any = None
_executor_lock = threading.Lock()


class GrammarError(ParamError):
    """A constraint that does not compile; ``param`` names the request field it came from."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's constraint. ``source``: the schema as JSON text (``json_schema``), the
    regex, the choices as a JSON list, or the grammar text; unused for ``json_object``."""

    kind: GrammarKind
    source: str
    param: str


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one row's packed mask."""
    return (vocab_size + 31) // 32


def _lark_literal(text: str) -> str:
    """``text`` as a Lark string literal. JSON's string escapes are valid in Lark string
    literals, but JSON leaves every non-printable character above U+001F raw (DEL, the C1
    controls, the line and paragraph separators, format characters), and the grammar's lexer
    refuses some of them: every character that is not printable is escaped (as a UTF-16
    surrogate pair above U+FFFF)."""
    out = []
    for ch in json.dumps(text, ensure_ascii=False):
        if ch.isprintable():
            out.append(ch)
            continue
        code = ord(ch)
        if code > 0xFFFF:
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out)


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly ``choices``."""
    return "start: " + " | ".join(_lark_literal(choice) if choice else '""' for choice in choices)


class RowMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_guard", "_matcher", "_words")

    def __init__(self, matcher: Any, words: int, guard: KeyGuard | None = None) -> None:
        self._matcher = matcher
        self._words = words
        self._guard = guard

    def advance(self, token_id: int) -> bool:
        """Accept ``token_id``; False when the grammar refuses it (the sequence then has to
        stop: its output would leave the grammar)."""
        accepted = bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()
        if accepted and self._guard is not None:
            self._guard.advance(token_id)
        return accepted

    @property
    def only_stop_left(self) -> bool:
        """The output is complete and nothing but a stop token may follow."""
        return bool(self._matcher.is_stopped())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """This sequence's next-token mask into row ``row`` of ``bitmask`` ([R, W] int32, on
        the host)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._guard is not None:
            self._guard.restrict(bitmask, row, self._matcher)

    def allows(self, token_id: int) -> bool:
        mask = torch.zeros((1, self._words), dtype=torch.int32)
        self.fill(mask, 0)
        return bool((int(mask[0, token_id // 32]) >> (token_id % 32)) & 1)


def fill_masks(rows: list[tuple[RowMatcher, int]], bitmask: torch.Tensor) -> None:
    """Each ``(matcher, row)``'s next-token mask into its row of ``bitmask`` ([R, W] int32,
    contiguous, on the host), computed in parallel outside the GIL."""
    if not rows:
        return
    if len(rows) == 1:
        matcher, row = rows[0]
        matcher.fill(bitmask, row)
        return
    import llguidance
    import llguidance.torch

    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = llguidance.LLExecutor()
    llguidance.torch.fill_next_token_bitmask_par(
        _executor, [(matcher._matcher, row) for matcher, row in rows], bitmask
    )
    for matcher, row in rows:
        if matcher._guard is not None:
            matcher._guard.restrict(bitmask, row, matcher._matcher)


@dataclass(frozen=True, slots=True)
class _Compiled:
    grammar: str
    open_keys: bool  # outputs may hold objects with keys beyond a fixed list
    finite_keys: bool  # ... from a set that may be finite (the guard looks ahead)


class CompiledGrammar:
    """A spec checked against one vocabulary; ``matcher()`` starts a sequence in it."""

    __slots__ = ("_compiled", "_keys", "_tokenizer", "_words", "spec")

    def __init__(
        self,
        spec: GrammarSpec,
        compiled: _Compiled,
        tokenizer: Any,
        words: int,
        keys: KeyVocab | None,
    ) -> None:
        self.spec = spec
        self._compiled = compiled
        self._tokenizer = tokenizer
        self._words = words
        self._keys = keys

    @property
    def guards_keys(self) -> bool:
        """Each matcher refuses tokens that would repeat a key of an object."""
        return self._keys is not None

    def matcher(self) -> RowMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self._compiled.grammar, log_level=0)
        if matcher.is_error():  # checked at compile time; a resource limit can still hit
            raise GrammarError(self.spec.param, _clean(matcher.get_error()))
        guard = None
        if self._keys is not None:
            guard = KeyGuard(self._keys, self._compiled.finite_keys)
        return RowMatcher(matcher, self._words, guard)


class GrammarCompiler:
    """Compiles specs against one tokenizer. ``vocab_size`` is the model's (its logits' width,
    which may exceed the tokenizer's); ``stop_token_ids`` end an output (EOS and the model's
    other end tokens). Thread-safe: the service compiles on its tokenizer threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids or None
        )
        self._cache: OrderedDict[tuple[str, str], _Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self._keys: KeyVocab | None = None

    def _key_vocab(self) -> KeyVocab:
        """Every token's bytes (built when a grammar first needs the key guard)."""
        with self._lock:
            if self._keys is None:
                tokenizer = self._tokenizer
                data = [tokenizer.decode_bytes([i]) for i in range(self.vocab_size)]
                self._keys = KeyVocab(data, self.stop_token_ids)
            return self._keys

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = (spec.kind, spec.source)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is None:
            grammar = self._grammar(spec)
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        keys = self._key_vocab() if grammar.open_keys else None
        return CompiledGrammar(spec, grammar, self._tokenizer, self.words, keys)

    def _grammar(self, spec: GrammarSpec) -> _Compiled:
        """The llguidance grammar of ``spec``, checked (with the vocabulary) before use."""
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        matcher = llguidance.LLMatcher
        open_keys = finite_keys = False
        if spec.kind == "json_schema":
            try:
                prepared = enforceable_schema(json.loads(spec.source), spec.param)
            except SchemaError as exc:
                raise GrammarError(exc.param, exc.message) from None
            open_keys, finite_keys = prepared.open_keys, prepared.finite_keys
        elif spec.kind == "json_object":
            open_keys = True
        try:
            if spec.kind == "json_schema":
                grammar = matcher.grammar_from_json_schema(prepared.schema, defaults=_JSON_OPTIONS)
            elif spec.kind == "json_object":
                grammar = matcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=_JSON_OPTIONS
                )
            elif spec.kind == "regex":
                grammar = matcher.grammar_from_regex(spec.source)
            elif spec.kind == "choice":
                grammar = matcher.grammar_from_lark(choice_grammar(json.loads(spec.source)))
            else:
                text = spec.source
                if "::=" in text:  # GBNF / EBNF rules (vLLM's guided_grammar), as Lark
                    text = gbnf_to_lark(text)
                grammar = matcher.grammar_from_lark(text)
        except Exception as exc:  # a schema that is not an object, a GBNF syntax error
            raise GrammarError(spec.param, _message(spec, str(exc))) from None
        error = matcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(spec.param, _message(spec, error))
        return _Compiled(str(grammar), open_keys, finite_keys)


def _clean(text: str) -> str:
    return " ".join(text.split())[:300]


def _message(spec: GrammarSpec, detail: str) -> str:
    what = {
        "json_schema": "is not a JSON schema this server can enforce",
        "json_object": "cannot be enforced",
        "regex": "is not a regular expression this server can enforce",
        "choice": "cannot be enforced",
        "grammar": "is not a valid grammar (Lark, or GBNF with ::= rules)",
    }[spec.kind]
    return f"{what}: {_clean(detail)}"


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, i]`` to -inf where bit i of row r of ``bitmask`` ([R, W] int32, R <= N)
    is 0; rows past R and columns past 32 * W are left alone. In place, on the logits' device,
    fixed shapes (graph-capturable)."""
    rows, words = bitmask.shape
    vocab = min(int(logits.shape[1]), words * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(rows, words * 32)[:, :vocab]
    logits[:rows, :vocab].masked_fill_(allowed == 0, -torch.inf)
