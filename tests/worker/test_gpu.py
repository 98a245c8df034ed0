"""CUDA path: graph-captured decode and prefill with the Triton SGMM kernels give peft's greedy
tokens; AdaFuse expert sets (Triton router, fused switch, gated SGMM) match the torch oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from waiting import async_wait_until

from adaptermesh.worker.engine import Engine, EngineConfig

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request, tokens

pytestmark = pytest.mark.gpu


def _run(
    tiny: Tiny, *, graphs: bool, dtype: str = "float32", overlap: bool = True
) -> tuple[dict[str, list[int]], dict[str, Any]]:
    async def go() -> tuple[dict[str, list[int]], dict[str, Any]]:
        cfg = EngineConfig(
            max_num_seqs=8,
            max_loras=4,
            max_lora_rank=16,
            max_prefill_chunk=7,
            use_cuda_graphs=graphs,
            lora_overlap=overlap,
        )
        eng = Engine(
            tiny.model_dir, tiny.root, device="cuda", dtype=dtype, config=cfg, model_name="tiny"
        )
        jobs = {
            f"{i}-{n}": (tiny.encode(p), n)
            for i, p in enumerate(PROMPTS)
            for n in (None, *ADAPTERS)
        }
        streams = {
            rid: eng.submit(request(rid, ids, n, max_tokens=8)) for rid, (ids, n) in jobs.items()
        }
        outs = {rid: tokens(await collect(s)) for rid, s in streams.items()}
        info = eng.describe()
        info["lora_side"] = eng.model.lora_side is not None
        await eng.shutdown()
        return outs, info

    return asyncio.run(go())


def test_cuda_graph_decode_matches_peft(tiny: Tiny) -> None:
    outs, info = _run(tiny, graphs=True)
    assert info["cuda_graphs"], info
    for rid, got in outs.items():
        i, name = rid.split("-", 1)
        adapter = None if name == "None" else name
        assert got == tiny.ref.greedy(list(tiny.encode(PROMPTS[int(i)])), adapter, 8), rid
    eager, _ = _run(tiny, graphs=False)
    assert eager == outs


def test_lora_shrink_beside_the_matmul_equals_the_serial_path(tiny: Tiny) -> None:
    # The side-stream shrink (the default on CUDA) against shrink + expand after the matmul,
    # graphs and eager: the same greedy tokens for a batch mixing base rows and three adapters.
    for graphs in (True, False):
        side, info = _run(tiny, graphs=graphs)
        serial, info_off = _run(tiny, graphs=graphs, overlap=False)
        assert info["lora_side"]
        assert not info_off["lora_side"]
        assert side == serial, graphs


def test_bf16_serves_mixed_batch(tiny: Tiny) -> None:
    outs, info = _run(tiny, graphs=True, dtype="bfloat16")
    assert info["cuda_graphs"], info
    assert all(len(v) == 8 for v in outs.values())


def test_single_request_prefill_graph_matches_peft(tiny: Tiny) -> None:
    async def go() -> tuple[dict[str, list[int]], dict[str, Any]]:
        cfg = EngineConfig(max_num_seqs=8, max_loras=4, max_lora_rank=16)
        eng = Engine(
            tiny.model_dir, tiny.root, device="cuda", dtype="float32", config=cfg, model_name="tiny"
        )
        outs = {}
        for i, p in enumerate(PROMPTS):
            for n in (None, *ADAPTERS):
                # One at a time: each prompt prefills alone, through the prefill graph.
                outs[f"{i}-{n}"] = tokens(
                    await collect(eng.submit(request(f"{i}-{n}", tiny.encode(p), n, max_tokens=6)))
                )
        info = eng.describe()
        await eng.shutdown()
        return outs, info

    outs, info = asyncio.run(go())
    # A prompt prefilling alone runs as a mixed (prefill + decode) step graph, bucket "m".
    assert any(k[0] == "m" for k in info["graph_buckets"]), info
    for rid, got in outs.items():
        i, name = rid.split("-", 1)
        adapter = None if name == "None" else name
        assert got == tiny.ref.greedy(list(tiny.encode(PROMPTS[int(i)])), adapter, 6), rid


def test_expert_sets_on_cuda_match_reference(tiny: Tiny, tmp_path: Path) -> None:
    import torch

    from .test_adafuse_engine import CONST, SETS, ExpertSetReference, write_expert_sets

    root = write_expert_sets(tiny, tmp_path / "adapters")
    sets = [*SETS, CONST]
    ref = ExpertSetReference(tiny.model_dir, root, sets)

    def greedy(ids: list[int], name: str | None, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            logits = (
                ref.logits(ids + out, name) if name in sets else tiny.ref.logits(ids + out, name)
            )
            out.append(int(logits[-1].argmax()))
        return out

    async def go() -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, Any], bool]:
        cfg = EngineConfig(max_num_seqs=8, max_loras=4, max_lora_rank=16, adafuse_merge_after=3)
        eng = Engine(
            tiny.model_dir, root, device="cuda", dtype="float32", config=cfg, model_name="tiny"
        )
        # Before any request: nothing can be merged yet.
        pristine = [t.clone() for layer in eng.model.layers for t in layer.values()]
        jobs = {
            f"{i}-{n}": (tiny.encode(p), n)
            for i, p in enumerate(PROMPTS)
            for n in (None, "alpha", *SETS)
        }
        streams = {
            rid: eng.submit(request(rid, ids, n, max_tokens=6)) for rid, (ids, n) in jobs.items()
        }
        mixed = {rid: tokens(await collect(s)) for rid, s in streams.items()}
        alone = {}
        for name in sets:  # alone: decode steps run in a graph, gated (solo graph) or merged
            alone[name] = tokens(
                await collect(
                    eng.submit(
                        request(f"alone-{name}", tiny.encode(PROMPTS[2]), name, max_tokens=6)
                    )
                )
            )
        await async_wait_until(
            lambda: eng.merge_policy.merged is None,
            timeout=2.0,
            what="the backbone restored after the merged decode",
        )
        restored = all(
            torch.equal(a, b)
            for a, b in zip(
                pristine, (t for layer in eng.model.layers for t in layer.values()), strict=True
            )
        )
        info = eng.describe()
        await eng.shutdown()
        return mixed, alone, info, restored

    mixed, alone, info, restored = asyncio.run(go())
    assert info["adafuse_merges"] > 0, info  # CONST: the selection repeats, so it merges
    assert info["adafuse_solo_graph_steps"] > 0, info
    assert info["adafuse_gated_steps"] > 0, info
    assert info["cuda_graphs"], info
    for rid, got in mixed.items():
        i, name = rid.split("-", 1)
        assert got == greedy(
            list(tiny.encode(PROMPTS[int(i)])), None if name == "None" else name, 6
        ), rid
    for name, got in alone.items():
        assert got == greedy(list(tiny.encode(PROMPTS[2])), name, 6), name
    assert restored


def test_dora_rows_on_cuda_match_peft(tmp_path: Path) -> None:
    # DoRA, plain LoRA and base rows in one batch on the Triton path: graph replay with the
    # side-stream shrink (the factor gathered after the deferred term) and eager steps with
    # the serial path, fp32 against peft; bf16 serves the same batch.
    from .fidelity_helpers import PROMPT, Ref, build_model, peft_adapter

    model_dir = build_model(tmp_path / "m", "llama", seed=3, pad_token_id=0, mlp_bias=True)
    root = tmp_path / "adapters"
    peft_adapter(
        root, model_dir, "d4", 11, r=4, use_dora=True, target_modules=["q_proj", "down_proj"]
    )
    peft_adapter(root, model_dir, "d8", 12, r=8, use_dora=True, use_rslora=True,
                 target_modules="all-linear")  # fmt: skip
    peft_adapter(root, model_dir, "p4", 13, r=4, target_modules=["v_proj", "o_proj"])
    names: list[str | None] = [None, "d4", "d8", "p4"]
    prompts = [PROMPT, PROMPT[3:7]]
    ref = Ref(model_dir, root, ["d4", "d8", "p4"])

    def run(graphs: bool, overlap: bool, dtype: str) -> tuple[dict[str, list[int]], Any]:
        async def go() -> tuple[dict[str, list[int]], Any]:
            cfg = EngineConfig(
                max_num_seqs=8,
                max_loras=3,
                max_lora_rank=16,
                max_prefill_chunk=5,
                use_cuda_graphs=graphs,
                lora_overlap=overlap,
                lora_dora=True,
            )
            eng = Engine(model_dir, root, device="cuda", dtype=dtype, config=cfg)
            streams = {
                f"{i}-{n}": eng.submit(request(f"{i}-{n}", p, n, max_tokens=6))
                for i, p in enumerate(prompts)
                for n in names
            }
            outs = {rid: tokens(await collect(s)) for rid, s in streams.items()}
            info = eng.describe()
            await eng.shutdown()
            return outs, info

        return asyncio.run(go())

    def greedy(ids: list[int], name: str | None) -> list[int]:
        out: list[int] = []
        for _ in range(6):
            out.append(int(ref.logits(ids + out, name)[-1].argmax()))
        return out

    replayed, info = run(graphs=True, overlap=True, dtype="float32")
    assert info["cuda_graphs"], info
    for rid, got in replayed.items():
        i, name = rid.split("-", 1)
        assert got == greedy(list(prompts[int(i)]), None if name == "None" else name), rid
    eager, _ = run(graphs=False, overlap=False, dtype="float32")
    assert eager == replayed
    bf16, _ = run(graphs=True, overlap=True, dtype="bfloat16")
    assert all(len(v) == 6 for v in bf16.values())
