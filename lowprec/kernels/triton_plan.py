"""From a cast (format, granularity, rounding) to the constants of the Triton kernels.

A :class:`Side` is one output of a tile pass (see [Note: tiles and sides] in ``triton_tiles``): what
it quantizes, how its scale is found and where it goes. :class:`Plan` is the two sides plus the
tile; it travels to the ``torch.library`` ops as a flat list of ints (ops take no dataclasses).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.kernels import triton_numerics as N
from lowprec.kernels import triton_tiles as T
from lowprec.kernels.fold_rule import foldable, headroom
from lowprec.kernels.fold_rule import target as fold_target
from lowprec.quant import Granularity, GranularityKind, ScaleRule
from lowprec.quant.hadamard import RHT_BLOCK

FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
"""Element formats the kernels write; a format's index is its code in a plan."""
_RULES = {ScaleRule.AMAX: N.RULE_AMAX, ScaleRule.FLOOR: N.RULE_FLOOR, ScaleRule.CEIL: N.RULE_CEIL,
          ScaleRule.NVFP4: N.RULE_NVFP4}
SPECIALS = {F.Special.NONE: N.SPECIAL_NONE, F.Special.FN: N.SPECIAL_FN, F.Special.IEEE: N.SPECIAL_IEEE}
MAX_BLOCK = 128
"""Largest block edge a tile holds (blocks must be powers of two up to this)."""


def _pow2(n) -> bool:
    return isinstance(n, int) and 0 < n <= MAX_BLOCK and n & (n - 1) == 0


def _roundup(n: int, b: int) -> int:
    return -(-n // b) * b


@dataclass(frozen=True, slots=True)
class Side:
    """One quantized output of a tile pass."""

    fmt: int
    """Index into :data:`FORMATS`."""
    mode: int
    """``triton_tiles.MODE_*``: where the scale comes from."""
    rule: int
    block: tuple[int, int]
    """Block edges in x's coordinates (LOCAL mode; 1 x 1 otherwise)."""
    rounding: int
    """``triton_tiles.ROUND_*``."""
    hadamard: bool
    saturate: bool
    fold: int
    """0, or 1 + the index into :data:`FORMATS` of the FP8 format a folded side's codes are folded into
    (see [Note: tiles and sides] in ``triton_tiles``)."""
    headroom: int
    """A folded side's ``h`` (``lowprec.kernels.fold.headroom``); 0 otherwise."""
    out_shape: tuple[int, int]
    """The padded 2-D view of this side's tensor (x for side A, x.T for side B)."""
    scale_shape: tuple[int, int]
    """Its scales' shape: the blocks' grid, or one per line where folded."""

    @property
    def amax_kind(self) -> int:
        """What the amax pass must reduce for this side before it can be cast."""
        if self.mode == T.MODE_TENSOR:
            return T.AMAX_TENSOR
        if self.mode == T.MODE_LINES:
            return T.AMAX_LINES
        if self.fold:
            return T.AMAX_FOLD
        if self.mode == T.MODE_LOCAL and self.rule == N.RULE_NVFP4:
            return T.AMAX_FINITE_BLOCKS
        return T.AMAX_NONE

    @property
    def format(self) -> F.Format:
        """The format the side's elements are cast to (an MX format, where the side is then folded)."""
        return F.get(FORMATS[self.fmt])

    @property
    def out_format(self) -> F.Format:
        """The format of the codes the side writes: the folded target, or :attr:`format`."""
        return F.get(FORMATS[self.fold - 1]) if self.fold else self.format

    def to_ints(self) -> list[int]:
        return [1, self.fmt, self.mode, self.rule, *self.block, self.rounding, int(self.hadamard),
                int(self.saturate), self.fold, self.headroom, *self.out_shape, *self.scale_shape]

    @staticmethod
    def from_ints(v: list[int]) -> Side | None:
        if not v[0]:
            return None
        return Side(v[1], v[2], v[3], (v[4], v[5]), v[6], bool(v[7]), bool(v[8]), v[9], v[10], (v[11], v[12]),
                    (v[13], v[14]))

    def kernel_args(self, suffix: str) -> dict:
        f, t = self.format, self.out_format
        args = dict(ON=True, EXP=f.exp_bits, MAN=f.man_bits, SPECIAL=SPECIALS[f.special], FMAX=f.max,
                    EMAX=f.emax, MODE=self.mode, RULE=self.rule, BR=self.block[0], BC=self.block[1],
                    ROUND=self.rounding, HAD=int(self.hadamard), SAT=int(self.saturate), FOLD=int(bool(self.fold)),
                    T_EXP=t.exp_bits, T_MAN=t.man_bits, T_SPECIAL=SPECIALS[t.special], H=self.headroom)
        return {f"{k}_{suffix}": v for k, v in args.items()}


SIDE_INTS = 15
"""Length of :meth:`Side.to_ints`: a present flag, then the fields in order, tuples flattened."""
_OFF = (0,) * SIDE_INTS


def off_args(suffix: str) -> dict:
    args = dict(ON=False, EXP=4, MAN=3, SPECIAL=1, FMAX=448.0, EMAX=8, MODE=0, RULE=0, BR=1, BC=1, ROUND=0,
                HAD=0, SAT=1, FOLD=0, T_EXP=4, T_MAN=3, T_SPECIAL=1, H=0)
    return {f"{k}_{suffix}": v for k, v in args.items()}


_MODES = {GranularityKind.TENSOR: T.MODE_TENSOR, GranularityKind.ROW: T.MODE_LINES}
"""Kernel modes of the granularities whose scales span a whole line; every other kind is LOCAL."""


def _mode(g: Granularity, given: bool) -> int | None:
    if given:
        return T.MODE_GIVEN if g.per_tensor else None
    mode = _MODES.get(g.kind, T.MODE_LOCAL)
    if mode == T.MODE_LOCAL and not (_pow2(g.block_rows) and _pow2(g.block_cols)):
        return None  # a column scale, or a block a tile cannot hold
    return mode


def covers(spec, saturate: bool = True) -> bool:
    """Whether the kernels cover a cast (a ``lowprec.kernels.route.CastSpec``), for any shape: the one
    statement of what they do, which :func:`lowprec.kernels.route.route` asks before choosing them."""
    fmt, g = spec.fmt, spec.granularity
    if fmt.name not in FORMATS or (not saturate and fmt.special is F.Special.NONE):
        return False
    # formats without inf/NaN: the reference zeroes a non-finite tensor under a given scale
    if spec.delayed and fmt.special is F.Special.NONE:
        return False
    mode = _mode(g, spec.delayed)
    if mode is None or (spec.folded and not foldable(fmt, g)):
        return False
    return spec.hadamard_seed is None or (mode == T.MODE_LOCAL and g.block_cols % RHT_BLOCK == 0)


def side(spec, saturate: bool, *, transposed: bool, rows: int, cols: int, given: bool = False,
         rand: bool = False, line_global: bool = False) -> Side:
    """The side casting a ``rows x cols`` view (x for side A; x.T, so ``rows = K``, for side B) as
    ``spec`` (a ``CastSpec``) says, with a given per-tensor scale or not; the kernels must cover it
    (:func:`covers`). ``line_global``: an NVFP4 side whose global amax is given per block row of x
    (``triton_numerics.RULE_NVFP4_LINES``)."""
    if not covers(spec if spec.delayed == given else replace(spec, delayed=given), saturate):
        fail("spec", "a cast the Triton kernels cover (see triton_plan.covers)", f"{spec}, given scale: {given}")
    fmt, g, hadamard = spec.fmt, spec.granularity, spec.hadamard_seed is not None
    br, bc = g.block_rows, g.block_cols
    rule = _RULES[g.rule]
    if line_global:
        if rule != N.RULE_NVFP4 or given:
            fail("spec", "an NVFP4 cast scaled by its blocks (a global amax per block row is NVFP4's)", str(spec))
        rule = N.RULE_NVFP4_LINES
    mode = _mode(g, given)
    ebr, ebc = br or rows, bc or cols
    out_shape = (_roundup(rows, ebr), _roundup(cols, ebc))
    scale_shape = (out_shape[0], 1) if spec.folded else (out_shape[0] // ebr, out_shape[1] // ebc)
    block = (br, bc) if mode == T.MODE_LOCAL else (1, 1)
    if transposed:
        block = block[::-1]
    rnd = T.ROUND_NEAREST if not spec.stochastic else (T.ROUND_RAND if rand else T.ROUND_PHILOX)
    fold = 1 + FORMATS.index(fold_target(fmt).name) if spec.folded else 0
    return Side(FORMATS.index(fmt.name), mode, rule, block, rnd, hadamard, saturate, fold,
                headroom(fmt) if spec.folded else 0, out_shape, scale_shape)


@dataclass(frozen=True, slots=True)
class Plan:
    m: int
    k: int
    a: Side | None
    b: Side | None
    record: bool = False
    """Also reduce x's amax (delayed scaling records it)."""
    num_warps: int = 0
    """Warps per tile; 0 picks 32 elements per thread."""
    tile_rows: int = 0
    tile_cols: int = 0
    """A tile shape to try instead of the default (0: default; each must be a multiple of every
    LOCAL block's edge along it, and a power of two)."""

    def __post_init__(self) -> None:
        for name in ("tile_rows", "tile_cols"):
            v = getattr(self, name)
            if v and (v < 16 or v & (v - 1)):
                fail(name, "0 (the default) or a power of two of at least 16", v)

    @property
    def share(self) -> bool:
        """Side B is side A transposed (one scale for the tensor, same format and rounding)."""
        a, b = self.a, self.b
        if a is None or b is None or a.mode not in (T.MODE_TENSOR, T.MODE_GIVEN):
            return False
        key = lambda s: (s.fmt, s.mode, s.rule, s.rounding, s.hadamard, s.saturate)  # noqa: E731
        return key(a) == key(b) and a.rounding == T.ROUND_NEAREST and not a.hadamard

    @property
    def tile(self) -> tuple[int, int, int]:
        """``(BM, BK, num_warps)``: by the kind of cast (below), never smaller than a block (every
        LOCAL block divides the tile, so no block straddles two programs)."""
        sides = [s for s in (self.a, self.b) if s is not None]
        random = any(s.rounding != T.ROUND_NEAREST or s.hadamard for s in sides)
        if self.b is None and not random:  # one deterministic cast: 32 elements per thread
            bm, bk, warps = 64, 128, 0
        else:
            # A pair (or a random, or transformed, cast) keeps more live values per element: 4 warps
            # (64 elements per thread at 64 x 128), and small blocks (MX, NVFP4) take a short tile,
            # random or transformed casts a narrow one; measured on the H200 (BENCHMARKS.md, run 4).
            local = [s for s in sides if s.mode == T.MODE_LOCAL]
            small = bool(local) and all(max(s.block) <= 32 for s in local)
            bm, bk, warps = (32 if small else 64), (64 if random else 128), 4
        bm, bk = self.tile_rows or bm, self.tile_cols or bk
        for s in sides:
            if s.mode == T.MODE_LOCAL:
                bm, bk = max(bm, s.block[0]), max(bk, s.block[1])
        return bm, bk, self.num_warps or warps or max(4, min(16, bm * bk // (32 * 32)))

    def to_ints(self) -> list[int]:
        """``[m, k, record, num_warps, *side A, *side B, tile_rows, tile_cols]`` (sides :data:`SIDE_INTS` long)."""
        return [self.m, self.k, int(self.record), self.num_warps, *(self.a.to_ints() if self.a else _OFF),
                *(self.b.to_ints() if self.b else _OFF), self.tile_rows, self.tile_cols]

    @staticmethod
    def from_ints(v: list[int]) -> Plan:
        a, b, tail = _HEAD, _HEAD + SIDE_INTS, _HEAD + 2 * SIDE_INTS
        return Plan(v[0], v[1], Side.from_ints(v[a:b]), Side.from_ints(v[b:tail]), bool(v[2]), v[3], v[tail],
                    v[tail + 1])


_HEAD = 4
"""Ints before side A in :meth:`Plan.to_ints`: m, k, record, num_warps."""


class Launch(NamedTuple):
    """What one kernel pass needs that follows from its casts and the shape alone, in plain values:
    worked out once per (casts, shape), and under ``torch.compile`` at trace time, where it is a
    constant of the graph (tracing the planning itself cost most of a layer's compile time). A named
    tuple: the tracer makes one in a step, where a dataclass's ``__init__`` costs it a hundred."""

    ints: tuple[int, ...]
    """:meth:`Plan.to_ints`: what the ops receive."""
    amax_kinds: tuple[int, int]
    """Per side (A, B), what the amax pass reduces for it (``triton_tiles.AMAX_*``)."""
    hadamard: tuple[bool, bool]
    given: tuple[bool, bool]
    """Per side, the scale is the given one (delayed scaling)."""
    nvfp4: tuple[bool, bool]
    """Per side, an NVFP4 cast (it has a global scale)."""
    scale_shapes: tuple[tuple[int, int], tuple[int, int]]
    philox: bool
    """A side draws its own random numbers (stochastic rounding without given uniforms)."""
    share: bool
    """Side B is side A transposed: the kernel writes one scale for both."""
    fold_blocks: tuple[int, int] = (0, 0)
    """Per side, a folded side's block length along its reduction dimension (0: not folded)."""

    @staticmethod
    def of(p: Plan) -> Launch:
        sides = (p.a, p.b)

        def each(f, off):
            return tuple(f(s) if s is not None else off for s in sides)

        return Launch(
            tuple(p.to_ints()), each(lambda s: s.amax_kind, T.AMAX_NONE), each(lambda s: s.hadamard, False),
            each(lambda s: s.mode == T.MODE_GIVEN, False),
            each(lambda s: s.rule in (N.RULE_NVFP4, N.RULE_NVFP4_LINES), False),
            each(lambda s: s.scale_shape, (0, 0)),
            any(s is not None and s.rounding == T.ROUND_PHILOX for s in sides), p.share,
            tuple(max(s.block) if s is not None and s.fold else 0 for s in sides))


@functools.lru_cache(maxsize=4096)
def launch(a, b, m: int, k: int, saturate: bool, given: bool, rand_a: bool, rand_b: bool, record: bool,
           line_global: bool = False) -> Launch:
    """The :class:`Launch` of casting an ``m x k`` tensor as ``a`` (along K) and ``b`` (transposed),
    ``CastSpec`` or None each, with a given scale or not, given uniforms or not; ``line_global``: NVFP4 sides
    with a global amax given per block row of x (:func:`side`)."""
    pa = None if a is None else side(a, saturate, transposed=False, rows=m, cols=k, given=given, rand=rand_a,
                                     line_global=line_global)
    pb = None if b is None else side(b, saturate, transposed=True, rows=k, cols=m, given=given, rand=rand_b,
                                     line_global=line_global)
    return Launch.of(Plan(m, k, pa, pb, record=record))


_SHAPE_INTS = 4
"""The last ints of :meth:`Side.to_ints`: out_shape and scale_shape, the only shape-dependent ones."""


@dataclass(frozen=True, slots=True)
class Template:
    """A launch with everything but the shape worked out, made with a route (eagerly, once): a cast of
    a given shape is then a few integer operations, which is all a compiled graph traces of it
    (tracing :func:`launch` itself cost about half a layer's compile time)."""

    heads: tuple[tuple[int, ...] | None, tuple[int, ...] | None]
    """Each side's :meth:`Side.to_ints` without its shapes (None: the side is absent)."""
    blocks: tuple[tuple[int, int], tuple[int, int]]
    """Each side's block edges along its own view's rows and columns (0: the whole dimension)."""
    folded: tuple[bool, bool]
    """Each side is folded: one scale per row of its view."""
    facts: Launch
    """The shape-free fields of the launch (``ints`` and ``scale_shapes`` are placeholders)."""

    def launch(self, m: int, k: int, record: bool) -> Launch:
        ints_a, shape_a = self._side(0, m, k)
        ints_b, shape_b = self._side(1, k, m)
        f = self.facts
        return Launch((m, k, int(record), 0, *ints_a, *ints_b, 0, 0), f.amax_kinds, f.hadamard, f.given, f.nvfp4,
                      (shape_a, shape_b), f.philox, f.share, f.fold_blocks)

    def _side(self, i: int, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, int]]:
        """Side ``i``'s ints and scale shape for its view of ``rows x cols`` (straight-line code: it is traced)."""
        head = self.heads[i]
        if head is None:
            return _OFF, (0, 0)
        br, bc = self.blocks[i]
        br, bc = br or rows, bc or cols
        r, c = -(-rows // br) * br, -(-cols // bc) * bc
        scales = (r, 1) if self.folded[i] else (r // br, c // bc)
        return (*head, r, c, *scales), scales


@functools.lru_cache(maxsize=1024)
def template(a, b, given: bool) -> Template:
    """The :class:`Template` of casting as ``a`` (along K) and ``b`` (transposed), either may be None."""
    facts = launch(a, b, 1, 1, True, given, False, False, False)
    heads, blocks = [], []
    for i, spec in enumerate((a, b)):
        start = _HEAD + i * SIDE_INTS
        head = facts.ints[start:start + SIDE_INTS - _SHAPE_INTS]
        heads.append(head if spec is not None else None)
        g = spec.granularity if spec is not None else None
        blocks.append((g.block_rows or 0, g.block_cols or 0) if g is not None else (0, 0))
    folded = tuple(spec is not None and spec.folded for spec in (a, b))
    return Template(tuple(heads), tuple(blocks), folded, facts)
