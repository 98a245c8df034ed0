"""Trained copies of whole modules (PEFT ``modules_to_save``): which modules an adapter may
save, where their tensors lie in its file, the adapter pool's per-slot tables that hold them,
and their per-row application in the step.

**Which modules.** PEFT wraps every module of the model whose name *ends with* an entry of
``modules_to_save`` (a plain string suffix: ``"norm"`` matches ``model.norm`` and every
``input_layernorm``), and keeps the adapter's trained copy beside the original. A copy is
served for ``embed_tokens``, ``lm_head`` and the norms the supported families have
(``input_layernorm``, ``post_attention_layernorm``, Gemma 2/3's ``pre_feedforward_layernorm``
and ``post_feedforward_layernorm``, Qwen3 / Gemma 3's per-head ``q_norm`` and ``k_norm``, and the
final ``norm``). An entry that matches any other module (a linear layer, a decoder layer, an
MLP) or no module at all (``score`` or ``classifier`` of a classification adapter) refuses the
adapter by name. As PEFT does, no LoRA is put on a module an entry names as a dotted part of
its path (``(^|.*\\.)entry($|\\..*)``), so ``modules_to_save: ["lm_head"]`` with ``lm_head`` in
``target_modules`` is a copy of the head and no head LoRA.

**In the file.** PEFT saves a copy under ``base_model.model.<module>.weight`` (the wrapper's
``modules_to_save.<adapter>.`` part removed); a state dict taken from a live PEFT model keeps
it (``<module>.modules_to_save.<adapter>.weight``), and either form is read. A copy must have
its base module's shape, except that an embedding or head copy has the adapter's vocabulary
rows: more than the model's for a resized vocabulary (``extra_vocab``, on a worker that holds
extra rows; refused by name otherwise), never fewer.

**In the pool.** ``SavedModulePool`` holds, per pool slot, one table entry for every module of
the kinds the worker was started with (``EngineConfig.lora_saved_modules``: ``embed_tokens``,
``lm_head``, ``norms``): a [V, H] table per slot for each vocabulary module, a few vectors per
layer for the norms (a vocabulary table has ``V + N`` rows on a worker holding ``N`` extra
vocabulary rows a slot; the rows past a copy's own are zero). The tables are part of the pool's bytes (``LoraPool.nbytes``, so the
sizing divides memory by the slot size with them), written with the adapter's LoRA matrices
in the same atomic load, verified with them, and dropped with the slot. Per slot the pool keeps
which (module, layer) copies it holds (``held``, on the host) and a device flag per module,
layer and slot (``on``; the last column, for base rows, is always off).

**In the step.** Only a step with a row whose adapter holds copies pays anything: the
launcher hands the forward pass a ``SavedStep`` naming the (module, layer) copies its rows'
adapters hold, and every other step runs exactly as before. Each application is torch ops on
device tensors, with no host sync: a norm is normalised once more for the whole batch and each
row takes its own slot's weight (a gather), then ``torch.where`` keeps the base rows' result
bit for bit; an embedding copy is a gather of each token's row from its slot's table; a head
copy is the head's matmul with the copy's weight, kept on the sequences of that adapter (one
matmul per distinct adapter with a head copy in the step, the host's list), over as many
columns as the step's logits have (the model's vocabulary, or ``V + N`` in a step with extra
vocabulary rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "POOL_KINDS",
    "SavedEntry",
    "SavedModulePool",
    "SavedRows",
    "SavedStep",
    "Site",
    "copy_sites",
    "excluded_from_lora",
    "module_kinds",
    "resolve_saved",
    "take_copies",
    "unserved_message",
]

# What a pool can hold copies of (``EngineConfig.lora_saved_modules``).
POOL_KINDS = ("embed_tokens", "lm_head", "norms")
_PREFIX = "base_model.model."
_VOCAB = ("embed_tokens", "lm_head")
_SERVED = "embed_tokens, lm_head and the norms"


class ArchConfig(Protocol):
    """The fields of ``model.ModelConfig`` this module reads."""

    @property
    def arch(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def sandwich_norm(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def fused_checkpoint(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Site:
    """One module a trained copy may replace: its PEFT name, layer (-1 for the model-level
    ``embed_tokens``, ``lm_head`` and final ``norm``), transformers' module path and weight
    shape."""

    module: str
    layer: int
    path: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SavedEntry:
    """Where one trained copy lies in ``CpuAdapter.data`` and which module it replaces."""

    key: str
    module: str
    layer: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in ``data``
    end: int

    def view(self, data: torch.Tensor) -> torch.Tensor:
        return data[self.start : self.end].view(self.dtype).view(self.shape)


def _kind(module: str) -> str:
    """The pool kind (``POOL_KINDS``) that holds copies of ``module``."""
    return module if module in ("embed_tokens", "lm_head") else "norms"


def _layer_norms(cfg: ArchConfig) -> list[tuple[str, str, int]]:
    """(PEFT name, path below the decoder layer, width) of each norm of a decoder layer."""
    norms = [
        ("input_layernorm", "input_layernorm", cfg.hidden_size),
        ("post_attention_layernorm", "post_attention_layernorm", cfg.hidden_size),
    ]
    if cfg.sandwich_norm:
        norms += [
            ("pre_feedforward_layernorm", "pre_feedforward_layernorm", cfg.hidden_size),
            ("post_feedforward_layernorm", "post_feedforward_layernorm", cfg.hidden_size),
        ]
    if cfg.qk_norm:
        norms += [
            ("q_norm", "self_attn.q_norm", cfg.head_dim),
            ("k_norm", "self_attn.k_norm", cfg.head_dim),
        ]
    return norms


def copy_sites(cfg: ArchConfig) -> list[Site]:
    """Every module of the model whose trained copy is served, in module order."""
    v, h = cfg.vocab_size, cfg.hidden_size
    sites = [Site("embed_tokens", -1, "model.embed_tokens", (v, h))]
    for layer in range(cfg.num_layers):
        for module, sub, width in _layer_norms(cfg):
            sites.append(Site(module, layer, f"model.layers.{layer}.{sub}", (width,)))
    sites += [Site("norm", -1, "model.norm", (h,)), Site("lm_head", -1, "lm_head", (v, h))]
    return sites


def module_kinds(cfg: ArchConfig) -> dict[str, str]:
    """Every module of the causal LM as transformers names it (``named_modules``), with what it
    is: ``"copy"`` for a copy site, else a description for error messages."""
    out: dict[str, str] = {
        "": "the whole model",
        "model": "the decoder",
        "model.layers": "the list of decoder layers",
        "model.rotary_emb": "the rotary embedding",
    }
    attn = (
        ("qkv_proj", "o_proj") if cfg.fused_checkpoint else ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    mlp = (
        ("gate_up_proj", "down_proj")
        if cfg.fused_checkpoint
        else ("gate_proj", "up_proj", "down_proj")
    )
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        out[p] = "a decoder layer"
        out[f"{p}.self_attn"] = "an attention block"
        out[f"{p}.mlp"] = "an MLP block"
        for m in attn:
            out[f"{p}.self_attn.{m}"] = "a linear layer"
        for m in mlp:
            out[f"{p}.mlp.{m}"] = "a linear layer"
        out[f"{p}.mlp.{'activation_fn' if cfg.fused_checkpoint else 'act_fn'}"] = "an activation"
        if cfg.fused_checkpoint:  # Phi-3's decoder layer
            out[f"{p}.resid_attn_dropout"] = "a dropout"
            out[f"{p}.resid_mlp_dropout"] = "a dropout"
    for site in copy_sites(cfg):
        out[site.path] = "copy"
    return out


def resolve_saved(raw: Any, cfg: ArchConfig) -> tuple[Site, ...]:
    """The copy sites ``modules_to_save`` wraps, matched as PEFT matches them (a module whose
    name ends with an entry). Raises ValueError (the message names the entry and the module)
    for an entry that matches a module whose copy is not served, or no module."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise ValueError(f"must be a list of module names, got {raw!r}")
    kinds = module_kinds(cfg)
    sites = {s.path: s for s in copy_sites(cfg)}
    hit: set[str] = set()
    for entry in raw:
        if not entry:
            raise ValueError("an empty name matches every module of the model")
        try:
            re.compile(rf"(^|.*\.){entry}($|\..*)")
        except re.error as e:
            # PEFT matches the entry as a regular expression against the LoRA targets.
            raise ValueError(f"{entry!r} is not a valid regular expression: {e}") from None
        paths = [p for p in kinds if p.endswith(entry)]
        if not paths:
            raise ValueError(
                f"{entry!r} names no module of the {cfg.arch} model (a classification "
                f"adapter's score or classifier head is not served; trained copies are "
                f"served for {_SERVED})"
            )
        bad = [p for p in paths if kinds[p] != "copy"]
        if bad:
            raise ValueError(
                f"{entry!r} matches {bad[0]}, {kinds[bad[0]]}: trained "
                f"copies are served for {_SERVED} only"
            )
        hit.update(paths)
    return tuple(s for p, s in sites.items() if p in hit)


def excluded_from_lora(raw: Any, path: str) -> bool:
    """Whether PEFT leaves module ``path`` without LoRA because ``modules_to_save`` names it
    (``check_target_module_exists``: an entry matching a dotted part of the path)."""
    if not raw or not isinstance(raw, list):
        return False
    return any(re.match(rf"(^|.*\.){m}($|\..*)", path) for m in raw if isinstance(m, str) and m)


Header = dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]


def take_copies(
    header: Header, sites: Sequence[Site], wfld: str, vocab_rows: int | None = None
) -> list[SavedEntry]:
    """Each site's copy, taken out of ``header`` (``key -> (dtype, shape, start, end)``); an
    embedding or head copy has ``vocab_rows`` rows (the adapter's vocabulary; None: the
    model's). Raises ValueError naming the tensor for a missing, doubled or misshapen copy."""
    out = []
    for site in sites:
        base = _PREFIX + site.path
        wrapped = base + ".modules_to_save."
        keys = [
            k
            for k in header
            if k == base + ".weight"
            or (
                k.startswith(wrapped)
                and k.endswith(".weight")
                and k[len(wrapped) : -len(".weight")].count(".") == 0
            )
        ]
        if not keys:
            raise ValueError(
                f"{site.module}: {wfld} has no trained copy of {site.path} (no {base}.weight)"
            )
        if len(keys) > 1:
            raise ValueError(
                f"{site.module}: {wfld} holds more than one copy of {site.path}: "
                f"{', '.join(sorted(keys))}"
            )
        key = keys[0]
        dt, shape, start, end = header.pop(key)
        vocab = site.module in _VOCAB
        want = (vocab_rows, site.shape[1]) if vocab and vocab_rows is not None else site.shape
        if shape != want:
            if vocab and len(shape) == 2 and shape[1] == site.shape[1]:
                whose = "the model has" if want[0] == site.shape[0] else "the adapter's has"
                raise ValueError(
                    f"{site.module}: tensor {key} has {shape[0]} vocabulary rows, {whose} "
                    f"{want[0]}: a copy holds the adapter's whole vocabulary"
                )
            raise ValueError(
                f"{site.module}: tensor {key} has shape {shape}, the model's {site.path} has "
                f"{site.shape}"
            )
        out.append(SavedEntry(key, site.module, site.layer, dt, shape, start, end))
    return out


def unserved_message(entries: Sequence[SavedEntry], pool: SavedModulePool | None) -> str | None:
    """Why a pool cannot hold an adapter's copies (None when it can)."""
    if not entries:
        return None
    held = pool.kinds if pool is not None else frozenset()
    missing = sorted({e.module for e in entries if _kind(e.module) not in held})
    if not missing:
        return None
    kinds = sorted({_kind(m) for m in missing})
    return (
        f"copies of {', '.join(missing)}: this worker's adapter pool holds no trained copies "
        f"of {' or '.join(kinds)} (start it with --lora-saved-modules {' '.join(kinds)}; "
        "not available with int4 pools or tensor parallelism)"
    )


class SavedModulePool:
    """Per-slot trained copies of the modules of ``kinds`` (``POOL_KINDS``)."""

    def __init__(
        self,
        cfg: ArchConfig,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        kinds: frozenset[str],
        extra_vocab: int = 0,
    ) -> None:
        """``extra_vocab``: rows past the model's vocabulary each vocabulary table holds."""
        unknown = sorted(kinds - set(POOL_KINDS))
        if unknown or not kinds:
            raise ValueError(
                f"saved module kinds must be a non-empty subset of {', '.join(POOL_KINDS)}, "
                f"got {sorted(kinds)}"
            )
        self.kinds = kinds
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype
        layers = cfg.num_layers
        # module -> [L', S, *shape] (L' = 1 for the model-level modules, indexed by layer 0).
        self.tables: dict[str, torch.Tensor] = {}
        # module -> [L', S + 1] bool: the slot holds that layer's copy (column S: base rows).
        self.on: dict[str, torch.Tensor] = {}
        self.layered: dict[str, bool] = {}
        for site in copy_sites(cfg):
            if _kind(site.module) not in kinds or site.module in self.tables:
                continue
            depth = layers if site.layer >= 0 else 1
            self.layered[site.module] = site.layer >= 0
            shape = site.shape
            if site.module in _VOCAB:
                shape = (shape[0] + extra_vocab, shape[1])
            self.tables[site.module] = torch.zeros(
                (depth, num_slots, *shape), dtype=dtype, device=device
            )
            self.on[site.module] = torch.zeros(
                (depth, num_slots + 1), dtype=torch.bool, device=device
            )
        # Per slot, the (module, layer) copies it holds (host; read by the step launcher for
        # the slots of the rows it runs, which hold their slot while they run).
        self.held: list[frozenset[tuple[str, int]]] = [frozenset()] * num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tables.values(), *self.on.values()))

    def view(self, module: str, layer: int, slot: int) -> torch.Tensor:
        """``slot``'s table entry for ``module`` (at ``layer``), all its rows."""
        return self.tables[module][max(layer, 0), slot]

    def placed(self, e: SavedEntry, slot: int) -> torch.Tensor:
        """Where copy ``e`` goes in ``slot`` (a vocabulary copy: its own rows)."""
        t = self.view(e.module, e.layer, slot)
        return t[: e.shape[0]] if e.module in _VOCAB else t

    def write(self, slot: int, entries: Sequence[SavedEntry], data: torch.Tensor) -> None:
        """Copy ``entries`` (over ``data``, the adapter's buffer on the host or the device) into
        ``slot`` and flag them; whatever the slot held before is no longer flagged."""
        self.clear(slot)
        if not entries:
            return
        dst = [self.placed(e, slot) for e in entries]
        torch._foreach_copy_(dst, [e.view(data) for e in entries])
        for e in entries:  # the table's rows past the copy's vocabulary read as zeros
            if e.module in _VOCAB and e.shape[0] < self.view(e.module, e.layer, slot).shape[0]:
                self.view(e.module, e.layer, slot)[e.shape[0] :].zero_()
        held = frozenset((e.module, e.layer) for e in entries)
        for module, flags in self.on.items():
            layers = range(flags.shape[0]) if self.layered[module] else (-1,)
            col = torch.tensor([(module, layer) in held for layer in layers], dtype=torch.bool)
            if bool(col.any()):
                flags[:, slot].copy_(col.to(self.device, non_blocking=True))
        self.held[slot] = held

    def clear(self, slot: int) -> None:
        for flags in self.on.values():
            flags[:, slot] = False
        self.held[slot] = frozenset()

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of the copies ``slot`` holds (a device scalar; no host sync)."""
        parts = [
            self.view(m, layer, slot).sum(dtype=torch.float64)
            for m, layer in sorted(self.held[slot])
        ]
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(parts).sum()

    def slots_with_copies(self, slots: Iterable[int]) -> tuple[int, ...]:
        """The slots among ``slots`` (-1: base rows) that hold any copy."""
        return tuple(sorted({s for s in slots if s >= 0 and self.held[s]}))

    def step(self, slots: Iterable[int]) -> SavedStep | None:
        """What a step whose rows use ``slots`` applies (None: nothing)."""
        slots = [s for s in slots if s >= 0]
        present = frozenset(key for s in slots for key in self.held[s])
        if not present:
            return None
        head = tuple(sorted({s for s in slots if ("lm_head", -1) in self.held[s]}))
        return SavedStep(self, present, head)


@dataclass(frozen=True, slots=True)
class SavedStep:
    """Host facts of one step: the (module, layer) copies its rows' adapters hold, and the
    slots whose adapters hold a head copy."""

    pool: SavedModulePool
    present: frozenset[tuple[str, int]]
    head_slots: tuple[int, ...]

    def bind(
        self, token_slots: torch.Tensor, logits_rows: torch.Tensor, heads: Mapping[str, int]
    ) -> SavedRows:
        """The per-row indices of one forward pass (``heads``: per-head norm -> heads per
        token row)."""
        return SavedRows(self, token_slots, logits_rows, dict(heads))


@dataclass(slots=True)
class SavedRows:
    """One forward pass's per-row application of a ``SavedStep`` (device tensors only)."""

    step: SavedStep
    token_slots: torch.Tensor  # [T] int32, -1: base
    logits_rows: torch.Tensor  # [S] int64
    heads: dict[str, int]
    _index: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def _rows(self, which: str, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(table row, flag column) per row of the token rows (``"tokens"``) or of the
        sequence rows (``"logits"``), each repeated ``repeat`` times (per-head norms)."""
        key = (which, repeat)
        got = self._index.get(key)
        if got is None:
            s = self.token_slots.to(torch.int64)
            if which == "logits":
                s = s.index_select(0, self.logits_rows)
            if repeat > 1:
                s = s.repeat_interleave(repeat)
            table = s.clamp(min=0)
            flag = torch.where(s >= 0, s, torch.full_like(s, self.step.pool.num_slots))
            got = self._index[key] = (table, flag)
        return got

    def embed(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``h`` [T, H] (the base embedding of each token) with each copy row's token taken
        from its adapter's embedding copy instead (before any embedding scale)."""
        if ("embed_tokens", -1) not in self.step.present:
            return h
        table, flag = self._rows("tokens")
        pool = self.step.pool
        copy = pool.tables["embed_tokens"][0][table, input_ids]
        mask = pool.on["embed_tokens"][0].index_select(0, flag)
        return torch.where(mask.unsqueeze(1), copy, h)

    def norm(
        self,
        module: str,
        layer: int,
        out: torch.Tensor,
        src: torch.Tensor,
        eps: float,
        gemma: bool,
    ) -> torch.Tensor:
        """``out`` (the base norm of ``src``'s rows) with each copy row normalised with its
        adapter's copy of ``module`` instead, exactly as the base norm is computed
        (``kernels.reference.rms_norm_ref``: transformers' order). ``src``: the norm's input
        (the summed residual where the norm adds one). The final ``norm`` (layer -1) runs
        over the sequence rows, a per-head norm over ``heads[module]`` rows per token."""
        if (module, layer) not in self.step.present:
            return out
        which = "logits" if module == "norm" else "tokens"
        table, flag = self._rows(which, self.heads.get(module, 1))
        pool = self.step.pool
        weight = pool.tables[module][max(layer, 0)].index_select(0, table)
        mask = pool.on[module][max(layer, 0)].index_select(0, flag)
        hf = src.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        y = (
            ((1.0 + weight.float()) * normed).to(out.dtype)
            if gemma
            else weight * normed.to(out.dtype)
        )
        return torch.where(mask.unsqueeze(1), y, out)

    def head(self, logits: torch.Tensor, hn: torch.Tensor) -> torch.Tensor:
        """``logits`` [S, V] (``hn`` times the base head) with each sequence row of an adapter
        with a head copy computed with that copy instead."""
        if not self.step.head_slots:
            return logits
        pool = self.step.pool
        slots = self.token_slots.index_select(0, self.logits_rows)
        width = logits.shape[1]  # the model's vocabulary, or V + N with extra rows
        for s in self.step.head_slots:
            mask = (slots == s).unsqueeze(1)
            logits = torch.where(mask, hn @ pool.tables["lm_head"][0, s, :width].T, logits)
        return logits
