"""How a model and its adapters split over the ranks of a tensor-parallel group.

Pure functions of (config, tensors, rank, world size); no communication (``tp_group`` runs the
ranks). The layout, Megatron style:

* q/k/v and gate/up are column-parallel: rank r holds heads ``[r*h/N, (r+1)*h/N)`` of q, the
  same share of the KV heads for k and v, and columns ``[r*I/N, (r+1)*I/N)`` of gate and up.
  Attention runs on the rank's own heads, so the paged KV cache holds ``num_kv_heads / N``
  heads per rank.
* o and down are row-parallel: rank r holds the matching input rows; each rank's output is a
  partial sum, and one all-reduce after each gives the full activation. Their biases live on
  rank 0 only (the others hold zeros), so the all-reduce adds each once.
* The LM head is vocabulary-parallel: rank r holds rows ``[r*V'/N, (r+1)*V'/N)`` of the head,
  with V' the vocabulary padded up to a multiple of N by zero rows; the logits are all-gathered
  and the padding dropped.
* The embedding is replicated (a lookup needs no communication; for a 70B-class model it is
  about 2 GB per rank in bf16).

LoRA follows the base split. On a column-parallel module A (the shrink) is replicated and B
(the expand) split by output rows like the base weight: no communication. On a row-parallel
module A is split by input columns like the base weight and B is replicated: each rank's
``scale * (x_r @ A_r.T) @ B.T`` is a partial sum of the full delta, so the expand adds into the
partial base output and the base all-reduce carries it (no extra communication): the
``base-reduce`` scheme. The ``sharded`` scheme (vLLM's ``fully_sharded_loras`` for these
modules) splits B of o and down by output rows too: the rank-sized shrink output is
all-reduced, and each rank expands only its share of the output columns (1/N of the expand's
work and of B's memory, for one more small all-reduce per module).
"""

from __future__ import annotations

import dataclasses

import torch

from adaptermesh.worker.lora_groups import GROUPS
from adaptermesh.worker.model import ModelConfig

__all__ = [
    "COLUMN_GROUPS",
    "ROW_GROUPS",
    "TP_LORA_SCHEMES",
    "check_divisible",
    "lora_a_shard",
    "lora_b_shard",
    "padded_vocab",
    "row_b_rows",
    "shard_config",
    "shard_weights",
]

COLUMN_GROUPS = frozenset({"qkv", "gate_up"})
ROW_GROUPS = frozenset({"o", "down"})
# How o's and down's LoRA split: B replicated ("base-reduce") or split by output rows too.
TP_LORA_SCHEMES = ("base-reduce", "sharded")


def check_divisible(cfg: ModelConfig, world: int, scheme: str = "base-reduce") -> None:
    """Raise ValueError naming the field when ``world`` does not split the model evenly."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {world}")
    if scheme not in TP_LORA_SCHEMES:
        raise ValueError(
            f"tp_lora_scheme: must be one of {', '.join(TP_LORA_SCHEMES)}, got {scheme!r}"
        )
    fields = [
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ]
    if scheme == "sharded":  # o's and down's B split by output rows
        fields.append(("hidden_size", cfg.hidden_size))
    for field, value in fields:
        if value % world:
            raise ValueError(
                f"tensor_parallel_size: {world} does not divide config.{field} ({value}); "
                f"use a size that divides it"
            )


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's view of the model: 1/world of the heads, KV heads and MLP columns.

    The vocabulary stays whole (the embedding is replicated); the LM head's split is
    ``padded_vocab``'s. ``tie_word_embeddings`` is off: each rank's head is its own slice."""
    check_divisible(cfg, world)
    if world == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
        tie_word_embeddings=False,
    )


def padded_vocab(vocab: int, world: int) -> int:
    return -(-vocab // world) * world


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=0)[rank]


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=-1)[rank]


def _split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for n in sizes:
        out.append(t[start : start + n])
        start += n
    return out


def shard_weights(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors under the Hugging Face names ``TransformerModel`` reads, for the
    config ``shard_config(cfg, world)``. ``weights`` is left as it was."""
    check_divisible(cfg, world)
    if cfg.quant is not None:
        raise ValueError(
            f"config.quantization_config: tensor parallelism over a quantised checkpoint "
            f"({cfg.quant.method}) is not implemented"
        )
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        parts = name.split(".")
        leaf = parts[-2] if len(parts) >= 2 else name
        kind = parts[-1]
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            out[name] = t  # the head is sliced below
        elif leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            out[name] = _rows(t, rank, world)
        elif leaf == "qkv_proj":  # a fused checkpoint (Phi-3): [q; k; v] rows
            pieces = _split_rows(t, [q, kv, kv])
            out[name] = torch.cat([_rows(p, rank, world) for p in pieces])
        elif leaf == "gate_up_proj":
            pieces = _split_rows(t, [inter, inter])
            out[name] = torch.cat([_rows(p, rank, world) for p in pieces])
        elif leaf in ("o_proj", "down_proj"):
            if kind == "bias":
                out[name] = t if rank == 0 else torch.zeros_like(t)
            else:
                out[name] = _cols(t, rank, world)
        else:
            out[name] = t  # norms: replicated
    head = weights.get("lm_head.weight")
    if cfg.tie_word_embeddings or head is None:
        head = weights["model.embed_tokens.weight"]
    pad = padded_vocab(head.shape[0], world) - head.shape[0]
    if pad:
        head = torch.cat([head, head.new_zeros((pad, head.shape[1]))])
    out["lm_head.weight"] = _rows(head, rank, world)
    return out


def lora_a_shard(group: str, a: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """One rank's share of A (``[..., R, in]``): whole on column-parallel groups, the input
    columns of the rank on row-parallel ones."""
    if group not in GROUPS:
        raise ValueError(f"group: unknown LoRA group {group!r}")
    return a if group in COLUMN_GROUPS else _cols(a, rank, world)


def lora_b_shard(
    group: str, b: torch.Tensor, rank: int, world: int, scheme: str = "base-reduce"
) -> torch.Tensor:
    """One rank's share of B (``[..., N, R]``): the output rows of the rank on column-parallel
    groups (per slice: q, k and v each split by heads); on row-parallel ones whole
    (``base-reduce``) or the rank's output rows (``sharded``)."""
    if group not in GROUPS:
        raise ValueError(f"group: unknown LoRA group {group!r}")
    if group in COLUMN_GROUPS or scheme == "sharded":
        return b.chunk(world, dim=-2)[rank]
    return b


def row_b_rows(cfg: ModelConfig, world: int, scheme: str) -> dict[str, int] | None:
    """B's output rows per module of a rank's pool where they are not the module's own
    (``LoraPool(out_features=...)``): o's and down's share under ``sharded``."""
    if scheme != "sharded" or world == 1:
        return None
    return {"o_proj": cfg.hidden_size // world, "down_proj": cfg.hidden_size // world}
