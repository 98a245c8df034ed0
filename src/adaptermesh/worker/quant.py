"""Quantised base checkpoints: what ``quantization_config`` may say, and the weights it describes.

FP8 (e4m3 weights, ``torch.float8_e4m3fn``, with float scales; ``w = q.float() * scale``
broadcast over the scale's layout):

- ``fp8`` (transformers ``FineGrainedFP8Config``; DeepSeek-V3, Qwen3-FP8): ``weight_scale_inv``
  per ``weight_block_size`` block, ``[ceil(out / bo), ceil(in / bi)]`` (the name says "inv"
  but it multiplies, as transformers' ``Fp8Dequantize`` does), or one per-tensor scalar when
  ``weight_block_size`` is null. ``activation_scheme: static`` adds ``activation_scale``.
  Without ``modules_to_not_convert`` (or its alias ``ignored_layers``), ``lm_head`` stays
  unquantised (transformers' default skips); with a list, only the list is skipped.
- ``compressed-tensors`` float8 (``format: float-quantized``): ``weight_scale`` per tensor
  (one element) or per channel (``[out, 1]``); ``input_scale`` (one element) for static
  activations, nothing for dynamic ones; modules picked by each config group's ``targets``
  (``Linear``, an exact module name, or ``re:`` + a regex matched from the name's start)
  minus ``ignore``.

4-bit integer weights in groups of ``group_size`` inputs, ``w = (q - z) * s`` with ``q`` and
``z`` unsigned nibbles and ``s`` fp16 per (group, output):

- ``awq`` (AutoAWQ ``version: gemm``): ``qweight`` int32 ``[in, out / 8]`` packed along the
  outputs, nibble ``i`` of a word holding column ``8 j + (0, 2, 4, 6, 1, 3, 5, 7)[i]``;
  ``qzeros`` int32 ``[in / group, out / 8]`` packed the same way; ``scales`` ``[in / group,
  out]``. ``lm_head`` is never quantised; ``modules_to_not_convert`` skips by transformers' rule.
- ``gptq`` (AutoGPTQ / GPTQModel / optimum): ``qweight`` int32 ``[in / 8, out]`` packed along
  the inputs, nibble ``i`` holding input ``8 r + i``; ``qzeros`` int32 ``[ceil(in / group), out
  / 8]`` packed along the outputs in plain order, storing the zero point minus 1 in the
  ``gptq`` (v1) format and as is in ``gptq_v2``; ``scales`` ``[ceil(in / group), out]``;
  ``g_idx`` int32 ``[in]``, each input's group (act-order, ``desc_act: true``, permutes them;
  served as stored). ``sym: true`` is checked against the zero points (all ``2 ** (bits - 1)``).

Every field of each layout is read, harmless or refused by name (the tables below, in the
style of ``model_fields``). Refused by name: every other ``quant_method`` and every value
these layouts do not describe (other bit widths, AWQ's GEMV packings, Marlin tiles, ...).

The loaded form is an ``Fp8Weight`` or ``Int4BaseWeight`` per quantised module: the stored
tensors (int4 ones repacked into the one input-packed layout both formats share), so a device
GEMM can consume them (``kernels/quant_linear.py``). ``dequantize_checkpoint`` also returns
each weight dequantised to the model dtype (the fp32 product, rounded once): what the CPU
forward pass multiplies by, and the GPU one unless the engine's ``quant_kernels`` keeps the
packed form. FP8 activation scales are kept and checked but not applied by the dequantised
path: it is transformers' ``dequantize=True`` reference, which drops them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from adaptermesh.kernels.quant_linear import Fp8Linear, W4Linear, quant_linear

__all__ = [
    "AWQ_ORDER",
    "FP8_DTYPE",
    "LINEAR_LEAVES",
    "Fp8Weight",
    "Int4BaseWeight",
    "LinearScheme",
    "QuantLinear",
    "QuantScheme",
    "QuantWeight",
    "check_quant_config",
    "dequantize_checkpoint",
    "pack_linear",
    "pack_rows",
    "packed_bytes",
    "parse_quant_config",
    "quant_linear",
]

FP8_DTYPE = torch.float8_e4m3fn

# Checkpoint module leaves that are linear layers (``Linear`` targets), plus ``lm_head``.
LINEAR_LEAVES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

QCheck = Callable[[Any, Mapping[str, Any]], str | None]


# --- field checks ------------------------------------------------------------------------


def _any(v: Any, d: Mapping[str, Any]) -> str | None:
    return None


def _only(*allowed: Any) -> QCheck:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        if any(v == a and type(v) is type(a) for a in allowed):
            return None
        return f"is not implemented (only {' or '.join(repr(a) for a in allowed)})"

    return check


def _check_fields(obj: Mapping[str, Any], table: Mapping[str, QCheck], of: str = "") -> str | None:
    """Why ``table`` refuses one of ``obj``'s fields, as ``key: value why`` (``key.inner...``
    where the check names a nested field), or None; a field the table does not name is refused.
    ``of`` follows the value in that refusal (`` of gptq``)."""
    for key, val in obj.items():
        check = table.get(key)
        if check is None:
            return f"{key}: unknown field (value {val!r}){of}, refused rather than ignored"
        msg = check(val, obj)
        if msg is not None:
            return f"{key}{msg}" if msg.startswith(".") else f"{key}: {val!r} {msg}"
    return None


def _bool(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _names(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None or (isinstance(v, list) and all(isinstance(x, str) and x for x in v)):
        return None
    return "must be null or a list of module names"


def _empty(reason: str) -> QCheck:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        return None if v in (None, [], {}) else reason

    return check


def _block_size(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None:
        return None
    if (
        isinstance(v, list | tuple)
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
    ):
        return None
    return "must be null (per-tensor scales) or two positive integers [rows, cols]"


def _activation_scheme(v: Any, d: Mapping[str, Any]) -> str | None:
    if isinstance(v, str) and v.lower() in ("dynamic", "static"):
        return None
    return "is not implemented (only 'dynamic' or 'static')"


def _ignored_layers(v: Any, d: Mapping[str, Any]) -> str | None:
    if d.get("modules_to_not_convert") is not None and v is not None:
        return "contradicts modules_to_not_convert (transformers reads only one of them)"
    return _names(v, d)


# quantization_config keys of quant_method "fp8" (FineGrainedFP8Config) -> check.
FP8_FIELDS: dict[str, QCheck] = {
    # read
    "quant_method": _only("fp8"),
    "activation_scheme": _activation_scheme,
    "weight_block_size": _block_size,
    "modules_to_not_convert": _names,
    "ignored_layers": _ignored_layers,  # MiniMax's alias of modules_to_not_convert
    "fmt": _only("e4m3"),  # DeepSeek-V3 / Qwen3-FP8 carry it; the weight dtype is checked too
    # harmless: how transformers would hold the weights, not what they are
    "dequantize": _bool,
    # refused unless at their no-op value
    "modules_to_convert": _empty("fp8 embedding tables are not implemented (only null)"),
    "scale_fmt": _only("float"),  # 'ue8m0' (float8_e8m0fnu scales) is not implemented
    "expert_dtype": _only("fp8"),  # dense models only; 'fp4' experts are not implemented
}


def _ct_format(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None or v == "float-quantized":
        return None
    return "is not implemented (only 'float-quantized': e4m3 weights with float scales)"


def _ct_status(v: Any, d: Mapping[str, Any]) -> str | None:
    if v in ("compressed", "frozen"):
        return None
    return "is not implemented (only a finished checkpoint: 'compressed' or 'frozen')"


def _ct_groups(v: Any, d: Mapping[str, Any]) -> str | None:
    # Nested messages start with "." and the path (".group_0.weights.num_bits: 4 ...").
    if not isinstance(v, dict) or not v:
        return "must map group names to quantization schemes"
    for name, scheme in v.items():
        if not isinstance(scheme, dict):
            return f".{name}: must be a quantization scheme object"
        msg = _check_fields(scheme, CT_SCHEME_FIELDS)
        if msg is not None:
            return f".{name}.{msg}"
        if scheme.get("weights") is None:
            return f".{name}.weights: null is not implemented (a group must quantise weights)"
        if (scheme.get("format") or d.get("format")) != "float-quantized":
            # compressed-tensors' default format is "dense" (weights not compressed).
            return f".{name}.format: null with no top-level format is not implemented (only 'float-quantized')"
        if not scheme.get("targets"):
            return f".{name}.targets: is required"
    return None


# quantization_config keys of quant_method "compressed-tensors" -> check.
CT_FIELDS: dict[str, QCheck] = {
    # read
    "quant_method": _only("compressed-tensors"),
    "config_groups": _ct_groups,
    "format": _ct_format,
    "ignore": _names,
    "quantization_status": _ct_status,
    # harmless: bookkeeping and transformers' loading options
    "global_compression_ratio": _any,
    "version": _any,
    "run_compressed": _any,
    "dequantize": _any,
    "use_optimized_inference": _any,
    # refused unless absent or empty
    "kv_cache_scheme": _empty("an fp8 KV cache is not implemented (the KV cache stays bf16)"),
    "sparsity_config": _empty("sparse compression is not implemented"),
    "transform_config": _empty("weight transforms are not implemented"),
}


def _targets(v: Any, d: Mapping[str, Any]) -> str | None:
    if not isinstance(v, list) or not v or not all(isinstance(t, str) and t for t in v):
        return "must be a non-empty list of targets"
    for t in v:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as e:
                return f"has an invalid regex {t!r} ({e})"
        elif t[:1].isupper() and t != "Linear":
            return f"names module class {t!r}: only 'Linear' is implemented"
    return None


def _args_check(role: str) -> QCheck:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        if v is None:
            return None if role == "input" else "is required"
        if not isinstance(v, dict):
            return "must be a quantization args object"
        msg = _check_fields(v, CT_ARGS_FIELDS)
        if msg is not None:
            return f".{msg}"
        if "type" not in v:
            # compressed-tensors' QuantizationArgs default: type "int".
            return ".type: absent means 'int', which is not implemented (only 'float')"
        strategy, dynamic = v.get("strategy", "tensor"), v.get("dynamic", False)
        if role == "weights":
            if strategy not in ("tensor", "channel"):
                return f".strategy: {strategy!r} is not implemented for weights (only 'tensor' or 'channel')"
            if dynamic is not False:
                return f".dynamic: {dynamic!r} is not implemented for weights (only false)"
        else:
            if dynamic is True and strategy not in ("token", "tensor"):
                return f".strategy: {strategy!r} is not implemented for dynamic activations (only 'token' or 'tensor')"
            if dynamic is False and strategy != "tensor":
                return f".strategy: {strategy!r} is not implemented for static activations (only 'tensor')"
            if dynamic not in (True, False):
                return f".dynamic: {dynamic!r} is not implemented (only true or false)"
        return None

    return check


CT_SCHEME_FIELDS: dict[str, QCheck] = {
    "targets": _targets,
    "weights": _args_check("weights"),
    "input_activations": _args_check("input"),
    "output_activations": _empty("output activation quantisation is not implemented (only null)"),
    "format": _ct_format,
}

CT_ARGS_FIELDS: dict[str, QCheck] = {
    # read
    "num_bits": _only(8),
    "type": _only("float"),  # 'int' (INT8 W8A8) is not implemented
    "strategy": _only("tensor", "channel", "token"),
    "dynamic": _only(True, False),
    "symmetric": _only(True),  # an asymmetric float scheme would carry zero points
    "group_size": _only(None),
    "block_structure": _only(None),
    "actorder": _only(None, False),
    # harmless: how the scales were computed, and their stored dtype (the tensor is checked)
    "observer": _any,
    "observer_kwargs": _any,
    "scale_dtype": _any,
    "zp_dtype": _any,
}


def _bits(v: Any, d: Mapping[str, Any]) -> str | None:
    if v == 4 and type(v) is int:
        return None
    if v in (2, 3, 8) and type(v) is int:
        return f"{v}-bit weights are not implemented (only 4)"
    return "is not implemented (only 4)"


def _group_size(v: Any, d: Mapping[str, Any]) -> str | None:
    if type(v) is int and (v == -1 or v > 0):
        return None
    return "must be -1 (one group per row) or a positive integer"


def _awq_version(v: Any, d: Mapping[str, Any]) -> str | None:
    if isinstance(v, str) and v.lower() == "gemm":
        return None
    return "is not implemented (only 'gemm': AutoAWQ's GEMM packing)"


def _alias_of(key: str, check: QCheck, note: str = "") -> QCheck:
    """A second name of field ``key``: given with ``key``, the two must agree (ignoring case);
    its value is checked as ``key``'s is."""

    def alias(v: Any, d: Mapping[str, Any]) -> str | None:
        other = d.get(key)
        if v is not None and other is not None and str(v).lower() != str(other).lower():
            return f"contradicts {key} {other!r}{note}"
        return None if v is None else check(v, d)

    return alias


# transformers 5 writes both (the same value); it reads version when both are given.
_awq_format = _alias_of("version", _awq_version, " (transformers reads version)")


def _awq_backend(v: Any, d: Mapping[str, Any]) -> str | None:
    # transformers turns backend 'llm-awq' into format 'llm-awq' (another packing).
    if isinstance(v, str) and v.lower() == "llm-awq":
        return "selects llm-awq's packing, which is not implemented (only AutoAWQ's GEMM)"
    return None


def _gptq_format(v: Any, d: Mapping[str, Any]) -> str | None:
    if isinstance(v, str) and v.lower() in ("gptq", "gptq_v2"):
        return None
    return "is not implemented (only 'gptq' or 'gptq_v2')"


def _pack_dtype(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v in (None, "int32", "torch.int32") else "is not implemented (only 'int32')"


def _module_lists(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None:
        return None
    if isinstance(v, list) and all(
        isinstance(g, list) and all(isinstance(x, str) and x for x in g) for g in v
    ):
        return None
    return "must be null or a list of lists of module names"


# quantization_config keys of quant_method "awq" (AutoAWQ / transformers AwqConfig) -> check.
AWQ_FIELDS: dict[str, QCheck] = {
    # read
    "quant_method": _only("awq"),
    "bits": _bits,
    "group_size": _group_size,
    "zero_point": _only(True),  # the GEMM format stores zero points; false is not implemented
    "version": _awq_version,
    "format": _awq_format,  # transformers 5's name for version
    "modules_to_not_convert": _names,
    "backend": _awq_backend,
    # harmless: how transformers / AutoAWQ would run the weights, not what they are
    "do_fuse": _any,
    "fuse_max_seq_len": _any,
    "modules_to_fuse": _any,
    "exllama_config": _any,
    # transformers 5's AwqConfig is a GPTQConfig: its saved config carries GPTQ's fields,
    # which AWQ's GEMM weights do not use (the tensors are checked instead)
    "checkpoint_format": _awq_format,
    "sym": _bool,
    "desc_act": _only(False),  # AWQ has no act-order; true would promise a g_idx
    "act_group_aware": _bool,
    "true_sequential": _any,
    "damp_percent": _any,
    "dataset": _any,
    "tokenizer": _any,
    "model_seqlen": _any,
    "batch_size": _any,
    "pad_token_id": _any,
    "max_input_length": _any,
    "cache_block_outputs": _any,
    "block_name_to_quantize": _any,
    "module_name_preceding_first_block": _any,
    "meta": _any,
    "modules_in_block_to_quantize": _empty(
        "restricts AWQ's modules, which is not implemented (only null)"
    ),
}

# quantization_config keys of quant_method "gptq" (AutoGPTQ / GPTQModel / optimum) -> check.
GPTQ_FIELDS: dict[str, QCheck] = {
    # read
    "quant_method": _only("gptq"),
    "bits": _bits,
    "group_size": _group_size,
    "desc_act": _bool,  # act-order: served through each module's g_idx
    "sym": _bool,  # checked against the stored zero points
    "checkpoint_format": _gptq_format,  # 'gptq': zero points stored minus 1; 'gptq_v2': as is
    "format": _alias_of(
        "checkpoint_format", _gptq_format
    ),  # GPTQModel / transformers 5's name for checkpoint_format
    "lm_head": _bool,  # GPTQModel: lm_head quantised too
    "modules_in_block_to_quantize": _module_lists,
    "pack_dtype": _pack_dtype,
    "is_marlin_format": _only(False),  # Marlin's repacked tiles are not implemented
    # harmless: how the weights were computed (the g_idx tensors carry the order) or how
    # transformers / optimum would run them
    "static_groups": _bool,
    "act_group_aware": _bool,
    "true_sequential": _any,
    "damp_percent": _any,
    "damp_auto_increment": _any,
    "mse": _any,
    "v2": _any,
    "v2_alpha": _any,
    "dataset": _any,
    "tokenizer": _any,
    "model_seqlen": _any,
    "batch_size": _any,
    "pad_token_id": _any,
    "cache_block_outputs": _any,
    "block_name_to_quantize": _any,
    "module_name_preceding_first_block": _any,
    "model_name_or_path": _any,
    "model_file_base_name": _any,
    "meta": _any,
    "backend": _any,
    "use_exllama": _any,
    "exllama_config": _any,
    "use_cuda_fp16": _any,
    "max_input_length": _any,
    "disable_exllama": _any,
    # refused unless absent or empty
    "dynamic": _empty("per-module overrides (dynamic) are not implemented (only null)"),
    "adapter": _empty("an adapter baked into the checkpoint is not implemented (only null)"),
    "rotation": _empty("weight rotations are not implemented (only null)"),
}

_METHODS = {
    "fp8": FP8_FIELDS,
    "compressed-tensors": CT_FIELDS,
    "awq": AWQ_FIELDS,
    "gptq": GPTQ_FIELDS,
}
_NOT_YET: dict[str, str] = {
    "bitsandbytes": "bitsandbytes 4/8-bit checkpoints are not implemented (fp8, compressed-tensors float8, awq and gptq are)",
    "exl2": "EXL2 checkpoints are not implemented",
    "hqq": "HQQ checkpoints are not implemented",
    "marlin": "Marlin-packed checkpoints are not implemented (GPTQ's own packing is)",
    "aqlm": "AQLM checkpoints are not implemented",
    "eetq": "EETQ checkpoints are not implemented",
    "quanto": "quanto checkpoints are not implemented",
    "torchao": "torchao checkpoints are not implemented",
    "bitnet": "BitNet checkpoints are not implemented",
}


def check_quant_config(v: Any) -> str | None:
    """Why ``quantization_config`` cannot be served (prefixed with the inner field), or None."""
    if not isinstance(v, dict):
        return "must be an object"
    method = v.get("quant_method")
    if isinstance(method, str) and method in _NOT_YET:
        return f"quant_method {method!r}: {_NOT_YET[method]}"
    table = _METHODS.get(method) if isinstance(method, str) else None
    if table is None:
        return f"quant_method {method!r} is not implemented (only {', '.join(map(repr, _METHODS))})"
    return _check_fields(v, table, f" of {method}")


# --- the scheme ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinearScheme:
    """How one group of linear modules is stored."""

    targets: tuple[str, ...]  # "Linear", exact module names, "re:<regex>"
    weight_layout: str  # "tensor" | "channel" | "block"
    block: tuple[int, int] | None  # block layout: (rows, cols) per scale
    static_input: bool  # an input scale tensor is stored (static activations)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A parsed ``quantization_config``: which modules are fp8, and how."""

    method: str  # "fp8" | "compressed-tensors"
    groups: tuple[tuple[str, LinearScheme], ...]
    ignore: tuple[str, ...]
    scale_name: str  # "weight_scale_inv" | "weight_scale"
    input_scale_name: str  # "activation_scale" | "input_scale"
    # fp8 without modules_to_not_convert: transformers' default skips keep lm_head unquantised
    # (given a list, even an empty one, only the list is skipped).
    skip_lm_head: bool = False
    # awq / gptq: 4-bit integer weights in groups of ``group_size`` inputs (-1: one group).
    bits: int = 0
    group_size: int = 0
    zero_offset: int = 0  # gptq v1 ('gptq'): stored zero points are the real ones minus 1
    sym: bool | None = None  # gptq: every zero point must be 2**(bits-1)
    desc_act: bool = False
    blocks: tuple[str, ...] | None = None  # gptq modules_in_block_to_quantize, flattened

    @property
    def int4(self) -> bool:
        return self.method in ("awq", "gptq")

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of checkpoint module ``module`` (a linear layer), or None: not quantised."""
        if self.method == "awq":
            # transformers' rule (``should_convert_module``, as for fp8), and its default
            # skips keep lm_head unquantised whatever the list says.
            if module == "lm_head" or any(_fp8_skip(p, module) for p in self.ignore):
                return None
            return self.groups[0][1]
        if self.method == "gptq":
            if module == "lm_head":
                return None if self.skip_lm_head else self.groups[0][1]
            if self.blocks is not None and not any(module.endswith("." + b) for b in self.blocks):
                return None
            return self.groups[0][1]
        if self.method == "fp8":
            if (module == "lm_head" and self.skip_lm_head) or any(
                _fp8_skip(p, module) for p in self.ignore
            ):
                return None
            return self.groups[0][1]
        if any(_ct_match(t, module) for t in self.ignore):
            return None
        hits = [(n, s) for n, s in self.groups if any(_ct_match(t, module) for t in s.targets)]
        if len(hits) > 1:
            raise ValueError(
                f"config.quantization_config.config_groups: module {module} is targeted by "
                f"groups {hits[0][0]!r} and {hits[1][0]!r}"
            )
        return hits[0][1] if hits else None


def _fp8_skip(pattern: str, name: str) -> bool:
    # transformers' skip rule: the pattern (a regex) matches from the start up to a module
    # boundary ("layers.1" skips "layers.1.mlp", not "layers.11.mlp"), or the name ends with it.
    try:
        hit = re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:
        hit = False
    return hit or name.endswith(pattern)


def _ct_match(target: str, name: str) -> bool:
    if target == "Linear":
        return True  # every module the caller asks about is a linear layer
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def parse_quant_config(v: Mapping[str, Any]) -> QuantScheme:
    """The scheme of a ``quantization_config`` that ``check_quant_config`` accepted."""
    if v["quant_method"] in ("awq", "gptq"):
        gptq = v["quant_method"] == "gptq"
        fmt = str(v.get("checkpoint_format") or v.get("format") or "gptq").lower()
        blocks = v.get("modules_in_block_to_quantize") if gptq else None
        return QuantScheme(
            str(v["quant_method"]),
            (("int4", LinearScheme(("Linear",), "group", None, False)),),
            () if gptq else tuple(v.get("modules_to_not_convert") or ()),
            "scales",
            "",
            skip_lm_head=not (gptq and v.get("lm_head") is True),
            bits=int(v.get("bits", 4)),
            group_size=int(v.get("group_size", 128)),
            zero_offset=1 if gptq and fmt == "gptq" else 0,
            sym=bool(v.get("sym", True)) if gptq else None,
            desc_act=bool(v.get("desc_act", False)) if gptq else False,
            blocks=None if blocks is None else tuple(x for g in blocks for x in g),
        )
    if v["quant_method"] == "fp8":
        block = v.get("weight_block_size", [128, 128])
        static = str(v.get("activation_scheme", "dynamic")).lower() == "static"
        skip = v.get("modules_to_not_convert")
        if skip is None:
            skip = v.get("ignored_layers")
        return QuantScheme(
            "fp8",
            (
                (
                    "fp8",
                    LinearScheme(
                        ("Linear",),
                        "tensor" if block is None else "block",
                        None if block is None else (int(block[0]), int(block[1])),
                        static,
                    ),
                ),
            ),
            tuple(skip or ()),
            "weight_scale_inv",
            "activation_scale",
            skip_lm_head=skip is None,
        )
    groups = []
    for name, scheme in v["config_groups"].items():
        inp = scheme.get("input_activations")
        groups.append(
            (
                str(name),
                LinearScheme(
                    tuple(scheme["targets"]),
                    str(scheme["weights"].get("strategy", "tensor")),
                    None,
                    inp is not None and inp.get("dynamic", False) is False,
                ),
            )
        )
    return QuantScheme(
        "compressed-tensors",
        tuple(groups),
        tuple(v.get("ignore") or ()),
        "weight_scale",
        "input_scale",
    )


# --- the weights ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """One linear module's weight as the checkpoint stores it.

    ``data``: float8_e4m3fn [out, in]. ``scale``: fp32, [1, 1] (per tensor), [out, 1] (per
    channel) or [ceil(out / block[0]), ceil(in / block[1])] (per block); ``w = data * scale``.
    ``input_scale``: fp32 [] for static activations (``x_q = x / input_scale``), else None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    input_scale: torch.Tensor | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in ``dtype``: the product in fp32, rounded once."""
        out, inp = self.data.shape
        s = self.scale
        if self.block is not None:
            s = s.repeat_interleave(self.block[0], 0)[:out].repeat_interleave(self.block[1], 1)
            s = s[:, :inp]
        return (self.data.float() * s).to(dtype)

    @property
    def nbytes(self) -> int:
        ts = [self.data, self.scale] + ([] if self.input_scale is None else [self.input_scale])
        return sum(t.numel() * t.element_size() for t in ts)


def _scale_tensor(
    name: str, t: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...], what: str
) -> torch.Tensor:
    """The checked scale in fp32, reshaped to ``shapes[0]`` (the other shapes are the
    equivalent layouts checkpoints store it in)."""
    if t is None:
        raise ValueError(f"model weights: missing tensor {name} ({what})")
    if t.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"model weights: tensor {name} is {t.dtype}, a {what} must be float32, bfloat16 or float16"
        )
    if tuple(t.shape) not in shapes:
        raise ValueError(
            f"model weights: tensor {name} has shape {list(t.shape)}, the {what} needs "
            f"{' or '.join(str(list(s)) for s in shapes)}"
        )
    f = t.float().reshape(shapes[0])
    if not bool(torch.isfinite(f).all()):
        raise ValueError(f"model weights: tensor {name} has non-finite values ({what})")
    if not bool((f > 0).all()):
        raise ValueError(f"model weights: tensor {name} has values <= 0 ({what} must be positive)")
    return f


_ONE: tuple[tuple[int, ...], ...] = ((1, 1), (), (1,))


def _load_one(
    scheme: QuantScheme, ls: LinearScheme, module: str, weights: dict[str, torch.Tensor]
) -> Fp8Weight:
    wname = module + ".weight"
    q = weights.pop(wname)
    if q.dtype != FP8_DTYPE or q.dim() != 2:
        raise ValueError(
            f"model weights: tensor {wname} is {q.dtype} {list(q.shape)}, quantization_config "
            f"({scheme.method}) stores it as a 2-d float8_e4m3fn"
        )
    if not bool(torch.isfinite(q.float()).all()):
        raise ValueError(f"model weights: tensor {wname} has NaN values")
    out, inp = q.shape
    if ls.weight_layout == "block":
        assert ls.block is not None
        shapes: tuple[tuple[int, ...], ...] = ((-(-out // ls.block[0]), -(-inp // ls.block[1])),)
    elif ls.weight_layout == "channel":
        shapes = ((out, 1), (out,))
    else:
        shapes = _ONE
    sname = f"{module}.{scheme.scale_name}"
    scale = _scale_tensor(
        sname, weights.pop(sname, None), shapes, f"{ls.weight_layout} weight scale"
    )
    iname = f"{module}.{scheme.input_scale_name}"
    input_scale = None
    if ls.static_input:
        input_scale = _scale_tensor(
            iname, weights.pop(iname, None), _ONE, "static input scale"
        ).reshape(())
    return Fp8Weight(q, scale, ls.block if ls.weight_layout == "block" else None, input_scale)


@dataclass(frozen=True, slots=True)
class Int4BaseWeight:
    """One AWQ or GPTQ linear module, repacked at load into one layout both formats share.

    ``qweight``: int32 [in / 8, out], eight unsigned 4-bit values per element along the input
    dim, input ``8 r + i`` of column ``n`` in bits ``4 i .. 4 i + 3`` of ``qweight[r, n]``
    (GPTQ's order; AWQ's output-packed, interleaved words are unpacked and packed again).
    ``zeros``: uint8 [groups, out], the real zero points (GPTQ v1's stored-minus-1 undone:
    0..16). ``scales``: [groups, out] as stored (fp16 in both formats). ``g_idx``: int32 [in],
    the group of each input (GPTQ act-order), or None: input ``k`` is in group
    ``k // group_size``. The weight is ``w[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n]``,
    formed in fp32 and rounded once to the model dtype.
    """

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    def groups_of_inputs(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def unpacked(self) -> torch.Tensor:
        """int32 [in, out]: the 4-bit values, 0..15."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device)
        q = (self.qweight[:, None, :] >> shifts[None, :, None]) & 0xF
        return q.reshape(-1, self.qweight.shape[1])[: self.in_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in ``dtype``: ``(q - z) * s`` in fp32, rounded once."""
        g = self.groups_of_inputs()
        q = self.unpacked().float()
        w = (q - self.zeros.float()[g]) * self.scales.float()[g]
        return w.T.contiguous().to(dtype)

    @property
    def nbytes(self) -> int:
        ts = [self.qweight, self.zeros, self.scales] + ([] if self.g_idx is None else [self.g_idx])
        return sum(t.numel() * t.element_size() for t in ts)


_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# AutoAWQ's GEMM packing: nibble i of a word holds output column 8 j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])


def _unpack_cols(t: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [rows, cols / 8] packed along the columns -> int32 [rows, cols], 0..15."""
    q = (t[:, :, None] >> _SHIFTS.to(t.device)[None, None, :]) & 0xF  # [rows, words, nibble]
    if awq:
        q = q[:, :, _AWQ_UNDO.to(t.device)]  # column c of a word sits in nibble AWQ_ORDER.index(c)
    return q.reshape(t.shape[0], -1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [in, out] values 0..15 -> int32 [ceil(in / 8), out] packed along the inputs."""
    k, n = q.shape
    pad = -k % 8
    if pad:
        q = torch.cat([q, q.new_zeros(pad, n)])
    q = q.to(torch.int64).reshape(-1, 8, n) << _SHIFTS.to(q.device, torch.int64)[None, :, None]
    words = q.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int_tensor(
    name: str, t: torch.Tensor | None, shape: tuple[int, ...], what: str
) -> torch.Tensor:
    if t is None:
        raise ValueError(f"model weights: missing tensor {name} ({what})")
    if t.dtype not in (torch.int32, torch.uint32) or tuple(t.shape) != shape:
        raise ValueError(
            f"model weights: tensor {name} is {t.dtype} {list(t.shape)}, the {what} needs int32 "
            f"{list(shape)}"
        )
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _load_int4(
    scheme: QuantScheme, module: str, weights: dict[str, torch.Tensor]
) -> Int4BaseWeight:
    awq = scheme.method == "awq"
    qname, zname, sname = (f"{module}.{x}" for x in ("qweight", "qzeros", "scales"))
    raw = weights.pop(qname)
    if raw.dim() != 2:
        raise ValueError(f"model weights: tensor {qname} has shape {list(raw.shape)}, needs 2-d")
    scales = weights.pop(sname, None)
    if scales is None:
        raise ValueError(f"model weights: missing tensor {sname} (group scales)")
    if scales.dtype not in _SCALE_DTYPES or scales.dim() != 2:
        raise ValueError(
            f"model weights: tensor {sname} is {scales.dtype} {list(scales.shape)}, group "
            "scales must be a 2-d float16, bfloat16 or float32 [groups, out]"
        )
    if awq:
        k, n = int(raw.shape[0]), int(raw.shape[1]) * 8
    else:
        k, n = int(raw.shape[0]) * 8, int(raw.shape[1])
    gs = k if scheme.group_size == -1 else scheme.group_size
    if awq and k % gs:
        # AutoAWQ's GEMM layer asserts it; GPTQ rounds the group count up (a partial last group).
        raise ValueError(
            f"model weights: tensor {qname}: {k} inputs are not a whole number of groups of "
            f"{gs} (quantization_config.group_size)"
        )
    ngroups = -(-k // gs)
    if tuple(scales.shape) != (ngroups, n):
        raise ValueError(
            f"model weights: tensor {sname} has shape {list(scales.shape)}, group size {gs} "
            f"over a [{n}, {k}] weight needs [{ngroups}, {n}]"
        )
    sf = scales.float()
    if not bool(torch.isfinite(sf).all()):
        raise ValueError(f"model weights: tensor {sname} has non-finite values (group scales)")
    qw = _int_tensor(qname, raw, tuple(raw.shape), "packed 4-bit weight")
    z_raw = weights.pop(zname, None)
    zt = _int_tensor(zname, z_raw, (ngroups, n // 8), "packed zero points")
    zeros = _unpack_cols(zt, awq) + scheme.zero_offset
    g_idx = None
    gname = f"{module}.g_idx"
    gi = weights.pop(gname, None)
    if gi is not None and awq:
        raise ValueError(f"model weights: tensor {gname} is not part of an AWQ checkpoint")
    if gi is not None:
        if gi.dtype not in (torch.int32, torch.int64) or tuple(gi.shape) != (k,):
            raise ValueError(
                f"model weights: tensor {gname} is {gi.dtype} {list(gi.shape)}, needs int32 [{k}]"
            )
        if bool(((gi < 0) | (gi >= ngroups)).any()):
            raise ValueError(f"model weights: tensor {gname} names groups outside 0..{ngroups - 1}")
        trivial = torch.arange(k, dtype=gi.dtype, device=gi.device) // gs
        if not torch.equal(gi, trivial):
            g_idx = gi.to(torch.int32).contiguous()
    elif scheme.desc_act:
        raise ValueError(f"model weights: missing tensor {gname} (desc_act is true)")
    if scheme.sym and not bool((zeros == 2 ** (scheme.bits - 1)).all()):
        raise ValueError(
            f"model weights: tensor {zname} holds zero points other than "
            f"{2 ** (scheme.bits - 1)}, but quantization_config.sym is true"
        )
    if awq:
        qw = pack_rows(_unpack_cols(qw, True))
    return Int4BaseWeight(
        qw.contiguous(), zeros.to(torch.uint8).contiguous(), scales.contiguous(), g_idx, gs, k
    )


def _linear_modules(names: Iterable[str]) -> Iterator[str]:
    """The modules of the ``<module>.weight`` tensors in ``names`` that are linear layers (a
    LINEAR_LEAVES leaf, or lm_head), in ``names``' order."""
    for name in names:
        if name.endswith(".weight"):
            module = name[: -len(".weight")]
            if module == "lm_head" or module.rsplit(".", 1)[-1] in LINEAR_LEAVES:
                yield module


def _split_int4(scheme: QuantScheme, weights: dict[str, torch.Tensor]) -> dict[str, Int4BaseWeight]:
    stored: dict[str, Int4BaseWeight] = {}
    for name in sorted(weights):
        if not name.endswith(".qweight"):
            continue
        module = name[: -len(".qweight")]
        leaf = module.rsplit(".", 1)[-1]
        if module != "lm_head" and leaf not in LINEAR_LEAVES:
            raise ValueError(
                f"model weights: tensor {name} quantises a module that is not a linear layer"
            )
        if scheme.scheme_for(module) is None:
            raise ValueError(
                f"model weights: tensor {name} is 4-bit but quantization_config "
                f"({scheme.method}) keeps {module} unquantised"
            )
        if module + ".weight" in weights:
            raise ValueError(f"model weights: {module} has both .qweight and .weight")
        stored[module] = _load_int4(scheme, module, weights)
    for module in _linear_modules(list(weights)):
        if scheme.scheme_for(module) is not None:
            raise ValueError(
                f"model weights: tensor {module}.weight is unquantised but quantization_config "
                f"({scheme.method}) quantises {module} (expected {module}.qweight)"
            )
    for name in weights:
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            raise ValueError(f"model weights: tensor {name} belongs to no quantised module")
    return stored


QuantWeight = Fp8Weight | Int4BaseWeight
# The device form of one packed projection (kernels/quant_linear.py).
QuantLinear = Fp8Linear | W4Linear


def dequantize_checkpoint(
    scheme: QuantScheme,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    dense: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split the checkpoint's tensors: ``(dense, stored)``.

    ``stored``: module name -> ``Fp8Weight`` / ``Int4BaseWeight`` for every linear module the
    scheme quantises (``dense=False``: not dequantised into ``dense``, for the packed path).
    ``dense``: the other tensors as they were, plus each quantised module's ``.weight``
    dequantised to ``dtype`` (the fp32 product, rounded once; one module at a time, so the
    load never holds an fp32 copy of the model). Scale tensors of unquantised modules stay in ``dense`` (the model
    then refuses them as unused); an fp8 tensor anywhere else is refused here.
    """
    weights = dict(weights)
    if scheme.int4:
        stored4 = _split_int4(scheme, weights)
        if dense:
            for module, w4 in stored4.items():
                weights[module + ".weight"] = w4.dequantize(dtype)
        return weights, stored4
    stored: dict[str, Fp8Weight] = {}
    for module in _linear_modules(sorted(weights)):
        ls = scheme.scheme_for(module)
        if ls is not None:
            stored[module] = _load_one(scheme, ls, module, weights)
    for name, t in weights.items():
        if t.dtype == FP8_DTYPE:
            raise ValueError(
                f"model weights: tensor {name} is float8_e4m3fn but quantization_config "
                f"({scheme.method}) does not quantise it (ignored, not targeted, or not a linear "
                "layer)"
            )
    if dense:
        for module, w in stored.items():
            weights[module + ".weight"] = w.dequantize(dtype)
    return weights, stored


def pack_linear(
    parts: list[QuantWeight], fp8_activations: bool = False
) -> Fp8Linear | W4Linear | None:
    """The device form of one projection whose modules ``parts`` (in output order, e.g. q, k,
    v) are all quantised: their weights concatenated along the outputs. None where no kernel
    serves them packed: fp8 block scales (no row-wise form), or 4-bit modules whose groups
    differ (group size, inputs, act-order orders); those stay dequantised.

    FP8 per-tensor scales are repeated over their outputs (exact: the same product); static
    input scales of fused modules become their maximum (the modules share one input, so one
    quantisation of it; the largest scale saturates none of them). ``fp8_activations``: fp8
    steps past the gemv's rows quantise their activations (``Fp8Linear.fp8_activations``)."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        f8 = [p for p in parts if isinstance(p, Fp8Weight)]
        if any(p.block is not None for p in f8):
            return None
        scales = [p.scale.reshape(-1).expand(p.data.shape[0]) for p in f8]
        inputs = [p.input_scale for p in f8]
        static = None
        if all(s is not None for s in inputs):
            static = torch.stack([s.reshape(()) for s in inputs if s is not None]).amax()
        return Fp8Linear(
            torch.cat([p.data for p in f8]).contiguous(),
            torch.cat(scales).float().contiguous(),
            static,
            fp8_activations,
        )
    if all(isinstance(p, Int4BaseWeight) for p in parts):
        w4 = [p for p in parts if isinstance(p, Int4BaseWeight)]
        first = w4[0]
        for p in w4[1:]:
            if (p.group_size, p.in_features) != (first.group_size, first.in_features):
                return None
            if (p.g_idx is None) != (first.g_idx is None) or (
                p.g_idx is not None
                and first.g_idx is not None
                and not torch.equal(p.g_idx, first.g_idx)
            ):
                return None
        if len({p.scales.dtype for p in w4}) != 1:
            return None
        return W4Linear(
            torch.cat([p.qweight for p in w4], dim=1).contiguous(),
            torch.cat([p.zeros for p in w4], dim=1).contiguous(),
            torch.cat([p.scales for p in w4], dim=1).contiguous(),
            first.g_idx,
            first.group_size,
            first.in_features,
        )
    return None


def packed_bytes(
    in_features: int, out_features: int, method: str, group_size: int = 128, act_order: bool = False
) -> int:
    """Device bytes of one projection held packed (``pack_linear``'s form), for sizing
    without a checkpoint: ``fp8`` / ``compressed-tensors``: e4m3 weights plus one fp32 scale
    per output; ``awq`` / ``gptq``: int32 words of eight inputs, a uint8 zero point and an
    fp16 scale per (group, output), plus an int32 ``g_idx`` with act-order."""
    if method in ("fp8", "compressed-tensors"):
        return in_features * out_features + 4 * out_features
    if method in ("awq", "gptq"):
        gs = in_features if group_size == -1 else group_size
        groups = -(-in_features // gs)
        words = -(-in_features // 8) * out_features * 4
        return words + groups * out_features * 3 + (4 * in_features if act_order else 0)
    raise ValueError(f"method: {method!r} has no packed form (fp8, compressed-tensors, awq, gptq)")
