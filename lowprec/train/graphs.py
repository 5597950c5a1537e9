"""The trainer's compiled model, with CUDA graphs where ``TrainConfig.cuda_graphs`` asks for them.

[Note: CUDA graphs in the trainer]
``torch.compile(mode="reduce-overhead")`` has inductor record each compiled graph (forward, backward) as a
CUDA graph at its first calls and replay it afterwards: one launch for the graph's hundreds of kernels,
so the host's time per step (dispatch, lowprec's operators, Triton's launches) leaves the step. It pays
where the host sets the pace: the FP8 experts of ``moe-1b`` (BENCHMARKS.md, "Mixture of experts"); a dense
1B step, which the GPU bounds, runs as fast without. A replay writes its outputs into the memory of the
last replay's, so each step starts a new generation (:func:`begin_step`) and nothing from an earlier
step's graphs is kept past it: the loss is read within the step, the gradients are consumed by the
optimizer before the next forward.

Inductor skips recording a graph it cannot replay (a CPU tensor among its inputs, an input written in
place that is not a parameter or buffer, an operator marked unsafe to record) and runs it as an ordinary
compiled graph. Skips are counted by inductor; :func:`warn_unrecorded` turns a new count into a warning
that names how many, so a run asked for CUDA graphs is never silently without them.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from lowprec.nn import GroupedLinear


def compiled(model: nn.Module, backend: str | None, cuda_graphs: bool) -> nn.Module:
    """``model`` compiled with ``backend`` (itself where None), replayed as CUDA graphs where ``cuda_graphs``
    (inductor's ``reduce-overhead`` mode; the config has checked the backend is inductor)."""
    if backend is None:
        return model
    if cuda_graphs:
        return torch.compile(model, backend=backend, mode="reduce-overhead")
    return torch.compile(model, backend=backend)


def suggest(model: nn.Module, compile_backend: str | None, cuda_graphs: bool, device: str, one_process: bool) -> None:
    """Warn once where a compiled run would likely train faster with CUDA graphs and could have them: low-precision
    mixture-of-experts layers (whose batched casts and grouped GEMMs are many small kernels the host launches)
    compiled by inductor on a CUDA device, in one process without gradient accumulation (``one_process``),
    without ``cuda_graphs``."""
    if compile_backend != "inductor" or cuda_graphs or not str(device).startswith("cuda") or not one_process:
        return
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedLinear) and m.recipe is not None
               and m.recipe.low_precision]
    if experts:
        warnings.warn(f"lowprec: {len(experts)} low-precision expert layer(s) ({experts[0]}, ...) compiled without "
                      "CUDA graphs: their many small kernels leave the step bound by the host's launches (moe-1b "
                      "on an H200: fp8-current 0.62x BF16's speed, 0.92x with graphs); pass --cuda-graphs "
                      "(TrainConfig.cuda_graphs=True)", stacklevel=2)


def begin_step(cuda_graphs: bool) -> None:
    """Start a step: the last step's graph outputs are dead from here (see the Note)."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def skipped() -> int:
    """Compiled graphs inductor has run without recording them as CUDA graphs, in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def warn_unrecorded(seen: int) -> int:
    """Warn where inductor has skipped recording graphs since the count ``seen`` (:func:`skipped` when the
    run began: the count is the process's, which an earlier run of ``compare`` may have raised); the count
    now."""
    now = skipped()
    if now > seen:
        warnings.warn(f"lowprec: cuda_graphs: {now - seen} compiled graph(s) run without CUDA graphs (inductor "
                      "did not record them: a CPU tensor or an input written in place among their inputs, or an "
                      "operator unsafe to record); those steps keep the host's per-kernel launches", stacklevel=2)
    return now
