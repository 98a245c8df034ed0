"""Multi-LoRA GPU kernels: SGMM (shrink/expand/add_lora, bf16 and INT4), AdaFuse dynamic
adapters (route, fused merge/switch, gated add_lora), the decoder layer's elementwise ops and
paged attention.

The worker calls these names everywhere: Triton on CUDA tensors, the torch twin on CPU (see
``dispatch.py``). Segment metadata is built once per batch with ``build_segment_meta`` and
shared by every layer. Importing the package imports no triton: the Triton modules load on
their first launch, so a CPU worker runs the twins without a Triton install.

Where a change goes: a tile table or config lookup, ``sgmm_config.py``; a kernel body,
``sgmm_kernels.py`` (bf16) or ``sgmm_int4_kernels.py``; a launcher or grid, ``sgmm.py`` /
``sgmm_int4.py``; an argument check, ``_validate.py``; a torch twin, ``reference.py``; which
backend runs, ``dispatch.py``; the INT4 format, ``int4_weight.py`` and ``int4_quant.py``; an
AdaFuse kernel or launcher, ``fuse_kernels.py``, its switch tiling or merge table,
``fuse_config.py``. docs/kernels.md has the full table.
"""

import sys
import types

from adaptermesh.kernels.dispatch import (
    act_mul,
    add_lora,
    add_lora_int4,
    choose_backend,
    fused_merge,
    fused_switch,
    fused_unmerge,
    gated_add_lora,
    paged_attention,
    rms_norm,
    rope_kv_write,
    route,
    sgmm_expand,
    sgmm_shrink,
)
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta

__all__ = [
    "SegmentMeta",
    "act_mul",
    "add_lora",
    "add_lora_int4",
    "build_segment_meta",
    "choose_backend",
    "fused_merge",
    "fused_switch",
    "fused_unmerge",
    "gated_add_lora",
    "paged_attention",
    "rms_norm",
    "rope_kv_write",
    "route",
    "sgmm_expand",
    "sgmm_shrink",
]


class _Package(types.ModuleType):
    """This package. The op ``paged_attention`` shares its name with the kernel module
    ``paged_attention.py``, and Python binds a submodule's name on its package once it is
    imported; the op keeps the name (the module stays reachable through ``sys.modules`` and
    ``from adaptermesh.kernels.paged_attention import ...``)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "paged_attention" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
