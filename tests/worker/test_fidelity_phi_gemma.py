"""Phi-3 and Gemma (1, 2 and 3 text) fidelity: the worker against transformers + peft on tiny random
models, every config field honoured or refused by name, and adapters on Phi-3's fused
qkv_proj / gate_up_proj split exactly onto the q/k/v and gate/up slices."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.worker.adapters import AdapterValidationError, read_adapter
from adaptermesh.worker.model import ModelConfig, rope_inv_freq

from .fidelity_helpers import (
    EXAMPLES,
    PROMPT,
    Ref,
    adapter_case,
    build_model,
    match_case,
    peft_adapter,
    run_random_case,
)

PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GEMMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _longrope(rot: int, seed: int = 0) -> dict[str, Any]:
    """LongRoPE parameters with distinct short and long factors (rot / 2 of each)."""
    g = torch.Generator().manual_seed(seed)
    short = (1.0 + 0.5 * torch.rand(rot // 2, generator=g)).tolist()
    long = (2.0 + 6.0 * torch.rand(rot // 2, generator=g)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long}


def _config(arch: str, **patch: Any) -> dict[str, Any]:
    """config.json as transformers writes it for a small model of ``arch``."""
    import transformers

    base: dict[str, Any] = {
        "vocab_size": 384,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = transformers.AutoConfig.for_model(arch, **base).to_diff_dict()
    d.update(patch)
    return d


# --- config parsing ------------------------------------------------------------------------

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    # Key sets (values shrunk) of Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct, Phi-4-mini-instruct,
    # gemma-2-2b and gemma-7b as published.
    "phi-3-mini-4k": {
        "_name_or_path": "Phi-3-mini-4k-instruct",
        "architectures": ["Phi3ForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2",
        "use_cache": True,
        "attention_bias": False,
        "vocab_size": 384,
    },
    "phi-3.5-mini": {
        "_name_or_path": "Phi-3.5-mini-instruct",
        "architectures": ["Phi3ForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 131072,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {**_longrope(16), "type": "longrope"},
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.3",
        "use_cache": True,
        "attention_bias": False,
        "vocab_size": 384,
    },
    "phi-4-mini": {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 0,
        "embd_pdrop": 0.0,
        "eos_token_id": 1,
        "full_attn_mod": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "interpolate_factor": 1,
        "lm_head_bias": False,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 1,
        "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {**_longrope(12), "type": "longrope"},
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": 384,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "torch_dtype": "float32",
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": 384,
    },
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": 384,
    },
    "gemma-7b": {
        "architectures": ["GemmaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "head_dim": 32,
        "hidden_act": "gelu",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 8192,
        "model_type": "gemma",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.38.0.dev0",
        "use_cache": True,
        "vocab_size": 384,
    },
}


def test_real_config_key_sets_load() -> None:
    c = ModelConfig.from_dict(REAL_CONFIGS["phi-3-mini-4k"])
    assert c.fused_checkpoint
    assert c.layer_windows == (2047, 2047)
    assert c.rot_dim == 16
    assert c.rope_scaling is None
    c = ModelConfig.from_dict(REAL_CONFIGS["phi-3.5-mini"])
    assert c.rope_scaling is not None
    assert c.rope_scaling["rope_type"] == "longrope"
    assert c.rope_scaling["original_max_position_embeddings"] == 4096
    c = ModelConfig.from_dict(REAL_CONFIGS["phi-4-mini"])
    assert c.rot_dim == 12
    assert c.head_dim == 16
    assert c.tie_word_embeddings
    c = ModelConfig.from_dict(REAL_CONFIGS["gemma-2-2b"])
    assert c.layer_windows == (4096, None)
    assert c.attn_softcap == 50.0
    assert c.final_softcap == 30.0
    assert c.attn_scale == 256**-0.5
    assert c.head_dim == 32
    assert c.tie_word_embeddings
    assert c.sandwich_norm
    assert c.act == "gelu_pytorch_tanh"
    assert c.gemma_norm
    assert c.embed_scale == math.sqrt(64)
    c = ModelConfig.from_dict(REAL_CONFIGS["gemma-3-1b"])
    assert c.local_rope == (10000.0, None)
    assert c.rope_theta == 1e6
    assert c.rope_scaling is None
    assert c.local_rope_layers == (True, False)
    assert c.layer_windows == (512, None)
    assert c.attn_softcap is None
    assert c.qk_norm
    c = ModelConfig.from_dict(REAL_CONFIGS["gemma-7b"])
    assert c.act == "gelu_pytorch_tanh"
    assert c.attn_scale is None
    assert c.attn_softcap is None
    assert not c.sandwich_norm


def test_defaults_follow_transformers_configs() -> None:
    import transformers

    # Absent fields take the transformers defaults: Gemma 2's soft-caps, window and head_dim.
    d = {
        k: v
        for k, v in REAL_CONFIGS["gemma-2-2b"].items()
        if k
        not in (
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "sliding_window",
            "head_dim",
            "query_pre_attn_scalar",
            "hidden_activation",
        )
    }
    d["num_hidden_layers"] = 3
    c = ModelConfig.from_dict(d)
    t = transformers.Gemma2Config(num_hidden_layers=3)
    assert (c.attn_softcap, c.final_softcap, c.head_dim) == (
        t.attn_logit_softcapping,
        t.final_logit_softcapping,
        t.head_dim,
    )
    assert c.layer_windows == tuple(
        t.sliding_window if x == "sliding_attention" else None for x in t.layer_types
    )
    assert c.attn_scale == t.query_pre_attn_scalar**-0.5
    assert c.act == t.hidden_activation
    # Phi-3 without a window attends to everything; partial_rotary_factor inside rope_parameters.
    # (inside rope_parameters it wins over the top level, as Phi3Config resolves it).
    d = _config("phi3", partial_rotary_factor=0.5)
    assert ModelConfig.from_dict(d).rot_dim == 8
    d["rope_parameters"].pop("partial_rotary_factor")
    c = ModelConfig.from_dict(d)
    assert c.layer_windows == ()
    assert c.rot_dim == 4


@pytest.mark.parametrize(
    ("max_len", "rope"),
    [
        (64, {"original_max_position_embeddings": 16}),
        (16, {"original_max_position_embeddings": 16}),
        (300, {"original_max_position_embeddings": 32, "factor": 3.0}),
        (300, {"original_max_position_embeddings": 32, "attention_factor": 1.25}),
    ],
)
def test_longrope_tables_match_transformers(max_len: int, rope: dict[str, Any]) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    orig = rope["original_max_position_embeddings"]
    lr = {
        **_longrope(4, seed=1),
        **{k: v for k, v in rope.items() if k != "original_max_position_embeddings"},
    }
    d = _config(
        "phi3",
        partial_rotary_factor=0.5,
        original_max_position_embeddings=orig,
        rope_parameters=None,
        rope_scaling=lr,
    )
    cfg = ModelConfig.from_dict(d)
    inv, mscale = rope_inv_freq(cfg, max_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformers.Phi3Config(
            **{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")}
        )
    # transformers' choice for one forward call over max_len positions.
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["longrope"](tc, "cpu", seq_len=max_len)
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=1e-7)
    assert mscale == pytest.approx(want_scale, rel=1e-12)
    assert inv.shape == (2,)


# --- refused fields ------------------------------------------------------------------------

REFUSED = [
    ("phi3", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ("phi3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    (
        "phi3",
        {"rope_parameters": None, "rope_scaling": {**_longrope(8), "short_factor": [1.0, 1.0]}},
        "rope_scaling",
    ),
    (
        "phi3",
        {
            "rope_parameters": None,
            "rope_scaling": {**_longrope(8), "long_factor": [1.0, "x", 1.0, 1.0]},
        },
        "rope_scaling",
    ),
    (
        "phi3",
        {"rope_parameters": None, "rope_scaling": {**_longrope(8), "beta_fast": 32}},
        "rope_scaling",
    ),
    (
        "phi3",
        {"rope_parameters": None, "partial_rotary_factor": 0.375},
        "partial_rotary_factor",
    ),  # 3 rotated dims
    ("phi3", {"rope_parameters": None, "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    (
        "phi3",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.1,
            }
        },
        "rope_parameters",
    ),
    ("phi3", {"attention_bias": True}, "attention_bias"),
    ("phi3", {"mlp_bias": True}, "mlp_bias"),
    ("phi3", {"lm_head_bias": True}, "lm_head_bias"),
    ("phi3", {"full_attn_mod": 2}, "full_attn_mod"),
    ("phi3", {"interpolate_factor": 2}, "interpolate_factor"),
    ("phi3", {"auto_map": {"AutoModelForCausalLM": "modeling_custom.MyPhi"}}, "auto_map"),
    ("phi3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("phi3", {"hidden_act": "gelu_new"}, "hidden_act"),
    (
        "phi3",
        {"quantization_config": {"quant_method": "awq", "version": "gemv"}},
        "quantization_config",
    ),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu_new"}, "hidden_activation"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping"),
    ("gemma2", {"mlp_bias": True}, "mlp_bias"),
    (
        "gemma2",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        },
        "rope_parameters",
    ),
    (
        "gemma2",
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        "rope_parameters",
    ),
    ("gemma2", {"final_logit_softcapping_new": 1}, "final_logit_softcapping_new"),
    ("gemma", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma", {"sliding_window": 16}, "sliding_window"),
    ("gemma", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    (
        "gemma3_text",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        "rope_parameters",
    ),
    (
        "gemma3_text",
        {"rope_parameters": {"chunked_attention": {"rope_type": "default"}}},
        "rope_parameters",
    ),
    (
        "gemma3_text",
        {"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1e4}}},
        "rope_parameters",
    ),
    (
        "gemma3_text",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}
            }
        },
        "rope_parameters",
    ),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"mlp_bias": True}, "mlp_bias"),
    ("gemma3_text", {"rope_local_base_freq": -1}, "rope_local_base_freq"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {}, "model_type"),
    ("phimoe", {}, "model_type"),
    ("phi3small", {}, "model_type"),
]


@pytest.mark.parametrize(
    ("arch", "patch", "field"), REFUSED, ids=[f"{a}-{f}-{i}" for i, (a, _, f) in enumerate(REFUSED)]
)
def test_field_refused_by_name(arch: str, patch: dict[str, Any], field: str) -> None:
    d = _config(arch if arch in ("phi3", "gemma", "gemma2", "gemma3_text") else "gemma2")
    d["model_type"] = arch
    d.update(patch)
    with pytest.raises(ValueError, match=rf"config\.{field}:") as exc:
        ModelConfig.from_dict(d)
    assert field in str(exc.value)


# --- adapters on fused modules ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("phi") / "m", "phi3", seed=2, pad_token_id=0)


def test_fused_adapter_entries_split_b_and_share_a(tmp_path: Path, tiny_phi3: Path) -> None:
    path = peft_adapter(
        tmp_path,
        tiny_phi3,
        "f",
        seed=1,
        r=3,
        lora_alpha=6,
        target_modules=["qkv_proj", "gate_up_proj"],
    )
    cfg = ModelConfig.from_dir(tiny_phi3)
    cpu = read_adapter("f", path, cfg, 16, torch.float32, pin_memory=False, per_module=True)
    assert cpu.targets == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    from safetensors.torch import load_file

    sd = load_file(str(path / "adapter_model.safetensors"))
    for layer in range(cfg.num_layers):
        mine = {(e.group, e.index, e.is_b): cpu.view(e) for e in cpu.entries if e.layer == layer}
        for fused, group in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", "gate_up")):
            key = f"base_model.model.model.layers.{layer}.{fused}"
            a, b = sd[key + ".lora_A.weight"], sd[key + ".lora_B.weight"]
            n = 3 if group == "qkv" else 2
            for i in range(n):
                assert torch.equal(mine[(group, i, False)], a)
            assert torch.equal(torch.cat([mine[(group, i, True)] for i in range(n)]), b)
    assert [mine[("qkv", i, True)].shape[0] for i in range(3)] == [
        cfg.module_shape(m)[1] for m in ("q_proj", "k_proj", "v_proj")
    ]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"target_modules": ["q_proj"]}, "target_modules"),
        ({"target_modules": ["gate_proj", "o_proj"]}, "target_modules"),
    ],
)
def test_phi3_adapter_on_unfused_names_refused(
    tmp_path: Path, tiny_phi3: Path, patch: dict[str, Any], field: str
) -> None:
    import json

    path = peft_adapter(
        tmp_path, tiny_phi3, "u", seed=1, r=2, lora_alpha=2, target_modules=["o_proj"]
    )
    cj = json.loads((path / "adapter_config.json").read_text())
    cj.update(patch)
    (path / "adapter_config.json").write_text(json.dumps(cj))
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter(
            "u",
            path,
            ModelConfig.from_dir(tiny_phi3),
            16,
            torch.float32,
            pin_memory=False,
            per_module=True,
        )
    assert exc.value.field == field
    assert "qkv_proj" in str(exc.value)


def test_fused_adapter_refused_for_adafuse_experts(tmp_path: Path, tiny_phi3: Path) -> None:
    path = peft_adapter(
        tmp_path, tiny_phi3, "x", seed=1, r=2, lora_alpha=2, target_modules=["qkv_proj"]
    )
    with pytest.raises(AdapterValidationError, match="fused") as exc:
        read_adapter(
            "x", path, ModelConfig.from_dir(tiny_phi3), 16, torch.float32, pin_memory=False
        )
    assert exc.value.field == "target_modules"


# --- against transformers + peft -----------------------------------------------------------

LONG_PROMPT = tuple(range(2, 80, 3))  # 26 tokens


FEATURES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # id, arch, config, engine overrides
    ("phi3-window", "phi3", {"sliding_window": 4, "num_key_value_heads": 4}, {}),
    # LongRoPE past original_max_position_embeddings (8): long factors from position 0, as in
    # transformers' forward over every sequence here; partial rotary (half of each head).
    (
        "phi3-longrope-long",
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 8,
            "rope_scaling": _longrope(4, seed=3),
        },
        {},
    ),
    # Serving length within the original one: the short factors, with the attention factor of
    # max_position_embeddings / original.
    (
        "phi3-longrope-short",
        "phi3",
        {
            "original_max_position_embeddings": 64,
            "max_position_embeddings": 512,
            "rope_scaling": _longrope(8, seed=4),
        },
        {"max_model_len": 64},
    ),
    (
        "phi3-tied-gelu",
        "phi3",
        {"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh", "num_hidden_layers": 3},
        {},
    ),
    (
        "gemma2",
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "sliding_window": 4,
            "num_hidden_layers": 3,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
        },
        {},
    ),
    (
        "gemma2-untied-nocap",
        "gemma2",
        {
            "head_dim": 8,
            "attention_bias": True,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": 5.0,
            "sliding_window": 3,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        {},
    ),
    (
        "gemma",
        "gemma",
        {"head_dim": 16, "hidden_act": "gelu", "tie_word_embeddings": True, "attention_bias": True},
        {},
    ),
    # Gemma 3: q/k norms with (1 + w), sliding layers with their own RoPE base, full layers
    # with linear scaling on theirs.
    (
        "gemma3",
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "sliding_window": 4,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_theta": 1000.0,
            "rope_local_base_freq": 50.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "tie_word_embeddings": True,
        },
        {},
    ),
    (
        "gemma3-pattern-cap",
        "gemma3_text",
        {
            "head_dim": 8,
            "sliding_window": 3,
            "sliding_window_pattern": 2,
            "final_logit_softcapping": 3.0,
            "attention_bias": True,
        },
        {},
    ),
]


def _modules(arch: str) -> tuple[str, ...]:
    return PHI3_MODULES if arch == "phi3" else GEMMA_MODULES


@pytest.mark.parametrize(
    ("arch", "extra", "eng_kw"), [f[1:] for f in FEATURES], ids=[f[0] for f in FEATURES]
)
def test_family_matches_transformers(
    tmp_path: Path, arch: str, extra: dict[str, Any], eng_kw: dict[str, Any]
) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=3, pad_token_id=0, **extra)
    root = tmp_path / "adapters"
    mods = _modules(arch)
    peft_adapter(root, model_dir, "all", seed=5, r=4, lora_alpha=8, target_modules=list(mods))
    # One fused module alone (Phi-3) / attention only, with a rank pattern on another module.
    part = ["qkv_proj", "down_proj"] if arch == "phi3" else ["k_proj", "v_proj", "up_proj"]
    peft_adapter(
        root,
        model_dir,
        "part",
        seed=6,
        r=3,
        lora_alpha=5,
        target_modules=part,
        rank_pattern={part[-1]: 6},
        alpha_pattern={part[0]: 2.0},
    )
    match_case(
        model_dir,
        root,
        ["all", "part"],
        [LONG_PROMPT, PROMPT[:6]],
        n=4,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
        **eng_kw,
    )


def test_gemma2_caps_and_windows_bite(tmp_path: Path) -> None:
    # Guards the Gemma 2 case above against features that never change a logit.
    base = {
        "head_dim": 16,
        "sliding_window": 4,
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
    }
    plain = Ref(
        build_model(
            tmp_path / "p",
            "gemma2",
            seed=3,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            layer_types=["full_attention", "full_attention"],
            **base,
        ),
        tmp_path,
        [],
    )
    for patch in (
        {
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": None,
            "layer_types": ["full_attention"] * 2,
        },
        {
            "attn_logit_softcapping": None,
            "final_logit_softcapping": 3.0,
            "layer_types": ["full_attention"] * 2,
        },
        {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    ):
        other = Ref(
            build_model(
                tmp_path / str(len(patch)) / str(id(patch)), "gemma2", seed=3, **patch, **base
            ),
            tmp_path,
            [],
        )
        diff = other.logits(list(LONG_PROMPT), None)[-1] - plain.logits(list(LONG_PROMPT), None)[-1]
        assert diff.abs().max() > 1e-3, patch


# --- property: random Phi-3 / Gemma configs and adapters ------------------------------------


@st.composite
def family_case(draw: st.DrawFn) -> dict[str, Any]:
    arch = draw(st.sampled_from(["phi3", "gemma", "gemma2", "gemma3_text"]))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 3))
    cfg: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "intermediate_size": draw(st.sampled_from([24, 48])),
        "tie_word_embeddings": draw(st.booleans()),
    }
    act = draw(st.sampled_from(["silu", "gelu", "gelu_pytorch_tanh", "relu"]))
    if arch == "phi3":
        cfg["hidden_size"] = (
            heads * head_dim
        )  # Phi3Config checks rope factors against hidden / heads
        cfg["hidden_act"] = act
        cfg["sliding_window"] = draw(st.sampled_from([None, 3, 6]))
        prf = draw(st.sampled_from([1.0, 0.5]))
        rot = int(head_dim * prf)
        if prf != 1.0:
            cfg["partial_rotary_factor"] = prf
        if draw(st.booleans()):
            cfg["original_max_position_embeddings"] = draw(st.sampled_from([8, 256]))
            cfg["rope_scaling"] = _longrope(rot, seed=draw(st.integers(0, 9)))
    else:
        cfg["hidden_size"] = draw(st.sampled_from([32, 48]))
        cfg["head_dim"] = head_dim
        cfg["attention_bias"] = draw(st.booleans())
        cfg["hidden_act" if arch == "gemma" else "hidden_activation"] = act
    if arch == "gemma3_text":
        cfg["rope_local_base_freq"] = draw(st.sampled_from([100.0, 10000.0]))
        cfg["rope_theta"] = draw(st.sampled_from([1000.0, 1e6]))
    if arch in ("gemma2", "gemma3_text"):
        cfg["query_pre_attn_scalar"] = draw(st.sampled_from([8, 12, 64]))
        cfg["attn_logit_softcapping"] = (
            draw(st.sampled_from([None, 1.5, 50.0])) if arch == "gemma2" else None
        )
        cfg["final_logit_softcapping"] = draw(st.sampled_from([None, 2.0, 30.0]))
        cfg["sliding_window"] = draw(st.sampled_from([3, 6]))
        cfg["layer_types"] = draw(
            st.lists(
                st.sampled_from(["sliding_attention", "full_attention"]),
                min_size=layers,
                max_size=layers,
            )
        )
    adapters = [draw(adapter_case(_modules(arch), layers)) for _ in range(draw(st.integers(1, 3)))]
    return {"arch": arch, "cfg": cfg, "adapters": adapters, "seed": draw(st.integers(0, 1000))}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=family_case())
def test_random_families_match(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    # Both prompts pass an original_max_position_embeddings of 8: LongRoPE's long factors then
    # apply from position 0 in transformers too (see docs/models.md).
    run_random_case(tmp_path_factory.mktemp("fam"), case, [LONG_PROMPT[:15], PROMPT[3:12]])
