"""AdaFuse expert sets served by the engine.

The oracle is written here, independently of the engine and the kernels: the plain
transformers model where, for every token t, each targeted linear layer uses
``W_t = W + c * sum_j g_tj * B[e_tj] @ A[e_tj]``, with ``(e_t, g_t)`` the top-k softmax of the
router applied to the token's first-layer input (its embedding).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from waiting import async_wait_until

from adaptermesh.worker import adafuse as adafuse_mod
from adaptermesh.worker.adapters import AdapterValidationError
from adaptermesh.worker.types import AdapterNotFoundError
from adaptermesh_testkit.checkpoints import make_adafuse_expert_set

from .conftest import PROMPTS, Tiny, collect, request, tokens

# name -> (num_experts, top_k, rank, targets, seed, use_rslora)
SETS: dict[str, tuple[int, int, int, tuple[str, ...], int, bool]] = {
    "moe": (4, 2, 4, ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), 11, False),
    "moe_k1": (3, 1, 8, ("k_proj", "up_proj"), 12, True),
}
# A copy of "moe" whose router ignores the token (zero weight, distinct biases): every token
# picks the same experts with the same gates, so the selection repeats on every step.
CONST = "moe_const"
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class ExpertSetReference:
    """transformers base model + per-token merged expert weights, one request at a time."""

    def __init__(self, model_dir: Path, root: Path, names: list[str]) -> None:
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            )
        self.model.eval()
        self.sets = {n: self._read(root / n) for n in names}

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        meta = json.loads((path / "adaptermesh_adafuse.json").read_text())
        router = load_file(str(path / "router.safetensors"))
        r, alpha = meta["r"], meta["lora_alpha"]
        scale = alpha / (r**0.5 if meta["use_rslora"] else r)
        deltas: dict[tuple[int, str], torch.Tensor] = {}  # [E, out, in] = B_e @ A_e
        for e in range(meta["num_experts"]):
            t = load_file(str(path / "experts" / str(e) / "adapter_model.safetensors"))
            for key, a in t.items():
                if not key.endswith("lora_A.weight"):
                    continue
                parts = key.split(".")
                layer, module = int(parts[4]), parts[6]
                b = t[key.replace("lora_A", "lora_B")]
                deltas.setdefault(
                    (layer, module), torch.zeros(meta["num_experts"], b.shape[0], a.shape[1])
                )[e] = b @ a
        return {"meta": meta, "router": router, "scale": scale, "deltas": deltas}

    def logits(self, ids: list[int], name: str | None) -> torch.Tensor:
        x = torch.tensor([ids])
        hooks = []
        if name is not None:
            s = self.sets[name]
            emb = self.model.model.embed_tokens(x)[0]  # the first decoder layer's input
            rl = emb @ s["router"]["weight"].T
            if "bias" in s["router"]:
                rl = rl + s["router"]["bias"]
            vals, experts = torch.topk(rl, s["meta"]["top_k"], dim=-1)
            gates = torch.softmax(vals, dim=-1)
            for (layer, module), delta in s["deltas"].items():
                lin = getattr(getattr(self.model.model.layers[layer], _PARENT[module]), module)
                # One merged weight per token: W_t = W + c * sum_j g_tj * B_e A_e.
                w_t = lin.weight.unsqueeze(0) + s["scale"] * torch.einsum(
                    "tk,tkoi->toi", gates, delta[experts]
                )

                def hook(mod: Any, inp: Any, out: Any, w_t: torch.Tensor = w_t) -> torch.Tensor:
                    return torch.einsum("bti,toi->bto", inp[0], w_t)

                hooks.append(lin.register_forward_hook(hook))
        try:
            with torch.no_grad():
                return self.model(input_ids=x).logits[0].float()
        finally:
            for h in hooks:
                h.remove()


@pytest.fixture(scope="module")
def moe_root(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_expert_sets(tiny, tmp_path_factory.mktemp("wk_moe") / "adapters")


def write_expert_sets(tiny: Tiny, root: Path) -> Path:
    """The tiny model's adapters plus every set in SETS and CONST under ``root``."""
    shutil.copytree(tiny.root, root)
    for name, (e, k, r, targets, seed, rs) in SETS.items():
        make_adafuse_expert_set(
            root, tiny.model_dir, name, e, k, r, targets, seed, rs, router_std=2.0, scale_b=0.1
        )
    # A set whose every token routes alike, so its decode repeats one selection and merges.
    shutil.copytree(root / "moe", root / CONST)
    router = load_file(str(root / CONST / "router.safetensors"))
    save_file(
        {"weight": torch.zeros_like(router["weight"]), "bias": torch.tensor([0.3, -0.5, 0.9, 0.0])},
        str(root / CONST / "router.safetensors"),
    )
    return root


@pytest.fixture(scope="module")
def moe_ref(tiny: Tiny, moe_root: Path) -> ExpertSetReference:
    return ExpertSetReference(tiny.model_dir, moe_root, [*SETS, CONST])


def _check(
    rid: str,
    ids: tuple[int, ...],
    got: list[int],
    want_logits: Callable[[list[int]], torch.Tensor],
    log: dict[str, list[torch.Tensor]],
) -> None:
    ref = want_logits(list(ids) + got[:-1])[len(ids) - 1 :]
    assert got == [int(r.argmax()) for r in ref], rid
    torch.testing.assert_close(torch.stack(log[rid]), ref, atol=2e-4, rtol=1e-4)


async def _idle(eng: Any) -> None:
    """Wait until the engine has gone idle and restored the backbone (it does so on its own)."""
    await async_wait_until(
        lambda: eng.merge_policy.merged is None and not eng.scheduler.running,
        what="the engine to restore the backbone while idle",
    )


def _weights(eng: Any) -> list[torch.Tensor]:
    return [t.clone() for layer in eng.model.layers for t in layer.values()]


def test_oracle_is_not_vacuous(tiny: Tiny, moe_ref: ExpertSetReference) -> None:
    ids = list(tiny.encode(PROMPTS[1]))
    base = moe_ref.logits(ids, None)
    for name in SETS:
        assert (moe_ref.logits(ids, name) - base).abs().max() > 1e-2, name
    # Different tokens pick different experts, so per-token routing matters.
    s = moe_ref.sets["moe"]
    emb = moe_ref.model.model.embed_tokens(torch.tensor([ids]))[0]
    picks = {
        tuple(sorted(r)) for r in torch.topk(emb @ s["router"]["weight"].T, 2).indices.tolist()
    }
    assert len(picks) > 1


async def test_expert_sets_in_mixed_batch_match_reference(
    tiny: Tiny,
    moe_root: Path,
    moe_ref: ExpertSetReference,
    make_engine: Any,
    logit_log: dict[str, list[torch.Tensor]],
) -> None:
    eng = make_engine(root=moe_root, max_num_seqs=8, max_prefill_chunk=6, max_num_batched_tokens=20)
    pristine = _weights(eng)
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        for j, name in enumerate([None, "alpha", "gamma", *SETS]):
            jobs.append((f"m{i}-{name}", tiny.encode(prompt), name, 5 + (i + j) % 4))
    streams = [eng.submit(request(rid, ids, name, max_tokens=n)) for rid, ids, name, n in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for (rid, ids, name, n), events in zip(jobs, results, strict=True):
        got = tokens(events)
        assert len(got) == n, rid
        if name in SETS or name is None:
            _check(rid, ids, got, lambda full, name=name: moe_ref.logits(full, name), logit_log)
        else:
            _check(rid, ids, got, lambda full, name=name: tiny.ref.logits(full, name), logit_log)
    info = eng.describe()
    assert info["adafuse_gated_steps"] > 0
    assert info["expert_sets"] == len(SETS)
    await _idle(eng)
    assert all(torch.equal(a, b) for a, b in zip(_weights(eng), pristine, strict=True))
    assert {a.name: a.rank for a in eng.list_adapters() if a.name in SETS} == {
        "moe": 4,
        "moe_k1": 8,
    }


async def test_single_request_merges_and_restores_backbone_exactly(
    tiny: Tiny,
    moe_root: Path,
    moe_ref: ExpertSetReference,
    make_engine: Any,
    logit_log: dict[str, list[torch.Tensor]],
) -> None:
    # adafuse_merge_after=1: every decode step merges its selection (or finds it merged).
    eng = make_engine(root=moe_root, adafuse_merge_after=1)
    ids = tiny.encode(PROMPTS[2])
    base_before = tokens(await collect(eng.submit(request("base-before", ids, None, max_tokens=8))))
    pristine = _weights(eng)
    for k, name in enumerate(["moe", "moe_k1", "moe"]):
        rid = f"alone-{k}-{name}"
        got = tokens(await collect(eng.submit(request(rid, ids, name, max_tokens=8))))
        _check(rid, ids, got, lambda full, name=name: moe_ref.logits(full, name), logit_log)
    info = eng.describe()
    # Prompt prefill (many tokens) took the gated path; every decode step the merged path.
    assert info["adafuse_gated_steps"] == 3
    assert info["adafuse_merges"] >= 3
    assert info["adafuse_merged_steps"] == 3 * 7
    assert info["adafuse_solo_gated_steps"] == 0
    # The engine restores the backbone when it goes idle; bit for bit, no drift.
    await _idle(eng)
    assert all(torch.equal(a, b) for a, b in zip(_weights(eng), pristine, strict=True))
    assert (
        tokens(await collect(eng.submit(request("base-after", ids, None, max_tokens=8))))
        == base_before
    )


async def test_merged_request_then_other_requests_see_clean_backbone(
    tiny: Tiny,
    moe_root: Path,
    moe_ref: ExpertSetReference,
    make_engine: Any,
    logit_log: dict[str, list[torch.Tensor]],
) -> None:
    # A base and a LoRA request arrive while an expert-set request decodes alone on merged
    # weights: the backbone must be restored before their first step.
    eng = make_engine(root=moe_root, adafuse_merge_after=1)
    ids = tiny.encode(PROMPTS[1])
    stream = eng.submit(request("solo", ids, "moe", max_tokens=12))
    it = stream.__aiter__()
    events = [await it.__anext__() for _ in range(3)]
    assert eng.describe()["adafuse_merges"] >= 1
    others = [eng.submit(request(f"late-{n}", ids, n, max_tokens=5)) for n in (None, "alpha")]
    events += [e async for e in it]
    late = await asyncio.gather(*(collect(s) for s in others))
    _check("solo", ids, tokens(events), lambda full: moe_ref.logits(full, "moe"), logit_log)
    _check("late-None", ids, tokens(late[0]), lambda full: tiny.ref.logits(full, None), logit_log)
    _check(
        "late-alpha", ids, tokens(late[1]), lambda full: tiny.ref.logits(full, "alpha"), logit_log
    )
    assert eng.describe()["adafuse_restores"] >= 1


async def test_repeated_selection_merges_after_n_tokens(
    tiny: Tiny,
    moe_root: Path,
    moe_ref: ExpertSetReference,
    make_engine: Any,
    logit_log: dict[str, list[torch.Tensor]],
) -> None:
    # Every token of CONST selects the same experts and gates. With N = 3, decode steps 1 and 2
    # take the gated path on the clean backbone, step 3 merges, steps 4..7 run merged.
    eng = make_engine(root=moe_root, adafuse_merge_after=3)
    pristine = _weights(eng)
    ids = tiny.encode(PROMPTS[1])
    got = tokens(await collect(eng.submit(request("const", ids, CONST, max_tokens=8))))
    _check("const", ids, got, lambda full: moe_ref.logits(full, CONST), logit_log)
    info = eng.describe()
    counts = {
        k: info[f"adafuse_{k}"]
        for k in ("merges", "merged_steps", "solo_gated_steps", "compensated_steps", "gated_steps")
    }
    assert counts == {
        "merges": 1,
        "merged_steps": 5,
        "solo_gated_steps": 2,
        "compensated_steps": 0,
        "gated_steps": 1,
    }
    await _idle(eng)
    assert eng.describe()["adafuse_restores"] == 1
    assert all(torch.equal(a, b) for a, b in zip(_weights(eng), pristine, strict=True))
    # adafuse_merge_after=0 never merges: the same request stays on the gated path throughout.
    eng0 = make_engine(root=moe_root, adafuse_merge_after=0)
    got0 = tokens(await collect(eng0.submit(request("const0", ids, CONST, max_tokens=8))))
    _check("const0", ids, got0, lambda full: moe_ref.logits(full, CONST), logit_log)
    assert (eng0.merge_policy.merges, eng0.merge_policy.solo_gated_steps) == (0, 7)


def _distinct_selection_tokens(ref: ExpertSetReference, name: str, vocab: int, n: int) -> list[int]:
    """n tokens whose routing (experts and gates) differs pairwise, by the oracle's router."""
    s = ref.sets[name]
    emb = ref.model.model.embed_tokens.weight[:vocab].detach()
    rl = emb @ s["router"]["weight"].T + s["router"]["bias"]
    picks = torch.topk(rl, s["meta"]["top_k"], dim=-1).indices.tolist()
    out: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for tok in range(3, vocab):
        key = tuple(picks[tok])
        if key not in seen:
            seen.add(key)
            out.append(tok)
        if len(out) == n:
            return out
    raise AssertionError(f"only {len(out)} distinct selections")


@pytest.mark.parametrize("packed", [True, False], ids=["packed-sgmm", "gated-kernels"])
async def test_changing_selection_stays_unmerged_and_cancels_merged_one(
    tiny: Tiny,
    moe_root: Path,
    moe_ref: ExpertSetReference,
    make_engine: Any,
    logit_log: dict[str, list[torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    packed: bool,
) -> None:
    # One-token prompt chunks make every prompt token a single-request step whose selection the
    # test chooses. N = 2: a repeated token merges; a changed selection runs gated over the
    # merged weights, cancelling the merged experts with negated gates, and does not re-merge.
    # Both solo implementations: experts packed as one SGMM LoRA, and the per-token kernels.
    if not packed:
        monkeypatch.setattr(adafuse_mod, "PACKED_MAX_RANK", 0)
    a, b, c, d = _distinct_selection_tokens(moe_ref, "moe", 200, 4)
    prompt = (a, a, b, b, b, c, a, d)
    # step:   gated, merge a, gated-over-a, merge b, merged, gated-over-b, gated-over-b, gated-over-b
    eng = make_engine(root=moe_root, adafuse_merge_after=2, max_prefill_chunk=1)
    pristine = _weights(eng)
    got = tokens(await collect(eng.submit(request("walk", prompt, "moe", max_tokens=1))))
    _check("walk", prompt, got, lambda full: moe_ref.logits(full, "moe"), logit_log)
    info = eng.describe()
    counts = {
        k: info[f"adafuse_{k}"]
        for k in ("merges", "merged_steps", "solo_gated_steps", "compensated_steps", "gated_steps")
    }
    assert counts == {
        "merges": 2,
        "merged_steps": 3,
        "solo_gated_steps": 5,
        "compensated_steps": 4,
        "gated_steps": 0,
    }
    await _idle(eng)
    assert all(torch.equal(x, y) for x, y in zip(_weights(eng), pristine, strict=True))
    # The same walk followed by decode steps: every logit still matches the oracle.
    got = tokens(await collect(eng.submit(request("walk-decode", prompt, "moe", max_tokens=6))))
    _check("walk-decode", prompt, got, lambda full: moe_ref.logits(full, "moe"), logit_log)
    assert eng.merge_policy.compensated_steps >= 8
    assert bool(eng.adapters.expert_sets["moe"].expert_set.packed) == packed


async def test_bad_merge_after_is_rejected(make_engine: Any) -> None:
    from adaptermesh.worker.types import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="adafuse_merge_after"):
        make_engine(adafuse_merge_after=-1)


async def test_load_unload_reload_and_eviction(
    tiny: Tiny, moe_root: Path, make_engine: Any
) -> None:
    eng = make_engine(root=moe_root, max_expert_sets=1)
    info = await eng.load_adapter("moe", "moe")
    assert (info.name, info.rank, info.resident_on_gpu) == ("moe", 4, True)
    v1 = eng.adapters.version("moe")
    await eng.load_adapter("moe", "moe")
    assert eng.adapters.version("moe") == v1 + 1
    ids = tiny.encode(PROMPTS[0])
    await collect(eng.submit(request("a", ids, "moe_k1", max_tokens=2)))  # evicts moe (limit 1)
    assert set(eng.adapters.expert_sets) == {"moe_k1"}
    assert eng.adapters.counters.expert_set_evictions == 1
    await eng.unload_adapter("moe_k1")
    assert "moe_k1" not in {a.name for a in eng.list_adapters()}
    with pytest.raises(AdapterNotFoundError):
        await eng.unload_adapter("moe_k1")


# ---- bad input ------------------------------------------------------------------------------


def _edit_json(rel: str, **changes: Any) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        cfg = json.loads((p / rel).read_text())
        cfg.update(changes)
        (p / rel).write_text(json.dumps(cfg))

    return mutate


def _router_shape(p: Path) -> None:
    t = load_file(str(p / "router.safetensors"))
    t["weight"] = t["weight"][:, :-1].contiguous()
    save_file(t, str(p / "router.safetensors"))


def _corrupt_router(p: Path) -> None:
    data = (p / "router.safetensors").read_bytes()
    (p / "router.safetensors").write_bytes(data[: len(data) // 2])


def _drop_expert_tensor(p: Path) -> None:
    st = p / "experts" / "2" / "adapter_model.safetensors"
    t = load_file(str(st))
    t.pop(sorted(t)[0])
    save_file(t, str(st))


def _escape(p: Path) -> None:
    outside = p.parent.parent / "outside_expert"
    shutil.copytree(p / "experts" / "0", outside)
    shutil.rmtree(p / "experts" / "0")
    os.symlink(outside, p / "experts" / "0")


BAD_SETS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "missing-expert": (lambda p: shutil.rmtree(p / "experts" / "3"), "experts/3", "missing"),
    "extra-expert": (
        lambda p: shutil.copytree(p / "experts" / "0", p / "experts" / "9"),
        "experts",
        "'9'",
    ),
    "top-k": (_edit_json("adaptermesh_adafuse.json", top_k=5), "top_k", r"\[1, 4\]"),
    "num-experts": (
        _edit_json("adaptermesh_adafuse.json", num_experts=0),
        "num_experts",
        "integer",
    ),
    "router-dims": (
        _edit_json("adaptermesh_adafuse.json", router={"hidden_size": 65, "bias": True}),
        "router.hidden_size",
        "hidden size 64",
    ),
    "router-shape": (_router_shape, "router.safetensors", "has shape"),
    "router-corrupt": (_corrupt_router, "router.safetensors", "corrupt or truncated"),
    "rank-too-large": (_edit_json("adaptermesh_adafuse.json", r=1024), "r", "integer"),
    "expert-rank": (
        _edit_json("experts/1/adapter_config.json", r=8),
        "experts/1/adapter_config.json: r",
        "the expert set says 4",
    ),
    "expert-targets": (
        _edit_json("experts/1/adapter_config.json", target_modules=["q_proj"]),
        "experts/1/adapter_config.json: target_modules",
        "must resolve",
    ),
    "expert-tensor": (_drop_expert_tensor, "experts/2/adapter_model.safetensors", "missing tensor"),
    "absent-module": (
        _edit_json("adaptermesh_adafuse.json", target_modules=["q_proj", "c_attn"]),
        "target_modules",
        "'c_attn' is not a module",
    ),
    "bad-json": (
        lambda p: (p / "adaptermesh_adafuse.json").write_text("{nope"),
        "adaptermesh_adafuse.json",
        "unreadable",
    ),
    "symlink-escape": (_escape, "experts/0", "outside the adapter root"),
}


@pytest.mark.parametrize("kind", list(BAD_SETS))
async def test_bad_expert_set_rejected_and_engine_keeps_serving(
    tiny: Tiny, moe_root: Path, tmp_path: Path, make_engine: Any, kind: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(moe_root / "moe", root / "bad")
    shutil.copytree(moe_root / "alpha", root / "alpha")
    mutate, field, message = BAD_SETS[kind]
    mutate(root / "bad")
    eng = make_engine(root=root)
    with pytest.raises(AdapterValidationError, match=message) as err:
        await eng.load_adapter("bad", "bad")
    assert err.value.field == field
    assert all(a.name != "bad" for a in eng.list_adapters())
    # On demand: raised from the stream before any token, then negative-cached.
    with pytest.raises(AdapterNotFoundError, match=message):
        await collect(eng.submit(request("od", tiny.encode("hi"), "bad")))
    with pytest.raises(AdapterNotFoundError):
        eng.submit(request("od2", tiny.encode("hi"), "bad"))
    ids = tiny.encode(PROMPTS[0])
    for name in (None, "alpha"):
        got = tokens(await collect(eng.submit(request(f"ok-{name}", ids, name, max_tokens=4))))
        assert got == tiny.ref.greedy(list(ids), name, 4)
