"""Adapters with extra vocabulary rows (a resized embedding and head): which tensors of the
file hold the adapter's vocabulary, the adapter pool's per-slot extra rows and vocabulary
width, and their per-row application in the step.

**Which adapters.** A user adds tokens (``tokenizer.add_tokens``), calls
``model.resize_token_embeddings(V + k)`` and trains: PEFT then saves, beside the adapter's
own tensors, the resized embedding and head (``save_embedding_layers``, on by default when the
vocabulary differs from the base config's). The adapter's vocabulary ``V_a = V + k`` is the
rows of its vocabulary tensors, which must all agree:

* a trained copy (``modules_to_save``) of ``embed_tokens`` / ``lm_head`` with ``V_a`` rows
  (``<module>.weight``; PEFT also writes the same copy as ``<module>.modules_to_save.weight``,
  which must hold the same bits, and the resized base as ``<module>.original_module.weight``);
* a LoRA on the module over the resized base: ``lora_embedding_A`` [r, V_a] / head
  ``lora_B`` [V_a, r], and the resized base as ``<module>.base_layer.weight``;
* neither: the resized base as ``<module>.weight``;
* trained rows of the new tokens (``trainable_token_indices``, every index an added token's):
  the resized base as ``embed_tokens.token_adapter.base_layer.weight`` and the trained rows
  as ``trainable_tokens_delta``, which replace those rows (PEFT's ``index_copy``; a tied
  head wraps the same rows, saved under ``lm_head.token_adapter``).

A resized base must hold the model's weight in its first ``V`` rows (PEFT loads it into the
model for every adapter; checked once, when the adapter first enters a slot); its rows from
``V`` on are the adapter's own, and are what this module's pool part holds. An embedding or a
head that is neither copied nor saved has no rows past ``V`` and refuses the adapter by name;
a tied model's head is its embedding's base. The most extra rows a slot holds is the worker's
``--lora-extra-vocab`` (``EngineConfig.lora_extra_vocab``); an adapter with more is refused
naming the field (0 keeps the refusal of every such adapter).

**In the pool.** ``ExtraVocabPool``: per slot, the extra rows of the base embedding and head
([S, N, H] each), the slot's vocabulary (``widths`` on the device, ``vocab`` on the host;
the last column, base rows, is ``V``). Trained copies and vocabulary LoRA factors are as
wide as ``V + N`` in their own pool tables (``saved_modules``, ``model.LoraPool``).

**In the step.** Only a step with a row whose adapter's vocabulary exceeds ``V`` pays
anything (``ExtraStep``; such a step runs eagerly). Its logits are ``V + N`` wide: a token
id at or past ``V`` embeds from its slot's extra rows (or its copy); the head's extra columns
are one matmul per adapter of the step with extra head rows; every row's columns at or past
its own vocabulary are ``-inf``, so greedy, random draws, penalties, logit_bias and grammar
masks never reach them, and base rows keep the base vocabulary's logits bit for bit. All of
it is torch ops on device tensors with no host sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "EXTRA_FLAG",
    "VOCAB_PREFIXES",
    "BaseRows",
    "ExtraEntry",
    "ExtraRows",
    "ExtraStep",
    "ExtraVocabPool",
    "VocabError",
    "VocabWeights",
    "take_vocab_weights",
    "trainable_tokens",
]

EXTRA_FLAG = "--lora-extra-vocab"
# PEFT's key prefix of each vocabulary module in an adapter file, and its pool part.
VOCAB_PREFIXES = {
    "embed_tokens": "base_model.model.model.embed_tokens",
    "lm_head": "base_model.model.lm_head",
}
_PARTS = {"embed_tokens": "embed", "lm_head": "head"}

Header = dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]


class ArchConfig(Protocol):
    """The fields of ``model.ModelConfig`` this module reads."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


class VocabError(ValueError):
    """An adapter's vocabulary tensors cannot be served; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ExtraEntry:
    """The adapter's own rows (past the model's vocabulary) of one vocabulary module's base
    weight, as they lie in ``CpuAdapter.data``."""

    part: str  # "embed" | "head"
    key: str
    dtype: torch.dtype
    rows: int
    hidden: int
    start: int  # byte offsets in ``data``
    end: int

    def view(self, data: torch.Tensor) -> torch.Tensor:
        return data[self.start : self.end].view(self.dtype).view(self.rows, self.hidden)


@dataclass(frozen=True, slots=True)
class BaseRows:
    """The first ``V`` rows of a saved base weight (checked against the model's)."""

    part: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, int]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class VocabWeights:
    """What ``take_vocab_weights`` found: the adapter's vocabulary, the base rows to check and
    the extra rows to serve."""

    rows: int
    bases: tuple[BaseRows, ...] = ()
    extra: tuple[ExtraEntry, ...] = ()


def _rows_of(key: str, shape: tuple[int, ...]) -> int | None:
    if len(shape) != 2:
        return None
    return shape[1] if key.endswith(".lora_embedding_A") else shape[0]


def _same_bits(data: torch.Tensor, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether byte ranges ``a`` and ``b`` of ``data`` (a host buffer) hold the same bytes."""
    if a[1] - a[0] != b[1] - b[0]:
        return False
    view = data.numpy()
    return bool(np.array_equal(view[a[0] : a[1]], view[b[0] : b[1]]))


_TOKENS = "trainable_token_indices"
_TOKEN_BASE = ".token_adapter.base_layer.weight"
_TOKEN_DELTA = ".token_adapter.trainable_tokens_delta"


def trainable_tokens(
    raw: Any, *, per_module: bool, copied: frozenset[str], lora: frozenset[str]
) -> tuple[int, ...]:
    """The embedding rows ``trainable_token_indices`` trains (PEFT: a list for the input
    embedding, or a dict of module name -> list). Raises ``VocabError`` naming the field for
    what is not served: a module other than the embedding, repeated or non-integer indices,
    an embedding that is also copied or carries a LoRA, AdaFuse experts. Whether each index
    is an added token's is checked against the file (``take_vocab_weights``)."""
    if raw is None or raw == [] or raw == {}:
        return ()
    if not per_module:
        raise VocabError(_TOKENS, "trained token rows are not implemented for AdaFuse experts")
    if isinstance(raw, dict):
        if len(raw) != 1 or next(iter(raw)) not in ("embed_tokens", "model.embed_tokens"):
            raise VocabError(
                _TOKENS,
                f"{sorted(raw)!r}: trained token rows are served for embed_tokens only (a tied "
                "head follows it)",
            )
        raw = next(iter(raw.values()))
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in raw
    ):
        raise VocabError(_TOKENS, f"must be a list of token ids, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise VocabError(_TOKENS, "names a token more than once")
    if "embed_tokens" in copied | lora:
        how = "copies" if "embed_tokens" in copied else "puts a LoRA on"
        raise VocabError(_TOKENS, f"trains rows of embed_tokens, which the adapter also {how}")
    return tuple(raw)


def take_vocab_weights(
    header: Header,
    data: torch.Tensor,
    cfg: ArchConfig,
    *,
    copied: frozenset[str],
    lora: frozenset[str],
    limit: int,
    wfld: str,
    per_module: bool,
    tokens: tuple[int, ...] = (),
) -> VocabWeights:
    """The adapter's vocabulary from its file's vocabulary tensors (``copied``: the modules
    ``modules_to_save`` copies; ``lora``: those its LoRA targets; ``tokens``: the embedding
    rows ``trainable_token_indices`` trains), with the saved base weights taken out of
    ``header`` (the copies and factors stay for their readers, which check them against
    ``rows``; trained token rows are written over their base rows in ``data``). Raises
    ``VocabError`` naming the field: more extra rows than ``limit``, a base weight of another
    shape, a module without its extra rows, two copies that differ, a trained token row that
    is not an added token's. Without ``per_module`` (AdaFuse experts) nothing is taken."""
    v, hid = cfg.vocab_size, cfg.hidden_size
    if not per_module:
        return VocabWeights(v)
    own = [i for i in tokens if i < v]
    if own:
        raise VocabError(
            _TOKENS,
            f"token {own[0]} is a row of the model's own vocabulary ({v} rows): trained token "
            "rows are served for added tokens only (a modules_to_save copy of embed_tokens "
            "trains the model's own rows)",
        )
    # 1. Every tensor a reader will take, with its vocabulary rows and the field it belongs to.
    found: list[tuple[int, str, str, str]] = []  # (rows, module, key, field)
    for m, p in VOCAB_PREFIXES.items():
        if m in copied:
            keys = [
                k
                for k in header
                if k == p + ".weight"
                or (k.startswith(p + ".modules_to_save.") and k.endswith(".weight"))
                or k == p + ".original_module.weight"
            ]
            fld = "modules_to_save"
        elif m in lora:
            tail = (".lora_embedding_A",) if m == "embed_tokens" else (".lora_B.weight",)
            keys = [k for k in (p + ".base_layer.weight", *(p + t for t in tail)) if k in header]
            fld = "target_modules"
        elif tokens and (m == "embed_tokens" or p + _TOKEN_BASE in header):
            keys = [p + _TOKEN_BASE] if p + _TOKEN_BASE in header else []
            fld = _TOKENS
        else:
            keys = [p + ".weight"] if p + ".weight" in header else []
            fld = wfld
        for k in keys:
            rows = _rows_of(k, header[k][1])
            if rows is not None:
                found.append((rows, m, k, fld))
    va = max((f[0] for f in found), default=v)
    if va > v:
        rows, m, key, fld = max(found, key=lambda f: f[0])
        if limit <= 0:
            raise VocabError(
                fld,
                f"{m}: tensor {key} has {rows} vocabulary rows, the model has {v}: adapters with "
                f"extra vocabulary rows are not served by this worker (start it with "
                f"{EXTRA_FLAG} {rows - v} or more)",
            )
        if rows - v > limit:
            raise VocabError(
                fld,
                f"{m}: tensor {key} has {rows} vocabulary rows, {rows - v} beyond the model's "
                f"{v}: this worker holds at most {limit} extra vocabulary rows a slot "
                f"({EXTRA_FLAG})",
            )
    va = max(va, v)
    # 2. The saved base weights, out of the header; a copy written twice must agree.
    bases: dict[str, tuple[str, torch.dtype, int, int]] = {}
    for m, p in VOCAB_PREFIXES.items():
        if m in copied:
            dup, copy = p + ".modules_to_save.weight", p + ".weight"
            if dup in header and copy in header:
                a, b = header[dup], header[copy]
                if a[:2] != b[:2] or not _same_bits(data, a[2:], b[2:]):
                    raise VocabError(
                        "modules_to_save",
                        f"{m}: {dup} and {copy} hold more than one copy of the module, and "
                        "they differ",
                    )
                header.pop(dup)
            key = p + ".original_module.weight"
        elif m in lora:
            key = p + ".base_layer.weight"
        elif tokens and (m == "embed_tokens" or p + _TOKEN_BASE in header):
            key = p + _TOKEN_BASE
        else:
            key = p + ".weight"
        h = header.pop(key, None)
        if h is None:
            if key.endswith(_TOKEN_BASE):
                raise VocabError(wfld, f"missing tensor {key} ({_TOKENS} is set)")
            continue
        dt, shape, start, end = h
        if shape != (va, hid):
            fld = (
                "modules_to_save"
                if m in copied
                else "target_modules"
                if m in lora
                else _TOKENS
                if key.endswith(_TOKEN_BASE)
                else wfld
            )
            more = f" (the model's vocabulary has {v} rows)" if va == v else ""
            raise VocabError(
                fld,
                f"{m}: {key} has shape {shape}, the adapter's vocabulary needs {(va, hid)}{more}",
            )
        if key.endswith(_TOKEN_BASE):
            _write_tokens(header, data, p, tokens, v, va, hid, (dt, start, end), wfld)
        bases[m] = (key, dt, start, end)
    checks = tuple(
        BaseRows(_PARTS[m], key, dt, (v, hid), start, start + v * hid * dt.itemsize)
        for m, (key, dt, start, _) in bases.items()
    )
    if va == v:
        return VocabWeights(v, checks)
    # 3. Each module's own rows past V: a copy holds them itself, else its saved base (a tied
    # head: the embedding's).
    extra: list[ExtraEntry] = []
    tied = cfg.tie_word_embeddings
    for m in VOCAB_PREFIXES:
        if m in copied:
            continue
        src = bases.get(m)
        if src is None and m == "lm_head" and tied:
            src = bases.get("embed_tokens")
        if src is None:
            saved = (
                f"{VOCAB_PREFIXES[m]}.base_layer.weight"
                if m in lora
                else f"{VOCAB_PREFIXES[m]}.weight"
            )
            raise VocabError(
                wfld,
                f"{m}: the adapter's vocabulary has {va} rows ({found[0][2]}), but the file holds "
                f"no rows of {m} past the model's {v} (no {saved}: PEFT saves the resized module "
                "with save_embedding_layers, or as a modules_to_save copy)",
            )
        key, dt, start, end = src
        lo = start + v * hid * dt.itemsize
        extra.append(ExtraEntry(_PARTS[m], key, dt, va - v, hid, lo, end))
    if tied and "embed_tokens" in bases and "lm_head" in bases and not copied:
        # One tied weight saved twice: PEFT loads both keys into the same parameter.
        emb, head = extra
        if emb.dtype != head.dtype or not _same_bits(
            data, (emb.start, emb.end), (head.start, head.end)
        ):
            raise VocabError(
                wfld,
                f"lm_head: the model ties its head to its embedding, but {head.key} and "
                f"{emb.key} differ in their extra vocabulary rows",
            )
    return VocabWeights(va, checks, tuple(extra))


def _write_tokens(
    header: Header,
    data: torch.Tensor,
    prefix: str,
    tokens: tuple[int, ...],
    v: int,
    va: int,
    hid: int,
    base: tuple[torch.dtype, int, int],
    wfld: str,
) -> None:
    """The trained rows of ``tokens`` (``<prefix>.token_adapter.trainable_tokens_delta``,
    taken out of ``header``) written over their rows of the saved base in ``data``, as
    PEFT's ``index_copy`` replaces them."""
    bad = [i for i in tokens if i >= va]
    if bad:
        raise VocabError(
            _TOKENS, f"token {bad[0]} is past the adapter's vocabulary ({va} rows in {prefix})"
        )
    key = prefix + _TOKEN_DELTA
    h = header.pop(key, None)
    if h is None:
        raise VocabError(wfld, f"missing tensor {key} ({_TOKENS} is set)")
    ddt, shape, start, end = h
    if shape != (len(tokens), hid):
        raise VocabError(
            wfld, f"tensor {key} has shape {shape}, expected {(len(tokens), hid)} (one row a token)"
        )
    bdt, bstart, bend = base
    rows = data[bstart:bend].view(bdt).view(va, hid)
    delta = data[start:end].view(ddt).view(shape)
    index = torch.tensor(tokens, dtype=torch.int64)
    rows.index_copy_(0, index, delta.to(bdt))


# ---- the pool ---------------------------------------------------------------------------


class ExtraVocabPool:
    """Per slot, the extra rows of the base embedding and head and the slot's vocabulary."""

    def __init__(
        self,
        cfg: ArchConfig,
        num_slots: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"extra vocabulary capacity must be positive, got {capacity}")
        self.base = cfg.vocab_size
        self.capacity = capacity
        self.width = cfg.vocab_size + capacity  # the logits' width in a step with extra rows
        self.num_slots = num_slots
        self.device = device
        self.rows: dict[str, torch.Tensor] = {
            part: torch.zeros((num_slots, capacity, cfg.hidden_size), dtype=dtype, device=device)
            for part in ("embed", "head")
        }
        # The vocabulary of each slot's adapter (column S: base rows).
        self.widths = torch.full((num_slots + 1,), self.base, dtype=torch.int32, device=device)
        # Host mirrors, read by the step launcher and the engine for the slots of the rows
        # they run (which hold their slot while they run).
        self.vocab: list[int] = [self.base] * num_slots
        self.held: list[frozenset[str]] = [frozenset()] * num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.rows.values(), self.widths))

    def view(self, e: ExtraEntry, slot: int) -> torch.Tensor:
        """Where ``e``'s rows go in ``slot``."""
        return self.rows[e.part][slot, : e.rows]

    def write(
        self, slot: int, entries: Iterable[ExtraEntry], data: torch.Tensor, vocab: int
    ) -> None:
        """``slot`` takes ``entries`` (over ``data``: the adapter's buffer on the host or the
        device) and the vocabulary ``vocab``; the rows it does not write read as zeros."""
        entries = list(entries)
        for t in self.rows.values():
            t[slot].zero_()
        if entries:
            torch._foreach_copy_(
                [self.view(e, slot) for e in entries], [e.view(data) for e in entries]
            )
        self.widths[slot] = vocab
        self.vocab[slot] = vocab
        self.held[slot] = frozenset(e.part for e in entries)

    def clear(self, slot: int) -> None:
        self.widths[slot] = self.base
        self.vocab[slot] = self.base
        self.held[slot] = frozenset()

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of the rows ``slot`` holds (a device scalar; no host sync)."""
        return torch.stack([t[slot].sum(dtype=torch.float64) for t in self.rows.values()]).sum()

    def slots_with_extra(self, slots: Iterable[int]) -> tuple[int, ...]:
        """The slots among ``slots`` (-1: base rows) whose vocabulary exceeds the model's."""
        return tuple(sorted({s for s in slots if s >= 0 and self.vocab[s] > self.base}))

    def step(self, slots: Iterable[int]) -> ExtraStep | None:
        """What a step whose rows use ``slots`` applies (None: nothing)."""
        extra = self.slots_with_extra(slots)
        if not extra:
            return None
        return ExtraStep(self, extra, tuple(s for s in extra if "head" in self.held[s]))

    def row_widths(self, token_slots: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
        """[S] int32: each sequence row's vocabulary."""
        s = token_slots.to(torch.int64).index_select(0, logits_rows)
        flag = torch.where(s >= 0, s, torch.full_like(s, self.num_slots))
        return self.widths.index_select(0, flag)


@dataclass(frozen=True, slots=True)
class ExtraStep:
    """Host facts of one step: the slots of its rows with extra vocabulary, and those among
    them whose head rows come from the pool (an adapter with a head copy has them there)."""

    pool: ExtraVocabPool
    slots: tuple[int, ...]
    head_slots: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.pool.width

    def bind(self, token_slots: torch.Tensor, logits_rows: torch.Tensor) -> ExtraRows:
        return ExtraRows(self, token_slots, logits_rows)


@dataclass(slots=True)
class ExtraRows:
    """One forward pass's per-row application of an ``ExtraStep`` (device tensors only)."""

    step: ExtraStep
    token_slots: torch.Tensor  # [T] int32, -1: base
    logits_rows: torch.Tensor  # [S] int64
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def base_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with each id past the model's vocabulary clamped into it (its row of
        the base embedding is replaced by ``embed``)."""
        return input_ids.clamp(max=self.step.pool.base - 1)

    def embed(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``h`` [T, H] (the base embedding of each clamped id) with each id past the model's
        vocabulary taken from its slot's extra embedding rows instead (before any embedding
        scale; a copy of the embedding then replaces its adapter's rows whole)."""
        pool = self.step.pool
        slots = self.token_slots.to(torch.int64).clamp(min=0)
        past = input_ids - pool.base
        rows = pool.rows["embed"][slots, past.clamp(0, pool.capacity - 1)]
        return torch.where((past >= 0).unsqueeze(1), rows, h)

    def widen(self, logits: torch.Tensor, hn: torch.Tensor) -> torch.Tensor:
        """``logits`` [S, V] with the head's extra columns [S, N] of each sequence row's
        adapter appended (zeros for rows whose adapter has none there: base rows, and a head
        copy's rows, which ``saved_modules`` replaces whole)."""
        pool = self.step.pool
        extra = torch.zeros(
            (logits.shape[0], pool.capacity), dtype=logits.dtype, device=logits.device
        )
        if self.step.head_slots:
            slots = self.token_slots.index_select(0, self.logits_rows)
            for s in self.step.head_slots:
                mask = (slots == s).unsqueeze(1)
                extra = torch.where(mask, hn @ pool.rows["head"][s].T, extra)
        return torch.cat([logits, extra], dim=1)

    def widths(self) -> torch.Tensor:
        """[S] int32: each sequence row's vocabulary."""
        got = self._cache.get("widths")
        if got is None:
            got = self._cache["widths"] = self.step.pool.row_widths(
                self.token_slots, self.logits_rows
            )
        return got

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [S, W] with each row's columns at or past its vocabulary at -inf."""
        cols = torch.arange(logits.shape[1], device=logits.device)
        outside = cols.unsqueeze(0) >= self.widths().unsqueeze(1)
        return logits.masked_fill(outside, -torch.inf)
