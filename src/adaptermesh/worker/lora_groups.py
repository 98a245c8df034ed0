"""Which projection modules LoRA targets and how they group into the fused base matmuls.

A small table module of its own so the model runtime (``model.py``), PEFT adapter reading
(``peft_adapter.py``) and AdaFuse expert sets (``adafuse.py``) share it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FUSED_MODULES", "GROUPS", "MODULE_TO_GROUP", "SUPPORTED_MODULES", "pool_groups"]

# Group name -> module names in slice order. Must stay in sync with the fused weight layout in
# TransformerModel (wqkv = [q; k; v], w_gate_up = [gate; up]).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_TO_GROUP: dict[str, tuple[str, int]] = {
    m: (g, i) for g, ms in GROUPS.items() for i, m in enumerate(ms)
}
SUPPORTED_MODULES: tuple[str, ...] = tuple(MODULE_TO_GROUP)
# A checkpoint's fused module -> the modules it stacks, in row order (Phi-3). An adapter on it
# has one A for all of them and a B whose row blocks are theirs.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": GROUPS["qkv"],
    "gate_up_proj": GROUPS["gate_up"],
}


def pool_groups(target_modules: Sequence[str] | None) -> frozenset[str] | None:
    """The pool groups that hold adapters on ``target_modules`` (None: every group). Raises
    ValueError naming a module the worker does not serve LoRA on."""
    if target_modules is None:
        return None
    unknown = [m for m in target_modules if m not in MODULE_TO_GROUP]
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} is not a LoRA target module (one of {', '.join(SUPPORTED_MODULES)})"
        )
    if not target_modules:
        raise ValueError("at least one target module is needed")
    return frozenset(MODULE_TO_GROUP[m][0] for m in target_modules)
