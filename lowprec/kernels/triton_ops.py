"""The Triton cast kernels as ``torch.library`` operators, with fake implementations.

Registered as opaque operators (``lowprec.kernels.ops.define``) so that ``torch.compile`` keeps them in
its graph without a break. Eager code calls the same implementations directly (``amax`` / ``cast``
below), skipping the dispatcher's few tens of microseconds per call, which matter next to kernels of
a few hundred; under a Python dispatch mode it calls the operators (see
``lowprec.kernels.triton_quant.as_operators``). A plan travels as a tuple of ints (see ``triton_plan``);
the kernel arguments it implies are worked out once per plan. Every output is a fresh tensor; unused outputs are empty.
"""
from __future__ import annotations

import functools

import torch
import triton

from lowprec.kernels import triton_launch as launch
from lowprec.kernels import triton_numerics as N
from lowprec.kernels import triton_tiles as T
from lowprec.kernels.fold_rule import MIN_SHIFT, NAN_EXPONENT
from lowprec.kernels.ops import define
from lowprec.kernels.triton_plan import Plan, Side, off_args

_Out = tuple[tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...]] | None
"""A side's outputs: codes' shape and storage dtype, scales' shape, the global scale's shape (one, or one per
block row of x: ``triton_numerics.RULE_NVFP4_LINES``); None for a side not made."""


@functools.lru_cache(maxsize=256)
def _config(plan: tuple[int, ...]) -> tuple[Plan, tuple[int, int], dict, dict, tuple[_Out, _Out], tuple[int, ...]]:
    """(plan, grid, amax-kernel constants, cast-kernel constants, each side's outputs, the cast kernel's
    output dimensions) of a plan: everything a launch needs but the tensors, worked out once."""
    p = Plan.from_ints(list(plan))
    bm, bk, warps = p.tile
    even = p.m % bm == 0 and p.k % bk == 0
    grid = (triton.cdiv(p.m, bm), triton.cdiv(p.k, bk))
    amax_kw = dict(BM=bm, BK=bk, EVEN=even, num_warps=warps)
    for suffix, s in (("A", p.a), ("B", p.b)):
        kind = s.amax_kind if s is not None else T.AMAX_NONE
        block = s.block if s is not None else (1, 1)
        amax_kw.update({f"KIND_{suffix}": kind, f"HAD_{suffix}": int(bool(s and s.hadamard)),
                        f"BR_{suffix}": block[0], f"BC_{suffix}": block[1]})
    cast_kw = dict(BM=bm, BK=bk, EVEN=even, RECORD=p.record, SHARE=p.share, num_warps=warps,
                   NAN_E=NAN_EXPONENT, MIN_D=MIN_SHIFT,
                   **(p.a.kernel_args("A") if p.a else off_args("A")),
                   **(p.b.kernel_args("B") if p.b else off_args("B")))
    outs = tuple(None if s is None else (tuple(s.out_shape), s.out_format.storage_dtype, tuple(s.scale_shape),
                                         _global_shape(s, transposed))
                 for s, transposed in ((p.a, False), (p.b, True)))
    dims = tuple(d for s in (p.a, p.b) for d in ((*s.out_shape, *s.scale_shape) if s is not None else (0, 0, 0, 0)))
    return p, grid, amax_kw, cast_kw, outs, dims


def _global_shape(s: Side, transposed: bool) -> tuple[int, ...]:
    """One global scale, or one per block row of x (side B's scales lie transposed: x's block rows are their
    columns)."""
    if s.rule != N.RULE_NVFP4_LINES:
        return ()
    return (s.scale_shape[1] if transposed else s.scale_shape[0],)


def _amax_len(s: Side | None, p: Plan, transposed: bool) -> int:
    if s is None or s.amax_kind == T.AMAX_NONE:
        return 0
    return (p.k if transposed else p.m) if s.amax_kind in (T.AMAX_LINES, T.AMAX_FOLD) else 1


def _pointer(t: torch.Tensor | None, live: torch.Tensor) -> torch.Tensor:
    """``t``, or ``live`` where ``t`` is absent or empty (a side without an amax: never read)."""
    return t if t is not None and t.numel() else live


def amax(x: torch.Tensor, plan: tuple[int, ...], hmat: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 bits of the amaxes each side's cast needs (one per tensor or per line). ``hmat``: the
    Hadamard matrix where a side transforms (unused pointers get x: any live allocation will do)."""
    hmat = x if hmat is None else hmat
    p, grid, kw, *_ = _config(plan)
    amax_a = torch.zeros(_amax_len(p.a, p, False), dtype=torch.int32, device=x.device)
    amax_b = torch.zeros(_amax_len(p.b, p, True), dtype=torch.int32, device=x.device)
    args = (x, x.stride(0), x.stride(1), p.m, p.k, hmat, _pointer(amax_a, hmat), _pointer(amax_b, hmat))
    _launch(T.amax_kernel, grid, args, kw, x, plan)
    return amax_a, amax_b


def _launch(kernel, grid, args: tuple, kw: dict, x: torch.Tensor, plan: tuple[int, ...], hw: bool = False) -> None:
    """``kernel[grid](*args, **kw)`` (and ``HW=x.is_cuda`` where ``hw``: the kernel converts with the
    GPU's instructions); on a GPU through :func:`lowprec.kernels.triton_launch.run`, whose launches of
    one plan skip Triton's argument binding after the first."""
    meta = {**kw, "HW": x.is_cuda} if hw else kw
    launch.launch(kernel, grid, args, meta, plan, x.is_cuda)


def _outputs(x: torch.Tensor, out: _Out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if out is None:
        return (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32),
                x.new_empty(0, dtype=torch.float32))
    shape, dtype, scale_shape, global_shape = out
    return (x.new_empty(shape, dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32),
            x.new_empty(global_shape, dtype=torch.float32))


def cast(
    x: torch.Tensor, plan: tuple[int, ...], hmat: torch.Tensor | None, amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    given: torch.Tensor | None, rand_a: torch.Tensor | None, rand_b: torch.Tensor | None, seed: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """(data_a, scale_a, global_a, data_b, scale_b, global_b, recorded amax bits) of one tile pass."""
    outs, grid, args, kw = cast_launch(x, plan, hmat, amax_a, amax_b, given, rand_a, rand_b, seed)
    _launch(T.cast_kernel, grid, args, kw, x, plan, hw=True)
    return outs


def cast_launch(
    x: torch.Tensor, plan: tuple[int, ...], hmat: torch.Tensor | None, amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    given: torch.Tensor | None, rand_a: torch.Tensor | None, rand_b: torch.Tensor | None, seed: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, int], tuple, dict]:
    """:func:`cast`'s outputs, allocated, and the cast kernel's grid, runtime arguments and constants (but
    ``HW``) that write them: everything of the pass but the launch."""
    hmat = x if hmat is None else hmat
    p, grid, _, kw, (out_a, out_b), (ra, ca, sra, sca, rb, cb, srb, scb) = _config(plan)
    data_a, scale_a, g_a = _outputs(x, out_a)
    data_b, scale_b, g_b = _outputs(x, out_b)
    record = torch.zeros(1, dtype=torch.int32, device=x.device) if p.record else x.new_empty(0, dtype=torch.int32)
    # Unused pointers get a live allocation (hmat, which is x where there is none): an empty tensor may
    # have no address. Sides not made have empty outputs.
    a_on, b_on = out_a is not None, out_b is not None
    args = (
        x, x.stride(0), x.stride(1), p.m, p.k, hmat, hmat if given is None else given,
        hmat if seed is None else seed, record if p.record else hmat,
        _pointer(amax_a, hmat), hmat if rand_a is None else rand_a,
        data_a.view(torch.uint8) if a_on else hmat, ra, ca, scale_a if a_on else hmat, sra, sca, g_a if a_on else hmat,
        _pointer(amax_b, hmat), hmat if rand_b is None else rand_b,
        data_b.view(torch.uint8) if b_on else hmat, rb, cb, scale_b if b_on else hmat, srb, scb, g_b if b_on else hmat,
    )
    return (data_a, scale_a, g_a, data_b, scale_b, g_b, record), grid, args, kw


def _amax_op(x, plan, hmat):
    return amax(x, tuple(plan), hmat)


def _amax_fake(x, plan, hmat):
    p = Plan.from_ints(plan)
    return (x.new_empty(_amax_len(p.a, p, False), dtype=torch.int32),
            x.new_empty(_amax_len(p.b, p, True), dtype=torch.int32))


def _cast_op(x, plan, hmat, amax_a, amax_b, given, rand_a, rand_b, seed, after=None):
    return cast(x, tuple(plan), hmat, amax_a, amax_b, given, rand_a, rand_b, seed)


def _cast_fake(x, plan, hmat, amax_a, amax_b, given, rand_a, rand_b, seed, after=None):
    p, _, _, _, (out_a, out_b), _ = _config(tuple(plan))
    return (*_outputs(x, out_a), *_outputs(x, out_b), x.new_empty(1 if p.record else 0, dtype=torch.int32))


tile_amax = define("tile_amax(Tensor x, int[] plan, Tensor? hmat) -> (Tensor, Tensor)", _amax_op, _amax_fake)
""":func:`amax` as an operator (see [Note: how kernels become operators] in ``lowprec.kernels.ops``)."""
tile_cast = define("tile_cast(Tensor x, int[] plan, Tensor? hmat, Tensor? amax_a, Tensor? amax_b, Tensor? given, "
                   "Tensor? rand_a, Tensor? rand_b, Tensor? seed, Tensor? after=None) -> (Tensor, Tensor, Tensor, "
                   "Tensor, Tensor, Tensor, Tensor)", _cast_op, _cast_fake)
""":func:`cast` as an operator: (data_a, scale_a, global_a, data_b, scale_b, global_b, recorded amax bits).
``after`` is never read: a tensor the cast must come after in the graph (see [Note: casts a compiled
backward makes] in ``lowprec.kernels.cast``)."""
