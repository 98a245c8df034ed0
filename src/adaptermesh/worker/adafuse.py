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

Three execution paths, all through ``adaptermesh.kernels.dispatch``:

* **Merged** (one token of one request, and only when the same selection has repeated for
  ``adafuse_merge_after`` consecutive tokens, or is already merged): ``fused_switch`` writes
  ``W = round(W0 + Delta)`` into every targeted backbone weight with one launch; the forward
  pass is then the plain backbone (and CUDA-graph decode still applies). ``W0`` is a pristine
  copy of each targeted weight, shared by every expert set that targets it, so unmerging
  restores the backbone bit for bit. The engine unmerges before any step that runs another
  request, and whenever it goes idle.
* **Solo gated** (one token of one request whose selection is not the merged one): the
  backbone is left as it is and each targeted module adds the token's experts from static
  buffers (``SoloGated``), inside the decode CUDA graph on a GPU. If the backbone still holds
  an older selection of the same set, the old experts are added too, with negated gates, so
  they cancel out of the merged weight (no switch is needed). With ``E * r <= 128`` the set's
  experts are packed per group as ONE LoRA of rank ``E * r`` and the step runs the SGMM
  shrink, scales each expert's rank rows by its net coefficient, and runs the SGMM expand
  (the split-K shrink keeps a one-token launch fast); larger sets use ``gated_add_lora``.
* **Gated** (every other step, mixed with LoRA and base requests): the backbone stays clean
  and each targeted module adds ``gated_add_lora`` with the set's per-token routing; rows of
  other requests get expert id -1 and are skipped by the kernels.

Routing depends only on the token: the router reads the token's embedding. ``ExpertSet``
therefore routes the whole embedding table once when it is built and keeps every token's
selection on the host, so choosing a single-request path costs no device work and no sync.
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

from adaptermesh.kernels.dispatch import (
    fused_switch,
    gated_add_lora,
    route,
    sgmm_expand,
    sgmm_shrink,
)
from adaptermesh.kernels.fuse_config import MergeTable, MergeTarget, build_merge_table
from adaptermesh.kernels.meta import build_segment_meta
from adaptermesh.worker.lora_groups import GROUPS, MODULE_TO_GROUP
from adaptermesh.worker.model import GatedTerms, ModelConfig
from adaptermesh.worker.peft_adapter import AdapterValidationError, read_adapter, target_set

if TYPE_CHECKING:
    from adaptermesh.worker.model import TransformerModel

__all__ = [
    "ADAFUSE_CONFIG",
    "BackboneMasters",
    "CpuExpertSet",
    "ExpertSet",
    "GatedBatch",
    "GatedTerms",
    "Selection",
    "SoloGated",
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
# Rows of the embedding table routed per call when an expert set builds its selection table.
_ROUTE_CHUNK = 8192
# Largest E * r packed as one LoRA for the solo path. Packing reads every expert each token,
# so it pays only while E * r stays small; above this the per-token gated kernels run.
PACKED_MAX_RANK = 128

# One token's routing, as host values: (expert ids, gates), best first.
Selection = tuple[tuple[int, ...], tuple[float, ...]]


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
    v = cj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise AdapterValidationError(name, key, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _message(e: Exception) -> str:
    # AdapterValidationError reads "<name>: <field>: <message>"; keep the message only.
    return str(e).split(": ", 2)[-1]


def _inside(root: Path, name: str, p: Path, fld: str) -> Path:
    # Files inside the set's directory may be symlinks too; none may lead out of the root.
    resolved = p.resolve(strict=False)
    if not resolved.is_relative_to(root.resolve()):
        raise AdapterValidationError(
            name, fld, f"resolves outside the adapter root {root.resolve()}"
        )
    return resolved


def read_expert_set(
    name: str, path: Path, root: Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype
) -> CpuExpertSet:
    """Read and validate an expert-set directory. Raises AdapterValidationError naming the field."""

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
        raise fail(
            "version", f"only version {FORMAT_VERSION} is supported, got {cj.get('version')!r}"
        )
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
        raise fail(
            "router.hidden_size",
            f"must equal the base model's hidden size {cfg.hidden_size}, got {router.get('hidden_size')!r}",
        )
    has_bias = router.get("bias", False)
    if not isinstance(has_bias, bool):
        raise fail("router.bias", f"must be a boolean, got {has_bias!r}")
    targets = target_set(name, cj, cfg)

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
            raise fail(
                fld, f"expert {i} of {num_experts} is missing (no {fld}/adapter_config.json)"
            )
        try:
            ej = json.loads((edir / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise fail(f"{fld}/adapter_config.json", f"unreadable: {e}") from None
        if not isinstance(ej, dict):
            raise fail(f"{fld}/adapter_config.json", "must hold a JSON object")
        for key, top in (("r", rank), ("lora_alpha", alpha), ("use_rslora", use_rslora)):
            got = ej.get(key, False if key == "use_rslora" else None)
            if got != top:
                raise fail(
                    f"{fld}/adapter_config.json: {key}", f"is {got!r}, the expert set says {top!r}"
                )
        try:
            e_targets = target_set(name, ej, cfg)
        except AdapterValidationError as e:
            raise fail(f"{fld}/adapter_config.json: {e.field}", _message(e)) from None
        if e_targets != targets:
            raise fail(
                f"{fld}/adapter_config.json: target_modules",
                "must resolve to the expert set's target_modules",
            )
        try:
            per_expert.append(
                read_adapter(f"{name}/{fld}", edir, cfg, max_rank, dtype, pin_memory=False)
            )
        except AdapterValidationError as e:
            raise fail(f"{fld}/{e.field}", _message(e)) from None
    if experts_dir.is_dir():
        names = {p.name for p in experts_dir.iterdir()}
        extra_dirs = sorted(names - {str(i) for i in range(num_experts)})
        if extra_dirs:
            raise fail(
                EXPERTS_DIR,
                f"holds {extra_dirs[0]!r}, but num_experts is {num_experts} (experts are 0..{num_experts - 1})",
            )

    # (layer, group, slice, is_b) -> matrix, per expert; every expert has every target.
    views = [
        {(e.layer, e.group, e.index, e.is_b): ex.view(e) for e in ex.entries} for ex in per_expert
    ]
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for layer, m in sorted(targets):
        g, i = MODULE_TO_GROUP[m]
        a[(layer, m)] = torch.stack([v[(layer, g, i, False)] for v in views]).to(dtype).contiguous()
        b[(layer, m)] = torch.stack([v[(layer, g, i, True)] for v in views]).to(dtype).contiguous()
    rw = rt["weight"].to(dtype).contiguous()
    rb = rt["bias"].to(dtype).contiguous() if has_bias else None
    nbytes = (
        sum(t.numel() * t.element_size() for d in (a, b) for t in d.values())
        + rw.numel() * rw.element_size()
    )
    scale = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
    return CpuExpertSet(
        name=name,
        path=path,
        num_experts=num_experts,
        top_k=top_k,
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        scale=scale,
        targets=frozenset(targets),
        router_weight=rw,
        router_bias=rb,
        a=a,
        b=b,
        nbytes=nbytes,
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

    def pristine(self, layer: int, module: str) -> torch.Tensor:
        """The unmerged weight of (layer, module): its copy when some expert set targets it
        (a merge may be in the live weight), else the live weight, which no set can have
        merged into (the copy is taken before any set on the module is published)."""
        with self._lock:
            t = self.copies.get((layer, module))
        return self.model.module_weight(layer, module) if t is None else t

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
    by_layer: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = field(
        default_factory=list
    )
    # Every vocabulary token's selection (host): ids [V, k] int32 and gates [V, k] fp32.
    token_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    token_gates: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    # Solo path with packed experts (E * r <= PACKED_MAX_RANK), per layer and group: A
    # [n_slices, 1, E*r, in] and B per slice [1, N_i, E*r]; expert e owns rank rows
    # e*r .. e*r+r-1. Slices the set does not target hold zeros. Empty when not packed.
    packed: list[dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]] = field(
        default_factory=list
    )
    packed_ranks: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    packed_scales: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @classmethod
    def build(
        cls, cpu: CpuExpertSet, model: TransformerModel, masters: BackboneMasters, version: int
    ) -> ExpertSet:
        dev = model.device
        weights = {
            k: (cpu.a[k].to(dev, non_blocking=True), cpu.b[k].to(dev, non_blocking=True))
            for k in sorted(cpu.targets)
        }
        targets = [
            MergeTarget(
                weight=model.module_weight(layer, m),
                lora_a=a,
                lora_b=b,
                scale=cpu.scale,
                master=masters.get(layer, m),
            )
            for (layer, m), (a, b) in weights.items()
        ]
        table = build_merge_table(targets, exact=True)
        by_layer: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = [
            {g: [] for g in GROUPS} for _ in range(model.cfg.num_layers)
        ]
        for (layer, m), (a, b) in weights.items():
            g, i = MODULE_TO_GROUP[m]
            by_layer[layer][g].append((i, a, b))
        es = cls(
            name=cpu.name,
            path=cpu.path,
            version=version,
            num_experts=cpu.num_experts,
            top_k=cpu.top_k,
            rank=cpu.rank,
            scale=cpu.scale,
            router_weight=cpu.router_weight.to(dev),
            router_bias=None if cpu.router_bias is None else cpu.router_bias.to(dev),
            weights=weights,
            table=table,
            nbytes=cpu.nbytes,
            pinned=cpu.pinned,
            by_layer=by_layer,
        )
        # The router's input for a token is its embedding row, so a token's selection never
        # changes: route the whole table once (the same kernel, row for row, as a live call).
        tok_ids: list[torch.Tensor] = []
        tok_gates: list[torch.Tensor] = []
        for lo in range(0, model.embed.shape[0], _ROUTE_CHUNK):
            chunk_ids, chunk_gates = es.route(model.embed[lo : lo + _ROUTE_CHUNK])
            tok_ids.append(chunk_ids.cpu())
            tok_gates.append(chunk_gates.cpu())
        es.token_ids = torch.cat(tok_ids)
        es.token_gates = torch.cat(tok_gates)
        if cpu.num_experts * cpu.rank <= PACKED_MAX_RANK:
            es._pack(model.cfg)
        return es

    def _pack(self, cfg: ModelConfig) -> None:
        e, r = self.num_experts, self.rank
        rr = e * r
        dev, dtype = self.router_weight.device, self.weights[next(iter(self.weights))][0].dtype
        self.packed = [{} for _ in range(cfg.num_layers)]
        for layer, groups in enumerate(self.by_layer):
            for g, items in groups.items():
                if not items:
                    continue
                mods = GROUPS[g]
                fan_in = cfg.module_shape(mods[0])[0]
                a = torch.zeros((len(mods), 1, rr, fan_in), dtype=dtype, device=dev)
                bs = [
                    torch.zeros((1, cfg.module_shape(m)[1], rr), dtype=dtype, device=dev)
                    for m in mods
                ]
                for i, ea, eb in items:
                    a[i, 0] = ea.reshape(rr, fan_in)  # [E, r, in] -> rows e*r + j
                    bs[i][0] = eb.permute(1, 0, 2).reshape(
                        eb.shape[1], rr
                    )  # [E, N, r] -> [N, e*r + j]
                self.packed[layer][g] = (a, tuple(bs))
        self.packed_ranks = torch.tensor([rr], dtype=torch.int32, device=dev)
        self.packed_scales = torch.ones(1, dtype=torch.float32, device=dev)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k] int32, gates [T, k] fp32) from the first layer's input ``h`` [T, H]."""
        return route(h, self.router_weight, self.router_bias, self.top_k)

    def selection(self, token: int) -> Selection:
        """The router's choice for ``token`` (host values; no device work)."""
        return tuple(self.token_ids[token].tolist()), tuple(self.token_gates[token].tolist())

    def solo_shape(self, rows: int) -> tuple[int, ...]:
        """Shape of the int32 selection buffer ``SoloGated`` reads for a batch of ``rows``.

        Packed: ``[rows + E*r]``: each row's pool slot (0 for the request, -1 for the rest),
        then per rank row its expert's net coefficient as fp32 bits. Otherwise
        ``[2, rows, 2k]``: expert ids (-1 = none), then the gates' fp32 bits."""
        if self.packed:
            return (rows + self.num_experts * self.rank,)
        return (2, rows, 2 * self.top_k)

    def solo_empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """A selection buffer that adds nothing (every row base / no expert)."""
        buf = torch.zeros(self.solo_shape(rows), dtype=torch.int32, device=device)
        if self.packed:
            buf[:rows].fill_(-1)
        else:
            buf[0].fill_(-1)
        return buf

    def solo_rows(
        self, rows: int, row: int, new: Selection, merged: Selection | None
    ) -> torch.Tensor:
        """Host selection buffer (``solo_shape``) for one token in row ``row``: its selection
        ``new``, minus ``merged``, a selection the backbone still holds (negated gates remove
        it exactly as far as rounding goes); every other row adds nothing."""
        buf = self.solo_empty(rows, torch.device("cpu"))
        if self.packed:
            # Net coefficient per expert: top-k experts are distinct within a selection, so an
            # expert in both selections gets c * (g_new - g_old).
            coef = [0.0] * self.num_experts
            for e, g in zip(*new, strict=True):
                coef[e] += g
            if merged is not None:
                for e, g in zip(*merged, strict=True):
                    coef[e] -= g
            per_rank = (
                torch.tensor(coef, dtype=torch.float32)
                .mul_(self.scale)
                .repeat_interleave(self.rank)
            )
            buf[row] = 0
            buf[rows:] = per_rank.view(torch.int32)
            return buf
        k = self.top_k
        buf[0, row, :k] = torch.tensor(new[0], dtype=torch.int32)
        buf[1, row, :k] = torch.tensor(new[1], dtype=torch.float32).view(torch.int32)
        if merged is not None:
            buf[0, row, k:] = torch.tensor(merged[0], dtype=torch.int32)
            buf[1, row, k:] = torch.tensor([-g for g in merged[1]], dtype=torch.float32).view(
                torch.int32
            )
        return buf

    def merge(self, sel: Selection) -> None:
        """Write ``W0 + c * sum_j g_j B_j A_j`` into every targeted weight (one launch)."""
        dev = self.table.device
        ids = torch.tensor(sel[0], dtype=torch.int32, device=dev)
        gates = torch.tensor(sel[1], dtype=torch.float32, device=dev)
        fused_switch(self.table, ids, gates)

    def unmerge(self) -> None:
        """Restore ``W0`` bit for bit in every targeted weight (one launch)."""
        dev = self.table.device
        fused_switch(
            self.table,
            torch.full((1,), -1, dtype=torch.int32, device=dev),
            torch.zeros(1, device=dev),
        )


def _group_cols(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Column ranges of each slice in the fused outputs (wqkv = [q; k; v], w_gate_up = [g; u])."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {
        "qkv": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "o": [(0, cfg.hidden_size)],
        "gate_up": [(0, inter), (inter, 2 * inter)],
        "down": [(0, cfg.hidden_size)],
    }


class SoloGated:
    """One token of one expert-set request on the gated path, with its selection given.

    ``sel`` is the int32 device buffer laid out by ``ExpertSet.solo_rows`` for a batch of
    ``rows``. It may be a CUDA graph's static buffer: nothing here reads values on the host
    (value checks are off, or skipped by the kernels during capture), so a replay does no
    host work at all.
    """

    def __init__(self, es: ExpertSet, sel: torch.Tensor, rows: int, cfg: ModelConfig) -> None:
        if tuple(sel.shape) != es.solo_shape(rows):
            raise ValueError(f"sel must have shape {es.solo_shape(rows)}, got {tuple(sel.shape)}")
        self.es = es
        self.sel = sel
        self.rows = rows
        self.cols = _group_cols(cfg)
        self.meta: Any = None

    def route(self, h: torch.Tensor) -> None:
        """No router launch (the selection came from the set's token table); packed sets group
        the rows by slot once per step, on the device."""
        if self.es.packed:
            slots = self.sel[: self.rows]
            self.meta = build_segment_meta(
                slots, 1, max_tokens=self.rows, check_values=not slots.is_cuda
            )

    def apply(self, layer: int, group: str, out: torch.Tensor, x: torch.Tensor) -> None:
        es = self.es
        if es.packed:
            pk = es.packed[layer].get(group)
            if pk is None:
                return
            a, bs = pk
            v = sgmm_shrink(x, a, es.packed_ranks, self.meta, check_values=False)
            v.mul_(
                self.sel[self.rows :].view(torch.float32)
            )  # each expert's rank rows x its coefficient
            sgmm_expand(
                out, v, bs, es.packed_scales, es.packed_ranks, self.meta, check_values=False
            )
            return
        cols = self.cols[group]
        # Ids come from the set's own token table (router output) or are -1: no per-call
        # range check, which on CUDA would be a host sync per module and layer.
        ids, gates = self.sel[0], self.sel[1].view(torch.float32)
        for i, ea, eb in es.by_layer[layer][group]:
            lo, hi = cols[i]
            gated_add_lora(out[:, lo:hi], x, ea, eb, ids, gates, es.scale, check_values=False)


class GatedBatch:
    """The expert sets of one step and, per set, which rows of the flat batch it owns."""

    def __init__(self, sets: list[ExpertSet], token_set: torch.Tensor, cfg: ModelConfig) -> None:
        self.sets = sets
        self.token_set = token_set  # [T] int32: index into ``sets``, -1 = not an expert-set row
        self.cols = _group_cols(cfg)
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
        # Ids are route()'s top-k over this set's experts, or -1: no per-call range check.
        for es, ids, gates in self.routes:
            for i, a, b in es.by_layer[layer][group]:
                lo, hi = cols[i]
                gated_add_lora(out[:, lo:hi], x, a, b, ids, gates, es.scale, check_values=False)
