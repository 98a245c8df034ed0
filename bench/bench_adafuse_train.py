"""AdaFuse training run: the loss curve of a router + LoRA experts trained on real text, and
whether the engine then serves the written set with the training-time forward's tokens.

The base model is a random Llama-shape checkpoint built here (no downloads); the text is this
repository's own documentation (``docs/*.md`` and ``README.md``: real English prose and
tables, a few hundred KB). The experts learn the text over the frozen random base, so the
curve shows the training machinery at work (pre-gating, top-k, the balance term), not a
language model's quality.

  # GPU (H200): hidden 1024, 8 layers, E=8, k=2, r=16 on all seven modules, 300 steps
  PYTHONPATH=src python3 bench/bench_adafuse_train.py --device cuda \\
      --out bench/results/adafuse_train_h200.json
  # CPU, reduced (the same code path on the tiny shape, about a minute)
  PYTHONPATH=src python3 bench/bench_adafuse_train.py --device cpu --tiny \\
      --out bench/results/adafuse_train_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from adaptermesh.worker.adafuse_train import (
    TextDataset,
    TrainConfig,
    load_base,
    train,
    write_expert_set,
)
from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SHAPES: dict[str, dict[str, int]] = {
    # ~0.1B parameters: big enough for real GEMMs, small enough to train in a few minutes.
    "small": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
}
PROMPTS = ["The control plane", "Adapters are directories", "The worker engine batches"]


def log(msg: str) -> None:
    print(f"[bench_adafuse_train] {msg}", file=sys.stderr, flush=True)


def corpus(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    for f in files:
        if f.is_file():
            (dest / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    return dest


async def serve_check(
    model: Any, model_dir: Path, root: Path, name: str, tok: Any, device: str, dtype: str, n: int
) -> dict[str, Any]:
    """Greedy tokens from the engine serving the written set vs the training-time forward."""
    eng = Engine(
        model_dir,
        root,
        config=EngineConfig(max_num_seqs=4, max_loras=2, max_lora_rank=64),
        model_name="base",
        device=device,
        dtype=dtype,
    )
    rows = []
    try:
        for i, text in enumerate(PROMPTS):
            prompt = list(tok(text)["input_ids"])
            ids, ref = list(prompt), []
            with torch.no_grad():
                for _ in range(n):
                    logits = model(torch.tensor([ids], device=device))[0][0, -1]
                    ref.append(int(logits.argmax()))
                    ids.append(ref[-1])
            req = GenerationRequest(f"p{i}", tuple(prompt), name, SamplingParams(max_tokens=n))
            got = [e.token_id async for e in eng.submit(req) if e.token_id is not None]
            agree = next(
                (j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                min(len(got), len(ref)),
            )
            rows.append(
                {"prompt": text, "engine": got, "training_forward": ref, "agree_prefix": agree}
            )
    finally:
        await eng.shutdown()
    return {
        "tokens": n,
        "prompts": rows,
        "all_equal": all(r["engine"] == r["training_forward"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="reduced run: tiny shape, few steps (CPU check)"
    )
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="default 300 (tiny: 40)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 16 (tiny: 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 256 (tiny: 64)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--balance-coef", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    shape = "tiny" if args.tiny else "small"
    steps = args.steps or (40 if args.tiny else 300)
    batch = args.batch_size or (4 if args.tiny else 16)
    seq = args.seq_len or (64 if args.tiny else 256)
    dtype_name = "bfloat16" if args.device == "cuda" else "float32"
    cfg = TrainConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        rank=args.rank,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        steps=steps,
        batch_size=batch,
        seq_len=seq,
        lr=args.lr,
        warmup_steps=max(1, steps // 20),
        balance_coef=args.balance_coef,
        eval_every=max(1, steps // 10),
        seed=args.seed,
    )
    cfg.validate()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_adafuse_train_") as tmp:
        work = Path(tmp)
        log(f"building the {shape} base model")
        model_dir = make_tiny_model(work / "model", init_std=0.02, **SHAPES[shape])
        data_dir = corpus(work / "data")
        base, tok = load_base(model_dir, args.device, getattr(torch, dtype_name))
        n_params = sum(p.numel() for p in base.parameters())
        data = TextDataset(data_dir, tok, cfg.seq_len, cfg.eval_fraction)
        log(
            f"{n_params / 1e6:.1f}M base parameters; {data.num_tokens} tokens in {len(data.files)} files"
        )

        def report(r: Any) -> None:
            if r.eval_loss is not None:
                log(
                    f"step {r.step}: lm {r.lm_loss:.3f} balance {r.balance_loss:.3f} eval {r.eval_loss:.3f}"
                )

        if args.device == "cuda":
            torch.cuda.synchronize()
        result = train(base, data, cfg, log=report)
        if args.device == "cuda":
            torch.cuda.synchronize()
        assert result.model is not None
        root = work / "adapters"
        write_expert_set(result.model, model_dir, root / "trained")
        result.model.eval()
        served = asyncio.run(
            serve_check(
                result.model,
                model_dir,
                root,
                "trained",
                tok,
                args.device,
                dtype_name,
                8 if args.tiny else 16,
            )
        )
        log(f"engine == training forward on every prompt: {served['all_equal']}")
    curve = result.curve()
    usage = torch.tensor([r.usage for r in result.records[-max(1, steps // 10) :]]).mean(0).tolist()
    first = sum(r.lm_loss for r in result.records[:5]) / min(5, len(result.records))
    last = sum(r.lm_loss for r in result.records[-5:]) / min(5, len(result.records))
    out: dict[str, Any] = {
        "bench": "bench_adafuse_train",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else (platform.processor() or platform.machine()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {"name": shape, **SHAPES[shape], "base_parameters": n_params, "dtype": dtype_name},
        "data": {
            "files": [f.name for f in data.files],
            "tokens": data.num_tokens,
            "train_tokens": result.train_tokens,
            "eval_tokens": result.eval_tokens,
        },
        "summary": {
            "train_seconds": result.seconds,
            "tokens_per_s": steps * batch * seq / result.seconds if result.seconds else None,
            "lm_loss_first5": first,
            "lm_loss_last5": last,
            "base_eval_loss": result.base_eval_loss,
            "final_eval_loss": result.final_eval_loss,
            "expert_usage_last10pct": usage,
            "min_expert_usage": min(usage),
            "engine_matches_training_forward": served["all_equal"],
            "wall_seconds": time.perf_counter() - started,
        },
        "serve_check": served,
        "curve": curve,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    log(f"wrote {args.out}: eval loss {result.base_eval_loss:.3f} -> {result.final_eval_loss:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
