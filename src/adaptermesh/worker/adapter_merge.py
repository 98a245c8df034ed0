"""Per-request merges of several LoRA adapters into one (the ``merged_adapters`` body field).

A merge names its parts (adapter ids), one weight per part and a method. The methods are those
of PEFT's ``LoraModel.add_weighted_adapter`` that work on the LoRA factors themselves (not on
the dense delta weight followed by an SVD):

=================  ====================================  ===================================
``merge_strategy``  PEFT ``combination_type``            options
=================  ====================================  ===================================
``linear``         ``linear``                            none
``ties``           ``ties``                              ``density``, ``majority_sign_method``
``dare_linear``    ``dare_linear``                       ``density``, ``seed``
``dare_ties``      ``dare_ties``                         ``density``, ``majority_sign_method``, ``seed``
``magnitude_prune``  ``magnitude_prune``                 ``density``
=================  ====================================  ===================================

For every module some part targets, each part that targets it contributes
``sign(w s) sqrt(|w s|) A`` to the merged A and ``sqrt(|w s|) B`` to the merged B, where ``w``
is its weight and ``s`` its own scale there (``lora_alpha / r``, rsLoRA and patterns applied);
A and B are then combined separately by the method (a weighted sum; TIES: each factor pruned
to its ``density`` largest magnitudes, a sign elected per element and the agreeing entries
averaged; DARE: entries dropped at random with keep probability ``density`` and the rest
rescaled by ``1/density``). Every part must have one rank across its modules and all parts
the same rank (as PEFT requires for these methods). The merged adapter's config is PEFT's:
the first part's, with ``r`` and ``lora_alpha`` that rank, no rank or alpha patterns, and the
union of the parts' ``target_modules`` (the first part's ``exclude_modules`` and
``layers_to_transform`` still apply; its ``use_rslora`` too, so the merged scale is then
``sqrt(r)``).

DARE's random drops come from a CPU generator seeded with ``seed`` (default 0), drawn in
PEFT's order (modules in the model's order, A before B, parts in request order), so the same
request always builds the same adapter, and it equals PEFT's result when torch's global
generator is seeded with ``seed`` just before PEFT merges the first module (PEFT draws from
the global generator, which its own initialisation of the new adapter also uses).

The merged adapter is written as an ordinary PEFT directory and then served like any other
adapter by the adapter manager (``AdapterManager.merged``): its name is ``merged-<hash>`` of
its parts' paths and file versions, the weights, the method and its options.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from adaptermesh.worker.merge_spec import (
    DEFAULT_MAX_PARTS,
    MAJORITY_SIGN_METHODS,
    MERGE_FIELD,
    MERGE_STRATEGIES,
    PRUNED,
    RANDOM,
    SIGNED,
    MergeSpec,
    MergeSpecError,
    parse_merge_spec,
)
from adaptermesh.worker.model import ModelConfig
from adaptermesh.worker.peft_adapter import (
    _PARENTS,
    AdapterValidationError,
    CpuAdapter,
    read_adapter,
    target_set,
)

__all__ = [
    "DEFAULT_MAX_PARTS",
    "MAJORITY_SIGN_METHODS",
    "MERGE_FIELD",
    "MERGE_STRATEGIES",
    "MergeSpec",
    "MergeSpecError",
    "build_merged",
    "merge_factors",
    "mergeable_as_cached",
    "merged_config",
    "merged_name",
    "parse_merge_spec",
    "part_etag",
    "read_part",
]

# Module order within a decoder layer as the checkpoints define them (PEFT visits modules in
# ``named_modules`` order, which fixes DARE's draws): Phi-3 defines o_proj before qkv_proj.
MERGED_PREFIX = "merged-"
_MODULE_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)


def part_etag(path: Path) -> str:
    """A version of the adapter directory at ``path``: its files' sizes and modification
    times (a reload from new files changes it; the same files keep it)."""
    parts = []
    for fname in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            st = os.stat(path / fname)
        except OSError:
            continue
        parts.append(f"{fname}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def merged_name(spec: MergeSpec, parts: list[tuple[str, Path, str]]) -> str:
    """``merged-<hash>`` of the parts (name, path, version), the weights and the options."""
    key = {
        "parts": [[n, str(p), v, w] for (n, p, v), w in zip(parts, spec.weights, strict=True)],
        **spec.options(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return MERGED_PREFIX + digest[:32]


# ---- the math (PEFT's definitions) ----------------------------------------------------------


def _magnitude_prune(t: torch.Tensor, density: float) -> torch.Tensor:
    flat = t.reshape(-1)
    mask = torch.zeros_like(flat)
    k = int(density * t.numel())
    mask[torch.topk(flat.abs(), k=k, largest=True).indices] = 1
    return t * mask.reshape(t.shape)


def _random_prune(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    mask = torch.bernoulli(torch.full_like(t, density), generator=gen)
    return t * mask / density


def merge_factors(
    tensors: list[torch.Tensor],
    weights: list[float],
    strategy: str,
    density: float,
    majority_sign_method: str,
    gen: torch.Generator | None,
) -> torch.Tensor:
    """One merged factor (all of A, or all of B) from the parts' factors and their weights."""
    if strategy in PRUNED and density < 1:
        if strategy in RANDOM:
            if gen is None:
                raise ValueError("a DARE merge needs a generator")
            tensors = [_random_prune(t, density, gen) for t in tensors]
        else:
            tensors = [_magnitude_prune(t, density) for t in tensors]
    stacked = torch.stack(tensors, dim=0)
    w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device).view(
        -1, *([1] * (stacked.dim() - 1))
    )
    if strategy in SIGNED:
        sign = stacked.sign()
        mass = stacked.sum(dim=0) if majority_sign_method == "total" else sign.sum(dim=0)
        agree = sign == torch.where(mass >= 0, 1, -1)
        kept = (stacked * w * agree).sum(dim=0)
        return kept / torch.clamp(agree.sum(dim=0), min=1.0)
    return (stacked * w).sum(dim=0)


# ---- building a merged adapter directory ----------------------------------------------------


def _factor(cpu: CpuAdapter, key: str, data: torch.Tensor) -> torch.Tensor:
    """The whole file matrix ``key`` over ``data`` (the part's buffer, on the merge's device),
    in fp32 (a fused module's B is split over its slices in ``entries``)."""
    es = [e for e in cpu.entries if e.key == key]
    if not es[0].is_b:
        return cpu.view(es[0], data).float()
    lo, hi = min(e.start for e in es), max(e.end for e in es)
    return data[lo:hi].view(es[0].dtype).view(-1, es[0].shape[1]).float()


def read_part(name: str, path: Path, cfg: ModelConfig, max_rank: int) -> CpuAdapter:
    """One part, validated as the adapter manager validates a load, with B as stored."""
    cpu = read_adapter(
        name, path, cfg, max_rank, torch.float32, False, per_module=True, fold_scales=False,
        extra_vocab=1 << 30,  # refused below, by name
    )  # fmt: skip
    if cpu.vocab_size > cfg.vocab_size or cpu.vocab_bases:
        raise AdapterValidationError(
            name,
            "adapter_model.safetensors",
            f"adapters with saved embedding or head weights (a resized vocabulary) cannot be "
            f"parts of {MERGE_FIELD}",
        )
    if cpu.magnitudes:
        raise AdapterValidationError(
            name, "use_dora", f"DoRA adapters cannot be parts of {MERGE_FIELD}"
        )
    if cpu.vocab:
        raise AdapterValidationError(
            name,
            "target_modules",
            f"adapters on embed_tokens or lm_head cannot be parts of {MERGE_FIELD}",
        )
    if cpu.saved:
        raise AdapterValidationError(
            name,
            "modules_to_save",
            f"adapters with trained module copies cannot be parts of {MERGE_FIELD}",
        )
    return cpu


def mergeable_as_cached(cpu: CpuAdapter) -> bool:
    """Whether an adapter as the adapter manager caches it can be a part as it is: no DoRA
    vectors and one scale over its modules (so no scale was folded into its B matrices)."""
    one_scale = len({sc for _, sc in cpu.module_scales.values()}) == 1
    plain = not cpu.magnitudes and not cpu.vocab and not cpu.saved and not cpu.vocab_bases
    return plain and one_scale


def _config(part: CpuAdapter) -> dict[str, Any]:
    cj = json.loads((part.path / "adapter_config.json").read_text())
    assert isinstance(cj, dict)  # read_adapter checked it
    return cj


def _union_targets(
    parts: list[CpuAdapter], configs: list[dict[str, Any]], cfg: ModelConfig
) -> str | list[str]:
    """The merged adapter's ``target_modules`` as PEFT forms it: the union of the parts' module
    names, or the alternation of their regular expressions."""
    raw = [c.get("target_modules") for c in configs]
    regex = [isinstance(t, str) and t != "all-linear" for t in raw]
    if any(regex) and not all(regex):
        raise MergeSpecError(
            f"{MERGE_FIELD}.ids",
            "mixes adapters whose target_modules is a regular expression ("
            + ", ".join(p.name for p, r in zip(parts, regex, strict=True) if r)
            + ") with adapters that list module names; PEFT merges one kind only",
        )
    if all(regex):
        return "|".join(f"({t})" for t in raw)
    names: set[str] = set()
    for t in raw:
        # PEFT expands "all-linear" to every linear module of the model but the head.
        names |= set(cfg.adapter_modules if t == "all-linear" else t if isinstance(t, list) else ())
    return sorted(names)


def _prefix(layer: int, module: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_PARENTS[module]}.{module}"


def merged_config(
    parts: list[CpuAdapter], cfg: ModelConfig, base_model: str = ""
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """The merged adapter's adapter_config.json and the (layer, module) pairs it covers, in
    the model's module order, as PEFT's ``add_weighted_adapter`` makes them: the first part's
    config with ``r`` and ``lora_alpha`` the common rank, no rank or alpha patterns and the
    union of the parts' target_modules (the first part's exclude_modules and
    layers_to_transform still apply)."""
    ranks = [_part_rank(p) for p in parts]
    if len(set(ranks)) > 1:
        raise MergeSpecError(
            f"{MERGE_FIELD}.ids",
            "the adapters have ranks "
            + ", ".join(f"{p.name}: {r}" for p, r in zip(parts, ranks, strict=True))
            + "; these merge methods combine adapters of one rank",
        )
    configs = [_config(p) for p in parts]
    cj = {
        **configs[0],
        "r": ranks[0],
        "lora_alpha": ranks[0],
        "target_modules": _union_targets(parts, configs, cfg),
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    if base_model:
        cj["base_model_name_or_path"] = base_model
    order = {m: i for i, m in enumerate(_MODULE_ORDER)}
    covered = sorted(target_set(MERGED_PREFIX, cj, cfg), key=lambda k: (k[0], order[k[1]]))
    return cj, covered


def _part_rank(p: CpuAdapter) -> int:
    """PEFT's rank of a part for these methods: ``r``, or the largest of ``r`` and its
    rank_pattern (the merged adapter's A and B have that many rows / columns; a part's module
    of a smaller rank does not fit them, so such a part is refused)."""
    ranks = {r for r, _ in p.module_scales.values()}
    if len(ranks) > 1 or next(iter(ranks)) != p.rank:
        raise AdapterValidationError(
            p.name,
            "rank_pattern",
            f"modules of ranks {sorted(ranks)}: a part of {MERGE_FIELD} needs one rank "
            "across its modules",
        )
    return p.rank


def _weights(part: CpuAdapter, prefix: str, weight: float) -> tuple[float, float] | None:
    """PEFT's (A, B) weights of a part at a module: ``sign(w s) sqrt(|w s|)`` and
    ``sqrt(|w s|)``; None where the part leaves the module."""
    rs = part.module_scales.get(prefix)
    if rs is None:
        return None
    ws = weight * rs[1]
    return math.sqrt(abs(ws)) * (1 if ws >= 0 else -1), math.sqrt(abs(ws))


@dataclass(slots=True)
class _Merge:
    """One merge's inputs (``parts`` with their data on the merge's device, in ``buffers``)
    and the merged tensors it writes into ``out``, by PEFT module name."""

    spec: MergeSpec
    strategy: str
    parts: list[CpuAdapter]
    buffers: list[torch.Tensor]
    cfg: ModelConfig
    dtype: torch.dtype
    out: dict[str, torch.Tensor] = field(default_factory=dict)

    def module(self, layer: int, module: str, gen: torch.Generator | None) -> None:
        """``merge_factors`` for ``module`` of ``layer``."""
        spec, parts, buffers = self.spec, self.parts, self.buffers
        prefix = _prefix(layer, module)
        wa, wb, fa, fb = [], [], [], []
        for p, buf, w in zip(parts, buffers, spec.weights, strict=True):
            ab = _weights(p, prefix, w)
            if ab is None:
                continue
            wa.append(ab[0])
            wb.append(ab[1])
            fa.append(_factor(p, prefix + ".lora_A.weight", buf))
            fb.append(_factor(p, prefix + ".lora_B.weight", buf))
        device = buffers[0].device
        rank = parts[0].rank
        fi, fo = self.cfg.module_shape(module)
        if not fa:  # covered by the merged config, targeted by no part: a zero update
            self.out[prefix + ".lora_A.weight"] = torch.zeros(
                rank, fi, dtype=self.dtype, device=device
            )
            self.out[prefix + ".lora_B.weight"] = torch.zeros(
                fo, rank, dtype=self.dtype, device=device
            )
            return
        for suffix, fs, ws_ in ((".lora_A.weight", fa, wa), (".lora_B.weight", fb, wb)):
            merged = merge_factors(
                fs, ws_, self.strategy, spec.density, spec.majority_sign_method, gen
            )
            self.out[prefix + suffix] = merged.to(self.dtype)

    def layers(self, layers: list[int], module: str) -> None:
        """``merge_factors`` for every layer in ``layers`` of ``module`` at once."""
        spec, parts, buffers, strategy = self.spec, self.parts, self.buffers, self.strategy
        device = buffers[0].device
        rank = parts[0].rank
        fi, fo = self.cfg.module_shape(module)
        for suffix, shape, idx in (
            (".lora_A.weight", (rank, fi), 0),
            (".lora_B.weight", (fo, rank), 1),
        ):
            stacked = torch.zeros(
                (len(parts), len(layers), *shape), dtype=torch.float32, device=device
            )
            w = torch.zeros((len(parts), len(layers)), dtype=torch.float32)
            for i, (p, buf, weight) in enumerate(zip(parts, buffers, spec.weights, strict=True)):
                for j, layer in enumerate(layers):
                    prefix = _prefix(layer, module)
                    ab = _weights(p, prefix, weight)
                    if ab is not None:
                        w[i, j] = ab[idx]
                        stacked[i, j] = _factor(p, prefix + suffix, buf)
            if strategy in PRUNED and spec.density < 1:
                flat = stacked.view(len(parts) * len(layers), -1)
                k = int(spec.density * flat.shape[1])  # PEFT's k, per matrix
                mask = torch.zeros_like(flat)
                mask.scatter_(1, torch.topk(flat.abs(), k=k, dim=1, largest=True).indices, 1.0)
                stacked = (flat * mask).view_as(stacked)
            wt = w.to(device).view(len(parts), len(layers), 1, 1)
            if strategy in SIGNED:
                sign = stacked.sign()
                mass = (
                    stacked.sum(dim=0) if spec.majority_sign_method == "total" else sign.sum(dim=0)
                )
                agree = sign == torch.where(mass >= 0, 1, -1)
                merged = (stacked * wt * agree).sum(dim=0) / torch.clamp(agree.sum(dim=0), min=1.0)
            else:
                merged = (stacked * wt).sum(dim=0)
            merged = merged.to(self.dtype)
            for j, layer in enumerate(layers):
                # A file tensor of its own.
                self.out[_prefix(layer, module) + suffix] = merged[j].clone()


def build_merged(
    spec: MergeSpec,
    parts: list[CpuAdapter],
    out_dir: Path,
    cfg: ModelConfig,
    base_model: str = "",
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Merge ``parts`` (``read_part``) by ``spec`` into a PEFT adapter directory at
    ``out_dir`` (written to a sibling and renamed, so a reader sees all of it or nothing),
    its tensors in ``dtype``. The maths runs on ``device`` (default the CPU); DARE draws
    from a generator there, as PEFT with its model on that device does. Returns seconds per
    phase (``merge``, ``write``)."""
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    config, covered = merged_config(parts, cfg, base_model)
    gen = None
    if spec.merge_strategy in RANDOM:
        gen = torch.Generator(device=device).manual_seed(spec.seed)
    buffers = [p.data.to(device, non_blocking=True) for p in parts]
    strategy = "linear" if len(parts) == 1 else spec.merge_strategy  # as PEFT does
    merge = _Merge(spec, strategy, parts, buffers, cfg, dtype)
    if strategy in RANDOM:
        # DARE: module by module, A before B, parts in order: PEFT's order of draws.
        for layer, module in covered:
            merge.module(layer, module, gen)
    else:
        # Deterministic methods: every layer of one module at once (one top-k per factor
        # kind instead of one per matrix); a part that leaves a layer enters as zeros with
        # weight 0, which changes no sum, no elected sign and no count of agreeing signs.
        by_module: dict[str, list[int]] = {}
        for layer, module in covered:
            by_module.setdefault(module, []).append(layer)
        for module, layers in by_module.items():
            merge.layers(layers, module)
    out = {k: v.to("cpu").contiguous() for k, v in merge.out.items()}
    t1 = time.perf_counter()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(out, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config))
        (tmp / "adaptermesh_merge.json").write_text(
            json.dumps(
                {"ids": list(spec.ids), "weights": list(spec.weights), **spec.options()},
                indent=1,
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"merge": t1 - t0, "write": time.perf_counter() - t1}
