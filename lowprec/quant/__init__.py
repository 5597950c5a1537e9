"""Scaling granularities, ``QuantizedTensor``, quantize / dequantize, the Hadamard transform."""
from lowprec.quant.granularity import (
    Granularity,
    GranularityKind,
    ScaleRule,
    blockwise,
    columnwise,
    mx,
    nvfp4,
    rowwise,
    tensorwise,
)
from lowprec.quant.hadamard import hadamard, hadamard_matrix, hadamard_padded
from lowprec.quant.quantize import dequantize, error_bound, fake_quantize, quantize
from lowprec.quant.tensor import QuantizedTensor

__all__ = [
    "Granularity", "GranularityKind", "ScaleRule", "QuantizedTensor", "blockwise", "columnwise", "dequantize",
    "error_bound", "fake_quantize", "hadamard", "hadamard_matrix", "hadamard_padded", "mx", "nvfp4", "quantize",
    "rowwise", "tensorwise",
]
