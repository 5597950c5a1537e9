"""Every expert's FP8 GEMM in one ``torch._scaled_grouped_mm``, where the device runs it and it agrees with
the expert-by-expert GEMMs.

[Note: one grouped GEMM for the experts]
Experts cast by ``lowprec.nn.grouped_casts`` hold the E4M3 codes of all their token rows and weights
with their scales. PyTorch's grouped FP8 GEMM takes row-wise scales, and two kinds of groups: token rows
times each expert's weight (:data:`ROWS`: forward, input gradient; a scale per token row and per row of
each weight), and each expert's features over its own tokens (:data:`FEATURES`: the weight gradient,
grouped along K; a scale per expert and feature on both sides; each expert's tokens are padded with zero
codes to a multiple of 16, where the kernel's K groups must start). Row-wise casts are such scales; an
expert's per-tensor scale repeated over its rows and features is too. So one launch computes every
expert's GEMM with the values of the per-expert GEMMs; the accumulation inside the tensor cores and the
epilogue (``acc * row scale * column scale``, against ``acc * (scale_a * scale_b)`` in cuBLAS's per-tensor
GEMM) may differ in the last bits.

It runs on CUDA devices of compute capability 9.0 and newer (PyTorch's kernels for them), with both operands
E4M3 and the dimensions other than the tokens multiples of 16. PyTorch's kernel refuses E5M2, so a pair with
an E5M2 operand (fp8-current's gradients: E5M2 times E4M3) runs as lowprec's own grouped Triton GEMMs of the
same two kinds and scales instead ([Note: grouped FP8 GEMMs in Triton] in
``lowprec.kernels.triton_grouped_gemm``), where Triton runs. So does an E4M3 pair without fast accumulation
(fp8-rowwise's gradients): PyTorch's kernel promoting its sums ran weight gradients at 161 TFLOP/s on the
H200 and input gradients at 245-280, the Triton kernels at 363 and 476-603, equally close to the exact sums
(BENCHMARKS.md, runs 57 and 70); with fast accumulation (the recipes' forward) PyTorch's kernel is faster
(600-740 TFLOP/s against the Triton rows kernel's 505-670). The first time either runs a kind on a device it
checks itself against the per-expert GEMMs computed from the exact values (FP8 products in FP32) on a small
problem of unbalanced experts (one of them without tokens, several tiles of each dimension); if they
disagree beyond the output's rounding (:data:`TOLERANCE`), or the call fails, it warns once and those GEMMs
stay expert by expert on that device (the weight gradient's kind is checked on both paddings
:func:`token_padding` makes). ``lowprec.nn.GroupedLinear`` asks :func:`runs_grouped` for each of its three
GEMMs; under ``torch.compile`` the answer, check included, is a constant of the graph.

Block-scaled operands (``fp8-blockwise``: FP32 scales per 1 x 128 and 128 x 128 blocks, which no grouped
kernel of PyTorch's takes on sm90) run as lowprec's blocked Triton kernels of the same two kinds
(:func:`grouped_by_rows_blocked`, :func:`grouped_by_features_blocked`), checked on first use against the
exact values (float64 sums of the dequantized operands, :func:`reference_blocked`); dimensions multiples
of 128.

Both kernels take the experts' bounds as offsets on the device, so a caller that never reads the counts
(a compiled graph's experts) passes the rows padded for any routing (:func:`padded_bound`): the columns
after the last expert's hold zeros, which no expert reads.
"""
from __future__ import annotations

import itertools
import warnings
from typing import NamedTuple

import torch

from lowprec.kernels.route import Backend, padding_backend

_CHECKED: dict[tuple[torch.device, str], bool] = {}
"""Per device and kind of grouped GEMM: whether it ran and agreed with the per-expert GEMMs on first use."""
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOLERANCE = 2.0 ** -8
"""Largest difference from the per-expert GEMMs the self-check accepts, relative to the output's norm:
twice BF16's rounding of the output (at most 2^-9 of each value). It catches wrong results (a layout, a
scale, a lost tile), not the tensor core's accumulation: on random values accumulating all of K inside
Hopper's FP8 MMA is 5e-4 off, promoting 1.3e-4 (BENCHMARKS.md, run 50)."""
ROWS, FEATURES = "rows", "features"
"""The two kinds: experts' rows times their weights (forward, input gradient: the tokens are M), and the
weight gradient (the tokens are K: each expert's features times its tokens' gradients)."""


def _offsets(counts, device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _on_torch(a: torch.Tensor, b: torch.Tensor, fast_accum: bool) -> bool:
    """Whether a pair runs on PyTorch's grouped kernel or on lowprec's Triton one: an E4M3 pair with fast
    accumulation, or where Triton does not run. Without fast accumulation PyTorch's kernel ran E4M3 weight
    gradients at 161 TFLOP/s on the H200 and input gradients at 245-280, lowprec's Triton kernels (promoting
    every 128) at 363 and 476-603, with the same error (BENCHMARKS.md, runs 57 and 70)."""
    return a.dtype == E4M3 and b.dtype == E4M3 and (fast_accum or not _triton_runs(a.device))


def _by_rows(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum: bool,
             on_torch: bool | None = None) -> torch.Tensor:
    """``(T, N)``: rows of expert ``e`` times ``b[e].T``; ``a_scales`` ``(T,)``, ``b_scales`` ``(E, N)``;
    ``on_torch``: the kernel (None: as :func:`_on_torch` says)."""
    if not (_on_torch(a, b, fast_accum) if on_torch is None else on_torch):
        from lowprec.kernels import triton_grouped_gemm  # Triton: imported where it runs

        return triton_grouped_gemm.grouped_rows(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum)
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scales, b_scales.contiguous(), offs=offsets,
                                    out_dtype=out_dtype, use_fast_accum=fast_accum)


class Padding(NamedTuple):
    """Token rows padded per expert (:func:`token_padding`)."""

    dest: torch.Tensor | None
    """``(T,)``: each row's place among the padded rows; None where no expert needs padding."""
    total: int
    """The padded row count."""
    ends: torch.Tensor
    """``(E,)`` int32: the padded offsets, cumulative."""
    sources: torch.Tensor | None
    """``(total,)`` int32: each padded row's row, -1 for the zero rows between experts (None with ``dest``)."""


def token_padding(counts: tuple[int, ...] | None, lengths: torch.Tensor, multiple: int = 16,
                  rows: int | None = None) -> Padding:
    """Each expert's rows followed by zero rows up to a multiple of ``multiple`` (16: the grouped GEMM's K
    groups must start at 16-aligned columns, and zero codes add nothing to a product; an MX block along the
    tokens: no block holds two experts). Computed on the rows' device from ``counts`` (host) and
    ``lengths`` (the same on the device). ``counts`` None: nothing read on the host, the ``rows`` routed
    rows padded to :func:`padded_bound` (zero rows after the last expert's), a size that does not depend on
    the routing."""
    padded = (lengths + multiple - 1) // multiple * multiple  # (E,)
    ends = padded.cumsum(0)
    if counts is not None:
        rows = sum(counts)
        total = padded_starts(counts, multiple)[-1] + -(-counts[-1] // multiple) * multiple if counts else 0
        if total == rows:
            return Padding(None, total, ends.to(torch.int32), None)
    else:
        total = padded_bound(rows, lengths.shape[0], multiple)
    shift = (ends - padded) - (lengths.cumsum(0) - lengths)  # (E,) where each expert's rows move
    dest = torch.repeat_interleave(shift, lengths, output_size=rows) + torch.arange(rows, device=lengths.device)
    sources = torch.full((total,), -1, dtype=torch.int32, device=lengths.device)
    sources[dest] = torch.arange(rows, dtype=torch.int32, device=lengths.device)
    return Padding(dest, total, ends.to(torch.int32), sources)


def padded_bound(rows: int, n_experts: int, multiple: int = 16) -> int:
    """The most padded rows ``rows`` routed rows can take among ``n_experts`` (each expert's padding is under
    ``multiple``), a multiple of ``multiple``."""
    return -(-(rows + n_experts * (multiple - 1)) // multiple) * multiple


def padded_starts(counts: tuple[int, ...], multiple: int = 16) -> tuple[int, ...]:
    """Where each expert's rows begin among the rows :func:`token_padding` pads (host)."""
    return tuple(itertools.accumulate((-(-n // multiple) * multiple for n in counts[:-1]), initial=0))


def features_padded(rows: torch.Tensor, padding: Padding) -> torch.Tensor:
    """``(K, total)``: token rows ``(T, K)`` (codes or values) transposed, each row at its padded column,
    zeros between the experts (the layout :func:`grouped_by_features` reads). One Triton pass where the
    route says so (``kernels.route.padding_backend``), else the reference's scatter; the same bits."""
    if rows.numel() and padding_backend(rows.device) is Backend.TRITON:
        from lowprec.kernels import triton_grouped  # Triton: imported where it runs

        return triton_grouped.features_padded(rows, padding.sources, padding.total)
    if padding.dest is None:
        return rows.t().contiguous()
    raw = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # FP8 codes: moved as bytes
    out = raw.new_zeros(rows.shape[1], padding.total)
    out[:, padding.dest] = raw.t()
    return out.view(rows.dtype)


def transposed(codes: torch.Tensor) -> torch.Tensor:
    """``(E, K, R)``: each expert's ``codes[e]`` (``(E, R, K)``) transposed, contiguous (an operand the grouped
    GEMMs read along its own K: the weights' for the input gradient, where their transposed side is the same
    codes). One Triton pass where the route says so (``kernels.route.padding_backend``), else the reference's
    copy; the same bits."""
    if codes.numel() and padding_backend(codes.device) is Backend.TRITON:
        from lowprec.kernels import triton_grouped  # Triton: imported where it runs

        return triton_grouped.transposed(codes)
    return codes.transpose(1, 2).contiguous()


def _laid_out(a_t, a_scales, b_t, b_scales, ends, out_dtype, fast_accum: bool,
              on_torch: bool | None = None) -> torch.Tensor:
    """``(E, M, N)`` from features-major codes ``a_t`` ``(M, P)`` and ``b_t`` ``(N, P)``, each expert's
    tokens at 16-aligned columns ending at ``ends``; ``on_torch``: the kernel (None: as :func:`_on_torch`
    says)."""
    if on_torch is None:
        on_torch = _on_torch(a_t, b_t, fast_accum)
    if not on_torch:
        from lowprec.kernels import triton_grouped_gemm  # Triton: imported where it runs

        return triton_grouped_gemm.grouped_features(a_t, a_scales, b_t, b_scales, ends, out_dtype)
    return torch._scaled_grouped_mm(a_t, b_t.t(), a_scales.contiguous(), b_scales.contiguous(), offs=ends,
                                    out_dtype=out_dtype, use_fast_accum=fast_accum)


def _by_features(a, a_scales, b, b_scales, padding: Padding, out_dtype, fast_accum: bool,
                 on_torch: bool | None = None) -> torch.Tensor:
    """``(E, M, N)``: ``a[rows of e].T @ b[rows of e]`` for token rows ``a`` ``(T, M)`` and ``b`` ``(T, N)``
    grouped as ``padding`` pads them; ``a_scales`` ``(E * M,)``, ``b_scales`` ``(E * N,)`` per expert and
    feature."""
    return _laid_out(features_padded(a, padding), a_scales, features_padded(b, padding), b_scales,
                     padding.ends, out_dtype, fast_accum, on_torch)


def _reference(kind: str, a, a_scales, b, b_scales, counts) -> torch.Tensor:
    """The experts' GEMMs from the exact values: E4M3 products are exact in FP32, summed in FP32."""
    out, start = [], 0
    for e, m in enumerate(counts):
        rows = slice(start, start + m)
        if kind == ROWS:
            out.append((a[rows].float() @ b[e].float().t()) * a_scales[rows, None] * b_scales[e])
        else:
            ma, nb = a.shape[1], b.shape[1]
            out.append((a[rows].float().t() @ b[rows].float()) * a_scales[e * ma:(e + 1) * ma, None]
                       * b_scales[e * nb:(e + 1) * nb])
        start += m
    return torch.cat(out) if kind == ROWS else torch.stack(out)


def _problem(kind: str, device: torch.device, a_dtype: torch.dtype = E4M3):
    """A small grouped problem: unbalanced experts, one without tokens, counts not multiples of 16 (several
    tiles of rows, and of K for the weight gradient's kind); ``a`` in ``a_dtype``, ``b`` E4M3."""
    g = torch.Generator(device=device).manual_seed(0)
    counts = (300, 0, 24, 517)
    t, k, n, e = sum(counts), 1024, 160, len(counts)  # several tiles of rows, of N and of K

    def codes(*shape, dtype=E4M3):
        return (torch.randn(*shape, device=device, generator=g) * 8).to(dtype)

    def scales(m):
        return torch.rand(m, device=device, generator=g) * 4 + 0.25

    if kind == ROWS:
        return codes(t, k, dtype=a_dtype), scales(t), codes(e, n, k), scales(e * n).view(e, n), counts
    return codes(t, k, dtype=a_dtype), scales(e * k), codes(t, n), scales(e * n), counts


def _name(kind: str, on_torch: bool) -> str:
    return f"torch._scaled_grouped_mm ({kind})" if on_torch else f"lowprec's grouped Triton GEMM ({kind})"


def _self_check(kind: str, device: torch.device, on_torch: bool) -> bool:
    """The first-use check of one kind on one kernel: PyTorch's with an E4M3 pair; lowprec's Triton one with
    each pair it takes (E5M2 gradients; E4M3 gradients without fast accumulation). The weight
    gradient's kind is checked on both paddings: to the counts read on the host, and to the bound of any
    routing (zero columns after the last expert's, as when the counts stay on the device)."""
    name = _name(kind, on_torch)
    pairs = (E4M3,) if on_torch else (E5M2, E4M3)
    for a_dtype in pairs:
        a, sa, b, sb, counts = _problem(kind, device, a_dtype)
        want = _reference(kind, a, sa, b, sb, counts)
        lengths = torch.tensor(counts, device=device)
        for read in ((True,) if kind == ROWS else (True, False)):
            try:
                if kind == ROWS:
                    got = _by_rows(a, sa, b, sb, _offsets(counts, device), torch.bfloat16, False,
                                   on_torch).float()
                else:
                    padding = token_padding(counts if read else None, lengths, rows=sum(counts))
                    got = _by_features(a, sa, b, sb, padding, torch.bfloat16, False, on_torch).float()
            except Exception as e:  # any failure (PyTorch's, Triton's compile or resources): per expert
                warnings.warn(f"lowprec: {name} fails on {device} ({str(e).splitlines()[0]}); those expert GEMMs "
                              "run one by one", stacklevel=4)
                return False
            rel = ((got - want).norm() / want.norm()).item()
            if not rel <= TOLERANCE:
                warnings.warn(f"lowprec: {name} differs from the per-expert FP8 GEMMs on {device} by {rel:.2e} of "
                              f"the output (more than {TOLERANCE:.2e}); those expert GEMMs run one by one",
                              stacklevel=4)
                return False
    return True


BLOCK = 128
"""The block scales' width along K of the blocked kind (``triton_grouped_gemm.BLOCK``)."""


def block_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 values of ``codes`` ``(R, K)`` whose ``scales`` ``(R / r, K / BLOCK)`` hold one scale per ``r``
    rows (``r`` from the shapes: 1, or a 2-D block's height) and :data:`BLOCK` columns: exact (an FP8 code
    times an FP32 scale fits float64's significand)."""
    r = -(-codes.shape[0] // scales.shape[0])
    s = scales.double().repeat_interleave(r, 0)[:codes.shape[0]].repeat_interleave(BLOCK, 1)[:, :codes.shape[1]]
    return codes.double() * s


def reference_blocked(kind: str, a, a_scales, b, b_scales, ends: torch.Tensor) -> torch.Tensor:
    """The blocked kinds' GEMMs from the exact values, summed in float64: :data:`ROWS` (token rows ``a`` ``(T,
    K)``, ``b`` ``(E, N, K)``, ``ends`` the offsets) or :data:`FEATURES` (features-major ``a`` ``(M, P)``, ``b``
    ``(N, P)``, ``ends`` the padded offsets); scales as ``block_values`` reads them."""
    out, start = [], 0
    if kind == ROWS:
        va = block_values(a, a_scales)
        for e, end in enumerate(ends.tolist()):
            out.append(va[start:end] @ block_values(b[e], b_scales[e]).t())
            start = end
        return torch.cat(out)
    va, vb = block_values(a, a_scales), block_values(b, b_scales)
    for end in ends.tolist():
        out.append(va[:, start:end] @ vb[:, start:end].t())
        start = end
    return torch.stack(out)


def _blocked_problem(kind: str, device: torch.device):
    """A small blocked problem: unbalanced experts, one without tokens, several tiles of every dimension,
    random E4M3 codes and block scales; ``(a, a scales, b, b scales, ends)`` as ``reference_blocked`` reads
    them."""
    g = torch.Generator(device=device).manual_seed(0)
    counts = (300, 0, 24, 517)
    t, k, n, e = sum(counts), 384, 256, len(counts)

    def codes(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 8).to(E4M3)

    def scales(*shape):
        return torch.rand(*shape, device=device, generator=g) * 4 + 0.25

    lengths = torch.tensor(counts, device=device)
    if kind == ROWS:  # 1 x 128 token rows, 128 x 128 weight blocks
        return codes(t, k), scales(t, k // BLOCK), codes(e, n, k), scales(e, n // BLOCK, k // BLOCK), \
            _offsets(counts, device)
    padding = token_padding(counts, lengths, BLOCK)
    p = padding.total
    return codes(k, p), scales(k, p // BLOCK), codes(n, p), scales(n, p // BLOCK), padding.ends


def _self_check_blocked(kind: str, device: torch.device) -> bool:
    """The first-use check of lowprec's blocked Triton kernel of ``kind`` against the exact values."""
    name = f"lowprec's grouped Triton GEMM with block scales ({kind})"
    a, sa, b, sb, ends = _blocked_problem(kind, device)
    try:
        got = (grouped_by_rows_blocked if kind == ROWS else grouped_by_features_blocked)(
            a, sa, b, sb, ends, torch.bfloat16).double()
    except Exception as e:  # any failure (Triton's compile or resources): per expert
        warnings.warn(f"lowprec: {name} fails on {device} ({str(e).splitlines()[0]}); those expert GEMMs run one "
                      "by one", stacklevel=4)
        return False
    want = reference_blocked(kind, a, sa, b, sb, ends)
    rel = ((got - want).norm() / want.norm()).item()
    if not rel <= TOLERANCE:
        warnings.warn(f"lowprec: {name} differs from the per-expert FP8 GEMMs on {device} by {rel:.2e} of the "
                      f"output (more than {TOLERANCE:.2e}); those expert GEMMs run one by one", stacklevel=4)
        return False
    return True


@torch._dynamo.assume_constant_result
def _triton_runs(device: torch.device) -> bool:
    from lowprec.kernels.capability import capability

    return capability(device).triton


def runs_grouped(kind: str, device: torch.device, a_fmt, b_fmt, *dims: int, fast_accum: bool = True,
                 blocked: bool = False) -> bool:
    """Whether the experts' GEMMs of ``kind`` (:data:`ROWS` or :data:`FEATURES`) run as one grouped GEMM
    here (see [Note: one grouped GEMM for the experts]): CUDA of compute capability 9.0 or newer, FP8
    operands (E4M3 pairs on PyTorch's kernel; with an E5M2 operand, or an E4M3 pair without ``fast_accum``,
    on lowprec's Triton one, where Triton runs), the non-token dimensions ``dims`` multiples of
    16, and the device's first-use check of that kernel and kind passed. ``blocked``: operands with block
    scales along K (``fp8-blockwise``: E4M3 pairs, 1 x 128 and 128 x 128 blocks), on lowprec's blocked Triton
    kernels, ``dims`` multiples of 128."""
    return _runs(kind, torch.device(device), a_fmt.torch_dtype, b_fmt.torch_dtype, dims, fast_accum, blocked)


@torch._dynamo.assume_constant_result
def _runs(kind: str, device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype, dims: tuple[int, ...],
          fast_accum: bool, blocked: bool = False) -> bool:
    """:func:`runs_grouped` of constants: while torch.compile traces, the first-use check runs eagerly then
    and its outcome enters the graph as a constant."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm") or any(d % 16 for d in dims):
        return False
    pair = (a_dtype, b_dtype)
    if pair not in ((E4M3, E4M3), (E5M2, E4M3)):  # the recipes' pairs: E4M3, or E5M2 gradients times E4M3
        return False
    triton_runs = _triton_runs(device)
    if blocked and (pair != (E4M3, E4M3) or not triton_runs or any(d % BLOCK for d in dims)):
        return False
    # E4M3 pairs without fast accumulation run on Triton where it runs (see _on_torch)
    on_torch = not blocked and pair == (E4M3, E4M3) and (fast_accum or not triton_runs)
    if torch.cuda.get_device_capability(device) < (9, 0) or not on_torch and not triton_runs:
        return False
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    key = (device, _key(kind, on_torch, blocked))
    if key not in _CHECKED:
        _CHECKED[key] = _self_check_blocked(kind, device) if blocked else _self_check(kind, device, on_torch)
    return _CHECKED[key]


def _key(kind: str, on_torch: bool, blocked: bool) -> str:
    """The name a kernel and kind is checked under in ``_CHECKED``."""
    return f"{kind} blocked" if blocked else kind if on_torch else f"{kind} triton"


def grouped_by_rows(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                    offsets: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``(T, N)``: every expert's rows of ``a`` (FP8 ``(T, K)``, ``a_scales`` ``(T,)`` per row; ``offsets``
    int32, cumulative, on the device: no count is read on the host) times its ``b[e].T`` (FP8 ``(E, N, K)``,
    ``b_scales`` ``(E, N)`` per row of ``b[e]``), in one grouped GEMM."""
    return _by_rows(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum)


def grouped_by_features(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        padding: Padding, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``(E, M, N)``: for every expert, ``a[its rows].T @ b[its rows]`` (FP8 token rows ``(T, M)`` and
    ``(T, N)`` grouped by expert as ``padding`` pads them, :func:`token_padding`; scales ``(E * M,)`` and
    ``(E * N,)`` per expert and feature), in one grouped GEMM."""
    return _by_features(a, a_scales, b, b_scales, padding, out_dtype, fast_accum)


def grouped_by_features_laid_out(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor,
                                 b_scales: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                                 fast_accum: bool) -> torch.Tensor:
    """:func:`grouped_by_features` of codes already laid out features-major and padded
    (:func:`features_padded`): ``a_t`` ``(M, P)``, ``b_t`` ``(N, P)``, ``ends`` the padded offsets
    (int32) of :func:`token_padding`."""
    return _laid_out(a_t, a_scales, b_t, b_scales, ends, out_dtype, fast_accum)


def grouped_by_rows_blocked(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                            offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_by_rows` of operands with block scales along K (``fp8-blockwise``): ``a`` E4M3 ``(T, K)``
    with ``a_scales`` ``(T, K / 128)``, ``b`` E4M3 ``(E, N, K)`` with ``b_scales`` ``(E, N / 128, K / 128)`` (or
    ``(E, N, K / 128)``), K a multiple of 128; lowprec's blocked Triton kernel."""
    from lowprec.kernels import triton_grouped_gemm  # Triton: imported where it runs

    return triton_grouped_gemm.grouped_rows_blocked(a, a_scales, b, b_scales, offsets, out_dtype)


def grouped_by_features_blocked(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor,
                                b_scales: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_by_features_laid_out` of token sides with block scales along the tokens: ``a_t`` E4M3
    ``(M, P)`` with ``a_scales`` ``(M, P / 128)``, ``b_t`` ``(N, P)`` with ``b_scales`` ``(N, P / 128)``, each
    expert's tokens whole blocks (``ends``: the offsets of :func:`token_padding` to 128)."""
    from lowprec.kernels import triton_grouped_gemm  # Triton: imported where it runs

    return triton_grouped_gemm.grouped_features_blocked(a_t, a_scales, b_t, b_scales, ends, out_dtype)


KERNELS = (("torch._scaled_grouped_mm", "e4m3 x e4m3", E4M3, False),
           ("lowprec Triton", "e5m2 x e4m3; e4m3 x e4m3 without fast accumulation", E5M2, False),
           ("lowprec Triton, block scales", "e4m3 x e4m3, 1x128 and 128x128 blocks", E4M3, True))
"""The grouped kernels, the operand pair each takes, the first operand's dtype that picks it, and whether it
takes block scales."""


def kernel_states(device: torch.device | str) -> list[tuple[str, str, str, bool | None]]:
    """``(kernel, operands, kind, state)`` for each grouped GEMM the experts may run on ``device``: state
    None (not checked yet: the experts' GEMMs check it on first use), True (passed) or False (failed: those
    GEMMs run per expert); empty where no grouped FP8 GEMM runs (a CPU, a GPU before sm90, no Triton for the
    E5M2 pair). Runs nothing (``check_kernels`` does)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm") or \
            torch.cuda.get_device_capability(device) < (9, 0):
        return []
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    out = []
    for name, pair, a_dtype, blocked in KERNELS:
        if (a_dtype == E5M2 or blocked) and not _triton_runs(device):
            continue
        for kind in (ROWS, FEATURES):
            out.append((name, pair, kind, _CHECKED.get((device, _key(kind, a_dtype == E4M3 and not blocked,
                                                                     blocked)))))
    return out


def check_kernels(device: torch.device | str) -> None:
    """Run now the first-use checks of the grouped GEMMs ``device`` has (``lowprec info --check``)."""
    from lowprec import formats as F

    device = torch.device(device)
    for _, _, a_dtype, blocked in KERNELS:
        for kind in (ROWS, FEATURES):
            runs_grouped(kind, device, F.get("e4m3" if a_dtype == E4M3 else "e5m2"), F.get("e4m3"), blocked=blocked)


def grouped_status() -> dict[str, bool]:
    """Each (device, kind) checked so far and whether its grouped GEMM passed (for ``lowprec info`` and
    benchmarks)."""
    return {f"{d} {kind}": ok for (d, kind), ok in _CHECKED.items()}


__all__ = ["BLOCK", "FEATURES", "KERNELS", "ROWS", "Padding", "block_values", "check_kernels", "features_padded",
           "grouped_by_features", "grouped_by_features_blocked", "grouped_by_features_laid_out", "grouped_by_rows",
           "grouped_by_rows_blocked", "reference_blocked", "grouped_status", "kernel_states", "padded_bound",
           "padded_starts", "runs_grouped", "token_padding", "transposed"]
