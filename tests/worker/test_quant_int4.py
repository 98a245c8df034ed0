"""AWQ and GPTQ 4-bit base checkpoints (``quantization_config`` quant_method ``awq`` and
``gptq``) against the checkpoint they dequantise to.

Each case quantises a tiny random fp32 model with this file's own group quantiser (asymmetric
or symmetric, groups along the inputs, GPTQ act-order through a drawn ``g_idx``), packs the
integers with this file's own packers (AutoAWQ's GEMM layout, GPTQ v1 / v2), writes the 4-bit
checkpoint and, beside it, the same weights dequantised (``(q - z) * s`` in fp32) as a plain
fp32 checkpoint. transformers + peft load the plain one; the engine loads the 4-bit one.
The engine forms the very same fp32 products at load, so the two models hold bit-identical
weights and the remaining difference is the op order of two fp32 forward passes: the fidelity
suites' tolerance (``fidelity_helpers.TOLERANCE``) applies unchanged, and greedy tokens must
be identical.

The packing itself is checked twice over: a deliberately naive unpacker here (Python ints, one
nibble at a time) must read back the integers the packers wrote, and the engine's loaded form
must hold those integers; AutoAWQ's own ``dequantize_gemm`` is compared too where installed.
"""

from __future__ import annotations

import asyncio
import json
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
from adaptermesh.worker.quant import (
    Int4BaseWeight,
    check_quant_config,
    dequantize_checkpoint,
    parse_quant_config,
)

from .conftest import LogitLog
from .fidelity_helpers import DEVICE, Ref, assert_matches, build_model, engine_config, peft_adapter

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL7 = list(LEAVES)
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PROMPTS = [tuple(range(2, 40, 3)), (5, 9, 2, 77, 31, 8)]
# AutoAWQ's pack order: nibble i of a word holds output column 8 j + ORDER[i] (written here
# from AutoAWQ's WQLinear_GEMM.from_linear, not from the product).
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# --- the test's own quantiser and packers ---------------------------------------------------


def quantise(
    w: torch.Tensor,
    group: int,
    *,
    sym: bool,
    g_idx: torch.Tensor | None = None,
    zmin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int64 [in, out] 0..15, zeros int64 [groups, out], scales fp16 [groups, out],
    g int64 [in]) for ``w`` [out, in]; ``w ~= (q - z[g]) * s[g]``. ``zmin``: the smallest zero
    point drawn (GPTQ v1 cannot store 0)."""
    out, k = w.shape
    gs = k if group == -1 else group
    g = torch.arange(k) // gs if g_idx is None else g_idx.long()
    ng = int(g.max()) + 1
    wt = w.T.float()  # [in, out]
    scales = torch.empty(ng, out)
    zeros = torch.empty(ng, out, dtype=torch.int64)
    for j in range(ng):
        rows = wt[g == j]
        if sym:
            s = rows.abs().amax(0).clamp_min(1e-4) / 7
            z = torch.full((out,), 8, dtype=torch.int64)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-4)
            z = torch.round(-lo / s).long().clamp(zmin, 15)
        scales[j] = s.half().float()
        zeros[j] = z
    s16 = scales.half()
    q = torch.round(wt / s16.float()[g]) + zeros[g]
    return q.clamp(0, 15).long(), zeros, s16, g


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words 0 .. 2**32 - 1 -> the int32 tensors checkpoints store (same bits)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] 0..15 -> int32 [rows, cols / 8], AutoAWQ's interleaved order."""
    rows, cols = v.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for i in range(8):
            words[:, j] |= v[:, 8 * j + ORDER[i]].long() << (4 * i)
    return to_int32(words)


def pack_cols(v: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] 0..15 -> int32 [rows, cols / 8], plain order (GPTQ's qzeros)."""
    rows, cols = v.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for i in range(8):
            words[:, j] |= v[:, 8 * j + i].long() << (4 * i)
    return to_int32(words)


def pack_gptq_rows(v: torch.Tensor) -> torch.Tensor:
    """int [in, out] 0..15 -> int32 [in / 8, out], packed along the inputs (GPTQ's qweight)."""
    return pack_cols(v.T.contiguous()).T.contiguous()


def naive_unpack(words: torch.Tensor, along: str, awq: bool = False) -> list[list[int]]:
    """Python-int unpacking, one nibble at a time: ``along`` 'cols' (each word holds eight
    neighbouring columns) or 'rows' (eight neighbouring rows)."""
    w = [[int(x) & 0xFFFFFFFF for x in row] for row in words.tolist()]
    if along == "rows":
        out = [[0] * len(w[0]) for _ in range(8 * len(w))]
        for r, row in enumerate(w):
            for c, x in enumerate(row):
                for i in range(8):
                    out[8 * r + i][c] = (x >> (4 * i)) & 0xF
        return out
    out = [[0] * (8 * len(w[0])) for _ in range(len(w))]
    for r, row in enumerate(w):
        for c, x in enumerate(row):
            for i in range(8):
                col = 8 * c + (ORDER[i] if awq else i)
                out[r][col] = (x >> (4 * i)) & 0xF
    return out


def module_tensors(
    w: torch.Tensor,
    fmt: str,
    group: int,
    *,
    sym: bool,
    g_idx: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """One module's checkpoint tensors (suffix -> tensor), the dequantised fp32 weight [out,
    in], and the integers behind them (q [in, out], z [groups, out], g [in])."""
    v1 = fmt == "gptq"
    q, z, s, g = quantise(w, group, sym=sym, g_idx=g_idx, zmin=1 if v1 else 0)
    deq = ((q.float() - z.float()[g]) * s.float()[g]).T.contiguous()
    if fmt == "awq":
        t = {"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": s}
    else:
        t = {
            "qweight": pack_gptq_rows(q),
            "qzeros": pack_cols(z - 1 if v1 else z),
            "scales": s,
            "g_idx": g.to(torch.int32),
        }
    return t, deq, {"q": q, "z": z, "g": g}


def write_int4(
    src: Path,
    dst: Path,
    ref: Path,
    qcfg: dict[str, Any],
    plan: Any,
    *,
    fmt: str,
    group: int,
    sym: bool,
    act_order: bool = False,
    seed: int = 0,
) -> dict[str, dict[str, torch.Tensor]]:
    """``plan(module) -> bool`` decides, independently of the product's matching code, which
    modules are stored in 4 bits. Returns each quantised module's integers."""
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    qt: dict[str, torch.Tensor] = {}
    rt: dict[str, torch.Tensor] = {}
    ints: dict[str, dict[str, torch.Tensor]] = {}
    orders: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and plan(module)):
            qt[name] = rt[name] = t
            continue
        g_idx = None
        if act_order:
            # Modules that read one input (q/k/v, gate/up) share its Hessian, hence GPTQ's
            # act-order permutation.
            parent, _, leaf = module.rpartition(".")
            key = parent + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(
                leaf, leaf
            )
            if key not in orders:
                orders[key] = torch.randperm(t.shape[1], generator=gen)
            g_idx = torch.empty(t.shape[1], dtype=torch.int64)
            g_idx[orders[key]] = torch.arange(t.shape[1]) // group
        parts, deq, ints[module] = module_tensors(t, fmt, group, sym=sym, g_idx=g_idx)
        for suffix, p in parts.items():
            qt[f"{module}.{suffix}"] = p
        rt[name] = deq
    for d in (dst, ref):
        (d / "model.safetensors").unlink()
    save_file(qt, str(dst / "model.safetensors"))
    save_file(rt, str(ref / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return ints


def _is_linear(m: str) -> bool:
    return m == "lm_head" or m.rsplit(".", 1)[-1] in (*LEAVES, *PHI3_MODULES)


# case -> (quantization_config, plan, packing, group, sym, act_order)
CASES: dict[str, tuple[dict[str, Any], Any, str, int, bool, bool]] = {
    # AutoAWQ's config.json as published (version gemm, zero points, group 128); layer 1's
    # attention kept in fp32 by modules_to_not_convert.
    "awq-g128": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "version": "gemm",
            "zero_point": True,
            "modules_to_not_convert": ["model.layers.1.self_attn"],
        },
        lambda m: m != "lm_head" and _is_linear(m) and not m.startswith("model.layers.1.self_attn"),
        "awq",
        128,
        False,
        False,
    ),
    # transformers 5's saved AwqConfig: GPTQConfig's fields ride along, format == version.
    "awq-g32-tf5": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "zero_point": True,
            "version": "gemm",
            "format": "gemm",
            "backend": "auto",
            "modules_to_not_convert": None,
            "damp_percent": 0.1,
            "desc_act": False,
            "sym": True,
            "true_sequential": True,
            "act_group_aware": True,
            "batch_size": 1,
            "cache_block_outputs": True,
            "dataset": None,
            "tokenizer": None,
            "meta": None,
            "model_seqlen": None,
            "block_name_to_quantize": None,
            "module_name_preceding_first_block": None,
            "pad_token_id": None,
            "max_input_length": None,
            "modules_in_block_to_quantize": None,
        },
        lambda m: m != "lm_head" and _is_linear(m),
        "awq",
        32,
        False,
        False,
    ),
    # AutoGPTQ's classic: v1 zero points (stored minus 1), symmetric, group 128, no act-order.
    "gptq-v1-sym-g128": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "model_name_or_path": None,
            "model_file_base_name": None,
            "checkpoint_format": "gptq",
        },
        lambda m: m != "lm_head" and _is_linear(m),
        "gptq",
        128,
        True,
        False,
    ),
    # GPTQModel v2 zero points, asymmetric, act-order (a permuted g_idx), lm_head quantised.
    "gptq-v2-asym-actorder-lmhead": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": True,
            "sym": False,
            "format": "gptq_v2",
            "lm_head": True,
            "pack_dtype": "int32",
            "meta": {"quantizer": ["gptqmodel:2.0"]},
        },
        _is_linear,
        "gptq_v2",
        32,
        False,
        True,
    ),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough for one group of 128 inputs (hidden 128, MLP 256)."""
    return build_model(
        tmp_path_factory.mktemp("int4_plain") / "m",
        "llama",
        seed=7,
        pad_token_id=0,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def plain_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("int4_phi3") / "m", "phi3", seed=8, pad_token_id=0)


def _write_case(plain: Path, tmp: Path, case: str) -> tuple[Path, Path, dict[str, Any]]:
    qcfg, plan, fmt, group, sym, act = CASES[case]
    dst, ref = tmp / "int4", tmp / "ref"
    ints = write_int4(
        plain, dst, ref, qcfg, plan, fmt=fmt, group=group, sym=sym, act_order=act, seed=1
    )
    return dst, ref, ints


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoint_matches_dequantised_reference(
    plain: Path, tmp_path: Path, case: str
) -> None:
    dst, ref_dir, _ = _write_case(plain, tmp_path, case)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=5, r=4, lora_alpha=8, target_modules=ALL7)
    peft_adapter(
        root, ref_dir, "a1", seed=6, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    ref = Ref(ref_dir, root, ["a0", "a1"])

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
            await assert_matches(eng, ref, [None, "a0", "a1"], log, PROMPTS, n=6, tag=case)
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_fused_phi3_awq_matches_dequantised_reference(plain_phi3: Path, tmp_path: Path) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: each is one AWQ module with its own
    zero points and scales, served under a fused-module adapter."""
    dst, ref_dir = tmp_path / "int4", tmp_path / "ref"
    write_int4(
        plain_phi3,
        dst,
        ref_dir,
        {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "GEMM", "zero_point": True},
        lambda m: m != "lm_head" and _is_linear(m),
        fmt="awq",
        group=16,
        sym=False,
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
            await assert_matches(eng, ref, [None, "a0"], log, PROMPTS, n=6, tag="phi3-awq")
        finally:
            await eng.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_load_equals_the_dequantised_checkpoint(
    plain: Path, tmp_path: Path, case: str
) -> None:
    """In bf16 the served weights are the fp32 products rounded once: exactly what the plain
    dequantised checkpoint gives when the same loader casts it."""
    dst, ref_dir, _ = _write_case(plain, tmp_path, case)
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


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_integers_are_the_packed_ones(plain: Path, tmp_path: Path, case: str) -> None:
    """The naive unpacker reads back what the packers wrote, and the loaded form holds those
    integers: the 4-bit values, the real zero points (v1's minus 1 undone), the scales as
    stored, and a g_idx only where act-order permuted the groups."""
    dst, _, ints = _write_case(plain, tmp_path, case)
    raw = load_file(str(dst / "model.safetensors"))
    m = load_model(dst, torch.device("cpu"), torch.float32, 64)
    fmt = CASES[case][2]
    assert set(m.quantized) == set(ints)
    for module, want in ints.items():
        w = m.quantized[module]
        assert isinstance(w, Int4BaseWeight)
        qw, qz = raw[module + ".qweight"], raw[module + ".qzeros"]
        if fmt == "awq":
            assert torch.tensor(naive_unpack(qw, "cols", awq=True)).equal(want["q"])
            assert torch.tensor(naive_unpack(qz, "cols", awq=True)).equal(want["z"])
        else:
            assert torch.tensor(naive_unpack(qw, "rows")).equal(want["q"])
            off = 1 if fmt == "gptq" else 0
            assert (torch.tensor(naive_unpack(qz, "cols")) + off).equal(want["z"])
        assert w.unpacked().long().equal(want["q"])
        assert w.zeros.long().equal(want["z"])
        assert torch.equal(w.scales, raw[module + ".scales"])
        assert w.groups_of_inputs().equal(want["g"])
        assert (w.g_idx is not None) == CASES[case][5]
        leaf = module.rsplit(".", 1)[-1]
        if module.startswith("model.layers.0.") and leaf in LEAVES:
            assert torch.equal(m.module_weight(0, leaf), w.dequantize())


def test_stored_form_is_counted(plain: Path, tmp_path: Path) -> None:
    dst, _, _ = _write_case(plain, tmp_path, "gptq-v1-sym-g128")
    m = load_model(dst, torch.device("cpu"), torch.bfloat16, 64)
    dense = sum(
        t.numel() * t.element_size()
        for t in [m.embed, m.norm, m.lm_head, *(t for layer in m.layers for t in layer.values())]
    )
    stored = 0
    for w in m.quantized.values():
        assert isinstance(w, Int4BaseWeight)
        stored += w.qweight.numel() * 4 + w.zeros.numel() + w.scales.numel() * 2
    assert m.nbytes == dense + stored


# --- Hypothesis: packing over shapes, group sizes, zero points, orders ----------------------


@st.composite
def _module(draw: st.DrawFn) -> dict[str, Any]:
    fmt = draw(st.sampled_from(["awq", "gptq", "gptq_v2"]))
    group = draw(st.sampled_from([8, 16, 24, 32, 64, 128, -1]))
    out = 8 * draw(st.integers(1, 12))
    if fmt == "awq":
        # AutoAWQ's GEMM layer needs whole groups of inputs.
        k = (8 if group == -1 else group) * draw(st.integers(1, 4))
    else:
        k = 8 * draw(st.integers(1, 40))  # a partial last group is GPTQ's rounding up
    act = fmt != "awq" and draw(st.booleans())
    sym = fmt != "awq" and draw(st.booleans())
    return {
        "fmt": fmt,
        "group": group,
        "out": out,
        "k": k,
        "act": act,
        "sym": sym,
        "seed": draw(st.integers(0, 2**16)),
        "scale": draw(st.sampled_from([1e-3, 0.1, 3.0])),
    }


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=_module())
def test_drawn_modules_dequantise_exactly(case: dict[str, Any]) -> None:
    """Any shape, group size (a partial last group for GPTQ), zero points, symmetric or not,
    act-order or not: the loaded integers are the drawn ones and the weight is exactly ``(q -
    z[g]) * s[g]`` in fp32, computed here independently."""
    gen = torch.Generator().manual_seed(case["seed"])
    out, k, group, fmt = case["out"], case["k"], case["group"], case["fmt"]
    w = torch.randn(out, k, generator=gen) * case["scale"]
    g_idx = None
    gs = k if group == -1 else group
    if case["act"]:
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // gs
    t, deq, ints = module_tensors(w, fmt, group, sym=case["sym"], g_idx=g_idx)
    qcfg: dict[str, Any] = {"quant_method": "awq" if fmt == "awq" else "gptq", "group_size": group}
    if fmt != "awq":
        qcfg.update(checkpoint_format=fmt, sym=case["sym"], desc_act=case["act"])
    assert check_quant_config(qcfg) is None
    scheme = parse_quant_config(qcfg)
    name = "model.layers.0.mlp.down_proj"
    dense, stored = dequantize_checkpoint(scheme, {f"{name}.{s}": v for s, v in t.items()})
    w4 = stored[name]
    assert isinstance(w4, Int4BaseWeight)
    assert w4.unpacked().long().equal(ints["q"])
    assert w4.zeros.long().equal(ints["z"])
    assert w4.groups_of_inputs().equal(ints["g"])
    assert torch.equal(dense[f"{name}.weight"], deq)
    mine_bf16 = w4.dequantize(torch.bfloat16)
    assert torch.equal(mine_bf16, deq.to(torch.bfloat16))


# --- refusals ------------------------------------------------------------------------------


def _cfg(plain: Path, qcfg: Any) -> dict[str, Any]:
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    return cfg


_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize(
    ("qcfg", "needle"),
    [
        ({**_AWQ, "bits": 8}, "bits: 8 8-bit weights are not implemented"),
        ({**_AWQ, "bits": 4.0}, "bits: 4.0 is not implemented"),
        ({**_AWQ, "version": "gemv"}, "version: 'gemv' is not implemented"),
        ({**_AWQ, "version": "gemv_fast"}, "version: 'gemv_fast'"),
        ({**_AWQ, "version": "gemm", "format": "gemv"}, "format: 'gemv' contradicts version"),
        ({**_AWQ, "backend": "llm-awq"}, "backend: 'llm-awq' selects llm-awq's packing"),
        ({**_AWQ, "zero_point": False}, "zero_point: False is not implemented"),
        ({**_AWQ, "group_size": 0}, "group_size: 0 must be"),
        ({**_AWQ, "desc_act": True}, "desc_act: True is not implemented"),
        (
            {**_AWQ, "modules_to_not_convert": "lm_head"},
            "modules_to_not_convert: 'lm_head' must be",
        ),
        (
            {**_AWQ, "modules_in_block_to_quantize": [["self_attn.q_proj"]]},
            "modules_in_block_to_quantize",
        ),
        ({**_AWQ, "brand_new": 1}, "brand_new: unknown field"),
        ({**_GPTQ, "bits": 3}, "bits: 3 3-bit weights are not implemented"),
        ({**_GPTQ, "bits": 2}, "bits: 2 2-bit"),
        ({**_GPTQ, "group_size": -2}, "group_size: -2 must be"),
        ({**_GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format: 'marlin' is not"),
        ({**_GPTQ, "format": "bitblas"}, "format: 'bitblas' is not"),
        (
            {**_GPTQ, "checkpoint_format": "gptq", "format": "gptq_v2"},
            "format: 'gptq_v2' contradicts checkpoint_format",
        ),
        ({**_GPTQ, "is_marlin_format": True}, "is_marlin_format: True is not"),
        ({**_GPTQ, "pack_dtype": "int16"}, "pack_dtype: 'int16' is not"),
        ({**_GPTQ, "desc_act": "yes"}, "desc_act: 'yes' must be"),
        ({**_GPTQ, "sym": None}, "sym: None must be"),
        ({**_GPTQ, "dynamic": {"-:.*down": {}}}, "dynamic: {'-:.*down': {}} per-module"),
        ({**_GPTQ, "adapter": {"name": "eora"}}, "adapter:"),
        ({**_GPTQ, "rotation": "hadamard"}, "rotation: 'hadamard'"),
        ({**_GPTQ, "modules_in_block_to_quantize": ["q_proj"]}, "modules_in_block_to_quantize"),
        ({**_GPTQ, "mystery": 0}, "mystery: unknown field (value 0) of gptq"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "exl2"}, "quant_method 'exl2'"),
        ({"quant_method": "marlin"}, "quant_method 'marlin'"),
    ],
)
def test_hostile_configs_refused_by_name(plain: Path, qcfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=r"config\.quantization_config") as e:
        ModelConfig.from_dict(_cfg(plain, qcfg))
    assert needle in str(e.value), str(e.value)


_Q = "model.layers.0.self_attn.q_proj"


def _tamper(plain: Path, tmp: Path, case: str, edit: Any) -> Path:
    dst, _, _ = _write_case(plain, tmp, case)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def _sym_break(t: dict[str, torch.Tensor]) -> None:
    t[_Q + ".qzeros"] = t[_Q + ".qzeros"] ^ 1  # a zero point of 7 (v1 stores 7 for 8)


@pytest.mark.parametrize(
    ("case", "edit", "needle"),
    [
        ("awq-g128", lambda t: t.pop(_Q + ".qzeros"), "missing tensor " + _Q + ".qzeros"),
        ("awq-g128", lambda t: t.pop(_Q + ".scales"), "missing tensor " + _Q + ".scales"),
        (
            "awq-g128",
            lambda t: t.update({_Q + ".scales": t[_Q + ".scales"][:, :8]}),
            _Q + ".scales has shape [1, 8]",
        ),
        (
            "awq-g128",
            lambda t: t.update({_Q + ".qweight": t[_Q + ".qweight"].float()}),
            _Q + ".qweight is torch.float32",
        ),
        (
            "awq-g128",
            lambda t: t.update({_Q + ".scales": t[_Q + ".scales"].int()}),
            _Q + ".scales is torch.int32",
        ),
        (
            "awq-g128",
            lambda t: t[_Q + ".scales"].__setitem__((0, 0), float("nan")),
            "non-finite",
        ),
        (
            "awq-g128",
            lambda t: t.update({_Q + ".g_idx": torch.zeros(128, dtype=torch.int32)}),
            "is not part of an AWQ checkpoint",
        ),
        (
            "awq-g128",
            lambda t: t.update({_Q + ".weight": torch.zeros(128, 128)}),
            "has both .qweight and .weight",
        ),
        (
            "awq-g128",
            lambda t: t.update(
                {"model.layers.0.mlp.act.scales": torch.ones(1, 256, dtype=torch.float16)}
            ),
            "model.layers.0.mlp.act.scales belongs to no quantised module",
        ),
        (
            "awq-g128",
            lambda t: t.update(
                {
                    "model.layers.1.self_attn.q_proj.qweight": t[_Q + ".qweight"].clone(),
                    "model.layers.1.self_attn.q_proj.qzeros": t[_Q + ".qzeros"].clone(),
                    "model.layers.1.self_attn.q_proj.scales": t[_Q + ".scales"].clone(),
                }
            ),
            "keeps model.layers.1.self_attn.q_proj unquantised",
        ),
        (
            "gptq-v1-sym-g128",
            lambda t: t.update({_Q + ".weight": t.pop(_Q + ".qweight").float()}),
            "expected " + _Q + ".qweight",
        ),
        (
            "gptq-v1-sym-g128",
            lambda t: t.update({_Q + ".qzeros": t[_Q + ".qzeros"][:, :1]}),
            _Q + ".qzeros is torch.int32 [1, 1]",
        ),
        ("gptq-v1-sym-g128", _sym_break, "quantization_config.sym is true"),
        (
            "gptq-v1-sym-g128",
            lambda t: t.update({_Q + ".g_idx": t[_Q + ".g_idx"][:64]}),
            _Q + ".g_idx is torch.int32 [64]",
        ),
        (
            "gptq-v1-sym-g128",
            lambda t: t.update({_Q + ".g_idx": t[_Q + ".g_idx"] + 1}),
            "names groups outside 0..0",
        ),
        (
            "gptq-v2-asym-actorder-lmhead",
            lambda t: t.pop(_Q + ".g_idx"),
            "missing tensor " + _Q + ".g_idx (desc_act is true)",
        ),
        (
            "gptq-v2-asym-actorder-lmhead",
            lambda t: t.update({"lm_head.weight": torch.zeros(384, 128)}),
            "lm_head has both .qweight and .weight",
        ),
        (
            "gptq-v1-sym-g128",
            lambda t: t.update(
                {"model.layers.0.input_layernorm.qweight": torch.zeros(16, 128, dtype=torch.int32)}
            ),
            "model.layers.0.input_layernorm.qweight quantises a module that is not a linear",
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


def test_gptq_modules_in_block_to_quantize(plain: Path, tmp_path: Path) -> None:
    """GPTQ's block list: only the listed modules are 4-bit, the rest stay plain."""
    qcfg = {
        **_GPTQ,
        "group_size": 32,
        "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.down_proj"]],
    }
    dst, ref = tmp_path / "int4", tmp_path / "ref"
    write_int4(
        plain,
        dst,
        ref,
        qcfg,
        lambda m: m.endswith((".q_proj", ".down_proj")),
        fmt="gptq",
        group=32,
        sym=True,
    )
    m = load_model(dst, torch.device("cpu"), torch.float32, 64)
    want = load_model(ref, torch.device("cpu"), torch.float32, 64)
    assert sorted(m.quantized) == sorted(
        f"model.layers.{i}.{s}" for i in (0, 1) for s in ("self_attn.q_proj", "mlp.down_proj")
    )
    for la, lb in zip(m.layers, want.layers, strict=True):
        for k in la:
            assert torch.equal(la[k], lb[k]), k


def test_tensor_parallel_refuses_int4(plain: Path) -> None:
    from adaptermesh.worker.tp_shard import shard_weights

    cfg = ModelConfig.from_dict(_cfg(plain, dict(_AWQ)))
    with pytest.raises(ValueError, match=r"config\.quantization_config: tensor parallelism"):
        shard_weights(cfg, {}, 0, 2)


# field -> (accepted values, refused values): the test's own table, written from the
# transformers / AutoAWQ / GPTQModel definitions.
_GPTQ_DRAW: dict[str, tuple[list[Any], list[Any]]] = {
    "bits": ([4], [2, 3, 8, "4"]),
    "group_size": ([128, 32, -1], [0, -3, "128"]),
    "desc_act": ([True, False], ["no"]),
    "sym": ([True, False], [1]),
    "checkpoint_format": (["gptq", "gptq_v2"], ["marlin", "awq"]),
    "damp_percent": ([0.01, 0.1], []),
    "true_sequential": ([True], []),
    "static_groups": ([False, True], ["x"]),
    "is_marlin_format": ([False], [True]),
    "dynamic": ([None, {}], [{"+:.*q_proj": {"bits": 8}}]),
    "lm_head": ([False, True], ["yes"]),
    "future": ([], [1]),
}
_AWQ_DRAW: dict[str, tuple[list[Any], list[Any]]] = {
    "bits": ([4], [8]),
    "group_size": ([128, 64], [0]),
    "zero_point": ([True], [False]),
    "version": (["gemm", "GEMM"], ["gemv", "gemv_fast", "marlin"]),
    "modules_to_not_convert": ([None, [], ["visual"]], ["visual"]),
    "do_fuse": ([False, True], []),
    "fuse_max_seq_len": ([None, 512], []),
    "backend": (["auto", "autoawq"], ["llm-awq"]),
    "desc_act": ([False], [True]),
    "future": ([], ["x"]),
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
@given(gptq=_fields(_GPTQ_DRAW), awq=_fields(_AWQ_DRAW), method=st.sampled_from(["awq", "gptq"]))
def test_drawn_field_combinations(plain: Path, gptq: Any, awq: Any, method: str) -> None:
    fields, bad = awq if method == "awq" else gptq
    cfg = _cfg(plain, {"quant_method": method, **fields})
    if not bad:
        assert ModelConfig.from_dict(cfg).quant is not None
        return
    with pytest.raises(ValueError, match=r"config\.quantization_config") as e:
        ModelConfig.from_dict(cfg)
    assert any(f"{k}:" in str(e.value) for k in bad), (str(e.value), bad)
