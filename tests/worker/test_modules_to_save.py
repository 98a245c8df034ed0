"""Trained module copies (PEFT ``modules_to_save``) against transformers + peft: one batch
mixing base rows, plain LoRA rows and rows whose adapters save embed_tokens, lm_head and the
norms gives every request peft's greedy tokens and close logits, each row seeing its own
modules; copies of anything else, of a resized vocabulary, or on a worker without the pool's
tables are refused by name; the pool and the CPU cache count the copies, and an adapter's
copies leave with its slot."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .fidelity_helpers import (
    PROMPT,
    build_model,
    match_case,
)

PROMPTS = [PROMPT, PROMPT[3:8]]
ALL = ("embed_tokens", "lm_head", "norms")


def saved_adapter(root: Path, model_dir: Path, name: str, seed: int, **lora: Any) -> Path:
    """An adapter saved by peft itself, with random non-zero LoRA factors and every trained
    copy (``modules_to_save``) moved off the base module it starts as."""
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
                    # A trained copy: the base weight moved by a few percent of its size.
                    p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
                elif "lora_A" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_embedding_A" in n:
                    p.copy_(torch.randn(p.shape, generator=gen))
                elif "lora_embedding_B" in n or "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        pm.save_pretrained(str(root / name))
    return root / name


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("mts") / "m", "llama", seed=3, pad_token_id=0)


def _mixed_root(root: Path, model_dir: Path) -> list[str]:
    saved_adapter(
        root, model_dir, "emb", 1, r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]
    )
    saved_adapter(
        root,
        model_dir,
        "head",
        2,
        r=8,
        target_modules=["v_proj", "down_proj"],
        modules_to_save=["lm_head"],
    )
    saved_adapter(
        root, model_dir, "norms", 3, r=4, target_modules="all-linear", modules_to_save=["norm"]
    )
    saved_adapter(
        root,
        model_dir,
        "all",
        4,
        r=6,
        use_rslora=True,
        target_modules=["o_proj", "up_proj"],
        modules_to_save=["embed_tokens", "lm_head", "input_layernorm", "model.norm"],
    )
    saved_adapter(root, model_dir, "plain", 5, r=4, target_modules=["q_proj", "v_proj"])
    return ["emb", "head", "norms", "all", "plain"]  # fmt: skip


def test_copy_rows_and_plain_rows_in_one_batch_match_peft(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    names = _mixed_root(root, llama)
    # Four slots for five adapters: slots change hands mid-run, so a slot's copies must follow
    # what it holds (a plain adapter after one with copies must read none of them).
    match_case(
        llama,
        root,
        names,
        PROMPTS,
        n=4,
        tag="mts-",
        lora_saved_modules=ALL,
        max_loras=4,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )
