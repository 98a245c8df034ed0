"""Base-model linear layers over quantised weights kept in their packed form on the device.

Two device formats, built at load from the checkpoint's (``worker/quant.py``):

- ``Fp8Linear``: e4m3 weight ``data`` [N, K] (row-major, as stored) and one fp32 ``scale`` per
  output [N] (a per-tensor checkpoint scale is repeated over the outputs), ``w = data *
  scale[:, None]``; ``input_scale`` (fp32 []) for static activation scales, else None.
- ``W4Linear``: ``qweight`` int32 [ceil(K / 8), N] (input ``8 r + i`` of column ``n`` in bits
  ``4 i .. 4 i + 3`` of ``qweight[r, n]``), ``zeros`` uint8 [G, N] (real zero points),
  ``scales`` [G, N] (fp16 / bf16 / fp32), ``g_idx`` int32 [K] or None (input ``k`` in group
  ``k // group_size``); ``w[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n]``.

``fp8_linear``: at most ``gemv_rows`` rows (batch-1 and small-batch decode) run the weight-only
gemv (``fp8_gemv_kernel``: reads the fp8 weight once, fp32 sums); more rows run the weight-only
W8A16 GEMM on the tensor cores (``w8a16_kernel``), or, with ``fp8_activations``, quantise the
activations to e4m3 (one scale per row, or the static scale) for ``torch._scaled_mm`` with
row-wise scales (W8A8: twice the tensor-core rate for compute-bound prefill, at e4m3's
activation error). ``w4a16_linear``: the Triton GEMM that dequantises 4-bit words in the
tensor-core path (``w4a16_kernel``). Each has a torch twin here (``*_ref``), which the CPU runs
unless ``backend="triton"`` under TRITON_INTERPRET=1; the twins state the maths: gemv / W8A16,
fp32 sums of the activations times the e4m3 values, times the per-output scale; W4A16, the
dequantised weight rounded once to the activation dtype, fp32 sums; scaled-mm, the activations
quantised exactly as the device path does, e4m3 products summed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from types import ModuleType
from typing import Any, TypeVar

import torch

from adaptermesh.kernels._backend import Backend, choose_backend, dot_fp32

__all__ = [
    "FP8_MAX",
    "Fp8Linear",
    "W4Linear",
    "fp8_gemv_ref",
    "fp8_linear",
    "fp8_scaled_mm_ref",
    "fp8_w8a16",
    "quant_linear",
    "quantize_fp8_rows",
    "w4a16_linear",
    "w4a16_ref",
]

_W = TypeVar("_W", "Fp8Linear", "W4Linear")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_GEMV_ROWS = 4


@cache
def _kernels() -> ModuleType:
    from adaptermesh.kernels import quant_linear_kernels

    return quant_linear_kernels


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N]
    input_scale: torch.Tensor | None = None  # fp32 []: static activations
    # Steps of more than the gemv's rows quantise their activations to e4m3 for
    # torch._scaled_mm (W8A8); False: the weight-only W8A16 GEMM (activations kept).
    fp8_activations: bool = False

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        ts = [self.data, self.scale] + ([] if self.input_scale is None else [self.input_scale])
        return sum(t.numel() * t.element_size() for t in ts)

    def to(self, device: torch.device) -> Fp8Linear:
        return Fp8Linear(
            self.data.to(device).contiguous(),
            self.scale.to(device=device, dtype=torch.float32).contiguous(),
            None if self.input_scale is None else self.input_scale.to(device, torch.float32),
            self.fp8_activations,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


@dataclass(frozen=True, slots=True)
class W4Linear:
    qweight: torch.Tensor  # int32 [ceil(K / 8), N]
    zeros: torch.Tensor  # uint8 [G, N]
    scales: torch.Tensor  # [G, N]
    g_idx: torch.Tensor | None  # int32 [K]
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        ts = [self.qweight, self.zeros, self.scales] + ([] if self.g_idx is None else [self.g_idx])
        return sum(t.numel() * t.element_size() for t in ts)

    def to(self, device: torch.device) -> W4Linear:
        return replace(
            self,
            qweight=self.qweight.to(device).contiguous(),
            zeros=self.zeros.to(device).contiguous(),
            scales=self.scales.to(device).contiguous(),
            g_idx=None if self.g_idx is None else self.g_idx.to(device).contiguous(),
        )

    def groups_of_inputs(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K]: ``(q - z) * s`` in fp32, rounded once to ``dtype``."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device)
        q = ((self.qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(
            -1, self.qweight.shape[1]
        )[: self.in_features]
        g = self.groups_of_inputs()
        w = (q.float() - self.zeros.float()[g]) * self.scales.float()[g]
        return w.T.contiguous().to(dtype)


# --- torch twins ---------------------------------------------------------------------------


def quantize_fp8_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 [M, 1]) with ``x ~= xq * scale``: amax / 448 per row (a zero row
    gets scale 1), or the static scale for every row. Values past the range saturate."""
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq, scale


def fp8_scaled_mm_ref(x: torch.Tensor, w: Fp8Linear) -> torch.Tensor:
    """The scaled-mm path's maths: the activations quantised as ``quantize_fp8_rows`` does,
    the e4m3 products summed in fp32, times both scales, rounded once to ``x.dtype``."""
    xq, xs = quantize_fp8_rows(x, w.input_scale)
    acc = xq.float() @ w.data.float().T
    return (acc * xs * w.scale[None, :]).to(x.dtype)


def fp8_gemv_ref(x: torch.Tensor, w: Fp8Linear) -> torch.Tensor:
    """The gemv's maths: fp32 sums of the activations times the e4m3 values, times the
    per-output scale, rounded once to ``x.dtype``."""
    return ((x.float() @ w.data.float().T) * w.scale[None, :]).to(x.dtype)


def w4a16_ref(x: torch.Tensor, w: W4Linear) -> torch.Tensor:
    """The W4A16 GEMM's maths: the weight dequantised in fp32 and rounded once to
    ``x.dtype``, fp32 sums, rounded once to ``x.dtype``."""
    return (x.float() @ w.dequantize(x.dtype).float().T).to(x.dtype)


# --- launchers -----------------------------------------------------------------------------


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: activations must be [M, {k}], got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: activations must be float32, bfloat16 or float16, got {x.dtype}")


def _launch_output(
    x: torch.Tensor,
    w: _W,
    what: str,
    backend: Backend | None,
    out: torch.Tensor | None,
    twin: Callable[[torch.Tensor, _W], torch.Tensor],
) -> tuple[torch.Tensor, bool]:
    """``(tensor, launch)`` for op ``what`` after checking the activations: on the torch
    backend the twin's result (in ``out`` when given) and False; else the output the kernel
    writes (``out``, checked, or a new one), and whether there are rows to launch for."""
    _check_x(x, w.in_features, what)
    if choose_backend(x, backend) == "torch":
        return _into(twin(x, w), out), False
    return _out(x, w.out_features, out), x.shape[0] > 0


def fp8_gemv(
    x: torch.Tensor, w: Fp8Linear, backend: Backend | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    out, launch = _launch_output(x, w, "fp8_gemv", backend, out, fp8_gemv_ref)
    if not launch:
        return out
    m, n, k = x.shape[0], w.out_features, w.in_features
    block_n = 16 if n >= 2048 else 8
    grid = (triton_cdiv(n, block_n), m)
    _kernels().fp8_gemv_kernel[grid](
        x,
        w.data,
        w.scale,
        out,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.data.stride(0),
        w.data.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_K=256 if k >= 256 else 64,
        num_warps=4,
    )
    return out


def _scaled_mm_ok(x: torch.Tensor, w: Fp8Linear) -> bool:
    # torch._scaled_mm: K and N multiples of 16; row-wise scales need a bf16 output.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.in_features % 16 == 0
        and w.out_features % 16 == 0
    )


def fp8_scaled_mm(
    x: torch.Tensor, w: Fp8Linear, backend: Backend | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    _check_x(x, w.in_features, "fp8_scaled_mm")
    if choose_backend(x, backend) == "torch" or not _scaled_mm_ok(x, w):
        return _into(fp8_scaled_mm_ref(x, w), out)
    xq, xs = quantize_fp8_rows(x, w.input_scale)
    y = torch._scaled_mm(
        xq,
        w.data.T,
        scale_a=xs,
        scale_b=w.scale.reshape(1, -1),
        out_dtype=x.dtype,
    )
    return _into(y, out)


def fp8_w8a16(
    x: torch.Tensor,
    w: Fp8Linear,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    **tiles: int,
) -> torch.Tensor:
    """The weight-only fp8 GEMM; the twin is the gemv's maths (``fp8_gemv_ref``)."""
    dst, launch = _launch_output(x, w, "fp8_w8a16", backend, out, fp8_gemv_ref)
    if not launch:
        return dst
    m, n, k = x.shape[0], w.out_features, w.in_features
    cfg = {**_w4_config(m, n, k, 64, False, x.device), **tiles}
    return _split_k_gemm(
        _kernels().w8a16_kernel, x, dst, k, cfg, (w.data, w.scale), tuple(w.data.stride())
    )


def fp8_linear(
    x: torch.Tensor,
    w: Fp8Linear,
    backend: Backend | None = None,
    gemv_rows: int = _GEMV_ROWS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T`` [M, N] in ``x.dtype``: the gemv for at most ``gemv_rows`` rows, else the
    scaled-mm path (activations quantised per row) with ``w.fp8_activations``, else the
    weight-only W8A16 GEMM."""
    if x.shape[0] <= gemv_rows:
        return fp8_gemv(x, w, backend, out=out)
    if w.fp8_activations:
        return fp8_scaled_mm(x, w, backend, out=out)
    return fp8_w8a16(x, w, backend, out=out)


def _split_k_gemm(
    kernel: Any,
    x: torch.Tensor,
    dst: torch.Tensor,
    k: int,
    cfg: dict[str, int],
    operands: tuple[torch.Tensor, ...],
    strides: tuple[int, ...],
    **consts: object,
) -> torch.Tensor:
    """Launch a tensor-core GEMM of ``x`` [M, K] into ``dst`` [M, N] over ``cfg``'s tiles,
    with up to SPLIT_K programs along K: one split writes ``dst``, more add their partial
    products into an fp32 buffer copied into ``dst`` after. The kernel takes ``x``, the
    weight's ``operands``, the output, M, N, K, the K range per split, then the strides of
    ``x``, the weight's ``strides`` and the output's."""
    m, n = dst.shape
    bk = cfg["BLOCK_K"]
    k_per = triton_cdiv(triton_cdiv(k, cfg["SPLIT_K"]), bk) * bk
    split = triton_cdiv(k, k_per)
    out = dst if split == 1 else torch.zeros((m, n), dtype=torch.float32, device=x.device)
    grid = (triton_cdiv(m, cfg["BLOCK_M"]), triton_cdiv(n, cfg["BLOCK_N"]), split)
    kernel[grid](
        x, *operands, out, m, n, k, k_per, x.stride(0), x.stride(1), *strides, out.stride(0),
        out.stride(1), SPLIT_K=split, DOT_FP32=dot_fp32(x.dtype), BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, num_warps=4, **consts,
    )  # fmt: skip
    if split > 1:
        dst.copy_(out)
    return dst


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _w4_config(
    m: int, n: int, k: int, group: int, gidx: bool, device: torch.device
) -> dict[str, int]:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 16 else 128
    block_k = 64 if group % 64 == 0 or gidx else 32
    programs = triton_cdiv(m, block_m) * triton_cdiv(n, block_n)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    steps = triton_cdiv(k, block_k)
    split = 1
    if m <= 64:
        split = max(1, min(steps // 4, triton_cdiv(2 * sms, programs)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}


def w4a16_linear(
    x: torch.Tensor,
    w: W4Linear,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    **tiles: int,
) -> torch.Tensor:
    """``x @ w.T`` [M, N] in ``x.dtype`` with the 4-bit weight dequantised per tile.
    ``tiles``: BLOCK_M / BLOCK_N / BLOCK_K / SPLIT_K overrides (tests, tuning)."""
    dst, launch = _launch_output(x, w, "w4a16_linear", backend, out, w4a16_ref)
    if not launch:
        return dst
    m, n, k = x.shape[0], w.out_features, w.in_features
    cfg = {**_w4_config(m, n, k, w.group_size, w.g_idx is not None, x.device), **tiles}
    return _split_k_gemm(
        _kernels().w4a16_kernel,
        x,
        dst,
        k,
        cfg,
        (w.qweight, w.zeros, w.scales, w.g_idx if w.g_idx is not None else w.qweight),
        (*w.qweight.stride(), *w.zeros.stride(), *w.scales.stride()),
        GROUP=w.group_size,
        HAS_GIDX=w.g_idx is not None,
        SCALE_ROW=w.g_idx is None and w.group_size % cfg["BLOCK_K"] == 0,
    )


def quant_linear(
    x: torch.Tensor,
    w: Fp8Linear | W4Linear,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T`` for either packed format; ``out`` ([M, N], ``x.dtype``): written there (the
    LoRA side-stream path hands its preallocated output) and returned."""
    if isinstance(w, Fp8Linear):
        return fp8_linear(x, w, backend, out=out)
    return w4a16_linear(x, w, backend, out=out)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def _out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (x.shape[0], n) or out.dtype != x.dtype:
        raise ValueError(
            f"out must be {x.dtype} [{x.shape[0]}, {n}], got {out.dtype} {list(out.shape)}"
        )
    return out
