"""Triton quantization: ``lowprec.quant.quantize`` bit for bit, in one or two passes over the tensor.

``supports`` says which casts the kernels cover; ``quantize`` is the reference's signature;
``quantize_pair`` casts ``x`` along K and ``x.T`` along M from one read of ``x`` (the row-major and
the transposed copies a linear layer's GEMMs need), optionally with the 16-point random Hadamard
transform on the transposed side and the amax recorded for delayed scaling.

Stochastic rounding draws its uniform numbers from Philox (``tl.rand4x``, four numbers per draw for
four neighbours) keyed by a seed drawn from ``generator`` and each element's position in its 2-D
view; given ``rand`` (the reference's argument) the kernel uses those numbers instead and equals the
reference bit for bit.
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec.kernels import triton_ops as ops
from lowprec.kernels import triton_tiles as T
from lowprec.kernels.triton_plan import Plan, Side, side
from lowprec.quant import Granularity, QuantizedTensor, hadamard_matrix
from lowprec.quant import quantize as _reference
from lowprec.quant.quantize import _check_args, as_2d

HADAMARD_BLOCK = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(fmt, granularity: Granularity, rounding: str = "nearest") -> bool:
    """Whether the kernels cover this cast (any shape; saturating; computed scales)."""
    try:
        f = F.get(fmt)
    except (TypeError, ValueError):
        return False
    if not isinstance(granularity, Granularity) or rounding not in ("nearest", "stochastic"):
        return False
    return side(f, granularity, rounding, True, transposed=False, rows=1, cols=1) is not None


_HMATS: dict[tuple[int, torch.device], torch.Tensor] = {}
"""Hadamard matrices built so far, by (seed, device): a plain table compiled code reads (and
guards on) without a break."""


@torch.compiler.disable
def _build_hadamard(seed: int, device: torch.device) -> torch.Tensor:
    # Its random signs come from a CPU torch.Generator, which a compiled graph cannot hold: built
    # outside any graph (a break the first time a compiled graph meets a new seed), then looked up.
    _HMATS[(seed, device)] = hadamard_matrix(HADAMARD_BLOCK, seed, device=device)
    return _HMATS[(seed, device)]


def _hmat(seed: int | None, device: torch.device) -> torch.Tensor | None:
    """The 16 x 16 matrix ``D H / 4`` (exact in every dtype), or None when no side uses it."""
    if seed is None:
        return None
    m = _HMATS.get((seed, device))
    return m if m is not None else _build_hadamard(seed, device)


def _seeds(p: Plan, device: torch.device, generator: torch.Generator | None) -> torch.Tensor | None:
    if not any(s is not None and s.rounding == T.ROUND_PHILOX for s in (p.a, p.b)):
        return None
    gen_device = generator.device if generator is not None else device
    seeds = torch.randint(0, 2**31 - 1, (2,), generator=generator, device=gen_device, dtype=torch.int32)
    return seeds.to(device)


def _prepare(x: torch.Tensor) -> torch.Tensor:
    x2 = as_2d(x.detach())  # (M, K), any strides
    return x2 if x2.dtype in _DTYPES else x2.float()


def _rand2(rand: torch.Tensor | None) -> torch.Tensor | None:
    return None if rand is None else as_2d(rand.detach()).float().contiguous()


def _traceable_amax(x2: torch.Tensor, s: Side | None, transposed: bool) -> torch.Tensor | None:
    """A side's amax bits from torch reductions, where they are plain maxima of ``|x|`` (per tensor,
    per line, no Hadamard transform), else None. Under ``torch.compile`` the compiler fuses these into
    the kernel that produced x, sparing the amax pass its read. The bits equal the amax kernel's:
    the max of a float tensor is exact, and a NaN (which torch propagates) marks the scale NaN either way."""
    if s is None or s.amax_kind == T.AMAX_NONE:
        return x2.new_empty(0, dtype=torch.int32)
    if s.hadamard or s.amax_kind not in (T.AMAX_TENSOR, T.AMAX_LINES):
        return None
    a = x2.abs()
    amax = a.amax().reshape(1) if s.amax_kind == T.AMAX_TENSOR else a.amax(dim=0 if transposed else 1)
    return amax.float().view(torch.int32) & 0x7FFFFFFF  # a NaN's sign may survive abs(): clear it


def _amaxes(x2, plan: Plan, ints: tuple[int, ...], hmat, compiling: bool):
    if compiling:
        a, b = _traceable_amax(x2, plan.a, False), _traceable_amax(x2, plan.b, True)
        if a is not None and b is not None:
            return a, b
        return ops.tile_amax(x2, list(ints), hmat)
    return ops.amax(x2, ints, hmat)


def _run(x2, plan: Plan, hmat, given, rand_a, rand_b, generator):
    ints = tuple(plan.to_ints())
    compiling = torch.compiler.is_compiling()  # ops in a graph; direct calls in eager mode
    if any(s is not None and s.amax_kind != T.AMAX_NONE for s in (plan.a, plan.b)):
        amax_a, amax_b = _amaxes(x2, plan, ints, hmat, compiling)
    else:
        amax_a = amax_b = x2.new_empty(0, dtype=torch.int32)
    given = None if given is None else given.detach().float().reshape(1).contiguous()
    args = (x2, hmat, amax_a, amax_b, given, rand_a, rand_b, _seeds(plan, x2.device, generator))
    if compiling:
        return ops.tile_cast(args[0], list(ints), *args[1:])
    return ops.cast(args[0], ints, *args[1:])


def _result(s: Side, data, scale, g, fmt, gran, shape, dtype, given) -> QuantizedTensor:
    if s.mode == T.MODE_GIVEN:  # the reference keeps the given scale, broadcast to the block grid
        scale = torch.broadcast_to(given.float(), s.scale_shape)
    return QuantizedTensor(data, scale, fmt, gran, shape, dtype, g if s.rule == 3 else None)


def quantize(
    x: torch.Tensor, fmt, granularity: Granularity, *, rounding: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None, rand: torch.Tensor | None = None,
) -> QuantizedTensor:
    """``lowprec.quant.quantize`` through the Triton kernels (the reference where they do not apply)."""
    f, g = _check_args(x, fmt, granularity, rounding, scale, rand)
    x2 = _prepare(x)
    m, k = x2.shape
    a = None if m * k == 0 else side(f, g, rounding, saturate, transposed=False, rows=m, cols=k,
                                     given_scale=scale, rand=rand is not None)
    if a is None:
        return _reference(x, f, g, rounding=rounding, saturate=saturate, scale=scale, rand=rand, generator=generator)
    out = _run(x2, Plan(m, k, a, None), _hmat(None, x.device), scale, _rand2(rand), None, generator)
    return _result(a, out[0], out[1], out[2], f, g, x.shape, x.dtype, scale)


def quantize_pair(
    x2: torch.Tensor, fmt, granularity: Granularity, fmt_t, granularity_t: Granularity, *,
    rounding: str = "nearest", rounding_t: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None, rand_t: torch.Tensor | None = None,
    hadamard_t: int | None = None, record_amax: bool = False,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor | None] | None:
    """``(quantize(x2, ...), quantize(x2.T [Hadamard-transformed], ...), amax of x2 or None)`` from one
    read of the 2-D ``x2``, or None where the kernels cannot do both sides in one pass.

    ``scale`` (delayed scaling) applies to both sides. ``hadamard_t``: the seed of the random
    Hadamard transform applied to ``x2.T`` along its last dimension (zero-padded to 16), as
    ``lowprec.quant.hadamard``; that side's shape is then the padded one."""
    f, g = _check_args(x2, fmt, granularity, rounding, scale, rand)
    f_t, g_t = _check_args(x2.t(), fmt_t, granularity_t, rounding_t, scale, rand_t)
    dtype = x2.dtype
    x2 = _prepare(x2)
    m, k = x2.shape
    if m * k == 0:
        return None
    a = side(f, g, rounding, saturate, transposed=False, rows=m, cols=k, given_scale=scale, rand=rand is not None)
    b = side(f_t, g_t, rounding_t, saturate, transposed=True, rows=k, cols=m, given_scale=scale,
             rand=rand_t is not None, hadamard=hadamard_t is not None)
    if a is None or b is None:
        return None
    plan = Plan(m, k, a, b, record=record_amax)
    out = _run(x2, plan, _hmat(hadamard_t, x2.device), scale, _rand2(rand), _rand2(rand_t), generator)
    q = _result(a, out[0], out[1], out[2], f, g, x2.shape, dtype, scale)
    shape_t = (k, -(-m // HADAMARD_BLOCK) * HADAMARD_BLOCK) if hadamard_t is not None else (k, m)
    scale_t = out[1] if plan.share else out[4]  # shared: the kernel wrote one scale, for both
    q_t = _result(b, out[3], scale_t, out[5], f_t, g_t, torch.Size(shape_t), dtype, scale)
    amax = out[6].view(torch.float32)[0] if record_amax else None
    return q, q_t, amax
