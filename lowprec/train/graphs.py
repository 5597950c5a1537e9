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


def compiled(model: nn.Module, backend: str | None, cuda_graphs: bool) -> nn.Module:
    """``model`` compiled with ``backend`` (itself where None), replayed as CUDA graphs where ``cuda_graphs``
    (inductor's ``reduce-overhead`` mode; the config has checked the backend is inductor)."""
    if backend is None:
        return model
    if cuda_graphs:
        return torch.compile(model, backend=backend, mode="reduce-overhead")
    return torch.compile(model, backend=backend)


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
