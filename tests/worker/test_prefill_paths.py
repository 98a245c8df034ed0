"""The first-chunk prefill path (attention over the chunk's own keys, graph-capturable) agrees
with the general cached-segment path, with and without a sliding window and with padding rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adaptermesh.worker.model import (
    BatchInputs,
    ModelConfig,
    PrefillSegment,
    TransformerModel,
    read_weights,
)

from .conftest import Tiny


@pytest.mark.parametrize("window", [None, 3])
def test_self_prefill_attention_matches_segment_attention(tiny: Tiny, window: int | None) -> None:
    cfg = dataclasses.replace(ModelConfig.from_dir(tiny.model_dir), sliding_window=window)
    model = TransformerModel(cfg, read_weights(tiny.model_dir), torch.device("cpu"), torch.float32, 64)
    g = torch.Generator().manual_seed(0)
    t, pad = 9, 7
    q = torch.randn(t + pad, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(t + pad, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(t + pad, cfg.num_kv_heads, cfg.head_dim, generator=g)
    kc = torch.zeros(2, 64, cfg.num_kv_heads, cfg.head_dim)
    vc = torch.zeros_like(kc)
    kc[1, :t], vc[1, :t] = k[:t], v[:t]
    ids = torch.zeros(t, dtype=torch.int64)
    batch = BatchInputs(ids, ids, ids, ids.int(), 0, None, 0, prefill=[PrefillSegment(1, 0, t, 0)])
    want = model._attention(q[:t], batch, kc, vc)
    got = model._self_attention(q, k, v)  # with padding rows after the real ones
    torch.testing.assert_close(got[:t], want, atol=1e-5, rtol=1e-5)
