"""FP8 base checkpoints: what ``quantization_config`` may say, and the weights it describes.

Two formats are served, both e4m3 weights (``torch.float8_e4m3fn``) with float scales, where
the real weight is ``w = q.float() * scale`` broadcast over the scale's layout:

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

Every field of both layouts is read, harmless or refused by name (the tables below, in the
style of ``model_fields``). Refused by name: AWQ, GPTQ and every other ``quant_method``.

The loaded form is an ``Fp8Weight`` per quantised module: the stored e4m3 tensor and its
scales, untouched, so a device GEMM on fp8 (``torch._scaled_mm`` or a Triton ``tl.dot``) can
consume them. No such kernel exists yet: ``dequantize_checkpoint`` also returns each weight
dequantised to the model dtype (the fp32 product, rounded once), which is what the forward pass
multiplies by on every device today. Activation scales are kept and checked but not applied:
the dequantised-weight path is transformers' ``dequantize=True`` reference, which drops them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FP8_DTYPE",
    "LINEAR_LEAVES",
    "Fp8Weight",
    "LinearScheme",
    "QuantScheme",
    "check_quant_config",
    "dequantize_checkpoint",
    "parse_quant_config",
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
        for key, val in scheme.items():
            check = CT_SCHEME_FIELDS.get(key)
            if check is None:
                return f".{name}.{key}: unknown field (value {val!r}), refused rather than ignored"
            msg = check(val, scheme)
            if msg is not None:
                return (
                    f".{name}.{key}{msg}"
                    if msg.startswith(".")
                    else f".{name}.{key}: {val!r} {msg}"
                )
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
        for key, val in v.items():
            c = CT_ARGS_FIELDS.get(key)
            if c is None:
                return f".{key}: unknown field (value {val!r}), refused rather than ignored"
            msg = c(val, v)
            if msg is not None:
                return f".{key}: {val!r} {msg}"
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

_METHODS = {"fp8": FP8_FIELDS, "compressed-tensors": CT_FIELDS}
_NOT_YET = {
    "awq": "AWQ 4-bit checkpoints are not implemented yet (fp8 and compressed-tensors float8 are)",
    "gptq": "GPTQ 4-bit checkpoints are not implemented yet (fp8 and compressed-tensors float8 are)",
}


def check_quant_config(v: Any) -> str | None:
    """Why ``quantization_config`` cannot be served (prefixed with the inner field), or None."""
    if not isinstance(v, dict):
        return "must be an object"
    method = v.get("quant_method")
    if method in _NOT_YET:
        return f"quant_method {method!r}: {_NOT_YET[method]}"
    table = _METHODS.get(method) if isinstance(method, str) else None
    if table is None:
        return f"quant_method {method!r} is not implemented (only {', '.join(map(repr, _METHODS))})"
    for key, val in v.items():
        check = table.get(key)
        if check is None:
            return f"{key}: unknown field (value {val!r}) of {method}, refused rather than ignored"
        msg = check(val, v)
        if msg is not None:
            return f"{key}{msg}" if msg.startswith(".") else f"{key}: {val!r} {msg}"
    return None


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

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of checkpoint module ``module`` (a linear layer), or None: not quantised."""
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


def dequantize_checkpoint(
    scheme: QuantScheme, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, Fp8Weight]]:
    """Split the checkpoint's tensors: ``(dense, stored)``.

    ``stored``: module name -> ``Fp8Weight`` for every linear module the scheme quantises.
    ``dense``: the other tensors as they were, plus each quantised module's ``.weight``
    dequantised to ``dtype`` (the fp32 product, rounded once; one module at a time, so the
    load never holds an fp32 copy of the model). Scale tensors of unquantised modules stay in ``dense`` (the model
    then refuses them as unused); an fp8 tensor anywhere else is refused here.
    """
    weights = dict(weights)
    stored: dict[str, Fp8Weight] = {}
    for name in sorted(weights):
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        if module != "lm_head" and module.rsplit(".", 1)[-1] not in LINEAR_LEAVES:
            continue
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
    for module, w in stored.items():
        weights[module + ".weight"] = w.dequantize(dtype)
    return weights, stored
