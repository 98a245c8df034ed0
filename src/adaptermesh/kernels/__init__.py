"""Multi-LoRA GPU kernels: SGMM (shrink/expand/add_lora) and AdaFuse dynamic adapters.

The worker calls ``adaptermesh.kernels.add_lora`` everywhere: Triton on CUDA tensors, the torch
twin on CPU (see ``dispatch.py``). Segment metadata is built once per batch with
``build_segment_meta`` and shared by every layer.
"""

from adaptermesh.kernels.dispatch import add_lora, choose_backend, sgmm_expand, sgmm_shrink
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta

__all__ = [
    "SegmentMeta",
    "add_lora",
    "build_segment_meta",
    "choose_backend",
    "sgmm_expand",
    "sgmm_shrink",
]
