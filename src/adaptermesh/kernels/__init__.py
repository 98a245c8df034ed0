"""Multi-LoRA GPU kernels: SGMM (shrink/expand/add_lora, bf16 and INT4), AdaFuse dynamic
adapters (route, fused merge/switch, gated add_lora), the decoder layer's elementwise ops and
paged attention.

The package re-exports nothing: each name is imported from the module that owns it. The worker
calls the ops in ``dispatch.py`` (Triton on CUDA tensors, the torch twin on CPU) and nothing
past it (an import-linter contract). Segment metadata is built once per batch with
``meta.build_segment_meta`` and shared by every layer. Importing the package, ``dispatch``,
``meta`` or ``reference`` imports no triton: the Triton modules load on their first launch, so
a CPU worker runs the twins without a Triton install.

Where a change goes: a tile table or config lookup, ``sgmm_config.py``; a kernel body,
``sgmm_kernels.py`` (bf16) or ``sgmm_int4_kernels.py``; a launcher or grid, ``sgmm.py`` /
``sgmm_int4.py``; an argument check, ``_validate.py``; a torch twin, ``reference.py``; which
backend runs, ``dispatch.py``; the INT4 format, ``int4_weight.py`` and ``int4_quant.py``; an
AdaFuse kernel or launcher, ``fuse_kernels.py``, its switch tiling or merge table,
``fuse_config.py``. docs/kernels.md has the full table.
"""
