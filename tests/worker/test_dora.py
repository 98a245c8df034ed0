"""DoRA (``use_dora``) adapters against transformers + peft: one batch mixing DoRA rows, plain
LoRA rows and base rows gives every request peft's greedy tokens and close logits; the configs
the worker cannot serve exactly are refused by name; the pool counts the factors."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.engine_config import InvalidRequestError, validate_config
from adaptermesh.worker.model import ModelConfig, make_lora_pool
from adaptermesh.worker.peft_adapter import AdapterValidationError, read_adapter

from .fidelity_helpers import (
    EXAMPLES,
    PROMPT,
    adapter_case,
    build_model,
    match_case,
    peft_adapter,
)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [PROMPT, PROMPT[3:7]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("dora") / "m", "llama", seed=3, pad_token_id=0)


def _dora_root(root: Path, model_dir: Path) -> list[str]:
    """Three DoRA adapters (ranks 4, 8, 16; different targets, rsLoRA, rank and alpha
    patterns) and two plain LoRA ones."""
    peft_adapter(
        root, model_dir, "d4", 11, r=4, lora_alpha=8.0, use_dora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )  # fmt: skip
    peft_adapter(
        root, model_dir, "d8", 12, r=8, lora_alpha=12.0, use_dora=True, use_rslora=True,
        target_modules="all-linear",
    )  # fmt: skip
    peft_adapter(
        root, model_dir, "d16", 13, r=16, lora_alpha=16.0, use_dora=True,
        target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
        rank_pattern={"o_proj": 2}, alpha_pattern={r"layers\.1\.mlp\.up_proj": 40.0},
    )  # fmt: skip
    peft_adapter(
        root, model_dir, "p4", 14, r=4, lora_alpha=8.0, target_modules=["q_proj", "o_proj"]
    )
    peft_adapter(root, model_dir, "p8", 15, r=8, lora_alpha=4.0, target_modules="all-linear")
    return ["d4", "d8", "d16", "p4", "p8"]


def test_dora_and_lora_rows_in_one_batch_match_peft(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    names = _dora_root(root, llama)
    # Three slots for five adapters: DoRA and plain adapters take over each other's slots
    # mid-run (eviction, reload), so a slot's factors must follow what it holds.
    match_case(
        llama,
        root,
        names,
        PROMPTS,
        n=4,
        tag="dora-",
        lora_dora=True,
        max_loras=3,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


def test_dora_with_projection_biases_matches_peft(tmp_path: Path) -> None:
    # Qwen2's q/k/v biases, Llama's o and MLP biases: DoRA scales W x + the LoRA term, not
    # the bias (peft subtracts the bias before scaling and adds it back).
    for arch, cfg in (("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})):
        model_dir = build_model(tmp_path / arch / "m", arch, seed=5, pad_token_id=0, **cfg)
        root = tmp_path / arch / "adapters"
        peft_adapter(root, model_dir, "d", 21, r=6, use_dora=True, target_modules="all-linear")
        peft_adapter(root, model_dir, "p", 22, r=3, target_modules=["q_proj", "down_proj"])
        match_case(model_dir, root, ["d", "p"], PROMPTS, n=4, tag=f"{arch}-", lora_dora=True)


# Every family the worker serves. Phi-3's fused qkv_proj / gate_up_proj carry one magnitude
# vector over the stacked outputs, split onto the slices like B.
FAMILIES = [
    ("mistral", {}, MODULES),
    ("qwen3", {"attention_bias": True}, MODULES),
    ("phi3", {}, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    ("phi3", {}, ("qkv_proj", "down_proj")),
    ("gemma", {"head_dim": 16, "attention_bias": True}, MODULES),
    ("gemma2", {"head_dim": 8, "final_logit_softcapping": 5.0}, MODULES),
    ("gemma3_text", {"head_dim": 8, "sliding_window": 3, "sliding_window_pattern": 2}, MODULES),
]


@pytest.mark.parametrize(
    ("arch", "cfg", "mods"), FAMILIES, ids=[f"{f[0]}-{len(f[2])}" for f in FAMILIES]
)
def test_dora_on_every_family_matches_peft(
    tmp_path: Path, arch: str, cfg: dict[str, Any], mods: tuple[str, ...]
) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=4, pad_token_id=0, **cfg)
    root = tmp_path / "adapters"
    peft_adapter(root, model_dir, "d", 41, r=4, use_dora=True, target_modules=list(mods))
    peft_adapter(root, model_dir, "p", 42, r=2, target_modules=list(mods[:1]))
    match_case(model_dir, root, ["d", "p"], PROMPTS, n=3, tag=f"{arch}-", lora_dora=True)


def test_dora_magnitude_really_changes_output(llama: Path, tmp_path: Path) -> None:
    # Guards the equivalence tests against a factor that is ignored (or always 1): the same
    # matrices saved without their magnitudes, as plain LoRA, give other tokens.
    root = tmp_path / "adapters"
    peft_adapter(root, llama, "d", 31, r=8, use_dora=True, target_modules="all-linear")
    plain = root / "plain"
    plain.mkdir()
    tensors = load_file(str(root / "d" / "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if "magnitude" not in k},
        str(plain / "adapter_model.safetensors"),
    )
    cj = json.loads((root / "d" / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**cj, "use_dora": False}))

    async def go() -> dict[str, list[int]]:
        from .conftest import collect, request, tokens

        eng = Engine(llama, root, config=EngineConfig(lora_dora=True, max_loras=2))
        try:
            outs = {}
            for name in ("d", "plain"):
                outs[name] = tokens(await collect(eng.submit(request(name, PROMPT, name))))
            return outs
        finally:
            await eng.shutdown()

    outs = asyncio.run(go())
    assert outs["d"] != outs["plain"]


@st.composite
def dora_case(draw: st.DrawFn) -> dict[str, Any]:
    arch = draw(st.sampled_from(["llama", "qwen2"]))
    cfg: dict[str, Any] = {}
    if arch == "llama":
        cfg["attention_bias"] = draw(st.booleans())
        cfg["mlp_bias"] = draw(st.booleans())
    adapters = []
    for _ in range(draw(st.integers(1, 2))):
        ad = draw(adapter_case(MODULES, 2))
        ad["r"] = min(ad["r"], 32)
        if "rank_pattern" in ad:
            ad["rank_pattern"] = {k: min(v, 32) for k, v in ad["rank_pattern"].items()}
        ad["use_dora"] = True
        adapters.append(ad)
    plain = draw(st.booleans())
    return {
        "arch": arch,
        "cfg": cfg,
        "adapters": adapters,
        "plain": plain,
        "seed": draw(st.integers(0, 1000)),
    }


@settings(
    max_examples=min(EXAMPLES, 6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=dora_case())
def test_random_dora_configs_match_peft(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("dprop")
    seed = case["seed"]
    model_dir = build_model(tmp / "m", case["arch"], seed=seed, pad_token_id=0, **case["cfg"])
    root = tmp / "adapters"
    names = []
    for i, ad in enumerate(case["adapters"]):
        peft_adapter(root, model_dir, f"d{i}", seed=seed + i, **ad)
        names.append(f"d{i}")
    if case["plain"]:
        peft_adapter(root, model_dir, "p", seed=seed + 7, r=4, target_modules="all-linear")
        names.append("p")
    match_case(
        model_dir,
        root,
        names,
        PROMPTS,
        n=3,
        tag=f"{case['arch']}-",
        lora_dora=True,
        max_loras=len(names),
        max_lora_rank=32,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


# --- refused by name -----------------------------------------------------------------------


def _read(path: Path, model_dir: Path, per_module: bool = True) -> Any:
    cfg = ModelConfig.from_dir(model_dir)
    return read_adapter("ad", path, cfg, 16, torch.float32, pin_memory=False, per_module=per_module)


def test_fused_magnitudes_split_onto_the_slices(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "m", "phi3", seed=1, pad_token_id=0)
    path = peft_adapter(
        tmp_path / "a", model_dir, "ad", 1, r=4, use_dora=True, target_modules=["qkv_proj"]
    )
    cpu = _read(path, model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    m = load_file(str(path / "adapter_model.safetensors"))[
        "base_model.model.model.layers.1.self_attn.qkv_proj.lora_magnitude_vector"
    ]
    parts = [e for e in cpu.magnitudes if e.layer == 1]
    assert [(e.group, e.index) for e in parts] == [("qkv", 0), ("qkv", 1), ("qkv", 2)]
    widths = [cfg.module_shape(s)[1] for s in ("q_proj", "k_proj", "v_proj")]
    torch.testing.assert_close(torch.cat([cpu.magnitude(e) for e in parts]), m)
    assert [e.length for e in parts] == widths


def test_dora_for_adafuse_experts_is_refused_by_name(llama: Path, tmp_path: Path) -> None:
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["q_proj"])
    with pytest.raises(AdapterValidationError) as exc:
        _read(path, llama, per_module=False)
    assert exc.value.field == "use_dora"
    _read(path, llama)  # a pool slot takes it


def test_dora_without_its_magnitudes_is_refused(llama: Path, tmp_path: Path) -> None:
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["v_proj"])
    f = path / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector"
    del tensors[key]
    save_file(tensors, str(f))
    with pytest.raises(AdapterValidationError, match="lora_magnitude_vector"):
        _read(path, llama)


def test_dora_magnitude_with_nan_is_refused(llama: Path, tmp_path: Path) -> None:
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["v_proj"])
    f = path / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_magnitude_vector"
    tensors[key][3] = math.nan
    save_file(tensors, str(f))
    with pytest.raises(AdapterValidationError, match="NaN"):
        _read(path, llama)


def test_magnitudes_without_use_dora_are_refused(llama: Path, tmp_path: Path) -> None:
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["v_proj"])
    cj = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cj, "use_dora": False}))
    with pytest.raises(AdapterValidationError, match=r"unexpected tensor .*lora_magnitude_vector"):
        _read(path, llama)


def test_dora_on_a_worker_without_dora_factors_is_refused(llama: Path, tmp_path: Path) -> None:
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["q_proj"])

    async def go() -> None:
        eng = Engine(llama, tmp_path, config=EngineConfig(max_loras=2))
        try:
            with pytest.raises(AdapterValidationError) as exc:
                await eng.load_adapter("ad", str(path))
            assert exc.value.field == "use_dora"
            assert "--lora-dora" in str(exc.value)
        finally:
            await eng.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize(
    "kw", [{"lora_dtype": "int4"}, {"tensor_parallel_size": 2}], ids=["int4", "tp"]
)
def test_dora_pool_with_unsupported_pool_config_is_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match="lora_dora"):
        validate_config(EngineConfig(lora_dora=True, **kw))


# --- the pool ------------------------------------------------------------------------------


def test_pool_counts_dora_factors(llama: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    cpu = torch.device("cpu")
    plain = make_lora_pool(cfg, 3, 8, cpu, torch.float32)
    dora = make_lora_pool(cfg, 3, 8, cpu, torch.float32, dora=True)
    widths = sum(cfg.module_shape(m)[1] for m in MODULES)
    # One factor per output feature of every module, per slot and for the base rows' slot.
    assert dora.nbytes - plain.nbytes == cfg.num_layers * (3 + 1) * widths * 4
    assert not plain.dora
    dora.dora["qkv"][:, 1] = 2.0
    dora.clear(1)
    assert bool((dora.dora["qkv"] == 1.0).all())


def test_dora_norms_come_from_the_unmerged_base(llama: Path, tmp_path: Path) -> None:
    # An AdaFuse merge writes into the live weights; a DoRA adapter loading meanwhile must
    # take its norms from the module's pristine copy, as peft (on the base model) does.
    path = peft_adapter(tmp_path, llama, "ad", 1, r=4, use_dora=True, target_modules=["q_proj"])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    a, b = tensors[prefix + "lora_A.weight"], tensors[prefix + "lora_B.weight"]
    m = tensors[prefix + "lora_magnitude_vector"]

    async def go() -> None:
        eng = Engine(llama, tmp_path, config=EngineConfig(lora_dora=True, max_loras=2))
        try:
            w0 = eng.merge_policy.masters.get(0, "q_proj").clone()  # what a set load takes
            eng.model.module_weight(0, "q_proj").add_(0.5)  # what a merge then writes
            await eng.load_adapter("ad", str(path))
            slot = eng.adapters.published["ad"].slot
            index = int(eng.pool.routes["qkv"].index[slot])  # its index in the qkv group
            got = eng.pool.dora_factors("qkv", 0)[index, : w0.shape[0]]
            cj = json.loads((path / "adapter_config.json").read_text())
            scale = cj["lora_alpha"] / cj["r"]
            want = m / torch.linalg.norm(w0 + scale * (b @ a), dim=1)
            torch.testing.assert_close(got, want)
        finally:
            await eng.shutdown()

    asyncio.run(go())
