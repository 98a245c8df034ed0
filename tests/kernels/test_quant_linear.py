"""Quantised-base GEMMs (quant_linear.py) against their torch twins and plain formulas.

CPU (CI): the Triton kernels under TRITON_INTERPRET=1 (fp32 dots there) on small ragged
shapes, fp32 and fp16; the scaled-mm twin against torch's own ``_scaled_mm`` (which the CPU
build has). ``gpu``: bf16 at Llama-2-7B shapes and odd ones, the Triton kernels and
``torch._scaled_mm`` on the tensor cores, CUDA-graph capture.

Tolerances (elementwise rtol, atol on O(1) outputs): the kernel and its twin compute the same
products (the W4A16 weight rounded once to the activation dtype in both), so they differ by
the fp32 sum order plus one rounding of the output: a few fp32 ulps, or one ulp of fp16/bf16.
The scaled-mm path differs from the dequantised weight by its e4m3 activations (3 mantissa
bits: up to 2^-4 relative per element, averaging out over K), checked separately as a
relative Frobenius error.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.kernels import quant_linear as ql
from adaptermesh.kernels.quant_linear import Fp8Linear, W4Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = (torch.float32, torch.float16)
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] 0..15 -> int32 [ceil(K / 8), N], input 8 r + i in bits 4 i of row r."""
    k, n = q.shape
    rows = -(-k // 8)
    words = torch.zeros(rows, n, dtype=torch.int64)
    for r in range(rows):
        for i in range(8):
            if 8 * r + i < k:
                words[r] |= q[8 * r + i].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def make_w4(
    n: int, k: int, group: int, *, act: bool, gen: torch.Generator, scale_dtype: torch.dtype
) -> tuple[W4Linear, torch.Tensor]:
    """A random W4Linear and its fp32 weight [N, K], written out element by element."""
    gs = k if group == -1 else group
    ng = -(-k // gs)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 17, (ng, n), generator=gen)  # 16: GPTQ v1's stored 15, plus 1
    # Scales sized so each output is O(1) for unit activations.
    s = (torch.rand(ng, n, generator=gen) + 0.5) / (4 * k**0.5)
    g = torch.arange(k) // gs
    if act:
        order = torch.randperm(k, generator=gen)
        g = torch.empty(k, dtype=torch.int64)
        g[order] = torch.arange(k) // gs
    s = s.to(scale_dtype)
    w = torch.empty(n, k)
    for kk in range(k):
        gk = int(g[kk])
        w[:, kk] = (q[kk].float() - z[gk].float()) * s[gk].float()
    packed = W4Linear(
        _pack_rows(q),
        z.to(torch.uint8),
        s,
        g.to(torch.int32) if act else None,
        gs,
        k,
    )
    return packed.to(torch.device(DEVICE)), w.to(DEVICE)


def make_fp8(
    n: int, k: int, *, gen: torch.Generator, static: bool = False
) -> tuple[Fp8Linear, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) / k**0.5
    scale = w.abs().amax(dim=1) / ql.FP8_MAX
    data = (w / scale[:, None]).to(torch.float8_e4m3fn)
    inp = torch.tensor(0.02) if static else None
    lin = Fp8Linear(data, scale, inp).to(torch.device(DEVICE))
    return lin, (data.float() * scale[:, None]).to(DEVICE)


# --- W4A16 ---------------------------------------------------------------------------------


def test_w4_dequantize_is_the_formula() -> None:
    gen = _gen("deq")
    for act in (False, True):
        lin, w = make_w4(24, 80, 32, act=act, gen=gen, scale_dtype=torch.float16)
        assert torch.equal(lin.dequantize(), w)
        assert torch.equal(lin.dequantize(torch.bfloat16), w.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "act", "tiles"),
    [
        (1, 64, 128, 128, False, {}),
        (3, 24, 72, 24, False, {}),  # groups not a multiple of BLOCK_K: the gather path
        (17, 40, 96, 32, True, {}),  # act-order g_idx
        (5, 136, 256, 64, False, {"SPLIT_K": 3}),  # split-K with a partial last split
        (33, 72, 200, -1, False, {"BLOCK_K": 32}),  # one group, K not a multiple of 8 * BLOCK
        (2, 8, 40, 16, True, {"SPLIT_K": 2, "BLOCK_K": 16}),
    ],
)
def test_w4a16_kernel_matches_twin(
    m: int, n: int, k: int, group: int, act: bool, tiles: dict[str, int], dtype: torch.dtype
) -> None:
    gen = _gen("w4", m, n, k, group, act, dtype)
    lin, w = make_w4(n, k, group, act=act, gen=gen, scale_dtype=torch.float16)
    x = torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=dtype)
    got = ql.w4a16_linear(x, lin, backend="triton", **tiles)
    want = ql.w4a16_ref(x, lin)
    assert got.dtype == dtype
    assert got.shape == (m, n)
    _close(got, want, dtype)
    formula = (x.float() @ w.to(dtype).float().T).to(dtype)
    _close(want, formula, dtype)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    m=st.integers(1, 40),
    n8=st.integers(1, 12),
    k8=st.integers(1, 24),
    group=st.sampled_from([8, 16, 32, 48, 64, 128, -1]),
    act=st.booleans(),
    split=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(CPU_DTYPES),
)
def test_w4a16_drawn_shapes(
    m: int, n8: int, k8: int, group: int, act: bool, split: int, dtype: torch.dtype
) -> None:
    gen = _gen("w4h", m, n8, k8, group, act, split)
    lin, _ = make_w4(8 * n8, 8 * k8, group, act=act, gen=gen, scale_dtype=torch.bfloat16)
    x = torch.randn(m, 8 * k8, generator=gen).to(device=DEVICE, dtype=dtype)
    _close(ql.w4a16_linear(x, lin, backend="triton", SPLIT_K=split), ql.w4a16_ref(x, lin), dtype)


def test_w4a16_refuses_bad_activations() -> None:
    lin, _ = make_w4(8, 16, 8, act=False, gen=_gen("bad"), scale_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"w4a16_linear: activations must be \[M, 16\]"):
        ql.w4a16_linear(torch.zeros(2, 8, device=DEVICE), lin)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ql.w4a16_linear(torch.zeros(2, 16, dtype=torch.int32, device=DEVICE), lin)


# --- FP8 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 64), (3, 40, 100), (4, 16, 300), (2, 7, 33)])
def test_fp8_gemv_kernel_matches_twin(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = _gen("gemv", m, n, k, dtype)
    lin, w = make_fp8(n, k, gen=gen)
    x = torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=dtype)
    got = ql.fp8_gemv(x, lin, backend="triton")
    want = ql.fp8_gemv_ref(x, lin)
    _close(got, want, dtype)
    _close(want, (x.float() @ w.T).to(dtype), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "tiles"),
    [
        (5, 48, 64, {}),
        (17, 40, 100, {}),
        (33, 24, 300, {"SPLIT_K": 3}),
        (70, 8, 40, {"BLOCK_K": 16}),
    ],
)
def test_fp8_w8a16_kernel_matches_twin(
    m: int, n: int, k: int, tiles: dict[str, int], dtype: torch.dtype
) -> None:
    gen = _gen("w8", m, n, k, dtype)
    lin, w = make_fp8(n, k, gen=gen)
    x = torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=dtype)
    got = ql.fp8_w8a16(x, lin, backend="triton", **tiles)
    _close(got, ql.fp8_gemv_ref(x, lin), dtype)
    _close(got, (x.float() @ w.T).to(dtype), dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_is_written_in_place(backend: str) -> None:
    """``out=`` (the LoRA side-stream path's preallocated output) receives the product, on
    every path: gemv, W8A16 (split-K too), W4A16 (split-K too), the scaled-mm twin."""
    gen = _gen("out", backend)
    f8, _ = make_fp8(24, 64, gen=gen)
    w4, _ = make_w4(24, 64, 16, act=False, gen=gen, scale_dtype=torch.float16)
    for m in (2, 9):
        x = torch.randn(m, 64, generator=gen).to(DEVICE)
        for lin in (f8, replace(f8, fp8_activations=True), w4):
            buf = torch.full((m, 24), float("nan"), device=DEVICE)
            got = ql.quant_linear(x, lin, backend, out=buf)  # type: ignore[arg-type]
            assert got is buf
            want = ql.quant_linear(x, lin, "torch")
            _close(buf, want, torch.float32)
        buf = torch.full((m, 24), float("nan"), device=DEVICE)
        ql.w4a16_linear(x, w4, backend, out=buf, SPLIT_K=2)  # type: ignore[arg-type]
        _close(buf, ql.w4a16_ref(x, w4), torch.float32)
        buf = torch.full((m, 24), float("nan"), device=DEVICE)
        ql.fp8_w8a16(x, f8, backend, out=buf, SPLIT_K=2)  # type: ignore[arg-type]
        _close(buf, ql.fp8_gemv_ref(x, f8), torch.float32)
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[2, 24\]"):
        ql.quant_linear(torch.zeros(2, 64, device=DEVICE), w4, "triton", out=torch.zeros(2, 8))


def test_quantize_fp8_rows() -> None:
    gen = _gen("rows")
    x = torch.randn(6, 50, generator=gen) * torch.tensor([1e-3, 1, 10, 100, 0, 3])[:, None]
    xq, s = ql.quantize_fp8_rows(x)
    assert xq.dtype == torch.float8_e4m3fn
    assert s.shape == (6, 1)
    assert s[4, 0] == 1.0
    assert bool((xq[4].float() == 0).all())
    back = xq.float() * s
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + 1e-30).all())  # e4m3: 3 mantissa bits
    assert torch.equal(xq.float().abs().amax(dim=1)[[0, 1, 2, 3, 5]], torch.full((5,), 448.0))
    xq2, s2 = ql.quantize_fp8_rows(x, torch.tensor(0.01))
    assert torch.equal(s2, torch.full((6, 1), 0.01))
    assert float(xq2.float().abs().max()) == 448.0  # saturates, no inf / nan


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(5, 32, 64), (64, 48, 128), (19, 16, 32)])
def test_fp8_scaled_mm_twin_is_torch_scaled_mm(m: int, n: int, k: int, static: bool) -> None:
    """The twin states what ``torch._scaled_mm`` computes: same e4m3 operands and row-wise
    scales, fp32 sums, one bf16 rounding (torch's CPU build runs it here)."""
    gen = _gen("smm", m, n, k, static)
    lin, w = make_fp8(n, k, gen=gen, static=static)
    lin = lin.to(torch.device("cpu"))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16) * 0.1
    xq, xs = ql.quantize_fp8_rows(x, lin.input_scale)
    theirs = torch._scaled_mm(
        xq, lin.data.T, scale_a=xs, scale_b=lin.scale.reshape(1, -1), out_dtype=torch.bfloat16
    )
    mine = ql.fp8_scaled_mm_ref(x, lin)
    _close(mine, theirs, torch.bfloat16)
    if not static:
        # Against the dequantised weight: the e4m3 activations' error, averaged over K.
        ref = x.float() @ w.cpu().T
        err = (mine.float() - ref).norm() / ref.norm()
        assert float(err) < 0.05, float(err)


def test_fp8_linear_picks_gemv_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def record(name: str) -> Any:
        def run(x: torch.Tensor, w: Fp8Linear, backend: Any = None, **kw: Any) -> torch.Tensor:
            calls.append(name)
            return x

        return run

    monkeypatch.setattr(ql, "fp8_gemv", record("gemv"))
    monkeypatch.setattr(ql, "fp8_scaled_mm", record("mm"))
    monkeypatch.setattr(ql, "fp8_w8a16", record("w8a16"))
    lin, _ = make_fp8(16, 16, gen=_gen("pick"))
    for m in (1, 4, 5, 64):
        ql.fp8_linear(torch.zeros(m, 16), lin)
    for m in (1, 4, 5, 64):
        ql.fp8_linear(torch.zeros(m, 16), replace(lin, fp8_activations=True))
    assert calls == ["gemv", "gemv", "w8a16", "w8a16", "gemv", "gemv", "mm", "mm"]


# --- GPU -----------------------------------------------------------------------------------

GPU_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096), (1000, 776)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 64, 200])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
@pytest.mark.parametrize("act", [False, True])
def test_gpu_w4a16_matches_twin(m: int, n: int, k: int, act: bool) -> None:
    gen = _gen("gw4", m, n, k, act)
    lin = _big_w4(n, k, 128, act=act, gen=gen)
    x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    got = ql.w4a16_linear(x, lin)
    want = ql.w4a16_ref(x, lin)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert float(rel) < 5e-3, float(rel)
    _close(got, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
def test_gpu_fp8_gemv_matches_twin(m: int, n: int, k: int) -> None:
    gen = _gen("ggemv", m, n, k)
    lin, _ = make_fp8(n, k, gen=gen)
    x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    _close(ql.fp8_linear(x, lin), ql.fp8_gemv_ref(x, lin), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 16, 64, 200])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
def test_gpu_fp8_w8a16_matches_twin(m: int, n: int, k: int) -> None:
    gen = _gen("gw8", m, n, k)
    lin, _ = make_fp8(n, k, gen=gen)
    x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    _close(ql.fp8_linear(x, lin), ql.fp8_gemv_ref(x, lin), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m", [5, 64, 333])
@pytest.mark.parametrize(("n", "k"), [s for s in GPU_SHAPES if s[0] % 16 == 0 and s[1] % 16 == 0])
def test_gpu_fp8_scaled_mm_matches_twin(m: int, n: int, k: int, static: bool) -> None:
    gen = _gen("gsmm", m, n, k, static)
    lin, _ = make_fp8(n, k, gen=gen, static=static)
    x = (torch.randn(m, k, generator=gen) * 0.1).to(device="cuda", dtype=torch.bfloat16)
    got = ql.fp8_linear(x, replace(lin, fp8_activations=True))
    _close(got, ql.fp8_scaled_mm_ref(x, lin), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_quant_linear_in_a_cuda_graph() -> None:
    gen = _gen("graph")
    w4 = _big_w4(4096, 4096, 128, act=False, gen=gen)
    f8, _ = make_fp8(4096, 4096, gen=gen)
    f8a = replace(f8, fp8_activations=True)
    for m in (1, 64):
        x = torch.randn(m, 4096, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        outs: dict[str, Any] = {}
        lins: tuple[tuple[str, Fp8Linear | W4Linear], ...] = (
            ("w4", w4),
            ("fp8", f8),
            ("fp8a", f8a),
        )
        for name, lin in lins:
            ql.quant_linear(x, lin)  # compile outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = ql.quant_linear(x, lin)
            x.copy_(torch.randn(m, 4096, generator=gen).to(device="cuda", dtype=torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            ref = ql.w4a16_ref(x, lin) if isinstance(lin, W4Linear) else _fp8_ref(x, lin)
            _close(outs[name], ref, torch.bfloat16)


def _fp8_ref(x: torch.Tensor, lin: Fp8Linear) -> torch.Tensor:
    if x.shape[0] <= 4 or not lin.fp8_activations:
        return ql.fp8_gemv_ref(x, lin)
    return ql.fp8_scaled_mm_ref(x, lin)


def _big_w4(n: int, k: int, group: int, *, act: bool, gen: torch.Generator) -> W4Linear:
    """make_w4 without the element-by-element reference (too slow at 7B shapes)."""
    ng = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen)
    k8 = -(-k // 8)
    qp = torch.zeros(k8 * 8, n, dtype=torch.int64)
    qp[:k] = q
    words = (qp.reshape(k8, 8, n) << (4 * torch.arange(8))[None, :, None]).sum(1)
    g = None
    if act:
        order = torch.randperm(k, generator=gen)
        g = torch.empty(k, dtype=torch.int32)
        g[order] = (torch.arange(k) // group).to(torch.int32)
    lin = W4Linear(
        torch.where(words >= 2**31, words - 2**32, words).to(torch.int32),
        torch.randint(0, 16, (ng, n), generator=gen).to(torch.uint8),
        ((torch.rand(ng, n, generator=gen) + 0.5) / (4 * k**0.5)).half(),
        g,
        group,
        k,
    )
    return lin.to(torch.device("cuda"))


def test_quant_linear_imports_without_triton() -> None:
    """A CPU worker loads quantised bases with no Triton install: the launchers import the
    kernels only on their first Triton launch."""
    import subprocess
    import sys

    code = (
        "import sys, adaptermesh.kernels.quant_linear, adaptermesh.worker.quant; "
        "assert 'triton' not in sys.modules, sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
