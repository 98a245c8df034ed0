"""FP8 base checkpoints (``quantization_config`` quant_method ``fp8`` and ``compressed-tensors``
float8) against the checkpoint they dequantise to.

Each case quantises a tiny random fp32 model with this file's own e4m3 quantiser (per tensor,
per channel or per block, with and without static activation scales), writes the fp8
checkpoint (safetensors + config.json) and, beside it, the same weights dequantised
(``q.float() * scale``) as a plain fp32 checkpoint. transformers + peft load the plain one;
the engine loads the fp8 one. The engine dequantises the very same products at load, so the
two models hold bit-identical fp32 weights, and the remaining difference is the op order of
two fp32 forward passes: the fidelity suites' tolerance (``fidelity_helpers.TOLERANCE``,
2e-4 of the largest |logit| + 1e-4 relative on the CPU) applies unchanged, and greedy tokens
must be identical. The dequantisation itself is held bit for bit to transformers' own
``Fp8Dequantize`` in bf16 and fp32.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from adaptermesh.worker.engine import Engine
from adaptermesh.worker.model import ModelConfig, load_model

from .conftest import LogitLog
from .fidelity_helpers import DEVICE, Ref, assert_matches, build_model, engine_config, peft_adapter

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL7 = list(LEAVES)
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # stored fused
PROMPTS = [tuple(range(2, 40, 3)), (5, 9, 2, 77, 31, 8)]


# --- the test's own quantiser --------------------------------------------------------------


def quantise(
    w: torch.Tensor, layout: str, block: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [out, in], fp32 scale, the scale broadcast to [out, in]) with ``w ~= q * scale``:
    amax / 448 per tensor, row or block."""
    w = w.float()
    out, inp = w.shape
    if layout == "tensor":
        s = w.abs().amax().reshape(1, 1) / FP8_MAX
        full = s.expand(out, inp)
    elif layout == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = s.expand(out, inp)
    else:
        assert block is not None
        bo, bi = block
        ro, ri = math.ceil(out / bo), math.ceil(inp / bi)
        s = torch.empty(ro, ri)
        for i in range(ro):
            for j in range(ri):
                s[i, j] = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].abs().amax() / FP8_MAX
        full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s, full


def write_fp8(
    src: Path,
    dst: Path,
    ref: Path,
    qcfg: dict[str, Any],
    plan: Any,
    *,
    scale_name: str,
    input_name: str | None = None,
) -> None:
    """``plan(module) -> (layout, block) | None`` decides, independently of the product's
    matching code, which modules are stored in fp8 and how."""
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    qt: dict[str, torch.Tensor] = {}
    rt: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        p = plan(module) if name.endswith(".weight") else None
        if p is None:
            qt[name] = rt[name] = t
            continue
        q, s, full = quantise(t, *p)
        qt[name] = q
        if p[0] == "tensor":  # fp8 stores a scalar, compressed-tensors a [1]
            s = s.reshape(()) if scale_name == "weight_scale_inv" else s.reshape(1)
        qt[f"{module}.{scale_name}"] = s
        if input_name is not None:
            qt[f"{module}.{input_name}"] = torch.tensor([0.02])
        rt[name] = q.float() * full
    for d in (dst, ref):
        (d / "model.safetensors").unlink()
    save_file(qt, str(dst / "model.safetensors"))
    save_file(rt, str(ref / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))


def _is_linear(m: str) -> bool:
    return m == "lm_head" or m.rsplit(".", 1)[-1] in (*LEAVES, *PHI3_MODULES)


CASES: dict[str, tuple[dict[str, Any], Any, str, str | None]] = {
    # DeepSeek/Qwen3-FP8 layout: 16x16 blocks, one layer's attention kept in fp32. A given
    # modules_to_not_convert replaces transformers' default skips: lm_head is quantised too.
    "fp8-block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [16, 16],
            "modules_to_not_convert": ["model.layers.1.self_attn"],
        },
        lambda m: (
            None
            if not _is_linear(m) or m.startswith("model.layers.1.self_attn")
            else ("block", (16, 16))
        ),
        "weight_scale_inv",
        None,
    ),
    # Blocks that do not divide the shapes (the last row/column block is partial); no
    # modules_to_not_convert, so lm_head keeps transformers' default skip.
    "fp8-ragged-block": (
        {"quant_method": "fp8", "weight_block_size": [12, 20]},
        lambda m: None if m == "lm_head" or not _is_linear(m) else ("block", (12, 20)),
        "weight_scale_inv",
        None,
    ),
    "fp8-tensor-static": (
        {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "static"},
        lambda m: None if m == "lm_head" or not _is_linear(m) else ("tensor", None),
        "weight_scale_inv",
        "activation_scale",
    ),
    # llm-compressor's FP8_DYNAMIC: per-channel weights, dynamic per-token activations.
    "ct-channel-dynamic": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "version": "0.9.1",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "channel",
                        "dynamic": False,
                        "group_size": None,
                        "block_structure": None,
                        "actorder": None,
                        "observer": "minmax",
                        "observer_kwargs": {},
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "token",
                        "dynamic": True,
                        "observer": None,
                    },
                    "output_activations": None,
                    "format": "float-quantized",
                }
            },
        },
        lambda m: None if m == "lm_head" or not _is_linear(m) else ("channel", None),
        "weight_scale",
        None,
    ),
    # FP8 static: per-tensor weights and input scales; lm_head quantised too (no ignore).
    "ct-tensor-static": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "tensor",
                        "dynamic": False,
                    },
                }
            },
        },
        lambda m: ("tensor", None) if _is_linear(m) else None,
        "weight_scale",
        "input_scale",
    ),
    # Two groups by regex: attention per tensor, MLP per channel, weight-only; down_proj of
    # layer 0 ignored by name.
    "ct-two-groups": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "frozen",
            "ignore": ["lm_head", "re:model\\.layers\\.0\\.mlp\\.down"],
            "config_groups": {
                "attn": {
                    "targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                },
                "mlp": {
                    "targets": ["re:.*mlp\\..*_proj"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                },
            },
        },
        lambda m: (
            None
            if m in ("lm_head", "model.layers.0.mlp.down_proj") or not _is_linear(m)
            else (("tensor", None) if "self_attn" in m else ("channel", None))
        ),
        "weight_scale",
        None,
    ),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("fp8_plain") / "m", "llama", seed=3, pad_token_id=0)


@pytest.fixture(scope="module")
def plain_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("fp8_phi3") / "m", "phi3", seed=4, pad_token_id=0)


def _write_case(plain: Path, tmp: Path, case: str) -> tuple[Path, Path]:
    qcfg, plan, scale_name, input_name = CASES[case]
    dst, ref = tmp / "fp8", tmp / "ref"
    write_fp8(plain, dst, ref, qcfg, plan, scale_name=scale_name, input_name=input_name)
    return dst, ref


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_dequantised_reference(
    plain: Path, tmp_path: Path, case: str
) -> None:
    dst, ref_dir = _write_case(plain, tmp_path, case)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=5, r=4, lora_alpha=8, target_modules=ALL7)
    ref = Ref(ref_dir, root, ["a0"])

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            dst,
            root,
            device=DEVICE,
            dtype="float32",
            config=engine_config(),
            model_name="q",
            sample_observer=log,
        )
        try:
            await assert_matches(eng, ref, [None, "a0"], log, PROMPTS, n=6, tag=case)
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_fused_phi3_checkpoint_matches_dequantised_reference(
    plain_phi3: Path, tmp_path: Path
) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: each is one fp8 module with its own
    block scales (64 and 96 rows of 16-row blocks), served under a fused-module adapter."""
    qcfg, _, scale_name, _ = CASES["fp8-block"]
    dst, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    write_fp8(
        plain_phi3,
        dst,
        ref_dir,
        {**qcfg, "modules_to_not_convert": None},
        lambda m: None if m == "lm_head" or not _is_linear(m) else ("block", (16, 16)),
        scale_name=scale_name,
    )
    m = load_model(dst, torch.device("cpu"), torch.float32, 64)
    assert sorted(k.rsplit(".", 1)[-1] for k in m.quantized) == sorted(PHI3_MODULES * 2)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=6, r=4, lora_alpha=8, target_modules=PHI3_MODULES)
    ref = Ref(ref_dir, root, ["a0"])

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            dst,
            root,
            device=DEVICE,
            dtype="float32",
            config=engine_config(),
            model_name="q",
            sample_observer=log,
        )
        try:
            await assert_matches(eng, ref, [None, "a0"], log, PROMPTS, n=6, tag="phi3")
        finally:
            await eng.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_load_equals_the_dequantised_checkpoint(
    plain: Path, tmp_path: Path, case: str
) -> None:
    """In bf16 the served weights are the fp32 products rounded once: exactly what the plain
    dequantised checkpoint gives when the same loader casts it."""
    dst, ref_dir = _write_case(plain, tmp_path, case)
    mine = load_model(dst, torch.device("cpu"), torch.bfloat16, 64)
    want = load_model(ref_dir, torch.device("cpu"), torch.bfloat16, 64)
    assert mine.quantized
    assert not want.quantized
    assert torch.equal(mine.lm_head, want.lm_head)
    for la, lb in zip(mine.layers, want.layers, strict=True):
        assert la.keys() == lb.keys()
        for k in la:
            assert la[k].dtype == torch.bfloat16
            assert torch.equal(la[k], lb[k]), k


def test_stored_form_is_kept_and_counted(plain: Path, tmp_path: Path) -> None:
    dst, _ = _write_case(plain, tmp_path, "fp8-block")
    raw = load_file(str(dst / "model.safetensors"))
    m = load_model(dst, torch.device("cpu"), torch.bfloat16, 64)
    name = "model.layers.0.self_attn.q_proj"
    w = m.quantized[name]
    assert w.data.dtype == FP8
    assert torch.equal(w.data.view(torch.uint8), raw[name + ".weight"].view(torch.uint8))
    assert torch.equal(w.scale, raw[name + ".weight_scale_inv"])
    assert w.block == (16, 16)
    assert w.input_scale is None
    # Layer 1's attention is in modules_to_not_convert: plain, not held.
    assert "model.layers.1.self_attn.q_proj" not in m.quantized
    assert m.quantized["lm_head"].block == (16, 16)  # a given list replaces the default skips
    assert len(m.quantized) == 7 + 3 + 1  # layer 0: all seven; layer 1: the MLP; lm_head
    dense = sum(
        t.numel() * t.element_size()
        for t in [m.embed, m.norm, m.lm_head, *(t for layer in m.layers for t in layer.values())]
    )
    stored = sum(q.data.numel() + q.scale.numel() * 4 for q in m.quantized.values())
    assert m.nbytes == dense + stored
    # The forward weight is the dequantised product, rounded once to the model dtype.
    assert torch.equal(m.module_weight(0, "q_proj"), w.dequantize(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(16, 16), None])
def test_dequantise_is_transformers_fp8_dequantize(dtype: torch.dtype, block: Any) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from adaptermesh.worker.quant import Fp8Weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * 0.1
    q, s, _ = quantise(w, "block" if block else "tensor", block)
    mine = Fp8Weight(q, s, block, None).dequantize(dtype)
    theirs = Fp8Dequantize(None)._dequantize_one(
        q, s if block else s.reshape(1, 1), output_dtype=dtype
    )
    assert mine.dtype == theirs.dtype == dtype
    assert torch.equal(mine, theirs)


# --- refusals ------------------------------------------------------------------------------


def _cfg(plain: Path, qcfg: Any) -> dict[str, Any]:
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    return cfg


_CT_W = {"num_bits": 8, "type": "float", "strategy": "channel"}


def _ct(**over: Any) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": dict(_CT_W)}
    group.update(over.pop("group", {}))
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
        **over,
    }


@pytest.mark.parametrize(
    ("qcfg", "needle"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version: 'gemv' is not"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format"),
        ({"quant_method": "hqq"}, "quant_method 'hqq': HQQ"),
        ({"bits": 4}, "quant_method None"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "brand_new": 1},
            "brand_new: unknown field",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: [128] must be"),
        (
            {"quant_method": "fp8", "weight_block_size": [0, 128]},
            "weight_block_size: [0, 128] must be",
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "per_token"},
            "activation_scheme: 'per_token' is not",
        ),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt: 'ue8m0' is not"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt: 'e5m2' is not"),
        (
            {"quant_method": "fp8", "modules_to_convert": ["model.embed_tokens"]},
            "modules_to_convert: ['model.embed_tokens'] fp8 embedding",
        ),
        (
            {"quant_method": "fp8", "modules_to_not_convert": ["a"], "ignored_layers": ["b"]},
            "ignored_layers: ['b'] contradicts",
        ),
        (_ct(format="pack-quantized"), "format: 'pack-quantized' is not"),
        (
            _ct(kv_cache_scheme={"num_bits": 8, "type": "float"}),
            "kv_cache_scheme: {'num_bits': 8, 'type': 'float'} an fp8 KV cache",
        ),
        (
            _ct(sparsity_config={"format": "sparse-24"}),
            "sparsity_config: {'format': 'sparse-24'} sparse",
        ),
        (_ct(quantization_status="calibration"), "quantization_status: 'calibration' is not"),
        (_ct(surprise=True), "surprise: unknown field"),
        (_ct(format=None), "config_groups.group_0.format: null with no top-level format"),
        (
            _ct(group={"weights": {**_CT_W, "type": "int"}}),
            "config_groups.group_0.weights.type: 'int'",
        ),
        (
            _ct(group={"weights": {"num_bits": 8, "strategy": "tensor"}}),
            "weights.type: absent means 'int'",
        ),
        (
            _ct(group={"input_activations": {"num_bits": 8, "dynamic": True}}),
            "input_activations.type: absent means 'int'",
        ),
        (_ct(group={"weights": {**_CT_W, "num_bits": 4}}), "group_0.weights.num_bits: 4"),
        (
            _ct(group={"weights": {**_CT_W, "strategy": "group", "group_size": 128}}),
            "group_0.weights.strategy: 'group'",
        ),
        (
            _ct(group={"weights": {**_CT_W, "strategy": "block"}}),
            "group_0.weights.strategy: 'block'",
        ),
        (_ct(group={"weights": {**_CT_W, "symmetric": False}}), "group_0.weights.symmetric: False"),
        (_ct(group={"weights": {**_CT_W, "dynamic": True}}), "group_0.weights.dynamic: True"),
        (_ct(group={"weights": {**_CT_W, "new_arg": 1}}), "group_0.weights.new_arg: unknown field"),
        (_ct(group={"weights": None}), "group_0.weights"),
        (_ct(group={"targets": ["Embedding"]}), "group_0.targets"),
        (_ct(group={"targets": ["re:("]}), "group_0.targets"),
        (_ct(group={"output_activations": {"num_bits": 8}}), "group_0.output_activations"),
        (
            _ct(
                group={
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": False,
                    }
                }
            ),
            "group_0.input_activations.strategy: 'token' is not implemented for static",
        ),
        (
            _ct(group={"input_activations": {"num_bits": 8, "type": "float", "dynamic": "local"}}),
            "group_0.input_activations.dynamic: 'local'",
        ),
        (_ct(group={"extra_key": 1}), "group_0.extra_key"),
    ],
)
def test_hostile_configs_refused_by_name(plain: Path, qcfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=r"config\.quantization_config") as e:
        ModelConfig.from_dict(_cfg(plain, qcfg))
    assert needle in str(e.value), str(e.value)


_Q = "model.layers.0.self_attn.q_proj"


def _tamper(plain: Path, tmp: Path, case: str, edit: Any) -> Path:
    dst, _ = _write_case(plain, tmp, case)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("case", "edit", "needle"),
    [
        (
            "fp8-block",
            lambda t: t.update({_Q + ".weight_scale_inv": torch.ones(3, 2)}),
            "has shape [3, 2]",
        ),
        (
            "fp8-block",
            lambda t: t[_Q + ".weight_scale_inv"].__setitem__((0, 0), float("inf")),
            "non-finite",
        ),
        (
            "fp8-block",
            lambda t: t[_Q + ".weight_scale_inv"].__setitem__((1, 0), float("nan")),
            "non-finite",
        ),
        ("fp8-block", lambda t: t[_Q + ".weight_scale_inv"].__setitem__((1, 1), -1.0), "<= 0"),
        (
            "fp8-block",
            lambda t: t.pop(_Q + ".weight_scale_inv"),
            "missing tensor " + _Q + ".weight_scale_inv",
        ),
        (
            "fp8-block",
            lambda t: t.update({_Q + ".weight": t[_Q + ".weight"].to(torch.bfloat16)}),
            "torch.bfloat16",
        ),
        (
            "fp8-block",
            lambda t: t.update(
                {_Q + ".weight_scale_inv": t[_Q + ".weight_scale_inv"].to(torch.int32)}
            ),
            "torch.int32",
        ),
        (
            "fp8-ragged-block",
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(FP8)}),
            "tensor lm_head.weight is float8_e4m3fn",
        ),
        (
            "fp8-block",
            lambda t: t.update(
                {
                    "model.layers.0.input_layernorm.weight": t[
                        "model.layers.0.input_layernorm.weight"
                    ].to(FP8)
                }
            ),
            "model.layers.0.input_layernorm.weight is float8",
        ),
        ("fp8-tensor-static", lambda t: t.pop(_Q + ".activation_scale"), _Q + ".activation_scale"),
        (
            "fp8-tensor-static",
            lambda t: t.update({_Q + ".activation_scale": torch.tensor([0.0])}),
            "<= 0",
        ),
        (
            "fp8-tensor-static",
            lambda t: t.update({_Q + ".weight_scale_inv": torch.ones(2)}),
            "has shape [2]",
        ),
        (
            "ct-channel-dynamic",
            lambda t: t.update({_Q + ".weight_scale": torch.ones(1)}),
            "has shape [1]",
        ),
        (
            "ct-channel-dynamic",
            lambda t: t.update({_Q + ".input_scale": torch.ones(1)}),
            _Q + ".input_scale",
        ),
        (
            "ct-channel-dynamic",
            lambda t: t.update({"lm_head.weight_scale": torch.ones(1)}),
            "lm_head.weight_scale",
        ),
        (
            "ct-tensor-static",
            lambda t: t.update({_Q + ".input_scale": torch.tensor([float("inf")])}),
            "non-finite",
        ),
        (
            "ct-two-groups",
            lambda t: t.update(
                {
                    "model.layers.0.mlp.down_proj.weight": t[
                        "model.layers.0.mlp.down_proj.weight"
                    ].to(FP8)
                }
            ),
            "model.layers.0.mlp.down_proj.weight is float8_e4m3fn",
        ),
    ],
)
def test_hostile_tensors_refused_by_name(
    plain: Path, tmp_path: Path, case: str, edit: Any, needle: str
) -> None:
    dst = _tamper(plain, tmp_path, case, edit)
    with pytest.raises(ValueError, match="model weights") as e:
        load_model(dst, torch.device("cpu"), torch.float32, 64)
    assert needle in str(e.value), str(e.value)


def test_two_groups_targeting_one_module_refused(plain: Path, tmp_path: Path) -> None:
    qcfg = _ct(
        config_groups={
            "a": {"targets": ["Linear"], "weights": dict(_CT_W)},
            "b": {"targets": ["re:.*q_proj"], "weights": dict(_CT_W)},
        }
    )
    cfg = ModelConfig.from_dict(_cfg(plain, qcfg))
    assert cfg.quant is not None
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.q_proj is targeted by groups 'a' and 'b'"
    ):
        cfg.quant.scheme_for(_Q)


def test_tensor_parallel_refuses_quantised(plain: Path) -> None:
    from adaptermesh.worker.tp_shard import shard_weights

    cfg = ModelConfig.from_dict(_cfg(plain, {"quant_method": "fp8"}))
    with pytest.raises(ValueError, match=r"config\.quantization_config: tensor parallelism"):
        shard_weights(cfg, {}, 0, 2)


# --- Hypothesis: field combinations ---------------------------------------------------------

# field -> (accepted values, refused values); the test's own table, written from the
# transformers / compressed-tensors definitions, not from the product's.
_FP8_DRAW: dict[str, tuple[list[Any], list[Any]]] = {
    "activation_scheme": (["dynamic", "static", "DYNAMIC"], ["per_token", 1, None]),
    "weight_block_size": ([None, [128, 128], [64, 32]], [[128], [0, 1], "128", [1.5, 2]]),
    "modules_to_not_convert": ([None, [], ["lm_head"]], ["lm_head", [3]]),
    "fmt": (["e4m3"], ["e5m2"]),
    "dequantize": ([True, False], ["yes"]),
    "scale_fmt": (["float"], ["ue8m0"]),
    "expert_dtype": (["fp8"], ["fp4"]),
    "modules_to_convert": ([None, []], [["model.embed_tokens"]]),
    "future_field": ([], [1, "x"]),
}
_CT_ARGS_DRAW: dict[str, tuple[list[Any], list[Any]]] = {
    "num_bits": ([8], [4, 16]),
    "type": (["float"], ["int"]),
    "symmetric": ([True], [False]),
    "group_size": ([None], [128]),
    "block_structure": ([None], [[128, 128]]),
    "actorder": ([None, False], ["group", True]),
    "observer": (["minmax", None], []),
    "observer_kwargs": ([{}], []),
    "strategy": (["tensor", "channel"], ["group", "block", "tensor_group"]),
    "dynamic": ([False], [True, "local"]),
    "mystery": ([], [0]),
}


_CT_TOP_DRAW: dict[str, tuple[list[Any], list[Any]]] = {
    "format": (["float-quantized"], ["pack-quantized", "dense", None]),
    "quantization_status": (["compressed", "frozen"], ["initialized", "calibration"]),
    "ignore": ([None, [], ["lm_head", "re:.*mlp"]], ["lm_head", [1]]),
    "kv_cache_scheme": ([None, {}], [{"num_bits": 8, "type": "float", "strategy": "tensor"}]),
    "sparsity_config": ([None, {}], [{"format": "sparse-24-bitmask"}]),
    "transform_config": ([None], [{"config_groups": {}}]),
    "global_compression_ratio": ([None, 1.5], []),
    "version": (["0.9.1"], []),
    "provider_extra": ([], ["x"]),
}


@st.composite
def _fields(
    draw: st.DrawFn, table: dict[str, tuple[list[Any], list[Any]]]
) -> tuple[dict[str, Any], set[str]]:
    out: dict[str, Any] = {}
    bad: set[str] = set()
    for key in draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=4)):
        ok, no = table[key]
        good = draw(st.booleans()) if ok and no else bool(ok)
        out[key] = draw(st.sampled_from(ok if good else no))
        if not good:
            bad.add(key)
    return out, bad


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    fp8=_fields(_FP8_DRAW),
    args=_fields(_CT_ARGS_DRAW),
    top=_fields(_CT_TOP_DRAW),
    method=st.sampled_from(["fp8", "ct"]),
)
def test_drawn_field_combinations(plain: Path, fp8: Any, args: Any, top: Any, method: str) -> None:
    if method == "fp8":
        fields, bad = fp8
        qcfg = {"quant_method": "fp8", **fields}
    else:
        fields, bad = args
        qcfg = _ct(group={"weights": {**_CT_W, **fields}}, **top[0])
        bad = bad | top[1]
    cfg = _cfg(plain, qcfg)
    if not bad:
        assert ModelConfig.from_dict(cfg).quant is not None
        return
    with pytest.raises(ValueError, match=r"config\.quantization_config") as e:
        ModelConfig.from_dict(cfg)
    assert any(f"{k}:" in str(e.value) for k in bad), (str(e.value), bad)
