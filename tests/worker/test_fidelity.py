"""Model and adapter fidelity: every config field is honoured or refused by name, every
checkpoint tensor is consumed, and each implemented feature gives transformers + peft's tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.worker.adapters import AdapterValidationError, read_adapter
from adaptermesh.worker.model import ModelConfig, TransformerModel, read_weights, rope_inv_freq
from adaptermesh.worker.testing import (
    make_adapter,
    make_model_config,
    make_tiny_model,
    make_tokenizer,
)

from .conftest import collect, recording_logits, request, tokens

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- builders ------------------------------------------------------------------------------


def build_model(directory: Path, arch: str, seed: int = 0, **config: Any) -> Path:
    """A random checkpoint saved by transformers, with any config field (biases, activations,
    windows, RoPE scaling) that make_tiny_model does not expose."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(directory)
    base = {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    }
    base.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(arch, **base)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(directory, safe_serialization=True)
    return directory


def peft_adapter(root: Path, model_dir: Path, name: str, seed: int, **lora: Any) -> Path:
    """An adapter saved by peft itself from a LoraConfig, with random non-zero A and B."""
    import peft
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        pm = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_A" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        pm.save_pretrained(str(root / name))
    return root / name


class Ref:
    """transformers + peft over a model and any number of adapters (or none)."""

    def __init__(self, model_dir: Path, root: Path, names: list[str]) -> None:
        import peft
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            if names:
                self.model = peft.PeftModel.from_pretrained(self.model, str(root / names[0]), adapter_name=names[0])
                for n in names[1:]:
                    self.model.load_adapter(str(root / n), adapter_name=n)
        self.model.eval()
        self.has_adapters = bool(names)

    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if adapter is None:
                if not self.has_adapters:
                    return self.model(input_ids=x).logits[0].float()
                with self.model.disable_adapter():
                    return self.model(input_ids=x).logits[0].float()
            self.model.set_adapter(adapter)
            return self.model(input_ids=x).logits[0].float()


PROMPT = tuple(range(2, 40, 3))  # 13 tokens: longer than every window used below


async def assert_matches(
    eng: Any, ref: Ref, names: list[str | None], log: dict[str, list[torch.Tensor]], prompts: list[tuple[int, ...]],
    n: int = 4, tag: str = "",
) -> None:
    """One concurrent batch over ``names`` x ``prompts``: greedy tokens equal the reference's,
    and the logits are close, per request."""
    jobs = [(f"{tag}{i}-{name}", p, name) for i, p in enumerate(prompts) for name in names]
    streams = [eng.submit(request(rid, p, name, max_tokens=n)) for rid, p, name in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for (rid, p, name), events in zip(jobs, results, strict=True):
        got = tokens(events)
        assert got, rid
        ref_logits = ref.logits([*p, *got][:-1], name)[len(p) - 1 :]
        want = [int(r.argmax()) for r in ref_logits]
        assert got == want, f"{rid}: engine {got} != reference {want}"
        torch.testing.assert_close(torch.stack(log[rid]), ref_logits, atol=2e-4, rtol=1e-4)


# --- refused config.json fields ------------------------------------------------------------

REFUSED_CONFIG = [
    ("llama", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("llama", {"hidden_act": "tanh"}, "hidden_act"),
    ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_medium": 3}}, "rope_scaling"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "rope_parameters"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("llama", {"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto_map"),
    ("llama", {"brand_new_field": 1}, "brand_new_field"),
    ("llama", {"sliding_window": 128}, "sliding_window"),
    ("llama", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("llama", {"logits_soft_cap": 30.0}, "logits_soft_cap"),
    ("mistral", {"attention_bias": True}, "attention_bias"),
    ("mistral", {"mlp_bias": True}, "mlp_bias"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen2", {"use_mrope": True}, "use_mrope"),
    ("qwen2", {"layer_types": ["full_attention"]}, "layer_types"),
    ("qwen2", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3", {"use_mrope": True}, "use_mrope"),
    ("qwen3", {"mlp_bias": True}, "mlp_bias"),
    ("gemma3", {}, "model_type"),
    ("phimoe", {}, "model_type"),
]


@pytest.mark.parametrize(("arch", "patch", "field"), REFUSED_CONFIG, ids=[f"{a}-{f}-{i}" for i, (a, _, f) in enumerate(REFUSED_CONFIG)])
def test_config_field_refused_by_name(arch: str, patch: dict[str, Any], field: str) -> None:
    d = make_model_config("llama" if arch not in ("llama", "mistral", "qwen2") else arch)  # type: ignore[arg-type]
    d["model_type"] = arch
    d.update(patch)
    with pytest.raises(ValueError, match=rf"config\.{field}:") as exc:
        ModelConfig.from_dict(d)
    assert field in str(exc.value)


REAL_CONFIGS = {
    # Key sets (values shrunk) of Llama-2-7b-hf, Llama-3.1-8B-Instruct, Mistral-7B-v0.1 and
    # Qwen2.5-7B-Instruct as published.
    "llama-2": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 128, "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 384,
    },
    "llama-3.1": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": [1, 2, 3], "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 128, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True,
        "vocab_size": 384,
    },
    "mistral-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 384,
    },
    "qwen2.5": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 384,
    },
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_config_key_sets_load(name: str) -> None:
    cfg = ModelConfig.from_dict(REAL_CONFIGS[name])
    assert cfg.num_layers == 2
    if name == "mistral-v0.1":
        assert cfg.layer_windows == (4096, 4096)
    else:
        assert cfg.layer_windows == ()


def test_qwen2_window_layers_follow_transformers() -> None:
    import transformers

    d = make_model_config("qwen2", num_hidden_layers=4)
    d.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert ModelConfig.from_dict(d).layer_windows == (None, 8, 8, 8)
    c = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert c.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    d["use_sliding_window"] = False
    assert ModelConfig.from_dict(d).layer_windows == ()
    d2 = make_model_config("mistral")
    del d2["sliding_window"]  # absent: MistralConfig's default 4096
    assert ModelConfig.from_dict(d2).layer_windows == (4096, 4096)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False, "beta_fast": 16},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_tables_match_transformers(rope: dict[str, Any]) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = make_model_config("llama", hidden_size=64, num_attention_heads=2, rope_scaling=rope)
    cfg = ModelConfig.from_dict(d)
    inv, mscale = rope_inv_freq(cfg, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformers.LlamaConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures", "torch_dtype")})
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](tc, "cpu")
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=1e-7)
    assert mscale == pytest.approx(want_scale, rel=1e-12)


# --- refused adapter_config.json fields ----------------------------------------------------

REFUSED_ADAPTER = [
    ({"use_dora": True}, "use_dora"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"init_lora_weights": "olora"}, "init_lora_weights"),
    ({"loftq_config": {"loftq_bits": 4, "loftq_iter": 1}}, "loftq_config"),
    ({"use_qalora": True}, "use_qalora"),
    ({"lora_bias": True}, "lora_bias"),
    ({"layer_replication": [[0, 1]]}, "layer_replication"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
    ({"trainable_token_indices": [3]}, "trainable_token_indices"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"brand_new_option": 1}, "brand_new_option"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
    ({"target_modules": ["embed_tokens"]}, "target_modules"),
    ({"target_modules": r".*(lm_head|q_proj)"}, "target_modules"),
    ({"layers_pattern": "h", "layers_to_transform": [0]}, "layers_pattern"),
    ({"layers_to_transform": [5]}, "layers_to_transform"),
    ({"rank_pattern": {"q_proj": 64}}, "rank_pattern"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fid") / "m", num_hidden_layers=2)


def _adapter_with(tmp: Path, model_dir: Path, patch: dict[str, Any], name: str = "ad") -> Path:
    path = make_adapter(tmp, model_dir, name, 4, ("q_proj", "v_proj"), seed=1)
    cj = json.loads((path / "adapter_config.json").read_text())
    cj.update(patch)
    (path / "adapter_config.json").write_text(json.dumps(cj))
    return path


@pytest.mark.parametrize(("patch", "field"), REFUSED_ADAPTER, ids=[f"{f}-{i}" for i, (_, f) in enumerate(REFUSED_ADAPTER)])
def test_adapter_field_refused_by_name(tmp_path: Path, tiny_llama: Path, patch: dict[str, Any], field: str) -> None:
    path = _adapter_with(tmp_path, tiny_llama, patch)
    cfg = ModelConfig.from_dir(tiny_llama)
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("ad", path, cfg, 16, torch.float32, pin_memory=False, per_module=True)
    assert exc.value.field == field
    assert field in str(exc.value)


@pytest.mark.parametrize(
    "patch",
    [
        {"megatron_config": {"tensor_model_parallel_size": 1}, "megatron_core": "megatron.core"},
        {"loftq_config": {}},
        {"init_lora_weights": "gaussian"},
        {"eva_config": None, "corda_config": None, "lora_bias": False, "use_dora": False},
        {"layers_pattern": "layers", "layers_to_transform": [1]},
    ],
)
def test_harmless_adapter_fields_load(tmp_path: Path, tiny_llama: Path, patch: dict[str, Any]) -> None:
    path = _adapter_with(tmp_path, tiny_llama, patch)
    cfg = ModelConfig.from_dir(tiny_llama)
    if "layers_to_transform" in patch:
        with pytest.raises(AdapterValidationError, match="unexpected tensor"):
            read_adapter("ad", path, cfg, 16, torch.float32, pin_memory=False)  # layer 0's tensors are extra
    else:
        assert read_adapter("ad", path, cfg, 16, torch.float32, pin_memory=False).rank == 4


def test_patterns_refused_where_one_scale_is_shared(tmp_path: Path, tiny_llama: Path) -> None:
    # AdaFuse experts read without per_module: an alpha_pattern would be silently dropped.
    cfg = ModelConfig.from_dir(tiny_llama)
    for fld, pat in (("alpha_pattern", {"q_proj": 3.0}), ("rank_pattern", {"q_proj": 2})):
        path = _adapter_with(tmp_path / fld, tiny_llama, {fld: pat})
        with pytest.raises(AdapterValidationError) as exc:
            read_adapter("ad", path, cfg, 16, torch.float32, pin_memory=False)
        assert exc.value.field == fld


def test_adafuse_expert_with_alpha_pattern_refused(tmp_path: Path, tiny_llama: Path) -> None:
    from adaptermesh.worker.adafuse import read_expert_set
    from adaptermesh.worker.testing import make_adafuse_expert_set

    es = make_adafuse_expert_set(tmp_path, tiny_llama, "es", num_experts=2, top_k=1, rank=4)
    cj_path = es / "experts" / "1" / "adapter_config.json"
    cj = json.loads(cj_path.read_text())
    cj["alpha_pattern"] = {"v_proj": 1.0}
    cj_path.write_text(json.dumps(cj))
    with pytest.raises(AdapterValidationError, match="alpha_pattern"):
        read_expert_set("es", es, tmp_path, ModelConfig.from_dir(tiny_llama), 16, torch.float32)


def test_adapter_bias_tensor_refused_by_name(tmp_path: Path, tiny_llama: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _adapter_with(tmp_path, tiny_llama, {})
    sd = load_file(str(path / "adapter_model.safetensors"))
    sd["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.zeros(64)
    save_file(sd, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterValidationError, match=r"lora_B\.bias"):
        read_adapter("ad", path, ModelConfig.from_dir(tiny_llama), 16, torch.float32, pin_memory=False)


def test_unconsumed_checkpoint_tensor_is_named(tiny_llama: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_llama)
    w = read_weights(tiny_llama)
    w["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # on the ignore list
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        TransformerModel(cfg, w, torch.device("cpu"), torch.float32, 64)
    w = read_weights(tiny_llama)
    del w["lm_head.weight"]  # untied and missing: transformers would draw it at random
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        TransformerModel(cfg, w, torch.device("cpu"), torch.float32, 64)


# --- implemented features against transformers + peft -------------------------------------

FEATURES = [
    ("llama", {"attention_bias": True}),
    ("llama", {"mlp_bias": True}),
    ("llama", {"hidden_act": "gelu"}),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ("llama", {"hidden_act": "relu"}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "num_hidden_layers": 3}),
    ("mistral", {"sliding_window": 5}),
    ("qwen3", {"head_dim": 16, "attention_bias": True}),
    ("qwen3", {"head_dim": 8, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "num_hidden_layers": 3}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False, "beta_fast": 16}}),
]


@pytest.mark.parametrize(("arch", "extra"), FEATURES, ids=["attention_bias", "mlp_bias", "gelu", "gelu_tanh", "relu", "qwen2-window-layers", "mistral-window", "qwen3-bias", "qwen3-window-layers", "yarn-mscale-truncate"])
async def test_feature_matches_transformers(
    tmp_path: Path, make_engine: Any, logit_log: dict[str, list[torch.Tensor]], arch: str, extra: dict[str, Any]
) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=3, **extra)
    root = tmp_path / "adapters"
    # o_proj and down_proj LoRA on top of their biases; q/k/v on top of the q/k/v biases.
    peft_adapter(root, model_dir, "ad", seed=5, r=4, lora_alpha=8, target_modules=list(MODULES))
    ref = Ref(model_dir, root, ["ad"])
    eng = make_engine(model_dir=model_dir, root=root, max_prefill_chunk=5, max_num_batched_tokens=16)
    await assert_matches(eng, ref, [None, "ad"], logit_log, [PROMPT, PROMPT[:6]])


async def test_window_really_applies(tmp_path: Path, make_engine: Any) -> None:
    # Guards the window tests against a window that never bites: the same weights without it
    # give other logits.
    extra = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}
    windowed = build_model(tmp_path / "w", "qwen2", seed=3, **extra)
    full = build_model(tmp_path / "f", "qwen2", seed=3)
    assert Ref(windowed, tmp_path, []).logits(list(PROMPT), None)[-1].sub(
        Ref(full, tmp_path, []).logits(list(PROMPT), None)[-1]).abs().max() > 1e-3


async def test_adapter_options_match_peft(tmp_path: Path, make_engine: Any, logit_log: dict[str, list[torch.Tensor]]) -> None:
    model_dir = build_model(tmp_path / "m", "llama", seed=4, num_hidden_layers=3)
    root = tmp_path / "adapters"
    peft_adapter(root, model_dir, "pat", seed=1, r=4, lora_alpha=8, target_modules=list(MODULES),
                 rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2}, alpha_pattern={"o_proj": 3.0})
    peft_adapter(root, model_dir, "excl", seed=2, r=6, lora_alpha=6, target_modules="all-linear",
                 exclude_modules=["k_proj", "gate_proj"])
    peft_adapter(root, model_dir, "lay", seed=3, r=3, lora_alpha=5, target_modules=["q_proj", "up_proj"],
                 layers_to_transform=[0, 2], layers_pattern="layers", use_rslora=True)
    # adapter_model.bin instead of safetensors, as older PEFT versions saved it
    from safetensors.torch import load_file

    b = peft_adapter(root, model_dir, "bin", seed=4, r=5, lora_alpha=10, target_modules=["v_proj", "down_proj"])
    torch.save(load_file(str(b / "adapter_model.safetensors")), str(b / "adapter_model.bin"))
    (b / "adapter_model.safetensors").unlink()
    names = ["pat", "excl", "lay", "bin"]
    ref = Ref(model_dir, root, names)
    eng = make_engine(model_dir=model_dir, root=root, max_lora_rank=16, max_loras=4)
    await assert_matches(eng, ref, [None, *names], logit_log, [PROMPT])


# --- property: random configs and adapters -------------------------------------------------

_EXAMPLES = int(os.environ.get("ADAPTERMESH_FIDELITY_EXAMPLES", "6"))


@st.composite
def model_and_adapters(draw: st.DrawFn) -> dict[str, Any]:
    arch = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 3))
    cfg: dict[str, Any] = {
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
        "hidden_act": draw(st.sampled_from(["silu", "gelu", "gelu_pytorch_tanh", "relu"])),
        "intermediate_size": draw(st.sampled_from([24, 48])),
    }
    if arch == "qwen2":
        cfg["hidden_size"] = heads * head_dim
    else:
        cfg["hidden_size"] = draw(st.sampled_from([32, 48]))
        cfg["head_dim"] = head_dim
    rope = draw(st.sampled_from(["none", "linear", "yarn", "llama3"]))
    if rope == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif rope == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}
    elif rope == "yarn":
        y: dict[str, Any] = {"rope_type": "yarn", "factor": draw(st.sampled_from([2.0, 4.0])), "original_max_position_embeddings": 16}
        if draw(st.booleans()):
            y.update(mscale=draw(st.sampled_from([0.707, 1.0])), mscale_all_dim=draw(st.sampled_from([0.5, 1.0])))
        if draw(st.booleans()):
            y["truncate"] = False
        cfg["rope_scaling"] = y
    if arch == "llama":
        cfg["attention_bias"] = draw(st.booleans())
        cfg["mlp_bias"] = draw(st.booleans())
    if arch == "qwen3":
        cfg["attention_bias"] = draw(st.booleans())
    elif arch == "mistral":
        cfg["sliding_window"] = draw(st.sampled_from([None, 3, 6]))
    if arch in ("qwen2", "qwen3") and draw(st.booleans()):
        cfg.update(use_sliding_window=True, sliding_window=draw(st.sampled_from([3, 6])),
                   max_window_layers=draw(st.integers(0, layers)))
    adapters = []
    for _ in range(draw(st.integers(1, 2))):
        targets = draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=7, unique=True))
        ad: dict[str, Any] = {"r": draw(st.integers(1, 32)), "lora_alpha": float(draw(st.integers(1, 64))),
                              "target_modules": sorted(targets)}
        if draw(st.booleans()):
            ad["rank_pattern"] = {draw(st.sampled_from(targets)): draw(st.integers(1, 32))}
        if draw(st.booleans()):
            ad["alpha_pattern"] = {draw(st.sampled_from(targets)): float(draw(st.integers(1, 64)))}
        if "rank_pattern" not in ad and "alpha_pattern" not in ad:
            ad["use_rslora"] = draw(st.booleans())
        adapters.append(ad)
    return {"arch": arch, "cfg": cfg, "adapters": adapters, "seed": draw(st.integers(0, 1000))}


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=model_and_adapters())
def test_random_models_and_adapters_match(tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]) -> None:
    asyncio.run(_random_case(tmp_path_factory.mktemp("prop"), case))


async def _random_case(tmp: Path, case: dict[str, Any]) -> None:
    from adaptermesh.worker.engine import Engine, EngineConfig

    model_dir = build_model(tmp / "m", case["arch"], seed=case["seed"], **case["cfg"])
    root = tmp / "adapters"
    names = []
    for i, ad in enumerate(case["adapters"]):
        peft_adapter(root, model_dir, f"a{i}", seed=case["seed"] + i, **ad)
        names.append(f"a{i}")
    ref = Ref(model_dir, root, names)
    eng = Engine(model_dir, root, config=EngineConfig(max_num_seqs=8, max_loras=2, max_lora_rank=32,
                                                      max_prefill_chunk=5, max_num_batched_tokens=16), model_name="p")
    try:
        with recording_logits() as log:
            await assert_matches(eng, ref, [None, *names], log, [PROMPT, PROMPT[3:7]], n=3, tag=f"{case['arch']}-")
    finally:
        await eng.shutdown()
