"""How the kernels package holds together: the torch twins load without triton, no module of
the package imports itself back (type-only imports included), and INT4 picks its backend in
``dispatch.py`` like bf16."""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest
import torch
from kernel_cases import make_case

from adaptermesh import kernels
from adaptermesh.kernels import build_segment_meta, dispatch, reference


@pytest.mark.parametrize(
    "module",
    ["adaptermesh.kernels.reference", "adaptermesh.kernels.dispatch", "adaptermesh.kernels"],
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


def test_paged_attention_op_keeps_its_name_after_the_module_loads() -> None:
    import adaptermesh.kernels.paged_attention  # noqa: F401  (binds the module's name, if let)

    assert kernels.paged_attention is dispatch.paged_attention
    assert sys.modules["adaptermesh.kernels.paged_attention"].__name__.endswith("paged_attention")


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
    kernels.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta)
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
                           check_values=False)  # fmt: skip
    assert seen == [{"v_buffer": None, "check_values": False}]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dispatch.add_lora_int4(out, case.x, qa, qb, case.scales, case.ranks, meta,
                               backend="triton")  # fmt: skip
