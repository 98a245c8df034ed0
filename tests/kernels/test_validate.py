"""Every argument check in ``_validate.py`` refuses a bad argument with a ``ValueError`` whose
message names that argument (checked with small CPU tensors; no kernel runs)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from adaptermesh.kernels import _validate as v
from adaptermesh.kernels.fuse_config import MergeTable, MergeTarget, build_merge_table
from adaptermesh.kernels.int4_quant import quantize_int4, quantize_lora
from adaptermesh.kernels.meta import build_segment_meta
from adaptermesh.kernels.paged_attention import PagedAttentionConfig
from adaptermesh.kernels.sgmm_config import SgmmConfig

T, H, S, R, N = 4, 16, 2, 8, 8
F32, I32 = torch.float32, torch.int32


def _x() -> torch.Tensor:
    return torch.zeros(T, H)


def _a() -> torch.Tensor:
    return torch.zeros(1, S, R, H)


def _b() -> tuple[torch.Tensor, ...]:
    return (torch.zeros(S, N, R),)


def _ranks(*vals: int) -> torch.Tensor:
    return torch.tensor(vals or (R, 4), dtype=I32)


def _scales() -> torch.Tensor:
    return torch.ones(S)


def _vbuf() -> torch.Tensor:
    return torch.zeros(1, T, R)


def _meta(slots: int = S, tokens: int = T):  # type: ignore[no-untyped-def]
    return build_segment_meta(torch.zeros(tokens, dtype=I32), slots)


def _int4():  # type: ignore[no-untyped-def]
    qa, qb = quantize_lora(_a(), _b(), 4)
    return qa, qb


def _shrink(**kw: object) -> Callable[[], object]:
    args = {"x": _x(), "lora_a": _a(), "ranks": _ranks(), "check_values": True} | kw
    return lambda: v.check_shrink(**args)  # type: ignore[arg-type]


def _expand(**kw: object) -> Callable[[], object]:
    args = {"out": torch.zeros(T, N), "v": _vbuf(), "lora_b": _b(), "scales": _scales(),
            "ranks": _ranks(), "check_values": True} | kw  # fmt: skip
    return lambda: v.check_expand(**args)  # type: ignore[arg-type]


def _pair(**kw: object) -> Callable[[], object]:
    args = {"out": torch.zeros(T, N), "x": _x(), "lora_a": _a(), "lora_b": _b()} | kw
    return lambda: v.check_pair(**args)  # type: ignore[arg-type]


def _int4_add(**kw: object) -> Callable[[], object]:
    qa, qb = _int4()
    args = {"out": torch.zeros(T, N), "x": _x(), "qa": qa, "qb": qb, "scales": _scales(),
            "ranks": _ranks(), "meta": _meta(), "check_values": True} | kw  # fmt: skip
    return lambda: v.check_int4(**args)  # type: ignore[arg-type]


def _int4_shrink(**kw: object) -> Callable[[], object]:
    qa, _ = _int4()
    args = {"x": _x(), "qa": qa, "ranks": _ranks(), "meta": _meta(), "check_values": True} | kw
    return lambda: v.check_shrink_int4(**args)  # type: ignore[arg-type]


def _int4_expand(**kw: object) -> Callable[[], object]:
    _, qb = _int4()
    args = {"out": torch.zeros(T, N), "v": _vbuf(), "qb": qb, "scales": _scales(),
            "ranks": _ranks(), "meta": _meta(), "check_values": True} | kw  # fmt: skip
    return lambda: v.check_expand_int4(**args)  # type: ignore[arg-type]


def _rms(**kw: object) -> Callable[[], object]:
    args = {"x": _x(), "weight": torch.ones(H), "eps": 1e-6, "residual": None, "out": None} | kw
    return lambda: v.check_rms_norm(**args)  # type: ignore[arg-type]


def _act(**kw: object) -> Callable[[], object]:
    args = {"gu": torch.zeros(T, 2 * N), "act": "silu", "out": None} | kw
    return lambda: v.check_act_mul(**args)  # type: ignore[arg-type]


def _rope(**kw: object) -> Callable[[], object]:
    d = 8
    args = {"q": torch.zeros(T, 4, d), "k": torch.zeros(T, 2, d), "v": torch.zeros(T, 2, d),
            "positions": torch.zeros(T, dtype=torch.int64), "cos_sin_cache": torch.zeros(16, d),
            "k_cache": torch.zeros(3, 4, 2, d), "v_cache": torch.zeros(3, 4, 2, d),
            "slot_mapping": torch.zeros(T, dtype=torch.int64), "rotary_dim": None} | kw  # fmt: skip
    return lambda: v.check_rope_kv_write(**args)  # type: ignore[arg-type]


def _attention(**kw: object) -> Callable[[], object]:
    d = 8
    args = {"out": torch.zeros(T, 4, d), "q": torch.zeros(T, 4, d),
            "k_cache": torch.zeros(3, 4, 2, d), "v_cache": torch.zeros(3, 4, 2, d),
            "block_tables": torch.zeros(2, 3, dtype=I32), "seq_lens": torch.zeros(2, dtype=I32),
            "query_start": torch.zeros(3, dtype=I32), "scale": 0.5, "max_query_len": 2,
            "sliding_window": None, "num_splits": 1, "softcap": None} | kw  # fmt: skip
    return lambda: v.check_paged_attention(**args)  # type: ignore[arg-type]


def _bad_group_weight():  # type: ignore[no-untyped-def]
    qa, _ = _int4()
    return replace(qa, scales=qa.scales.float())


E, K = 3, 16  # AdaFuse: experts, input size of a target


def _target(**kw: object) -> MergeTarget:
    w = torch.zeros(N, K)
    args = {"weight": w, "lora_a": torch.zeros(E, R, K), "lora_b": torch.zeros(E, N, R),
            "scale": 1.0, "master": w.clone()} | kw  # fmt: skip
    return MergeTarget(**args)  # type: ignore[arg-type]


def _table() -> MergeTable:
    return build_merge_table([_target()])


def _route(**kw: object) -> Callable[[], object]:
    args = {"h": _x(), "weight": torch.zeros(E, H), "bias": None, "top_k": 2} | kw
    return lambda: v.check_route(**args)  # type: ignore[arg-type]


def _selection(**kw: object) -> Callable[[], object]:
    args = {"table": _table(), "ids": torch.tensor([0, -1], dtype=I32),
            "gates": torch.ones(2), "what": "new"} | kw  # fmt: skip
    return lambda: v.check_selection(**args)  # type: ignore[arg-type]


def _gated(**kw: object) -> Callable[[], object]:
    args = {"out": torch.zeros(T, N), "x": torch.zeros(T, K), "lora_a": torch.zeros(E, R, K),
            "lora_b": torch.zeros(E, N, R), "expert_ids": torch.zeros(T, 2, dtype=I32),
            "gates": torch.ones(T, 2), "check_values": True} | kw  # fmt: skip
    return lambda: v.check_gated_add_lora(**args)  # type: ignore[arg-type]


def _switch_config(**kw: int) -> Callable[[], object]:
    """The check on a SwitchConfig's fields (its constructor runs the same check)."""
    fields = {"block_m": 32, "block_n": 256, "chunks": 16, "num_warps": 4, "num_stages": 3} | kw
    return lambda: v.check_switch_config(SimpleNamespace(**fields))  # type: ignore[arg-type]


CFG = SgmmConfig(16, 16, 16)

# (check, a call that must fail, the argument its message must name)
REFUSALS: list[tuple[str, Callable[[], object], str]] = [
    ("check_shrink", _shrink(x=torch.zeros(T, H, 1)), "x"),
    ("check_shrink", _shrink(x=torch.zeros(T, H, dtype=I32)), "x"),
    ("check_shrink", _shrink(lora_a=torch.zeros(S, R, H)), "lora_a"),
    ("check_shrink", _shrink(lora_a=torch.zeros(4, S, R, H)), "lora_a"),
    ("check_shrink", _shrink(lora_a=torch.zeros(1, S, R, H + 1)), "lora_a"),
    ("check_shrink", _shrink(lora_a=torch.zeros(1, S, R, H, dtype=torch.float16)), "lora_a"),
    ("check_shrink", _shrink(ranks=torch.zeros(S + 1, dtype=I32)), "ranks"),
    ("check_shrink", _shrink(ranks=torch.zeros(S)), "ranks"),
    ("check_shrink", _shrink(ranks=_ranks(R + 1, 0)), "ranks"),
    ("check_shrink", _shrink(ranks=[R, 4]), "ranks"),
    ("check_expand", _expand(out=torch.zeros(T)), "out"),
    ("check_expand", _expand(out=torch.zeros(T, N + 1)), "out"),
    ("check_expand", _expand(lora_b=torch.zeros(S, N, R)), "lora_b"),
    ("check_expand", _expand(lora_b=(torch.zeros(S, N),)), "lora_b[0]"),
    ("check_expand", _expand(lora_b=(torch.zeros(S, N, R), torch.zeros(S, N, R - 1))), "lora_b[1]"),
    ("check_expand", _expand(lora_b=(torch.zeros(S, N, R, dtype=torch.float16),)), "lora_b[0]"),
    ("check_expand", _expand(v=torch.zeros(1, T, R + 1)), "v"),
    ("check_expand", _expand(v=torch.zeros(1, T, R, dtype=torch.float16)), "v"),
    ("check_expand", _expand(scales=torch.ones(S + 1)), "scales"),
    ("check_expand", _expand(scales=torch.ones(S, dtype=torch.float16)), "scales"),
    ("check_expand", _expand(ranks=_ranks(-1, 0)), "ranks"),
    (
        "check_meta",
        lambda: v.check_meta(object(), v.check_shrink(_x(), _a(), _ranks(), True), _x()),
        "meta",
    ),  # type: ignore[arg-type]
    (
        "check_meta",
        lambda: v.check_meta(_meta(3), v.check_shrink(_x(), _a(), _ranks(), True), _x()),
        "meta",
    ),
    (
        "check_meta",
        lambda: v.check_meta(_meta(S, T + 1), v.check_shrink(_x(), _a(), _ranks(), True), _x()),
        "meta",
    ),
    ("check_pair", _pair(out=torch.zeros(T)), "out"),
    ("check_pair", _pair(out=torch.zeros(T + 1, N)), "out"),
    ("check_pair", _pair(out=torch.zeros(T, N, dtype=torch.float16)), "out"),
    ("check_pair", _pair(lora_b=torch.zeros(S, N, R)), "lora_b"),
    ("check_pair", _pair(lora_b=(torch.zeros(S, N),)), "lora_b"),
    ("check_pair", _pair(lora_b=_b() * 2), "lora_b"),
    ("check_pair", _pair(lora_b=(torch.zeros(S + 1, N, R),)), "lora_b[0]"),
    (
        "check_v_buffer",
        lambda: v.check_v_buffer(torch.zeros(1, T, R + 1), (1, T, R), torch.device("cpu")),
        "v buffer",
    ),
    (
        "check_v_buffer",
        lambda: v.check_v_buffer(
            torch.zeros(1, T, R, dtype=torch.float16), (1, T, R), torch.device("cpu")
        ),
        "v buffer",
    ),
    ("check_config", lambda: v.check_config(SgmmConfig(24, 16, 16)), "config.block_m"),
    ("check_config", lambda: v.check_config(SgmmConfig(16, 8, 16)), "config.block_n"),
    ("check_config", lambda: v.check_config(SgmmConfig(16, 16, 16, split_k=0)), "config.split_k"),
    ("check_config", lambda: v.check_config(SgmmConfig(16, 16, 16, n_blocks=0)), "config.n_blocks"),
    ("check_config", lambda: v.check_config(replace(CFG, fused=True, split_k=2)), "config"),
    (
        "check_config",
        lambda: v.check_config(replace(CFG, hoist_v=True, gemv=True)),
        "config.hoist_v",
    ),
    ("check_gemv_rank", lambda: v.check_gemv_rank(replace(CFG, gemv=True), 32), "config.block_k"),
    (
        "check_hoist_rank",
        lambda: v.check_hoist_rank(replace(CFG, hoist_v=True), 32),
        "config.hoist_v",
    ),
    ("check_int4_config", lambda: v.check_int4_config(replace(CFG, fused=True)), "config.fused"),
    ("check_group", lambda: v.check_group(3, -1), "group_size"),
    ("check_group", lambda: v.check_group(4, 0), "group_dim"),
    ("check_int4_weight", lambda: v.check_int4_weight("qa", _a(), 4, _x()), "qa"),
    ("check_int4_weight", lambda: v.check_int4_weight("qa", _int4()[0], 3, _x()), "qa.packed"),
    (
        "check_int4_weight",
        lambda: v.check_int4_weight("qa", _bad_group_weight(), 4, _x()),
        "qa.scales",
    ),
    ("check_int4", _int4_add(x=torch.zeros(T, H, 1)), "x"),
    ("check_int4", _int4_add(out=torch.zeros(T + 1, N)), "out"),
    ("check_int4", _int4_add(qa=_a()), "qa"),
    ("check_int4", _int4_add(x=torch.zeros(T, H + 2)), "qa"),
    ("check_int4", _int4_add(qb=_int4()[1][0]), "qb"),
    (
        "check_int4",
        _int4_add(qb=(quantize_int4(torch.zeros(S, N, R + 2), 4, group_dim=-2),)),
        "qb[0]",
    ),
    ("check_int4", _int4_add(out=torch.zeros(T, N + 1)), "out"),
    ("check_int4", _int4_add(scales=torch.ones(S + 1)), "scales"),
    ("check_int4", _int4_add(ranks=torch.zeros(S)), "ranks"),
    ("check_int4", _int4_add(ranks=_ranks(R + 1, 0)), "ranks"),
    ("check_int4", _int4_add(meta=_meta(3)), "meta"),
    ("check_shrink_int4", _int4_shrink(qa=_a()), "qa"),
    ("check_shrink_int4", _int4_shrink(x=torch.zeros(T, H + 2)), "x"),
    ("check_shrink_int4", _int4_shrink(ranks=_ranks(R + 1, 0)), "ranks"),
    ("check_shrink_int4", _int4_shrink(meta=_meta(S, T + 1)), "meta"),
    ("check_expand_int4", _int4_expand(qb=_b()), "qb"),
    ("check_expand_int4", _int4_expand(out=torch.zeros(T)), "out"),
    ("check_expand_int4", _int4_expand(out=torch.zeros(T, N + 1)), "out"),
    ("check_expand_int4", _int4_expand(scales=torch.ones(S + 1)), "scales"),
    ("check_expand_int4", _int4_expand(ranks=_ranks(R + 1, 0)), "ranks"),
    ("check_expand_int4", _int4_expand(v=torch.zeros(1, T, R + 1)), "v"),
    (
        "check_int4_groups",
        lambda: v.check_int4_groups(
            (_int4()[1][0], quantize_int4(torch.zeros(S, N, R), 8, group_dim=-2))
        ),
        "qb",
    ),
    ("check_rms_norm", _rms(x=torch.zeros(T)), "x"),
    ("check_rms_norm", _rms(weight=torch.ones(H + 1)), "weight"),
    ("check_rms_norm", _rms(eps=-1.0), "eps"),
    ("check_rms_norm", _rms(residual=torch.zeros(T, H + 1)), "residual"),
    ("check_rms_norm", _rms(out=torch.zeros(T, H, dtype=torch.float16)), "out"),
    ("check_rms_norm", _rms(extra=_x()), "extra"),
    ("check_act_mul", _act(act="tanh"), "act"),
    ("check_act_mul", _act(gu=torch.zeros(T, 3)), "gu"),
    ("check_act_mul", _act(out=torch.zeros(T, N + 1)), "out"),
    ("check_act_mul", _act(extra=torch.zeros(T, N)), "extra"),
    ("check_rope_kv_write", _rope(q=torch.zeros(T, 4)), "q"),
    ("check_rope_kv_write", _rope(k=torch.zeros(T, 2, 4)), "k"),
    ("check_rope_kv_write", _rope(v=torch.zeros(T, 3, 8)), "v"),
    ("check_rope_kv_write", _rope(rotary_dim=3), "rotary_dim"),
    ("check_rope_kv_write", _rope(positions=torch.zeros(T, dtype=I32)), "positions"),
    (
        "check_rope_kv_write",
        _rope(slot_mapping=torch.zeros(T + 1, dtype=torch.int64)),
        "slot_mapping",
    ),
    ("check_rope_kv_write", _rope(cos_sin_cache=torch.zeros(16, 4)), "cos_sin_cache"),
    ("check_rope_kv_write", _rope(k_cache=torch.zeros(3, 4, 1, 8)), "k_cache"),
    ("check_rope_kv_write", _rope(v_cache=torch.zeros(3, 2, 2, 8)), "v_cache"),
    ("check_paged_attention", _attention(q=torch.zeros(T, 4)), "q"),
    ("check_paged_attention", _attention(out=torch.zeros(T, 4, 4)), "out"),
    ("check_paged_attention", _attention(k_cache=torch.zeros(3, 4, 8)), "k_cache"),
    ("check_paged_attention", _attention(v_cache=torch.zeros(3, 4, 2, 4)), "v_cache"),
    ("check_paged_attention", _attention(block_tables=torch.zeros(2, dtype=I32)), "block_tables"),
    ("check_paged_attention", _attention(seq_lens=torch.zeros(3, dtype=I32)), "seq_lens"),
    ("check_paged_attention", _attention(query_start=torch.zeros(2, dtype=I32)), "query_start"),
    ("check_paged_attention", _attention(scale=0.0), "scale"),
    ("check_paged_attention", _attention(max_query_len=0), "max_query_len"),
    ("check_paged_attention", _attention(num_splits=0), "num_splits"),
    ("check_paged_attention", _attention(sliding_window=0), "sliding_window"),
    ("check_paged_attention", _attention(softcap=-1.0), "softcap"),
    ("check_block", lambda: v.check_block("block_h", 24, 16), "block_h"),
    ("check_block", lambda: v.check_block("block_i", True, 16), "block_i"),
    (
        "check_attention_config",
        lambda: v.check_attention_config(PagedAttentionConfig(48), 16, decode=True),
        "config.block_n",
    ),
    (
        "check_attention_config",
        lambda: v.check_attention_config(PagedAttentionConfig(8), 16, decode=True),
        "config.block_n",
    ),
    (
        "check_attention_config",
        lambda: v.check_attention_config(PagedAttentionConfig(64), 8, decode=False),
        "rows",
    ),
    (
        "check_attention_workspace",
        lambda: v.check_attention_workspace(torch.zeros(64, dtype=torch.float16), 8, _x().device),
        "workspace",
    ),
    (
        "check_attention_workspace",
        lambda: v.check_attention_workspace(torch.zeros(4), 8, _x().device),
        "workspace",
    ),
    ("check_instance", lambda: v.check_instance("table", object(), MergeTable), "table"),
    ("check_float", lambda: v.check_float("h", [1.0]), "h"),
    ("check_float", lambda: v.check_float("h", torch.zeros(2, dtype=I32)), "h"),
    ("check_route", _route(h=torch.zeros(T, H, dtype=I32)), "h"),
    ("check_route", _route(h=torch.zeros(H)), "h"),
    ("check_route", _route(weight=torch.zeros(E, H + 1)), "weight"),
    ("check_route", _route(weight=torch.zeros(E, H, dtype=torch.float16)), "weight"),
    ("check_route", _route(top_k=E + 1), "top_k"),
    ("check_route", _route(top_k=1.0), "top_k"),
    ("check_route", _route(bias=torch.zeros(E + 1)), "bias"),
    ("check_router_experts", lambda: v.check_router_experts(65), "experts"),
    ("check_switch_config", _switch_config(block_m=24), "block_m"),
    ("check_switch_config", _switch_config(block_n=8), "block_n"),
    ("check_switch_config", _switch_config(chunks=0), "switch config"),
    ("check_switch_config", _switch_config(num_warps=3), "switch config"),
    ("check_merge_targets", lambda: v.check_merge_targets([], True), "targets"),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(weight=torch.zeros(N, K, dtype=I32))], True),
        "targets[0].weight",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets(
            [_target(), _target(lora_a=torch.zeros(E, R, K).half())], True
        ),
        "targets[1].lora_a",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(lora_a=torch.zeros(E, R, 2 * K)[..., ::2])], True),
        "targets[0].lora_a",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(weight=torch.zeros(N * K), master=None)], False),
        "targets[0].weight",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(lora_a=torch.zeros(E, R, K + 1))], True),
        "targets[0].lora_a",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(lora_b=torch.zeros(E, N, R - 1))], True),
        "targets[0].lora_b",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets(
            [_target(lora_a=torch.zeros(E, 129, K), lora_b=torch.zeros(E, N, 129))], True
        ),
        "targets[0] rank",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(master=None)], True),
        "targets[0].master",
    ),
    (
        "check_merge_targets",
        lambda: v.check_merge_targets([_target(master=torch.zeros(K, N).T)], True),
        "targets[0].master",
    ),
    ("check_selection", _selection(ids=[0, 1]), "ids"),
    ("check_selection", _selection(ids=torch.zeros(2)), "new_ids"),
    ("check_selection", _selection(ids=torch.zeros(0, dtype=I32), gates=torch.ones(0)), "new_ids"),
    ("check_selection", _selection(gates=torch.ones(3)), "new_gates"),
    ("check_selection", _selection(gates=torch.ones(2, dtype=torch.float16)), "new_gates"),
    ("check_selection", _selection(ids=torch.zeros(4, dtype=I32)[::2]), "ids"),
    ("check_selection", _selection(ids=torch.tensor([0, E], dtype=I32)), "new_ids"),
    ("check_selection", _selection(ids=torch.tensor([-2, 0], dtype=I32), what="old"), "old_ids"),
    ("check_gated_add_lora", _gated(out=torch.zeros(T, N, dtype=I32)), "out"),
    ("check_gated_add_lora", _gated(lora_a=torch.zeros(E, R, K).half()), "lora_a"),
    ("check_gated_add_lora", _gated(out=torch.zeros(T + 1, N)), "out"),
    ("check_gated_add_lora", _gated(x=torch.zeros(K, T).T), "stride"),
    ("check_gated_add_lora", _gated(lora_a=torch.zeros(E, R, K + 1)), "lora_a"),
    ("check_gated_add_lora", _gated(lora_b=torch.zeros(E, N + 1, R)), "lora_b"),
    (
        "check_gated_add_lora",
        _gated(lora_a=torch.zeros(E, 129, K), lora_b=torch.zeros(E, N, 129)),
        "rank",
    ),
    ("check_gated_add_lora", _gated(expert_ids=torch.zeros(T, 2)), "expert_ids"),
    ("check_gated_add_lora", _gated(gates=torch.ones(T, 3)), "gates"),
    ("check_gated_add_lora", _gated(gates=torch.ones(2, T).T), "contiguous"),
    ("check_gated_add_lora", _gated(expert_ids=torch.full((T, 2), E, dtype=I32)), "expert_ids"),
]


@pytest.mark.parametrize(
    ("check", "call", "name"), REFUSALS, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(REFUSALS)]
)
def test_check_refuses_naming_the_argument(
    check: str, call: Callable[[], object], name: str
) -> None:
    with pytest.raises(ValueError) as refused:
        call()
    assert name in str(refused.value), (check, str(refused.value))


def test_every_check_is_refused_above() -> None:
    checks = {n for n, f in inspect.getmembers(v, inspect.isfunction)
              if n.startswith("check_") and f.__module__ == v.__name__}  # fmt: skip
    assert checks == {c for c, _, _ in REFUSALS}


def test_valid_arguments_pass() -> None:
    _shrink()()
    _expand()()
    _pair()()
    _int4_add()()
    _int4_shrink()()
    _int4_expand()()
    _rms()()
    _act()()
    _rope()()
    _attention()()
    v.check_config(CFG)
    v.check_group(4, -2)
    assert v.check_block("block_h", None, 64) == 64
    assert v.check_block("block_h", 32, 64) == 32
    v.check_attention_config(PagedAttentionConfig(64), 16, decode=True)
    v.check_attention_config(PagedAttentionConfig(64, use_dot=False), 4, decode=True)
    ws = torch.zeros(8)
    assert v.check_attention_workspace(ws, 8, ws.device) is ws
    v.check_instance("table", _table(), MergeTable)
    v.check_router_experts(64)
    _route()()
    _route(bias=torch.zeros(E))()
    _switch_config()()
    shapes = v.check_merge_targets([_target(), _target(lora_a=torch.zeros(E, 4, K),
                                                       lora_b=torch.zeros(E, N, 4))], True)  # fmt: skip
    assert (shapes.num_experts, shapes.dims, shapes.r_max) == (E, [(N, K, R), (N, K, 4)], R)
    _selection()()
    _selection(ids=torch.tensor([E], dtype=I32), gates=torch.ones(1), values=False)()
    _gated()()
    _gated(expert_ids=torch.full((T, 2), E, dtype=I32), check_values=False)()
