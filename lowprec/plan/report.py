"""A plan as JSON-ready data and as text tables."""
from __future__ import annotations

from lowprec import recipes as R
from lowprec._table import format_table
from lowprec.plan.gpus import GPUS
from lowprec.plan.layers import count_params
from lowprec.plan.models import all_presets
from lowprec.plan.planner import Plan
from lowprec.plan.units import GB

CURRENCY = "USD"
"""What ``--price-per-gpu-hour`` is counted in, so the cost is too."""


def _gb(nbytes: float) -> float:
    return round(nbytes / GB, 3)


def plan_to_dict(p: Plan) -> dict:
    c, par, t = p.config, p.parallel, p.throughput
    train = c.training
    return {
        "model": {"name": p.model.name, "params": p.params.total, "active_params": p.params.active,
                  "quantized_params": p.params.quantized, "layers": p.model.n_layers, "source": p.model.source},
        "recipe": {"name": p.recipe.name, "gemms": dict(zip(R.GEMMS, p.recipe.gemms)),
                   "note": p.recipe.note, "min_features": p.recipe.min_features},
        "gpu": {"name": p.gpu.key, "memory_gb": p.gpu.memory_gb, "source": p.gpu.source, "note": p.gpu.note},
        "parallel": {"gpus": par.gpus, "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "zero": par.zero},
        "training": {"seq": train.seq, "micro_batch": train.micro_batch, "grad_accum": train.grad_accum,
                     "recompute": train.recompute, "optimizer": train.optimizer, "grad_dtype": train.grad_dtype,
                     "optim_states": train.optim_states, "master_weights": train.master_weights,
                     "fp8_weights": train.fp8_weights,
                     "saved_activations": str(train.saved_activations) if train.saved_activations else None},
        "memory": {
            "stage": p.memory.stage,
            "components": [{"name": x.name, "bytes": x.bytes, "gb": _gb(x.bytes), "formula": x.formula}
                           for x in p.memory.components],
            "total_gb": _gb(p.memory.total), "capacity_gb": p.gpu.memory_gb, "fits": p.fits,
            "fewest_gpus": p.fewest_gpus,
        },
        "flops": [{"name": f.name, "flops_per_token": f.flops, "gemm": f.gemm, "path": f.path.value,
                   "emulated_in": f.emulated_in, "peak_tflops": f.tflops, "native": f.native,
                   "cast_bytes_per_token": f.cast_bytes, "recompute": f.recompute, "formula": f.formula}
                  for f in p.flops],
        "trainer_refusals": list(p.trainer_refusals),
        "throughput": {
            "formula": ("tokens/s = gpus x mfu / sum(flops_per_token / peak)" if p.step is None else
                        "tokens/s = tokens_per_step / sum(parts' seconds per step on one GPU)"),
            "mfu": c.mfu, "model_flops_per_token": t.model_flops_per_token,
            "bf16_peak_fraction": _bf16_peak_fraction(p),
            "step_parts": None if p.step is None else [
                {"name": x.name, "seconds": x.seconds, "how": x.how} for x in p.step.parts],
            "fractions": None if p.step is None else {
                "measured_on": p.step.efficiency.gpu, "this_gpu": p.step.measured,
                "source": p.step.efficiency.source, "pipeline_factor": p.step.bubble},
            "effective_peak_tflops": t.effective_peak_tflops, "tokens_per_s": t.tokens_per_s,
            "tokens_per_step": t.tokens_per_step, "step_s": t.step_s, "tokens": t.tokens, "days": t.days,
            "gpu_hours": t.gpu_hours, "price_per_gpu_hour": c.price_per_gpu_hour, "cost": t.cost,
            "currency": CURRENCY, "cost_formula": "cost = gpu_hours x price_per_gpu_hour",
        },
    }


def _fit_line(p: Plan) -> str:
    used, cap = p.memory.total / GB, p.gpu.memory_gb
    verdict = "fits" if p.fits else "does NOT fit"
    line = f"{verdict}: {used:.1f} of {cap:g} GB per GPU ({100 * used / cap:.0f}%)"
    par = p.parallel
    layout = f"tp {par.tp} x pp {par.pp} x ep {par.ep}, ZeRO-{par.zero}"
    if p.fewest_gpus is None:
        return line + f"; no GPU count fits with {layout}" + _hint(p)
    return line + f"; fewest GPUs that fit with {layout}: {p.fewest_gpus}"


def _hint(p: Plan) -> str:
    """What to try where nothing fits: only options not already at their most saving value."""
    tries = (["--zero 3"] if p.parallel.zero < 3 else []) + ["more --tp/--pp"] + (
        ["--recompute full"] if p.config.training.recompute != "full" else [])
    return f" (try {', '.join(tries[:-1])} or {tries[-1]})" if len(tries) > 1 else f" (try {tries[0]})"


def _trainer_lines(p: Plan) -> list[str]:
    if not p.trainer_refusals:
        return []
    return ["", "lowprec train cannot run this layout as planned:"] + [f"  {line}" for line in p.trainer_refusals]


def _bf16_peak_fraction(p: Plan) -> float:
    """Model FLOPs per second per GPU over the BF16 peak: what the benchmarks report as MFU (above 1 where FP8
    GEMMs carry the step: their peak is twice BF16's)."""
    return p.throughput.model_flops_per_token * p.throughput.tokens_per_s / p.parallel.gpus / (
        p.gpu.peak("bf16")[0] * 1e12)


def _step_lines(p: Plan) -> list[str]:
    if p.step is None:
        return []
    s = p.step
    where = (f"measured on this GPU ({s.efficiency.source})" if s.measured else
             f"measured on the {s.efficiency.gpu.upper()}, assumed for the {p.gpu.key.upper()} ({s.efficiency.source})")
    rows = [[x.name, f"{1e3 * x.seconds:,.1f}", f"{100 * x.seconds / s.step_s:.0f}%", x.how] for x in s.parts]
    rows.append(["step", f"{1e3 * s.step_s:,.1f}", "100%", "" if s.bubble == 1 else
                 f"pipeline stage {s.stage}, the slowest; its compute x {s.bubble:.3g} for 1F1B's bubble"])
    notes = [f"fractions of peak {where}; communication not modelled"
             + ("" if p.parallel.gpus == 1 else ": a bound for more than one GPU")]
    return ["", "step time on one GPU by part (--mfu replaces this by one fraction)",
            format_table(["part", "ms", "share", "how"], rows)] + notes


def _time_lines(p: Plan) -> list[str]:
    t = p.throughput
    how = (f"at MFU {p.config.mfu:g}" if p.step is None else
           f"model FLOPs at {_bf16_peak_fraction(p):.0%} of the BF16 peak")
    lines = [f"{t.tokens_per_s:,.0f} tokens/s on {p.parallel.gpus} GPUs "
             f"(blended peak {t.effective_peak_tflops:,.0f} TFLOP/s per GPU; {how}); "
             f"step of {t.tokens_per_step:,} tokens: {t.step_s:.3g} s"]
    if t.days is not None:
        line = f"{t.tokens:.3g} tokens: {t.days:,.1f} days, {t.gpu_hours:,.0f} GPU-hours"
        if t.cost is not None:
            line += f", cost ${t.cost:,.0f} (at ${p.config.price_per_gpu_hour:,.2f} per GPU-hour)"
        lines.append(line)
    return lines


def format_plan(p: Plan) -> str:
    m, par, train = p.model, p.parallel, p.config.training
    head = [
        f"{m.name} ({p.params.total / 1e9:.2f}B params, {p.params.active / 1e9:.2f}B active), recipe "
        f"{p.recipe.name}, {par.gpus} x {p.gpu.key} (tp {par.tp}, pp {par.pp}, ep {par.ep}, dp {par.dp}, "
        f"ZeRO-{par.zero})",
        f"seq {train.seq} x micro-batch {train.micro_batch}, grad accumulation {train.grad_accum}, "
        f"recompute {train.recompute}, "
        + (f"norm/SwiGLU inputs saved as {train.saved_activations}, " if train.saved_activations else "") +
        f"optimizer {train.optimizer} ({train.optim_states} moments"
        f"{'' if train.master_weights else ', no master weights'}), gradients {train.grad_dtype}",
        "",
        f"memory per GPU (pipeline stage {p.memory.stage}, the fullest; "
        f"{p.memory.layers[0] + p.memory.layers[1]} layers)",
    ]
    rows = [[x.name, f"{x.bytes / GB:.2f}", x.formula] for x in p.memory.components]
    rows.append(["total", f"{p.memory.total / GB:.2f}", ""])
    flops = [[f.name, f.label, f"{f.tflops:g}",
              f"{f.flops / 1e9:.4g}", f.formula] for f in p.flops]
    return "\n".join(head + [format_table(["component", "GB", "formula"], rows), "", _fit_line(p)]
                     + _trainer_lines(p) + ["",
                             "FLOPs per token by GEMM format",
                             format_table(["part", "format", "peak TFLOP/s", "GFLOP", "formula"], flops)]
                     + _step_lines(p) + [""] + _time_lines(p))


def format_comparison(plans: list[Plan]) -> str:
    """Several recipes' plans of one model and layout side by side, each against the first."""
    base = plans[0]
    m, par = base.model, base.parallel
    head = (f"{m.name} ({base.params.total / 1e9:.2f}B params), {par.gpus} x {base.gpu.key} (tp {par.tp}, "
            f"pp {par.pp}, ep {par.ep}, ZeRO-{par.zero}), seq {base.config.training.seq} x micro-batch "
            f"{base.config.training.micro_batch}: each recipe against {base.recipe.name}")
    rows = []
    for p in plans:
        t = p.throughput
        row = [p.recipe.name, f"{p.memory.total / GB:.1f}", f"{p.memory.total / base.memory.total:.2f}x",
               "yes" if p.fits else "no", "-" if p.fewest_gpus is None else str(p.fewest_gpus),
               f"{t.tokens_per_s:,.0f}", f"{t.tokens_per_s / base.throughput.tokens_per_s:.2f}x"]
        if t.days is not None:
            row.append(f"{t.days:,.1f}" + ("" if t.cost is None else f" (${t.cost:,.0f})"))
        rows.append(row)
    cols = ["recipe", "GB per GPU", "memory", "fits", "fewest GPUs", "tokens/s", "speed"]
    cols += ["days (cost)"] if base.throughput.days is not None else []
    how = (f"at MFU {base.config.mfu:g}" if base.step is None else
           "step time by parts at fractions of peak measured on the " + base.step.efficiency.gpu.upper()
           + ("" if base.step.measured else f", assumed for the {base.gpu.key.upper()}"))
    return "\n".join([head, "", format_table(cols, rows), "", f"speed {how}; `lowprec plan` with one recipe "
                                                            "shows each plan's components"])


def gpu_table() -> str:
    rows = [[g.key, g.name, f"{g.memory_gb:g}", f"{g.hbm_tb_s:g}", f"{g.link_gb_s:g}",
             " ".join(f"{f}={v:g}" for f, v in g.peaks), g.source + (f" ({g.note})" if g.note else "")]
            for g in GPUS.values()]
    return format_table(["gpu", "name", "GB", "HBM TB/s", "link GB/s", "dense TFLOP/s", "source"], rows)


def model_table() -> str:
    rows = []
    for key, m in all_presets().items():
        c = count_params(m)
        rows.append([key, f"{c.total / 1e9:.3f}B", f"{c.active / 1e9:.3f}B", m.n_layers, m.d_model, m.source])
    return format_table(["model", "params", "active", "layers", "d_model", "source"], rows)
