"""Adapters' own tokenizers: an adapter whose directory ships tokenizer files (an adapter
trained with added tokens, ``extra_vocab``) has its prompts tokenised, its outputs
detokenised, its logprob entries named and its grammars compiled with its own tokenizer, and
its tokenizer's end-of-sequence token ends its outputs.

``AdapterTexts.helper(name)`` is the ``TokenizerHelper`` of a request's adapter: the base
model's for the base, an adapter without tokenizer files, or one whose directory is not local
yet; else the adapter's, loaded once per version of its tokenizer files (their sizes and
modification times: a new version of the adapter with new files gets a new tokenizer) and
kept in a small LRU cache. ``prepare`` loads it off the event loop (the service calls it
before tokenising), ``compiler`` is the grammar compiler of a helper (every compiler masks
the same width, the widest vocabulary a pool slot can hold, so the masks of base rows and of
adapter rows share one bitmask).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptermesh.worker.grammar import GrammarCompiler
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh.worker.tokenizer_helpers import TokenizerHelper, load_tokenizer

__all__ = ["TOKENIZER_FILES", "AdapterTexts", "ships_tokenizer"]

# Files a saved tokenizer is made of (``save_pretrained`` writes some of them); the first
# three mark a directory as shipping one.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "added_tokens.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
_MARKERS = TOKENIZER_FILES[:3]


def ships_tokenizer(path: Path) -> bool:
    """Whether the adapter directory ``path`` ships its own tokenizer."""
    return any((path / name).is_file() for name in _MARKERS)


def _signature(path: Path) -> tuple[tuple[str, int, int], ...] | None:
    """The version of ``path``'s tokenizer files (name, size, mtime), None without any."""
    out = []
    for name in TOKENIZER_FILES:
        try:
            st = (path / name).stat()
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    if not any(name in _MARKERS for name, _, _ in out):
        return None
    return tuple(out)


class AdapterTexts:
    """The tokenizer helpers of the base model and of the adapters that ship tokenizers."""

    def __init__(
        self,
        base: TokenizerHelper,
        locate: Callable[[str], Path | None],
        grammar_vocab: int,
        stop_ids: frozenset[int],
        max_entries: int = 64,
    ) -> None:
        """``locate(name)``: the adapter's local directory (None: not local, or not an
        adapter); ``grammar_vocab``: the width every grammar compiler masks; ``stop_ids``: the
        base model's end tokens."""
        self.base = base
        self._locate = locate
        self.grammar_vocab = grammar_vocab
        self.stop_ids = stop_ids
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[Path, tuple[tuple[str, int, int], ...]], TokenizerHelper]
        self._cache = OrderedDict()
        self._compilers: dict[int, tuple[TokenizerHelper, GrammarCompiler]] = {}
        self._lock = threading.Lock()
        self.loads = 0

    def _key(self, name: str | None) -> tuple[Path, tuple[tuple[str, int, int], ...]] | None:
        if name is None:
            return None
        path = self._locate(name)
        if path is None:
            return None
        sig = _signature(path)
        return None if sig is None else (path, sig)

    def cached(self, name: str | None) -> TokenizerHelper | None:
        """The helper of ``name`` when no load is needed (the base's, or a cached one)."""
        key = self._key(name)
        return self.base if key is None else self._lookup(key)

    def _lookup(self, key: tuple[Path, tuple[tuple[str, int, int], ...]]) -> TokenizerHelper | None:
        with self._lock:
            helper = self._cache.get(key)
            if helper is not None:
                self._cache.move_to_end(key)
        return helper

    def helper(self, name: str | None) -> TokenizerHelper:
        """The helper of a request for ``name`` (loaded here when not cached). Raises
        AdapterValidationError naming the file when the adapter's tokenizer cannot load."""
        key = self._key(name)
        if key is None:
            return self.base
        helper = self._lookup(key)
        if helper is not None:
            return helper
        assert name is not None
        try:
            helper = TokenizerHelper(load_tokenizer(key[0]))
        except Exception as e:  # the tokenizer libraries raise many kinds
            raise AdapterValidationError(
                name, "tokenizer.json", f"the adapter's tokenizer files do not load: {e}"
            ) from None
        with self._lock:
            self.loads += 1
            self._cache[key] = helper
            while len(self._cache) > self.max_entries:
                old = self._cache.popitem(last=False)[1]
                self._compilers.pop(id(old), None)
        return helper

    async def prepare(self, name: str | None) -> TokenizerHelper:
        """``helper(name)``, loading off the event loop."""
        got = self.cached(name)
        if got is not None:
            return got
        return await asyncio.to_thread(self.helper, name)

    def stops(self, helper: TokenizerHelper) -> frozenset[int]:
        """End tokens of rows tokenised by ``helper``: the base's, and its own EOS."""
        eos = getattr(helper.tokenizer, "eos_token_id", None)
        if helper is self.base or not isinstance(eos, int):
            return self.stop_ids
        return self.stop_ids | {eos}

    def compiler(self, helper: TokenizerHelper) -> GrammarCompiler:
        """The grammar compiler over ``helper``'s tokenizer (built once; thread-safe)."""
        with self._lock:
            got = self._compilers.get(id(helper))
            if got is not None and got[0] is helper:
                return got[1]
        compiler = GrammarCompiler(helper.tokenizer, self.grammar_vocab, sorted(self.stops(helper)))
        with self._lock:
            got = self._compilers.get(id(helper))
            if got is not None and got[0] is helper:
                return got[1]
            self._compilers[id(helper)] = (helper, compiler)
        return compiler

    def describe(self) -> dict[str, Any]:
        return {"adapter_tokenizers": len(self._cache), "adapter_tokenizer_loads": self.loads}
