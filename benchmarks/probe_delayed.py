"""Where fp8-delayed's compile time and step time go: the 1B preset's widths with fewer blocks, compiled
cold, with parts of delayed scaling switched off (a diagnostic: the switched-off variants train wrongly).

    python benchmarks/probe_delayed.py VARIANT BLOCKS     # one variant per process, so each compiles cold

VARIANT:
    current      fp8-current, the reference
    delayed      fp8-delayed as it is
    norecord     fp8-delayed recording no amax (forward's and backward's)
    nobwdrecord  fp8-delayed recording forward's amaxes only
    noread       fp8-delayed whose compiled casts scale by the operand's own amax (no bank read)

Prints one ``RESULT`` line of JSON: the first step (compilation included), the median of 15 steps, the
graphs, and dynamo's and inductor's time per phase. Without CUDA it runs the tiny preset (a dry run).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import _common
import torch
import torch.nn.functional as nnf
from _models import ADAMW, SIZES

import lowprec
from lowprec.nn import delayed as D
from lowprec.nn import delayed_bank as DB
from lowprec.quant.scales import amax_scale
from lowprec.recipes import Role
from lowprec.train.model import build_model

VARIANTS = ("current", "delayed", "norecord", "nobwdrecord", "noread")
PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "aot_trace_joint_graph",
          "compile_fx_inner", "GraphLowering.compile_to_module", "GraphLowering.codegen", "Scheduler.__init__",
          "async_compile.wait")


def switch_off(variant: str) -> None:
    """Replace the part of delayed scaling that ``variant`` leaves out."""
    record = DB.DelayedBank.record
    if variant == "norecord":
        DB.DelayedBank.record = lambda self, row, role, amax: None
    elif variant == "nobwdrecord":
        DB.DelayedBank.record = lambda self, row, role, amax: (
            None if role is Role.GRAD_OUTPUT else record(self, row, role, amax))
    elif variant == "noread":
        scale = D.DelayedState.scale

        def own_scale(self, role, fmt, current=None):
            if torch.compiler.is_compiling() and current is not None:
                return amax_scale(current, fmt).reshape(1, 1)
            return scale(self, role, fmt, current)

        D.DelayedState.scale = own_scale


def main(variant: str, blocks: int) -> dict:
    if variant not in VARIANTS:
        raise SystemExit(f"probe_delayed.py: VARIANT must be one of {', '.join(VARIANTS)}, got {variant!r}")
    dev = _common.DEVICE
    torch._inductor.config.force_disable_caches = True
    switch_off(variant)
    size = SIZES["1b" if dev == "cuda" else "tiny"]
    cfg = dataclasses.replace(size.config, n_layers=blocks)
    model = build_model(cfg).to(dev)
    lowprec.convert(model, "fp8-current" if variant == "current" else "fp8-delayed")
    forward = torch.compile(model)
    tokens = torch.randint(0, cfg.vocab_size, (size.batch, size.seq_len + 1), device=dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = nnf.cross_entropy(forward(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    step().item()
    first = time.perf_counter() - t0
    cuda = dev == "cuda"
    for _ in range(3 if cuda else 0):
        step()
    seconds, _ = _common.timed(step, 15 if cuda else 1, dev)
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    phases = {k: round(float(v), 1) for k, v in zip(names, values) if k in PHASES}
    return {"variant": variant, "blocks": blocks, "first_s": round(first, 1),
            "step_ms": round(statistics.median(seconds) * 1e3, 2),
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], **phases}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print("RESULT", json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
