"""AdaFuse training: a router and ``E`` LoRA experts learned on a folder of text files.

The model trained is exactly the one the engine serves (``adaptermesh.worker.adafuse``):

* **Token-level pre-gating.** The router is one linear layer (optional bias) on the token's
  embedding row, the hidden state that enters the first decoder layer. Its top-k logits,
  softmaxed, are the token's gates, and that one decision is used by every targeted module of
  every layer (no per-layer router, no recomputation).
* **Experts.** Each targeted module ``m`` of each layer adds
  ``c * sum_j g_tj * B_m[e_tj] @ A_m[e_tj] x`` to its frozen base output, ``c = alpha / r``
  (``alpha / sqrt(r)`` with rsLoRA). The base model is frozen; only the router and the
  experts' A/B are trained.
* **Loss.** Next-token cross entropy plus ``balance_coef`` times the load-balancing loss
  ``E * sum_e f_e * P_e`` (``f_e``: the fraction of the batch's top-k assignments that went to
  expert ``e``; ``P_e``: the mean full-softmax router probability of ``e``). It is 1 when the
  load is uniform and grows as the router collapses onto few experts; ``P_e`` carries the
  gradient, so the router is pushed toward the experts it under-uses.

The expert path is computed densely over all experts (``x @ A_all`` -> ``[N, E, r]``, scaled
by a dense gate matrix that is zero outside the top-k, then ``@ B_all``): for the ``E * r``
of a practical set (<= 128) this is cheaper than gathering per-token experts, and it is the
same sum the engine's gated kernels compute.

``train`` returns the loss curve; ``write_expert_set`` writes the directory the worker serves
(``adaptermesh_adafuse.json``, ``router.safetensors``, ``experts/<i>/`` PEFT LoRA adapters)
and reads it back through the worker's own validator before returning.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from adaptermesh.worker.adafuse import (
    ADAFUSE_CONFIG,
    EXPERTS_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_EXPERTS,
    ROUTER_FILE,
    read_expert_set,
)
from adaptermesh.worker.model import ModelConfig

__all__ = [
    "MODULE_PARENTS",
    "AdaFuseModel",
    "StepRecord",
    "TextDataset",
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "balance_loss",
    "expert_set_meta",
    "peft_adapter_config",
    "train",
    "write_expert_set",
]

# Module name -> its parent inside a Llama-family decoder layer (PEFT's key layout).
MODULE_PARENTS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
TEXT_SUFFIXES = (".txt", ".md", ".text")


class TrainingError(ValueError):
    """Bad input to training; the message starts with the field or file at fault."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    num_experts: int = 4
    top_k: int = 2
    rank: int = 8
    lora_alpha: float | None = None  # default 2 * rank
    use_rslora: bool = False
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    router_bias: bool = True
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    router_lr: float | None = None  # default: lr
    weight_decay: float = 0.0
    warmup_steps: int = 10
    balance_coef: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 10
    eval_fraction: float = 0.1
    # At most this many held-out blocks are scored per evaluation (the rest stay unused).
    eval_blocks: int = 64
    seed: int = 0
    # Router init: std of its weight relative to 1 / sqrt(hidden). Large enough that tokens
    # start on different experts, which is what lets the experts specialise at all.
    router_init: float = 1.0

    def validate(self) -> None:
        def need(ok: bool, fld: str, msg: str) -> None:
            if not ok:
                raise TrainingError(f"{fld}: {msg}")

        need(
            1 <= self.num_experts <= MAX_EXPERTS,
            "num_experts",
            f"must be in [1, {MAX_EXPERTS}], got {self.num_experts}",
        )
        need(
            1 <= self.top_k <= self.num_experts,
            "top_k",
            f"must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        need(1 <= self.rank <= 128, "rank", f"must be in [1, 128], got {self.rank}")
        need(
            self.lora_alpha is None or (math.isfinite(self.lora_alpha) and self.lora_alpha > 0),
            "lora_alpha",
            f"must be a positive number, got {self.lora_alpha!r}",
        )
        need(bool(self.target_modules), "target_modules", "must name at least one module")
        bad = [m for m in self.target_modules if m not in MODULE_PARENTS]
        need(
            not bad,
            "target_modules",
            f"unknown module {bad[0] if bad else ''!r}; known: {sorted(MODULE_PARENTS)}",
        )
        need(
            len(set(self.target_modules)) == len(self.target_modules),
            "target_modules",
            "lists a module twice",
        )
        need(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        need(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        need(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        need(
            math.isfinite(self.lr) and self.lr > 0,
            "lr",
            f"must be a positive number, got {self.lr}",
        )
        need(
            self.router_lr is None or (math.isfinite(self.router_lr) and self.router_lr > 0),
            "router_lr",
            f"must be a positive number, got {self.router_lr}",
        )
        need(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        need(
            math.isfinite(self.balance_coef) and self.balance_coef >= 0,
            "balance_coef",
            f"must be >= 0, got {self.balance_coef}",
        )
        need(
            math.isfinite(self.grad_clip) and self.grad_clip > 0,
            "grad_clip",
            f"must be > 0, got {self.grad_clip}",
        )
        need(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")
        need(self.eval_blocks >= 1, "eval_blocks", f"must be >= 1, got {self.eval_blocks}")
        need(
            0 <= self.eval_fraction < 1,
            "eval_fraction",
            f"must be in [0, 1), got {self.eval_fraction}",
        )
        need(
            math.isfinite(self.router_init) and self.router_init > 0,
            "router_init",
            f"must be > 0, got {self.router_init}",
        )

    @property
    def alpha(self) -> float:
        return float(2 * self.rank if self.lora_alpha is None else self.lora_alpha)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class TextDataset:
    """Every text file under a folder, tokenised and cut into ``seq_len + 1`` token blocks.

    Files are read in sorted path order, each followed by the tokenizer's EOS token, and
    concatenated; the stream is cut into non-overlapping blocks. The last ``eval_fraction`` of
    the blocks (at least one when the fraction is positive) are held out for evaluation.
    """

    def __init__(self, folder: Path, tokenizer: Any, seq_len: int, eval_fraction: float) -> None:
        if not folder.is_dir():
            raise TrainingError(f"data: {folder} is not a directory")
        files = sorted(
            p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise TrainingError(f"data: no text files ({', '.join(TEXT_SUFFIXES)}) under {folder}")
        eos = tokenizer.eos_token_id
        stream: list[int] = []
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise TrainingError(
                    f"data: {p} is not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                stream.append(int(eos))
        self.files = files
        self.num_tokens = len(stream)
        n = len(stream) // (seq_len + 1)
        if n < 1 or (eval_fraction > 0 and n < 2):
            need = (seq_len + 1) * (2 if eval_fraction > 0 else 1)
            raise TrainingError(
                f"data: {len(stream)} tokens under {folder}, need at least {need} for seq_len={seq_len}"
            )
        blocks = torch.tensor(stream[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)
        n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
        n_eval = min(n_eval, n - 1) if n_eval else 0
        self.train = blocks[: n - n_eval]
        self.eval = blocks[n - n_eval :]

    def batch(self, size: int, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, self.train.shape[0], (size,), generator=gen)
        return self.train[idx]


def _linear(base: Any, layer: int, module: str) -> torch.nn.Linear:
    lin = getattr(getattr(base.model.layers[layer], MODULE_PARENTS[module]), module, None)
    if not isinstance(lin, torch.nn.Linear):
        raise TrainingError(
            f"target_modules: layer {layer} has no linear {MODULE_PARENTS[module]}.{module}"
            " (only Llama-family layouts with separate projections are supported)"
        )
    return lin


def balance_loss(
    router_logits: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the rows of ``router_logits`` [N, E] with top-k ids [N, k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    counts = torch.zeros(num_experts, device=router_logits.device)
    counts.scatter_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), device=router_logits.device)
    )
    f = counts / max(1, experts.numel())
    return num_experts * (f * probs.mean(dim=0)).sum()


class AdaFuseModel(torch.nn.Module):
    """A frozen causal LM with a trainable router and LoRA experts on the targeted modules.

    ``forward(ids)`` [B, T] -> ``(logits [B, T, V], router_logits [B*T, E], experts [B*T, k])``.
    """

    def __init__(self, base: Any, config: TrainConfig, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.config = config
        e, r = config.num_experts, config.rank
        emb = base.get_input_embeddings().weight
        hidden = int(emb.shape[1])
        self.hidden_size = hidden
        dev = emb.device
        self.router_weight = torch.nn.Parameter(
            (config.router_init / math.sqrt(hidden)) * torch.randn(e, hidden, generator=gen).to(dev)
        )
        self.router_bias = (
            torch.nn.Parameter(torch.zeros(e, device=dev)) if config.router_bias else None
        )
        self.num_layers = len(base.model.layers)
        self.targets: list[tuple[int, str]] = [
            (layer, m) for layer in range(self.num_layers) for m in config.target_modules
        ]
        self.lora_a = torch.nn.ParameterList()
        self.lora_b = torch.nn.ParameterList()
        self._hooks = []
        # Routing of the forward pass in flight: a dense gate matrix [N, E], zero off the top-k.
        self._gates: torch.Tensor | None = None
        for i, (layer, m) in enumerate(self.targets):
            lin = _linear(base, layer, m)
            fan_in, fan_out = lin.in_features, lin.out_features
            # PEFT's init: A ~ kaiming-uniform, B = 0, so training starts at the base model.
            bound = 1.0 / math.sqrt(fan_in)
            a = (torch.rand(e, r, fan_in, generator=gen) * 2 - 1) * bound
            self.lora_a.append(torch.nn.Parameter(a.to(dev)))
            self.lora_b.append(torch.nn.Parameter(torch.zeros(e, fan_out, r, device=dev)))
            self._hooks.append(lin.register_forward_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable[[Any, Any, torch.Tensor], torch.Tensor]:
        def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor:
            gates = self._gates
            if gates is None:
                return out
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            a, b = self.lora_a[i], self.lora_b[i]  # [E, r, in], [E, out, r]
            e, r = a.shape[0], a.shape[1]
            # Two plain GEMMs over the packed experts (expert e owns rank rows e*r..e*r+r-1).
            v = x @ a.reshape(e * r, -1).T  # [N, E*r]
            v = (v.view(-1, e, r) * gates.unsqueeze(-1)).view(-1, e * r)
            delta = (v @ b.permute(0, 2, 1).reshape(e * r, -1)) * self.config.scale  # [N, out]
            res: torch.Tensor = out + delta.view(out.shape).to(out.dtype)
            return res

        return hook

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits [N, E], top-k ids [N, k] and gates [N, k] for the flat tokens of ``ids``.

        The input is the embedding row (the engine routes the same table)."""
        emb = self.base.get_input_embeddings().weight[ids.reshape(-1)].float()
        logits = emb @ self.router_weight.T
        if self.router_bias is not None:
            logits = logits + self.router_bias
        vals, experts = torch.topk(logits, self.config.top_k, dim=-1)
        return logits, experts, torch.softmax(vals, dim=-1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_r, experts, gates = self.route(ids)
        dense = torch.zeros_like(logits_r).scatter(1, experts, gates)
        self._gates = dense
        try:
            logits = self.base(input_ids=ids).logits
        finally:
            self._gates = None
        return logits, logits_r, experts

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def trainable(self) -> list[torch.nn.Parameter]:
        out = [self.router_weight] + ([self.router_bias] if self.router_bias is not None else [])
        return out + list(self.lora_a) + list(self.lora_b)


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    lm_loss: float
    balance_loss: float
    lr: float
    # Fraction of the step's top-k assignments per expert.
    usage: tuple[float, ...]
    eval_loss: float | None = None
    base_eval_loss: float | None = None


@dataclass(slots=True)
class TrainResult:
    config: TrainConfig
    records: list[StepRecord] = field(default_factory=list)
    base_eval_loss: float | None = None
    final_eval_loss: float | None = None
    train_tokens: int = 0
    eval_tokens: int = 0
    seconds: float = 0.0
    model: AdaFuseModel | None = None

    def curve(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "base_eval_loss": self.base_eval_loss,
            "final_eval_loss": self.final_eval_loss,
            "train_tokens": self.train_tokens,
            "eval_tokens": self.eval_tokens,
            "seconds": self.seconds,
            "steps": [asdict(r) for r in self.records],
        }


def load_base(model_dir: Path, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The base model (frozen, eval mode) and its tokenizer from a local directory."""
    import transformers

    if not (model_dir / "config.json").is_file():
        raise TrainingError(f"model: {model_dir} has no config.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = model.to(device)
    model.eval()
    return model, tok


def _lm_loss(logits: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), block[:, 1:].reshape(-1)
    )


@torch.no_grad()
def _evaluate(model: AdaFuseModel, blocks: torch.Tensor, batch: int, adapters: bool) -> float:
    total, n = 0.0, 0
    dev = model.router_weight.device
    for lo in range(0, blocks.shape[0], batch):
        x = blocks[lo : lo + batch].to(dev)
        logits = model(x)[0] if adapters else model.base(input_ids=x).logits
        total += float(_lm_loss(logits, x)) * x.shape[0]
        n += x.shape[0]
    return total / max(1, n)


def train(
    base: Any,
    data: TextDataset,
    config: TrainConfig,
    *,
    log: Callable[[StepRecord], None] | None = None,
) -> TrainResult:
    """Train a router and experts on ``data`` over the frozen ``base``; returns the curve and
    the trained ``AdaFuseModel`` (its hooks stay on the base model until ``remove_hooks``)."""
    config.validate()
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    model = AdaFuseModel(base, config, gen)
    dev = model.router_weight.device
    router_params = [model.router_weight] + (
        [model.router_bias] if model.router_bias is not None else []
    )
    opt = torch.optim.AdamW(
        [
            {"params": router_params, "lr": config.router_lr or config.lr},
            {"params": list(model.lora_a) + list(model.lora_b), "lr": config.lr},
        ],
        weight_decay=config.weight_decay,
    )
    bases = [g["lr"] for g in opt.param_groups]

    def lr_at(step: int) -> float:
        # Linear warm-up, then cosine decay to a tenth.
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        t = (step - config.warmup_steps) / span
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    result = TrainResult(
        config,
        train_tokens=int(data.train.numel()),
        eval_tokens=int(data.eval[: config.eval_blocks].numel()),
    )
    eval_set = data.eval[: config.eval_blocks]
    has_eval = eval_set.shape[0] > 0
    if has_eval:
        result.base_eval_loss = _evaluate(model, eval_set, config.batch_size, adapters=False)
    t0 = time.perf_counter()
    for step in range(config.steps):
        factor = lr_at(step)
        for g, b in zip(opt.param_groups, bases, strict=True):
            g["lr"] = b * factor
        x = data.batch(config.batch_size, gen).to(dev)
        logits, rl, experts = model(x)
        lm = _lm_loss(logits, x)
        bal = balance_loss(rl, experts, config.num_experts)
        loss = lm + config.balance_coef * bal
        if not torch.isfinite(loss):
            raise TrainingError(
                f"lr: the loss became {float(loss)} at step {step}; lower the learning rate"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.trainable(), config.grad_clip)
        opt.step()
        counts = torch.bincount(experts.reshape(-1), minlength=config.num_experts).float()
        usage = tuple((counts / counts.sum()).tolist())
        ev = None
        if has_eval and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            model.eval()
            ev = _evaluate(model, eval_set, config.batch_size, adapters=True)
        rec = StepRecord(
            step, float(lm.detach()), float(bal.detach()), opt.param_groups[-1]["lr"], usage, ev
        )
        result.records.append(rec)
        if log is not None:
            log(rec)
    result.seconds = time.perf_counter() - t0
    evals = [r.eval_loss for r in result.records if r.eval_loss is not None]
    result.final_eval_loss = evals[-1] if evals else None
    result.model = model
    return result


def peft_adapter_config(
    base_model_dir: str | Path,
    rank: int,
    lora_alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool,
) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter in inference mode (no dropout, no
    bias, no per-module patterns): what every adapter written here, and every test adapter,
    carries; ``peft.PeftModel.from_pretrained`` and the worker's reader both accept it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_dir),
        "r": rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }


def expert_set_meta(
    num_experts: int,
    top_k: int,
    hidden_size: int,
    router_bias: bool,
    target_modules: Sequence[str],
    rank: int,
    lora_alpha: float,
    use_rslora: bool,
) -> dict[str, Any]:
    """An expert set's ``adaptermesh_adafuse.json`` (``adaptermesh.worker.adafuse`` reads it)."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_experts": num_experts,
        "top_k": top_k,
        "router": {"hidden_size": hidden_size, "bias": router_bias},
        "target_modules": sorted(target_modules),
        "r": rank,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
    }


def write_expert_set(
    model: AdaFuseModel,
    model_dir: Path,
    out: Path,
    *,
    overwrite: bool = False,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``model``'s router and experts as an expert-set directory at ``out``.

    The set is written next to ``out`` under a temporary name, validated by the worker's own
    reader, then renamed into place, so a failed write never leaves a half set under ``out``.
    """
    cfg = model.config
    if out.exists() and not overwrite:
        raise TrainingError(f"output: {out} already exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        with torch.no_grad():
            router = {"weight": model.router_weight.detach().float().cpu().contiguous()}
            if model.router_bias is not None:
                router["bias"] = model.router_bias.detach().float().cpu().contiguous()
            save_file(router, str(tmp / ROUTER_FILE), metadata={"format": "pt"})
            peft_cfg = json.dumps(
                peft_adapter_config(
                    model_dir, cfg.rank, cfg.alpha, cfg.target_modules, cfg.use_rslora
                ),
                indent=2,
            )
            for e in range(cfg.num_experts):
                tensors: dict[str, torch.Tensor] = {}
                for (layer, m), a, b in zip(model.targets, model.lora_a, model.lora_b, strict=True):
                    prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENTS[m]}.{m}"
                    tensors[f"{prefix}.lora_A.weight"] = a[e].detach().float().cpu().contiguous()
                    tensors[f"{prefix}.lora_B.weight"] = b[e].detach().float().cpu().contiguous()
                edir = tmp / EXPERTS_DIR / str(e)
                edir.mkdir(parents=True)
                save_file(
                    tensors, str(edir / "adapter_model.safetensors"), metadata={"format": "pt"}
                )
                (edir / "adapter_config.json").write_text(peft_cfg)
        meta = expert_set_meta(
            cfg.num_experts,
            cfg.top_k,
            model.hidden_size,
            cfg.router_bias,
            cfg.target_modules,
            cfg.rank,
            cfg.alpha,
            cfg.use_rslora,
        )
        if extra_meta:
            meta["training"] = extra_meta
        (tmp / ADAFUSE_CONFIG).write_text(json.dumps(meta, indent=2))
        # The worker's own reader: what it refuses is never published.
        read_expert_set(
            out.name, tmp, tmp.parent, ModelConfig.from_dir(model_dir), cfg.rank, torch.float32
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def split_targets(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` or ``"all-linear"`` -> module names."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if items == ["all-linear"]:
        return tuple(MODULE_PARENTS)
    return tuple(items)
