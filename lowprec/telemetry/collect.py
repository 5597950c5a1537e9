"""The collector a sampled region installs, and the probe the linear layers report their casts into.

[Note: telemetry under torch.compile]
Telemetry is computed only on sampled steps, and a sampled step runs eagerly: :func:`collecting`
enters ``torch.compiler.set_stance("force_eager")``, so a compiled model runs its original Python
code for that step, with the collector readable (a ``contextvars`` value in ``lowprec.nn.probe``, as
``lowprec.autocast`` keeps its region). A layer asks :func:`probe` after its casts; while the compiler traces, the first
test (``torch.compiler.is_compiling()``) is a constant, the context variable is never read, and the
graph holds no trace of telemetry: unsampled compiled steps run the graphs they always ran, with no
graph break, no guard and no recompilation, and a sampled step leaves the compiled cache as it was.
The figures of a sampled step are those of the eager model, which the compiled one equals (the same
quantized values; tests/nn/test_compile_model.py). Collecting inside a graph instead would need the
statistics in every compiled graph (paid on every step, or a second graph per sampled step) and a
host read of their results; an eager step costs what an eager step costs, once every N steps.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.kernels import quantize
from lowprec.nn.probe import probe, reporting_to
from lowprec.quant.hadamard import RHT_BLOCK, hadamard_padded
from lowprec.telemetry.stats import OperandStats, cast_format, stats_tensor

__all__ = ["Collector", "collecting", "probe"]

_GEMM_OF_SIDE = {(int(role), transposed): sides[transposed][0]  # (role value, transposed side) -> its GEMM
                 for role, sides in R.SIDES.items() for transposed in (False, True)}
_OPERANDS = ("input", "weight", "grad_output")


class Collector:
    """The operand figures of one sampled region, by layer. Layers report tensors (no host sync);
    :meth:`finish` reads them all back at once and merges repeated reports of one layer's operand
    (gradient accumulation's micro-batches, a layer called twice) into the worst of each figure:
    the largest amax, scale, underflow and saturation, the lowest SQNR."""

    def __init__(self, names: dict[int, str], step: int) -> None:
        self._names = names
        """id of a layer's cast state -> the layer's name in the sampled model."""
        self.step = step
        self._pending: list[tuple[str, str, str, F.Format | None, torch.Tensor]] = []

    def side(self, state: object, role: int, transposed: bool, hp2: torch.Tensor, q, spec) -> None:
        """Report one cast side: ``q`` the cast of ``hp2`` (a layer's 2-D operand, transposed for the
        transposed side), made as ``spec`` says (None: kept in high precision, ``q`` a plain tensor)."""
        name = self._names.get(id(state))
        if name is None or q is None:
            return  # a layer outside the sampled model
        if spec is not None and spec.hadamard_seed is not None:
            hp2 = hadamard_padded(hp2, RHT_BLOCK, spec.hadamard_seed)  # what the cast quantized
        if spec is not None and spec.folded:
            # a folded cast's codes hold no block scales, so its saturation would be judged against the
            # FP8 target's range: the figures are those of the MX cast it folded, made again here (on
            # sampled steps only; a stochastic cast draws its own numbers, alike in distribution)
            q = quantize(hp2, spec.fmt, spec.granularity, rounding=spec.rounding.value)
        figures = stats_tensor(hp2, q)
        self._pending.append((name, _GEMM_OF_SIDE[(role, transposed)], _OPERANDS[role], cast_format(q), figures))

    def forward(self, state: object, plan, x2: torch.Tensor, weight: torch.Tensor | None, qx, qx_t, qw,
                qw_t) -> None:
        """Report a forward's casts: the input's (fprop, and wgrad's when made now) and the weight's
        (fprop, and dgrad's when made now); ``weight`` None when it arrived quantized (no high-precision
        copy to compare with)."""
        self.side(state, 0, False, x2, qx, _spec(plan.input, False))
        self.side(state, 0, True, x2.t(), qx_t, _spec(plan.input, True))
        if weight is not None:
            self.side(state, 1, False, weight, qw, _spec(plan.weight, False))
            self.side(state, 1, True, weight.t(), qw_t, _spec(plan.weight, True))

    def backward(self, state: object, plan, dy2: torch.Tensor, qdy, qdy_t, weight: torch.Tensor | None,
                 qw_t) -> None:
        """Report a backward's casts: grad_output's for dgrad and wgrad, and weight.T's when backward
        made it again (``weight``, else None: forward reported it)."""
        self.side(state, 2, False, dy2, qdy, _spec(plan.grad_output, False))
        self.side(state, 2, True, dy2.t(), qdy_t, _spec(plan.grad_output, True))
        if weight is not None:
            self.side(state, 1, True, weight.t(), qw_t, _spec(plan.weight, True))

    def finish(self) -> list[OperandStats]:
        if not self._pending:
            return []
        rows = torch.stack([f.cpu() for *_, f in self._pending]).tolist()  # one host sync per device
        merged: dict[tuple[str, str, str], list[float]] = {}
        formats: dict[tuple[str, str, str], F.Format | None] = {}
        for (name, gemm, operand, fmt, _), row in zip(self._pending, rows):
            key = (name, gemm, operand)
            merged[key] = row if key not in merged else _worst(merged[key], row)
            formats.setdefault(key, fmt)  # one layer's operand: one recipe, one format
        self._pending.clear()
        return [OperandStats(*key, *row, self.step, formats[key]) for key, row in merged.items()]


def _worst(a: list[float], b: list[float]) -> list[float]:
    """The worse of two reports' figures (amax, scale, underflow, saturation: the larger; SQNR: the
    lower); NaN wins, so a NaN seen once is not hidden by the other report."""
    def pick(u: float, v: float, choose) -> float:
        return math.nan if math.isnan(u) or math.isnan(v) else choose(u, v)

    return [pick(u, v, max) for u, v in zip(a[:4], b[:4])] + [pick(a[4], b[4], min)]


def _spec(op, transposed: bool):
    """The CastSpec of one side of an operand plan (None: the side is kept in high precision)."""
    if op is None:
        return None
    route = op.both if op.both is not None else op.transposed if transposed else op.along_k
    if route is None:
        return None
    return route.transposed if transposed else route.along_k


@contextlib.contextmanager
def collecting(collector: Collector) -> Iterator[Collector]:
    """Layers report into ``collector`` in the region, and compiled models run eagerly there."""
    with reporting_to(collector), torch.compiler.set_stance("force_eager"):
        yield collector
