"""Loss-spike detection against a running window of recent losses.

[Note: what counts as a spike]
A loss is a spike when it lies more than ``factor`` standard deviations above the mean of the last
``window`` finite losses: ``loss > mean + factor * max(std, 0.01 * |mean|)``. The floor on the
deviation keeps a flat window (a constant loss, std 0) from calling every tiny rise a spike.
Only rises count: a falling loss is what training is for. Detection starts once ``min_history``
losses have been seen, since a mean of two or three early losses says little. Every finite loss
enters the window, spikes included, so a lasting shift in level stops being reported once the
window has caught up with it. Spikes are reported; the step guard skips them only when asked to
(``skip_spikes``), and a training loop may roll back instead (``TrainConfig.on_spike``).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from lowprec._checks import check_positive_int, describe, fail

_STD_FLOOR = 0.01  # relative to |mean|; see the note


class SpikeDetector:
    """Remembers the last ``window`` losses and says whether a new one is a spike."""

    def __init__(self, window: int = 100, factor: float = 3.0, min_history: int | None = None) -> None:
        self.window = check_positive_int("spike_window", window)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            fail("spike_factor", "a finite number > 0", describe(factor))
        self.factor = float(factor)
        self.min_history = min(window, 10) if min_history is None else check_positive_int("min_history", min_history)
        if self.min_history > window:
            fail("min_history", f"at most spike_window ({window})", describe(min_history))
        self._losses: deque[float] = deque(maxlen=window)

    def threshold(self) -> float:
        """The loss above which the next one is a spike (inf until ``min_history`` losses were seen)."""
        if len(self._losses) < self.min_history:
            return math.inf
        mean = statistics.fmean(self._losses)
        std = statistics.pstdev(self._losses, mu=mean)
        return mean + self.factor * max(std, _STD_FLOOR * abs(mean))

    def observe(self, loss: float) -> bool:
        """Whether ``loss`` is a spike; a finite ``loss`` then joins the window."""
        if not math.isfinite(loss):
            return False  # not a spike but a non-finite step, which the guard skips
        spike = loss > self.threshold()
        self._losses.append(loss)
        return spike

    def state_dict(self) -> list[float]:
        return list(self._losses)

    def load_state_dict(self, losses: Any) -> None:
        name = "state_dict['guard']['window']"
        if not isinstance(losses, (list, tuple)) or not all(isinstance(x, (int, float)) for x in losses):
            fail(name, "a list of numbers", describe(losses))
        self._losses = deque((float(x) for x in losses), maxlen=self.window)
