"""PEFT adapters on disk: name and path rules, adapter_config.json and weight-file validation,
and the packed CPU form (``CpuAdapter``) the adapter manager caches and uploads.

Everything here is pure reading and checking, with no device state, so both the adapter
manager (``adapters.py``) and AdaFuse expert sets (``adafuse.py``, whose experts are PEFT
adapters) use it without importing each other.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adaptermesh.worker.extra_vocab import (
    ExtraEntry,
    VocabError,
    take_vocab_weights,
    trainable_tokens,
)
from adaptermesh.worker.lora_groups import FUSED_MODULES, GROUPS, MODULE_TO_GROUP, SUPPORTED_MODULES
from adaptermesh.worker.model import ModelConfig
from adaptermesh.worker.model_fields import check_adapter_config
from adaptermesh.worker.saved_modules import (
    SavedEntry,
    excluded_from_lora,
    resolve_saved,
    take_copies,
)
from adaptermesh.worker.types import AdapterNotFoundError

__all__ = [
    "VOCAB_MODULES",
    "AdapterValidationError",
    "CpuAdapter",
    "MagnitudeEntry",
    "TensorEntry",
    "entry_sums",
    "read_adapter",
    "resolve_in_root",
    "target_set",
    "validate_name",
]


# "@" joins an adapter and its version ("credit-risk@2.0.0", docs/rollout.md).
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/@]{0,199}$")
_PARENTS = {
    m: ("self_attn" if m in GROUPS["qkv"] or m == "o_proj" else "mlp") for m in SUPPORTED_MODULES
}
_PARENTS.update(qkv_proj="self_attn", gate_up_proj="mlp")


class AdapterValidationError(AdapterNotFoundError):
    """An adapter exists but cannot be served; ``field`` names what is wrong."""

    def __init__(self, name: str, field: str, message: str) -> None:
        super().__init__(name, f"{field}: {message}")
        self.field = field


def validate_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not _NAME_RE.match(name)
        or any(p in ("..", ".") for p in name.split("/"))
    ):
        raise AdapterValidationError(
            str(name),
            "name",
            "must be 1-200 characters of [A-Za-z0-9._-/@] with no '.' or '..' parts",
        )


def resolve_in_root(root: Path, name: str, path: str | None = None) -> Path:
    """The adapter directory for ``name`` (or an explicit ``path``), guaranteed inside ``root``."""
    rel = Path(path) if path is not None else Path(name)
    if ".." in rel.parts:
        raise AdapterValidationError(name, "lora_path", "must not contain '..'")
    root_r = root.resolve()
    candidate = rel if rel.is_absolute() else root_r / rel
    if "\x00" in str(rel):
        raise AdapterValidationError(name, "lora_path", "must not contain NUL")
    try:
        resolved = candidate.resolve(
            strict=False
        )  # follows symlinks, so an escaping link is caught
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError on 3.11), a name too long
        raise AdapterValidationError(name, "lora_path", f"cannot be resolved: {exc}") from None
    if not resolved.is_relative_to(root_r):
        if not os.path.lexists(candidate):
            # Nothing there: say so rather than call a typo an escape.
            raise AdapterValidationError(name, "lora_path", f"{rel} does not exist")
        raise AdapterValidationError(
            name, "lora_path", f"resolves outside the adapter root {root_r}"
        )
    return resolved


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one LoRA matrix lies in ``CpuAdapter.data`` and where it goes in a pool slot."""

    key: str
    group: str
    index: int  # slice within the group
    layer: int
    is_b: bool  # lora_B [out, r] (else lora_A [r, in])
    dtype: torch.dtype  # as stored in the file
    shape: tuple[int, int]
    start: int  # byte offsets in ``data``
    end: int


@dataclass(frozen=True, slots=True)
class MagnitudeEntry:
    """Where one DoRA magnitude vector (``lora_magnitude_vector`` [out]) lies in
    ``CpuAdapter.data`` and which pool slice it belongs to."""

    key: str
    group: str
    index: int  # slice within the group
    layer: int
    dtype: torch.dtype
    length: int  # the module's output features
    start: int
    end: int


@dataclass(slots=True)
class CpuAdapter:
    """A validated adapter as read from disk: the safetensors data section in one buffer
    (pinned on CUDA, so it reaches the GPU in one copy) plus where each matrix lies in it."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    scale: float
    targets: frozenset[str]
    groups: frozenset[str]  # groups with at least one targeted module
    data: torch.Tensor  # uint8 [nbytes]
    entries: tuple[TensorEntry, ...]
    # All entries share one dtype and tile ``data`` exactly: one reduction covers them all.
    uniform: bool
    nbytes: int
    # DoRA (``use_dora``): one magnitude vector per targeted module, in ``data`` beside the
    # matrices (so the tiers hold and count them like the matrices); empty for plain LoRA.
    magnitudes: tuple[MagnitudeEntry, ...] = ()
    # Per targeted module (its file key prefix): (rank, scale) as PEFT resolves them from r,
    # lora_alpha, use_rslora and the patterns. Merges (``adapter_merge``) weight by these.
    module_scales: dict[str, tuple[int, float]] = field(default_factory=dict)
    # LoRA on the vocabulary modules: the pool parts it fills ("embed", "head"; its entries
    # of those groups have layer -1), and the base weights PEFT saved beside them, which must
    # equal the model's (checked once, at the first upload: ``vocab_checked``).
    vocab: frozenset[str] = frozenset()
    vocab_bases: tuple[TensorEntry, ...] = ()
    vocab_checked: bool = False
    # Trained copies of whole modules (``modules_to_save``), in ``data`` beside the matrices
    # (so the tiers hold and count them like the matrices; ``saved_modules``).
    saved: tuple[SavedEntry, ...] = ()
    # The adapter's vocabulary (0: the model's), and the rows of its resized embedding and
    # head past the model's, in ``data`` (``extra_vocab``; the base rows before them are
    # checked against the model's with ``vocab_bases``).
    vocab_size: int = 0
    extra_rows: tuple[ExtraEntry, ...] = ()
    pinned: bool = False
    # (sum, sum of |x|) of the matrices cast to a pool dtype, kept after the first upload: the
    # data never changes, so a later upload from the CPU cache verifies against these.
    sums: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def view(self, e: TensorEntry, data: torch.Tensor | None = None) -> torch.Tensor:
        """Entry ``e`` as a tensor over ``data`` (default: the host buffer; or a device copy)."""
        buf = self.data if data is None else data
        return buf[e.start : e.end].view(e.dtype).view(e.shape)

    def magnitude(self, e: MagnitudeEntry, data: torch.Tensor | None = None) -> torch.Tensor:
        """Magnitude vector ``e`` [out] over ``data`` (default: the host buffer)."""
        buf = self.data if data is None else data
        return buf[e.start : e.end].view(e.dtype)

    def first_non_finite(
        self, data: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> str | None:
        """Key of the first matrix (or trained copy) holding NaN or Inf (after a cast to
        ``dtype``), if any."""
        buf = self.data if data is None else data
        views = [(e.key, self.view(e, buf)) for e in self.entries]
        views += [(e.key, e.view(buf)) for e in self.saved]
        views += [(e.key, e.view(buf)) for e in self.extra_rows]
        for key, t in views:
            if not bool(torch.isfinite(t if dtype is None else t.to(dtype)).all()):
                return key
        return None


def _fail(name: str, fld: str, msg: str) -> AdapterValidationError:
    return AdapterValidationError(name, fld, msg)


_REFUSED_TARGETS = {"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"}
_VOCAB_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
# The vocabulary modules a LoRA may target on a pool that holds them (``LoraPool.vocab``):
# module -> (pool part, file key prefix).
VOCAB_MODULES = {
    "embed_tokens": ("embed", "base_model.model.model.embed_tokens"),
    "lm_head": ("head", "base_model.model.lm_head"),
}


def _matches(spec: str | list[str], key: str) -> bool:
    """PEFT's rule: a string is a regular expression over the whole module name; a list entry
    names the module or a dotted suffix of it."""
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith("." + e) for e in spec)


def target_set(
    name: str, cfg_json: dict[str, Any], cfg: ModelConfig, *, vocab: bool = False
) -> set[tuple[int, str]]:
    """The (layer, module) pairs the adapter targets, resolved exactly as PEFT resolves them
    (``peft.tuners.tuners_utils.check_target_module_exists``): exclude_modules first, then
    target_modules, with layers_to_transform applied only to a list of module names.

    With ``vocab``, ``embed_tokens`` and ``lm_head`` may be targeted too, as ``(-1, name)``
    (``VOCAB_MODULES``); without it they are refused by name. They have no layer index, so a
    list target_modules with layers_to_transform leaves them, as PEFT does."""
    raw = cfg_json.get("target_modules")
    layers = cfg_json.get("layers_to_transform")
    if isinstance(layers, bool) or not (
        layers is None
        or isinstance(layers, int)
        or (
            isinstance(layers, list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        )
    ):
        raise _fail(
            name, "layers_to_transform", f"must be a layer index or a list of them, got {layers!r}"
        )
    layer_ids: set[int] | None = (
        {layers} if isinstance(layers, int) else (set(layers) if layers else None)
    )
    if layer_ids is not None:
        bad_layers = sorted(x for x in layer_ids if not 0 <= x < cfg.num_layers)
        if bad_layers:
            raise _fail(
                name,
                "layers_to_transform",
                f"layers {bad_layers} do not exist (model has {cfg.num_layers})",
            )
    pattern = cfg_json.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise _fail(
            name,
            "layers_pattern",
            f"{pattern!r} names no layer list of the base model (only 'layers')",
        )
    exclude = cfg_json.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, (str, list)):
        raise _fail(
            name, "exclude_modules", f"must be a list of module names or a string, got {exclude!r}"
        )
    if isinstance(exclude, str):
        try:
            re.compile(exclude)
        except re.error as e:
            raise _fail(name, "exclude_modules", f"invalid regular expression: {e}") from None
    modules = cfg.adapter_modules
    full = {
        (layer, m): f"model.layers.{layer}.{_PARENTS[m]}.{m}"
        for layer in range(cfg.num_layers)
        for m in modules
    }
    if raw == "all-linear":
        raw = list(modules)  # PEFT expands it to every linear but the output head
    if isinstance(raw, str):
        if layer_ids is not None:
            raise _fail(
                name,
                "layers_to_transform",
                "cannot be combined with a regular-expression target_modules",
            )
        try:
            re.compile(raw)
        except re.error as e:
            raise _fail(name, "target_modules", f"invalid regular expression: {e}") from None
        for short, path in _REFUSED_TARGETS.items():
            if re.fullmatch(raw, path) and not vocab:
                raise _fail(
                    name,
                    "target_modules",
                    f"{raw!r} targets {short}: adapters on {short} are not implemented",
                )
    elif isinstance(raw, list) and raw:
        for entry in raw:
            if not isinstance(entry, str):
                raise _fail(name, "target_modules", f"entries must be strings, got {entry!r}")
            on_vocab = False
            for short, path in _REFUSED_TARGETS.items():
                if entry == path or path.endswith("." + entry) or entry.endswith(short):
                    if not vocab:
                        raise _fail(
                            name,
                            "target_modules",
                            f"{entry!r}: adapters on {short} are not implemented",
                        )
                    on_vocab = True
            if not on_vocab and not any(
                path == entry or path.endswith("." + entry) for path in full.values()
            ):
                raise _fail(
                    name,
                    "target_modules",
                    f"{entry!r} is not a module of the base model (supported: {', '.join(modules)})",
                )
    else:
        raise _fail(name, "target_modules", "must be a non-empty list of module names or a string")
    out: set[tuple[int, str]] = set()
    for k, path in full.items():
        if exclude and _matches(exclude, path):
            continue
        if isinstance(raw, str):
            hit = _matches(raw, path)
        elif path in raw:
            hit = True  # a full module name: PEFT skips the layer filter
        else:
            hit = _matches(raw, path) and (layer_ids is None or k[0] in layer_ids)
        if hit:
            out.add(k)
    if vocab:
        for short, path in _REFUSED_TARGETS.items():
            if exclude and _matches(exclude, path):
                continue
            if isinstance(raw, str):
                hit = _matches(raw, path)
            else:
                hit = path in raw or (_matches(raw, path) and layer_ids is None)
            if hit:
                out.add((-1, short))
    if not out:
        raise _fail(
            name,
            "target_modules",
            f"{raw!r} matches no module of the base model (after exclude_modules and layers_to_transform)",
        )
    return out


def _pattern_value(name: str, fld: str, pattern: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first pattern whose regex matches a dotted suffix of ``key``."""
    for pat, val in pattern.items():
        try:
            if re.match(rf"(.*\.)?({pat})$", key):
                return val
        except re.error as e:
            raise _fail(name, fld, f"invalid regular expression {pat!r}: {e}") from None
    return default


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_adapter(
    name: str,
    path: Path,
    cfg: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool,
    *,
    per_module: bool = False,
    fold_scales: bool = True,
    extra_vocab: int = 0,
) -> CpuAdapter:
    """Read, validate and pack one PEFT adapter directory. Raises AdapterValidationError.

    Every adapter_config.json field is honoured or refused by name (``model_fields``). With
    ``per_module`` (LoRA pool slots), a rank_pattern or alpha_pattern is honoured: each module
    keeps its own rank (zero-padded in the slot to the largest) and its own scale, folded into
    its B matrix (the slot's scale is then 1; ``fold_scales=False`` leaves B as stored, for a
    merge that reads ``module_scales`` instead, never for a slot). Without it (AdaFuse experts, which share one rank
    and one scale across the set) a pattern is refused. ``extra_vocab``: the most vocabulary
    rows past the model's the adapter may bring (a resized embedding and head,
    ``extra_vocab.take_vocab_weights``).
    """
    if not path.is_dir():
        raise AdapterNotFoundError(name, f"no adapter directory at {path}")
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterNotFoundError(name, f"{path} has no adapter_config.json")
    try:
        cj = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise _fail(name, "adapter_config.json", f"unreadable: {e}") from None
    if not isinstance(cj, dict):
        raise _fail(name, "adapter_config.json", "must hold a JSON object")
    bad = check_adapter_config(cj)
    if bad is not None:
        raise _fail(name, *bad)
    r = cj.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(name, "r", f"must be a positive integer, got {r!r}")
    alpha = cj.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _fail(name, "lora_alpha", f"must be a number, got {alpha!r}")
    use_rslora = cj.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(name, "use_rslora", f"must be a boolean, got {use_rslora!r}")
    patterns: dict[str, dict[str, Any]] = {}
    for fld in ("rank_pattern", "alpha_pattern"):
        pat = cj.get(fld) or {}
        if not isinstance(pat, dict):
            raise _fail(name, fld, f"must be an object of pattern -> value, got {pat!r}")
        for k, v in pat.items():
            ok = (
                isinstance(v, int) and not isinstance(v, bool) and v >= 1
                if fld == "rank_pattern"
                else _is_number(v)
            )
            if not ok:
                raise _fail(
                    name,
                    fld,
                    f"{k!r}: {v!r} is not a valid {'rank' if fld == 'rank_pattern' else 'alpha'}",
                )
        if pat and not per_module:
            raise _fail(
                name,
                fld,
                f"{pat!r} is not implemented here: every AdaFuse expert has one rank and one scale",
            )
        patterns[fld] = pat
    targets = target_set(name, cj, cfg, vocab=per_module)
    try:
        sites = resolve_saved(cj.get("modules_to_save"), cfg)
    except ValueError as e:
        raise _fail(name, "modules_to_save", str(e)) from None
    if sites and not per_module:
        raise _fail(
            name, "modules_to_save", "trained copies are not implemented for AdaFuse experts"
        )
    if sites:
        targets = _without_saved(name, cj, targets, {s.path for s in sites})
    vocab_targets = sorted(m for layer, m in targets if layer < 0)
    copied = frozenset(s.module for s in sites if s.module in VOCAB_MODULES)
    try:
        tokens = trainable_tokens(
            cj.get("trainable_token_indices"),
            per_module=per_module,
            copied=copied,
            lora=frozenset(vocab_targets),
        )
    except VocabError as e:
        raise _fail(name, e.field, str(e)) from None
    targets = {(layer, m) for layer, m in targets if layer >= 0}
    fused = sorted({m for _, m in targets if m in FUSED_MODULES})
    dora = cj.get("use_dora") is True
    if dora and not per_module:
        raise _fail(name, "use_dora", "True is not implemented for AdaFuse experts")
    if dora and vocab_targets:
        raise _fail(
            name,
            "use_dora",
            f"True with target_modules on {', '.join(vocab_targets)} is not implemented "
            "(DoRA is served on the projection modules only)",
        )
    if fused and not per_module:
        raise _fail(
            name,
            "target_modules",
            f"{fused[0]!r}: AdaFuse experts on a fused module are not implemented",
        )
    # (layer, module) -> (rank, scale), as PEFT's LoraModel._create_and_replace picks them;
    # the vocabulary modules under layer -1.
    per: dict[tuple[int, str], tuple[int, float]] = {}
    for layer, m in [*targets, *((-1, v) for v in vocab_targets)]:
        key = _VOCAB_PATHS[m] if layer < 0 else f"model.layers.{layer}.{_PARENTS[m]}.{m}"
        rm = int(_pattern_value(name, "rank_pattern", patterns["rank_pattern"], key, r))
        am = float(_pattern_value(name, "alpha_pattern", patterns["alpha_pattern"], key, alpha))
        per[(layer, m)] = (rm, am / (math.sqrt(rm) if use_rslora else rm))
    slot_rank = max(rm for rm, _ in per.values())
    if slot_rank > max_rank:
        fld = "r" if slot_rank == r else "rank_pattern"
        raise _fail(name, fld, f"rank {slot_rank} exceeds the engine's max_lora_rank {max_rank}")
    scales = {sc for _, sc in per.values()}
    fold = len(scales) > 1 and fold_scales
    scale = 1.0 if fold else next(iter(scales))

    header, data, wfld = _read_weights_file(name, path, pin_memory)
    try:
        vw = take_vocab_weights(
            header,
            data,
            cfg,
            copied=copied,
            lora=frozenset(vocab_targets),
            limit=extra_vocab,
            wfld=wfld,
            per_module=per_module,
            tokens=tokens,
        )
    except VocabError as e:
        raise _fail(name, e.field, str(e)) from None
    entries: list[TensorEntry] = []
    magnitudes: list[MagnitudeEntry] = []
    target_modules = {sub for _, m in targets for sub in FUSED_MODULES.get(m, (m,))}
    for layer, m in sorted(targets):
        prefix = f"base_model.model.model.layers.{layer}.{_PARENTS[m]}.{m}"
        fi, fo = cfg.module_shape(m)
        rm, sm = per[(layer, m)]
        for suffix, shape in ((".lora_A.weight", (rm, fi)), (".lora_B.weight", (fo, rm))):
            key = prefix + suffix
            h = header.pop(key, None)
            if h is None:
                raise _fail(name, wfld, f"missing tensor {key}")
            dt, got_shape, start, end = h
            if got_shape != shape:
                raise _fail(
                    name, wfld, f"tensor {key} has shape {got_shape}, expected {shape} (rank {rm})"
                )
            is_b = suffix == ".lora_B.weight"
            if fold and is_b:
                data[start:end].view(dt).mul_(sm)  # this module's scale rides in its B
            entries.extend(_split_entry(cfg, key, m, layer, is_b, dt, shape, start))
        if dora:
            magnitudes.extend(_magnitude_entries(cfg, name, wfld, header, prefix, m, layer, fo))
    vocab_bases = [
        TensorEntry(b.key, b.part, 0, -1, False, b.dtype, b.shape, b.start, b.end) for b in vw.bases
    ]
    for m in vocab_targets:
        part, prefix = VOCAB_MODULES[m]
        rm, sm = per[(-1, m)]
        v, hid = vw.rows, cfg.hidden_size
        # PEFT names an embedding's factors lora_embedding_A [r, V] / _B [H, r]; the head is
        # a Linear (lora_A [r, H], lora_B [V, r]); V is the adapter's vocabulary.
        pairs = (
            ((".lora_embedding_A", (rm, v), False), (".lora_embedding_B", (hid, rm), True))
            if m == "embed_tokens"
            else ((".lora_A.weight", (rm, hid), False), (".lora_B.weight", (v, rm), True))
        )
        for suffix, shape, is_b in pairs:
            key = prefix + suffix
            h = header.pop(key, None)
            if h is None:
                raise _fail(name, wfld, f"missing tensor {key}")
            dt, got_shape, start, end = h
            if got_shape != shape:
                more = f", vocabulary {v}" if v != cfg.vocab_size else ""
                raise _fail(
                    name,
                    wfld,
                    f"tensor {key} has shape {got_shape}, expected {shape} (rank {rm}{more})",
                )
            if fold and is_b:
                data[start:end].view(dt).mul_(sm)
            entries.append(TensorEntry(key, part, 0, -1, is_b, dt, shape, start, end))
    try:
        saved = take_copies(header, sites, wfld, vw.rows)
    except ValueError as e:
        raise _fail(name, "modules_to_save", str(e)) from None
    if header:
        extra = sorted(header)[0]
        why = (
            "a bias or a saved module"
            if not extra.endswith((".lora_A.weight", ".lora_B.weight"))
            else "not in target_modules of the base model"
        )
        raise _fail(name, wfld, f"unexpected tensor {extra} ({why}): refused rather than ignored")
    spans = sorted((e.start, e.end) for e in entries)
    tiles = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    uniform = bool(entries) and tiles and spans[0][0] == 0 and spans[-1][1] == data.numel()
    uniform = uniform and len({e.dtype for e in entries}) == 1 and not saved and not vw.extra
    cpu = CpuAdapter(
        name=name,
        path=path,
        rank=slot_rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        scale=scale,
        targets=frozenset(target_modules),
        groups=frozenset(MODULE_TO_GROUP[m][0] for m in target_modules),
        data=data,
        entries=tuple(entries),
        uniform=uniform,
        nbytes=data.numel(),
        magnitudes=tuple(magnitudes),
        module_scales={
            f"base_model.model.model.layers.{layer}.{_PARENTS[m]}.{m}": rs
            for (layer, m), rs in per.items()
            if layer >= 0
        },
        vocab=frozenset(VOCAB_MODULES[m][0] for m in vocab_targets),
        vocab_bases=tuple(vocab_bases),
        saved=tuple(saved),
        vocab_size=vw.rows,
        extra_rows=vw.extra,
    )
    for me in cpu.magnitudes:
        if not bool(torch.isfinite(cpu.magnitude(me)).all()):
            raise _fail(name, wfld, f"tensor {me.key} holds NaN or Inf")
    if not pin_memory and not _all_finite(cpu, dtype):
        # Without a GPU the slot copy cannot check finiteness on the device; check here, once.
        raise _fail(name, wfld, f"tensor {cpu.first_non_finite(data, dtype)} holds NaN or Inf")
    return cpu


def _target_path(layer: int, module: str) -> str:
    return (
        _VOCAB_PATHS[module] if layer < 0 else f"model.layers.{layer}.{_PARENTS[module]}.{module}"
    )


def _without_saved(
    name: str, cj: dict[str, Any], targets: set[tuple[int, str]], saved_paths: set[str]
) -> set[tuple[int, str]]:
    """``targets`` less the modules PEFT puts no LoRA on because ``modules_to_save`` names
    them; a module that keeps a LoRA and is also copied (an entry that is only a suffix of its
    name, such as ``head``) is refused."""
    raw = cj.get("modules_to_save")
    kept = {t for t in targets if not excluded_from_lora(raw, _target_path(*t))}
    both = sorted(_target_path(*t) for t in kept if _target_path(*t) in saved_paths)
    if both:
        raise _fail(
            name,
            "modules_to_save",
            f"copies {both[0]}, which target_modules also puts a LoRA on",
        )
    if not kept:
        raise _fail(
            name,
            "target_modules",
            f"{cj.get('target_modules')!r} leaves no module with a LoRA once modules_to_save's "
            "modules are left out (as PEFT leaves them)",
        )
    return kept


def _magnitude_entries(
    cfg: ModelConfig,
    name: str,
    wfld: str,
    header: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]],
    prefix: str,
    module: str,
    layer: int,
    out_features: int,
) -> list[MagnitudeEntry]:
    """The DoRA magnitude vector of one targeted module, taken out of ``header``. A fused
    module's (Phi-3) vector splits by output rows like its B: each row's norm is of that row
    of ``W + scale B A`` alone, so every slice keeps its rows' magnitudes."""
    key = prefix + ".lora_magnitude_vector"
    h = header.pop(key, None)
    if h is None:
        raise _fail(name, wfld, f"missing tensor {key} (use_dora is true)")
    dt, got_shape, start, _ = h
    if got_shape != (out_features,):
        raise _fail(name, wfld, f"tensor {key} has shape {got_shape}, expected ({out_features},)")
    out = []
    row = 0
    for sub in FUSED_MODULES.get(module, (module,)):
        g, i = MODULE_TO_GROUP[sub]
        n = cfg.module_shape(sub)[1] if sub != module else out_features
        lo = start + row * dt.itemsize
        out.append(MagnitudeEntry(key, g, i, layer, dt, n, lo, lo + n * dt.itemsize))
        row += n
    return out


def _split_entry(
    cfg: ModelConfig,
    key: str,
    module: str,
    layer: int,
    is_b: bool,
    dt: torch.dtype,
    shape: tuple[int, int],
    start: int,
) -> list[TensorEntry]:
    """The pool entries of one file matrix. A fused module's (Phi-3 qkv_proj, gate_up_proj)
    adapter computes ``B (A x)`` for the stacked output; each slice's rows of it are
    ``B_rows (A x)``, so every slice gets the shared A and its own row block of B (rows of a
    row-major B are one contiguous byte range)."""
    parts = FUSED_MODULES.get(module, (module,))
    out: list[TensorEntry] = []
    row = 0
    for sub in parts:
        g, i = MODULE_TO_GROUP[sub]
        if not is_b:
            out.append(
                TensorEntry(
                    key,
                    g,
                    i,
                    layer,
                    False,
                    dt,
                    shape,
                    start,
                    start + shape[0] * shape[1] * dt.itemsize,
                )
            )
            continue
        n = cfg.module_shape(sub)[1] if len(parts) > 1 else shape[0]
        lo = start + row * shape[1] * dt.itemsize
        out.append(
            TensorEntry(
                key, g, i, layer, True, dt, (n, shape[1]), lo, lo + n * shape[1] * dt.itemsize
            )
        )
        row += n
    return out


def _read_weights_file(
    name: str, path: Path, pin_memory: bool
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], torch.Tensor, str]:
    """The adapter's tensors from adapter_model.safetensors, else adapter_model.bin (PEFT's
    order), with the file name used in errors."""
    st_path = path / "adapter_model.safetensors"
    if st_path.is_file():
        return (*_read_safetensors(name, st_path, pin_memory), st_path.name)
    bin_path = path / "adapter_model.bin"
    if bin_path.is_file():
        return (*_read_bin(name, bin_path, pin_memory), bin_path.name)
    raise _fail(
        name, "adapter_model.safetensors", "file is missing (and there is no adapter_model.bin)"
    )


def _read_bin(
    name: str, path: Path, pin_memory: bool
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], torch.Tensor]:
    """A pickled state dict, loaded with ``weights_only=True`` (no code runs), packed into one
    buffer in the layout ``_read_safetensors`` returns."""
    fld = path.name
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle and zip errors have no common base class
        raise _fail(name, fld, f"unreadable or not a weights-only state dict: {e}") from None
    if not isinstance(sd, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        raise _fail(name, fld, "must hold a dict of tensor name -> tensor")
    dtypes = set(_ST_DTYPES.values())
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    offset = 0
    for key, t in sd.items():
        if t.dtype not in dtypes:
            raise _fail(name, fld, f"tensor {key}: unsupported dtype {t.dtype}")
        align = -offset % t.element_size()
        offset += align
        n = t.numel() * t.element_size()
        out[key] = (t.dtype, tuple(t.shape), offset, offset + n)
        offset += n
    data = torch.zeros(offset, dtype=torch.uint8, pin_memory=pin_memory)
    for key, t in sd.items():
        _, _, start, end = out[key]
        data[start:end].view(t.dtype).copy_(t.contiguous().reshape(-1))
    return out, data


# Exponent bits of each float format: all ones means Inf or NaN.
_EXP_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def _all_finite(cpu: CpuAdapter, dtype: torch.dtype) -> bool:
    """Host-side finiteness of every matrix (as cast to ``dtype``), by integer ops on the bits:
    several times faster on a CPU than isfinite or a float64 sum over bf16."""
    if not cpu.uniform:
        return cpu.first_non_finite(cpu.data, dtype) is None
    src = cpu.entries[0].dtype
    if src.itemsize > dtype.itemsize:  # a narrowing cast can overflow to Inf
        return bool(torch.isfinite(cpu.data.view(src).to(dtype)).all())
    int_t, mask = _EXP_BITS[src]
    bits = cpu.data.view(int_t)
    return not bool(((bits & mask) == mask).any())


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_MAX_HEADER = 100 << 20


def _read_safetensors(
    name: str, path: Path, pin_memory: bool
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], torch.Tensor]:
    """Header ``key -> (dtype, shape, start, end)`` and the whole data section in one buffer.

    One read into one (pinned) buffer instead of a tensor per matrix: the buffer is what the
    CPU cache keeps and what one host-to-device copy moves. Corrupt or truncated files are
    rejected here; the layout is the documented safetensors one (an 8-byte little-endian
    header length, a JSON header, then the data section).
    """
    fld = "adapter_model.safetensors"
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(name, fld, "corrupt or truncated: shorter than a safetensors header")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise _fail(
                    name, fld, f"corrupt or truncated: header length {n} does not fit the file"
                )
            raw = json.loads(f.read(n))
            data_len = size - 8 - n
            data = torch.empty(data_len, dtype=torch.uint8, pin_memory=pin_memory)
            view = memoryview(data.numpy())  # type: ignore[arg-type]
            got = 0
            while got < data_len:
                k = f.readinto(view[got:])
                if not k:
                    raise _fail(name, fld, "corrupt or truncated: the file shrank while being read")
                got += k
    except OSError as e:
        raise _fail(name, fld, f"unreadable: {e}") from None
    except ValueError as e:
        raise _fail(name, fld, f"corrupt or truncated: {e}") from None
    if not isinstance(raw, dict):
        raise _fail(name, fld, "corrupt or truncated: the header is not a JSON object")
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for key, info in raw.items():
        if key == "__metadata__":
            continue
        try:
            dt = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _fail(
                name, fld, f"tensor {key}: unsupported dtype or malformed header entry {info!r}"
            ) from None
        numel = math.prod(shape)
        if not 0 <= start <= end or end - start != numel * dt.itemsize or start % dt.itemsize:
            raise _fail(
                name, fld, f"corrupt or truncated: tensor {key} has inconsistent data offsets"
            )
        if end > data_len:
            raise _fail(
                name, fld, f"corrupt or truncated: tensor {key} lies past the end of the file"
            )
        out[key] = (dt, shape, start, end)
    return out, data


def entry_sums(cpu: CpuAdapter, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[sum, sum of |x|] (float64) of every matrix cast to ``dtype``; non-finite iff some
    element is NaN or Inf (float64 cannot overflow on sums of 16/32-bit floats)."""
    if cpu.uniform:
        t = data.view(cpu.entries[0].dtype)
        if t.dtype != dtype:
            t = t.to(dtype)
        return torch.stack([t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)])
    parts = [cpu.view(e, data).to(dtype) for e in cpu.entries]
    parts += [e.view(data).to(dtype) for e in cpu.saved]
    parts += [e.view(data).to(dtype) for e in cpu.extra_rows]
    return torch.stack(
        [
            torch.stack([p.sum(dtype=torch.float64) for p in parts]).sum(),
            torch.stack([p.abs().sum(dtype=torch.float64) for p in parts]).sum(),
        ]
    )
