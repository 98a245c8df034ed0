"""Sizing over a quantised base: the packed weights take fewer device bytes, and the adapter
pool and KV cache grow by what they saved.

On CUDA the engine sizes itself from the memory the device holds once the weights are loaded
(``engine_config.size_config``: ``total - free``), so what counts is that the device holds the
packed bytes and no dense copy. Checked here: the packed model's bytes are what
``quant.packed_bytes`` predicts from shapes alone; ``choose_sizing`` hands every saved byte
to the pool and the KV cache; and, for the Llama-2-7B shape on an H200's memory, the sizes it
then chooses (computed, not measured: the facts are the shapes and the card's capacity).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptermesh.worker.kv_cache import KVCacheSpec, spec_bytes_per_token
from adaptermesh.worker.model import ModelConfig, TransformerModel, make_lora_pool, read_weights
from adaptermesh.worker.quant import packed_bytes
from adaptermesh.worker.sizing import (
    ACTIVATION_RESERVE_BYTES,
    DeviceFacts,
    HostFacts,
    ModelFacts,
    Requested,
    choose_sizing,
)

from .fidelity_configs import ACCEPTED
from .fidelity_helpers import build_model
from .test_quant_fp8 import CASES as FP8_CASES
from .test_quant_fp8 import write_fp8
from .test_quant_int4 import CASES as INT4_CASES
from .test_quant_int4 import write_int4

# The device's projections: q/k/v and gate/up each packed as one weight (one g_idx).
PROJ = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GIB = 1 << 30
# An H200's device memory as torch reports it (143,771 MiB), and what the CUDA context and
# allocator hold before the weights: the facts the sizing below is computed from.
H200_BYTES = 143_771 << 20
CONTEXT_BYTES = GIB // 2


def projection_bytes(cfg: ModelConfig, method: str | None, dtype_bytes: int = 2) -> int:
    total = 0
    for m in PROJ:
        k, n = cfg.module_shape(m)
        total += k * n * dtype_bytes if method is None else packed_bytes(k, n, method)
    return total * cfg.num_layers


def weight_bytes(cfg: ModelConfig, method: str | None) -> int:
    """Device bytes of the base: bf16 embedding, norms and lm_head (never packed here), the
    projections dense or packed."""
    rest = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    rest += (2 * cfg.num_layers + 1) * cfg.hidden_size
    return 2 * rest + projection_bytes(cfg, method)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(
        tmp_path_factory.mktemp("size_plain") / "m",
        "llama",
        seed=13,
        pad_token_id=0,
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.mark.parametrize(
    "case", ["ct-channel-dynamic", "awq-g32-tf5", "gptq-v2-asym-actorder-lmhead"]
)
def test_packed_bytes_predict_the_loaded_model(plain: Path, tmp_path: Path, case: str) -> None:
    dst, ref = tmp_path / "q", tmp_path / "ref"
    if case in FP8_CASES:
        qcfg, plan, scale_name, input_name = FP8_CASES[case]
        write_fp8(plain, dst, ref, qcfg, plan, scale_name=scale_name, input_name=input_name)
        method = "fp8"
        act = False
    else:
        qcfg, iplan, fmt, group, sym, act = INT4_CASES[case]
        write_int4(plain, dst, ref, qcfg, iplan, fmt=fmt, group=group, sym=sym, act_order=act)
        method = "gptq"
    cfg = ModelConfig.from_dir(dst)
    m = TransformerModel(
        cfg, read_weights(dst), torch.device("cpu"), torch.bfloat16, 64, quant_kernels=True
    )
    dense = TransformerModel(
        ModelConfig.from_dir(ref), read_weights(ref), torch.device("cpu"), torch.bfloat16, 64
    )
    group = int(qcfg.get("group_size", 128))
    want = 0
    for m_name in PROJ:
        k, n = cfg.module_shape(m_name)
        want += packed_bytes(k, n, method, group, act)
    assert sum(w.nbytes for w in m.packed.values()) == want * cfg.num_layers
    # The dense model holds the projections at 2 bytes a weight; the packed one does not.
    saved = projection_bytes(cfg, None) - want * cfg.num_layers
    host = sum(w.nbytes for w in m.quantized.values())  # the CPU also holds the stored form
    assert dense.nbytes - (m.nbytes - host) == saved
    assert saved > 0


def _sizes(cfg: ModelConfig, weights: int, rank: int = 16) -> tuple[int, int, int, int]:
    slot = make_lora_pool(cfg, 1, rank, torch.device("meta"), torch.bfloat16).nbytes
    kv_tok = spec_bytes_per_token(
        KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.bfloat16)
    )
    s = choose_sizing(
        DeviceFacts("cuda", H200_BYTES, CONTEXT_BYTES + weights),
        HostFacts(256 * GIB),
        ModelFacts(kv_tok, slot, 4096),
        Requested(),
    )
    assert s.kv_cache_bytes is not None
    return s.max_loras, s.kv_cache_bytes // kv_tok, s.max_num_seqs, slot


def test_saved_bytes_go_to_the_pool_and_the_kv_cache() -> None:
    cfg = ModelConfig.from_dict(ACCEPTED["Llama-2-7b-hf"])
    bf16 = weight_bytes(cfg, None)
    assert 13.4e9 < bf16 < 13.6e9  # the 13.5 GB
    rows = {}
    for method in (None, "fp8", "awq"):
        w = weight_bytes(cfg, method)
        loras, tokens, seqs, slot = _sizes(cfg, w)
        budget = int(H200_BYTES * 0.85) - CONTEXT_BYTES - w - ACTIVATION_RESERVE_BYTES
        # Every byte of the budget goes to the pool or the KV cache (less a slot's rounding).
        kv_tok = spec_bytes_per_token(
            KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.bfloat16)
        )
        used = loras * slot + tokens * kv_tok
        assert budget - used < kv_tok
        rows[method] = (w, loras, tokens, seqs)
    (wb, lb, tb, sb), (wf, lf, tf, sf), (wa, la, ta, sa) = rows[None], rows["fp8"], rows["awq"]
    assert wa < wf < wb
    assert lb < lf < la
    assert tb < tf < ta
    assert sb <= sf <= sa
    # The saving splits between the pool and the cache and is not lost.
    slot = _sizes(cfg, wb)[3]
    kv_tok = spec_bytes_per_token(
        KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.bfloat16)
    )
    grown = (lf - lb) * slot + (tf - tb) * kv_tok
    assert abs(grown - (wb - wf)) < 2 * kv_tok
