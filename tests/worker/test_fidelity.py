"""Model and adapter fidelity: every config field is honoured or refused by name, every
checkpoint tensor is consumed, and each implemented feature gives transformers + peft's tokens.

The engine runs on ADAPTERMESH_TEST_DEVICE (default cpu; cuda runs the Triton kernels), see
``fidelity_helpers``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.worker import model as model_mod
from adaptermesh.worker.adapters import AdapterValidationError, read_adapter
from adaptermesh.worker.model import ModelConfig, TransformerModel, read_weights, rope_inv_freq
from adaptermesh.worker.model_fields import (
    ADAPTER_FIELDS,
    ARCH_FIELDS,
    HARMLESS_MODEL_FIELDS,
    UNREAD_FIELDS,
    check_adapter_config,
)
from adaptermesh_testkit.checkpoints import make_adapter, make_model_config, make_tiny_model

from .fidelity_configs import ACCEPTED, REFUSED
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

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- refused config.json fields ------------------------------------------------------------

REFUSED_CONFIG = [
    ("llama", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("llama", {"hidden_act": "tanh"}, "hidden_act"),
    ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling"),
    (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_medium": 3}},
        "rope_scaling",
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
        "rope_parameters",
    ),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 8}}, "quantization_config"),
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


@pytest.mark.parametrize(
    ("arch", "patch", "field"),
    REFUSED_CONFIG,
    ids=[f"{a}-{f}-{i}" for i, (a, _, f) in enumerate(REFUSED_CONFIG)],
)
def test_config_field_refused_by_name(arch: str, patch: dict[str, Any], field: str) -> None:
    d = make_model_config("llama" if arch not in ("llama", "mistral", "qwen2") else arch)  # type: ignore[arg-type]
    d["model_type"] = arch
    d.update(patch)
    with pytest.raises(ValueError, match=rf"config\.{field}:") as exc:
        ModelConfig.from_dict(d)
    assert field in str(exc.value)


class _ReadRecorder(dict):  # type: ignore[type-arg]
    """A config dict that records which keys the parser looks up."""

    def __init__(self, d: dict[str, Any]) -> None:
        super().__init__(d)
        self.read: set[str] = set()

    def __getitem__(self, k: str) -> Any:
        self.read.add(k)
        return super().__getitem__(k)

    def get(self, k: str, default: Any = None) -> Any:
        self.read.add(k)
        return super().get(k, default)

    def __contains__(self, k: object) -> bool:
        self.read.add(str(k))
        return super().__contains__(k)


def _unaccounted(d: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fields of an accepted config that the parser never reads and no list calls harmless.
    The field checks are bypassed so that only the parser's own reads are recorded."""
    with monkeypatch.context() as m:
        m.setattr(model_mod, "check_model_config", lambda _d: None)
        rec = _ReadRecorder(d)
        ModelConfig.from_dict(rec)
    unread = UNREAD_FIELDS[str(d["model_type"])]
    return sorted(
        k for k in d if k not in rec.read and k not in HARMLESS_MODEL_FIELDS and k not in unread
    )


@pytest.mark.parametrize(
    "name", list(ACCEPTED), ids=[re.sub(r"[^A-Za-z0-9.-]+", "_", k) for k in ACCEPTED]
)
def test_published_configs_load_with_every_field_accounted(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = ACCEPTED[name]
    cfg = ModelConfig.from_dict(d)
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (
        d["num_hidden_layers"],
        d["vocab_size"],
        d["hidden_size"],
    )
    assert cfg.num_kv_heads == d.get("num_key_value_heads", d["num_attention_heads"])
    assert _unaccounted(d, monkeypatch) == []


def test_published_configs_derived_settings() -> None:
    c = ModelConfig.from_dict(ACCEPTED["Llama-3.2-1B"])
    assert c.tie_word_embeddings
    assert c.head_dim == 64
    assert c.rope_scaling is not None
    assert c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["factor"] == 32.0
    assert ModelConfig.from_dict(ACCEPTED["Llama-3.1-8B-Instruct"]).eos_token_ids == (
        128001,
        128008,
        128009,
    )
    assert ModelConfig.from_dict(ACCEPTED["Mistral-7B-v0.1"]).layer_windows == (4096,) * 32
    assert (
        ModelConfig.from_dict(ACCEPTED["Mistral-7B-v0.3"]).layer_windows == ()
    )  # sliding_window null
    assert (
        ModelConfig.from_dict(ACCEPTED["Qwen2.5-7B"]).layer_windows == ()
    )  # use_sliding_window false
    q3 = ModelConfig.from_dict(ACCEPTED["Qwen3-8B"])
    assert q3.qk_norm
    assert q3.head_dim == 128
    assert not q3.tie_word_embeddings
    assert ModelConfig.from_dict(ACCEPTED["Qwen3-0.6B"]).tie_word_embeddings
    g = ModelConfig.from_dict(ACCEPTED["gemma-2-9b"])
    assert g.layer_windows == tuple(4096 if i % 2 == 0 else None for i in range(42))
    assert (g.attn_softcap, g.final_softcap, g.attn_scale) == (50.0, 30.0, 256**-0.5)
    p = ModelConfig.from_dict(ACCEPTED["Phi-4-mini-instruct"])
    assert p.rot_dim == 96
    assert p.head_dim == 128
    assert p.fused_checkpoint


@pytest.mark.parametrize(
    "name", list(REFUSED), ids=[re.sub(r"[^A-Za-z0-9.-]+", "_", k) for k in REFUSED]
)
def test_published_configs_refused_by_name(name: str) -> None:
    d, field = REFUSED[name]
    with pytest.raises(ValueError, match=rf"config\.{field}:"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("arch", list(ARCH_FIELDS))
def test_transformers_written_configs_load_with_every_field_accounted(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What save_pretrained writes (every default spelled out), for each supported family.
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = transformers.AutoConfig.for_model(
            arch,
            vocab_size=384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        ).to_dict()
    ModelConfig.from_dict(d)
    assert _unaccounted(d, monkeypatch) == []


def test_unread_field_lists_name_table_fields() -> None:
    # A name in UNREAD_FIELDS that its table lacks would hide a typo.
    assert set(UNREAD_FIELDS) == set(ARCH_FIELDS)
    for arch, names in UNREAD_FIELDS.items():
        assert names <= set(ARCH_FIELDS[arch]), (arch, names - set(ARCH_FIELDS[arch]))


def test_qwen2_window_layers_follow_transformers() -> None:
    import transformers

    d = make_model_config("qwen2", num_hidden_layers=4)
    d.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert ModelConfig.from_dict(d).layer_windows == (None, 8, 8, 8)
    c = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    assert c.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    d["use_sliding_window"] = False
    assert ModelConfig.from_dict(d).layer_windows == ()
    d2 = make_model_config("mistral")
    del d2["sliding_window"]  # absent: MistralConfig's default 4096
    assert ModelConfig.from_dict(d2).layer_windows == (4096, 4096)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
            "beta_fast": 16,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.3,
        },
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
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
        tc = transformers.LlamaConfig(
            **{
                k: v
                for k, v in d.items()
                if k not in ("model_type", "architectures", "torch_dtype")
            }
        )
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](tc, "cpu")
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=1e-7)
    assert mscale == pytest.approx(want_scale, rel=1e-12)


# --- refused adapter_config.json fields ----------------------------------------------------

REFUSED_ADAPTER = [
    ({"use_dora": "yes"}, "use_dora"),
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
    # embed_tokens / lm_head are served on a --lora-vocab pool (test_vocab_lora.py refuses
    # them on other workers); these are still refused whatever the pool.
    ({"target_modules": ["q_proj", "wte_proj"]}, "target_modules"),
    ({"target_modules": []}, "target_modules"),
    ({"target_modules": r".*(q_proj"}, "target_modules"),
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


@pytest.mark.parametrize(
    ("patch", "field"),
    REFUSED_ADAPTER,
    ids=[f"{f}-{i}" for i, (_, f) in enumerate(REFUSED_ADAPTER)],
)
def test_adapter_field_refused_by_name(
    tmp_path: Path, tiny_llama: Path, patch: dict[str, Any], field: str
) -> None:
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
        {"init_lora_weights": "orthogonal"},
        {"init_lora_weights": False},
        {"init_lora_weights": "eva", "eva_config": {"rho": 2.0}},
        {"eva_config": None, "corda_config": None, "lora_bias": False, "use_dora": False},
        {"layers_pattern": "layers", "layers_to_transform": [1]},
    ],
)
def test_harmless_adapter_fields_load(
    tmp_path: Path, tiny_llama: Path, patch: dict[str, Any]
) -> None:
    path = _adapter_with(tmp_path, tiny_llama, patch)
    cfg = ModelConfig.from_dir(tiny_llama)
    if "layers_to_transform" in patch:
        with pytest.raises(AdapterValidationError, match="unexpected tensor"):
            read_adapter(
                "ad", path, cfg, 16, torch.float32, pin_memory=False
            )  # layer 0's tensors are extra
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
    from adaptermesh_testkit.checkpoints import make_adafuse_expert_set

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
        read_adapter(
            "ad", path, ModelConfig.from_dir(tiny_llama), 16, torch.float32, pin_memory=False
        )


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

_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
FEATURES = [
    ("llama", {"attention_bias": True}),
    ("llama", {"mlp_bias": True}),
    ("llama", {"hidden_act": "gelu"}),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ("llama", {"hidden_act": "relu"}),
    (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    ("mistral", {"sliding_window": 5}),
    ("qwen3", {"head_dim": 16, "attention_bias": True}),
    (
        "qwen3",
        {
            "head_dim": 8,
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    (
        "qwen3",
        {"head_dim": 16, "tie_word_embeddings": True},
    ),  # Qwen3-0.6B's shape: tied, head_dim != hidden / heads
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "truncate": False,
                "beta_fast": 16,
            }
        },
    ),
    # Llama 3.2 1B/3B shape: tied embeddings, explicit head_dim, llama3 RoPE past its original length.
    (
        "llama",
        {
            "tie_word_embeddings": True,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3,
        },
    ),
]
FEATURE_IDS = [
    "attention_bias",
    "mlp_bias",
    "gelu",
    "gelu_tanh",
    "relu",
    "qwen2-window-layers",
    "mistral-window",
    "qwen3-bias",
    "qwen3-window-layers",
    "qwen3-tied",
    "yarn-mscale-truncate",
    "llama3.2-small",
]


@pytest.mark.parametrize(("arch", "extra"), FEATURES, ids=FEATURE_IDS)
def test_feature_matches_transformers(tmp_path: Path, arch: str, extra: dict[str, Any]) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=3, **extra)
    root = tmp_path / "adapters"
    # o_proj and down_proj LoRA on top of their biases; q/k/v on top of the q/k/v biases.
    peft_adapter(root, model_dir, "ad", seed=5, r=4, lora_alpha=8, target_modules=list(MODULES))
    match_case(
        model_dir,
        root,
        ["ad"],
        [PROMPT, PROMPT[:6]],
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


def test_window_really_applies(tmp_path: Path) -> None:
    # Guards the window tests against a window that never bites: the same weights without it
    # give other logits.
    extra = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}
    windowed = build_model(tmp_path / "w", "qwen2", seed=3, **extra)
    full = build_model(tmp_path / "f", "qwen2", seed=3)
    assert (
        Ref(windowed, tmp_path, [])
        .logits(list(PROMPT), None)[-1]
        .sub(Ref(full, tmp_path, []).logits(list(PROMPT), None)[-1])
        .abs()
        .max()
        > 1e-3
    )


def test_adapter_options_match_peft(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "m", "llama", seed=4, num_hidden_layers=3)
    root = tmp_path / "adapters"
    # rank_pattern and alpha_pattern with plain and regular-expression keys (PEFT matches a
    # key against a dotted suffix of the module name, first key first).
    peft_adapter(
        root,
        model_dir,
        "pat",
        seed=1,
        r=4,
        lora_alpha=8,
        target_modules=list(MODULES),
        rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2},
        alpha_pattern={"o_proj": 3.0, r"layers\.[02]\.self_attn\.(k|v)_proj": 20.0},
    )
    peft_adapter(
        root,
        model_dir,
        "excl",
        seed=2,
        r=6,
        lora_alpha=6,
        target_modules="all-linear",
        exclude_modules=["k_proj", "gate_proj"],
    )
    peft_adapter(
        root,
        model_dir,
        "lay",
        seed=3,
        r=3,
        lora_alpha=5,
        target_modules=["q_proj", "up_proj"],
        layers_to_transform=[0, 2],
        layers_pattern="layers",
        use_rslora=True,
    )
    # target_modules and exclude_modules as regular expressions over the full module name.
    peft_adapter(
        root,
        model_dir,
        "rx",
        seed=5,
        r=7,
        lora_alpha=14,
        target_modules=r".*layers\.[12]\..*_proj",
        exclude_modules=r".*\.1\.mlp\.(up|gate)_proj",
        use_rslora=True,
    )
    # adapter_model.bin instead of safetensors, as older PEFT versions saved it
    from safetensors.torch import load_file

    b = peft_adapter(
        root, model_dir, "bin", seed=4, r=5, lora_alpha=10, target_modules=["v_proj", "down_proj"]
    )
    torch.save(load_file(str(b / "adapter_model.safetensors")), str(b / "adapter_model.bin"))
    (b / "adapter_model.safetensors").unlink()
    match_case(
        model_dir,
        root,
        ["pat", "excl", "lay", "rx", "bin"],
        [PROMPT],
        max_lora_rank=16,
        max_loras=5,
    )


def test_adapter_bin_loaded_weights_only(tmp_path: Path, tiny_llama: Path) -> None:
    # adapter_model.bin is read with torch.load(weights_only=True): a pickle that would run
    # code is refused by name, and nothing runs.
    import pickle

    path = _adapter_with(tmp_path, tiny_llama, {})
    (path / "adapter_model.safetensors").unlink()
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    with open(path / "adapter_model.bin", "wb") as f:
        pickle.dump({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": Evil()}, f)
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter(
            "ad", path, ModelConfig.from_dir(tiny_llama), 16, torch.float32, pin_memory=False
        )
    assert exc.value.field == "adapter_model.bin"
    assert not marker.exists()


def test_every_peft_lora_field_is_honoured_or_refused() -> None:
    # The installed peft's LoraConfig: every field has an entry (honoured, harmless or refused
    # when set), and an adapter saved with every default loads.
    import peft

    names = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert names - set(ADAPTER_FIELDS) == set()
    cj = peft.LoraConfig(target_modules=["q_proj"]).to_dict()
    cj = {k: sorted(v) if isinstance(v, set) else v for k, v in cj.items()}
    assert check_adapter_config(json.loads(json.dumps(cj, default=str))) is None


# --- property: random configs and adapters -------------------------------------------------


@st.composite
def model_and_adapters(draw: st.DrawFn) -> dict[str, Any]:
    arch = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))  # GQA ratio 1, 2 or 4
    head_dim = draw(st.sampled_from([8, 16, 32]))
    layers = draw(st.integers(1, 3))
    cfg: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "hidden_act": draw(st.sampled_from(["silu", "gelu", "gelu_pytorch_tanh", "relu"])),
        "intermediate_size": draw(st.sampled_from([24, 48])),
        "tie_word_embeddings": draw(st.booleans()),
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
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": draw(st.sampled_from([8.0, 32.0])),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    elif rope == "yarn":
        y: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": draw(st.sampled_from([2.0, 4.0])),
            "original_max_position_embeddings": 16,
        }
        if draw(st.booleans()):
            y.update(
                mscale=draw(st.sampled_from([0.707, 1.0])),
                mscale_all_dim=draw(st.sampled_from([0.5, 1.0])),
            )
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
        cfg.update(
            use_sliding_window=True,
            sliding_window=draw(st.sampled_from([3, 6])),
            max_window_layers=draw(st.integers(0, layers)),
        )
    adapters = [draw(adapter_case(MODULES, layers)) for _ in range(draw(st.integers(1, 3)))]
    return {"arch": arch, "cfg": cfg, "adapters": adapters, "seed": draw(st.integers(0, 1000))}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=model_and_adapters())
def test_random_models_and_adapters_match(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    run_random_case(tmp_path_factory.mktemp("prop"), case, [PROMPT, PROMPT[3:7]])
