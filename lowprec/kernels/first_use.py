"""A GEMM path that checks itself against the emulation the first time it runs on a device.

[Note: GEMM paths that check themselves]
A GEMM path this project cannot run in CI, or that differs from the emulation by a bound rather than not at
all (MX operands folded to row scales on Hopper, ``kernels.fold``; Blackwell's block-scaled tensor cores,
``kernels.blackwell``), runs only on a device where it has shown, on its first use there, that it computes
what the emulation (``kernels.gemm._emulated``) computes: on small problems whose products' sums the device's
accumulation keeps (small integers times powers of two), within :data:`TOLERANCE` of ``|A| |B|^T``. A path
that raises or differs warns once, in one line, and that device's GEMMs take the next path down. Each check's
outcome per device is kept for the process (``lowprec info --check`` runs them and shows it).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from lowprec.quant import QuantizedTensor

TOLERANCE = 2.0 ** -9
"""What a check accepts, per unit of ``|A| |B|^T``: the tensor cores' accumulation inside a K step (about
14 bits kept on Hopper, DeepSeek-V3 measured) over a few steps; a misread scale or layout is off by whole
units."""

Gemm = Callable[[QuantizedTensor, QuantizedTensor], torch.Tensor]


def integer_operands(device: torch.device, fmt: str, granularity, rows: int = 48, cols: int = 40, k: int = 160,
                     block: int = 32) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Two operands quantized along K whose values are small integers times a power of two per block of
    ``block`` (up to four binades apart): every partial sum representable, every folding exact."""
    from lowprec.quant import quantize

    g = torch.Generator(device="cpu").manual_seed(0)
    n = rows + cols
    ints = torch.randint(-3, 4, (n, k), generator=g).float()
    blocks = 2.0 ** torch.randint(-2, 3, (n, k // block), generator=g).float()
    x = (ints.view(n, k // block, block) * blocks[:, :, None]).view(n, k).to(device)
    lhs, rhs = granularity if isinstance(granularity, tuple) else (granularity, granularity)
    return quantize(x[:rows], fmt, lhs), quantize(x[rows:], fmt, rhs)


def relative_error(a: QuantizedTensor, b: QuantizedTensor, gemm: Gemm, emulated: Gemm) -> float:
    """``gemm``'s largest difference from ``emulated`` on ``a @ b.T``, per unit of ``|A| |B|^T``."""
    m, n = a.shape[0], b.shape[0]
    want, got = emulated(a, b)[:m, :n].float(), gemm(a, b)[:m, :n].float()  # outputs may carry padding
    scale = a.dequantize(torch.float32).abs() @ b.dequantize(torch.float32).abs().t()
    return ((got - want).abs() / scale.clamp(min=1e-30)).max().item()


def device_key(device: torch.device | str) -> torch.device:
    """``device`` as a check's outcome is kept under: a CUDA device without an index is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class FirstUseCheck:
    """One path's checks: ``problems(device)`` gives named operand pairs; ``what`` names the path and
    ``otherwise`` says where its GEMMs go when a check fails, in the warning."""

    def __init__(self, what: str, otherwise: str,
                 problems: Callable[[torch.device], list[tuple[str, QuantizedTensor, QuantizedTensor]]]):
        self.what, self.otherwise, self.problems = what, otherwise, problems
        self._done: dict[torch.device, bool] = {}

    def checked(self, device: torch.device, gemm: Gemm, emulated: Gemm) -> bool:
        """Whether the path runs on ``device``: checked there on the first call, remembered afterwards."""
        key = device_key(device)
        if key not in self._done:
            self._done[key] = self.run(key, gemm, emulated)
        return self._done[key]

    def run(self, device: torch.device, gemm: Gemm, emulated: Gemm) -> bool:
        """The check itself, warning once if it fails (not remembered: :meth:`checked` does that)."""
        for name, a, b in self.problems(device):
            try:
                err = relative_error(a, b, gemm, emulated)
            except Exception as e:  # a kernel's compiler or the library's refusal: any error
                first = (str(e).splitlines() or [type(e).__name__])[0]
                warnings.warn(f"lowprec: {self.what} fail on {device} ({first}); {self.otherwise}", stacklevel=5)
                return False
            if not err <= TOLERANCE:
                warnings.warn(f"lowprec: {self.what} differ from the emulation on {device} ({name}: by {err:.3g} of "
                              f"|A||B|^T, more than {TOLERANCE:.3g}); {self.otherwise}", stacklevel=5)
                return False
        return True

    def state(self, device: torch.device) -> bool | None:
        """True or False once checked on ``device``, None before."""
        return self._done.get(device_key(device))

    def status(self) -> dict[str, bool]:
        return {str(d): ok for d, ok in self._done.items()}


__all__ = ["TOLERANCE", "FirstUseCheck", "device_key", "integer_operands", "relative_error"]
