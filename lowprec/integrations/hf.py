"""The Hugging Face Trainer and Accelerate: convert first, and lowprec's telemetry from a callback.

Neither has a slot for a third-party low-precision backend (Accelerate's ``mixed_precision="fp8"`` takes
only its own), so the way in is to convert the model before building the ``Trainer`` or calling
``accelerator.prepare``, with ``mixed_precision`` left at ``"no"`` or ``"bf16"``::

    report = lowprec.convert(model, "mxfp8")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[TelemetryCallback("runs/mxfp8", every=100)])

:class:`TelemetryCallback` samples every ``every``-th optimizer step (forward and backward of all its
micro-batches) with ``lowprec.telemetry.sample`` and writes the figures to ``telemetry.csv`` in
``out_dir``, the file ``lowprec train --telemetry-every`` writes, so ``lowprec inspect OUT_DIR`` reads it.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from torch import nn

from lowprec._checks import describe, fail
from lowprec.nn import GroupedLinear, Linear
from lowprec.telemetry import Sample, Telemetry, sample
from lowprec.telemetry.records import FILENAME, TelemetryWriter
from lowprec.telemetry.sample import warn_nothing_to_sample

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the integrations extra installs it
    raise ImportError("lowprec.integrations.hf needs transformers: pip install 'lowprec[integrations]'") from e

__all__ = ["TelemetryCallback"]


class TelemetryCallback(TrainerCallback):
    """Writes lowprec's per-layer, per-operand figures of every ``every``-th optimizer step to
    ``out_dir/telemetry.csv`` (``out_dir`` None: the Trainer's ``output_dir``), from the main process.

    The Trainer's steps count from 1, as ``lowprec train``'s do: step ``s`` is sampled when ``s % every == 0``.
    A run resumed from a checkpoint keeps the rows of the steps up to it. Sampling computes figures only: the
    training itself is the same with or without the callback."""

    def __init__(self, out_dir: str | Path | None = None, every: int = 100) -> None:
        if out_dir is not None and not isinstance(out_dir, (str, Path)):
            fail("out_dir", "a directory path or None (the Trainer's output_dir)", describe(out_dir), TypeError)
        self.telemetry = Telemetry(every)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.path: Path | None = None
        """The ``telemetry.csv`` written (set when training begins, on the main process)."""
        self._writer: TelemetryWriter | None = None
        self._region: contextlib.ExitStack | None = None
        self._sample: Sample | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any):
        if not state.is_world_process_zero:
            return
        out = self.out_dir if self.out_dir is not None else Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / FILENAME
        self._writer = TelemetryWriter(self.path, state.global_step if state.global_step > 0 else None)
        if model is not None:  # said once, at the start, rather than by a missing file at the end
            warn_nothing_to_sample(model, self.telemetry, _casts_low_precision(model))

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any):
        step = state.global_step + 1  # the step about to run
        if self._writer is None or model is None or not self.telemetry.due(step):
            return
        self._region = contextlib.ExitStack()
        self._sample = self._region.enter_context(sample(model, step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self._write()  # every micro-batch's forward and backward are in; the update is not

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self._write()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self._write()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self) -> None:
        """End a sampled region, if one is open, and append its figures to the file."""
        if self._region is None:
            return
        self._region.close()
        self._region = None
        if self._sample.records:  # none from a model whose layers cast nothing: no file, as lowprec train
            self._writer.write(self._sample.records)


def _casts_low_precision(model: nn.Module) -> bool:
    """Whether ``model``'s converted layers hold a recipe that casts to low precision, or none is converted
    (so that telemetry's warning says the model was not converted)."""
    bound = [m.recipe for m in model.modules() if isinstance(m, (Linear, GroupedLinear)) and m.recipe is not None]
    return not bound or any(r.low_precision for r in bound)
