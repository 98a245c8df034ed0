"""The packed quantised path (``EngineConfig.quant_kernels``): the engine keeps a quantised
base's projections in their fp8 / 4-bit form and runs kernels/quant_linear.py on them.

Here with ``quant_kernels="on"`` on the CPU, where the kernels' torch twins run (the Triton
kernels themselves are checked against the twins in tests/kernels/test_quant_linear.py, and
on the GPU by its ``gpu`` tests), against transformers + peft on the dequantised weights:

- AWQ / GPTQ: the W4A16 twin is the dequantised weight rounded once to the model dtype times
  the activations, the dense path's product: the fidelity suites' tolerance and identical
  greedy tokens.
- FP8 (the gemv up to 4 rows, the W8A16 GEMM beyond): fp32 sums of the activations times
  the e4m3 values, times the per-output scale: the dequantised product up to the sum order,
  so the same tolerance and tokens.
- FP8 with ``quant_fp8_activations`` (``torch._scaled_mm`` on e4m3 activations): each
  activation carries up to 2^-4 relative error (3 mantissa bits); only a sanity bound against
  the dequantised reference holds (see that test).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from adaptermesh.kernels.quant_linear import Fp8Linear, W4Linear
from adaptermesh.worker.engine import Engine
from adaptermesh.worker.model import ModelConfig, TransformerModel, load_model, read_weights

from .conftest import LogitLog, collect, request
from .fidelity_helpers import DEVICE, Ref, assert_matches, build_model, engine_config, peft_adapter
from .test_quant_fp8 import CASES as FP8_CASES
from .test_quant_fp8 import write_fp8
from .test_quant_int4 import CASES as INT4_CASES
from .test_quant_int4 import write_int4

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [tuple(range(2, 40, 3)), (5, 9, 2, 77, 31, 8)]
GROUPS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(
        tmp_path_factory.mktemp("packed_plain") / "m",
        "llama",
        seed=11,
        pad_token_id=0,
        hidden_size=128,
        intermediate_size=256,
    )


def _int4(plain: Path, tmp: Path, case: str) -> tuple[Path, Path]:
    qcfg, plan, fmt, group, sym, act = INT4_CASES[case]
    dst, ref = tmp / "q", tmp / "ref"
    write_int4(plain, dst, ref, qcfg, plan, fmt=fmt, group=group, sym=sym, act_order=act, seed=2)
    return dst, ref


def _fp8(plain: Path, tmp: Path, case: str) -> tuple[Path, Path]:
    qcfg, plan, scale_name, input_name = FP8_CASES[case]
    dst, ref = tmp / "q", tmp / "ref"
    write_fp8(plain, dst, ref, qcfg, plan, scale_name=scale_name, input_name=input_name)
    return dst, ref


def _packed_model(dst: Path, dtype: torch.dtype = torch.float32) -> TransformerModel:
    cfg = ModelConfig.from_dir(dst)
    return TransformerModel(
        cfg, read_weights(dst), torch.device("cpu"), dtype, 64, quant_kernels=True
    )


def _run(dst: Path, ref: Ref, root: Path, names: list[str | None], tag: str, **kw: object) -> None:
    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            dst,
            root,
            device=DEVICE,
            dtype="float32",
            config=engine_config(quant_kernels="on", **kw),
            model_name="q",
            sample_observer=log,
        )
        try:
            assert eng.model.packed
            await assert_matches(eng, ref, names, log, PROMPTS, n=6, tag=tag)
        finally:
            await eng.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("case", ["awq-g128", "gptq-v2-asym-actorder-lmhead", "gptq-v1-sym-g128"])
def test_packed_int4_matches_dequantised_reference(plain: Path, tmp_path: Path, case: str) -> None:
    dst, ref_dir = _int4(plain, tmp_path, case)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=5, r=4, lora_alpha=8, target_modules=ALL7)
    _run(dst, Ref(ref_dir, root, ["a0"]), root, [None, "a0"], case)


@pytest.mark.parametrize("case", ["ct-channel-dynamic", "fp8-tensor-static", "ct-tensor-static"])
def test_packed_fp8_matches_dequantised_reference(plain: Path, tmp_path: Path, case: str) -> None:
    """The default fp8 path: the gemv for steps of at most 4 rows, the W8A16 GEMM beyond
    (whole prompts here), both weight-only."""
    dst, ref_dir = _fp8(plain, tmp_path, case)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=5, r=4, lora_alpha=8, target_modules=ALL7)
    _run(dst, Ref(ref_dir, root, ["a0"]), root, [None, "a0"], case)


@pytest.mark.parametrize("case", ["ct-channel-dynamic", "ct-tensor-static"])
def test_w8a8_engine_within_activation_error(plain: Path, tmp_path: Path, case: str) -> None:
    """``quant_fp8_activations``: whole prompts in one step take torch._scaled_mm with e4m3
    activations (its maths is held to torch's own _scaled_mm in tests/kernels). Against the
    dequantised reference only a sanity bound holds: on these random tiny models one linear
    layer's e4m3 activations cost ~2.5 % relative error and 14 of them compound to ~16 % of
    the largest logit; a real model's is what the GPU fidelity call measures."""
    dst, ref_dir = _fp8(plain, tmp_path, case)
    root = tmp_path / "adapters"
    peft_adapter(root, ref_dir, "a0", seed=5, r=4, lora_alpha=8, target_modules=ALL7)
    ref = Ref(ref_dir, root, ["a0"])
    jobs = [(f"s{i}-{n}", p, n) for i, p in enumerate(PROMPTS) for n in (None, "a0")]

    async def go() -> dict[str, list[torch.Tensor]]:
        log = LogitLog()
        eng = Engine(
            dst,
            root,
            device=DEVICE,
            dtype="float32",
            config=engine_config(quant_kernels="on", quant_fp8_activations=True),
            model_name="q",
            sample_observer=log,
        )
        try:
            lin = eng.model.packed[(0, "qkv")]
            assert isinstance(lin, Fp8Linear)
            assert lin.fp8_activations
            streams = [eng.submit(request(rid, p, n, max_tokens=1)) for rid, p, n in jobs]
            await asyncio.gather(*(collect(s) for s in streams))
            return log
        finally:
            await eng.shutdown()

    log = asyncio.run(go())
    for rid, p, n in jobs:
        mine = log[rid][0]
        want = ref.logits(list(p), n)[-1]
        err = float((mine - want).abs().max() / want.abs().max())
        assert 0 < err < 0.3, (rid, err)


def test_packed_model_holds_no_dense_copy(plain: Path, tmp_path: Path) -> None:
    """Every projection of every layer packed: its dense weight is a meta tensor (no bytes),
    nbytes counts the packed form, and module_weight refuses by name."""
    dst, _ = _int4(plain, tmp_path, "gptq-v1-sym-g128")
    m = _packed_model(dst, torch.bfloat16)
    dense = load_model(dst, torch.device("cpu"), torch.bfloat16, 64)
    assert sorted(m.packed) == sorted((i, g) for i in range(2) for g in GROUPS)
    for lw in m.layers:
        for k in ("wqkv", "wo", "wgu", "wd"):
            assert lw[k].is_meta
    for (i, g), lin in m.packed.items():
        assert isinstance(lin, W4Linear)
        want = {"qkv": "wqkv", "o": "wo", "gate_up": "wgu", "down": "wd"}[g]
        # The fused packed weight dequantises to the dense model's fused weight exactly.
        assert torch.equal(lin.dequantize(torch.bfloat16), dense.layers[i][want])
    packed_bytes = sum(w.nbytes for w in m.packed.values())
    dense_proj = sum(
        lw[k].numel() * lw[k].element_size()
        for lw in dense.layers
        for k in ("wqkv", "wo", "wgu", "wd")
    )
    assert m.nbytes == dense.nbytes - dense_proj + packed_bytes
    assert packed_bytes < dense_proj / 3  # 4-bit words + per-128 fp16 scales vs bf16
    with pytest.raises(ValueError, match="module: q_proj of layer 0 is held packed"):
        m.module_weight(0, "q_proj")


def test_fp8_packing_fuses_per_tensor_scales(plain: Path, tmp_path: Path) -> None:
    """Per-tensor q/k/v scales become one per-output scale vector (exact), static input
    scales their maximum; block scales stay dense (no row-wise form)."""
    dst, _ = _fp8(plain, tmp_path, "fp8-tensor-static")
    m = _packed_model(dst)
    dense = load_model(dst, torch.device("cpu"), torch.float32, 64)
    lin = m.packed[(0, "qkv")]
    assert isinstance(lin, Fp8Linear)
    assert lin.input_scale is not None
    assert float(lin.input_scale) == pytest.approx(0.02)
    assert torch.equal(lin.dequantize(torch.float32), dense.layers[0]["wqkv"])
    blk, _ = _fp8(plain, tmp_path / "blk", "fp8-block")
    mb = _packed_model(blk)
    assert not mb.packed
    assert not any(t.is_meta for lw in mb.layers for t in lw.values())


def test_quant_kernels_value_refused_by_name() -> None:
    from adaptermesh.worker.engine_config import validate_config
    from adaptermesh.worker.types import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="quant_kernels"):
        validate_config(engine_config(quant_kernels="yes"))


def test_int4_parts_with_different_orders_stay_dense() -> None:
    """4-bit parts of one projection whose act-order g_idx (or group size) differ cannot
    share one device weight: ``pack_linear`` leaves them dense."""
    from adaptermesh.worker.quant import Int4BaseWeight, pack_linear

    def part(g_idx: torch.Tensor | None, group: int = 8) -> Int4BaseWeight:
        return Int4BaseWeight(
            torch.zeros(2, 8, dtype=torch.int32),
            torch.zeros(2, 8, dtype=torch.uint8),
            torch.ones(2, 8, dtype=torch.float16),
            g_idx,
            group,
            16,
        )

    g = (torch.arange(16) // 8).flip(0).to(torch.int32)
    assert isinstance(pack_linear([part(None), part(None)]), W4Linear)
    assert isinstance(pack_linear([part(g), part(g.clone())]), W4Linear)
    assert pack_linear([part(g), part(None)]) is None
    assert pack_linear([part(g), part(g.roll(1))]) is None
    assert pack_linear([part(None), part(None, 16)]) is None
