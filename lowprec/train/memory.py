"""Peak memory of a stretch of training: the CUDA allocator's high-water mark, or the process's on Linux.

On the CPU, torch has no allocator statistics; the process's resident-set high-water mark (VmHWM)
is the measure, and Linux lets a process reset it (``clear_refs``), so each recipe of a comparison
gets its own peak. Elsewhere the CPU peak is unknown and reported as None, not guessed.
"""
from __future__ import annotations

from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


class PeakMemory:
    """``reset()`` at the start of a stretch, ``peak_bytes()`` at its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._resettable = False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            _CLEAR_REFS.write_text("5")  # "5" resets the high-water mark to the current RSS
            self._resettable = True
        except OSError:
            self._resettable = False

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _vm_hwm_bytes() if self._resettable else None
