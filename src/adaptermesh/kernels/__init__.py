"""Multi-LoRA GPU kernels: SGMM (shrink/expand/add_lora) and AdaFuse dynamic adapters.

The worker calls ``adaptermesh.kernels.add_lora`` everywhere: Triton on CUDA tensors, the torch
twin on CPU (see ``dispatch.py``). Segment metadata is built once per batch with
``build_segment_meta`` and shared by every layer.
"""

# Imported first for its side effect. The kernel module and the op share the name
# ``paged_attention``, and importing a submodule binds its name on the package; imported here,
# before the op below takes the name, the module can never displace the op later.
import adaptermesh.kernels.paged_attention as _paged_attention_kernels  # noqa: F401
from adaptermesh.kernels.dispatch import (
    act_mul,
    add_lora,
    choose_backend,
    paged_attention,
    rms_norm,
    rope_kv_write,
    sgmm_expand,
    sgmm_shrink,
)
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta

__all__ = [
    "SegmentMeta",
    "act_mul",
    "add_lora",
    "build_segment_meta",
    "choose_backend",
    "paged_attention",
    "rms_norm",
    "rope_kv_write",
    "sgmm_expand",
    "sgmm_shrink",
]
