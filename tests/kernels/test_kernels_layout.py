"""How the kernels package holds together: the torch twins load without triton, the package
re-exports nothing, no module of the package imports itself back (type-only imports included),
and INT4, AdaFuse, the layer ops and paged attention pick their backend in ``dispatch.py`` like
bf16."""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest
import torch
from kernel_cases import make_case

from adaptermesh.kernels import dispatch, reference
from adaptermesh.kernels.meta import build_segment_meta


@pytest.mark.parametrize(
    "module",
    [
        "adaptermesh.kernels.reference",
        "adaptermesh.kernels.dispatch",
        "adaptermesh.kernels.meta",
        "adaptermesh.kernels",
    ],
)
def test_twins_import_without_triton(module: str) -> None:
    code = f"import sys, {module}; assert 'triton' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_import_cycle_among_kernel_modules() -> None:
    graph = grimp.build_graph("adaptermesh", exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if m.startswith("adaptermesh.kernels."))
    cycles = []
    for importer in modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if not imported.startswith("adaptermesh.kernels."):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append((importer, *back))
    assert cycles == []


def test_the_package_reexports_nothing() -> None:
    """Every name is imported from the module that owns it: the package holds its submodules
    and nothing else."""
    code = (
        "import types, adaptermesh.kernels as k, adaptermesh.kernels.dispatch, "
        "adaptermesh.kernels.meta; "
        "print(sorted(n for n, v in vars(k).items() "
        "if not n.startswith('__') and not isinstance(v, types.ModuleType)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _int4_case():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels.int4_quant import quantize_lora

    case = make_case(
        t=6, h=16, s=2, r_max=8, ranks=None, out_sizes=(8, 4),
        mix="uniform", dtype=torch.float32, device="cpu", seed=11,
    )  # fmt: skip
    qa, qb = quantize_lora(case.lora_a, case.lora_b, 8)
    meta = build_segment_meta(case.slots, 2)
    return case, qa, qb, meta


def test_dispatch_runs_the_int4_twin_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptermesh.kernels import sgmm_int4

    case, qa, qb, meta = _int4_case()
    calls: list[str] = []
    twin = reference.add_lora_int4_ref

    def counting_twin(*args: object, **kw: object) -> None:
        calls.append("torch")
        twin(*args, **kw)  # type: ignore[arg-type]

    def no_triton(*args: object, **kw: object) -> None:
        raise AssertionError("the Triton launcher ran on CPU tensors")

    monkeypatch.setattr(reference, "add_lora_int4_ref", counting_twin)
    monkeypatch.setattr(sgmm_int4, "add_lora_int4", no_triton)
    got = case.out.clone()
    dispatch.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta)
    dispatch.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta, backend="torch")
    assert calls == ["torch", "torch"]
    want = case.out.clone()
    twin(want, case.x, qa, qb, case.scales, case.ranks, meta)
    twin(want, case.x, qa, qb, case.scales, case.ranks, meta)
    assert torch.equal(got, want)


def test_dispatch_runs_the_int4_kernels_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptermesh.kernels import sgmm_int4

    case, qa, qb, meta = _int4_case()
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(sgmm_int4, "add_lora_int4", lambda *a, **kw: seen.append(kw))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = case.out.clone()
    dispatch.add_lora_int4(out, case.x, qa, qb, case.scales, case.ranks, meta, backend="triton",
                           active_slots=2, check_values=False)  # fmt: skip
    # The batch's adapter count reaches the kernels, which pick their tiles by it.
    assert seen == [{"v_buffer": None, "active_slots": 2, "check_values": False}]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dispatch.add_lora_int4(out, case.x, qa, qb, case.scales, case.ranks, meta,
                               backend="triton")  # fmt: skip


# The AdaFuse, layer and attention ops of dispatch.py, run on CPU tensors in a fresh
# interpreter: each must reach its torch twin, and nothing may import triton on the way.
_CPU_OPS = """
import sys
import torch
from adaptermesh.kernels import reference

called = []
for name in ("route_ref", "fused_switch_ref", "gated_add_lora_ref", "rms_norm_ref",
             "act_mul_ref", "rope_kv_write_ref", "paged_attention_ref"):
    twin = getattr(reference, name)
    def counting(*args, _twin=twin, _name=name, **kw):
        called.append(_name)
        return _twin(*args, **kw)
    setattr(reference, name, counting)

from adaptermesh.kernels import dispatch
from adaptermesh.kernels.fuse_config import MergeTarget, build_merge_table

g = torch.Generator().manual_seed(0)
h = torch.randn(5, 16, generator=g)
ids, gates = dispatch.route(h, torch.randn(4, 16, generator=g), None, 2)
w = torch.randn(8, 16, generator=g)
target = MergeTarget(w, torch.randn(4, 2, 16, generator=g), torch.randn(4, 8, 2, generator=g),
                     0.5, master=w.clone())
table = build_merge_table([target])
dispatch.fused_merge(table, ids[0].contiguous(), gates[0].contiguous())
dispatch.fused_switch(table, ids[1].contiguous(), gates[1].contiguous())
dispatch.fused_unmerge(table)
assert torch.equal(target.weight, target.master)
out = torch.zeros(5, 8)
dispatch.gated_add_lora(out, h, target.lora_a, target.lora_b, ids, gates, 0.5)
dispatch.rms_norm(h, torch.ones(16), 1e-6)
dispatch.act_mul(h)
q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
dispatch.rope_kv_write(q, k, v, torch.arange(5), torch.randn(16, 8, generator=g), k_cache,
                      v_cache, torch.arange(5))
dispatch.paged_attention(torch.zeros(5, 4, 8), q, k_cache, v_cache,
                        torch.tensor([[0, 1]], dtype=torch.int32),
                        torch.tensor([5], dtype=torch.int32),
                        torch.tensor([0, 5], dtype=torch.int32), scale=0.5, max_query_len=5)
assert called == ["route_ref", "fused_switch_ref", "fused_switch_ref", "fused_switch_ref",
                  "gated_add_lora_ref", "rms_norm_ref", "act_mul_ref", "rope_kv_write_ref",
                  "paged_attention_ref"], called
assert "triton" not in sys.modules, sorted(sys.modules)
"""


def test_adafuse_layer_and_attention_ops_run_their_twins_on_cpu_without_triton() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CPU_OPS], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_adafuse_ops_run_the_twins_not_the_launchers_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adaptermesh.kernels import fuse_kernels
    from adaptermesh.kernels.fuse_config import MergeTarget, build_merge_table

    def no_triton(*args: object, **kw: object) -> None:
        raise AssertionError("a Triton launcher ran on CPU tensors")

    for name in ("route", "fused_switch", "gated_add_lora"):
        monkeypatch.setattr(fuse_kernels, name, no_triton)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 16, generator=g)
    router = torch.randn(4, 16, generator=g)
    ids, gates = dispatch.route(h, router, None, 2)
    want_ids, want_gates = reference.route_ref(h, router, None, 2)
    assert torch.equal(ids, want_ids)
    assert torch.equal(gates, want_gates)
    w = torch.randn(8, 16, generator=g)
    target = MergeTarget(w, torch.randn(4, 2, 16, generator=g),
                         torch.randn(4, 8, 2, generator=g), 0.5, master=w.clone())  # fmt: skip
    table = build_merge_table([target])
    dispatch.fused_merge(table, ids[0].contiguous(), gates[0].contiguous())
    assert torch.equal(table.cur_ids, ids[0])
    dispatch.fused_unmerge(table, backend="torch")
    assert torch.equal(target.weight, target.master)
    out = torch.zeros(3, 8)
    dispatch.gated_add_lora(out, h, target.lora_a, target.lora_b, ids, gates, 0.5)
    want = torch.zeros(3, 8)
    reference.gated_add_lora_ref(want, h, target.lora_a, target.lora_b, ids, gates, 0.5)
    assert torch.equal(out, want)
