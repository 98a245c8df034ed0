"""Shared harness of the fidelity suites (test_fidelity*.py): tiny checkpoints saved by
transformers, adapters saved by peft, the transformers + peft reference, and one mixed batch
through the engine compared with it request by request.

The engine runs on ``ADAPTERMESH_TEST_DEVICE`` (default ``cpu``; ``cuda`` or ``cuda:N`` runs the
Triton kernels: SGMM add_lora, paged attention, the fused norms, RoPE and activations). The
reference always runs on the CPU in fp32, and the engine in fp32 on either device: Triton's
fp32 ``tl.dot`` runs with IEEE products (no TF32) and torch's fp32 matmuls are held at
"highest" precision, so token-for-token equality stays meaningful on the GPU too.

``ADAPTERMESH_FIDELITY_EXAMPLES`` sets how many Hypothesis examples each property test draws
(default 10). ``ADAPTERMESH_FIDELITY_DIFF_LOG`` names a file that receives one JSON line per
compared request (test id, device, largest |logit difference|); bench/fidelity_gpu.py reads it.

No pytest-asyncio needed: every test drives the engine with ``asyncio.run``, so the suite runs
with nothing but pytest and hypothesis on the GPU machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from adaptermesh_testkit.checkpoints import make_tokenizer

from .conftest import LogitLog, collect, request, tokens

__all__ = [
    "DEVICE",
    "EXAMPLES",
    "PROMPT",
    "TOLERANCE",
    "Ref",
    "adapter_case",
    "assert_matches",
    "build_model",
    "engine_config",
    "kernel_calls",
    "match_case",
    "peft_adapter",
    "run_random_case",
]


def _device() -> torch.device:
    raw = os.environ.get("ADAPTERMESH_TEST_DEVICE", "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", raw):
        raise ValueError(f"ADAPTERMESH_TEST_DEVICE must be cpu, cuda or cuda:N, got {raw!r}")
    dev = torch.device(raw)
    if dev.type == "cuda":
        # Asked for the GPU: a machine without one fails the run instead of passing on the CPU.
        if not torch.cuda.is_available():
            raise RuntimeError(f"ADAPTERMESH_TEST_DEVICE={raw} but torch sees no CUDA device")
        torch.set_float32_matmul_precision("highest")  # no TF32 in the base matmuls
    return dev


DEVICE = _device()
EXAMPLES = int(os.environ.get("ADAPTERMESH_FIDELITY_EXAMPLES", "10"))
# (atol, rtol) on fp32 logits, atol per unit of the largest |logit| of the compared request
# (Gemma's scaled embeddings and tied head give logits tens of units large). The CPU engine
# and transformers run the same torch ops in another order; on CUDA the Triton kernels reduce
# in other orders again (split-K SGMM, online-softmax attention with exp2), still in IEEE fp32.
TOLERANCE: tuple[float, float] = (2e-4, 1e-4) if DEVICE.type == "cpu" else (5e-4, 2e-4)

PROMPT = tuple(range(2, 40, 3))  # 13 tokens: longer than every window the suites use


# --- builders ------------------------------------------------------------------------------


def build_model(directory: Path, arch: str, seed: int = 0, **config: Any) -> Path:
    """A random checkpoint saved by transformers, with any config field (biases, activations,
    windows, RoPE scaling) that make_tiny_model does not expose."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(directory)
    base = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    base.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(arch, **base)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(directory, safe_serialization=True)
    return directory


def peft_adapter(root: Path, model_dir: Path, name: str, seed: int, **lora: Any) -> Path:
    """An adapter saved by peft itself from a LoraConfig, with random non-zero A and B (and,
    with ``use_dora``, random magnitudes; with ``modules_to_save``, every trained copy moved
    off the base module it starts as)."""
    import peft
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        )
        pm = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "modules_to_save" in n:
                    # A trained copy: the base weight plus noise of about a third of its
                    # mean magnitude.
                    p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
                elif "lora_A" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_embedding_A" in n:  # [r, vocab]: a token picks a column
                    p.copy_(torch.randn(p.shape, generator=gen))
                elif "lora_embedding_B" in n or "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                elif "lora_magnitude_vector" in n:
                    # DoRA starts at m = ||W|| (a factor of about 1); move it off that.
                    p.mul_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))
        pm.save_pretrained(str(root / name))
    return root / name


class Ref:
    """transformers + peft over a model and any number of adapters (or none), on the CPU.

    The reference runs transformers' eager attention, the one every family's modeling code
    defines: transformers 5.17 loads Gemma 2 with SDPA by default, which does not apply the
    attention soft-capping (5.24 defaults to eager), so the default would make the reference,
    not the engine, depend on the installed version."""

    def __init__(self, model_dir: Path, root: Path, names: list[str]) -> None:
        import peft
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32, attn_implementation="eager"
            )
            if names:
                self.model = peft.PeftModel.from_pretrained(
                    self.model, str(root / names[0]), adapter_name=names[0]
                )
                for n in names[1:]:
                    self.model.load_adapter(str(root / n), adapter_name=n)
        self.model.eval()
        self.has_adapters = bool(names)

    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if adapter is None:
                if not self.has_adapters:
                    return self.model(input_ids=x).logits[0].float()
                with self.model.disable_adapter():
                    return self.model(input_ids=x).logits[0].float()
            self.model.set_adapter(adapter)
            return self.model(input_ids=x).logits[0].float()


# --- the engine on the test device ---------------------------------------------------------


def engine_config(**kw: Any) -> Any:
    """EngineConfig for a fidelity run. CUDA graphs stay off: a replayed graph never calls the
    engine's ``sample_observer`` (``LogitLog``), and graph replay against peft has its own GPU tests
    (tests/worker/test_gpu.py); the kernels are the same ones."""
    from adaptermesh.worker.engine import EngineConfig

    return EngineConfig(
        **{"max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 16, "use_cuda_graphs": False, **kw}
    )


@contextlib.contextmanager
def kernel_calls() -> Iterator[Counter[str]]:
    """Counts which implementation served add_lora and paged attention: ``triton:*`` (the
    kernel modules) or ``torch:*`` (the twins in kernels.reference)."""
    from adaptermesh.kernels import reference, sgmm

    pa_mod = importlib.import_module("adaptermesh.kernels.paged_attention")
    seen: Counter[str] = Counter()
    patched = [
        (sgmm, "add_lora", "triton:add_lora"),
        (pa_mod, "paged_attention", "triton:paged_attention"),
        (reference, "add_lora_ref", "torch:add_lora"),
        (reference, "paged_attention_ref", "torch:paged_attention"),
    ]
    saved = []
    for mod, attr, tag in patched:
        real = getattr(mod, attr)

        def counting(*a: Any, _real: Any = real, _tag: str = tag, **k: Any) -> Any:
            seen[_tag] += 1
            return _real(*a, **k)

        saved.append((mod, attr, real))
        setattr(mod, attr, counting)
    try:
        yield seen
    finally:
        for mod, attr, real in saved:
            setattr(mod, attr, real)


def _log_diff(rid: str, diff: float) -> None:
    path = os.environ.get("ADAPTERMESH_FIDELITY_DIFF_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {"test": test, "request": rid, "device": str(DEVICE), "max_abs_logit_diff": diff}
            )
            + "\n"
        )


async def assert_matches(
    eng: Any,
    ref: Ref,
    names: list[str | None],
    log: dict[str, list[torch.Tensor]],
    prompts: list[tuple[int, ...]],
    n: int = 4,
    tag: str = "",
) -> None:
    """One concurrent batch over ``names`` x ``prompts``: greedy tokens equal the reference's,
    and the logits are close, per request."""
    jobs = [(f"{tag}{i}-{name}", p, name) for i, p in enumerate(prompts) for name in names]
    streams = [eng.submit(request(rid, p, name, max_tokens=n)) for rid, p, name in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    atol, rtol = TOLERANCE
    for (rid, p, name), events in zip(jobs, results, strict=True):
        got = tokens(events)
        assert got, rid
        ref_logits = ref.logits([*p, *got][:-1], name)[len(p) - 1 :]
        want = [int(r.argmax()) for r in ref_logits]
        mine = torch.stack(log[rid])  # the reference ran on the engine's tokens: same shape
        _log_diff(rid, float((mine - ref_logits).abs().max()))
        assert got == want, f"{rid}: engine {got} != reference {want} on {DEVICE}"
        scale = max(1.0, float(ref_logits.abs().max()))
        torch.testing.assert_close(mine, ref_logits, atol=atol * scale, rtol=rtol)


def match_case(
    model_dir: Path,
    root: Path,
    names: list[str],
    prompts: list[tuple[int, ...]],
    *,
    n: int = 4,
    tag: str = "",
    **engine_kw: Any,
) -> None:
    """Build the reference and an engine on DEVICE, run one mixed batch (the base model and
    every adapter over every prompt) and compare. Also checks the device ran its own kernels."""
    from adaptermesh.worker.engine import Engine

    ref = Ref(model_dir, root, names)

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            model_dir,
            root,
            device=DEVICE,
            dtype="float32",
            config=engine_config(**engine_kw),
            model_name="fid",
            sample_observer=log,
        )
        try:
            with kernel_calls() as calls:
                await assert_matches(eng, ref, [None, *names], log, prompts, n=n, tag=tag)
        finally:
            await eng.shutdown()
        want = "triton" if DEVICE.type == "cuda" else "torch"
        other = "torch" if want == "triton" else "triton"
        assert calls[f"{want}:paged_attention"] > 0, dict(calls)
        if names:
            assert calls[f"{want}:add_lora"] > 0, dict(calls)
        assert not any(k.startswith(other) for k in calls), dict(calls)

    asyncio.run(go())


def run_random_case(tmp: Path, case: dict[str, Any], prompts: list[tuple[int, ...]]) -> None:
    """One Hypothesis case: ``{"arch", "cfg", "adapters": [LoraConfig kwargs], "seed"}``."""
    model_dir = build_model(
        tmp / "m", case["arch"], seed=case["seed"], pad_token_id=0, **case["cfg"]
    )
    root = tmp / "adapters"
    names = []
    for i, ad in enumerate(case["adapters"]):
        peft_adapter(root, model_dir, f"a{i}", seed=case["seed"] + i, **ad)
        names.append(f"a{i}")
    rank = max(
        [
            128,
            *(
                max([ad.get("r", 8), *ad.get("rank_pattern", {}).values()])
                for ad in case["adapters"]
            ),
        ]
    )
    match_case(
        model_dir,
        root,
        names,
        prompts,
        n=3,
        tag=f"{case['arch']}-",
        max_loras=max(2, len(names)),
        max_lora_rank=rank,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


# --- Hypothesis strategies ---------------------------------------------------------------


def _pattern_key(draw: st.DrawFn, module: str, layers: int) -> str:
    """A rank/alpha pattern key: the module's name, a regex over one layer's module, or an
    alternation, all forms PEFT's get_pattern_key accepts."""
    parent = (
        "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"
    )
    kind = draw(st.sampled_from(["name", "layer", "regex"]))
    if kind == "name":
        return module
    if kind == "layer":
        return rf"layers\.{draw(st.integers(0, layers - 1))}\.{parent}\.{module}"
    return rf"{parent}\.({module}|nothing_proj)"


@st.composite
def adapter_case(draw: st.DrawFn, modules: tuple[str, ...], layers: int) -> dict[str, Any]:
    """LoraConfig kwargs: rank 1-128, random targets (a list, "all-linear" or a regex string),
    optional exclude_modules, layers_to_transform, rank/alpha patterns and rsLoRA."""
    targets = draw(
        st.lists(st.sampled_from(modules), min_size=1, max_size=len(modules), unique=True)
    )
    ad: dict[str, Any] = {
        "r": draw(st.integers(1, 128)),
        "lora_alpha": float(draw(st.integers(1, 256))),
    }
    form = draw(st.sampled_from(["list", "list", "all-linear", "regex"]))
    if form == "all-linear":
        targets = list(modules)
        ad["target_modules"] = "all-linear"
    elif form == "regex":
        ad["target_modules"] = rf".*\.({'|'.join(sorted(targets))})"
    else:
        ad["target_modules"] = sorted(targets)
    if len(targets) > 1 and draw(st.booleans()):
        excluded = draw(
            st.lists(st.sampled_from(targets), min_size=1, max_size=len(targets) - 1, unique=True)
        )
        ad["exclude_modules"] = sorted(excluded)
        targets = [t for t in targets if t not in excluded]
    if form == "list" and layers > 1 and draw(st.booleans()):
        ad["layers_to_transform"] = sorted(
            draw(st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers, unique=True))
        )
    if draw(st.booleans()):
        ad["rank_pattern"] = {
            _pattern_key(draw, draw(st.sampled_from(targets)), layers): draw(st.integers(1, 128))
        }
    if draw(st.booleans()):
        ad["alpha_pattern"] = {
            _pattern_key(draw, draw(st.sampled_from(targets)), layers): float(
                draw(st.integers(1, 256))
            )
        }
    ad["use_rslora"] = draw(st.booleans())
    return ad
