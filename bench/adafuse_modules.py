"""AdaFuse on a Hugging Face model, for bench/bench_engine.py's decode comparison.

Thin ``nn.Module`` wrappers over the AdaFuse ops in ``adaptermesh.kernels.dispatch``: a router
at the first layer, each targeted ``nn.Linear`` wrapped with its experts, and a controller that merges
a one-token selection into every wrapped weight with one ``fused_switch`` (or, for larger
batches, adds the gated low-rank terms per token). The worker does not use them: its engine
holds the expert sets itself (``adaptermesh.worker.adafuse``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from adaptermesh.kernels.dispatch import fused_switch, fused_unmerge, gated_add_lora, route
from adaptermesh.kernels.fuse_config import MergeTarget, build_merge_table

__all__ = ["AdaFuseController", "AdaFuseRouter", "DynamicAdapter"]


class AdaFuseRouter(nn.Module):
    """Token-level pre-gating at the first layer: one linear ``hidden -> num_experts``, top-k,
    softmax over the selected logits. ``forward(h [T, hidden]) -> (ids [T, k] int32,
    gates [T, k] fp32)``."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.top_k = top_k
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        nn.init.normal_(self.weight, std=hidden**-0.5)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.weight, self.bias, self.top_k)


class DynamicAdapter(nn.Module):
    """One backbone linear layer with ``E`` expert LoRAs under AdaFuse gating.

    Constructor::

        DynamicAdapter(base: nn.Linear,
                       lora_a: Tensor[E, r, base.in_features],
                       lora_b: Tensor[E, base.out_features, r],
                       scale: float,            # alpha / r (or alpha / sqrt(r)), by the caller
                       *, exact: bool = True)   # keep a pristine copy of base.weight

    The expert weights are copied to ``base.weight``'s dtype and device. ``exact`` keeps a copy
    of the backbone weight so merges never drift (see the module docstring); set it False to
    save that memory and accept a bounded rounding drift.

    ``forward(x: Tensor[..., in_features]) -> Tensor[..., out_features]``:

    - without a controller or a routing decision: the plain backbone ``base(x)``;
    - when the controller merged a batch-1 selection into the weights: ``base(x)`` (the
      weight already holds ``W + c * sum_j g_j B_j A_j``);
    - otherwise ``base(x)`` plus the gated SGMM path with the controller's per-token routing;
      the number of tokens ``prod(x.shape[:-1])`` must equal the routed batch's.

    Register every ``DynamicAdapter`` of the model with one ``AdaFuseController``, then call
    ``controller.route(h_first_layer)`` once per forward step before running the layers.
    """

    def __init__(
        self,
        base: nn.Linear,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
        *,
        exact: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"base must be an nn.Linear, got {type(base).__name__}")
        w = base.weight
        e = lora_a.shape[0] if lora_a.dim() == 3 else -1
        if lora_a.dim() != 3 or lora_a.shape[2] != base.in_features or e < 1:
            raise ValueError(
                f"lora_a must be [E, r, {base.in_features}], got {tuple(lora_a.shape)}"
            )
        r = lora_a.shape[1]
        if lora_b.shape != (e, base.out_features, r):
            raise ValueError(
                f"lora_b must be [{e}, {base.out_features}, {r}], got {tuple(lora_b.shape)}"
            )
        self.base = base
        self.scale = float(scale)
        self.exact = exact
        self.lora_a: torch.Tensor
        self.lora_b: torch.Tensor
        self.register_buffer(
            "lora_a", lora_a.detach().to(device=w.device, dtype=w.dtype).contiguous()
        )
        self.register_buffer(
            "lora_b", lora_b.detach().to(device=w.device, dtype=w.dtype).contiguous()
        )
        self.master: torch.Tensor | None
        self.register_buffer("master", w.detach().clone() if exact else None)
        self.controller: AdaFuseController | None = None

    @property
    def num_experts(self) -> int:
        return int(self.lora_a.shape[0])

    def target(self) -> MergeTarget:
        if not self.base.weight.is_contiguous():
            raise ValueError("base.weight must be contiguous to be merged in place")
        return MergeTarget(
            weight=self.base.weight.data,
            lora_a=self.lora_a,
            lora_b=self.lora_b,
            scale=self.scale,
            master=self.master,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        ctl = self.controller
        if ctl is None or ctl.merged or ctl.routing is None:
            return y
        ids, gates = ctl.routing
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != ids.shape[0]:
            raise ValueError(f"x has {x2.shape[0]} tokens, the controller routed {ids.shape[0]}")
        y2 = y.reshape(-1, y.shape[-1])
        if not y2.is_contiguous():
            y2 = y2.contiguous()
        gated_add_lora(y2, x2.contiguous(), self.lora_a, self.lora_b, ids, gates, self.scale)
        return y2.view(y.shape)


class AdaFuseController:
    """Routes once per step and picks the path for every registered ``DynamicAdapter``.

    ``route(h [T, hidden])`` runs the router on the first layer's hidden states. With ``T == 1``
    it merges the token's selection into every targeted weight with one ``fused_switch`` launch
    (skipped when the selection is unchanged; the comparison reads 2k numbers back). With
    ``T > 1`` it restores the plain backbone (one launch, if something was merged) and leaves
    the per-token routing for the adapters' gated SGMM path. Returns ``(ids, gates)``.
    """

    def __init__(
        self,
        router: AdaFuseRouter,
        adapters: Sequence[DynamicAdapter],
        *,
        exact: bool = True,
    ) -> None:
        if not adapters:
            raise ValueError("adapters must hold at least one DynamicAdapter")
        for i, a in enumerate(adapters):
            if a.exact != exact:
                raise ValueError(
                    f"adapters[{i}].exact={a.exact} but the controller has exact={exact}"
                )
            if a.num_experts != router.weight.shape[0]:
                raise ValueError(
                    f"adapters[{i}] has {a.num_experts} experts, the router {router.weight.shape[0]}"
                )
        self.router = router
        self.adapters = list(adapters)
        self.table = build_merge_table([a.target() for a in adapters], exact=exact)
        self.merged = False
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None
        for a in adapters:
            a.controller = self

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, gates = self.router(h)
        if h.shape[0] == 1:
            new_ids, new_gates = ids[0].contiguous(), gates[0].contiguous()
            same = (
                self.merged
                and torch.equal(new_ids, self.table.cur_ids)
                and torch.equal(new_gates, self.table.cur_gates)
            )
            if not same:
                fused_switch(self.table, new_ids, new_gates)
            self.merged = True
        else:
            self.unmerge()
        self.routing = (ids, gates)
        return ids, gates

    def unmerge(self) -> None:
        """Restore the plain backbone weights (bit-exact in exact mode)."""
        if self.merged:
            fused_unmerge(self.table)
            self.merged = False
