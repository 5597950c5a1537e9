"""Which linear layers a conversion keeps in high precision, and why.

The default policy converts every ``nn.Linear`` the recipe's GEMMs can take, except:
* the LM head / final projection (its output feeds the softmax over the vocabulary, and it is
  often tied to the embedding): modules named ``lm_head``, ``output``, ``head``, ``embed_out``,
  ``classifier``, ``score``, or whose weight is an ``nn.Embedding``'s weight;
* MoE routers and gates (a few bits of error reorder the experts): modules named ``router`` or
  ``gate`` exactly, containing ``router``, or ending in ``expert_gate`` (Qwen2-MoE's gate of its shared
  expert); SwiGLU's ``gate_proj``/``w1`` are converted;
* linears inside ``nn.MultiheadAttention`` (it reads their weights directly, bypassing forward);
* the first ``keep_first_blocks`` and last ``keep_last_blocks`` transformer blocks (the recipe's
  ``hp_last_fraction`` sets the default of the latter: NVFP4 keeps its last ~15% in BF16);
* layers too small to gain: where the recipe's GEMMs run natively (FP8 on Hopper), a linear with
  a dimension under ``min_features`` runs in high precision, since its GEMM saves less time than its
  casts cost (``skip_small``; on a device that emulates the recipe every layer takes it, so that a
  recipe's numerics can be checked there whole).
Embeddings, norms and attention's softmax are not linears and are never touched.

Layers that read the same input (``share_inputs``: q/k/v, gate/up) share that input's casts.

``saved_activations`` is the one setting here that is not about linears: it makes the norms and
SwiGLU keep their inputs for backward in FP8 (see [Note: saved activations] in ``lowprec.nn.saved``).
It lives in the policy, not the recipe, because it is a choice of which modules ``convert`` changes
and how, independent of the GEMMs' formats (it goes with ``bf16`` as well as with ``mxfp8``), while a
recipe is the casts of a linear's three GEMMs and nothing else.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch.nn as nn

from lowprec._checks import describe, fail
from lowprec.nn.plan import too_small
from lowprec.nn.saved import SavedActivations

Filter = Callable[[str, nn.Linear], bool] | tuple[str, ...] | None
HEAD_NAMES = ("lm_head", "output", "head", "embed_out", "classifier", "score")
ROUTER_NAMES = ("router", "gate")


def is_router(leaf: str) -> bool:
    """A module named as an MoE router or gate: ``router``/``gate`` exactly, a name containing ``router``,
    or an expert's gate (Qwen2-MoE's ``shared_expert_gate``, a sigmoid on the shared expert's output)."""
    return leaf in ROUTER_NAMES or "router" in leaf or leaf.endswith("expert_gate")


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
    skip_small: bool | None = None
    """Keep layers with a dimension under ``min_features`` in high precision: None (default) where the
    recipe's GEMMs run natively, decided per device (so a model converted on the CPU and moved to a
    GPU follows the GPU's rule); True everywhere; False never."""
    min_features: int = 1024
    """The smallest ``min(in_features, out_features)`` worth converting: on the H200 a whole training
    step of a model of width 768 ran no faster in FP8 than in BF16, one of width 2048 ran 1.2-1.4x
    faster (BENCHMARKS.md)."""
    share_inputs: tuple[tuple[str, ...], ...] = (
        ("wq", "wk", "wv"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"),
        ("w1", "w3"), ("gate_proj", "up_proj"))
    """Groups of sibling linears or expert projections (leaf names under one parent) that read the same
    input: each group casts it once per forward and shares the casts (deterministic, current-scaled casts
    only; experts' projections for the same routing only)."""
    saved_activations: SavedActivations | None = None
    """How ``lowprec.nn.RMSNorm`` and ``lowprec.nn.SwiGLU`` modules keep their inputs for backward: None
    in the model's dtype, or FP8 (``lowprec.nn.fp8_activations("1x128")``); ``convert`` also swaps a
    ``torch.nn.RMSNorm`` over the last dimension for ``lowprec.nn.RMSNorm`` when this is set."""
    recast_inputs: bool = False
    """Under ``torch.compile``, each converted linear's backward makes its input's transposed cast
    again instead of keeping it, so that the compiler keeps the input only where nothing cheaper
    rebuilds it (see [Note: recasting the input in backward] in ``lowprec.nn.function``): less memory,
    more work: on the H200 the compiled 1B step's peak fell from 0.88x to 0.81x BF16's (torchao's) and
    its speed from 1.19x to 1.16x BF16's (torchao's 1.17x; BENCHMARKS.md, run 15), so it is off by
    default. Ignored
    while ``saved_activations`` is set (the norms then keep FP8 copies, from which their outputs cannot
    be rebuilt)."""

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            v = getattr(self, name)
            if v is not None and not callable(v) and not (isinstance(v, tuple) and all(isinstance(p, str) for p in v)):
                fail(name, "None, a tuple of glob patterns or a predicate (name, module) -> bool", describe(v))
        for name in ("keep_first_blocks", "keep_last_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                fail(name, "a non-negative int", describe(v))
        if self.skip_small not in (None, True, False):
            fail("skip_small", "None (where the recipe runs natively), True or False", describe(self.skip_small))
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int) or self.min_features < 1:
            fail("min_features", "a positive int", describe(self.min_features))
        groups = self.share_inputs
        if not isinstance(groups, tuple) or not all(
                isinstance(g, tuple) and all(isinstance(n, str) for n in g) for g in groups):
            fail("share_inputs", "a tuple of tuples of layer names", describe(groups))
        if not isinstance(self.recast_inputs, bool):
            fail("recast_inputs", "a bool", describe(self.recast_inputs), TypeError)
        if self.saved_activations is not None and not isinstance(self.saved_activations, SavedActivations):
            fail("saved_activations", "None or a lowprec.nn.SavedActivations", describe(self.saved_activations),
                 TypeError)

    @property
    def recasts_inputs(self) -> bool:
        """Whether converted linears recast their inputs in a compiled backward (``recast_inputs``)."""
        return self.recast_inputs and self.saved_activations is None

    @property
    def small_rule(self) -> int | None:
        """The ``min_features`` a layer applies per device (``skip_small`` None), else None."""
        return self.min_features if self.skip_small is None else None


def quality_policy(policy: Policy | None = None) -> Policy:
    """The policy a quality question (``lowprec compare``, ``lowprec check``) converts with: ``policy``
    (None: the default), with ``skip_small`` False where it is None, so that every layer the recipe can
    take runs it on every device, a small one on a GPU too (its speed is reported, never traded for the
    verdict); a ``skip_small`` the policy sets, True or False, is kept."""
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        fail("policy", "a lowprec.Policy or None", describe(policy), TypeError)
    return replace(policy, skip_small=False) if policy.skip_small is None else policy


def _matches(f: Filter, name: str, module: nn.Module) -> bool:
    if callable(f):
        return bool(f(name, module))
    return any(fnmatch.fnmatchcase(name, p) for p in f)


class UnmatchedPatternWarning(UserWarning):
    """A glob pattern of ``policy.include`` / ``policy.exclude`` that names no linear of the model (a typo,
    most likely): the policy then does less than it says."""


def unmatched_patterns(policy: Policy, names: list[str], name: str = "policy") -> str | None:
    """One line (about the argument ``name``) naming each glob pattern of ``policy.include`` / ``exclude``
    that matches none of ``names`` (the model's linears), or None when each matches one; predicates are
    not judged."""
    unmatched = [f"{field} {p!r}" for field in ("include", "exclude") if isinstance(getattr(policy, field), tuple)
                 for p in getattr(policy, field) if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if not unmatched:
        return None
    example = f" such as {names[0]!r}" if names else ""
    return (f"{name}: expected include/exclude patterns that each match a linear layer's name{example}, got "
            f"{', '.join(unmatched)} matching none of the model's {len(names)} linears")


def find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The transformer blocks: (prefix, count) of the ModuleList (or ModuleDict keyed 0, 1, ..., as
    torchtitan keeps them) holding the most parameters."""
    best, best_params = None, 0
    for name, m in model.named_modules():
        numbered = isinstance(m, nn.ModuleList) or (
            isinstance(m, nn.ModuleDict) and list(m.keys()) == [str(i) for i in range(len(m))])
        if numbered and len(m) > 1:
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


class PolicyKeep(NamedTuple):
    """Why a policy keeps a layer in high precision."""

    reason: str
    small: bool = False
    """By the small-layer rule (``skip_small=True``), not by name or place."""


def policy_keeps(policy: Policy, name: str, module: nn.Linear, *, embeddings: set[int],
                 mha_children: set[int], blocks: tuple[str, int] | None, last_fraction: float) -> PolicyKeep | None:
    """Why ``policy`` keeps this layer in high precision, or None to convert it."""
    leaf = name.rsplit(".", 1)[-1]
    if id(module) in mha_children:
        return PolicyKeep("inside nn.MultiheadAttention (reads the weight directly)")
    if policy.include is not None and not _matches(policy.include, name, module):
        return PolicyKeep("not matched by policy.include")
    if policy.exclude is not None and _matches(policy.exclude, name, module):
        return PolicyKeep("excluded by policy.exclude")
    if policy.keep_head and (leaf in HEAD_NAMES or id(module.weight) in embeddings):
        return PolicyKeep("LM head / final projection (kept by policy)")
    if policy.keep_routers and is_router(leaf):
        return PolicyKeep("MoE router / gate (kept by policy)")
    idx = block_index(name, blocks)
    if idx is not None:
        n = blocks[1]
        last = policy.keep_last_blocks if policy.keep_last_blocks is not None else math.ceil(last_fraction * n)
        if idx < policy.keep_first_blocks:
            return PolicyKeep(f"block {idx} of the first {policy.keep_first_blocks} (kept by policy)")
        if idx >= n - last:
            return PolicyKeep(f"block {idx} of the last {last} (kept by policy)")
    if policy_small(policy, module):
        return PolicyKeep(f"too small to gain ({module.in_features}x{module.out_features}: a dimension under "
                          "policy.min_features)", small=True)
    return None


def policy_small(policy: Policy, module: nn.Linear) -> bool:
    """The policy keeps ``module`` as too small to gain on every device (``skip_small=True``)."""
    return bool(policy.skip_small) and too_small(module.in_features, module.out_features, policy.min_features)


def share_groups(policy: Policy, names: list[str]) -> list[tuple[str, ...]]:
    """The groups of ``names`` (converted linears and expert projections) that share their input's casts:
    siblings under one parent whose leaf names form one of ``policy.share_inputs``, two or more present."""
    by_parent: dict[str, dict[str, str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = name
    out = []
    for leaves in by_parent.values():
        for group in policy.share_inputs:
            present = tuple(leaves[n] for n in group if n in leaves)
            if len(present) > 1:
                out.append(present)
    return out
