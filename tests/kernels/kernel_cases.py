"""Inputs and the tolerance table shared by the kernel tests (and bench/bench_sgmm.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# One tolerance table per dtype. "out": elementwise (rtol, atol) for the add_lora result, which
# is rounded once to the dtype; atol also covers v's rounding to the weight dtype before the
# expand product landing on the other side of a tie (1 ulp of v ~ 2^-7 for bf16, times |B| and
# a scale <= 2). "norm": bound on ||got - ref|| / ||ref||. "v": the fp32 shrink
# output. Outputs are O(1) by construction (see make_case), so atol is in the same units and an
# element the kernel failed to write misses by O(1).
TOLERANCES: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.float32: {"out": (1e-5, 1e-5), "norm": (1e-5, 0.0), "v": (1e-5, 1e-5)},
    torch.float16: {"out": (2e-3, 5e-3), "norm": (1e-3, 0.0), "v": (1e-4, 1e-4)},
    torch.bfloat16: {"out": (1.6e-2, 4e-2), "norm": (5e-3, 0.0), "v": (1e-4, 1e-4)},
}
# The triton 3.9 CPU interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest
# even), so under TRITON_INTERPRET=1 each bf16 rounding can be off by a whole ulp, not half.
INTERPRETER_TOLERANCES: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    **TOLERANCES,
    torch.bfloat16: {"out": (1.6e-2, 6e-2), "norm": (1.2e-2, 0.0), "v": (1e-4, 1e-4)},
}


def tolerance(dtype: torch.dtype, what: str) -> tuple[float, float]:
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return (INTERPRETER_TOLERANCES if interp else TOLERANCES)[dtype][what]


MIXES = ("identical", "distinct", "uniform", "zipf", "skewed", "with_base", "all_base")


def make_slots(mix: str, t: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slots for a named adapter mix; -1 is the base model."""
    if mix == "identical":
        slots = torch.full((t,), int(torch.randint(0, s, (1,), generator=gen)))
    elif mix == "distinct":
        slots = torch.randperm(max(s, t), generator=gen)[:t] % s
    elif mix == "uniform":
        slots = torch.randint(0, s, (t,), generator=gen)
    elif mix == "zipf":
        p = torch.tensor([1.0 / (i + 1) for i in range(s)])
        slots = torch.multinomial(p, t, replacement=True, generator=gen)
    elif mix == "skewed":  # segments of 1 and T-1 tokens
        a, b = (0, s - 1) if s > 1 else (0, 0)
        slots = torch.full((t,), b)
        slots[int(torch.randint(0, t, (1,), generator=gen))] = a
    elif mix == "with_base":
        slots = torch.randint(-1, s, (t,), generator=gen)
    elif mix == "all_base":
        slots = torch.full((t,), -1)
    else:
        raise AssertionError(mix)
    return slots.to(torch.int32)


@dataclass
class Case:
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    scales: torch.Tensor
    ranks: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor


def make_case(
    *,
    t: int,
    h: int,
    s: int,
    r_max: int,
    ranks: list[int] | None,
    out_sizes: tuple[int, ...],
    mix: str,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> Case:
    """Fresh random inputs (never zeros) scaled so v, the LoRA term and out are all O(1):
    a kernel that skips an element of out then misses by O(1), far outside tolerance."""
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)  # big pools: draw on the device
    n_slices = len(out_sizes)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=dgen, device=device) * std).to(dtype)

    x = rnd(t, h, std=1.0)
    lora_a = rnd(n_slices, s, r_max, h, std=1.0 / math.sqrt(h))
    lora_b = tuple(rnd(s, n, r_max, std=1.0 / math.sqrt(r_max)) for n in out_sizes)
    scales = (0.5 + 1.5 * torch.rand(s, generator=gen)).to(device)
    if ranks is None:
        ranks = [r_max] * s
    rk = torch.tensor(ranks, dtype=torch.int32, device=device)
    slots = make_slots(mix, t, s, gen).to(device)
    out = rnd(t, sum(out_sizes), std=1.0)
    return Case(x, lora_a, lora_b, scales, rk, slots, out)


def defined_v_mask(case: Case, n_slices: int) -> torch.Tensor:
    """[n_slices, T, R_max] bool: entries sgmm_shrink promises to write."""
    r_max = case.lora_a.shape[2]
    slots = case.slots.long()
    rank_t = torch.where(slots >= 0, case.ranks.long()[slots.clamp(min=0)], 0)
    cols = torch.arange(r_max, device=slots.device)
    m = cols[None, :] < rank_t[:, None]
    return m.unsqueeze(0).expand(n_slices, -1, -1)
