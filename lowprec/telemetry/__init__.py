"""Per-layer, per-operand numerics of low-precision GEMMs (amax, scale, underflow, saturation, SQNR),
sampled; see docs/telemetry.md."""
from lowprec.telemetry.stats import GEMMS, OPERANDS, OperandStats, operand_stats, stats_tensor

__all__ = ["GEMMS", "OPERANDS", "OperandStats", "operand_stats", "stats_tensor"]
