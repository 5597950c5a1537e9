"""The configuration of a training run: one frozen dataclass, validated, never modified."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from lowprec._checks import check_choice, check_positive_int, describe, fail
from lowprec.distributed.grad_comm import GradComm
from lowprec.distributed.launch import Parallel
from lowprec.nn.saved import SavedActivations, fp8_activations

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """Parameters in bf16 on CUDA (with fp32 masters); fp32 on the CPU, where bf16 arithmetic is slow."""
    return "float32" if device == "cpu" else "bfloat16"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How to train: recipe, batch, schedule, evaluation, checkpoints. Defaults suit the tiny model on a CPU."""

    recipe: str = "bf16"
    """A preset of :mod:`lowprec.recipes` (``bf16``, ``fp8-current``, ``mxfp4``, ...)."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per micro-batch."""
    seq_len: int = 128
    grad_accum: int = 1
    """Micro-batches per optimizer step; gradients accumulate in fp32."""
    lr: float = 2e-3
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``lr * min_lr_ratio``."""
    weight_decay: float = 0.1
    """AdamW decay of the weight matrices (not of norms or embeddings)."""
    max_grad_norm: float = 1.0
    eval_every: int = 50
    """Validation loss every this many steps, and after the last."""
    val_batches: int = 8
    save_every: int = 0
    """A checkpoint every this many steps (0: only after the last), when there is an output directory."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted."""
    seed: int = 0
    """Seeds the initialisation, the data order and every random draw of the run."""
    hp_start_steps: int = 0
    """The first this many steps run in BF16 while scaling statistics settle, then the recipe."""
    max_skips_in_row: int = 25
    """Stop when this many steps in a row were skipped (non-finite): the run has diverged."""
    device: str = "cpu"
    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16``; low-precision ones get fp32 masters."""
    tensorboard: bool = True
    progress: bool = True
    """A progress bar, shown only when stderr is a terminal."""
    parallel: str = "none"
    """``none``, ``ddp`` or ``fsdp2`` (see :mod:`lowprec.distributed.launch`); the last two need a process
    group (torchrun), and ``batch_size`` is then the global micro-batch, split across the ranks."""
    grad_comm: str = "fp32"
    """The precision of gradient communication under ``ddp``/``fsdp2``: ``fp32``, ``bf16`` or ``fp8``."""
    fp8_all_gather: bool = True
    """Under ``fsdp2``, all-gather the weights of per-tensor FP8 recipes (fp8-current, fp8-delayed) as
    E4M3 codes with their scales (``lowprec.distributed.fp8_weights``); other recipes, and False,
    all-gather in the parameters' dtype."""
    fp8_activations: str | None = None
    """Norms and SwiGLU keep their inputs for backward in E4M3 (``Policy.saved_activations``), with FP32
    scales per ``"tensor"`` or per ``"1xB"`` block (``"1x128"``); None keeps them in the model's dtype."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches", "keep", "max_skips_in_row",
                     "eval_every"):
            check_positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "save_every", "hp_start_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(name, "a non-negative int", describe(value))
        for name in ("lr", "max_grad_norm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                fail(name, "a positive finite number", describe(value))
        for name in ("min_lr_ratio", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                fail(name, "a number in [0, 1]", describe(value))
        check_choice("dtype", self.dtype, DTYPES)
        Parallel.parse(self.parallel)
        GradComm.parse(self.grad_comm, "grad_comm")
        if self.fp8_activations is not None:
            fp8_activations(self.fp8_activations)
        if not isinstance(self.fp8_all_gather, bool):
            fail("fp8_all_gather", "a bool", describe(self.fp8_all_gather), TypeError)
        try:
            torch.device(self.device)
        except RuntimeError:
            fail("device", "a torch device such as 'cpu' or 'cuda:0'", repr(self.device))

    @property
    def saved_activations(self) -> SavedActivations | None:
        return fp8_activations(self.fp8_activations) if self.fp8_activations is not None else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


RESUME_MUST_MATCH = tuple(f.name for f in fields(TrainConfig)
                          if f.name not in ("steps", "save_every", "keep", "device", "tensorboard", "progress",
                                            "parallel", "grad_comm", "fp8_all_gather"))
"""Settings that change the numbers: a resumed run must use the checkpoint's. ``steps`` may grow; the
parallelism and number of ranks may change (the global batch does not)."""


def check_resumable(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """``ValueError`` naming the first setting that differs from the checkpoint's."""
    current = cfg.to_dict()
    for name in RESUME_MUST_MATCH:
        if name in saved and saved[name] != current[name]:
            fail(name, f"{saved[name]!r} as in the checkpoint being resumed", repr(current[name]))
