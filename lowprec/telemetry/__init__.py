"""Per-layer, per-operand numerics of low-precision GEMMs (amax, scale, underflow, saturation, SQNR),
sampled every N steps; see docs/telemetry.md."""
from lowprec.telemetry.sample import NothingToSample, Sample, Telemetry, layer_names, sample
from lowprec.telemetry.stats import GEMMS, OPERANDS, OperandStats, operand_stats, stats_tensor

__all__ = ["GEMMS", "OPERANDS", "NothingToSample", "OperandStats", "Sample", "Telemetry", "layer_names",
           "operand_stats", "sample", "stats_tensor"]
