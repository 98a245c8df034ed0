"""AdaFuse dynamic adapters, their public names in one place: the ops (``route``,
``fused_switch`` / ``fused_merge`` / ``fused_unmerge``, ``gated_add_lora``) pick Triton or the
torch twin in ``dispatch.py``; the switch tiling and the merge table are ``fuse_config.py``; the
kernels, their launchers and the maths are ``fuse_kernels.py``. Importing this module imports
triton (``switch_launch_args`` names Triton types); ``adaptermesh.kernels`` and
``fuse_config`` give the ops and the table without it.
"""

from adaptermesh.kernels.dispatch import (
    fused_merge,
    fused_switch,
    fused_unmerge,
    gated_add_lora,
    route,
)
from adaptermesh.kernels.fuse_config import (
    DEFAULT_SWITCH_CONFIG,
    SWITCH_CANDIDATES,
    MergeTable,
    MergeTarget,
    SwitchConfig,
    SwitchPlan,
    build_merge_table,
)
from adaptermesh.kernels.fuse_kernels import switch_launch_args

__all__ = [
    "DEFAULT_SWITCH_CONFIG",
    "SWITCH_CANDIDATES",
    "MergeTable",
    "MergeTarget",
    "SwitchConfig",
    "SwitchPlan",
    "build_merge_table",
    "fused_merge",
    "fused_switch",
    "fused_unmerge",
    "gated_add_lora",
    "route",
    "switch_launch_args",
]
