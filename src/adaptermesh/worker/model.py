"""Llama-family model runtime (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3 text) with
multi-LoRA linear layers.

One forward pass runs a flat batch of T token rows over a paged KV cache (``StepInputs``):
a decode region of sequences with one query row each, then a prefill region of prompt chunks.
Attention reads K/V in place through each sequence's block table; RoPE is fused with the KV
write, and the residual adds with RMSNorm.

Every targeted linear module adds its LoRA delta through ``lora_ops.add_lora`` over the whole
flat batch, so requests for different adapters (and the base model, slot -1) share each launch.
q/k/v form one group of 3 slices and gate/up one group of 2 slices, matching the fused base
weights. Phi-3 checkpoints store those fused (qkv_proj, gate_up_proj) and load as they are;
an adapter on a fused module is split onto the slices (``FUSED_MODULES``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from adaptermesh.kernels import dispatch, int4_weight
from adaptermesh.kernels.int4_quant import quantize_int4
from adaptermesh.kernels.int4_weight import DEFAULT_GROUP_SIZE, Int4Weight
from adaptermesh.worker import lora_ops
from adaptermesh.worker.extra_vocab import ExtraStep, ExtraVocabPool
from adaptermesh.worker.kv_cache import PagedKVCache
from adaptermesh.worker.lora_groups import FUSED_MODULES, GROUPS, MODULE_TO_GROUP, SUPPORTED_MODULES
from adaptermesh.worker.model_fields import (
    ACTIVATIONS,
    IGNORED_TENSOR_SUFFIXES,
    check_model_config,
    gemma_act,
    rotary_dim,
)
from adaptermesh.worker.quant import (
    Fp8Weight,
    QuantLinear,
    QuantScheme,
    QuantWeight,
    dequantize_checkpoint,
    pack_linear,
    parse_quant_config,
    quant_linear,
)
from adaptermesh.worker.saved_modules import SavedModulePool, SavedRows, SavedStep
from adaptermesh.worker.sizing import ARENA_ALIGN_BYTES, arena_lengths, arena_unit

log = logging.getLogger(__name__)

__all__ = [
    "FUSED_MODULES",
    "GROUPS",
    "LORA_DTYPES",
    "MODULE_TO_GROUP",
    "SUPPORTED_MODULES",
    "ArenaGrid",
    "ArenaLayout",
    "ArenaLoraPool",
    "GatedTerms",
    "Int4LoraPool",
    "LoraPool",
    "ModelConfig",
    "ParallelComm",
    "StepInputs",
    "TransformerModel",
    "arena_part_bytes",
    "load_model",
    "make_lora_pool",
]

_PHI3_MODULES: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _rope_settings(
    params: dict[str, Any] | None, legacy: dict[str, Any] | None, theta: float, d: dict[str, Any]
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from transformers 5's ``rope_parameters`` or, without it,
    4.x's ``rope_theta`` + ``rope_scaling``; scaling None is plain RoPE."""
    scaling: dict[str, Any] | None
    if params is not None:
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        scaling = dict(legacy) if legacy else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        scaling.pop("partial_rotary_factor", None)  # read by model_fields.rotary_dim
        if rope_type == "su":
            rope_type = scaling["rope_type"] = "longrope"
        if rope_type == "longrope":
            # Phi3Config's top-level original_max_position_embeddings (default 4096) wins.
            scaling["original_max_position_embeddings"] = int(
                d.get("original_max_position_embeddings", 4096)
            )
        if rope_type == "default":
            scaling = None
    return theta, scaling


def _gemma3_layer_types(d: dict[str, Any], num_layers: int) -> list[str]:
    """Gemma3TextConfig: layer_types, else every sliding_window_pattern-th layer (6) is full."""
    pattern = int(d.get("sliding_window_pattern", 6))
    return list(
        d.get("layer_types")
        or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    )


def _layer_windows(model_type: str, d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers 5 applies it.

    Mistral: ``sliding_window`` on every layer (absent means MistralConfig's 4096). Qwen2/3: the
    window only when ``use_sliding_window``, on layers whose ``layer_types`` entry is
    sliding_attention; without layer_types, layers with index >= ``max_window_layers`` (default
    28) slide (Qwen2Config.__post_init__).
    """
    if model_type == "mistral":
        w = d.get("sliding_window", 4096)
        return tuple([int(w)] * num_layers) if w else ()
    if model_type == "phi3":
        w = d.get("sliding_window")
        return tuple([int(w)] * num_layers) if w else ()
    if model_type in ("gemma2", "gemma3_text"):
        # Gemma2Config: window 4096 when absent, even layers sliding when layer_types is absent.
        w = d.get("sliding_window", 4096)
        if model_type == "gemma3_text":
            types = _gemma3_layer_types(d, num_layers)
        else:
            types = d.get("layer_types") or [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
            ]
        out = tuple(int(w) if w and t == "sliding_attention" else None for t in types)
        return out if any(x is not None for x in out) else ()
    if model_type in ("qwen2", "qwen3"):
        w = d.get("sliding_window", 4096)
        qtypes = d.get("layer_types")
        first = int(d.get("max_window_layers", 28))
        if not d.get("use_sliding_window", False) or not w:
            return ()
        if qtypes is None:
            qtypes = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        out = tuple(int(w) if t == "sliding_attention" else None for t in qtypes)
        return out if any(x is not None for x in out) else ()
    return ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The largest window of any layer (None: every layer attends to the whole sequence).
    sliding_window: int | None = None
    o_bias: bool = False  # o_proj bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down biases
    act: str = "silu"  # kernels.act_mul's name for hidden_act
    # Per layer: the sliding window, or None for full attention. Empty: no windows anywhere.
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    rotary_dim: int = 0  # rotated dimensions of a head (partial_rotary_factor); 0: head_dim
    attn_scale: float | None = (
        None  # softmax scale (Gemma 2: query_pre_attn_scalar^-0.5); None: head_dim^-0.5
    )
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c)
    gemma_norm: bool = False  # RMSNorm scales by (1 + weight), in fp32
    embed_scale: float | None = None  # embeddings times sqrt(hidden_size), rounded to the dtype
    sandwich_norm: bool = False  # Gemma 2: norms after attention and around the MLP too
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj are stored fused
    # Gemma 3: (rope_theta, rope_scaling) of the sliding-attention layers, which layers those
    # are (their own RoPE even without a window).
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    local_rope_layers: tuple[bool, ...] = ()
    # quantization_config: which linear modules the checkpoint stores in fp8 (worker/quant.py).
    quant: QuantScheme | None = None

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def adapter_modules(self) -> tuple[str, ...]:
        """The linear modules of the checkpoint an adapter may target, as PEFT names them."""
        return _PHI3_MODULES if self.fused_checkpoint else SUPPORTED_MODULES

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse ``config.json``; every field is read or harmless (``model_fields``), else refused."""
        bad = check_model_config(d)
        if bad is not None:
            raise ValueError(f"config.{bad[0]}: {bad[1]}")
        model_type = str(d["model_type"])
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        # Qwen3Config's head_dim defaults to 128 and Gemma's to 256, not hidden / heads.
        default_hd = (
            {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}.get(model_type)
            if "head_dim" not in d
            else None
        )
        head_dim = int(d.get("head_dim") or default_hd or hidden // heads)
        # transformers 5 nests RoPE settings in rope_parameters; 4.x uses rope_theta + rope_scaling.
        local_rope: tuple[float, dict[str, Any] | None] | None = None
        if model_type == "gemma3_text":
            # Gemma3TextConfig: RoPE per layer type; legacy rope_theta / rope_scaling are the
            # full-attention layers', rope_local_base_freq the sliding layers' theta.
            nested = d.get("rope_parameters") or {}
            full = dict(nested.get("full_attention") or {"rope_type": "default"})
            if d.get("rope_scaling"):
                full.update(d["rope_scaling"])
            full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
            local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
            local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
            theta, scaling = _rope_settings(full, None, 0.0, d)
            local_rope = _rope_settings(local, None, 0.0, d)
        else:
            rp = d.get("rope_parameters")
            theta, scaling = _rope_settings(
                rp if isinstance(rp, dict) else None,
                d.get("rope_scaling"),
                float(d.get("rope_theta", 10000.0)),
                d,
            )
        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),))
        )
        num_layers = int(d["num_hidden_layers"])
        attention_bias = model_type in (
            "llama",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
        ) and bool(d.get("attention_bias", False))
        windows = _layer_windows(model_type, d, num_layers)
        gemma = model_type in ("gemma", "gemma2", "gemma3_text")
        sandwich = model_type in ("gemma2", "gemma3_text")
        if model_type == "gemma":
            act = gemma_act(d)
        elif sandwich:
            act = str(d.get("hidden_activation", "gelu_pytorch_tanh"))
        else:
            act = str(d.get("hidden_act", "silu"))
        rot = rotary_dim(d, head_dim)
        caps: dict[str, float | None] = {
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
        if model_type == "gemma2":  # Gemma2Config's defaults: 50 and 30
            caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
        if sandwich:  # Gemma3TextConfig's defaults are null
            caps.update({k: d[k] for k in caps if k in d})
        return cls(
            arch=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            eos_token_ids=eos_ids,
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            sliding_window=max((w for w in windows if w is not None), default=None),
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
            act=ACTIVATIONS[act],
            layer_windows=windows,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            rotary_dim=rot if rot != head_dim else 0,
            attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5 if sandwich else None,
            attn_softcap=None
            if caps["attn_logit_softcapping"] is None
            else float(caps["attn_logit_softcapping"]),
            final_softcap=None
            if caps["final_logit_softcapping"] is None
            else float(caps["final_logit_softcapping"]),
            gemma_norm=gemma,
            embed_scale=math.sqrt(hidden) if gemma else None,
            sandwich_norm=sandwich,
            fused_checkpoint=model_type == "phi3",
            local_rope=local_rope,
            local_rope_layers=(
                tuple(t == "sliding_attention" for t in _gemma3_layer_types(d, num_layers))
                if local_rope
                else ()
            ),
            quant=(
                parse_quant_config(d["quantization_config"])
                if d.get("quantization_config") is not None
                else None
            ),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model_dir: {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a targetable linear module (or a fused one)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return {
            "qkv_proj": (self.hidden_size, q + 2 * kv),
            "gate_up_proj": (self.hidden_size, 2 * self.intermediate_size),
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


def rope_inv_freq(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (fp32) and the attention scaling factor for cos/sin."""
    dim = cfg.rot_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv, 1.0
    kind = sc["rope_type"]
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "dynamic":
        # NTK-aware dynamic scaling, fixed at the serving context length: a cache-based engine
        # cannot re-rotate cached keys as a sequence grows, so the base is chosen once from
        # max_model_len (identical to the unscaled one while max_len <= the trained length).
        trained = cfg.max_position_embeddings
        if max_len <= trained:
            return inv, 1.0
        new_base = base * ((factor * max_len / trained) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (new_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if kind == "llama3":
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        orig = float(sc.get("original_max_position_embeddings", 8192))
        low_wavelen = orig / low
        high_wavelen = orig / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        # transformers' _compute_yarn_parameters, field for field.
        orig_y = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        yf = (
            float(sc["factor"])
            if sc.get("factor") is not None
            else cfg.max_position_embeddings / orig_y
        )
        beta_fast = float(sc.get("beta_fast") or 32.0)
        beta_slow = float(sc.get("beta_slow") or 1.0)
        ms, ms_all = sc.get("mscale"), sc.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn_factor = sc.get("attention_factor")
        if attn_factor is not None:
            mscale = float(attn_factor)
        elif ms and ms_all:
            mscale = get_mscale(yf, float(ms)) / get_mscale(yf, float(ms_all))
        else:
            mscale = get_mscale(yf)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig_y / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo_f, hi_f = corr_dim(beta_fast), corr_dim(beta_slow)
        if sc.get("truncate", True):
            lo_f, hi_f = math.floor(lo_f), math.ceil(hi_f)
        lo, hi = max(lo_f, 0), min(hi_f, dim - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        interp = inv / yf
        return interp * (1 - extrapolation) + inv * extrapolation, mscale
    if kind == "longrope":
        # transformers' _compute_longrope_parameters. Which factors apply is fixed at the
        # serving context length, like dynamic above: transformers picks per forward call
        # (long once the call's last position passes the original length), which a KV cache
        # cannot follow without re-rotating cached keys. With max_len <= the original length
        # this is transformers' output for every sequence; above it, the long factors apply
        # from position 0, as in transformers' forward over any sequence past that length.
        orig_l = float(sc["original_max_position_embeddings"])
        lf = (
            float(sc["factor"])
            if sc.get("factor") is not None
            else cfg.max_position_embeddings / orig_l
        )
        af = sc.get("attention_factor")
        if af is None:
            af = 1.0 if lf <= 1.0 else math.sqrt(1 + math.log(lf) / math.log(orig_l))
        long = max_len > orig_l
        if long:
            log.warning(
                "LongRoPE: max_model_len %d > original_max_position_embeddings %d, so every sequence uses the "
                "long factors; transformers uses the short ones for sequences of at most %d tokens",
                max_len,
                int(orig_l),
                int(orig_l),
            )
        ext = torch.tensor(sc["long_factor"] if long else sc["short_factor"], dtype=torch.float32)
        return 1.0 / (
            ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        ), float(af)
    raise ValueError(
        f"config.rope_scaling.rope_type: unsupported {kind!r} (linear, dynamic, llama3, yarn, longrope)"
    )


def _cos_sin(
    cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[max_len, rotary_dim]: cos of each frequency, then sin, rounded to the model dtype like
    the cos/sin tables of transformers' Llama."""
    inv, mscale = rope_inv_freq(cfg, max_len)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1).to(
        device=device, dtype=dtype
    )


class ParallelComm(Protocol):
    """The collectives a tensor-parallel rank's forward pass needs (``tp_group.TPComm``)."""

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (after each row-parallel projection)."""
        ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, V/N] logits of this rank's vocabulary slice -> [S, V] of every rank's."""
        ...

    def row_lora_columns(self, width: int) -> tuple[int, int] | None:
        """Where a row-parallel module's LoRA expand goes: None, the whole output (B
        replicated; the delta joins the base all-reduce as a partial sum); or the column range
        of this rank's share of B (the shrink output is all-reduced first)."""
        ...


class GatedTerms(Protocol):
    """What the forward pass calls for expert sets on an unmerged path (``adafuse.SoloGated``,
    ``adafuse.GatedBatch``)."""

    def route(self, h: torch.Tensor) -> None: ...

    def apply(self, layer: int, group: str, out: torch.Tensor, x: torch.Tensor) -> None: ...


@dataclass(slots=True)
class StepInputs:
    """Device tensors and host facts for one forward pass over a paged KV cache.

    The step holds ``S`` sequence entries and ``T`` token rows. Sequences ``[0, num_decode)``
    own exactly one query row each (the decode region, served by the split-KV decode kernel);
    sequences ``[num_decode, S)`` own up to ``max_prefill_len`` rows each (prompt chunks,
    served by the tiled prefill kernel). A sequence's rows are its last positions: rows
    ``query_start[s] .. query_start[s+1]-1`` sit at positions ``seq_lens[s]-n_s ..
    seq_lens[s]-1``. Padding sequences have ``seq_lens == 0``; padding rows write nowhere
    (``slot_mapping == -1``) and use no adapter, so a CUDA graph captured for a bucket of
    shapes replays any smaller step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: (
        torch.Tensor
    )  # [T] int64 flat KV slot (block * block_size + offset), -1 = no write
    token_slots: torch.Tensor  # [T] int32, LoRA pool slot, -1 = base
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, keys held after this step (0 = padding sequence)
    query_start: torch.Tensor  # [S + 1] int32
    logits_rows: torch.Tensor  # [S] int64: the row whose logits each sequence samples from
    num_decode: int  # host: sequences in the decode region
    max_prefill_len: int  # host: bound on rows per prefill-region sequence (0: none)
    num_splits: int = 1  # host: key partitions per decode sequence
    # Trained module copies (``modules_to_save``) the step's rows' adapters hold; None: none
    # (``saved_modules``: the step then runs no part of them).
    saved: SavedStep | None = None
    # Rows of adapters with extra vocabulary rows (``extra_vocab``); None: none (the logits
    # are the model's vocabulary wide, and the step runs no part of it).
    extra: ExtraStep | None = None


class LoraPool:
    """GPU-resident LoRA weights for ``num_slots`` adapters, in the kernels' pool layout.

    Per group g (see GROUPS): ``a[g]`` is [L, n_slices, S, R_max, in] and ``b[g][i]`` is
    [L, S, N_i, R_max], so layer l's view ``a[g][l]`` is exactly the [n_slices, S, R_max, H]
    tensor ``add_lora`` takes, and one slot of every layer is written with one copy.
    ``ranks[g]`` is the adapter's rank where it targets any module of g, else 0.
    ``routes[p]`` (``lora_ops.GroupRoute``) gives each slot's index in part p (a group, or the
    vocabulary's ``embed``/``head``): the slot itself where its adapter targets p, -1
    elsewhere, so a row whose adapter leaves p is a base row in p's kernel launch.

    ``groups`` limits the pool to the groups the served adapters target (``pool_groups``):
    a pool for q_proj/v_proj adapters holds only the qkv group, a seventh of the bytes of a
    slot over every module, so several times the adapters fit the same memory. The forward
    pass runs no LoRA term for a group the pool lacks, and an adapter that targets one is
    refused when it loads.

    With ``dora`` the pool also holds DoRA's per-output factor ``m / ||W + scale B A||`` (the
    norm per output row of the direction, constant at inference, so computed once at load
    from the adapter's magnitude vector, its slot matrices and ``base_weight``):
    ``dora[g]`` is [L, S + 1, sum N_i], 1 wherever a slot holds a plain LoRA or a module the
    adapter leaves, and row S is all ones (base rows, at index -1, take 1). The forward pass scales
    each projection's output (without its bias) by its row's factor.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        groups: frozenset[str] | None = None,
        out_features: dict[str, int] | None = None,
        dora: bool = False,
        vocab: bool = False,
        saved: frozenset[str] = frozenset(),
        extra_vocab: int = 0,
    ) -> None:
        """``out_features``: B's output rows per module where they differ from the module's
        (a tensor-parallel rank holding a share of o's and down's B, ``tp_shard``).

        ``vocab``: the pool also holds LoRA on ``embed_tokens`` and ``lm_head`` (``embed_a``
        [S, R_max, V] as PEFT's ``lora_embedding_A`` so a token's column is gathered,
        ``embed_b`` [S, H, R_max]; ``head_a`` [1, S, R_max, H], ``head_b`` [S, V, R_max] in
        the kernels' layout), with their own ranks (``vocab_ranks``, 0 where the adapter
        leaves the module).

        ``saved``: the kinds of trained module copies (``modules_to_save``) the pool holds per
        slot (``saved_modules.POOL_KINDS``; ``self.saved``, None without any).

        ``extra_vocab``: the most vocabulary rows past the model's an adapter in a slot may
        have (``extra_vocab``; ``self.extra``, None for 0): the vocabulary factors and copies
        are that much wider, and the extra rows of the base embedding and head are held."""
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.groups = _checked_groups(groups)
        self._cfg_vocab = cfg.vocab_size
        outs = out_features or {}
        L = cfg.num_layers
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, tuple[torch.Tensor, ...]] = {}
        self.ranks: dict[str, torch.Tensor] = {}
        for g, mods in _pool_groups(self.groups):
            fan_in = cfg.module_shape(mods[0])[0]
            self.a[g] = torch.zeros(
                (L, len(mods), num_slots, max_rank, fan_in), dtype=dtype, device=device
            )
            self.b[g] = tuple(
                torch.zeros(
                    (L, num_slots, outs.get(m, cfg.module_shape(m)[1]), max_rank),
                    dtype=dtype,
                    device=device,
                )
                for m in mods
            )
            self.ranks[g] = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.dora: dict[str, torch.Tensor] = {}
        if dora:
            for g, bs in self.b.items():
                width = sum(b.shape[2] for b in bs)
                self.dora[g] = torch.ones((L, num_slots + 1, width), dtype=dtype, device=device)
        # The live [out, in] base weight of (layer, module), bound by the engine for a DoRA
        # pool (``TransformerModel.module_weight``).
        self.base_weight: Callable[[int, str], torch.Tensor] | None = None
        self.vocab: dict[str, torch.Tensor] = {}
        self.vocab_ranks: dict[str, torch.Tensor] = {}
        if vocab:
            v, hid = cfg.vocab_size + extra_vocab, cfg.hidden_size
            shapes = {
                "embed_a": (num_slots, max_rank, v),
                "embed_b": (num_slots, hid, max_rank),
                "head_a": (1, num_slots, max_rank, hid),
                "head_b": (num_slots, v, max_rank),
            }
            for k, shape in shapes.items():
                self.vocab[k] = torch.zeros(shape, dtype=dtype, device=device)
            for part in ("embed", "head"):
                self.vocab_ranks[part] = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # The model's embedding and head weights, bound by the engine for a vocab pool: a
        # vocab adapter's saved base weights are checked against them.
        self.base_vocab: Callable[[str], torch.Tensor] | None = None
        self.saved: SavedModulePool | None = (
            SavedModulePool(cfg, num_slots, device, dtype, saved, extra_vocab) if saved else None
        )
        self.extra: ExtraVocabPool | None = (
            ExtraVocabPool(cfg, num_slots, extra_vocab, device, dtype) if extra_vocab else None
        )
        self.num_layers = L
        self._init_routes(num_slots, [*self.a, *self.vocab_ranks], device)

    # A pool of slots: every part's index of an adapter is its slot. ``ArenaLoraPool`` sets
    # its layout (``ArenaLayout``), in which the manager places each part on its own.
    arena: ArenaLayout | None = None

    def place(self, slot: int, placement: Mapping[str, int]) -> None:
        """The adapter in ``slot`` holds ``placement[p]`` of each part p: in a pool of slots,
        always the slot itself."""
        odd = sorted(p for p, i in placement.items() if i != slot)
        if odd:
            raise ValueError(f"slot {slot}: a pool of slots holds {', '.join(odd)} at the slot")

    def _init_routes(self, grid: int, parts: Sequence[str], device: torch.device) -> None:
        """Per part (pool group, or vocabulary part ``embed``/``head``): each handle's index in
        the part's grid of ``grid`` indices, -1 until an adapter on the part is published
        there (``lora_ops.GroupRoute``)."""
        self.routes: dict[str, lora_ops.GroupRoute] = {
            part: lora_ops.GroupRoute(
                torch.full((self.num_slots,), -1, dtype=torch.int32, device=device), grid
            )
            for part in parts
        }

    def _route(self, slot: int, parts: frozenset[str] | Mapping[str, int]) -> None:
        """Publish ``slot``'s index in every part: its own where ``parts`` names the part (a
        mapping gives the index), -1 elsewhere."""
        for part, route in self.routes.items():
            if isinstance(parts, Mapping):
                route.index[slot] = parts.get(part, -1)
            else:
                route.index[slot] = slot if part in parts else -1

    def group_scales(self, part: str) -> torch.Tensor:
        """[S] fp32 scales the kernels read for ``part``'s indices."""
        return self.scales

    def describe(self) -> str:
        """What the pool holds, for the start-up log."""
        return f"{self.num_slots} slots"

    def vocab_args(
        self, part: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A, B, scales, ranks) of vocabulary part ``embed`` (A [S, R_max, V] gathered by
        token, B [S, H, R_max]) or ``head`` (A [1, S, R_max, H], B [S, V, R_max])."""
        ranks = self.vocab_ranks[part]
        if part == "embed":
            return self.vocab["embed_a"], self.vocab["embed_b"], self.group_scales(part), ranks
        return self.vocab["head_a"], self.vocab["head_b"], self.group_scales(part), ranks

    def dora_factors(self, group: str, layer: int) -> torch.Tensor:
        """[S (+ 1), N] DoRA factors of ``group``'s indices in ``layer``."""
        return self.dora[group][layer]

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.a.values())
        total += self.saved.nbytes if self.saved is not None else 0
        total += self.extra.nbytes if self.extra is not None else 0
        total += sum(t.numel() * t.element_size() for bs in self.b.values() for t in bs)
        total += sum(t.numel() * t.element_size() for t in self.dora.values())
        total += sum(t.numel() * t.element_size() for t in self.vocab.values())
        return total

    def vocab_view(
        self, part: str, slot: int, rank: int, is_b: bool, rows: int | None = None
    ) -> torch.Tensor:
        """Where a vocabulary LoRA matrix goes, in its file's shape: embed A [rank, V], embed
        B [H, rank], head A [rank, H], head B [V, rank], V being ``rows`` (the adapter's
        vocabulary; None: the model's)."""
        v = self._cfg_vocab if rows is None else rows
        if part == "embed":
            t = self.vocab["embed_a"]
            return self.vocab["embed_b"][slot, :, :rank] if is_b else t[slot, :rank, :v]
        if is_b:
            return self.vocab["head_b"][slot, :v, :rank]
        return self.vocab["head_a"][0, slot, :rank]

    def set_vocab(self, slot: int, rank: int, parts: frozenset[str]) -> None:
        """Publish the slot's vocabulary ranks (0 for a part the adapter leaves) and its index
        in each (-1 for a part it leaves)."""
        for part, ranks in self.vocab_ranks.items():
            ranks[slot] = rank if part in parts else 0
            self.routes[part].index[slot] = slot if part in parts else -1

    def set_dora(
        self, slot: int, scale: float, magnitudes: Sequence[tuple[str, int, int, torch.Tensor]]
    ) -> None:
        """Write ``slot``'s DoRA factors from its magnitude vectors ``(group, slice, layer,
        m [N_i])``; every other output of the slot gets 1. Runs after the slot's matrices are
        written (their padding ranks zeroed) and reads them there, so the norm sees exactly
        the weights the step uses. As PEFT's ``DoraLinearLayer.get_weight_norm``: the norm of
        each output row of ``W + scale * (B @ A)`` in the weights' dtype, then ``m / norm``."""
        for t in self.dora.values():
            t[:, slot].fill_(1.0)
        if not magnitudes:
            return
        if self.base_weight is None:
            raise RuntimeError("a DoRA pool needs its base weights bound (base_weight)")
        for g, i, layer, m in magnitudes:
            w = self.base_weight(layer, GROUPS[g][i])
            a = self.a[g][layer, i, slot]  # [R_max, in]
            b = self.b[g][i][layer, slot]  # [N_i, R_max]
            direction = w + scale * (b @ a).to(w.dtype)
            norm = torch.linalg.norm(direction, dim=1).to(w.dtype)
            off = sum(bb.shape[2] for bb in self.b[g][:i])
            self.dora[g][layer, slot, off : off + b.shape[0]] = m.to(w.dtype) / norm

    def layer_args(
        self, g: str, layer: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        return self.a[g][layer], tuple(b[layer] for b in self.b[g]), self.ranks[g]

    def clear(self, slot: int) -> None:
        self.scales[slot] = 0.0
        for g in self.ranks:
            self.ranks[g][slot] = 0
        for ranks in self.vocab_ranks.values():
            ranks[slot] = 0
        for t in self.dora.values():
            t[:, slot].fill_(1.0)
        if self.saved is not None:
            self.saved.clear(slot)
        for route in self.routes.values():
            route.index[slot] = -1
        if self.extra is not None:
            self.extra.clear(slot)

    def zero_slot(self, slot: int, written: Mapping[str, int] | None = None) -> None:
        """Zero what the next copy into ``slot`` will not write: ranks above an adapter's own,
        and layers and modules it does not target, must read as zeros. ``written[g]``: the
        copy writes ranks below it of every layer and module of group ``g``, so only the
        ranks from there up are zeroed (none when it is ``max_rank``); any other group is
        zeroed whole."""
        for g in self.a:
            r = written.get(g, 0) if written else 0
            if r >= self.max_rank:
                continue
            self.a[g][:, :, slot, r:].zero_()
            for b in self.b[g]:
                b[:, slot, :, r:].zero_()
        for k, t in self.vocab.items():  # a few MB a slot: zeroed whole
            (t[0, slot] if k == "head_a" else t[slot]).zero_()

    def slot_view(
        self, group: str, index: int, layer: int, slot: int, rank: int, is_b: bool
    ) -> torch.Tensor:
        """Where one adapter matrix goes: A [rank, in] or B [out, rank] of (layer, slice)."""
        if is_b:
            return self.b[group][index][layer, slot, :, :rank]
        return self.a[group][layer, index, slot, :rank]

    def set_slot(self, slot: int, rank: int, scale: float, groups: frozenset[str]) -> None:
        """Publish the slot's ranks (0 for untargeted groups), scale and index in each group
        (-1 for untargeted ones: its rows skip the group) to the kernels."""
        for g in self.ranks:
            self.ranks[g][slot] = rank if g in groups else 0
            self.routes[g].index[slot] = slot if g in groups else -1
        self.scales[slot] = scale

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of everything in ``slot`` (a device scalar; no host sync)."""
        parts = [self.a[g][:, :, slot].sum(dtype=torch.float64) for g in self.a]
        parts += [b[:, slot].sum(dtype=torch.float64) for g in self.b for b in self.b[g]]
        parts += [
            (t[0, slot] if k == "head_a" else t[slot]).sum(dtype=torch.float64)
            for k, t in self.vocab.items()
        ]
        if self.saved is not None:
            parts.append(self.saved.slot_sum(slot))
        if self.extra is not None:
            parts.append(self.extra.slot_sum(slot))
        return torch.stack(parts).sum()

    @property
    def slot_nbytes(self) -> int:
        """Device bytes one adapter slot takes (all layers and groups)."""
        return self.nbytes // self.num_slots


VOCAB_PARTS = ("embed", "head")


@dataclass(frozen=True, slots=True)
class ArenaGrid:
    """One part's grid over the arena: index i holds one adapter's matrices of the part (every
    layer, at the pool's max rank) in bytes ``[i * step, i * step + length)``. Every part's
    grid has the same step (the arena's unit) and a length of whole steps, so consecutive
    indices of one grid overlap where the part is longer than a step, and an adapter's parts
    pack back to back."""

    step: int
    length: int
    count: int

    def span(self, index: int) -> tuple[int, int]:
        return index * self.step, index * self.step + self.length


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """The arena's size in bytes and each part's grid over it (what the adapter manager
    allocates in)."""

    size: int
    grids: Mapping[str, ArenaGrid]

    def adapter_bytes(self, parts: Iterable[str]) -> int:
        """Bytes an adapter on ``parts`` takes: one index of each part's grid."""
        return sum(self.grids[p].length for p in parts)

    def fits(self, parts: Iterable[str]) -> int:
        """How many adapters on ``parts`` (and nothing else) the arena holds at once."""
        need = self.adapter_bytes(parts)
        return self.size // need if need else max(g.count for g in self.grids.values())


@dataclass(frozen=True, slots=True)
class _PartShape:
    """Where one part's tensors lie inside an index, in elements: each (offset, shape) is
    contiguous; ``used`` elements in all (the rest of the part's length is padding)."""

    tensors: tuple[tuple[int, tuple[int, ...]], ...]  # A, then B per slice (or embed/head B)
    dora: tuple[int, tuple[int, ...]] | None  # [L, sum N_i] DoRA factors
    used: int


def _part_shapes(
    cfg: ModelConfig, max_rank: int, groups: frozenset[str], dora: bool, vocab: bool
) -> dict[str, _PartShape]:
    L, R = cfg.num_layers, max_rank
    out: dict[str, _PartShape] = {}
    for g, mods in _pool_groups(groups):
        fan_in = cfg.module_shape(mods[0])[0]
        shapes: list[tuple[int, ...]] = [(L, len(mods), R, fan_in)]
        shapes += [(L, cfg.module_shape(m)[1], R) for m in mods]
        offsets = []
        at = 0
        for shape in shapes:
            offsets.append((at, shape))
            at += math.prod(shape)
        factors = None
        if dora:
            width = sum(cfg.module_shape(m)[1] for m in mods)
            factors = (at, (L, width))
            at += L * width
        out[g] = _PartShape(tuple(offsets), factors, at)
    if vocab:
        v, hid = cfg.vocab_size, cfg.hidden_size
        out["embed"] = _PartShape(((0, (R, v)), (R * v, (hid, R))), None, R * v + hid * R)
        out["head"] = _PartShape(((0, (R, hid)), (R * hid, (v, R))), None, R * hid + v * R)
    return out


def arena_part_bytes(
    cfg: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    groups: frozenset[str] | None = None,
    dora: bool = False,
    vocab: bool = False,
) -> dict[str, int]:
    """Bytes of one adapter's matrices of each part at ``max_rank`` (and its DoRA factors),
    aligned to ARENA_ALIGN_BYTES; an arena rounds them up to its steps (``arena_lengths``)."""
    size = torch.empty((), dtype=dtype).element_size()
    return {
        p: -(-shape.used * size // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
        for p, shape in _part_shapes(cfg, max_rank, _checked_groups(groups), dora, vocab).items()
    }


class ArenaLoraPool(LoraPool):
    """A LoRA pool in one arena of bytes, allocated once, in which each adapter takes only the
    parts it targets: per part (pool group, or vocabulary part) a grid of indices over the
    whole arena (``ArenaGrid``), each index holding one adapter's matrices of that part, so an
    adapter on q and v takes one index of the qkv grid and nothing of o, gate_up or down.

    The grids overlap: the adapter manager places each adapter's parts in byte ranges that
    overlap nothing else in use (``place``). The kernels' operands are fixed views over the
    arena (a CUDA graph captures their bases once): per group and layer, A is
    ``[n_slices, S_g, R_max, in]`` and B ``[S_g, N_i, R_max]`` with the arena's unit between
    indices; ranks and scales are per part and per index; ``routes[p]`` maps each adapter
    handle (``num_slots`` of them, the most adapters the arena can hold) to its index in p.
    DoRA factors live in their group's index, [L, sum N_i] after the matrices."""

    def __init__(
        self,
        cfg: ModelConfig,
        arena_bytes: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        groups: frozenset[str] | None = None,
        dora: bool = False,
        vocab: bool = False,
    ) -> None:
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.groups = _checked_groups(groups)
        self.num_layers = cfg.num_layers
        self._shapes = _part_shapes(cfg, max_rank, self.groups, dora, vocab)
        used = arena_part_bytes(cfg, max_rank, dtype, self.groups, dora, vocab)
        elt = torch.empty((), dtype=dtype).element_size()
        unit = arena_unit(arena_bytes, used)
        size = arena_bytes // unit * unit
        grids = {
            p: ArenaGrid(unit, length, (size - length) // unit + 1 if size >= length else 0)
            for p, length in arena_lengths(arena_bytes, used).items()
        }
        short = sorted(p for p, g in grids.items() if g.count < 1)
        if short:
            raise ValueError(
                f"lora_arena_bytes: {arena_bytes} bytes hold no adapter on {', '.join(short)}; "
                f"one adapter on every target module at rank {max_rank} takes "
                f"{sum(g.length for g in grids.values())}"
            )
        self.layout = ArenaLayout(size, grids)
        self.arena = self.layout
        self.storage = torch.zeros(size, dtype=torch.uint8, device=device)
        self._elements = self.storage.view(dtype)
        self._elt = elt
        self.num_slots = max(g.count for g in grids.values())
        self.placed: dict[int, dict[str, int]] = {}
        self.ranks = {g: self._zeros(grids[g].count, torch.int32) for g in self._layer_parts}
        self.vocab_ranks = {
            p: self._zeros(grids[p].count, torch.int32) for p in VOCAB_PARTS if p in grids
        }
        self._scales = {p: self._zeros(g.count, torch.float32) for p, g in grids.items()}
        self.a, self.b = {}, {}
        self._layers: dict[str, tuple[tuple[torch.Tensor, tuple[torch.Tensor, ...]], ...]] = {}
        self._dora: dict[str, tuple[torch.Tensor, ...]] = {}
        for g in self._layer_parts:
            (a_off, (L, n, R, fan_in)), *bs = self._shapes[g].tensors
            count, stride = grids[g].count, unit // elt
            layers = []
            for li in range(L):
                a = self._elements.as_strided(
                    (n, count, R, fan_in),
                    (R * fan_in, stride, fan_in, 1),
                    a_off + li * n * R * fan_in,
                )
                b = tuple(
                    self._elements.as_strided((count, out, R), (stride, R, 1), off + li * out * R)
                    for off, (_, out, _) in bs
                )
                layers.append((a, b))
            self._layers[g] = tuple(layers)
            factors = self._shapes[g].dora
            if factors is not None:
                off, (_, width) = factors
                self._dora[g] = tuple(
                    self._elements.as_strided((count, width), (stride, 1), off + li * width)
                    for li in range(L)
                )
        self.dora = dict(self._dora)  # type: ignore[arg-type]
        self.vocab = {}
        if vocab:
            v, hid = cfg.vocab_size, cfg.hidden_size
            e, h = grids["embed"], grids["head"]
            es = hs = unit // elt
            R = max_rank
            self.vocab = {
                "embed_a": self._elements.as_strided((e.count, R, v), (es, v, 1), 0),
                "embed_b": self._elements.as_strided((e.count, hid, R), (es, R, 1), R * v),
                "head_a": self._elements.as_strided((1, h.count, R, hid), (0, hs, hid, 1), 0),
                "head_b": self._elements.as_strided((h.count, v, R), (hs, R, 1), R * hid),
            }
        self.base_weight = None
        self.base_vocab = None
        self.saved = None  # trained module copies keep a pool of slots
        self.extra = None  # and so do extra vocabulary rows
        self._cfg_vocab = cfg.vocab_size
        self.scales = self._zeros(1, torch.float32)  # unused: scales are per part (group_scales)
        self.routes = {
            p: lora_ops.GroupRoute(self._full(self.num_slots), g.count) for p, g in grids.items()
        }

    @property
    def _layer_parts(self) -> list[str]:
        return [g for g, _ in _pool_groups(self.groups)]

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def _full(self, n: int) -> torch.Tensor:
        return torch.full((n,), -1, dtype=torch.int32, device=self.device)

    # ---- placement ------------------------------------------------------------------------

    def place(self, slot: int, placement: Mapping[str, int]) -> None:
        """Handle ``slot`` holds its adapter at ``placement[p]`` of each part p (host only;
        the manager chose byte ranges that overlap nothing in use). Published to the kernels
        by ``set_slot``."""
        for p, i in placement.items():
            grid = self.layout.grids.get(p)
            if grid is None or not 0 <= i < grid.count:
                raise ValueError(f"slot {slot}: no index {i} in the arena's {p!r} grid")
        self.placed[slot] = dict(placement)

    def _index(self, slot: int, part: str) -> int:
        got = self.placed.get(slot, {}).get(part)
        if got is None:
            raise RuntimeError(f"slot {slot} has no index in {part!r} (place it first)")
        return got

    def _region(self, part: str, index: int, k: int) -> torch.Tensor:
        """Tensor ``k`` of ``part`` at ``index`` (A, then the Bs), in its own contiguous shape."""
        off, shape = self._shapes[part].tensors[k]
        base = index * self.layout.grids[part].step // self._elt + off
        return self._elements[base : base + math.prod(shape)].view(shape)

    def _factors(self, group: str, index: int) -> torch.Tensor:
        factors = self._shapes[group].dora
        assert factors is not None
        off, shape = factors
        base = index * self.layout.grids[group].step // self._elt + off
        return self._elements[base : base + math.prod(shape)].view(shape)

    # ---- what the manager writes ----------------------------------------------------------

    def zero_slot(self, slot: int, written: Mapping[str, int] | None = None) -> None:
        """Zero what the next copy will not write, in the slot's own indices (their bytes may
        hold any earlier adapter's matrices of any part): as ``LoraPool.zero_slot``."""
        for part, index in self.placed.get(slot, {}).items():
            tensors = self._shapes[part].tensors
            if part in VOCAB_PARTS:
                for k in range(len(tensors)):
                    self._region(part, index, k).zero_()
                continue
            r = written.get(part, 0) if written else 0
            if r >= self.max_rank:
                continue
            self._region(part, index, 0)[:, :, r:].zero_()
            for k in range(1, len(tensors)):
                self._region(part, index, k)[:, :, r:].zero_()

    def slot_view(
        self, group: str, index: int, layer: int, slot: int, rank: int, is_b: bool
    ) -> torch.Tensor:
        at = self._index(slot, group)
        if is_b:
            return self._region(group, at, 1 + index)[layer, :, :rank]
        return self._region(group, at, 0)[layer, index, :rank]

    def vocab_view(
        self, part: str, slot: int, rank: int, is_b: bool, rows: int | None = None
    ) -> torch.Tensor:
        # ``rows``: an arena holds the model's vocabulary only (extra vocabulary rows keep a
        # pool of slots, and the adapter reader refuses them without one).
        at = self._index(slot, part)
        if is_b:
            return self._region(part, at, 1)[:, :rank]
        return self._region(part, at, 0)[:rank]

    def set_slot(self, slot: int, rank: int, scale: float, groups: frozenset[str]) -> None:
        """Publish the slot: ranks and scale at its indices, its index in every part (-1 in
        the parts it leaves)."""
        placement = self.placed.get(slot, {})
        missing = sorted(g for g in groups if g not in placement)
        if missing:
            raise RuntimeError(f"slot {slot} has no index in {', '.join(missing)}")
        for part, index in placement.items():
            if part in self.ranks:
                self.ranks[part][index] = rank if part in groups else 0
            self._scales[part][index] = scale
        self._route(slot, placement)

    def set_vocab(self, slot: int, rank: int, parts: frozenset[str]) -> None:
        for part, ranks in self.vocab_ranks.items():
            index = self.placed.get(slot, {}).get(part)
            if index is not None:
                ranks[index] = rank if part in parts else 0

    def clear(self, slot: int) -> None:
        for part, index in self.placed.pop(slot, {}).items():
            if part in self.ranks:
                self.ranks[part][index] = 0
            if part in self.vocab_ranks:
                self.vocab_ranks[part][index] = 0
            self._scales[part][index] = 0.0
        for route in self.routes.values():
            route.index[slot] = -1

    def set_dora(
        self, slot: int, scale: float, magnitudes: Sequence[tuple[str, int, int, torch.Tensor]]
    ) -> None:
        """As ``LoraPool.set_dora``, in the factors of the slot's own group indices."""
        placement = self.placed.get(slot, {})
        for g in self._dora:
            if g in placement:
                self._factors(g, placement[g]).fill_(1.0)
        if not magnitudes:
            return
        if self.base_weight is None:
            raise RuntimeError("a DoRA pool needs its base weights bound (base_weight)")
        for g, i, layer, m in magnitudes:
            at = placement[g]
            w = self.base_weight(layer, GROUPS[g][i])
            a = self._region(g, at, 0)[layer, i]  # [R_max, in]
            b = self._region(g, at, 1 + i)[layer]  # [N_i, R_max]
            direction = w + scale * (b @ a).to(w.dtype)
            norm = torch.linalg.norm(direction, dim=1).to(w.dtype)
            off = sum(self._shapes[g].tensors[1 + k][1][1] for k in range(i))
            self._factors(g, at)[layer, off : off + b.shape[0]] = m.to(w.dtype) / norm

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of the slot's matrices (its indices' A and B; no padding, no factors)."""
        parts = [
            self._region(part, index, k).sum(dtype=torch.float64)
            for part, index in self.placed.get(slot, {}).items()
            for k in range(len(self._shapes[part].tensors))
        ]
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(parts).sum()

    # ---- what the kernels read ------------------------------------------------------------

    def layer_args(
        self, g: str, layer: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        a, b = self._layers[g][layer]
        return a, b, self.ranks[g]

    def group_scales(self, part: str) -> torch.Tensor:
        return self._scales[part]

    def dora_factors(self, group: str, layer: int) -> torch.Tensor:
        return self._dora[group][layer]

    @property
    def nbytes(self) -> int:
        return self.layout.size

    @property
    def slot_nbytes(self) -> int:
        """Bytes one adapter on every part of the pool takes."""
        return self.layout.adapter_bytes(self.layout.grids)

    def describe(self) -> str:
        grids = self.layout.grids
        alone = ", ".join(f"{p} {self.layout.fits([p])}" for p in grids)
        size = self.layout.size
        shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB"
        return (
            f"arena {shown}: {self.layout.fits(grids)} adapters on "
            f"every module at rank {self.max_rank}, or on one part alone: {alone}"
        )


class Int4LoraPool(LoraPool):
    """``LoraPool`` with INT4 weights (``kernels.sgmm_int4``): A grouped along its input, B along
    its output, ``group_size`` elements per bf16 scale. A load writes the slot's matrices into a
    full-precision staging copy of one slot (``slot_view``); ``set_slot`` quantises it into the
    packed storage, and ``slot_sum`` verifies the copy against the staging, then drops it.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 group_size: int = DEFAULT_GROUP_SIZE, groups: frozenset[str] | None = None) -> None:  # fmt: skip
        # No full-precision pool: only the shapes of LoraPool, with no storage behind them.
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.groups = _checked_groups(groups)
        self.group_size = group_size
        self._cfg = cfg
        L = cfg.num_layers
        self.qa: dict[str, Int4Weight] = {}
        self.qb: dict[str, tuple[Int4Weight, ...]] = {}
        self.ranks = {}
        self.a, self.b = {}, {}
        self.dora = {}  # DoRA is not served from an INT4 pool (EngineConfig refuses it)
        self.base_weight = None
        self.vocab, self.vocab_ranks = {}, {}  # nor vocabulary LoRA (make_lora_pool refuses it)
        self.base_vocab = None
        self.saved = None  # nor trained module copies (make_lora_pool refuses them)
        self.extra = None  # nor extra vocabulary rows (make_lora_pool refuses them)
        self._cfg_vocab = cfg.vocab_size
        for g, mods in _pool_groups(self.groups):
            fan_in = cfg.module_shape(mods[0])[0]
            self.qa[g] = _empty_int4(
                (L, len(mods), num_slots, max_rank, fan_in), group_size, -1, device
            )
            self.qb[g] = tuple(
                _empty_int4(
                    (L, num_slots, cfg.module_shape(m)[1], max_rank), group_size, -2, device
                )
                for m in mods
            )
            self.ranks[g] = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.num_layers = L
        self._init_routes(num_slots, list(self.qa), device)
        self._layers = {
            g: [(self.qa[g][li], tuple(b[li] for b in self.qb[g])) for li in range(L)]
            for g in self.qa
        }
        # slot -> (A staging per group [L, n, R, in], B staging per group and slice [L, N_i, R])
        self._staging: dict[
            int, tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, ...]]]
        ] = {}

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.qa.values()) + sum(
            q.nbytes for qs in self.qb.values() for q in qs
        )

    def int4_layer_args(
        self, g: str, layer: int
    ) -> tuple[Int4Weight, tuple[Int4Weight, ...], torch.Tensor]:
        qa, qb = self._layers[g][layer]
        return qa, qb, self.ranks[g]

    def layer_args(
        self, g: str, layer: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        raise TypeError("an Int4LoraPool has no full-precision layer weights; use int4_layer_args")

    def clear(self, slot: int) -> None:
        super().clear(slot)
        self._staging.pop(slot, None)

    def zero_slot(self, slot: int, written: Mapping[str, int] | None = None) -> None:
        # A fresh zeroed staging copy: nothing to skip.
        L, dev, dt = self._cfg.num_layers, self.device, self.dtype
        a: dict[str, torch.Tensor] = {}
        b: dict[str, tuple[torch.Tensor, ...]] = {}
        for g, mods in _pool_groups(self.groups):
            fan_in = self._cfg.module_shape(mods[0])[0]
            a[g] = torch.zeros((L, len(mods), self.max_rank, fan_in), dtype=dt, device=dev)
            b[g] = tuple(
                torch.zeros((L, self._cfg.module_shape(m)[1], self.max_rank), dtype=dt, device=dev)
                for m in mods
            )
        self._staging[slot] = (a, b)

    def slot_view(
        self, group: str, index: int, layer: int, slot: int, rank: int, is_b: bool
    ) -> torch.Tensor:
        a, b = self._staging[slot]
        if is_b:
            return b[group][index][layer, :, :rank]
        return a[group][layer, index, :rank]

    def set_slot(self, slot: int, rank: int, scale: float, groups: frozenset[str]) -> None:
        staged = self._staging.get(slot)
        if staged is not None:
            a, b = staged
            for g in self.qa:
                _store_int4(self.qa[g], slot, 2, quantize_int4(a[g], self.group_size, group_dim=-1))
                for dst, w in zip(self.qb[g], b[g], strict=True):
                    _store_int4(dst, slot, 1, quantize_int4(w, self.group_size, group_dim=-2))
        super().set_slot(slot, rank, scale, groups)

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of the slot's staged (full-precision) weights; the staging is dropped."""
        staged = self._staging.pop(slot, None)
        if staged is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        a, b = staged
        parts = [t.sum(dtype=torch.float64) for t in a.values()]
        parts += [t.sum(dtype=torch.float64) for ts in b.values() for t in ts]
        return torch.stack(parts).sum()


def _empty_int4(
    shape: tuple[int, ...], group_size: int, group_dim: int, device: torch.device
) -> Int4Weight:
    packed = torch.zeros(int4_weight.packed_shape(shape), dtype=torch.uint8, device=device)
    scales = torch.zeros(
        int4_weight.scales_shape(shape, group_size, group_dim),
        dtype=int4_weight.SCALE_DTYPE,
        device=device,
    )
    return Int4Weight(packed, scales, shape[-1], group_size, group_dim)


def _store_int4(dst: Int4Weight, slot: int, slot_dim: int, src: Int4Weight) -> None:
    """Write one slot's quantised weights (``src`` lacks the slot dim) into the pool's storage."""
    dst.packed.select(slot_dim, slot).copy_(src.packed)
    dst.scales.select(slot_dim, slot).copy_(src.scales)


LORA_DTYPES = ("bf16", "fp16", "fp32", "int4")


def make_lora_pool(
    cfg: ModelConfig,
    num_slots: int,
    max_rank: int,
    device: torch.device,
    dtype: torch.dtype,
    lora_dtype: str | None = None,
    groups: frozenset[str] | None = None,
    dora: bool = False,
    vocab: bool = False,
    saved: frozenset[str] = frozenset(),
    arena_bytes: int | None = None,
    extra_vocab: int = 0,
) -> LoraPool:
    """The pool for ``lora_dtype`` (None: the model dtype; "int4": an ``Int4LoraPool``) over
    ``groups`` (None: every group; ``pool_groups`` turns target modules into groups), with
    DoRA factors when ``dora``, vocabulary LoRA when ``vocab``, trained module copies of the
    ``saved`` kinds and ``extra_vocab`` extra vocabulary rows a slot (float pools only). With
    ``arena_bytes`` a float pool is an ``ArenaLoraPool`` of that many bytes (``num_slots`` is
    then unused); a pool of trained module copies or extra vocabulary rows keeps slots (tables
    per slot).

    Float pools must match the model dtype (the kernels take A and B in the activation dtype).
    """
    if lora_dtype == "int4" and arena_bytes is not None:
        raise ValueError("lora_dtype int4 keeps a pool of slots: it has no adapter arena")
    if saved and arena_bytes is not None:
        raise ValueError("lora_saved_modules keeps a pool of slots: it has no adapter arena")
    if extra_vocab and arena_bytes is not None:
        raise ValueError("lora_extra_vocab keeps a pool of slots: it has no adapter arena")
    if lora_dtype is None and arena_bytes is not None:
        return ArenaLoraPool(cfg, arena_bytes, max_rank, device, dtype, groups, dora, vocab)
    if lora_dtype is None:
        return LoraPool(
            cfg, num_slots, max_rank, device, dtype, groups, dora=dora, vocab=vocab, saved=saved,
            extra_vocab=extra_vocab,
        )  # fmt: skip
    if lora_dtype == "int4":
        if dora:
            raise ValueError("lora_dora is not implemented with lora_dtype int4")
        if vocab:
            raise ValueError("lora_vocab is not implemented with lora_dtype int4")
        if saved:
            raise ValueError("lora_saved_modules is not implemented with lora_dtype int4")
        if extra_vocab:
            raise ValueError("lora_extra_vocab is not implemented with lora_dtype int4")
        return Int4LoraPool(cfg, num_slots, max_rank, device, dtype, groups=groups)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(lora_dtype)
    if want is None:
        raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {lora_dtype!r}")
    if want != dtype:
        raise ValueError(f"lora_dtype {lora_dtype} needs the model dtype to match, it is {dtype}")
    if arena_bytes is not None:
        return ArenaLoraPool(cfg, arena_bytes, max_rank, device, dtype, groups, dora, vocab)
    return LoraPool(
        cfg, num_slots, max_rank, device, dtype, groups, dora=dora, vocab=vocab, saved=saved,
        extra_vocab=extra_vocab,
    )  # fmt: skip


def _checked_groups(groups: frozenset[str] | None) -> frozenset[str]:
    if groups is None:
        return frozenset(GROUPS)
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown or not groups:
        raise ValueError(
            f"pool groups must be a non-empty subset of {', '.join(GROUPS)}, got {sorted(groups)}"
        )
    return frozenset(groups)


def _pool_groups(groups: frozenset[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The pool's groups with their modules, in GROUPS order."""
    return [(g, mods) for g, mods in GROUPS.items() if g in groups]


# A layer's weight and bias names per LoRA group.
_WEIGHTS = {
    "qkv": ("wqkv", "bqkv"),
    "o": ("wo", "bo"),
    "gate_up": ("wgu", "bgu"),
    "down": ("wd", "bd"),
}


def _pack_projections(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    stored: Mapping[str, QuantWeight],
    device: torch.device,
    fp8_activations: bool,
) -> dict[tuple[int, str], QuantLinear]:
    """The projections a device kernel serves packed, keyed (layer, group), moved to
    ``device``; each one's modules get meta tensors of their shape in ``weights`` (no bytes).
    A projection with an unquantised module, or parts ``pack_linear`` cannot fuse, stays
    dense."""
    groups = {
        "qkv": ["self_attn.qkv_proj"]
        if cfg.fused_checkpoint
        else [f"self_attn.{m}" for m in GROUPS["qkv"]],
        "o": ["self_attn.o_proj"],
        "gate_up": ["mlp.gate_up_proj"]
        if cfg.fused_checkpoint
        else [f"mlp.{m}" for m in GROUPS["gate_up"]],
        "down": ["mlp.down_proj"],
    }
    out: dict[tuple[int, str], QuantLinear] = {}
    for i in range(cfg.num_layers):
        for g, mods in groups.items():
            names = [f"model.layers.{i}.{m}" for m in mods]
            parts = [stored.get(n) for n in names]
            if any(p is None for p in parts):
                continue
            lin = pack_linear([p for p in parts if p is not None], fp8_activations)
            if lin is None:
                continue
            out[(i, g)] = lin.to(device)
            for n, p in zip(names, parts, strict=True):
                assert p is not None
                shape = (
                    p.data.shape if isinstance(p, Fp8Weight) else (p.out_features, p.in_features)
                )
                weights[n + ".weight"] = torch.empty(shape, dtype=torch.float32, device="meta")
    return out


def _apply_lora(
    pool: LoraPool,
    meta: lora_ops.LoraBatchMeta,
    group: str,
    layer: int,
    out: torch.Tensor,
    x: torch.Tensor,
) -> None:
    gm = meta.group(group)
    if isinstance(pool, Int4LoraPool):
        qa, qb, r = pool.int4_layer_args(group, layer)
        lora_ops.add_lora_int4(out, x, qa, qb, pool.group_scales(group), r, gm)
        return
    a, b, r = pool.layer_args(group, layer)
    lora_ops.add_lora(out, x, a, b, pool.group_scales(group), r, gm)


class TransformerModel:
    """The base weights, fused per layer, plus the forward pass over a flat batch."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_len: int,
        quant_kernels: bool = False,
        fp8_activations: bool = False,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        # A CUDA stream for the LoRA shrinks beside the base matmuls (the engine sets it when
        # EngineConfig.lora_overlap is on); None: the shrink and expand run after the matmul.
        self.lora_side: torch.cuda.Stream | None = None
        # Steps of at most this many tokens take the side stream; larger ones keep the LoRA
        # terms after each matmul (their matmuls fill the GPU, and the H200 HTTP mix, whose
        # steps carry up to 2,048 tokens, served 11% less with the side path on every step).
        self.lora_side_max_tokens = 64
        # Tensor parallelism (``tp_group``): this model holds one rank's shard
        # (``tp_shard``), and the forward pass reduces after o and down and gathers the logits.
        self.tp: ParallelComm | None = None
        # A quantised checkpoint's linear weights as stored (fp8 + scales, or 4-bit words,
        # zero points and scales; on the host, where the file put them). The forward pass
        # multiplies by their dequantised copies, rounded once to ``dtype``, except where
        # ``quant_kernels`` packs a projection: ``packed[(layer, group)]`` then holds it on
        # the device for kernels/quant_linear.py, and no dense copy is made.
        self.quantized: dict[str, QuantWeight] = {}
        self.packed: dict[tuple[int, str], QuantLinear] = {}
        if cfg.quant is not None:
            weights, self.quantized = dequantize_checkpoint(
                cfg.quant, weights, dtype, dense=not quant_kernels
            )
            if quant_kernels:
                self.packed = _pack_projections(
                    cfg, weights, self.quantized, device, fp8_activations
                )
                for name, w in self.quantized.items():  # what stays dense
                    weights.setdefault(name + ".weight", w.dequantize(dtype))

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model weights: missing tensor {name}")
            t = weights.pop(name)
            if t.is_meta:  # held packed (``self.packed``): the shape only
                return torch.empty(t.shape, dtype=dtype, device="meta")
            return t.to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            if cfg.fused_checkpoint:
                wqkv, wgu = (
                    take(p + "self_attn.qkv_proj.weight"),
                    take(p + "mlp.gate_up_proj.weight"),
                )
            else:
                wqkv = torch.cat(
                    [take(p + f"self_attn.{m}.weight") for m in GROUPS["qkv"]]
                ).contiguous()
                wgu = torch.cat(
                    [take(p + f"mlp.{m}.weight") for m in GROUPS["gate_up"]]
                ).contiguous()
            layer = {
                "ln1": take(p + "input_layernorm.weight"),
                "wqkv": wqkv,
                "wo": take(p + "self_attn.o_proj.weight"),
                "wgu": wgu,
                "wd": take(p + "mlp.down_proj.weight"),
            }
            if cfg.sandwich_norm:
                # Gemma 2: post_attention_layernorm normalises the attention output; the MLP
                # input is pre_feedforward_layernorm's, and its output gets its own norm.
                layer["ln_attn_out"] = take(p + "post_attention_layernorm.weight")
                layer["ln2"] = take(p + "pre_feedforward_layernorm.weight")
                layer["ln_mlp_out"] = take(p + "post_feedforward_layernorm.weight")
            else:
                layer["ln2"] = take(p + "post_attention_layernorm.weight")
            if cfg.qkv_bias:
                layer["bqkv"] = torch.cat(
                    [take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")]
                ).contiguous()
            if cfg.qk_norm:
                layer["qn"] = take(p + "self_attn.q_norm.weight")
                layer["kn"] = take(p + "self_attn.k_norm.weight")
            if cfg.o_bias:
                layer["bo"] = take(p + "self_attn.o_proj.bias")
            if cfg.mlp_bias:
                layer["bgu"] = torch.cat(
                    [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]
                ).contiguous()
                layer["bd"] = take(p + "mlp.down_proj.bias")
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # transformers ties it to the embedding too
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight")
        # A tensor nothing consumed means the checkpoint uses a feature this runtime lacks.
        left = sorted(k for k in weights if not k.endswith(IGNORED_TENSOR_SUFFIXES))
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ValueError(
                f"model weights: tensor {left[0]}{more} is not used by any module of the {cfg.arch} runtime"
            )
        self.cos_sin = _cos_sin(cfg, max_len, device, dtype)
        self.cos_sin_local = self.cos_sin
        if cfg.local_rope is not None:
            theta, scaling = cfg.local_rope
            self.cos_sin_local = _cos_sin(
                dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling),
                max_len,
                device,
                dtype,
            )
        self.act = cfg.act
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.rotary_dim = cfg.rotary_dim or None
        # Gemma multiplies the embeddings by sqrt(hidden) cast to the model dtype.
        self.embed_scale = (
            None
            if cfg.embed_scale is None
            else torch.tensor(cfg.embed_scale, dtype=torch.float32).to(device=device, dtype=dtype)
        )

    def module_weight(self, layer: int, module: str) -> torch.Tensor:
        """The live [out, in] weight of one module: a row range of the fused weight, so it is
        contiguous and writing it (AdaFuse merges) changes what the forward pass uses."""
        lw = self.layers[layer]
        q, kv, inter = self.q_size, self.kv_size, self.cfg.intermediate_size
        views = {
            "q_proj": lambda: lw["wqkv"][:q],
            "k_proj": lambda: lw["wqkv"][q : q + kv],
            "v_proj": lambda: lw["wqkv"][q + kv :],
            "o_proj": lambda: lw["wo"],
            "gate_proj": lambda: lw["wgu"][:inter],
            "up_proj": lambda: lw["wgu"][inter:],
            "down_proj": lambda: lw["wd"],
        }
        if module not in views:
            raise ValueError(f"module: unknown module {module!r}")
        w = views[module]()
        if w.is_meta:
            method = self.cfg.quant.method if self.cfg.quant is not None else "quantised"
            raise ValueError(
                f"module: {module} of layer {layer} is held packed ({method} weights on the "
                "device), so it has no dense weight to read or merge into (AdaFuse merges and "
                "DoRA norms need EngineConfig.quant_kernels off)"
            )
        return w

    @property
    def nbytes(self) -> int:
        tensors = [
            self.embed,
            self.norm,
            self.lm_head,
            *(t for layer in self.layers for t in layer.values()),
        ]
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t.is_meta or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        if self.device.type == "cpu":  # the stored form shares the device's memory there
            total += sum(w.nbytes for w in self.quantized.values())
        total += sum(w.nbytes for w in self.packed.values())  # on the device
        return total

    @torch.inference_mode()
    def forward(
        self,
        inp: StepInputs,
        kv: PagedKVCache,
        pool: LoraPool | None,
        meta: lora_ops.LoraBatchMeta | None,
        gated: GatedTerms | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] (fp32), one row per sequence entry (``inp.logits_rows``).

        Per layer, outside LoRA: fused residual-add + RMSNorm, the fused q/k/v matmul, RoPE
        fused with the paged KV write, decode and/or prefill paged attention (reading K/V in
        place through the block tables), the o matmul, fused add + RMSNorm, the fused
        gate/up matmul, fused activation x up, the down matmul: 10 launches (biases ride in
        addmm, no extra launch; +2 for Qwen3's q/k norms; +1 when split-KV decode reduces partitions, +1 for a mixed step's second
        attention launch). ``pool``/``meta`` None: a base-only step with no LoRA launch.

        ``gated``: AdaFuse expert sets on an unmerged path; routed once here, from the first
        layer's input (a ``SoloGated`` brings its selection along), and applied in every
        targeted module.

        ``inp.saved``: trained module copies of the rows' adapters (``saved_modules``), each
        applied right after the base module it replaces, on its adapter's rows only.

        ``inp.extra``: rows of adapters with extra vocabulary rows (``extra_vocab``): their
        ids past the model's vocabulary embed from their slot's rows, and the logits are
        ``V + N`` wide, each row -inf past its own vocabulary.
        """
        cfg = self.cfg
        gn = cfg.gemma_norm
        sv = self._saved_rows(inp)
        ev = inp.extra.bind(inp.token_slots, inp.logits_rows) if inp.extra is not None else None
        if ev is None:
            h = self.embed.index_select(0, inp.input_ids)
        else:
            h = ev.embed(self.embed.index_select(0, ev.base_ids(inp.input_ids)), inp.input_ids)
        if sv is not None:
            h = sv.embed(h, inp.input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        lp = (pool, meta) if pool is not None and meta is not None and meta.any_lora else None
        if lp is not None and lp[0].vocab:
            h = self._embed_lora(h, inp.input_ids, *lp)
        if gated is not None:
            gated.route(h)
        # DoRA pools: each row's index in each group's factors, once per step (graph-captured).
        dora_rows = (
            {g: lp[1].group(g).token_slots.to(torch.int64) for g in lp[0].dora}
            if lp is not None and lp[0].dora
            else None
        )
        T = h.shape[0]
        attn = torch.empty((T, cfg.num_heads, cfg.head_dim), dtype=h.dtype, device=h.device)
        attn.zero_()  # rows no sequence owns stay finite (they feed the o matmul, then are dropped)
        residual = h
        d: torch.Tensor | None = None
        d_lora: torch.Tensor | None = None
        for li, layer in enumerate(self.layers):
            if d is None:
                x = dispatch.rms_norm(h, layer["ln1"], cfg.rms_eps, gemma=gn)
            else:
                x = dispatch.rms_norm(
                    d, layer["ln1"], cfg.rms_eps, residual=residual, gemma=gn, extra=d_lora
                )
            if sv is not None:  # the norm's input: the residual stream (h before layer 0)
                x = sv.norm("input_layernorm", li, x, residual, cfg.rms_eps, gn)
            qkv, _ = self._project(
                layer, "qkv", x, li, lp, dora_rows=dora_rows
            )  # its consumer (RoPE) takes no extra
            if gated is not None:
                gated.apply(li, "qkv", qkv, x)
            q = qkv[:, : self.q_size].view(T, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                T, cfg.num_kv_heads, cfg.head_dim
            )
            v = qkv[:, self.q_size + self.kv_size :].view(T, cfg.num_kv_heads, cfg.head_dim)
            if "qn" in layer:
                # Qwen3 normalises each head of the projections (LoRA included) before RoPE.
                q_in, k_in = q.reshape(-1, cfg.head_dim), k.reshape(-1, cfg.head_dim)
                qn = dispatch.rms_norm(q_in, layer["qn"], cfg.rms_eps, gemma=gn)
                kn = dispatch.rms_norm(k_in, layer["kn"], cfg.rms_eps, gemma=gn)
                if sv is not None:
                    qn = sv.norm("q_norm", li, qn, q_in, cfg.rms_eps, gn)
                    kn = sv.norm("k_norm", li, kn, k_in, cfg.rms_eps, gn)
                q, k = qn.view(q.shape), kn.view(k.shape)
            kc, vc = kv.k[li], kv.v[li]
            cos_sin = (
                self.cos_sin_local
                if cfg.local_rope_layers and cfg.local_rope_layers[li]
                else self.cos_sin
            )
            dispatch.rope_kv_write(
                q,
                k,
                v,
                inp.positions,
                cos_sin,
                kc,
                vc,
                inp.slot_mapping,
                rotary_dim=self.rotary_dim,
            )
            self._attention(attn, q, kc, vc, inp, cfg.window(li))
            a2 = attn.view(T, -1)
            # With the side stream, o's, gate_up's and down's LoRA terms come back apart and
            # join the next elementwise kernel (RMSNorm's residual add, the activation): no
            # LoRA launch waits for the matmul.
            tp = self.tp
            o, o_lora = self._project(
                layer, "o", a2, li, lp, "ln_attn_out" not in layer and tp is None, dora_rows
            )
            if gated is not None:
                gated.apply(li, "o", o, a2)
            if tp is not None:
                tp.all_reduce(o)  # partial sums of the rank's heads, LoRA delta included
            if "ln_attn_out" in layer:
                o_in = o
                o = dispatch.rms_norm(o, layer["ln_attn_out"], cfg.rms_eps, gemma=gn)
                if sv is not None:
                    o = sv.norm("post_attention_layernorm", li, o, o_in, cfg.rms_eps, gn)
            x = dispatch.rms_norm(
                o, layer["ln2"], cfg.rms_eps, residual=residual, gemma=gn, extra=o_lora
            )
            if sv is not None:
                ln2 = (
                    "pre_feedforward_layernorm" if cfg.sandwich_norm else "post_attention_layernorm"
                )
                x = sv.norm(ln2, li, x, residual, cfg.rms_eps, gn)
            gu, gu_lora = self._project(layer, "gate_up", x, li, lp, True, dora_rows)
            if gated is not None:
                gated.apply(li, "gate_up", gu, x)
            act = dispatch.act_mul(gu, act=self.act, extra=gu_lora)
            d, d_lora = self._project(
                layer, "down", act, li, lp, "ln_mlp_out" not in layer and tp is None, dora_rows
            )
            if gated is not None:
                gated.apply(li, "down", d, act)
            if tp is not None:
                tp.all_reduce(d)
            if "ln_mlp_out" in layer:
                d_in = d
                d = dispatch.rms_norm(d, layer["ln_mlp_out"], cfg.rms_eps, gemma=gn)
                if sv is not None:
                    d = sv.norm("post_feedforward_layernorm", li, d, d_in, cfg.rms_eps, gn)
        assert d is not None
        rows_d = d.index_select(0, inp.logits_rows)
        rows_r = residual.index_select(0, inp.logits_rows)
        rows_e = None if d_lora is None else d_lora.index_select(0, inp.logits_rows)
        hn = dispatch.rms_norm(
            rows_d, self.norm, cfg.rms_eps, residual=rows_r, gemma=gn, extra=rows_e
        )
        if sv is not None:
            hn = sv.norm("norm", -1, hn, rows_r, cfg.rms_eps, gn)
        logits = hn @ self.lm_head.T
        if ev is not None:
            logits = ev.widen(logits, hn)
        if sv is not None:
            logits = sv.head(logits, hn)
        if lp is not None and lp[0].vocab:
            self._head_lora(logits, hn, inp.logits_rows, *lp)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        logits = logits.float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        if ev is not None:
            logits = ev.mask(logits)
        return logits

    def _saved_rows(self, inp: StepInputs) -> SavedRows | None:
        if inp.saved is None:
            return None
        heads = {"q_norm": self.cfg.num_heads, "k_norm": self.cfg.num_kv_heads}
        return inp.saved.bind(inp.token_slots, inp.logits_rows, heads)

    def _embed_lora(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        pool: LoraPool,
        meta: lora_ops.LoraBatchMeta,
    ) -> torch.Tensor:
        """``h`` plus each adapter row's embedding LoRA, as PEFT's ``lora.Embedding``:
        ``scale * B A[:, id]`` (times the embedding scale where the model scales its
        embeddings, as PEFT does for Gemma's scaled embeddings). ``A[:, id]`` is a gather,
        the ``B`` product the SGMM expand over the batch's segments; no host sync."""
        gm = meta.group("embed")
        embed_a, embed_b, scales, ranks = pool.vocab_args("embed")
        slots = gm.token_slots.clamp(min=0).to(torch.int64)
        after_a = embed_a[slots, :, input_ids].float().unsqueeze(0)  # [1, T, R]
        delta = torch.zeros_like(h)
        dispatch.sgmm_expand(
            delta, after_a, (embed_b,), scales, ranks, gm.segments(), check_values=False
        )
        if self.embed_scale is not None:
            delta = delta * self.embed_scale
        return h + delta

    def _head_lora(
        self,
        logits: torch.Tensor,
        hn: torch.Tensor,
        logits_rows: torch.Tensor,
        pool: LoraPool,
        meta: lora_ops.LoraBatchMeta,
    ) -> None:
        """In place: each sequence row's ``lm_head`` LoRA, ``scale * B (A hn)`` (PEFT's
        ``lora.Linear`` on the head), through add_lora over the rows' own segments."""
        row_meta = lora_ops.build_meta(
            meta.token_slots.index_select(0, logits_rows),
            pool.num_slots,
            routes={"head": pool.routes["head"]} if meta.groups else None,
        ).group("head")
        head_a, head_b, scales, ranks = pool.vocab_args("head")
        lora_ops.add_lora(
            logits, hn, head_a, (head_b[:, : logits.shape[1]],), scales, ranks, row_meta
        )

    def _project(
        self,
        layer: dict[str, torch.Tensor],
        group: str,
        x: torch.Tensor,
        li: int,
        lp: tuple[LoraPool, lora_ops.LoraBatchMeta] | None,
        defer: bool = False,
        dora_rows: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One projection of a layer plus the batch's LoRA terms for it: ``(out, delta)``.

        With ``lora_side`` (CUDA, a bf16/fp16 pool, a step of at most ``lora_side_max_tokens``
        tokens) the LoRA work runs on that stream beside the matmul, and with ``defer`` (the
        output's consumer takes an ``extra=`` term) the whole term comes back apart as
        ``delta``. Otherwise shrink and expand follow the matmul and ``delta`` is None.

        ``dora_rows`` (a DoRA pool's rows per group): both then get each row's DoRA factor."""
        wname, bname = _WEIGHTS[group]
        bias = layer.get(bname)
        if lp is not None and group not in lp[0].groups:
            lp = None  # the pool holds no adapter on this group
        rows = dora_rows[group] if dora_rows is not None and lp is not None else None
        packed = self.packed.get((li, group)) if self.packed else None
        if packed is not None:
            # The base GEMM on the packed weight; the LoRA terms (bf16, the same input) beside
            # it on the side stream where the dense path puts them there, else after it.
            if (
                lp is not None
                and self.lora_side is not None
                and x.shape[0] <= self.lora_side_max_tokens
                and not isinstance(lp[0], Int4LoraPool)
            ):
                pool, meta = lp
                a, b, r = pool.layer_args(group, li)
                out, delta = lora_ops.project_with_lora(
                    x,
                    layer[wname],
                    bias,
                    a,
                    b,
                    pool.group_scales(group),
                    r,
                    meta.group(group),
                    self.lora_side,
                    defer=defer,
                    matmul=lambda xx, o: quant_linear(xx, packed, out=o),
                )
                if rows is not None:
                    lora_ops.apply_dora(out, delta, bias, pool.dora_factors(group, li), rows)
                return out, delta
            out = quant_linear(x, packed)
            if bias is not None:
                out += bias
            if lp is not None:
                _apply_lora(*lp, group, li, out, x)
                if rows is not None:
                    lora_ops.apply_dora(out, None, bias, lp[0].dora_factors(group, li), rows)
            return out, None
        side = self.lora_side
        cols = (
            self.tp.row_lora_columns(layer[wname].shape[0])
            if lp is not None and self.tp is not None and group in ("o", "down")
            else None
        )
        if (
            lp is not None
            and cols is None
            and side is not None
            and x.shape[0] <= self.lora_side_max_tokens
            and not isinstance(lp[0], Int4LoraPool)
        ):
            pool, meta = lp
            a, b, r = pool.layer_args(group, li)
            out, delta = lora_ops.project_with_lora(
                x,
                layer[wname],
                bias,
                a,
                b,
                pool.group_scales(group),
                r,
                meta.group(group),
                side,
                defer=defer,
            )
            if rows is not None:
                lora_ops.apply_dora(out, delta, bias, pool.dora_factors(group, li), rows)
            return out, delta
        out = torch.addmm(bias, x, layer[wname].T) if bias is not None else x @ layer[wname].T
        if lp is not None:
            if cols is None:
                _apply_lora(*lp, group, li, out, x)
            else:
                self._sharded_row_lora(lp, group, li, out, x, cols)
            if rows is not None:
                lora_ops.apply_dora(out, None, bias, lp[0].dora_factors(group, li), rows)
        return out, None

    def _sharded_row_lora(
        self,
        lp: tuple[LoraPool, lora_ops.LoraBatchMeta],
        group: str,
        li: int,
        out: torch.Tensor,
        x: torch.Tensor,
        cols: tuple[int, int],
    ) -> None:
        """A row-parallel module's LoRA term with A and B both sharded: the shrink of this
        rank's input rows, an all-reduce of the rank-sized result, then the expand of this
        rank's B share into its output columns (the base all-reduce sums the columns)."""
        assert self.tp is not None
        pool, meta = lp
        a, b, r = pool.layer_args(group, li)
        lora_ops.add_lora_sharded_rows(
            out, x, a, b, pool.group_scales(group), r, meta.group(group), cols, self.tp.all_reduce
        )

    def _attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        inp: StepInputs,
        window: int | None,
    ) -> None:
        """Decode region with the split-KV decode kernel, prefill region with the tiled one;
        ``window``: this layer's sliding window (None: full attention)."""
        nd = inp.num_decode
        S = int(inp.seq_lens.shape[0])
        if nd > 0:
            dispatch.paged_attention(
                out,
                q,
                kc,
                vc,
                inp.block_tables[:nd],
                inp.seq_lens[:nd],
                inp.query_start[: nd + 1],
                scale=self.scale,
                max_query_len=1,
                sliding_window=window,
                num_splits=inp.num_splits,
                softcap=self.cfg.attn_softcap,
            )
        if nd < S and inp.max_prefill_len > 0:
            dispatch.paged_attention(
                out,
                q,
                kc,
                vc,
                inp.block_tables[nd:],
                inp.seq_lens[nd:],
                inp.query_start[nd:],
                scale=self.scale,
                max_query_len=inp.max_prefill_len,
                sliding_window=window,
                softcap=self.cfg.attn_softcap,
            )


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir: {model_dir} has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = fh.get_tensor(k)
    return out


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, max_len: int
) -> TransformerModel:
    cfg = ModelConfig.from_dir(model_dir)
    return TransformerModel(cfg, read_weights(model_dir), device, dtype, max_len)
