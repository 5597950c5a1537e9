"""Triton quantization: ``lowprec.quant.quantize`` bit for bit, in one or two passes over the tensor.

``cast`` casts ``x`` along K and ``x.T`` along M (either or both) from one read of ``x`` (the row-major
and the transposed copies a linear layer's GEMMs need), optionally with the 16-point random Hadamard
transform on a side and the amax recorded for delayed scaling; ``quantize`` and ``quantize_pair`` are
the same with the reference's arguments. Which casts the kernels cover is said once, by
``triton_plan.covers``; the route (``lowprec.kernels.route``) asks it before choosing them.

Stochastic rounding draws its uniform numbers from Philox (``tl.rand4x``, four numbers per draw for
four neighbours) keyed by a seed drawn from ``generator`` and each element's position in its 2-D
view; given ``rand`` (the reference's argument) the kernel uses those numbers instead and equals the
reference bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from lowprec._checks import describe, fail
from lowprec.kernels import triton_ops as ops
from lowprec.kernels import triton_tiles as T
from lowprec.kernels.first_use import device_key
from lowprec.kernels.fold_rule import target as fold_target
from lowprec.kernels.ops import as_operators
from lowprec.kernels.route import CastSpec
from lowprec.kernels.triton_plan import Launch, Template, launch
from lowprec.quant import Granularity, QuantizedTensor, hadamard_matrix, rowwise
from lowprec.quant import quantize as _reference
from lowprec.quant.hadamard import RHT_BLOCK
from lowprec.quant.quantize import _check_args, as_2d

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_HMATS: dict[tuple[int, torch.device], torch.Tensor] = {}
"""Hadamard matrices built so far, by (seed, device): a plain table compiled code reads (and
guards on) without a break."""


@torch.compiler.disable
def _build_hadamard(seed: int, device: torch.device) -> torch.Tensor:
    # Its random signs come from a CPU torch.Generator, which a compiled graph cannot hold: built
    # outside any graph (a break the first time a compiled graph meets a new seed), then looked up.
    _HMATS[(seed, device)] = hadamard_matrix(RHT_BLOCK, seed, device=device)
    return _HMATS[(seed, device)]


def _hmat(seed: int | None, device: torch.device) -> torch.Tensor | None:
    """The 16 x 16 matrix ``D H / 4`` (exact in every dtype), or None when no side uses it."""
    if seed is None:
        return None
    m = _HMATS.get((seed, device))
    return m if m is not None else _build_hadamard(seed, device)


def _seeds(launch: Launch, device: torch.device, generator: torch.Generator | None) -> torch.Tensor | None:
    if not launch.philox:
        return None
    gen_device = generator.device if generator is not None else device
    seeds = torch.randint(0, 2**31 - 1, (2,), generator=generator, device=gen_device, dtype=torch.int32)
    return seeds.to(device)


def _prepare(x: torch.Tensor) -> torch.Tensor:
    x2 = as_2d(x.detach())  # (M, K), any strides
    return x2 if x2.dtype in _DTYPES else x2.float()


def _rand2(rand: torch.Tensor | None) -> torch.Tensor | None:
    return None if rand is None else as_2d(rand.detach()).float().contiguous()


def _traceable_amax(x2: torch.Tensor, kind: int, hadamard: bool, transposed: bool,
                    fold_block: int = 0) -> torch.Tensor | None:
    """A side's amax bits from torch reductions, where they are plain maxima of ``|x|`` (per tensor,
    per line, or a folded side's largest finite block per line, with whole blocks; no Hadamard transform),
    else None. Under ``torch.compile`` the compiler fuses these into the kernel that produced x, sparing the
    amax pass its read (and the graph an operator call). The bits equal the amax kernel's: the max of a
    float tensor is exact, and a NaN (which torch propagates) marks the scale NaN either way, or the block
    as not finite."""
    if hadamard or kind not in (T.AMAX_TENSOR, T.AMAX_LINES, T.AMAX_FOLD):
        return None
    a = x2.abs()
    if kind == T.AMAX_FOLD:  # (see [Note: tiles and sides] in triton_tiles)
        n = x2.shape[0] if transposed else x2.shape[1]  # along the side's reduction dimension
        if not fold_block or n % fold_block:
            return None
        blocks = (a.reshape(n // fold_block, fold_block, -1).amax(1) if transposed
                  else a.reshape(a.shape[0], -1, fold_block).amax(2))
        bits = blocks.float().view(torch.int32) & 0x7FFFFFFF
        return torch.where(bits < 0x7F800000, bits + 1, 0).amax(0 if transposed else 1)
    amax = a.amax().reshape(1) if kind == T.AMAX_TENSOR else a.amax(dim=0 if transposed else 1)
    return amax.float().view(torch.int32) & 0x7FFFFFFF  # a NaN's sign may survive abs(): clear it


def _amaxes(x2, launch: Launch, hmat, compiling: bool, opaque: bool):
    """Each side's amax bits, None for a side that takes none. In compiled code an absent side is None
    rather than a fresh empty tensor: the compiler never merges two calls that take distinct allocations,
    and layers reading one input (q/k/v) must make one cast of it (see :class:`lowprec.nn.casts.InputShare`)."""
    ka, kb = launch.amax_kinds
    if ka == kb == T.AMAX_NONE:
        return None, None
    if compiling:  # two sides spelled out: a loop over them costs the tracer several times the steps
        a = None if ka == T.AMAX_NONE else _traceable_amax(x2, ka, launch.hadamard[0], False, launch.fold_blocks[0])
        b = None if kb == T.AMAX_NONE else _traceable_amax(x2, kb, launch.hadamard[1], True, launch.fold_blocks[1])
        if (a is not None or ka == T.AMAX_NONE) and (b is not None or kb == T.AMAX_NONE):
            return a, b
    if opaque:
        return ops.tile_amax(x2, list(launch.ints), hmat)
    return ops.amax(x2, launch.ints, hmat)


def _run(x2, launch: Launch, hmat, given, rand_a, rand_b, generator, after=None):
    opaque = as_operators()  # ops in a graph or under a mode; direct calls otherwise
    amax_a, amax_b = _amaxes(x2, launch, hmat, torch.compiler.is_compiling(), opaque)
    given = None if given is None else given.detach().float().reshape(1).contiguous()
    args = (x2, hmat, amax_a, amax_b, given, rand_a, rand_b, _seeds(launch, x2.device, generator))
    if opaque:
        return ops.tile_cast(args[0], list(launch.ints), *args[1:], after)
    return ops.cast(args[0], launch.ints, *args[1:])


def _result(launch: Launch, i: int, data, scale, g, spec: CastSpec, shape, dtype, given) -> QuantizedTensor:
    if spec.folded:  # row-wise codes of the fold's target (see [Note: folding MX blocks into rows])
        return QuantizedTensor(data, scale, fold_target(spec.fmt), rowwise(), shape, dtype)
    if launch.given[i]:  # the reference keeps the given scale, broadcast to the block grid
        scale = torch.broadcast_to(given.float(), launch.scale_shapes[i])
    return QuantizedTensor(data, scale, spec.fmt, spec.granularity, shape, dtype, g if launch.nvfp4[i] else None)


def cast(
    x2: torch.Tensor, a: CastSpec | None, b: CastSpec | None, *, saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None, rand_t: torch.Tensor | None = None, record_amax: bool = False,
    templates: tuple[Template | None, Template | None] | None = None, after: torch.Tensor | None = None,
) -> tuple[QuantizedTensor | None, QuantizedTensor | None, torch.Tensor | None]:
    """``(x2 cast as a, x2.T [Hadamard-transformed] cast as b, amax of x2 or None)`` from one read of the
    non-empty 2-D ``x2``; a side that is None is not made. The kernels must cover both sides
    (:func:`lowprec.kernels.triton_plan.covers`; :func:`lowprec.kernels.route.route` checks).

    ``scale`` (delayed scaling) applies to both sides. A Hadamard side's shape is the padded one.
    ``templates``: the route's launch templates without and with a given scale (see
    :class:`lowprec.kernels.triton_plan.Template`), for casts with the default saturation and rounding.
    ``after``: in compiled code, a tensor the cast comes after (see ``lowprec.kernels.cast.cast``)."""
    dtype = x2.dtype
    x2 = _prepare(x2)
    m, k = x2.shape
    if scale is not None and scale.numel() != 1:
        fail("scale", "one per-tensor scale (a tensor of one element)", describe(scale))
    tmpl = (templates[1 if scale is not None else 0] if templates is not None and saturate and rand is rand_t is None
            else None)  # an int index: dynamo refuses a bool one
    if tmpl is not None:
        plan = tmpl.launch(m, k, record_amax)
    else:
        plan = launch(a, b, m, k, saturate, scale is not None, rand is not None, rand_t is not None, record_amax)
    seed = a.hadamard_seed if a is not None else None
    if seed is None and b is not None:
        seed = b.hadamard_seed
    out = _run(x2, plan, _hmat(seed, x2.device), scale, _rand2(rand), _rand2(rand_t), generator, after)
    q = None if a is None else _result(plan, 0, out[0], out[1], out[2], a, x2.shape, dtype, scale)
    q_t = None
    if b is not None:
        shape_t = (k, -(-m // RHT_BLOCK) * RHT_BLOCK) if b.hadamard_seed is not None else (k, m)
        scale_t = out[1] if plan.share else out[4]  # shared: the kernel wrote one scale, for both
        q_t = _result(plan, 1, out[3], scale_t, out[5], b, torch.Size(shape_t), dtype, scale)
    amax = out[6].view(torch.float32)[0] if record_amax else None
    return q, q_t, amax


def rows_by_amax(x2: torch.Tensor, spec: CastSpec, row_amax: torch.Tensor) -> torch.Tensor:
    """The codes ``(M, K)`` of the non-empty ``x2``'s rows each scaled by the amax it is given
    (``row_amax`` ``(M,)`` float32, the row's group's amax, not its own): the row-wise cast's kernel with
    its amax pass replaced by these, so each row gets ``amax_scale(row_amax)`` as a per-tensor cast of its
    group would (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``). ``spec``: a
    row-wise, current-scaled, nearest-rounded cast the kernels cover. Eager code only."""
    x2 = _prepare(x2)
    m, k = x2.shape
    plan = launch(spec, None, m, k, True, False, False, False, False)
    bits = row_amax.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF  # as the amax kernel's
    args = (None, bits, None, None, None, None, _seeds(plan, x2.device, None))
    out = ops.tile_cast(x2, list(plan.ints), *args) if as_operators() else ops.cast(x2, plan.ints, *args)
    return out[0]


def quantize(
    x: torch.Tensor, fmt, granularity: Granularity, *, rounding: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None, rand: torch.Tensor | None = None,
) -> QuantizedTensor:
    """``lowprec.quant.quantize`` through the kernels, which must cover the cast (an empty tensor, which
    no kernel needs to touch, goes to the reference)."""
    f, g = _check_args(x, fmt, granularity, rounding, scale, rand)
    if x.numel() == 0:
        return _reference(x, f, g, rounding=rounding, saturate=saturate, scale=scale, rand=rand, generator=generator)
    spec = CastSpec.of(f, g, rounding, delayed=scale is not None)
    q = cast(as_2d(x), spec, None, saturate=saturate, scale=scale, generator=generator, rand=rand)[0]
    return replace(q, shape=x.shape)


def quantize_pair(
    x2: torch.Tensor, fmt, granularity: Granularity, fmt_t, granularity_t: Granularity, *,
    rounding: str = "nearest", rounding_t: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None, rand_t: torch.Tensor | None = None,
    hadamard_t: int | None = None, record_amax: bool = False,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor | None]:
    """:func:`cast` of the 2-D ``x2`` with both sides given by name (``hadamard_t``: the transposed side's
    Hadamard seed)."""
    f, g = _check_args(x2, fmt, granularity, rounding, scale, rand)
    f_t, g_t = _check_args(x2.t(), fmt_t, granularity_t, rounding_t, scale, rand_t)
    if x2.numel() == 0:
        fail("x2", "a non-empty tensor", describe(x2))
    delayed = scale is not None
    return cast(x2, CastSpec.of(f, g, rounding, delayed=delayed),
                CastSpec.of(f_t, g_t, rounding_t, hadamard_t, delayed=delayed), saturate=saturate, scale=scale,
                generator=generator, rand=rand, rand_t=rand_t, record_amax=record_amax)


def nvfp4_by_lines(x2: torch.Tensor, spec: CastSpec, line_amax: torch.Tensor, *, transposed: bool = False,
                   rand: torch.Tensor | None = None) -> QuantizedTensor:
    """The non-empty 2-D ``x2`` cast as ``spec`` (NVFP4, the kernels cover it) along K, or ``x2.T`` along M
    where ``transposed`` (its Hadamard transform too, where ``spec`` has one), each block row of ``x2`` under
    the global scale of its own finite amax ``line_amax[i]`` (one per block row of ``x2``, float32): what
    ``lowprec.quant.quantize`` gives with ``global_amax`` one per block row (``(Mb, 1)``), or for ``x2.T`` one
    per block column (``(1, Mb)``), bit for bit, in one pass (the experts of a mixture cast together, each
    under its own global scale: ``lowprec.nn.grouped_casts``). ``rand``: stochastic rounding's uniform numbers,
    the reference's, of ``x2``'s shape or ``x2.T``'s (a transformed side's rows whole blocks: nothing padded)."""
    dtype = x2.dtype
    x2 = _prepare(x2)
    m, k = x2.shape
    a, b = (None, spec) if transposed else (spec, None)
    plan = launch(a, b, m, k, True, False, rand is not None and not transposed, rand is not None and transposed,
                  False, line_global=True)
    bits = line_amax.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF  # as the amax pass writes them
    rand = _rand2(rand)
    args = (_hmat(spec.hadamard_seed, x2.device), None if transposed else bits, bits if transposed else None, None,
            None if transposed else rand, rand if transposed else None, _seeds(plan, x2.device, None))
    out = ops.tile_cast(x2, list(plan.ints), *args) if as_operators() else ops.cast(x2, plan.ints, *args)
    if not transposed:
        return QuantizedTensor(out[0], out[1], spec.fmt, spec.granularity, x2.shape, dtype, out[2].view(-1, 1))
    shape_t = (k, -(-m // RHT_BLOCK) * RHT_BLOCK) if spec.hadamard_seed is not None else (k, m)
    return QuantizedTensor(out[3], out[4], spec.fmt, spec.granularity, torch.Size(shape_t), dtype, out[5].view(1, -1))


_LINES_CHECKED: dict[torch.device, bool] = {}


def lines_state(device: torch.device) -> bool | None:
    """The outcome of :func:`nvfp4_lines_checked` on ``device``: None before it ran there (``lowprec info``)."""
    return _LINES_CHECKED.get(device_key(device))


def nvfp4_lines_checked(device: torch.device) -> bool:
    """Whether :func:`nvfp4_by_lines` runs on ``device``: on its first use there it casts small problems of every
    kind the experts' casts make (rows along K; 16 x 16 weight blocks; the tokens' transposed side with the
    Hadamard transform and given uniform numbers; BF16 input) and must equal the reference bit for bit; else
    one warning, and the experts' NVFP4 casts run on the reference's operations on that device."""
    device = device_key(device)
    if device not in _LINES_CHECKED:
        _LINES_CHECKED[device] = _check_lines(device)
    return _LINES_CHECKED[device]


def _check_lines(device: torch.device) -> bool:
    import warnings

    try:
        for name, got, want in _lines_problems(device):
            q, r = got(), want()
            if not (torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(q.scale, r.scale)
                    and torch.equal(q.global_scale, r.global_scale)):
                warnings.warn(f"lowprec: the Triton NVFP4 cast with a global scale per expert differs from the "
                              f"reference on {device} ({name}); the experts' NVFP4 casts run on the reference's "
                              "tensor operations", stacklevel=4)
                return False
    except Exception as e:  # Triton's compiler or resources, the device itself: any failure
        warnings.warn(f"lowprec: the Triton NVFP4 cast with a global scale per expert fails on {device} "
                      f"({(str(e).splitlines() or [type(e).__name__])[0]}); the experts' NVFP4 casts run on "
                      "the reference's tensor operations", stacklevel=4)
        return False
    return True


def _lines_problems(device: torch.device) -> list:
    """(name, the kernel's cast, the reference's) for every kind of side the experts' casts make: rows along K;
    16 x 16 weight blocks from BF16; the tokens' transposed side with the Hadamard transform and given uniform
    numbers."""
    from lowprec.quant import hadamard_padded, nvfp4

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=gen) * torch.linspace(0.01, 40.0, 64)[:, None]).to(device)
    rows_amax = (torch.rand(64, generator=gen) * 50 + 0.5).to(device)
    block_amax = (torch.rand(4, generator=gen) * 50 + 0.5).to(device)
    rand = torch.rand(96, 64, generator=gen).to(device)
    one, two = nvfp4(16), nvfp4(16, two_d=True)
    e2m1 = "e2m1"
    return [
        ("rows", lambda: nvfp4_by_lines(x, CastSpec.of(e2m1, one, "nearest"), rows_amax),
         lambda: _reference(x, e2m1, one, global_amax=rows_amax[:, None])),
        ("16x16 blocks, BF16", lambda: nvfp4_by_lines(x.bfloat16(), CastSpec.of(e2m1, two, "nearest"), block_amax),
         lambda: _reference(x.bfloat16(), e2m1, two, global_amax=block_amax[:, None])),
        ("transposed, Hadamard, stochastic",
         lambda: nvfp4_by_lines(x, CastSpec.of(e2m1, one, "stochastic", 5), block_amax, transposed=True, rand=rand),
         lambda: _reference(hadamard_padded(x.t(), RHT_BLOCK, 5), e2m1, one, rounding="stochastic", rand=rand,
                            global_amax=block_amax[None, :])),
    ]
