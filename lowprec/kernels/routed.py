"""``lowprec.quant``'s quantize on the backend the route chooses (Triton or the reference, same bits), and
FP8 weights requantized many at a time."""
from __future__ import annotations

import torch

from lowprec._checks import check_tensor, describe, fail
from lowprec.kernels.route import Backend, CastSpec, quantize_backend, requantize_backend
from lowprec.quant import Granularity, QuantizedTensor, tensorwise
from lowprec.quant import quantize as _reference_quantize

_E4M3 = "e4m3"


def quantize(
    x: torch.Tensor, fmt, granularity: Granularity, *, rounding: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None, backend: str | None = None,
) -> QuantizedTensor:
    """``lowprec.quant.quantize`` on the backend the route chooses for x's device (same values, bit for
    bit), or on ``backend``."""
    spec = CastSpec.of(fmt, granularity, rounding, delayed=scale is not None)
    if quantize_backend(spec, x.device, saturate=saturate, backend=backend) is Backend.TRITON:
        from lowprec.kernels import triton_quant

        return triton_quant.quantize(x, fmt, granularity, rounding=rounding, scale=scale, generator=generator)
    return _reference_quantize(x, fmt, granularity, rounding=rounding, saturate=saturate, scale=scale,
                               generator=generator)


def requantize_many(sources: list[torch.Tensor], scales: torch.Tensor, codes: list[torch.Tensor],
                    scale_outs: list[torch.Tensor], dtype: torch.dtype, *, backend: str | None = None) -> None:
    """FP8 weights cast again: for each i, ``codes[i]`` and ``scale_outs[i]`` set in place to the codes and
    the scale of ``lowprec.quant.quantize(sources[i].to(dtype), "e4m3", tensorwise(), scale=scales[i])``.
    Where the route takes Triton, float32 sources onto BF16 go in one launch (see [Note: one launch for
    many tensors] in ``lowprec.kernels.triton_multi``); otherwise one cast each. Same bits either way."""
    _check_requantize(sources, scales, codes, scale_outs)
    if not sources:
        return
    device = sources[0].device
    if requantize_backend(device, dtype, backend) is Backend.TRITON:
        from lowprec.kernels import triton_multi as multi  # Triton: imported where it runs

        laid_out = scales.device == device and all(
            s.dtype == torch.float32 and s.is_contiguous() and 0 < s.numel() <= multi.MAX_NUMEL and s.device == device
            and c.is_contiguous() and c.device == device and o.device == device  # sizes: checked above
            for s, c, o in zip(sources, codes, scale_outs, strict=True))
        if laid_out:
            multi.requantize(sources, scales, codes, scale_outs)
            return
    for src, scale, c, o in zip(sources, scales.unbind(), codes, scale_outs, strict=True):
        q = quantize(src.to(dtype), _E4M3, tensorwise(), scale=scale, backend=backend)
        c.copy_(q.data.view(c.shape))
        o.copy_(q.scale.view(o.shape))


def _check_requantize(sources, scales, codes, scale_outs) -> None:
    n = len(sources)
    if not isinstance(scales, torch.Tensor) or scales.shape != (n,):
        fail("scales", f"a tensor of {n} scales, one per source", describe(scales))
    for name, outs in (("codes", codes), ("scale_outs", scale_outs)):
        if len(outs) != n:
            fail(name, f"{n} tensors, one per source", f"{len(outs)}")
    for i, (src, c, o) in enumerate(zip(sources, codes, scale_outs)):
        check_tensor(f"sources[{i}]", src)
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float8_e4m3fn or c.numel() != src.numel():
            fail(f"codes[{i}]", f"a float8_e4m3fn tensor of sources[{i}]'s {src.numel()} elements", describe(c))
        if not isinstance(o, torch.Tensor) or o.dtype != torch.float32 or o.numel() != 1:
            fail(f"scale_outs[{i}]", "a float32 tensor of one element", describe(o))
