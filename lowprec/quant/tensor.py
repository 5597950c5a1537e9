"""``QuantizedTensor``: a plain, frozen holder of quantized data and its scales."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec import formats as F
from lowprec.quant.granularity import Granularity


def store(values: torch.Tensor, fmt: F.Format) -> torch.Tensor:
    """float32 values already on ``fmt``'s grid -> the format's storage (codes or native dtype)."""
    if fmt.torch_dtype is not None:
        return values.to(fmt.torch_dtype)  # exact: the values are on the grid
    if fmt.bits <= 8:
        return F.codes_of(values, fmt).view(fmt.storage_dtype)
    return values  # tf32: float32 storage


def load(data: torch.Tensor, fmt: F.Format) -> torch.Tensor:
    """The format's storage -> float32 values."""
    if fmt.torch_dtype is not None:
        return data.float()  # exact: torch's casts from narrower float dtypes are exact
    return F.decode_unchecked(data, fmt)


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A tensor quantized onto ``fmt`` with ``granularity``; ``x ~= decode(data) * scale``.

    ``data`` and ``scale`` hold the padded 2-D view (see ``lowprec.quant.granularity``):
    ``data`` is ``(M_pad, K_pad)`` in ``fmt.storage_dtype`` (float8 dtypes for FP8, one uint8 code per
    element for FP6/FP4: :func:`lowprec.formats.pack` packs them for storage); ``scale`` is
    ``(M_pad / block_rows, K_pad / block_cols)`` float32 whose values are exact in the scale format
    (FP32, E8M0 or E4M3). NVFP4 also has an FP32 ``global_scale`` (a 0-d tensor), TransformerEngine's
    global decode scale ``1 / G`` (see [Note: NVFP4's order of operations] in ``lowprec.quant.scales``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: F.Format
    granularity: Granularity
    shape: torch.Size
    """The original shape."""
    dtype: torch.dtype
    """The original dtype, which ``dequantize`` returns by default."""
    global_scale: torch.Tensor | None = None

    @property
    def block_shape(self) -> tuple[int, int]:
        # from the granularity, not data / scale shapes: those are 0 // 0 for an empty tensor
        return self.granularity.blocks(*self.data.shape)

    def effective_scale(self) -> torch.Tensor:
        """Per-block float32 scale that multiplies decoded values (block scale x global scale)."""
        if self.global_scale is None:
            return self.scale
        return self.scale * self.global_scale

    def values(self) -> torch.Tensor:
        """Decoded element values, unscaled, of the padded 2-D view (float32)."""
        return load(self.data, self.fmt)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``decode(data) * scale`` in float32, cropped to the original shape, cast to ``dtype``."""
        mp, kp = self.data.shape
        br, bc = self.block_shape
        mb, kb = self.scale.shape
        v = self.values().view(mb, br, kb, bc)  # (Mb, br, Kb, bc)
        x = (v * self.effective_scale()[:, None, :, None]).view(mp, kp)
        return self.crop(x).to(dtype or self.dtype)

    def crop(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2``, laid out like the padded 2-D data, cropped and reshaped to the original shape."""
        m, k = (math.prod(self.shape[:-1]), self.shape[-1]) if len(self.shape) else (1, 1)
        return x2[:m, :k].reshape(self.shape)

    def scale_codes(self) -> torch.Tensor:
        """The block scales as uint8 codes of their format (E8M0 or E4M3); for FP32 scales, the floats."""
        fmt = self.granularity.scale_format
        return self.scale if fmt.bits > 8 else F.encode(self.scale, fmt)  # FP32 scales have no byte codes

    @property
    def nbytes(self) -> int:
        """Bytes this tensor needs in its formats (FP4 two per byte, FP6 four per three bytes)."""
        scale_bits = self.granularity.scale_format.bits
        gs = 4 if self.global_scale is not None else 0
        return (self.data.numel() * self.fmt.bits + 7) // 8 + (self.scale.numel() * scale_bits + 7) // 8 + gs

    def to_saved(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple]:
        """The tensors for autograd's ``save_for_backward`` (data, scale, global scale or None) and the
        metadata :meth:`from_saved` rebuilds the operand from: the one packing of a quantized tensor
        kept from forward to backward."""
        return (self.data, self.scale, self.global_scale), (self.fmt, self.granularity, self.shape, self.dtype)

    @classmethod
    def from_saved(cls, tensors: tuple, meta: tuple) -> QuantizedTensor:
        """The tensor :meth:`to_saved` packed (``tensors`` as autograd gives them back)."""
        fmt, granularity, shape, dtype = meta
        return cls(tensors[0], tensors[1], fmt, granularity, shape, dtype, tensors[2])

    def __repr__(self) -> str:
        return (f"QuantizedTensor(shape={tuple(self.shape)}, fmt={self.fmt.name}, "
                f"granularity={self.granularity}, dtype={self.dtype}, device={self.data.device})")
