"""AdaFuse expert sets served by the engine: on-disk format, validation, device state, paths.

An expert set is a router plus ``E`` LoRA experts that share one rank, one alpha and one set
of targeted modules. For every token the router (one linear layer on the hidden state that
enters the first decoder layer, i.e. the token embedding) picks the top-k experts and their
softmax gates; every targeted module of every layer then uses::

    W'_m(t) = W_m + c * sum_j g_tj * B_m[e_tj] @ A_m[e_tj]        (c = alpha / r, or alpha / sqrt(r))

On disk (one directory under the adapter root, named like any adapter)::

    <name>/adaptermesh_adafuse.json   {"format": "adaptermesh.adafuse", "version": 1,
                                       "num_experts": E, "top_k": k,
                                       "router": {"hidden_size": H, "bias": true},
                                       "target_modules": [...], "r": r, "lora_alpha": a,
                                       "use_rslora": false}
    <name>/router.safetensors         "weight" [E, H] (and "bias" [E] when router.bias)
    <name>/experts/<i>/               i = 0..E-1, each a PEFT LoRA directory whose
                                      adapter_config.json agrees with r, lora_alpha,
                                      use_rslora and the resolved target modules

Two execution paths, both from ``adaptermesh.kernels.fuse``:

* **Merged** (a step that is one token of one request, i.e. batch-1 decode): ``fused_switch``
  writes ``W = round(W0 + Delta)`` into every targeted backbone weight with one launch; the
  forward pass is then the plain backbone (and CUDA-graph decode still applies). ``W0`` is a
  pristine copy of each targeted weight, shared by every expert set that targets it, so
  unmerging restores the backbone bit for bit. The engine unmerges before any step that runs
  anything else, and whenever it goes idle.
* **Gated** (every other step, mixed with LoRA and base requests): the backbone stays clean
  and each targeted module adds ``gated_add_lora`` with the set's per-token routing; rows of
  other requests get expert id -1 and are skipped by the kernels.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from adaptermesh.kernels.fuse import (
    MergeTable,
    MergeTarget,
    build_merge_table,
    fused_switch,
    gated_add_lora,
    route,
)
from adaptermesh.worker.model import GROUPS, MODULE_TO_GROUP, ModelConfig

if TYPE_CHECKING:
    from adaptermesh.worker.model import TransformerModel

__all__ = [
    "ADAFUSE_CONFIG",
    "BackboneMasters",
    "CpuExpertSet",
    "ExpertSet",
    "GatedBatch",
    "is_expert_set",
    "read_expert_set",
]

ADAFUSE_CONFIG = "adaptermesh_adafuse.json"
ROUTER_FILE = "router.safetensors"
EXPERTS_DIR = "experts"
FORMAT_NAME = "adaptermesh.adafuse"
FORMAT_VERSION = 1
# The Triton router keeps every expert's logit of a 16-token tile in registers.
MAX_EXPERTS = 64


def is_expert_set(path: Path) -> bool:
    return (path / ADAFUSE_CONFIG).is_file()


@dataclass(slots=True)
class CpuExpertSet:
    """A validated expert set on the host. ``a[(layer, module)]`` [E, r, in], ``b[...]`` [E, out, r]."""

    name: str
    path: Path
    num_experts: int
    top_k: int
    rank: int
    alpha: float
    use_rslora: bool
    scale: float
    targets: frozenset[tuple[int, str]]
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E]
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    nbytes: int
    pinned: bool = False


def _int_field(name: str, cj: dict[str, Any], key: str, lo: int, hi: int) -> int:
    from adaptermesh.worker.adapters import AdapterValidationError

    v = cj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise AdapterValidationError(name, key, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _message(e: Exception) -> str:
    # AdapterValidationError reads "<name>: <field>: <message>"; keep the message only.
    return str(e).split(": ", 2)[-1]


def _inside(root: Path, name: str, p: Path, fld: str) -> Path:
    # Files inside the set's directory may be symlinks too; none may lead out of the root.
    from adaptermesh.worker.adapters import AdapterValidationError

    resolved = p.resolve(strict=False)
    if not resolved.is_relative_to(root.resolve()):
        raise AdapterValidationError(name, fld, f"resolves outside the adapter root {root.resolve()}")
    return resolved


def read_expert_set(
    name: str, path: Path, root: Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype
) -> CpuExpertSet:
    """Read and validate an expert-set directory. Raises AdapterValidationError naming the field."""
    from adaptermesh.worker.adapters import AdapterValidationError, _target_set, read_adapter

    def fail(fld: str, msg: str) -> AdapterValidationError:
        return AdapterValidationError(name, fld, msg)

    try:
        cj = json.loads((path / ADAFUSE_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise fail(ADAFUSE_CONFIG, f"unreadable: {e}") from None
    if not isinstance(cj, dict):
        raise fail(ADAFUSE_CONFIG, "must hold a JSON object")
    if cj.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise fail("format", f"must be {FORMAT_NAME!r}, got {cj.get('format')!r}")
    if cj.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise fail("version", f"only version {FORMAT_VERSION} is supported, got {cj.get('version')!r}")
    num_experts = _int_field(name, cj, "num_experts", 1, MAX_EXPERTS)
    top_k = _int_field(name, cj, "top_k", 1, num_experts)
    rank = _int_field(name, cj, "r", 1, min(max_rank, 128))
    alpha = cj.get("lora_alpha", 2 * rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail("lora_alpha", f"must be a number, got {alpha!r}")
    use_rslora = cj.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail("use_rslora", f"must be a boolean, got {use_rslora!r}")
    router = cj.get("router")
    if not isinstance(router, dict):
        raise fail("router", 'must be an object {"hidden_size": H, "bias": true|false}')
    if router.get("hidden_size") != cfg.hidden_size:
        raise fail("router.hidden_size", f"must equal the base model's hidden size {cfg.hidden_size}, got {router.get('hidden_size')!r}")
    has_bias = router.get("bias", False)
    if not isinstance(has_bias, bool):
        raise fail("router.bias", f"must be a boolean, got {has_bias!r}")
    targets = _target_set(name, cj, cfg)

    rpath = _inside(root, name, path / ROUTER_FILE, ROUTER_FILE)
    if not rpath.is_file():
        raise fail(ROUTER_FILE, "file is missing")
    try:
        with safe_open(str(rpath), framework="pt") as fh:
            keys = set(fh.keys())
            rt = {k: fh.get_tensor(k) for k in keys}
    except Exception as e:  # safetensors raises its own error types for corrupt/truncated files
        raise fail(ROUTER_FILE, f"corrupt or truncated: {e}") from None
    want: dict[str, tuple[int, ...]] = {"weight": (num_experts, cfg.hidden_size)}
    if has_bias:
        want["bias"] = (num_experts,)
    for key, shape in want.items():
        t = rt.get(key)
        if t is None:
            raise fail(ROUTER_FILE, f"missing tensor {key!r}")
        if tuple(t.shape) != shape:
            raise fail(ROUTER_FILE, f"tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise fail(ROUTER_FILE, f"tensor {key!r} must hold finite floats")
    extra = sorted(keys - set(want))
    if extra:
        raise fail(ROUTER_FILE, f"unexpected tensor {extra[0]!r}")

    experts_dir = path / EXPERTS_DIR
    per_expert = []
    for i in range(num_experts):
        fld = f"{EXPERTS_DIR}/{i}"
        edir = _inside(root, name, experts_dir / str(i), fld)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            _inside(root, name, edir / f, f"{fld}/{f}")
        if not (edir / "adapter_config.json").is_file():
            raise fail(fld, f"expert {i} of {num_experts} is missing (no {fld}/adapter_config.json)")
        try:
            ej = json.loads((edir / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise fail(f"{fld}/adapter_config.json", f"unreadable: {e}") from None
        if not isinstance(ej, dict):
            raise fail(f"{fld}/adapter_config.json", "must hold a JSON object")
        for key, top in (("r", rank), ("lora_alpha", alpha), ("use_rslora", use_rslora)):
            got = ej.get(key, False if key == "use_rslora" else None)
            if got != top:
                raise fail(f"{fld}/adapter_config.json: {key}", f"is {got!r}, the expert set says {top!r}")
        try:
            e_targets = _target_set(name, ej, cfg)
        except AdapterValidationError as e:
            raise fail(f"{fld}/adapter_config.json: {e.field}", _message(e)) from None
        if e_targets != targets:
            raise fail(f"{fld}/adapter_config.json: target_modules", "must resolve to the expert set's target_modules")
        try:
            per_expert.append(read_adapter(f"{name}/{fld}", edir, cfg, max_rank, dtype, pin_memory=False))
        except AdapterValidationError as e:
            raise fail(f"{fld}/{e.field}", _message(e)) from None
    if experts_dir.is_dir():
        names = {p.name for p in experts_dir.iterdir()}
        extra_dirs = sorted(names - {str(i) for i in range(num_experts)})
        if extra_dirs:
            raise fail(EXPERTS_DIR, f"holds {extra_dirs[0]!r}, but num_experts is {num_experts} (experts are 0..{num_experts - 1})")

    # (layer, group, slice, is_b) -> matrix, per expert; every expert has every target.
    views = [{(e.layer, e.group, e.index, e.is_b): ex.view(e) for e in ex.entries} for ex in per_expert]
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for layer, m in sorted(targets):
        g, i = MODULE_TO_GROUP[m]
        a[(layer, m)] = torch.stack([v[(layer, g, i, False)] for v in views]).to(dtype).contiguous()
        b[(layer, m)] = torch.stack([v[(layer, g, i, True)] for v in views]).to(dtype).contiguous()
    rw = rt["weight"].to(dtype).contiguous()
    rb = rt["bias"].to(dtype).contiguous() if has_bias else None
    nbytes = sum(t.numel() * t.element_size() for d in (a, b) for t in d.values()) + rw.numel() * rw.element_size()
    scale = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
    return CpuExpertSet(
        name=name, path=path, num_experts=num_experts, top_k=top_k, rank=rank, alpha=float(alpha),
        use_rslora=use_rslora, scale=scale, targets=frozenset(targets), router_weight=rw, router_bias=rb,
        a=a, b=b, nbytes=nbytes,
    )


class BackboneMasters:
    """Pristine copies ``W0`` of the backbone weights that some expert set targets.

    One copy per (layer, module), shared by every expert set, created the first time a set that
    targets the module is loaded. At that moment no published set targets it, so nothing can
    have been merged into it: the copy is pristine. Copies are kept for the engine's life.
    """

    def __init__(self, model: TransformerModel) -> None:
        self.model = model
        self.copies: dict[tuple[int, str], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, layer: int, module: str) -> torch.Tensor:
        with self._lock:
            t = self.copies.get((layer, module))
            if t is None:
                t = self.model.module_weight(layer, module).detach().clone()
                self.copies[(layer, module)] = t
            return t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())


@dataclass(eq=False)
class ExpertSet:
    """A device-resident expert set with its merge table. Compared by identity."""

    name: str
    path: Path
    version: int
    num_experts: int
    top_k: int
    rank: int
    scale: float
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None
    # (layer, module) -> (A [E, r, in], B [E, out, r]); only targeted (layer, module) pairs.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    table: MergeTable
    nbytes: int
    pinned: bool = False
    refcount: int = 0
    last_used: float = 0.0
    # Per layer and group: [(slice index, A, B)], so the forward pass does no dict lookups.
    by_layer: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = field(default_factory=list)

    @classmethod
    def build(cls, cpu: CpuExpertSet, model: TransformerModel, masters: BackboneMasters, version: int) -> ExpertSet:
        dev = model.device
        weights = {
            k: (cpu.a[k].to(dev, non_blocking=True), cpu.b[k].to(dev, non_blocking=True)) for k in sorted(cpu.targets)
        }
        targets = [
            MergeTarget(weight=model.module_weight(layer, m), lora_a=a, lora_b=b, scale=cpu.scale, master=masters.get(layer, m))
            for (layer, m), (a, b) in weights.items()
        ]
        table = build_merge_table(targets, exact=True)
        by_layer: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = [
            {g: [] for g in GROUPS} for _ in range(model.cfg.num_layers)
        ]
        for (layer, m), (a, b) in weights.items():
            g, i = MODULE_TO_GROUP[m]
            by_layer[layer][g].append((i, a, b))
        return cls(
            name=cpu.name, path=cpu.path, version=version, num_experts=cpu.num_experts, top_k=cpu.top_k,
            rank=cpu.rank, scale=cpu.scale, router_weight=cpu.router_weight.to(dev),
            router_bias=None if cpu.router_bias is None else cpu.router_bias.to(dev), weights=weights,
            table=table, nbytes=cpu.nbytes, pinned=cpu.pinned, by_layer=by_layer,
        )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k] int32, gates [T, k] fp32) from the first layer's input ``h`` [T, H]."""
        return route(h, self.router_weight, self.router_bias, self.top_k)

    def merge(self, ids: torch.Tensor, gates: torch.Tensor) -> None:
        """Write ``W0 + c * sum_j g_j B_j A_j`` into every targeted weight (one launch)."""
        fused_switch(self.table, ids, gates)

    def unmerge(self) -> None:
        """Restore ``W0`` bit for bit in every targeted weight (one launch)."""
        dev = self.table.device
        fused_switch(self.table, torch.full((1,), -1, dtype=torch.int32, device=dev), torch.zeros(1, device=dev))

    def holds(self, ids: torch.Tensor, gates: torch.Tensor) -> bool:
        """Whether the weights already hold exactly this selection (reads 2k numbers back)."""
        cur_i, cur_g = self.table.cur_ids, self.table.cur_gates
        return cur_i.shape == ids.shape and torch.equal(cur_i, ids) and torch.equal(cur_g, gates)


class GatedBatch:
    """The expert sets of one step and, per set, which rows of the flat batch it owns."""

    def __init__(self, sets: list[ExpertSet], token_set: torch.Tensor, cfg: ModelConfig) -> None:
        self.sets = sets
        self.token_set = token_set  # [T] int32: index into ``sets``, -1 = not an expert-set row
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        # Column ranges of each slice in the fused outputs (wqkv = [q; k; v], w_gate_up = [g; u]).
        self.cols: dict[str, list[tuple[int, int]]] = {
            "qkv": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "o": [(0, cfg.hidden_size)],
            "gate_up": [(0, inter), (inter, 2 * inter)],
            "down": [(0, cfg.hidden_size)],
        }
        self.routes: list[tuple[ExpertSet, torch.Tensor, torch.Tensor]] = []

    def route(self, h: torch.Tensor) -> None:
        """Route every set's rows from the first layer's input ``h`` [T, H]; other rows get -1."""
        self.routes = []
        for idx, es in enumerate(self.sets):
            ids, gates = es.route(h)
            mine = (self.token_set == idx).unsqueeze(1)
            ids = torch.where(mine, ids, torch.full_like(ids, -1)).contiguous()
            gates = torch.where(mine, gates, torch.zeros_like(gates)).contiguous()
            self.routes.append((es, ids, gates))

    def apply(self, layer: int, group: str, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out[:, slice] += c * sum_j g_tj (x @ A[e_tj].T) @ B[e_tj].T`` for each targeted slice."""
        cols = self.cols[group]
        for es, ids, gates in self.routes:
            for i, a, b in es.by_layer[layer][group]:
                lo, hi = cols[i]
                gated_add_lora(out[:, lo:hi], x, a, b, ids, gates, es.scale)
