"""Which linear layers a conversion keeps in high precision, and why.

The default policy converts every ``nn.Linear`` the recipe's GEMMs can take, except:
* the LM head / final projection (its output feeds the softmax over the vocabulary, and it is
  often tied to the embedding): modules named ``lm_head``, ``output``, ``head``, ``embed_out``,
  ``classifier``, ``score``, or whose weight is an ``nn.Embedding``'s weight;
* MoE routers and gates (a few bits of error reorder the experts): modules named ``router`` or
  ``gate`` exactly, or containing ``router`` (SwiGLU's ``gate_proj``/``w1`` are converted);
* linears inside ``nn.MultiheadAttention`` (it reads their weights directly, bypassing forward);
* the first ``keep_first_blocks`` and last ``keep_last_blocks`` transformer blocks (the recipe's
  ``hp_last_fraction`` sets the default of the latter: NVFP4 keeps its last ~15% in BF16);
* with ``skip_small``, layers whose GEMMs are too small to gain from low precision here.
Embeddings, norms and attention's softmax are not linears and are never touched.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from lowprec._checks import describe, fail

Filter = Callable[[str, nn.Linear], bool] | tuple[str, ...] | None
HEAD_NAMES = ("lm_head", "output", "head", "embed_out", "classifier", "score")
ROUTER_NAMES = ("router", "gate")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """What ``lowprec.convert`` converts."""

    include: Filter = None
    """Only layers matching (glob patterns on the module name, or a predicate ``(name, module)``)."""
    exclude: Filter = None
    """Never layers matching (glob patterns or a predicate)."""
    keep_head: bool = True
    """Keep the LM head / final projection in high precision."""
    keep_routers: bool = True
    """Keep MoE routers and gates in high precision."""
    keep_first_blocks: int = 0
    """Keep this many first transformer blocks in high precision."""
    keep_last_blocks: int | None = None
    """Keep this many last blocks in high precision (None: the recipe's ``hp_last_fraction``)."""
    skip_small: bool = False
    """Keep layers whose ``in_features * out_features`` is below ``min_size`` in high precision."""
    min_size: int = 1024 * 1024
    """With ``skip_small``: the smallest weight (elements) worth converting (about where FP8 GEMMs
    and their casts start to beat BF16 on Hopper)."""

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            v = getattr(self, name)
            if v is not None and not callable(v) and not (isinstance(v, tuple) and all(isinstance(p, str) for p in v)):
                fail(name, "None, a tuple of glob patterns or a predicate (name, module) -> bool", describe(v))
        for name in ("keep_first_blocks", "keep_last_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                fail(name, "a non-negative int", describe(v))


def _matches(f: Filter, name: str, module: nn.Module) -> bool:
    if callable(f):
        return bool(f(name, module))
    return any(fnmatch.fnmatchcase(name, p) for p in f)


def find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The transformer blocks: (prefix, count) of the ModuleList holding the most parameters."""
    best, best_params = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = (name, len(m)), n
    return best


def block_index(name: str, blocks: tuple[str, int] | None) -> int | None:
    if blocks is None:
        return None
    prefix = blocks[0] + "." if blocks[0] else ""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def policy_reason(policy: Policy, name: str, module: nn.Linear, *, embeddings: set[int],
                  mha_children: set[int], blocks: tuple[str, int] | None, last_fraction: float) -> str | None:
    """Why ``policy`` keeps this layer in high precision, or None to convert it."""
    leaf = name.rsplit(".", 1)[-1]
    if id(module) in mha_children:
        return "inside nn.MultiheadAttention (reads the weight directly)"
    if policy.include is not None and not _matches(policy.include, name, module):
        return "not matched by policy.include"
    if policy.exclude is not None and _matches(policy.exclude, name, module):
        return "excluded by policy.exclude"
    if policy.keep_head and (leaf in HEAD_NAMES or id(module.weight) in embeddings):
        return "LM head / final projection (kept by policy)"
    if policy.keep_routers and (leaf in ROUTER_NAMES or "router" in leaf):
        return "MoE router / gate (kept by policy)"
    idx = block_index(name, blocks)
    if idx is not None:
        n = blocks[1]
        last = policy.keep_last_blocks if policy.keep_last_blocks is not None else math.ceil(last_fraction * n)
        if idx < policy.keep_first_blocks:
            return f"block {idx} of the first {policy.keep_first_blocks} (kept by policy)"
        if idx >= n - last:
            return f"block {idx} of the last {last} (kept by policy)"
    if policy.skip_small and module.in_features * module.out_features < policy.min_size:
        return f"too small to gain ({module.in_features}x{module.out_features} < policy.min_size)"
    return None
