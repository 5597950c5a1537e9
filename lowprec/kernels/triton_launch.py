"""Launching a Triton kernel again without re-binding its arguments.

[Note: launching a Triton kernel cheaply]
``kernel[grid](*args, **constexprs)`` binds every argument on every call: it classifies each one
(dtype, alignment, divisibility, whether an int is 1), formats the result into a cache key and looks
the compiled kernel up. For the cast kernel, with 27 runtime arguments and 32 constants, that took
45-92 us of CPU per launch on the H200's hosts, against 13 us for a kernel of two arguments; a compiled
1B training step calls the cast 400 times, and on a slow host the CPU, not the GPU, sets the step's
pace. Launched through the cache, the cast kernel took 21 us where the ordinary launch took 45.

:func:`run` keeps the compiled kernel Triton returned at the first launch of a *site key*: the
caller's own key (a cast's plan) and the constants' values, with what the binder derives from the
arguments themselves (a tensor's dtype and whether its address is a multiple of 16; for an int, whether
it is 1, whether 16 divides it and whether it fits 32 bits), so two launches with one key are launches
Triton would bind alike. Later launches with that key go straight to the compiled kernel's launcher
(``CompiledKernel[grid]``, Triton's own entry for a compiled kernel, on this launch's grid), with the
arguments Triton's binder would have passed: every parameter in order, constants
included. Anything else (the CPU interpreter, a kernel object without that entry) takes the ordinary
launch every time: the same kernel either way, only its host cost differs. If a compiled kernel's
launcher refuses those arguments (a Triton that passes them otherwise), the cache turns itself off
with a warning. What Triton's ordinary launch re-reads at every call and the cache does not: a kernel's
pre-run hooks (a kernel with any is never cached), a changed global the kernel reads, and Triton's
debug and instrumentation settings, which change its own cache key; lowprec's kernels read no
globals, and a process that turns those settings on should set ``LOWPREC_LAUNCH_CACHE=0``.
"""
from __future__ import annotations

import os
import warnings

import torch

DISABLED = os.environ.get("LOWPREC_LAUNCH_CACHE") == "0" or torch.version.hip is not None
"""``LOWPREC_LAUNCH_CACHE=0`` (to measure what the cache saves), or a ROCm build (whose binder also
specialises on a tensor's size): every launch takes Triton's ordinary path."""
_CACHE: dict[tuple, list] = {}
_LIMIT = 4096
"""Entries kept; beyond it the table starts afresh (a model's cast sites and their layouts: hundreds)."""
_REFUSED: list[str] = []
"""The error that turned the cache off, once one has."""


def _key_of(args: tuple) -> tuple:
    """What Triton's binder reads from each argument: a tensor's dtype and 16-byte alignment; for an int,
    whether it is 1 (then a constant), whether 16 divides it (an alignment it compiles for) and its range
    (``a >> 31`` is 0 or -1 exactly for an i32; beyond, the high bits tell i64 from u64), so a size that
    changes at every call (the routed tokens of experts) still finds its compiled kernel; anything else
    by type and value (True, 1 and 1.0 are equal in Python and bound differently by Triton). Inline: it
    runs for every argument of every launch."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0, a >> 31) if type(a) is int else (type(a), a) for a in args)


def run(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, site: tuple) -> None:
    """``kernel[grid](*args, **constexprs)`` on the current CUDA device. ``args``: the kernel's runtime
    parameters in order (tensors, ints); ``constexprs``: its constants and launch options (hashable
    values, given in the same order at every launch of a site); ``site``: the caller's key. Launches that
    ``site``, those constants, the device and the arguments' own specialisation already met go straight to
    the compiled kernel."""
    if _REFUSED or DISABLED:
        kernel[grid](*args, **constexprs)
        return
    # the constants' values too: a caller's site need not name those it derives from sizes (a tile's
    # evenness), which ints of one class no longer tell apart
    key = (id(kernel), site, torch.cuda.current_device(), tuple(constexprs.values()), _key_of(args))
    hit = _CACHE.get(key)
    if hit is not None:
        compiled, tail, tried = hit
        runner = compiled[(*grid, 1, 1)[:3]]  # a compiled kernel's launcher takes three grid dims
        if tried:
            runner(*args, *tail)
            return
        try:  # the entry's first direct launch: a launcher that takes other arguments refuses them
            runner(*args, *tail)
            hit[2] = True
            return
        except (TypeError, IndexError) as e:
            _refuse(e)
    compiled = kernel[grid](*args, **constexprs)
    if _REFUSED or getattr(kernel, "pre_run_hooks", None):  # hooks run at every ordinary launch
        return
    if compiled is None or not hasattr(compiled, "__getitem__") or not hasattr(compiled, "function"):
        return  # not a compiled GPU kernel (the interpreter): the ordinary launch each time
    params = kernel.signature.parameters
    tail = tuple(constexprs[n] if n in constexprs else params[n].default  # the constants, in parameter order
                 for n in kernel.arg_names[len(args):])
    if len(_CACHE) >= _LIMIT:
        _CACHE.clear()
    _CACHE[key] = [compiled, tail, False]


def launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, site: tuple, gpu: bool) -> None:
    """:func:`run` where ``gpu`` (the arguments are on a CUDA device); elsewhere (Triton's interpreter on
    the CPU) the ordinary launch."""
    if gpu:
        run(kernel, grid, args, constexprs, site)
    else:
        kernel[grid](*args, **constexprs)


def _torch_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def device_workspace() -> None:
    """Let a kernel that makes tensor-memory-accelerator descriptors on the device launch from this thread:
    Triton asks the allocator ``triton.set_allocator`` set, per thread (a context variable), for their
    global scratch at each launch, and by default has none (the launch fails). Where this thread has none,
    it gets one from PyTorch's caching allocator on the current stream (so a launch recorded into a CUDA
    graph takes its scratch from the graph's pool); an allocator already set is kept."""
    if _workspace_set():
        return
    import triton

    triton.set_allocator(_torch_workspace)


def _workspace_set() -> bool:
    try:
        from triton.runtime import _allocation
    except ImportError:  # a Triton without the module: set one every time
        return False
    return not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)


def _refuse(e: Exception) -> None:
    """Stop using the cache (this Triton's compiled-kernel launcher does not take what Triton's own launch
    passes it), and say so once: launches stay correct, at the ordinary host cost."""
    if not _REFUSED:
        _REFUSED.append(repr(e))
        warnings.warn(f"lowprec: Triton kernels take the ordinary launch path (the launch cache failed: {e!r})",
                      stacklevel=3)
    _CACHE.clear()


def host_table(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small table made on the host (``t``, on the CPU) on ``device``: to a GPU from pinned memory, so the
    copy waits for no earlier work (a copy from pageable memory waits for the whole stream first)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
