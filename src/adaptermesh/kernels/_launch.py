"""Kernel launches: a plain call, or one bound once so that calling it only launches.

``launch`` is ``kernel[grid](*args, **constexprs, ...)``: Triton's own dispatch binds the
arguments, computes the specialisation key and looks up the compiled kernel on every call.

``prepare`` does all of that once, without running the kernel, and returns a closure that calls
the compiled kernel's launcher directly with the bound arguments, the way ``JITFunction.run``
does after its lookup (an ``AddLoraPlan`` is two of these). It needs the launcher interface of
triton >= 3.4 (``triton.knobs``; launchers take every bound argument, constexprs included).
Older triton, the CPU interpreter and non-CUDA tensors get a closure over the plain call, which
is always correct. ``ADAPTERMESH_GENERIC_LAUNCH=1`` forces that too.

A cache of compiled kernels behind the plain call was measured on the H200 and dropped: with
argument checks in Python around every ``add_lora``, skipping Triton's dispatch saved nothing
measurable (151 vs 156 us and 150 vs 162 us per call in one run, slower in another).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from adaptermesh.kernels._backend import interpreter_enabled

__all__ = ["fast_path_available", "launch", "prepare"]

try:  # triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton
    _knobs = None


def fast_path_available() -> bool:
    return (
        _knobs is not None
        and not interpreter_enabled()
        and os.environ.get("ADAPTERMESH_GENERIC_LAUNCH", "") != "1"
    )


def launch(
    kernel: Any,  # a triton JITFunction
    grid: tuple[int, int, int],
    args: tuple[object, ...],  # runtime arguments in signature order
    constexprs: dict[str, object],  # every constexpr, in signature order
    *,
    num_warps: int,
    num_stages: int,
    launch_pdl: bool = False,
) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``; ``launch_pdl``:
    a programmatic dependent launch (the kernel may start while the previous one finishes and
    waits for it with ``gdc_wait``; CUDA, compute capability 9.0 and up)."""
    extra = {"launch_pdl": True} if launch_pdl else {}
    kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **extra)


def prepare(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple[object, ...],
    constexprs: dict[str, object],
    *,
    num_warps: int,
    num_stages: int,
    launch_pdl: bool = False,
) -> Callable[[], None]:
    """A launch with every argument bound now: calling it costs the driver call alone.

    The kernel is compiled here (without running); the closure keeps the tensors alive. Where
    the fast path is unavailable the closure is the generic launch, still correct.
    """
    extra = {"launch_pdl": True} if launch_pdl else {}
    if not fast_path_available() or not args or not isinstance(args[0], torch.Tensor):

        def generic() -> None:
            kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **extra)

        return generic
    # launch_pdl is compiled into the kernel's metadata, which its launcher reads.
    compiled = kernel.warmup(
        *args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages, **extra
    )
    values = (*args, *constexprs.values())
    device = args[0].device
    run = compiled.run
    function = compiled.function
    packed = compiled.packed_metadata
    g0, g1, g2 = grid
    runtime = _knobs.runtime

    def fast() -> None:
        stream = _raw_stream(device)
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
        run(g0, g1, g2, stream, function, packed, meta, enter, leave, *values)

    return fast


def _raw_stream(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(index))
    return int(torch.cuda.current_stream(device).cuda_stream)
