"""``adaptermesh adafuse-train``: train an AdaFuse expert set from a base model and text files.

    adaptermesh adafuse-train --model BASE_DIR --data TEXT_DIR --out ADAPTER_ROOT/NAME \\
        [--experts 8] [--top-k 2] [--rank 8] [--targets q_proj,k_proj,v_proj,o_proj] \\
        [--steps 200] [--batch-size 8] [--seq-len 256] [--lr 1e-3] [--balance-coef 0.01] \\
        [--device cuda] [--dtype bfloat16] [--curve curve.json] [--overwrite]

The written directory is served by any worker whose adapter root holds it, under its name.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from adaptermesh.clisetup import RawDescriptionDefaultsHelpFormatter
from adaptermesh.worker.adafuse_train import (
    StepRecord,
    TextDataset,
    TrainConfig,
    TrainingError,
    load_base,
    split_targets,
    train,
    write_expert_set,
)

__all__ = ["build_parser", "main"]

log = logging.getLogger("adaptermesh.worker.adafuse_train")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Flags that set a TrainConfig field of the same meaning: (flag, field, type, help). The
# default is the field's; the value is read back from the flag's argparse name.
_ConfigFlags = tuple[tuple[str, str, type, str], ...]
_SET_FLAGS: _ConfigFlags = (
    ("--experts", "num_experts", int, "LoRA experts in the set"),
    ("--top-k", "top_k", int, "experts the router mixes per token"),
    ("--rank", "rank", int, "LoRA rank of each expert (1..128)"),
    ("--alpha", "lora_alpha", float, "lora_alpha (default 2 * rank)"),
)
_TRAINING_FLAGS: _ConfigFlags = (
    ("--steps", "steps", int, "optimiser steps"),
    ("--batch-size", "batch_size", int, "token blocks per step"),
    ("--seq-len", "seq_len", int, "tokens per training block"),
    ("--lr", "lr", float, "learning rate of the experts"),
    ("--router-lr", "router_lr", float, "learning rate of the router (default: --lr)"),
    ("--warmup-steps", "warmup_steps", int, "steps of linear learning-rate warm-up"),
    ("--balance-coef", "balance_coef", float, "weight of the router's load-balancing loss"),
    ("--eval-every", "eval_every", int, "steps between held-out evaluations"),
    (
        "--eval-fraction",
        "eval_fraction",
        float,
        "share of the token blocks held out for evaluation",
    ),
    ("--seed", "seed", int, "random seed (data order, initialisation)"),
)


def _add_config_flags(p: argparse.ArgumentParser, flags: _ConfigFlags) -> None:
    defaults = TrainConfig()
    for flag, field, kind, text in flags:
        p.add_argument(flag, type=kind, default=getattr(defaults, field), help=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adaptermesh adafuse-train",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="base model directory (config.json, *.safetensors, tokenizer)",
    )
    p.add_argument(
        "--data", type=Path, required=True, help="folder of .txt/.md files (searched recursively)"
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="expert-set directory to write (its name is the adapter name)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    _add_config_flags(p, _SET_FLAGS)
    p.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r)")
    p.add_argument(
        "--targets",
        default=",".join(TrainConfig().target_modules),
        help='comma-separated modules or "all-linear"',
    )
    p.add_argument("--no-router-bias", action="store_true", help="a router without a bias term")
    _add_config_flags(p, _TRAINING_FLAGS)
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device to train on",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="base model dtype (default bfloat16 on CUDA, float32 on CPU); experts train in float32",
    )
    p.add_argument("--curve", type=Path, default=None, help="write the loss curve JSON here")
    p.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR: the least severe lines written",
    )
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = vars(args)
    cfg = TrainConfig(
        **{
            field: values[flag.removeprefix("--").replace("-", "_")]
            for flag, field, _, _ in _SET_FLAGS + _TRAINING_FLAGS
        },
        use_rslora=args.rslora,
        target_modules=split_targets(args.targets),
        router_bias=not args.no_router_bias,
    )
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    dtype = (
        _DTYPES[args.dtype]
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    try:
        cfg = config_from_args(args)
        if args.out.exists() and not args.overwrite:
            raise TrainingError(f"out: {args.out} already exists (pass --overwrite to replace it)")
        base, tok = load_base(args.model, args.device, dtype)
        data = TextDataset(args.data, tok, cfg.seq_len, cfg.eval_fraction)
        log.info(
            "data: %d files, %d tokens, %d train / %d eval blocks",
            len(data.files),
            data.num_tokens,
            data.train.shape[0],
            data.eval.shape[0],
        )

        def report(r: StepRecord) -> None:
            if r.eval_loss is not None or r.step == 0:
                log.info(
                    "step %d: lm %.4f balance %.4f eval %s usage %s",
                    r.step,
                    r.lm_loss,
                    r.balance_loss,
                    "-" if r.eval_loss is None else f"{r.eval_loss:.4f}",
                    " ".join(f"{u:.2f}" for u in r.usage),
                )

        result = train(base, data, cfg, log=report)
        assert result.model is not None
        write_expert_set(
            result.model,
            args.model,
            args.out,
            overwrite=args.overwrite,
            extra_meta={
                "steps": cfg.steps,
                "base_eval_loss": result.base_eval_loss,
                "final_eval_loss": result.final_eval_loss,
            },
        )
    except TrainingError as exc:
        print(f"adaptermesh adafuse-train: {exc}", file=sys.stderr)
        return 2
    if args.curve is not None:
        args.curve.parent.mkdir(parents=True, exist_ok=True)
        args.curve.write_text(json.dumps(result.curve(), indent=2))
    log.info(
        "wrote %s (eval loss %s -> %s)", args.out, result.base_eval_loss, result.final_eval_loss
    )
    return 0
