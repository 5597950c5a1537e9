"""Scaled GEMMs of two quantized operands: ``a (M, K) @ b (N, K).T -> (M, N)``.

Backends:
* ``cublas``: ``torch._scaled_mm`` on FP8 tensor cores (per-tensor and row-wise scales; 1x128 x
  128x128 and 1x128 x 1x128 block scales on sm90), and on Blackwell's block-scaled tensor cores for MX and
  NVFP4 pairs (sm100 and later: ``kernels.blackwell``, checked on first use, never run in this project yet);
* ``folded``: MX operands (E8M0 block scales) folded to one power-of-two scale per row, then
  ``torch._scaled_mm`` row-wise on FP8 tensor cores (see [Note: folding MX blocks into rows] in
  ``lowprec.kernels.fold``), where the device has FP8 tensor cores and passed the first-use check;
* ``emulated``: the exact quantized values in a high-precision GEMM with FP32 accumulation. Where an
  operand's scales are constant along K (tensor, row) the GEMM runs on the unscaled values and the
  scales multiply the output, as the hardware does; otherwise the operands are dequantized block by
  block first. On CUDA the dequantized values go through a BF16 GEMM when they are exact in BF16
  (FP8/FP6/FP4 elements times power-of-two or E4M3 block scales: at most 8 significant bits),
  else FP32; on the CPU always FP32. Only the accumulation order differs from a native GEMM.
"""
from __future__ import annotations

import enum
import math
import os

import torch

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.kernels import blackwell
from lowprec.kernels.blackwell import native_pair
from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.first_use import FirstUseCheck
from lowprec.kernels.fold import CHECK as FOLD_CHECK
from lowprec.kernels.fold import fold, foldable, target
from lowprec.kernels.route import Backend, emulated_operand_backend
from lowprec.quant import Granularity, GranularityKind, QuantizedTensor

E4M3, E5M2 = F.get("e4m3"), F.get("e5m2")
TENSOR, ROW, BLOCK = GranularityKind.TENSOR, GranularityKind.ROW, GranularityKind.BLOCK
BLOCK_SCALED = (GranularityKind.MX, GranularityKind.NVFP4)
"""Operands whose scales change along K in blocks the Blackwell tensor cores read (``kernels.blackwell``)."""


def _blocks(g: Granularity) -> tuple[int | None, int | None]:
    return (g.block_rows, g.block_cols) if g.kind is BLOCK else (None, None)


def _deepseek(lhs: Granularity, rhs: Granularity) -> bool:
    """1x128 x 128x128 (fprop, dgrad) or 1x128 x 1x128 (wgrad): the block-scaled GEMMs cuBLAS has on sm90."""
    return _blocks(lhs) == (1, 128) and _blocks(rhs) in ((128, 128), (1, 128))


class GemmPath(str, enum.Enum):
    """How a GEMM runs; its value is the word reports print (a str, so it compares equal to it)."""

    CUBLAS = "cublas"
    """Natively, on the tensor cores: ``torch._scaled_mm``."""
    FOLDED = "folded"
    """MX operands folded to row scales, on FP8 tensor cores (``kernels.fold``)."""
    EMULATED = "emulated"
    """The exact quantized values in a high-precision GEMM."""
    HP = "hp"
    """An operand is not quantized: a high-precision matmul (never :func:`scaled_mm`'s)."""

    def __str__(self) -> str:
        return self.value


def _folds(a: F.Format, a_gran: Granularity, b: F.Format, b_gran: Granularity) -> bool:
    """Two MX operands that fold into FP8 ones an FP8 tensor core multiplies (at most one E5M2)."""
    return foldable(a, a_gran) and foldable(b, b_gran) and not (target(a) is E5M2 and target(b) is E5M2)


def gemm_path(lhs_fmt, lhs_gran: Granularity, rhs_fmt, rhs_gran: Granularity, cap: Capability) -> GemmPath:
    """``CUBLAS`` where the device has a native GEMM for this pair of operand casts (MX and NVFP4 on
    Blackwell's block-scaled tensor cores included), ``FOLDED`` for MX pairs on other FP8 tensor cores, else
    ``EMULATED``."""
    a, b = F.get(lhs_fmt), F.get(rhs_fmt)
    if not cap.fp8_gemm:
        return GemmPath.EMULATED
    if cap.mx_gemm and native_pair(a, lhs_gran, b, rhs_gran):
        return GemmPath.CUBLAS  # Blackwell's block-scaled tensor cores, checked on first use
    if _folds(a, lhs_gran, b, rhs_gran):
        return GemmPath.FOLDED
    if a not in (E4M3, E5M2) or b not in (E4M3, E5M2):
        return GemmPath.EMULATED
    if a is E5M2 and b is E5M2:
        return GemmPath.EMULATED  # FP8 tensor cores take at most one E5M2 operand
    if (lhs_gran.kind, rhs_gran.kind) in ((TENSOR, TENSOR), (ROW, ROW)):
        return GemmPath.CUBLAS
    if cap.blockwise_fp8_gemm and _deepseek(lhs_gran, rhs_gran):
        return GemmPath.CUBLAS
    return GemmPath.EMULATED


def first_use_check(lhs_fmt, lhs_gran: Granularity, rhs_fmt, rhs_gran: Granularity,
                    cap: Capability) -> FirstUseCheck | None:
    """The check the path of this pair on ``cap``'s device must pass on its first use there (folded MX GEMMs,
    Blackwell's block-scaled ones), or None for a path that needs none."""
    path = gemm_path(lhs_fmt, lhs_gran, rhs_fmt, rhs_gran, cap)
    if path is GemmPath.FOLDED:
        return FOLD_CHECK
    if path is GemmPath.CUBLAS and lhs_gran.kind in BLOCK_SCALED:
        return blackwell.CHECK
    return None


@torch._dynamo.assume_constant_result
def _folded_checked(device: torch.device) -> bool:
    """``FOLD_CHECK`` on ``device``. While torch.compile traces, the check runs eagerly then and its outcome
    enters the graph as a constant: no graph break, no host sync in the compiled step."""
    return FOLD_CHECK.checked(device, _folded, _emulated)


@torch._dynamo.assume_constant_result
def _blackwell_checked(device: torch.device) -> bool:
    """``blackwell.CHECK`` on ``device``, run eagerly at trace time as :func:`_folded_checked`."""
    return blackwell.CHECK.checked(device, _cublas, _emulated)


def folded_runs(device: torch.device | str) -> bool:
    """Whether folded GEMMs run on ``device`` outside :func:`scaled_mm` (the experts' grouped GEMMs): a CUDA
    device whose first-use check passed (run now if it has not)."""
    device = torch.device(device)
    return device.type == "cuda" and _folded_checked(device)


FOLD_AT_CAST = os.environ.get("LOWPREC_FOLD_AT_CAST") != "0"
"""``LOWPREC_FOLD_AT_CAST=0`` (read at import, to measure what folding at the casts gives): layers cast MX
operands as MX and their folded GEMMs fold them, as before casts could fold; the same bits either way."""


def folds_at_cast(device: torch.device | str) -> bool:
    """Whether a layer's casts for folded GEMMs on ``device`` write the folded operands themselves
    (``CastSpec.folded``): where folded GEMMs run, i.e. a CUDA device whose first-use check passed (run now
    if it has not), or a device without that check (the CPU, in tests, told it has FP8 tensor cores); unless
    :data:`FOLD_AT_CAST` is off."""
    device = torch.device(device)
    return FOLD_AT_CAST and (device.type != "cuda" or _folded_checked(device))


def check_paths(device: torch.device | str) -> None:
    """Run now, on ``device``, the first-use checks of the paths its GEMMs may take (``lowprec info --check``)."""
    device = torch.device(device)
    cap = capability(device)
    if cap.fp8_gemm:
        _folded_checked(device)
    if cap.mx_gemm:
        _blackwell_checked(device)


def gemm_backend(a: QuantizedTensor, b: QuantizedTensor, cap: Capability) -> GemmPath:
    """The backend ``scaled_mm`` takes for these operands on ``cap``'s device."""
    return gemm_path(a.fmt, a.granularity, b.fmt, b.granularity, cap)


def _pad(t: torch.Tensor, value: float, *, rows: int = 0, cols: int = 0) -> torch.Tensor:
    """``t`` (2-D) with ``rows`` rows and ``cols`` columns of ``value`` appended (FP8 codes: zero bytes, +0)."""
    if not rows and not cols:
        return t
    if t.element_size() == 1:
        return torch.nn.functional.pad(t.view(torch.uint8), (0, cols, 0, rows)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, cols, 0, rows), value=value)


def blockwise_operands(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, ...]:
    """``(a data, a scales, b data, b scales)`` laid out as cuBLAS's sm90 block-scaled GEMM reads them.

    [Note: block scales for cuBLAS]
    cuBLAS reads 1x128 scales outer-dim-major, ``(M, K/128)`` with a leading dimension of M, and
    128x128 scales ``(K/128, N/128)`` with a leading dimension of K/128; both leading dimensions must be
    multiples of 4. ``torch._scaled_mm`` (2.11) checks neither: with K/128 = 6 (K = 768, the 125m
    preset's width) it multiplied with misread scales and fp8-blockwise training diverged on the H200,
    and it refuses 128x128 scales padded to a leading dimension of 8 (measured, bench_gemm's ragged
    probes). So where K/128 is not a multiple of 4 both operands' K is padded with zero codes (and
    their scales with ones) to the next multiple of 512, which adds nothing to the product; and 1x128
    operands' rows (codes with zeros, scales with ones) to a multiple of 4. The caller crops the output."""
    m4 = -a.data.shape[0] % 4  # rows short of a multiple of 4
    if _blocks(b.granularity) == (128, 128):
        kb = -a.scale.shape[1] % 4  # K blocks short of a multiple of 4
        b_data, sb = _pad(b.data, 0.0, cols=128 * kb), _pad(b.scale, 1.0, cols=kb).t()  # (K/128, N/128)
    else:  # the weight gradient, both along the tokens: (K/128, N) row-major, N padded to a multiple of 4
        kb, n4 = 0, -b.data.shape[0] % 4
        b_data, sb = _pad(b.data, 0.0, rows=n4), _pad(b.scale, 1.0, rows=n4).t().contiguous()
    a_data, sa = _pad(a.data, 0.0, rows=m4, cols=128 * kb), _pad(a.scale, 1.0, rows=m4, cols=kb)
    return a_data, sa.t().contiguous().t(), b_data, sb  # a's scales (M, K/128), outer-dim-major


def _cublas(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32,
            fast_accum: bool = False) -> torch.Tensor:
    if a.granularity.kind in BLOCK_SCALED:
        return blackwell.block_scaled_mm(a, b, out_dtype)
    if _blocks(a.granularity) == (1, 128):
        a_data, sa, b_data, sb = blockwise_operands(a, b)
    else:
        # cuBLAS's FP8 GEMM takes M, N and K in multiples of 16 (an expert's few tokens are not): zero codes
        # (scales of one) add nothing to the product, and the caller crops the output
        m16, n16, k16 = (-a.data.shape[0] % 16, -b.data.shape[0] % 16, -a.data.shape[1] % 16)
        a_data, b_data = _pad(a.data, 0.0, rows=m16, cols=k16), _pad(b.data, 0.0, rows=n16, cols=k16)
        # per row (a row of one included: its data is padded to 16 rows) or one per tensor
        sa = _pad(a.scale, 1.0, rows=m16) if a.granularity.kind is ROW else a.scale  # (M or 1, 1)
        sb = (_pad(b.scale, 1.0, rows=n16) if b.granularity.kind is ROW else b.scale).t()  # (1, N or 1)
    return torch._scaled_mm(a_data, b_data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _folded(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32,
            fast_accum: bool = False) -> torch.Tensor:
    """Both MX operands folded to row scales, then the row-wise FP8 GEMM (see ``kernels.fold``). An operand
    that arrives folded (its cast folded it: ``CastSpec.folded``) is taken as it is."""
    return _cublas(_fold_once(a), _fold_once(b), out_dtype, fast_accum)


def _fold_once(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` folded, or ``q`` itself where a cast already folded it (row-wise FP8, power-of-two row scales)."""
    return q if q.granularity.kind is ROW and q.fmt in (E4M3, E5M2) else fold(q)


def exact_in_bf16(fmt: F.Format, gran: Granularity) -> bool:
    """Whether the values the GEMM multiplies are exact in BF16: the elements alone where the scales
    stay outside (tensor, row), else element times block scale, whose significand bits (the
    element's, plus 0 for E8M0 or 3 for E4M3 scales) must fit BF16's 7."""
    if fmt.bits > 8:
        return False
    if gran.kind in (TENSOR, ROW):  # scales constant along K
        return fmt.man_bits <= 7
    scale_bits = gran.scale_format.man_bits  # E8M0 0, E4M3 3; FP32 23: never exact in BF16
    return fmt.man_bits + scale_bits <= 7


def emulation_dtype(lhs_fmt, lhs_gran: Granularity, rhs_fmt, rhs_gran: Granularity,
                    device_type: str) -> torch.dtype:
    """The dtype of the high-precision GEMM an ``emulated`` pair of casts runs in on ``device_type``:
    BF16 on CUDA where both operands' values are exact in it, else FP32."""
    exact = exact_in_bf16(F.get(lhs_fmt), lhs_gran) and exact_in_bf16(F.get(rhs_fmt), rhs_gran)
    return torch.bfloat16 if device_type == "cuda" and exact else torch.float32


def emulated_operand(q: QuantizedTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values to multiply, per-row output scale or None), as an emulated GEMM multiplies ``q``: scales
    constant along K stay outside, block scales are multiplied into the elements (a global scale is left to
    the output). ``(Mp, Kp)``: padded as the codes are."""
    if q.granularity.kind in (TENSOR, ROW):  # scales constant along K
        v = q.data.to(dtype) if q.fmt.torch_dtype is not None else q.values().to(dtype)  # exact
        return v, q.scale  # (1, 1) or (Mp, 1): broadcasts over the output's rows
    if emulated_operand_backend(q.data.device, dtype) is Backend.TRITON:
        from lowprec.kernels.triton_dequant import block_values_bf16  # Triton: imported where it runs

        return block_values_bf16(q), None  # one fused pass: decode x block scale -> BF16
    v = q.values()  # (Mp, Kp) float32
    mb, kb = q.scale.shape
    br, bc = q.block_shape
    v = (v.view(mb, br, kb, bc) * q.scale[:, None, :, None]).view(v.shape)
    return v.to(dtype), None


def _emulated(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    dtype = emulation_dtype(a.fmt, a.granularity, b.fmt, b.granularity, a.data.device.type)
    va, sa = emulated_operand(a, dtype)
    vb, sb = emulated_operand(b, dtype)
    # BF16 operands, FP32 accumulation and FP32 output (the scales below multiply in FP32)
    out = torch.mm(va, vb.t(), out_dtype=torch.float32) if dtype != torch.float32 else va @ vb.t()
    if sa is not None:
        out = out * sa
    if sb is not None:
        out = out * sb.t()
    for g in (a.global_scale, b.global_scale):
        if g is not None:
            out = out * g
    return out.to(out_dtype)


def scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32, *,
    fast_accum: bool = False, backend: GemmPath | str | None = None,
) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` with both operands quantized along K; returns ``(M, N)``
    in ``out_dtype`` (cropped to the operands' original row counts)."""
    if a.shape[-1] != b.shape[-1]:
        fail("a/b", "operands with the same reduction dimension K", f"{tuple(a.shape)} and {tuple(b.shape)}")
    backend = backend or gemm_backend(a, b, capability(a.data.device))
    if backend not in (GemmPath.CUBLAS, GemmPath.FOLDED, GemmPath.EMULATED):  # a str enum: "cublas" is CUBLAS
        fail("backend", "'cublas', 'folded' or 'emulated'", repr(backend))
    backend = GemmPath(backend)
    device = a.data.device
    if backend is GemmPath.CUBLAS and a.granularity.kind in BLOCK_SCALED and device.type == "cuda" \
            and not _blackwell_checked(device):  # the first-use check failed, and said so
        backend = GemmPath.FOLDED if _folds(a.fmt, a.granularity, b.fmt, b.granularity) else GemmPath.EMULATED
    if backend is GemmPath.FOLDED and device.type == "cuda" and not _folded_checked(device):
        backend = GemmPath.EMULATED  # the device's first-use check failed, and said so
    if backend is GemmPath.CUBLAS:
        out = _cublas(a, b, out_dtype, fast_accum)
    elif backend is GemmPath.FOLDED:
        out = _folded(a, b, out_dtype, fast_accum)
    else:
        out = _emulated(a, b, out_dtype)
    m = math.prod(a.shape[:-1])
    n = math.prod(b.shape[:-1])
    return out[:m, :n]
