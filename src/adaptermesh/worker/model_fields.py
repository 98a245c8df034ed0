"""What the runtime reads from ``config.json`` and ``adapter_config.json``, and what it refuses.

Each rule has one home here. A checkpoint or adapter loads only if every field in its config is
either read with a supported value or listed as harmless (it does not change a single logit:
training knobs, generation defaults, bookkeeping). Anything else refuses the load with the
field's name and value, because serving it would give silently wrong tokens.

``check_model_config(d)`` and ``check_adapter_config(cj)`` return the first violation as
``(field, message)`` or None; the callers raise their own error types with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from adaptermesh.worker.quant import check_quant_config

__all__ = [
    "ACTIVATIONS",
    "ADAPTER_FIELDS",
    "ARCH_FIELDS",
    "HARMLESS_MODEL_FIELDS",
    "IGNORED_TENSOR_SUFFIXES",
    "ROPE_KEYS",
    "UNREAD_FIELDS",
    "check_adapter_config",
    "check_model_config",
    "gemma_act",
    "rotary_dim",
]

Check = Callable[[Any, Mapping[str, Any]], str | None]

# hidden_act -> the activation name ``kernels.act_mul`` takes (transformers' ACT2FN names).
ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
}

# RoPE type -> the keys of rope_scaling / rope_parameters it reads (besides rope_type/type and
# rope_theta). Must stay in sync with ``model.rope_inv_freq``.
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
    # Phi-3 LongRoPE ("su" in the first Phi-3 configs): per-frequency short/long factors.
    "longrope": frozenset(
        {
            "short_factor",
            "long_factor",
            "factor",
            "attention_factor",
            "original_max_position_embeddings",
        }
    ),
}
# RoPE types each architecture's transformers config accepts (phi3 validates to these two).
_ROPE_TYPES_PHI3 = frozenset({"default", "longrope", "su"})
_ROPE_TYPES_COMMON = frozenset(ROPE_KEYS) - {"longrope"}

# Checkpoint tensors no module consumes on purpose: buffers some exporters save.
IGNORED_TENSOR_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)

# config.json keys that cannot change a logit of a causal-LM forward pass at inference.
HARMLESS_MODEL_FIELDS: frozenset[str] = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "pad_token_id",
        "attention_dropout",
        "pretraining_tp",
        "model_type",
        # PretrainedConfig bookkeeping and generation defaults that old configs carry.
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "finetuning_task",
        "torchscript",
        "use_bfloat16",
        "pruned_heads",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "cross_attention_hidden_size",
        "tf_legacy_loss",
        "output_router_logits",
    }
)


def _pos_int(v: Any, d: Mapping[str, Any]) -> str | None:
    return (
        None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0
        else "must be a positive integer"
    )


def _opt_pos_int(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v is None else _pos_int(v, d)


def _non_negative_int(v: Any, d: Mapping[str, Any]) -> str | None:
    return (
        None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0
        else "must be a non-negative integer"
    )


def _number(v: Any, d: Mapping[str, Any]) -> str | None:
    return (
        None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        else "must be a positive number"
    )


def _bool(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _false(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v in (False, None) else "is not implemented (only false)"


def _token_id(v: Any, d: Mapping[str, Any]) -> str | None:
    ok = v is None or (isinstance(v, int) and not isinstance(v, bool))
    ok = ok or (
        isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    )
    return None if ok else "must be a token id, a list of token ids or null"


def _hidden_act(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v in ACTIVATIONS else f"is not implemented (supported: {', '.join(ACTIVATIONS)})"


def _kv_heads(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None:
        return None
    if _pos_int(v, d) or int(d.get("num_attention_heads", 0)) % v:
        return "must be a positive integer dividing num_attention_heads"
    return None


def rotary_dim(d: Mapping[str, Any], head_dim: int | None = None) -> int:
    """The rotated dimensions of a head: head_dim x partial_rotary_factor (top level, or inside
    rope_parameters / rope_scaling), as transformers computes ``dim``; head_dim when absent.
    ``head_dim``: the resolved one (an architecture's default), else config / hidden / heads."""
    if head_dim is None:
        heads = int(d.get("num_attention_heads") or 1)
        head_dim = int(d.get("head_dim") or int(d.get("hidden_size") or 0) // heads)
    factor = d.get("partial_rotary_factor")
    for key in ("rope_parameters", "rope_scaling"):
        inner = d.get(key)
        if isinstance(inner, dict) and inner.get("partial_rotary_factor") is not None:
            factor = inner["partial_rotary_factor"]
    return int(head_dim * float(factor if factor is not None else 1.0))


def _partial_factor(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        return "must be a number in (0, 1]"
    rot = rotary_dim(d)
    if rot < 2 or rot % 2:
        return f"gives {rot} rotated dimensions per head, which must be even and >= 2"
    return None


def _factor_list(v: Any, n: int) -> str | None:
    if not isinstance(v, list) or len(v) != n:
        return f"must be a list of {n} numbers (rotary_dim / 2)"
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v):
        return "must hold positive numbers"
    return None


def _rope_check(kinds: frozenset[str], partial: bool) -> Check:
    """rope_scaling / rope_parameters: a type in ``kinds`` with only the keys it reads;
    ``partial``: partial_rotary_factor (any valid value) is honoured, else only 1.0."""

    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        if v is None:
            return None
        if not isinstance(v, dict):
            return "must be an object or null"
        kind = v.get("rope_type", v.get("type", "default"))
        if kind not in kinds:
            return f"rope_type {kind!r} is not implemented for {d.get('model_type')} (supported: {', '.join(sorted(kinds))})"
        kind = "longrope" if kind == "su" else kind
        for key, val in v.items():
            if key in ("rope_type", "type", "rope_theta"):
                continue
            if key == "partial_rotary_factor":
                if partial:
                    msg = _partial_factor(val, d)
                    if msg:
                        return f"partial_rotary_factor={val!r} {msg}"
                    continue
                if val in (1, 1.0, None):
                    continue
            if key not in ROPE_KEYS[kind]:
                return f"{key}={val!r} is not implemented for rope_type {kind!r}"
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                msg = _factor_list(v.get(key), rotary_dim(d) // 2)
                if msg:
                    return f"{key} {msg}"
        elif kind != "default" and "factor" not in v and kind != "yarn":
            return f"rope_type {kind!r} needs a factor"
        return None

    return check


_rope = _rope_check(_ROPE_TYPES_COMMON, partial=False)


def _null_window(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v is None else "is not implemented for this architecture (only null)"


def _layer_types_full(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None or (isinstance(v, list) and all(x == "full_attention" for x in v)):
        return None
    return "is not implemented for this architecture (only full_attention layers)"


def _layer_types_qwen2(v: Any, d: Mapping[str, Any]) -> str | None:
    if v is None:
        return None
    n = d.get("num_hidden_layers")
    if (
        not isinstance(v, list)
        or len(v) != n
        or any(x not in ("full_attention", "sliding_attention") for x in v)
    ):
        return f"must list full_attention or sliding_attention for each of the {n} layers"
    return None


def _opt_number(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v is None else _number(v, d)


def _any(v: Any, d: Mapping[str, Any]) -> str | None:
    return None


def _equals(*allowed: Any) -> Check:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        return (
            None
            if v in allowed
            else f"is not implemented (only {' or '.join(repr(a) for a in allowed)})"
        )

    return check


def _phi3_auto_map(v: Any, d: Mapping[str, Any]) -> str | None:
    # Phi-3 checkpoints published before transformers had the architecture name their own
    # copies of it; transformers loads its built-in Phi3 for them unless told to trust the
    # remote code. Served only when every entry names a Phi-3 class.
    if (
        isinstance(v, dict)
        and v
        and all(isinstance(x, str) and x.rsplit(".", 1)[-1].startswith("Phi3") for x in v.values())
    ):
        return None
    return "custom modeling code is not implemented (only the Phi3Config / Phi3ForCausalLM entries of Phi-3 checkpoints)"


def _gemma_hidden_activation(v: Any, d: Mapping[str, Any]) -> str | None:
    # transformers 5's GemmaMLP reads hidden_act (legacy "gelu" meaning the tanh form); a
    # hidden_activation naming another function would be served differently by older code.
    want = gemma_act(d)
    return (
        None
        if v is None or v == want
        else f"differs from hidden_act ({want!r}), which is what runs"
    )


def gemma_act(d: Mapping[str, Any]) -> str:
    """Gemma 1's activation as GemmaConfig resolves it: hidden_act, "gelu" read as the tanh form."""
    act = str(d.get("hidden_act", "gelu_pytorch_tanh"))
    return "gelu_pytorch_tanh" if act == "gelu" else act


def _same_as(other: str) -> Check:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        if v is None or v == d.get(other):
            return None
        return f"differs from {other} ({d.get(other)!r}), which is the one transformers applies"

    return check


def _never(reason: str) -> Check:
    def check(v: Any, d: Mapping[str, Any]) -> str | None:
        return reason

    return check


_COMMON: dict[str, Check] = {
    "vocab_size": _pos_int,
    "hidden_size": _pos_int,
    "intermediate_size": _pos_int,
    "num_hidden_layers": _pos_int,
    "num_attention_heads": _pos_int,
    "num_key_value_heads": _kv_heads,
    "head_dim": _opt_pos_int,
    "hidden_act": _hidden_act,
    "max_position_embeddings": _pos_int,
    "rms_norm_eps": _number,
    "rope_theta": _number,
    "rope_scaling": _rope,
    "rope_parameters": _rope,
    "tie_word_embeddings": _bool,
    "bos_token_id": _token_id,
    "eos_token_id": _token_id,
    "quantization_config": lambda v, d: check_quant_config(v),  # worker/quant.py's tables
    "auto_map": _never("custom modeling code is not implemented"),
}

# The sliding-window fields Qwen2 and Qwen3 share.
_QWEN_WINDOWS: dict[str, Check] = {
    "use_sliding_window": _bool,
    "sliding_window": _opt_pos_int,
    "max_window_layers": _non_negative_int,
    "layer_types": _layer_types_qwen2,
}

# model_type -> every config.json field the runtime reads, with its check. A field absent
# here and from HARMLESS_MODEL_FIELDS refuses the load.
ARCH_FIELDS: dict[str, dict[str, Check]] = {
    "llama": {
        **_COMMON,
        "attention_bias": _bool,  # q/k/v/o biases
        "mlp_bias": _bool,  # gate/up/down biases
        "sliding_window": _null_window,
        "layer_types": _layer_types_full,
    },
    "mistral": {
        **_COMMON,
        "sliding_window": _opt_pos_int,  # every layer; absent means 4096 (MistralConfig's default)
        "layer_types": _layer_types_full,
    },
    "qwen2": {**_COMMON, **_QWEN_WINDOWS, "use_mrope": _false},
    "qwen3": {**_COMMON, "attention_bias": _bool, **_QWEN_WINDOWS},  # q/k/v/o biases
}

_NO_HIDDEN_ACT = {k: v for k, v in _COMMON.items() if k != "hidden_act"}

ARCH_FIELDS["phi3"] = {
    **_COMMON,
    "rope_scaling": _rope_check(_ROPE_TYPES_PHI3, partial=True),
    "rope_parameters": _rope_check(_ROPE_TYPES_PHI3, partial=True),
    "partial_rotary_factor": _partial_factor,
    "original_max_position_embeddings": _pos_int,
    "sliding_window": _opt_pos_int,  # every layer
    "resid_pdrop": _any,  # dropout: training only
    "embd_pdrop": _any,
    "auto_map": _phi3_auto_map,
    # Carried by Phi-4-mini's published config; transformers' Phi3 reads none of them, and
    # only these values are what the checkpoint was exported with.
    "attention_bias": _false,
    "mlp_bias": _false,
    "lm_head_bias": _false,
    "full_attn_mod": _equals(1),
    "interpolate_factor": _equals(1, 1.0),
}
ARCH_FIELDS["gemma"] = {
    **_COMMON,
    "hidden_act": lambda v, d: _hidden_act(gemma_act(d), d),
    "hidden_activation": _gemma_hidden_activation,
    "attention_bias": _bool,  # q/k/v/o biases
    "use_bidirectional_attention": _false,
}
ARCH_FIELDS["gemma2"] = {
    **_NO_HIDDEN_ACT,
    "hidden_activation": _hidden_act,
    "hidden_act": _any,  # published configs carry it; Gemma2MLP reads hidden_activation only
    "attention_bias": _bool,
    "query_pre_attn_scalar": _number,
    "sliding_window": _opt_pos_int,
    "layer_types": _layer_types_qwen2,
    "attn_logit_softcapping": _opt_number,
    "final_logit_softcapping": _opt_number,
    "use_bidirectional_attention": _false,
    "cache_implementation": _any,  # generation's cache class
    # gemma-2-9b / -27b carry it beside sliding_window; Gemma2Config never reads it.
    "sliding_window_size": _same_as("sliding_window"),
}


def _rope_by_layer_type(v: Any, d: Mapping[str, Any]) -> str | None:
    # Gemma3TextConfig nests RoPE by layer type; a flat object would not load in transformers.
    if v is None:
        return None
    if not isinstance(v, dict) or not set(v) <= {"full_attention", "sliding_attention"}:
        return "must map full_attention / sliding_attention to RoPE settings"
    for kind, inner in v.items():
        msg = _rope(inner, d)
        if msg is not None:
            return f"{kind}: {msg}"
    return None


def _null_gemma3_cap(v: Any, d: Mapping[str, Any]) -> str | None:
    return None if v is None else "is not applied by transformers' Gemma 3 (only null)"


ARCH_FIELDS["gemma3_text"] = {
    **ARCH_FIELDS["gemma2"],
    "rope_parameters": _rope_by_layer_type,
    "rope_local_base_freq": _number,  # sliding layers' rope_theta (default 10000; full: 1e6)
    "sliding_window_pattern": _pos_int,  # every n-th layer is full when layer_types is absent
    "_sliding_window_pattern": _any,  # saved by transformers; never read back
    # Gemma3Attention stores it but never passes it to the attention function: a value would
    # be served capped here and uncapped by transformers, so only null loads.
    "attn_logit_softcapping": _null_gemma3_cap,
}

# Per architecture, the fields of ARCH_FIELDS that ``ModelConfig.from_dict`` never reads: each
# check admits only the value the runtime implements anyway (a bias that must be false, full
# attention only), or the field is one transformers' own model ignores too (dropout, the
# generation cache class, a duplicate of another field). Every other field of a table is read.
# tests/worker/test_fidelity.py holds real and transformers-written configs to this.
_UNREAD_COMMON = frozenset({"auto_map"})
UNREAD_FIELDS: dict[str, frozenset[str]] = {
    "llama": _UNREAD_COMMON | {"sliding_window", "layer_types"},
    "mistral": _UNREAD_COMMON | {"layer_types"},
    "qwen2": _UNREAD_COMMON | {"use_mrope"},
    "qwen3": _UNREAD_COMMON,
    "phi3": _UNREAD_COMMON
    | {
        "resid_pdrop",
        "embd_pdrop",
        "attention_bias",
        "mlp_bias",
        "lm_head_bias",
        "full_attn_mod",
        "interpolate_factor",
        "original_max_position_embeddings",  # read only with LongRoPE, like Phi3Config does
    },
    "gemma": _UNREAD_COMMON | {"hidden_activation", "use_bidirectional_attention"},
    "gemma2": _UNREAD_COMMON
    | {"hidden_act", "use_bidirectional_attention", "cache_implementation", "sliding_window_size"},
    "gemma3_text": _UNREAD_COMMON
    | {
        "hidden_act",
        "use_bidirectional_attention",
        "cache_implementation",
        "sliding_window_size",
        "_sliding_window_pattern",
    },
}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def check_model_config(d: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``config.json`` that the runtime cannot honour, as (field, message)."""
    model_type = d.get("model_type")
    if model_type not in ARCH_FIELDS:
        return "model_type", f"unsupported architecture {model_type!r} ({', '.join(ARCH_FIELDS)})"
    table = ARCH_FIELDS[str(model_type)]
    for key in _REQUIRED:
        if key not in d:
            return key, "is required"
    return _first_refused(d, table, HARMLESS_MODEL_FIELDS, f" for {model_type}")


def _first_refused(
    fields: Mapping[str, Any], table: Mapping[str, Check], harmless: frozenset[str], where: str
) -> tuple[str, str] | None:
    """The first of ``fields`` that ``table`` does not name (and ``harmless`` does not let
    through) or whose check fails, as (field, message); ``where`` ends the unknown-field
    message's "not implemented"."""
    for key, val in fields.items():
        check = table.get(key)
        if check is None:
            if key in harmless:
                continue
            return (
                key,
                f"unknown field (value {val!r}): not implemented{where}, refused rather than ignored",
            )
        msg = check(val, fields)
        if msg is not None:
            return key, f"{val!r} {msg}"
    return None


# --- adapter_config.json -------------------------------------------------------------------


def _a_false(v: Any, cj: Mapping[str, Any]) -> str | None:
    return None if v in (False, None) else "is not implemented"


def _a_empty(v: Any, cj: Mapping[str, Any]) -> str | None:
    return None if v in (None, [], {}, "") else "is not implemented"


def _a_any(v: Any, cj: Mapping[str, Any]) -> str | None:
    return None


def _a_bias(v: Any, cj: Mapping[str, Any]) -> str | None:
    return (
        None
        if v in ("none", None)
        else "is not implemented (only 'none': the adapter would carry biases)"
    )


def _a_loftq(v: Any, cj: Mapping[str, Any]) -> str | None:
    # LoftQ only changes how weights are initialised (and quantises the base during training);
    # the saved adapter is an ordinary LoRA unless it asks for the base to be replaced.
    return (
        None
        if not v or not v.get("loftq_bits")
        else "is not implemented (the base weights would be replaced)"
    )


def _a_init(v: Any, cj: Mapping[str, Any]) -> str | None:
    # Every init option only decides the starting point of training; PiSSA/OLoRA/CorDA-style
    # inits subtract from the base weights unless converted, which the file cannot show: they
    # are refused, like PEFT's own warning says they must be converted before sharing.
    if v in (True, False, None, "gaussian", "eva", "orthogonal"):
        return None
    return "is not implemented (an init that changes the base weights; convert the adapter to plain LoRA)"


def _a_tristate(v: Any, cj: Mapping[str, Any]) -> str | None:
    return None if v in (False, None) else "is not implemented"


# adapter_config.json key -> check. Read (honoured) fields and harmless ones are both listed;
# any other key refuses the adapter.
ADAPTER_FIELDS: dict[str, Check] = {
    # honoured: read by adapters.read_adapter / _target_set
    "peft_type": lambda v, cj: None if v in ("LORA", None) else "only LORA is supported",
    "r": _a_any,
    "lora_alpha": _a_any,
    "use_rslora": _a_any,
    "target_modules": _a_any,
    "exclude_modules": _a_any,
    "layers_to_transform": _a_any,
    "layers_pattern": _a_any,
    "rank_pattern": _a_any,
    "alpha_pattern": _a_any,
    # DoRA: magnitude vectors read with the matrices (read_adapter); where the worker cannot
    # serve it exactly (AdaFuse experts, a pool without DoRA factors) the load
    # refuses it by this name.
    "use_dora": lambda v, cj: None if v is None or isinstance(v, bool) else "must be a boolean",
    # Trained copies of embed_tokens, lm_head and the norms (saved_modules.resolve_saved
    # names what else an entry matches); a worker without the pool's tables for them
    # refuses the adapter by this name when it loads.
    "modules_to_save": lambda v, cj: (
        None
        if v is None or (isinstance(v, list) and all(isinstance(e, str) for e in v))
        else "must be a list of module names"
    ),
    # harmless at inference
    "task_type": _a_any,
    "base_model_name_or_path": _a_any,
    "revision": _a_any,
    "inference_mode": _a_any,
    "lora_dropout": _a_any,
    "auto_mapping": _a_any,
    "peft_version": _a_any,
    "init_lora_weights": _a_init,
    "loftq_config": _a_loftq,
    "megatron_config": _a_any,  # only used to build Megatron parallel layers; same maths
    "megatron_core": _a_any,
    "layer_replication": _a_empty,
    "eva_config": _a_any,  # EVA is an init
    "corda_config": _a_any,
    "qalora_group_size": _a_any,  # only read when use_qalora
    "lora_bias": _a_false,
    "target_parameters": _a_empty,
    # Trained rows of added tokens (extra_vocab.trainable_tokens checks the value).
    "trainable_token_indices": _a_any,
    "runtime_config": _a_any,
    "ensure_weight_tying": _a_false,
    # refused when set
    "use_qalora": _a_false,
    "bias": _a_bias,
    "fan_in_fan_out": _a_false,
    "alora_invocation_tokens": lambda v, cj: (
        None if v is None else "activated LoRA (aLoRA) is not implemented"
    ),
    "arrow_config": _a_tristate,
    "use_bdlora": _a_tristate,
    "lora_ga_config": _a_empty,  # LoRA-GA moves part of the weight out of the base
    "velora_config": _a_empty,
    "monteclora_config": _a_empty,
    "kasa_config": _a_empty,
}


def check_adapter_config(cj: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``adapter_config.json`` that the runtime cannot honour."""
    return _first_refused(cj, ADAPTER_FIELDS, frozenset(), "")
