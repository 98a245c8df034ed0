"""Kernel test setup: the Triton interpreter on machines without CUDA, shared inputs, tolerances.

``triton.jit`` picks the interpreter when a kernel is *decorated*, so TRITON_INTERPRET must be
set before ``adaptermesh.kernels.sgmm`` / ``fuse`` are imported. Another part's tests may have
imported them first; they are reloaded then, so the CPU tests always run the real kernels in
the interpreter. On a CUDA machine nothing changes and the kernels compile for the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in (
        "adaptermesh.kernels.sgmm",
        "adaptermesh.kernels.fuse",
        "adaptermesh.kernels.layer_ops",
        "adaptermesh.kernels.paged_attention",
        "adaptermesh.kernels.sgmm_int4",
    ):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
