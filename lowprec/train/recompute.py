"""Activation recomputation of a model's transformer blocks: ``none``, ``selective`` or ``full``.

[Note: what each recompute mode keeps]
Each block of the model (:func:`lowprec.distributed.launch.transformer_blocks`, the ``layers`` of the
reference and Llama-style models) is checkpointed in place: the block's own ``forward`` runs under
``torch.utils.checkpoint`` (non-reentrant), so the model keeps its module names, its ``state_dict`` keys,
the names its conversion report and telemetry give its layers, and the hooks FSDP2 puts on the block.
``torch.compile`` traces that checkpoint as a region of its graph and its partitioner decides what the
region recomputes, by the same policy (selective) or with every operator to be recomputed (full:
:func:`recompute_all`). (Torch's composable checkpoint, forward hooks around the same implementation,
fails under ``torch.compile`` with inductor: the recomputation finds none of the first forward's
saved values.)

* ``none``: every op keeps what its backward needs (the norms and SwiGLU their inputs, a converted
  linear its input's transposed cast, attention q, k, v, its output and log-sum-exp).
* ``full``: a block keeps only its input; backward runs the block's forward again, then its backward.
* ``selective``: selective activation checkpointing (``create_selective_checkpoint_contexts``) with
  :func:`selective_policy`: the outputs of the GEMMs and of the fused attention kernels are kept from
  the first forward; backward runs the block's forward again but takes those from the first forward
  instead of computing them, and recomputes everything else: the norms, RoPE, SwiGLU, the residual
  additions, and every cast of a converted linear (the quantized copies it would save are made again
  from the recomputed input). No GEMM runs twice.

What selective checkpointing sees: it intercepts every ATen operator below autograd, including those
inside ``lowprec.nn``'s autograd functions (a converted linear's casts and GEMM, the norm's and SwiGLU's
arithmetic). A linear's GEMM is ``aten.mm`` (high precision, and FP8/MX/NVFP4 emulated on its exact
values: there the FP32 product is kept, before the output scales and the cast to the output dtype),
``aten._scaled_mm`` (FP8 on the tensor cores) or the grouped forms; lowprec's ``torch.library``
operators (``lowprec::tile_cast``, ``lowprec::tile_amax``, ``lowprec::keep``) are casts and copies,
recomputed; eager Triton casts run outside the dispatcher and are recomputed with the code that launches
them. ``aten.bmm`` is not kept: in a block it is the Hadamard transform of NVFP4's weight-gradient
operand (a cast) or the scores of attention's unfused math path, which is then recomputed whole.

Recomputation gives the same numbers, bit for bit: the recomputed forward runs the same operations on
the same values, with torch's random state as the first forward had it (``preserve_rng_state``: the
stochastic rounding of NVFP4's gradients, drawn in backward, sees the generator as it would without
recomputation), and the delayed-scaling bank neither records nor folds during it (see [Note:
recomputed forwards] in ``lowprec.nn.recomputation``), nor does telemetry's probe report it.
"""
from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lowprec._checks import check_choice, fail
from lowprec.distributed.launch import transformer_blocks
from lowprec.nn.probe import reporting_to
from lowprec.nn.recomputation import recomputation

__all__ = ["KEPT_OPS", "Recompute", "recompute_all", "recompute_blocks", "recompute_mode", "selective_policy"]


class Recompute(str, enum.Enum):
    """How much of a block's forward backward runs again (see [Note: what each recompute mode keeps]);
    its value is the word ``--recompute`` and ``lowprec plan`` take."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any, name: str = "recompute") -> Recompute:
        return cls(check_choice(name, value, [m.value for m in cls]))

    def __str__(self) -> str:
        return self.value


def _ops(*names: str) -> frozenset:
    """The ATen overloads named ``op.overload`` that this torch has (older builds lack some)."""
    found = (getattr(getattr(torch.ops.aten, op, None), overload, None)
             for op, overload in (n.split(".") for n in names))
    return frozenset(op for op in found if op is not None)


GEMM_OPS = _ops("mm.default", "mm.dtype", "addmm.default", "_scaled_mm.default", "_grouped_mm.default",
                "_scaled_grouped_mm.default")
"""The operators a linear layer's forward GEMM runs as, converted (lowprec's ``gemm``) or not."""
ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention.default",
                     "_scaled_dot_product_flash_attention_for_cpu.default",
                     "_scaled_dot_product_efficient_attention.default",
                     "_scaled_dot_product_cudnn_attention.default",
                     "_scaled_dot_product_fused_attention_overrideable.default")
"""``scaled_dot_product_attention``'s fused kernels: their output and log-sum-exp are kept."""
KEPT_OPS = GEMM_OPS | ATTENTION_OPS
"""The operators whose outputs selective recomputation keeps from the first forward."""


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's choice for one operator of a block's forward: keep the GEMMs' and the
    fused attention's outputs (``MUST_SAVE``, which a compiler may not override), recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Full recomputation's choice for every operator of a compiled block: ``MUST_RECOMPUTE``. A compiled
    checkpoint without a policy keeps more: on one H200 (torch 2.11, inductor, the 1B benchmark model)
    its forward kept 7.0 GiB where this policy keeps 4.3 (the blocks' inputs and the LM head's logits)."""
    return CheckpointPolicy.MUST_RECOMPUTE


@contextlib.contextmanager
def _rerun(inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """The context of a recomputed forward: ``inner`` (selective checkpointing's cache, or nothing),
    with the delayed-scaling bank and telemetry's probe left alone (see [Note: recomputed forwards])."""
    with inner, recomputation(), reporting_to(None):
        yield


def _contexts(mode: Recompute) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for torch's checkpoint in eager code: (the first forward's context, the recomputation's)."""
    def contexts() -> tuple[Any, Any]:
        if mode is Recompute.FULL:
            return contextlib.nullcontext(), _rerun(contextlib.nullcontext())
        caching, cached = create_selective_checkpoint_contexts(selective_policy)
        return caching, _rerun(cached)

    return contexts


_CHECKPOINTED = "_lowprec_recompute"
"""The attribute a checkpointed block carries: its mode."""
_INNER = "_lowprec_forward"
"""The attribute that keeps a checkpointed block's own forward where it was an instance's (a wrapper's); None
where it is its class's, which the checkpoint calls as ``type(block).forward``."""


_COMPILED = {Recompute.SELECTIVE: functools.partial(create_selective_checkpoint_contexts, selective_policy),
             Recompute.FULL: functools.partial(create_selective_checkpoint_contexts, recompute_all)}
"""The ``context_fn`` a compiled checkpoint takes for each mode: a constant of the graph."""
_EAGER = {mode: _contexts(mode) for mode in _COMPILED}


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A checkpointed block's ``forward``: its own forward run under ``torch.utils.checkpoint``
    (non-reentrant) as its mode says.

    Traced by ``torch.compile``, the checkpoint becomes a region of the graph whose recomputation the
    compiler plans (selective: the same policy; full: :func:`recompute_all`), handed over as the constant
    that compiled checkpointing accepts; the graph's recomputed ops are pure, so the bank and the probe are
    left alone without :func:`_rerun`'s contexts, which only an eager recomputation runs. The block holds
    this function as a ``functools.partial`` of itself, which a deep copy rebinds to the copy and pickle
    saves by name (a bound method would pickle as an attribute lookup that fails on loading)."""
    mode = getattr(self, _CHECKPOINTED)
    context_fn = _COMPILED[mode] if torch.compiler.is_compiling() else _EAGER[mode]
    inner = getattr(self, _INNER)
    inner = functools.partial(type(self).forward, self) if inner is None else inner
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def recompute_blocks(model: nn.Module, mode: str | Recompute) -> list[nn.Module]:
    """Checkpoint every transformer block of ``model`` in place as ``mode`` says (nothing for ``none``);
    returns the blocks checkpointed. Call it once per model, after ``lowprec.convert`` and before wrapping
    for DDP or FSDP2 and compiling. A model without a list of blocks is refused for ``selective`` and
    ``full``; a block checkpointed already, for a second call."""
    mode = Recompute.parse(mode) if not isinstance(mode, Recompute) else mode
    if mode is Recompute.NONE:
        return []
    blocks = transformer_blocks(model)
    if not blocks:
        fail("recompute", "'none' for a model without an nn.ModuleList of transformer blocks",
             f"{mode.value!r} for a {type(model).__name__}")
    for block in blocks:
        if _CHECKPOINTED in vars(block):
            fail("recompute", "one call per model", f"a second call ({mode.value!r}) on a checkpointed block")
    for block in blocks:
        # the instance's forward, so module names, state_dict keys and hooks (FSDP2's) stay the block's own
        setattr(block, _INNER, vars(block).get("forward"))  # a wrapper's forward on the instance, kept
        setattr(block, _CHECKPOINTED, mode)
        block.forward = functools.partial(_checkpointed_forward, block)
    return blocks


def recompute_mode(block: nn.Module) -> Recompute:
    """The mode :func:`recompute_blocks` checkpointed ``block`` with; ``none`` for a block it did not."""
    return vars(block).get(_CHECKPOINTED, Recompute.NONE)
