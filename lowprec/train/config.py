"""The configuration of a training run: one frozen dataclass, validated, never modified."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from lowprec import recipes
from lowprec._checks import check_choice, check_positive_int, describe, fail
from lowprec.distributed.grad_comm import GradComm
from lowprec.distributed.launch import Parallel
from lowprec.distributed.supported import unsupported
from lowprec.nn.saved import SavedActivations, fp8_activations
from lowprec.optim.states import StateFormat
from lowprec.policy import Policy
from lowprec.policy_file import policy_from_dict
from lowprec.telemetry.control import ControlConfig
from lowprec.train.recompute import Recompute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAM_BETAS = (0.9, 0.95)
"""The trainer's AdamW betas."""
LR_MAX = torch.finfo(torch.float32).max * (1 - ADAM_BETAS[0])
"""Adam's first step moves a weight by ``lr / (1 - beta1)`` (its bias correction), a float32 scalar in torch's
kernels: a larger ``lr`` overflows it there, a traceback rather than a skipped step."""


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
    ep: int = 1
    """Expert parallelism: split the routed experts of every MoE layer over this many ranks (1: none).
    Needs ``ddp`` or ``fsdp2`` and divides the number of ranks (groups of ``ep`` consecutive ranks, replicas of
    each other, their experts' gradients averaged over all); tokens go to their experts' ranks in FP8
    (1x128 E4M3 blocks) under a low-precision recipe, in the parameters' dtype otherwise, and come back in
    the parameters' dtype (see [Note: expert parallelism] in ``lowprec.distributed.expert_parallel``)."""
    tp: int = 1
    """Tensor and sequence parallelism: split every block's attention and feed-forward over this many ranks (1:
    none), which train on the same rows (see [Note: tensor parallelism] in ``lowprec.distributed.tensor_parallel``).
    Needs ``parallel`` ``ddp`` or ``fsdp2`` and divides the number of ranks: DDP or FSDP2 over the ``ranks / tp``
    replicas of a tensor-parallel group (``grad_comm`` fp32)."""
    optim_states: str = "fp32"
    """How AdamW keeps its moments: ``fp32`` (torch's AdamW), ``bf16``, ``fp8`` (E4M3 with range expansion)
    or ``int8`` (blockwise 8 bits); see :mod:`lowprec.optim.states`. Under ``fsdp2``: ``fp32`` or ``bf16``."""
    master_weights: bool = True
    """FP32 master weights for bfloat16/float16 parameters; False rounds the updated weights back
    stochastically instead (one process only: it swaps ``param.data``, which DDP and FSDP2 rely on)."""
    policy: dict[str, Any] | None = None
    """Which layers stay in high precision: a :class:`lowprec.policy.Policy` in the JSON form of
    :mod:`lowprec.policy_file` (None: the default policy). Part of the run, so a resume keeps it."""
    on_spike: str = "log"
    """What a loss spike does: ``log`` (flagged in the log only), ``skip`` (the step is not taken: weights
    and optimizer state untouched) or ``rollback`` (the step is not taken, the run goes back to its last
    checkpoint and skips the data of the steps since and the spike's; ``save_every``, which must then be
    positive, sets how far back that is; see [Note: rolling back a spike] in :mod:`lowprec.train.step_control`)."""
    control: ControlConfig = field(default_factory=ControlConfig)
    """Automatic precision control and the BF16 final fraction (:mod:`lowprec.telemetry.control`)."""
    compile: str | None = None
    """A ``torch.compile`` backend (``inductor``; ``aot_eager`` in tests) for the training and validation
    forward and backward, or None for eager. The optimizer step stays eager."""
    cuda_graphs: bool = False
    """Compile with ``mode="reduce-overhead"``: inductor records the compiled forward and backward as CUDA
    graphs and replays them, so the host no longer issues each kernel. It pays where the host, not the GPU,
    sets the step's pace: the FP8 experts of a mixture of experts (BENCHMARKS.md). Needs ``compile``
    ``inductor`` on a CUDA device, one process without tensor or expert parallelism, and ``grad_accum`` 1
    (a replay writes over the last one's outputs, which an accumulated gradient would still hold). A
    compiled graph inductor does not record is named in a warning (see :mod:`lowprec.train.graphs`)."""
    telemetry_every: int = 500
    """Sample the converted layers' operand figures (amax, scale, underflow, saturation, SQNR) every this many
    steps into ``telemetry.csv`` (0: never); see ``lowprec.telemetry``. It changes no number of the run."""
    fp8_weights: bool = False
    """Store the converted layers' weights in FP8 with their FP32 masters in the optimizer alone
    (``lowprec.convert(..., fp8_weights=True)``); needs ``dtype`` bfloat16 or float16 and ``tp`` 1. Under
    ``fsdp2`` each rank stores its rows as codes and the ranks all-gather the codes (weights stored in 128x128
    blocks need out_features a multiple of 128 x ranks; see ``lowprec.distributed.fp8_weight_shards``)."""
    fp8_activations: str | None = None
    """Norms and SwiGLU keep their inputs for backward in E4M3 (``Policy.saved_activations``), with FP32
    scales per ``"tensor"`` or per ``"1xB"`` block (``"1x128"``); None keeps them in the model's dtype."""
    recompute: str = "none"
    """Activation recomputation of the transformer blocks: ``none``, ``selective`` (backward recomputes all
    but the GEMMs' and attention's outputs) or ``full`` (each block keeps only its input); see [Note: what
    each recompute mode keeps] in :mod:`lowprec.train.recompute`. It changes no number of the run."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches", "keep", "max_skips_in_row",
                     "eval_every"):
            check_positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "save_every", "hp_start_steps", "seed", "telemetry_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(name, "a non-negative int", describe(value))
        for name in ("lr", "max_grad_norm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                fail(name, "a positive finite number", describe(value))
        if self.lr >= LR_MAX:
            fail("lr", f"a positive number under {LR_MAX:.3g} (Adam's first step, lr / (1 - beta1), must fit float32)",
                 describe(self.lr))
        for name in ("min_lr_ratio", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                fail(name, "a number in [0, 1]", describe(value))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("on_spike", self.on_spike, ("log", "skip", "rollback"))
        if self.on_spike == "rollback" and self.save_every == 0:
            fail("on_spike", "save_every > 0 with 'rollback' (a roll-back returns to the newest checkpoint; "
                 "save_every 0 saves only after the last step)", "'rollback' with save_every 0")
        if not isinstance(self.control, ControlConfig):
            fail("control", "a lowprec.telemetry.control.ControlConfig", describe(self.control), TypeError)
        if self.control.auto and self.telemetry_every == 0:
            # the controller reads the sampled steps' figures: without them it would react to spikes alone
            fail("telemetry_every", "a positive int with control.auto (the controller judges the sampled "
                 "steps' figures)", 0)
        if self.policy is not None:
            self.policy_object()  # refuses a bad field, naming it
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile):
            fail("compile", "None or a torch.compile backend name such as 'inductor'", describe(self.compile))
        Parallel.parse(self.parallel)
        GradComm.parse(self.grad_comm, "grad_comm")
        if self.fp8_activations is not None:
            fp8_activations(self.fp8_activations)
        Recompute.parse(self.recompute)
        if not isinstance(self.fp8_all_gather, bool):
            fail("fp8_all_gather", "a bool", describe(self.fp8_all_gather), TypeError)
        check_positive_int("ep", self.ep)
        if self.ep > 1 and self.parallel == "none":
            fail("ep", "1 with parallel 'none' (experts are split over the ranks of a ddp or fsdp2 run)", self.ep)
        if self.ep > 1 and self.recipe in recipes.names() and recipes.get(self.recipe).uses_delayed_scaling:
            fail("ep", f"1 with recipe {self.recipe} (delayed scaling keeps an amax history per expert, which "
                 "expert parallelism would split over the ranks; fp8-current scales each expert by its own amax)",
                 self.ep)
        self._check_cuda_graphs()
        self._check_tp()
        self._check_fp8_weights()
        self._check_optimizer()
        try:
            torch.device(self.device)
        except RuntimeError:
            fail("device", "a torch device such as 'cpu' or 'cuda:0'", repr(self.device))

    def _check_cuda_graphs(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            fail("cuda_graphs", "a bool", describe(self.cuda_graphs), TypeError)
        if not self.cuda_graphs:
            return
        needs = (("compile", self.compile == "inductor", "'inductor'", repr(self.compile)),
                 ("device", str(self.device).startswith("cuda"), "a CUDA device", repr(self.device)),
                 ("parallel", self.parallel == "none", "'none'", repr(self.parallel)),
                 ("grad_accum", self.grad_accum == 1, "1", self.grad_accum))
        for name, ok, expected, got in needs:
            if not ok:
                fail(name, f"{expected} with cuda_graphs (CUDA graphs replay inductor's graphs, one process "
                     "without gradient accumulation)", got)

    def _check_tp(self) -> None:
        check_positive_int("tp", self.tp)
        if self.tp == 1:
            return
        if self.parallel == "none":
            fail("tp", "1 with parallel 'none' (tensor parallelism splits over the ranks of a ddp or fsdp2 run)",
                 self.tp)
        for name, ok, expected in (("ep", self.ep == 1, "1"), ("fp8_weights", not self.fp8_weights, "False"),
                                   ("grad_comm", self.grad_comm == "fp32", "'fp32' (the split weights' gradients "
                                                                            "are averaged in float32)"),
                                   ("optim_states", self.optim_states in ("fp32", "bf16"),
                                    "'fp32' or 'bf16' (FP8 and 8-bit moments group the rows of shards split along "
                                    "dim 0; rowwise layers split along dim 1)")):
            if not ok:
                fail(name, f"{expected} with tp {self.tp}", repr(getattr(self, name)))

    def _check_optimizer(self) -> None:
        check_choice("optim_states", self.optim_states, [f.value for f in StateFormat])
        if not isinstance(self.master_weights, bool):
            fail("master_weights", "a bool", describe(self.master_weights), TypeError)
        if not self.master_weights and self.dtype == "float32":
            fail("master_weights", "True for float32 parameters (they are their own masters); False needs "
                 "dtype bfloat16 or float16", False)
        # what a run spread over ranks cannot combine: the rule lowprec plan reports too
        for u in unsupported(self.parallel, fp8_weights=self.fp8_weights, optim_states=self.optim_states,
                             master_weights=self.master_weights):
            fail(u.option, u.expected, u.received)

    def policy_object(self) -> Policy | None:
        """The conversion policy, or None for the default one."""
        return None if self.policy is None else policy_from_dict(self.policy, "policy")

    def _check_fp8_weights(self) -> None:
        if not isinstance(self.fp8_weights, bool):
            fail("fp8_weights", "a bool", describe(self.fp8_weights), TypeError)
        if self.fp8_weights and self.dtype == "float32":
            fail("fp8_weights", "dtype bfloat16 or float16 (float32 weights have no master to drop: FP8 codes "
                 "beside an FP32 master would add memory)", "dtype float32")

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
                                            "parallel", "grad_comm", "fp8_all_gather", "ep", "tp", "compile",
                                            "cuda_graphs",
                                            "telemetry_every", "recompute"))
"""Settings that change the numbers: a resumed run must use the checkpoint's. ``steps`` may grow; the
parallelism and number of ranks may change (the global batch does not; experts split by ``ep`` and linears
split by ``tp`` are saved as shards and reshard like FSDP2's), and so may ``recompute``, which
gives the same numbers bit for bit."""


def check_resumable(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """``ValueError`` naming the first setting that differs from the checkpoint's."""
    current = cfg.to_dict()
    for name in RESUME_MUST_MATCH:
        if name in saved and saved[name] != current[name]:
            fail(name, f"{saved[name]!r} as in the checkpoint being resumed", repr(current[name]))
