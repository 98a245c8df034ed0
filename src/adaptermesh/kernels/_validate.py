"""Argument checks shared by the Triton launchers and their torch twins: every op's checks
live here (SGMM, INT4 SGMM, the decoder-layer ops, paged attention), so both backends reject
the same inputs with the same messages. No triton import.

Every check runs before any launch and raises ``ValueError`` naming the argument. Checks that
read tensor values (slot and rank ranges) cost a host synchronisation on CUDA; they run when
``check_values`` is true and the stream is not being captured into a graph. The kernels clamp
ranks to ``R_max`` and treat out-of-range slots as base tokens (see ``meta.py``), so a skipped
value check can give wrong numbers for the offending tokens but never touches memory outside
the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from adaptermesh.kernels.int4_weight import SCALE_DTYPE, Int4Weight, scales_shape
from adaptermesh.kernels.meta import SegmentMeta

if TYPE_CHECKING:
    from adaptermesh.kernels.sgmm_config import SgmmConfig

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 3


@dataclass(frozen=True)
class SgmmShapes:
    num_tokens: int
    hidden: int
    n_slices: int
    num_slots: int
    r_max: int
    out_sizes: tuple[int, ...]
    out_offsets: tuple[int, ...]

    @property
    def out_total(self) -> int:
        return sum(self.out_sizes)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device} (the device of x)")


def _check_ranks(ranks: object, s: int, r_max: int, ref: torch.Tensor, check_values: bool) -> None:
    ranks = _tensor("ranks", ranks)
    if ranks.shape != (s,):
        raise ValueError(f"ranks must have shape [{s}], got {tuple(ranks.shape)}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32, got {ranks.dtype}")
    _same_device("ranks", ranks, ref)
    if check_values and not _capturing(ranks):
        lo, hi = int(ranks.min()), int(ranks.max())
        if lo < 0 or hi > r_max:
            raise ValueError(f"ranks must lie in [0, R_max={r_max}], got min {lo} max {hi}")


def check_shrink(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    ranks: torch.Tensor,  # [S] int32
    check_values: bool,
) -> SgmmShapes:
    x = _tensor("x", x)
    lora_a = _tensor("lora_a", lora_a)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    t, h = x.shape
    if lora_a.dim() != 4:
        raise ValueError(f"lora_a must be 4-D [n_slices, S, R_max, H], got {tuple(lora_a.shape)}")
    n_slices, s, r_max, ha = lora_a.shape
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"lora_a must have 1..{MAX_SLICES} slices, got {n_slices}")
    if ha != h:
        raise ValueError(f"lora_a hidden size {ha} does not match x hidden size {h}")
    if s < 1 or r_max < 1:
        raise ValueError(f"lora_a needs S >= 1 and R_max >= 1, got shape {tuple(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a dtype {lora_a.dtype} does not match x dtype {x.dtype}")
    _same_device("lora_a", lora_a, x)
    _check_ranks(ranks, s, r_max, x, check_values)
    return SgmmShapes(t, h, n_slices, s, r_max, (), ())


def check_expand(
    out: torch.Tensor,  # [T, sum N_i]
    v: torch.Tensor,  # [n_slices, T, R_max] fp32
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    check_values: bool,
) -> SgmmShapes:
    out = _tensor("out", out)
    v = _tensor("v", v)
    if out.dim() != 2:
        raise ValueError(f"out must be 2-D [T, sum N_i], got shape {tuple(out.shape)}")
    if out.dtype not in ACT_DTYPES:
        raise ValueError(f"out must be float16, bfloat16 or float32, got {out.dtype}")
    if isinstance(lora_b, torch.Tensor) or not isinstance(lora_b, Sequence) or not lora_b:
        raise ValueError("lora_b must be a tuple of tensors, one [S, N_i, R_max] per slice")
    n_slices = len(lora_b)
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"lora_b must have 1..{MAX_SLICES} slices, got {n_slices}")
    b0 = _tensor("lora_b[0]", lora_b[0])
    if b0.dim() != 3:
        raise ValueError(f"lora_b[0] must be 3-D [S, N, R_max], got {tuple(b0.shape)}")
    s, _, r_max = b0.shape
    sizes: list[int] = []
    for i, b in enumerate(lora_b):
        name = f"lora_b[{i}]"
        b = _tensor(name, b)
        if b.dim() != 3 or b.shape[0] != s or b.shape[2] != r_max or b.shape[1] < 1:
            raise ValueError(f"{name} must have shape [{s}, N, {r_max}], got {tuple(b.shape)}")
        if b.dtype != out.dtype:
            raise ValueError(f"{name} dtype {b.dtype} does not match out dtype {out.dtype}")
        _same_device(name, b, out)
        sizes.append(int(b.shape[1]))
    t = out.shape[0]
    if out.shape[1] != sum(sizes):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of lora_b need {sum(sizes)}")
    want = (n_slices, t, r_max)
    if tuple(v.shape) != want:
        raise ValueError(f"v must have shape {list(want)}, got {tuple(v.shape)}")
    if v.dtype != torch.float32:
        raise ValueError(f"v must be float32 (sgmm_shrink's output), got {v.dtype}")
    _same_device("v", v, out)
    scales = _tensor("scales", scales)
    if scales.shape != (s,):
        raise ValueError(f"scales must have shape [{s}], got {tuple(scales.shape)}")
    if scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {scales.dtype}")
    _same_device("scales", scales, out)
    _check_ranks(ranks, s, r_max, out, check_values)
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return SgmmShapes(t, 0, n_slices, s, r_max, tuple(sizes), tuple(offsets))


def check_meta(meta: SegmentMeta, shapes: SgmmShapes, ref: torch.Tensor) -> None:
    if not isinstance(meta, SegmentMeta):
        raise ValueError(f"meta must be a SegmentMeta, got {type(meta).__name__}")
    if meta.num_slots != shapes.num_slots:
        raise ValueError(
            f"meta was built for {meta.num_slots} slots, the pool has {shapes.num_slots}"
        )
    if meta.max_tokens != shapes.num_tokens:
        raise ValueError(
            f"meta was built for max_tokens={meta.max_tokens}, the activations have "
            f"{shapes.num_tokens} rows"
        )
    if meta.device != ref.device:
        raise ValueError(f"meta is on {meta.device}, the activations on {ref.device}")


def check_pair(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
) -> None:
    """Cross-checks that add_lora needs beyond the separate shrink and expand checks."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError("out must be a 2-D tensor [T, sum N_i]")
    if isinstance(lora_b, torch.Tensor) or not isinstance(lora_b, Sequence):
        raise ValueError("lora_b must be a tuple of tensors, one [S, N_i, R_max] per slice")
    if not all(isinstance(b, torch.Tensor) and b.dim() == 3 for b in lora_b):
        raise ValueError("lora_b must hold 3-D tensors [S, N_i, R_max]")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x has {x.shape[0]}")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} does not match x dtype {x.dtype}")
    if len(lora_b) != lora_a.shape[0]:
        raise ValueError(f"lora_b has {len(lora_b)} slices, lora_a has {lora_a.shape[0]}")
    for i, b in enumerate(lora_b):
        if b.shape[0] != lora_a.shape[1] or b.shape[2] != lora_a.shape[2]:
            raise ValueError(
                f"lora_b[{i}] shape {tuple(b.shape)} does not match lora_a's "
                f"S={lora_a.shape[1]} and R_max={lora_a.shape[2]}"
            )


def check_v_buffer(buf: object, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """A caller's scratch for the shrink's output v."""
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != shape:
        raise ValueError(f"v buffer must be a float32 tensor of shape {list(shape)}")
    if buf.dtype != torch.float32 or buf.device != device:
        raise ValueError(f"v buffer must be float32 on {device}")
    return buf


# ---------------------------------------------------------------------------------------------
# SGMM configs (sgmm_config.SgmmConfig)
# ---------------------------------------------------------------------------------------------
def check_config(cfg: SgmmConfig) -> None:
    for name in ("block_m", "block_n", "block_k"):
        val = getattr(cfg, name)
        # A matrix-vector program may hold a single token (block_m) and, in the shrink, a
        # single rank row or output column (block_n); tensor-core tiles need 16.
        least = 1 if cfg.gemv and name in ("block_m", "block_n") else 16
        if val < least or val & (val - 1):
            raise ValueError(f"config.{name} must be a power of two >= {least}, got {val}")
    if cfg.split_k < 1:
        raise ValueError(f"config.split_k must be >= 1, got {cfg.split_k}")
    if cfg.n_blocks < 1:
        raise ValueError(f"config.n_blocks must be >= 1, got {cfg.n_blocks}")
    if cfg.fused and (cfg.gemv or cfg.split_k != 1):
        raise ValueError("a fused config has no gemv or split_k variant")
    if cfg.hoist_v and (cfg.gemv or cfg.fused):
        raise ValueError("config.hoist_v is a tile-expand option (not gemv or fused)")


def check_gemv_rank(cfg: SgmmConfig, r_max: int) -> None:
    """A matrix-vector expand holds the whole rank in one tile."""
    if cfg.gemv and cfg.block_k < r_max:
        raise ValueError(f"a gemv expand needs config.block_k >= R_max={r_max}")


def check_hoist_rank(cfg: SgmmConfig, r_max: int) -> None:
    """A hoisted expand tile holds the whole rank in one tile."""
    if cfg.hoist_v and cfg.block_k < r_max:
        raise ValueError(f"config.hoist_v needs config.block_k >= R_max={r_max}")


def check_int4_config(cfg: SgmmConfig | None) -> None:
    if cfg is not None and cfg.fused:
        raise ValueError("the INT4 kernels have no fused variant: config.fused must be False")


# ---------------------------------------------------------------------------------------------
# INT4 SGMM (int4_weight.Int4Weight)
# ---------------------------------------------------------------------------------------------
def check_group(group_size: int, group_dim: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even int >= 2, got {group_size!r}")
    if group_dim not in (-1, -2):
        raise ValueError(f"group_dim must be -1 (along the last dim) or -2, got {group_dim!r}")


def check_int4_weight(name: str, q: object, dim: int, ref: torch.Tensor) -> Int4Weight:
    if not isinstance(q, Int4Weight):
        raise ValueError(f"{name} must be an Int4Weight (quantize_int4), got {type(q).__name__}")
    if q.packed.dtype != torch.uint8 or q.packed.dim() != dim:
        raise ValueError(f"{name}.packed must be a {dim}-D uint8 tensor, got {q.packed.dtype} "
                         f"{tuple(q.packed.shape)}")  # fmt: skip
    check_group(q.group_size, q.group_dim)
    if q.packed.shape[-1] != -(-q.size // 2):
        raise ValueError(f"{name}.packed has {q.packed.shape[-1]} bytes per row, size {q.size}")
    want = scales_shape(q.shape, q.group_size, q.group_dim)
    if tuple(q.scales.shape) != want or q.scales.dtype != SCALE_DTYPE:
        raise ValueError(f"{name}.scales must be bfloat16 of shape {list(want)}, got "
                         f"{q.scales.dtype} {tuple(q.scales.shape)}")  # fmt: skip
    for t in (q.packed, q.scales):
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")
    return q


def _check_int4_ranks(
    ranks: object, s: int, r_max: int, ref: torch.Tensor, check_values: bool
) -> None:
    if not isinstance(ranks, torch.Tensor) or ranks.shape != (s,) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be an int32 tensor of shape [{s}]")
    if ranks.device != ref.device:
        raise ValueError(f"ranks is on {ranks.device}, expected {ref.device}")
    capturing = ranks.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        lo, hi = int(ranks.min()), int(ranks.max())
        if lo < 0 or hi > r_max:
            raise ValueError(f"ranks must lie in [0, R_max={r_max}], got min {lo} max {hi}")


def check_int4(
    out: torch.Tensor,
    x: torch.Tensor,
    qa: Int4Weight,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    check_values: bool,
) -> SgmmShapes:
    """Every argument check of add_lora_int4, before any launch."""
    for name, t in (("x", x), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in ACT_DTYPES:
            raise ValueError(f"{name} must be a 2-D float16/bfloat16/float32 tensor")
    if out.dtype != x.dtype or out.shape[0] != x.shape[0] or out.device != x.device:
        raise ValueError("out must have x's dtype, device and row count")
    qa = check_int4_weight("qa", qa, 4, x)
    n_slices, s, r_max, h = qa.shape
    if h != x.shape[1]:
        raise ValueError(f"qa hidden size {h} does not match x hidden size {x.shape[1]}")
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"qa must have 1..{MAX_SLICES} slices, got {n_slices}")
    if isinstance(qb, Int4Weight) or not isinstance(qb, Sequence) or len(qb) != n_slices:
        raise ValueError(f"qb must be a tuple of {n_slices} Int4Weight, one [S, N_i, R_max] each")
    sizes = []
    for i, b in enumerate(qb):
        b = check_int4_weight(f"qb[{i}]", b, 3, x)
        if b.shape[0] != s or b.size != r_max or b.shape[1] < 1:
            raise ValueError(f"qb[{i}] must have shape [{s}, N, {r_max}], got {list(b.shape)}")
        sizes.append(int(b.shape[1]))
    if out.shape[1] != sum(sizes):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of qb need {sum(sizes)}")
    if (
        not isinstance(scales, torch.Tensor)
        or scales.shape != (s,)
        or scales.dtype != torch.float32
    ):
        raise ValueError(f"scales must be a float32 tensor of shape [{s}]")
    if scales.device != x.device:
        raise ValueError(f"scales is on {scales.device}, expected {x.device}")
    _check_int4_ranks(ranks, s, r_max, x, check_values)
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    shapes = SgmmShapes(int(x.shape[0]), h, n_slices, s, r_max, tuple(sizes), tuple(offsets))
    check_meta(meta, shapes, x)
    return shapes


def check_shrink_int4(
    x: torch.Tensor,  # [T, H]
    qa: Int4Weight,  # [n_slices, S, R_max, H]
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    check_values: bool,
) -> SgmmShapes:
    """Every argument check of sgmm_shrink_int4, before any launch."""
    qa = check_int4_weight("qa", qa, 4, x)
    n_slices, s, r_max, h = qa.shape
    if x.dim() != 2 or x.shape[1] != h or x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be a 2-D float tensor with {h} columns")
    _check_int4_ranks(ranks, s, r_max, x, check_values)
    shapes = SgmmShapes(int(x.shape[0]), h, n_slices, s, r_max, (), ())
    check_meta(meta, shapes, x)
    return shapes


def check_expand_int4(
    out: torch.Tensor,  # [T, sum N_i]
    v: torch.Tensor,  # [n_slices, T, R_max] fp32
    qb: Sequence[Int4Weight],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    check_values: bool,
) -> SgmmShapes:
    """Every argument check of sgmm_expand_int4, before any launch."""
    if isinstance(qb, Int4Weight) or not qb or not isinstance(qb[0], Int4Weight):
        raise ValueError("qb must be a tuple of Int4Weight")
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.dtype not in ACT_DTYPES:
        raise ValueError("out must be a 2-D float16/bfloat16/float32 tensor")
    s, _, r_max = qb[0].shape
    for i, b in enumerate(qb):
        check_int4_weight(f"qb[{i}]", b, 3, out)
        if b.shape[0] != s or b.size != r_max:
            raise ValueError(f"qb[{i}] must have shape [{s}, N, {r_max}], got {list(b.shape)}")
    widths = tuple(int(b.shape[1]) for b in qb)
    if out.shape[1] != sum(widths):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of qb need {sum(widths)}")
    if (
        not isinstance(scales, torch.Tensor)
        or scales.shape != (s,)
        or scales.dtype != torch.float32
    ):
        raise ValueError(f"scales must be a float32 tensor of shape [{s}]")
    _check_int4_ranks(ranks, s, r_max, out, check_values)
    offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
    shapes = SgmmShapes(int(out.shape[0]), 0, len(qb), s, r_max, widths, offsets)
    check_meta(meta, shapes, out)
    if tuple(v.shape) != (shapes.n_slices, shapes.num_tokens, r_max) or v.dtype != torch.float32:
        raise ValueError(
            f"v must be float32 of shape {[shapes.n_slices, shapes.num_tokens, r_max]}"
        )
    return shapes


def check_int4_groups(qb: Sequence[Int4Weight]) -> None:
    """The expand kernel reads every slice's scales with the first slice's grouping."""
    if len({(b.group_size, b.group_dim) for b in qb}) != 1:
        raise ValueError("every slice of qb must use the same group_size and group_dim")


# ---------------------------------------------------------------------------------------------
# Decoder-layer elementwise ops (layer_ops.py): residual add + RMSNorm, RoPE + paged KV write,
# gated activation. No check here reads tensor values, so they cost no host synchronisation and
# run inside CUDA-graph capture.
# ---------------------------------------------------------------------------------------------
LAYER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


def _layer_tensor(name: str, t: object, ndim: int, ref: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    if ref is not None and t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return t


def _layer_dtype(name: str, t: torch.Tensor, want: torch.dtype | None = None) -> None:
    if want is None and t.dtype not in LAYER_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if want is not None and t.dtype != want:
        raise ValueError(f"{name} must be {want} (the dtype of its activations), got {t.dtype}")


def _layer_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def check_rms_norm(
    x: object,
    weight: object,
    eps: object,
    residual: object | None,
    out: object | None,
    extra: object | None = None,
) -> tuple[int, int]:
    """(T, H) of a valid ``rms_norm`` call; ValueError naming the first bad argument."""
    x = _layer_tensor("x", x, 2)
    _layer_dtype("x", x)
    t, h = x.shape
    if h == 0:
        raise ValueError("x must have a non-empty hidden dimension")
    w = _layer_tensor("weight", weight, 1, x)
    _layer_shape("weight", w, (h,))
    _layer_dtype("weight", w, x.dtype)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if extra is not None and residual is None:
        raise ValueError("extra needs residual (it is added to x before the residual)")
    for name, other in (("residual", residual), ("out", out), ("extra", extra)):
        if other is not None:
            other = _layer_tensor(name, other, 2, x)
            _layer_shape(name, other, (t, h))
            _layer_dtype(name, other, x.dtype)
    if isinstance(residual, torch.Tensor):
        for name, other in (("out", out), ("extra", extra)):
            if (
                isinstance(other, torch.Tensor)
                and other.numel() > 0
                and other.data_ptr() == residual.data_ptr()
            ):
                raise ValueError(f"{name} must not alias residual (residual receives the sum)")
    return t, h


def check_act_mul(gu: object, act: object, out: object | None, extra: object | None = None) -> int:
    """The intermediate size I of a valid ``act_mul`` call (gu is [T, 2*I])."""
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}; got {act!r}")
    gu = _layer_tensor("gu", gu, 2)
    _layer_dtype("gu", gu)
    t, width = gu.shape
    if width == 0 or width % 2:
        raise ValueError(f"gu must be [T, 2*I] with I >= 1, got shape {list(gu.shape)}")
    if out is not None:
        out = _layer_tensor("out", out, 2, gu)
        _layer_shape("out", out, (t, width // 2))
        _layer_dtype("out", out, gu.dtype)
    if extra is not None:
        extra = _layer_tensor("extra", extra, 2, gu)
        _layer_shape("extra", extra, (t, width))
        _layer_dtype("extra", extra, gu.dtype)
    return width // 2


def check_rope_kv_write(
    q: object,
    k: object,
    v: object,
    positions: object,
    cos_sin_cache: object,
    k_cache: object,
    v_cache: object,
    slot_mapping: object,
    rotary_dim: object | None,
) -> int:
    """The rotary dimension of a valid ``rope_kv_write`` call (``head_dim`` when None)."""
    q = _layer_tensor("q", q, 3)
    _layer_dtype("q", q)
    t, hq, d = q.shape
    if hq == 0 or d == 0:
        raise ValueError(f"q must be [T, Hq, D] with Hq, D >= 1, got shape {list(q.shape)}")
    k = _layer_tensor("k", k, 3, q)
    _layer_dtype("k", k, q.dtype)
    if k.shape[0] != t or k.shape[2] != d or k.shape[1] == 0:
        raise ValueError(f"k must be [{t}, Hkv, {d}] with Hkv >= 1, got shape {list(k.shape)}")
    hkv = k.shape[1]
    v = _layer_tensor("v", v, 3, q)
    _layer_shape("v", v, (t, hkv, d))
    _layer_dtype("v", v, q.dtype)
    rot = d if rotary_dim is None else rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, int) or rot < 2 or rot > d or rot % 2:
        raise ValueError(f"rotary_dim must be an even int in [2, {d}], got {rotary_dim!r}")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        idx = _layer_tensor(name, idx, 1, q)
        _layer_shape(name, idx, (t,))
        if idx.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {idx.dtype}")
    cs = _layer_tensor("cos_sin_cache", cos_sin_cache, 2, q)
    if cs.shape[0] == 0 or cs.shape[1] != rot:
        raise ValueError(
            f"cos_sin_cache must be [max_pos, {rot}] (cos | sin), got shape {list(cs.shape)}"
        )
    if cs.dtype not in (torch.float32, q.dtype):
        raise ValueError(f"cos_sin_cache must be float32 or {q.dtype}, got {cs.dtype}")
    kc = _layer_tensor("k_cache", k_cache, 4, q)
    if tuple(kc.shape[2:]) != (hkv, d):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {hkv}, {d}], got shape {list(kc.shape)}"
        )
    _layer_dtype("k_cache", kc, q.dtype)
    vc = _layer_tensor("v_cache", v_cache, 4, q)
    _layer_shape("v_cache", vc, tuple(kc.shape))
    _layer_dtype("v_cache", vc, q.dtype)
    return rot


def check_block(name: str, block: int | None, default: int) -> int:
    """A launcher's optional block size: ``default`` when None, else a power of two >= 1."""
    if block is None:
        return default
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {block!r}")
    return block


# ---------------------------------------------------------------------------------------------
# Paged attention (paged_attention.py)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PagedAttentionShapes:
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    num_seqs: int
    max_blocks: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _int_arg(name: str, val: object, low: int) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < low:
        raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    return val


def _positive_float(name: str, val: object) -> float:
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise ValueError(f"{name} must be a float, got {val!r}")
    f = float(val)
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {val!r}")
    return f


def check_paged_attention(
    out: torch.Tensor,  # [T, Hq, D]
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start: torch.Tensor,  # [S + 1] int32
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None,
    num_splits: int,
    softcap: float | None,
) -> PagedAttentionShapes:
    """Shape, dtype, device and layout checks; reads no tensor values (no synchronisation)."""
    out, q = _tensor("out", out), _tensor("q", q)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    block_tables, seq_lens = _tensor("block_tables", block_tables), _tensor("seq_lens", seq_lens)
    query_start = _tensor("query_start", query_start)
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [T, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype not in ACT_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    t, hq, d = q.shape
    if d < 1 or hq < 1:
        raise ValueError(f"q needs Hq >= 1 and D >= 1, got shape {tuple(q.shape)}")
    if tuple(out.shape) != (t, hq, d):
        raise ValueError(f"out must have q's shape {[t, hq, d]}, got {tuple(out.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be 4-D [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}"
        )
    nb, bs, hkv, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if dk != d:
        raise ValueError(f"k_cache head dim {dk} does not match q's head dim {d}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of k_cache's {hkv} kv heads")
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"k_cache block_size must be a power of two, got {bs}")
    for name, x in (("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} dtype {x.dtype} does not match q dtype {q.dtype}")
    for name, x in (("out", out), ("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device} (the device of q)")
        if x.numel() and x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {x.stride()}")
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be 2-D [S, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    s, max_blocks = block_tables.shape
    if tuple(seq_lens.shape) != (s,):
        raise ValueError(f"seq_lens must have shape [{s}], got {tuple(seq_lens.shape)}")
    if tuple(query_start.shape) != (s + 1,):
        raise ValueError(f"query_start must have shape [{s + 1}], got {tuple(query_start.shape)}")
    for name, x in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start", query_start),
    ):
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device} (the device of q)")
        if x.numel() and x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {x.stride()}")
    _positive_float("scale", scale)
    _int_arg("max_query_len", max_query_len, 1)
    _int_arg("num_splits", num_splits, 1)
    if sliding_window is not None:
        _int_arg("sliding_window", sliding_window, 1)
    if softcap is not None:
        _positive_float("softcap", softcap)
    return PagedAttentionShapes(t, hq, hkv, d, nb, bs, s, max_blocks)


class PagedAttentionConfigView(Protocol):
    """What ``check_attention_config`` reads of a ``paged_attention.PagedAttentionConfig`` (a
    protocol: the config lives beside the Triton kernels, which import this module)."""

    @property
    def block_n(self) -> int: ...
    @property
    def block_q(self) -> int: ...
    @property
    def num_warps(self) -> int: ...
    @property
    def use_dot(self) -> bool: ...


def check_attention_config(cfg: PagedAttentionConfigView, rows: int, decode: bool) -> None:
    """A paged-attention tiling: power-of-two sizes, >= 16 keys a tile, and >= 16 rows a program
    wherever ``tl.dot`` runs (``rows``: the query rows one program holds)."""
    for name in ("block_n", "block_q", "num_warps"):
        val = getattr(cfg, name)
        if val < 1 or val & (val - 1):
            raise ValueError(f"config.{name} must be a power of two, got {val}")
    if cfg.block_n < 16:
        raise ValueError(f"config.block_n must be >= 16, got {cfg.block_n}")
    if (cfg.use_dot or not decode) and rows < 16:
        raise ValueError(f"tl.dot needs >= 16 rows a program, config gives {rows}")


def check_attention_workspace(buf: object, need: int, device: torch.device) -> torch.Tensor:
    """A caller's split-KV workspace: fp32 on ``device``, contiguous, >= ``need`` elements."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32 or buf.device != device:
        raise ValueError(f"workspace must be a float32 tensor on {device}")
    if not buf.is_contiguous() or buf.numel() < need:
        raise ValueError(f"workspace must be contiguous with >= {need} elements")
    return buf


# ---------------------------------------------------------------------------------------------
# AdaFuse (fuse_config.py, fuse_kernels.py): the router, the merge table and its selections,
# the switch tiling, gated SGMM. The table and its targets are read through protocols: their
# classes live in fuse_config.py, which imports this module.
# ---------------------------------------------------------------------------------------------
FUSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUTER_MAX_EXPERTS = 64
FUSE_MAX_RANK = 128


class MergeTargetView(Protocol):
    """What the checks and ``reference.fused_switch_ref`` read of a ``MergeTarget``."""

    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def lora_a(self) -> torch.Tensor: ...
    @property
    def lora_b(self) -> torch.Tensor: ...
    @property
    def scale(self) -> float: ...
    @property
    def master(self) -> torch.Tensor | None: ...


class MergeTableView(Protocol):
    """What the checks and ``reference.fused_switch_ref`` read of a ``MergeTable``."""

    @property
    def targets(self) -> Sequence[MergeTargetView]: ...
    @property
    def exact(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def num_experts(self) -> int: ...


class SwitchConfigView(Protocol):
    """What ``check_switch_config`` reads of a ``SwitchConfig``."""

    @property
    def block_m(self) -> int: ...
    @property
    def block_n(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def num_warps(self) -> int: ...
    @property
    def num_stages(self) -> int: ...


@dataclass(frozen=True)
class MergeShapes:
    dtype: torch.dtype
    device: torch.device
    num_experts: int
    dims: list[tuple[int, int, int]]  # N, K, r per target
    r_max: int


def check_instance(name: str, value: object, cls: type) -> None:
    """``value`` is a ``cls`` (for the classes defined beside the kernels, such as MergeTable)."""
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")


def check_float(name: str, t: object) -> torch.Tensor:
    """A float16, bfloat16 or float32 tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FUSE_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def check_route(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int
) -> None:
    h = check_float("h", h)
    weight = check_float("weight", weight)
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [T, H], got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must be [E, {h.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != h.dtype or weight.device != h.device:
        raise ValueError(f"weight must be {h.dtype} on {h.device}")
    e = weight.shape[0]
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")
    if bias is not None:
        bias = check_float("bias", bias)
        if bias.shape != (e,) or bias.device != h.device:
            raise ValueError(f"bias must be [{e}] on {h.device}, got {tuple(bias.shape)}")


def check_router_experts(num_experts: int) -> None:
    """The Triton router holds every expert's logit of a token in one program."""
    if num_experts > ROUTER_MAX_EXPERTS:
        raise ValueError(
            f"the Triton router supports up to {ROUTER_MAX_EXPERTS} experts, got E={num_experts}"
        )


def check_switch_config(cfg: SwitchConfigView) -> None:
    for name in ("block_m", "block_n"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if cfg.chunks < 1 or cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(f"bad switch config {cfg}")


def check_merge_targets(targets: Sequence[MergeTargetView], exact: bool) -> MergeShapes:
    """The targets of one merge table: one dtype and device, contiguous, ``A [E, r, K]`` and
    ``B [E, N, r]`` with one E, ranks in [1, 128], a master copy per weight in exact mode."""
    if not targets:
        raise ValueError("targets must name at least one module")
    t0 = targets[0]
    dtype, device = t0.weight.dtype, t0.weight.device
    num_experts = t0.lora_a.shape[0] if t0.lora_a.dim() == 3 else -1
    dims: list[tuple[int, int, int]] = []
    r_max = 1
    for i, t in enumerate(targets):
        w, a, b = t.weight, t.lora_a, t.lora_b
        name = f"targets[{i}]"
        for what, x in (("weight", w), ("lora_a", a), ("lora_b", b)):
            check_float(f"{name}.{what}", x)
            if x.dtype != dtype or x.device != device:
                raise ValueError(f"{name}.{what} must be {dtype} on {device}")
            if not x.is_contiguous():
                raise ValueError(f"{name}.{what} must be contiguous")
        if w.dim() != 2:
            raise ValueError(f"{name}.weight must be 2-D [N, K], got {tuple(w.shape)}")
        n, k = w.shape
        if a.dim() != 3 or a.shape[0] != num_experts or a.shape[2] != k:
            raise ValueError(f"{name}.lora_a must be [{num_experts}, r, {k}], got {tuple(a.shape)}")
        r = a.shape[1]
        if b.shape != (num_experts, n, r):
            raise ValueError(
                f"{name}.lora_b must be [{num_experts}, {n}, {r}], got {tuple(b.shape)}"
            )
        if r < 1 or r > FUSE_MAX_RANK:
            raise ValueError(f"{name} rank must be in [1, {FUSE_MAX_RANK}], got {r}")
        if exact:
            if t.master is None or t.master.shape != w.shape or t.master.dtype != dtype:
                raise ValueError(f"{name}.master must be a {dtype} copy of the weight (exact mode)")
            if t.master.device != device or not t.master.is_contiguous():
                raise ValueError(f"{name}.master must be contiguous on {device}")
        if max(w.numel(), a.numel(), b.numel()) >= 2**31:
            raise ValueError(f"{name}: tensors of 2^31 elements or more are not supported")
        r_max = max(r_max, r)
        dims.append((n, k, r))
    return MergeShapes(dtype, device, num_experts, dims, r_max)


def check_selection(
    table: MergeTableView,
    ids: torch.Tensor,
    gates: torch.Tensor,
    what: str,
    *,
    values: bool = True,
) -> None:
    """A selection ``(ids [k] int32, gates [k] fp32)`` for ``table``; with ``values`` every id
    lies in ``[-1, E)`` (one read-back, skipped while a graph is captured)."""
    if not isinstance(ids, torch.Tensor) or not isinstance(gates, torch.Tensor):
        raise ValueError(f"{what} ids and gates must be tensors")
    if ids.dim() != 1 or ids.dtype != torch.int32 or ids.numel() < 1:
        raise ValueError(
            f"{what}_ids must be a non-empty 1-D int32 tensor [k], got {ids.dtype} {tuple(ids.shape)}"
        )
    if gates.shape != ids.shape or gates.dtype != torch.float32:
        raise ValueError(f"{what}_gates must be float32 of shape {tuple(ids.shape)}")
    if ids.device != table.device or gates.device != table.device:
        raise ValueError(f"{what} ids and gates must be on {table.device}")
    if not ids.is_contiguous() or not gates.is_contiguous():
        raise ValueError(f"{what} ids and gates must be contiguous")
    if values and not _capturing(ids):
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one read-back
        if lo < -1 or hi >= table.num_experts:
            raise ValueError(
                f"{what}_ids must lie in [-1, {table.num_experts}), got min {lo} max {hi}"
            )


def check_gated_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    expert_ids: torch.Tensor,
    gates: torch.Tensor,
    check_values: bool,
) -> None:
    for name, ten in (("out", out), ("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_float(name, ten)
        if ten.dtype != x.dtype or ten.device != x.device:
            raise ValueError(
                f"{name} must be {x.dtype} on {x.device}, got {ten.dtype} on {ten.device}"
            )
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"x [T, K] and out [T, N] must agree on T, got {tuple(x.shape)} and {tuple(out.shape)}"
        )
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out need unit stride along their last dimension")
    t, k = x.shape
    n = out.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[2] != k or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be a contiguous [E, r, {k}], got {tuple(lora_a.shape)}")
    e, r, _ = lora_a.shape
    if lora_b.shape != (e, n, r) or not lora_b.is_contiguous():
        raise ValueError(f"lora_b must be a contiguous [{e}, {n}, {r}], got {tuple(lora_b.shape)}")
    if r > FUSE_MAX_RANK:
        raise ValueError(f"rank must be <= {FUSE_MAX_RANK}, got {r}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or expert_ids.dtype != torch.int32:
        raise ValueError(
            f"expert_ids must be int32 [{t}, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    if gates.shape != expert_ids.shape or gates.dtype != torch.float32:
        raise ValueError(f"gates must be float32 of shape {tuple(expert_ids.shape)}")
    if expert_ids.device != x.device or gates.device != x.device:
        raise ValueError(f"expert_ids and gates must be on {x.device}")
    if not expert_ids.is_contiguous() or not gates.is_contiguous():
        raise ValueError("expert_ids and gates must be contiguous")
    if check_values and expert_ids.numel() and not _capturing(x):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < -1 or hi >= e:
            raise ValueError(f"expert_ids must lie in [-1, {e}), got min {lo} max {hi}")
