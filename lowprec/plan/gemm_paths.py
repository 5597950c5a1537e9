"""How each GEMM of a recipe runs on a device: natively, folded, emulated, or in high precision.

The word is the kernels' own (see [Note: one source for "native"] in ``lowprec.kernels.native``):
a GEMM of two low-precision operands is native where ``gemm_path`` gives it a tensor-core GEMM in its
format, folded where it gives MX operands folded to row scales on FP8 tensor cores, else emulated, in
the high-precision dtype ``emulation_dtype`` gives; a GEMM with a high-precision operand is ``hp``.
``lowprec plan`` times each GEMM by this word and ``lowprec info`` prints it, so neither can call native
what the kernels emulate.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from lowprec import recipes as R
from lowprec.kernels.capability import Capability, cuda_capability, host_capability
from lowprec.kernels.gemm import GemmPath as KernelPath
from lowprec.kernels.gemm import emulation_dtype
from lowprec.kernels.gemm import gemm_path as kernel_path
from lowprec.kernels.native import is_native

GEMMS = R.GEMMS

DEVICES: dict[str, Capability] = {
    "sm80": cuda_capability((8, 0)), "sm89": cuda_capability((8, 9)), "sm90": cuda_capability((9, 0)),
    "sm100": cuda_capability((10, 0)), "sm120": cuda_capability((12, 0)), "cpu": host_capability("cpu"),
}
"""The devices docs/kernels.md's table of paths covers: Ampere, Ada, Hopper, Blackwell (data centre
and consumer), the CPU."""


class Path(enum.Enum):
    NATIVE = "native"
    """Both operands in low precision, multiplied by the tensor cores in that format."""
    FOLDED = "folded"
    """MX operands folded to one power-of-two scale per row, multiplied by FP8 tensor cores
    (``lowprec.kernels.fold``)."""
    EMULATED = "emulated"
    """Both operands in low precision, their exact values multiplied in a high-precision GEMM."""
    HP = "hp"
    """An operand in high precision: a BF16/FP16 GEMM, no low-precision arithmetic."""


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True, slots=True)
class GemmPath:
    gemm: str
    """``fprop``, ``dgrad`` or ``wgrad``."""
    path: Path
    emulated_in: str | None = None
    """``bf16`` or ``fp32``: the dtype of an emulated GEMM's high-precision multiply; None otherwise."""


def gemm_path_of(recipe: R.Recipe, gemm: str, cap: Capability) -> GemmPath:
    """How ``recipe``'s GEMM ``gemm`` runs on ``cap``'s device."""
    g: R.Gemm = getattr(recipe, gemm)
    if not g.low_precision:
        return GemmPath(gemm, Path.HP)
    casts = (g.lhs.fmt, g.lhs.granularity, g.rhs.fmt, g.rhs.granularity)
    if is_native(*casts, cap):
        return GemmPath(gemm, Path.NATIVE)
    if kernel_path(*casts, cap) is KernelPath.FOLDED:
        return GemmPath(gemm, Path.FOLDED)
    return GemmPath(gemm, Path.EMULATED, _DTYPE_NAMES[emulation_dtype(*casts, cap.device_type)])


def gemm_paths(recipe: R.Recipe, cap: Capability) -> tuple[GemmPath, GemmPath, GemmPath]:
    """fprop, dgrad and wgrad of ``recipe`` on ``cap``'s device."""
    fprop, dgrad, wgrad = (gemm_path_of(recipe, g, cap) for g in GEMMS)
    return fprop, dgrad, wgrad


def path_word(p: GemmPath) -> str:
    """``native``, ``folded (fp8)`` (on FP8 tensor cores), ``emulated (bf16)`` / ``emulated (fp32)`` (the dtype
    of its high-precision GEMM) or ``hp``."""
    if p.path is Path.FOLDED:
        return "folded (fp8)"
    return f"{p.path.value} ({p.emulated_in})" if p.path is Path.EMULATED else p.path.value


def recipe_word(recipe: R.Recipe, cap: Capability) -> str:
    """How ``recipe``'s GEMMs run on ``cap``'s device, in one word where all three agree."""
    words = [path_word(p) for p in gemm_paths(recipe, cap)]
    return words[0] if len(set(words)) == 1 else ", ".join(f"{g} {w}" for g, w in zip(GEMMS, words))


def paths_table(caps: dict[str, Capability]) -> str:
    """A markdown table of every preset recipe's :func:`recipe_word` on each of ``caps`` (by column name):
    the table docs/kernels.md shows, which a test holds to this function."""
    rows = [f"| {name} | " + " | ".join(recipe_word(R.get(name), c) for c in caps.values()) + " |"
            for name in R.names()]
    head = "| recipe | " + " | ".join(caps) + " |"
    return "\n".join([head, "|---" * (len(caps) + 1) + "|"] + rows)
