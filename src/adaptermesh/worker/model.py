"""Llama-family model runtime (Llama, Mistral, Qwen2) with multi-LoRA linear layers.

One forward pass runs a flat batch of T tokens that may mix two kinds of rows:

* a **decode block**: one row per KV-cache slot (row i reads and writes cache row i), present
  whenever any sequence is decoding. Idle rows point at the scratch cache row and slot -1.
* **prefill segments**: chunks of prompts, each attending causally to its own cache row.

Every targeted linear module adds its LoRA delta through ``lora_ops.add_lora`` over the whole
flat batch, so requests for different adapters (and the base model, slot -1) share each launch.
q/k/v form one group of 3 slices and gate/up one group of 2 slices, matching the fused base
weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from adaptermesh.worker import lora_ops
from adaptermesh.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from adaptermesh.worker.adafuse import GatedTerms

__all__ = [
    "GROUPS",
    "MODULE_TO_GROUP",
    "SUPPORTED_MODULES",
    "BatchInputs",
    "LoraPool",
    "ModelConfig",
    "PrefillSegment",
    "TransformerModel",
    "load_model",
]

# Group name -> module names in slice order. Must stay in sync with the fused weight layout in
# TransformerModel (wqkv = [q; k; v], w_gate_up = [gate; up]).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_TO_GROUP: dict[str, tuple[str, int]] = {
    m: (g, i) for g, ms in GROUPS.items() for i, m in enumerate(ms)
}
SUPPORTED_MODULES: tuple[str, ...] = tuple(MODULE_TO_GROUP)
_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


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
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = str(d.get("model_type", ""))
        if model_type not in _ARCHS:
            raise ValueError(f"config.model_type: unsupported architecture {model_type!r} (llama, mistral, qwen2)")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        # transformers 5 nests RoPE settings in rope_parameters; 4.x uses rope_theta + rope_scaling.
        rope_params = d.get("rope_parameters")
        scaling: dict[str, Any] | None
        if isinstance(rope_params, dict):
            theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        else:
            theta = float(d.get("rope_theta", 10000.0))
            scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qkv_bias = model_type == "qwen2" or bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            arch=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            eos_token_ids=eos_ids,
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model_dir: {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a targetable linear module."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


def rope_inv_freq(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) and the attention scaling factor for cos/sin."""
    dim = cfg.head_dim
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
        orig_y = float(sc.get("original_max_position_embeddings", cfg.max_position_embeddings))
        beta_fast = float(sc.get("beta_fast", 32.0))
        beta_slow = float(sc.get("beta_slow", 1.0))
        attn_factor = sc.get("attention_factor")
        mscale = float(attn_factor) if attn_factor is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig_y / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if lo == hi:
            hi += 1  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        interp = inv / factor
        return interp * (1 - extrapolation) + inv * extrapolation, mscale
    raise ValueError(f"config.rope_scaling.rope_type: unsupported {kind!r} (linear, dynamic, llama3, yarn)")


@dataclass(slots=True)
class PrefillSegment:
    """A chunk of one prompt in the flat batch."""

    slot: int  # KV cache row
    start_pos: int  # position of the chunk's first token
    num_tokens: int
    offset: int  # index of the chunk's first token in the flat batch


@dataclass(slots=True)
class BatchInputs:
    """Device tensors and host facts for one forward pass. Decode rows (if any) come first."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64, KV row each token is written to
    token_slots: torch.Tensor  # [T] int32, LoRA pool slot, -1 = base
    decode_rows: int  # 0 or the number of KV slots (the decode block covers every slot)
    decode_lengths: torch.Tensor | None  # [decode_rows] int64, context length after this step
    decode_len_bucket: int  # keys read per decode row (>= every decode length)
    prefill: list[PrefillSegment] = field(default_factory=list)
    logits_rows: torch.Tensor | None = None  # [R] rows whose logits are wanted; None = all
    # All T rows are the first chunk (from position 0) of ONE prompt, possibly followed by
    # padding rows: attention then needs no cache read and no per-segment host facts, so the
    # step can be captured in a CUDA graph. ``prefill`` is ignored.
    self_prefill: bool = False


class LoraPool:
    """GPU-resident LoRA weights for ``num_slots`` adapters, in the kernels' pool layout.

    Per group g (see GROUPS): ``a[g]`` is [L, n_slices, S, R_max, in] and ``b[g][i]`` is
    [L, S, N_i, R_max], so layer l's view ``a[g][l]`` is exactly the [n_slices, S, R_max, H]
    tensor ``add_lora`` takes, and one slot of every layer is written with one copy.
    ``ranks[g]`` is the adapter's rank where it targets any module of g, else 0.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        L = cfg.num_layers
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, tuple[torch.Tensor, ...]] = {}
        self.ranks: dict[str, torch.Tensor] = {}
        for g, mods in GROUPS.items():
            fan_in = cfg.module_shape(mods[0])[0]
            self.a[g] = torch.zeros((L, len(mods), num_slots, max_rank, fan_in), dtype=dtype, device=device)
            self.b[g] = tuple(
                torch.zeros((L, num_slots, cfg.module_shape(m)[1], max_rank), dtype=dtype, device=device) for m in mods
            )
            self.ranks[g] = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.a.values())
        total += sum(t.numel() * t.element_size() for bs in self.b.values() for t in bs)
        return total

    def layer_args(self, g: str, layer: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        return self.a[g][layer], tuple(b[layer] for b in self.b[g]), self.ranks[g]

    def clear(self, slot: int) -> None:
        self.scales[slot] = 0.0
        for g in GROUPS:
            self.ranks[g][slot] = 0

    def zero_slot(self, slot: int) -> None:
        # Ranks above an adapter's own and layers it does not target must read as zeros.
        for g in GROUPS:
            self.a[g][:, :, slot].zero_()
            for b in self.b[g]:
                b[:, slot].zero_()

    def slot_view(self, group: str, index: int, layer: int, slot: int, rank: int, is_b: bool) -> torch.Tensor:
        """Where one adapter matrix goes: A [rank, in] or B [out, rank] of (layer, slice)."""
        if is_b:
            return self.b[group][index][layer, slot, :, :rank]
        return self.a[group][layer, index, slot, :rank]

    def set_slot(self, slot: int, rank: int, scale: float, groups: frozenset[str]) -> None:
        """Publish the slot's ranks (0 for untargeted groups) and scale to the kernels."""
        for g in GROUPS:
            self.ranks[g][slot] = rank if g in groups else 0
        self.scales[slot] = scale

    def slot_sum(self, slot: int) -> torch.Tensor:
        """float64 sum of everything in ``slot`` (a device scalar; no host sync)."""
        parts = [self.a[g][:, :, slot].sum(dtype=torch.float64) for g in GROUPS]
        parts += [b[:, slot].sum(dtype=torch.float64) for g in GROUPS for b in self.b[g]]
        return torch.stack(parts).sum()


def _apply_lora(pool: LoraPool, meta: lora_ops.LoraBatchMeta, group: str, layer: int, out: torch.Tensor, x: torch.Tensor) -> None:
    a, b, r = pool.layer_args(group, layer)
    lora_ops.add_lora(out, x, a, b, pool.scales, r, meta)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm, for bit-close outputs.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D]. rotate_half convention (Hugging Face checkpoints).
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


@dataclass(slots=True)
class _AttnMasks:
    """A batch's attention masks, the same in every layer: True = masked out for decode rows
    ([n, 1, 1, len bucket]), True = allowed for each prefill segment ([t, end])."""

    decode: torch.Tensor | None
    prefill: list[torch.Tensor]


class TransformerModel:
    """The base weights, fused per layer, plus the forward pass over a flat batch."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, max_len: int) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model weights: missing tensor {name}")
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "ln1": take(p + "input_layernorm.weight"),
                "ln2": take(p + "post_attention_layernorm.weight"),
                "wqkv": torch.cat(
                    [take(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]
                ).contiguous(),
                "wo": take(p + "self_attn.o_proj.weight"),
                "wgu": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]).contiguous(),
                "wd": take(p + "mlp.down_proj.weight"),
            }
            if cfg.qkv_bias:
                layer["bqkv"] = torch.cat(
                    [take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")]
                ).contiguous()
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight")
        inv, mscale = rope_inv_freq(cfg, max_len)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * mscale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * mscale).to(device=device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5

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
        return views[module]()

    @property
    def nbytes(self) -> int:
        tensors = [self.embed, self.norm, self.lm_head, *(t for layer in self.layers for t in layer.values())]
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(
        self,
        batch: BatchInputs,
        kv: KVCache,
        pool: LoraPool | None,
        meta: lora_ops.LoraBatchMeta | None,
        gated: GatedTerms | None = None,
    ) -> torch.Tensor:
        """Logits [R, vocab] (fp32) for ``batch.logits_rows`` (all rows if None).

        ``gated``: AdaFuse expert sets on an unmerged path; routed once here, from the first
        layer's input (a ``SoloGated`` brings its selection along), and applied in every
        targeted module.
        """
        cfg = self.cfg
        h = self.embed.index_select(0, batch.input_ids)
        if gated is not None:
            gated.route(h)
        cos = self.cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self.sin.index_select(0, batch.positions).unsqueeze(1)
        use_lora = pool is not None and meta is not None and meta.any_lora
        T = h.shape[0]
        # Attention masks depend on the batch only: built once here, shared by every layer.
        self_mask = self._self_mask(T, h.device) if batch.self_prefill else None
        masks = None if batch.self_prefill else self._attention_masks(batch, h.device)
        for li, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["ln1"], cfg.rms_eps)
            qkv = x @ layer["wqkv"].T
            if "bqkv" in layer:
                qkv = qkv + layer["bqkv"]
            if pool is not None and meta is not None and use_lora:
                _apply_lora(pool, meta, "qkv", li, qkv, x)
            if gated is not None:
                gated.apply(li, "qkv", qkv, x)
            q = qkv[:, : self.q_size].view(T, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(T, cfg.num_kv_heads, cfg.head_dim)
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
            kc, vc = kv.k[li], kv.v[li]
            kc.index_put_((batch.write_slots, batch.positions), k)
            vc.index_put_((batch.write_slots, batch.positions), v)
            attn = (
                self._self_attention(q, k, v, self_mask)
                if batch.self_prefill
                else self._attention(q, batch, kc, vc, masks)
            )
            o = attn @ layer["wo"].T
            if pool is not None and meta is not None and use_lora:
                _apply_lora(pool, meta, "o", li, o, attn)
            if gated is not None:
                gated.apply(li, "o", o, attn)
            h = h + o
            x = _rms_norm(h, layer["ln2"], cfg.rms_eps)
            gu = x @ layer["wgu"].T
            if pool is not None and meta is not None and use_lora:
                _apply_lora(pool, meta, "gate_up", li, gu, x)
            if gated is not None:
                gated.apply(li, "gate_up", gu, x)
            inter = cfg.intermediate_size
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            d = act @ layer["wd"].T
            if pool is not None and meta is not None and use_lora:
                _apply_lora(pool, meta, "down", li, d, act)
            if gated is not None:
                gated.apply(li, "down", d, act)
            h = h + d
        if batch.logits_rows is not None:
            h = h.index_select(0, batch.logits_rows)
        h = _rms_norm(h, self.norm, cfg.rms_eps)
        return (h @ self.lm_head.T).float()

    def _self_mask(self, T: int, device: torch.device) -> torch.Tensor | None:
        """The sliding-window causal mask of a self-prefill chunk of T rows; None when plain
        causal attention is exact."""
        w = self.cfg.sliding_window
        if w is None or w >= T:
            return None
        pos = torch.arange(T, device=device)
        return (pos.view(1, T) <= pos.view(T, 1)) & (pos.view(1, T) > pos.view(T, 1) - w)

    def _attention_masks(self, batch: BatchInputs, device: torch.device) -> _AttnMasks:
        """Decode and prefill masks of ``batch`` (see ``_attention``)."""
        cfg = self.cfg
        decode_mask = None
        n = batch.decode_rows
        if n:
            assert batch.decode_lengths is not None
            lb = batch.decode_len_bucket
            pos = torch.arange(lb, device=device)
            decode_mask = pos.view(1, 1, 1, lb) >= batch.decode_lengths.view(n, 1, 1, 1)
            if cfg.sliding_window is not None:
                decode_mask = decode_mask | (
                    pos.view(1, 1, 1, lb) < (batch.decode_lengths - cfg.sliding_window).view(n, 1, 1, 1)
                )
        prefill: list[torch.Tensor] = []
        for seg in batch.prefill:
            end = seg.start_pos + seg.num_tokens
            qpos = torch.arange(seg.start_pos, end, device=device).unsqueeze(1)
            kpos = torch.arange(end, device=device).unsqueeze(0)
            allowed = kpos <= qpos
            if cfg.sliding_window is not None:
                allowed = allowed & (kpos > qpos - cfg.sliding_window)
            prefill.append(allowed)
        return _AttnMasks(decode_mask, prefill)

    def _self_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of one prompt chunk that starts at position 0, over its own keys.
        Padding rows (if any) come last, so the causal mask keeps them out of real rows.
        ``mask`` is ``_self_mask(T)``, computed here when not given."""
        cfg = self.cfg
        T = q.shape[0]
        group = cfg.num_heads // cfg.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
        if mask is None:
            mask = self._self_mask(T, q.device)
        if mask is not None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        return o.transpose(0, 1).reshape(T, -1)

    def _attention(
        self, q: torch.Tensor, batch: BatchInputs, kc: torch.Tensor, vc: torch.Tensor, masks: _AttnMasks | None = None
    ) -> torch.Tensor:
        """``masks`` is ``_attention_masks(batch)``, computed here when not given."""
        cfg = self.cfg
        if masks is None:
            masks = self._attention_masks(batch, q.device)
        T = q.shape[0]
        group = cfg.num_heads // cfg.num_kv_heads
        out = torch.empty((T, cfg.num_heads * cfg.head_dim), dtype=q.dtype, device=q.device)
        n = batch.decode_rows
        if n:
            assert batch.decode_lengths is not None
            lb = batch.decode_len_bucket
            qd = q[:n].view(n, cfg.num_kv_heads, group, cfg.head_dim)
            keys = kc[:n, :lb]  # [n, lb, kvh, D], read in place: row i is cache row i
            vals = vc[:n, :lb]
            scores = torch.einsum("skgd,slkd->skgl", qd, keys).float() * self.scale
            assert masks.decode is not None
            scores = scores.masked_fill(masks.decode, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            od = torch.einsum("skgl,slkd->skgd", probs, vals)
            out[:n] = od.reshape(n, -1)
        for seg, allowed in zip(batch.prefill, masks.prefill, strict=True):
            qs = q[seg.offset : seg.offset + seg.num_tokens]  # [t, H, D]
            end = seg.start_pos + seg.num_tokens
            ks = kc[seg.slot, :end]  # [end, kvh, D]
            vs = vc[seg.slot, :end]
            if group > 1:
                ks = ks.repeat_interleave(group, dim=1)
                vs = vs.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed, scale=self.scale
            )  # [H, t, D]
            out[seg.offset : seg.offset + seg.num_tokens] = o.transpose(0, 1).reshape(seg.num_tokens, -1)
        return out


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


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, max_len: int) -> TransformerModel:
    cfg = ModelConfig.from_dir(model_dir)
    return TransformerModel(cfg, read_weights(model_dir), device, dtype, max_len)
