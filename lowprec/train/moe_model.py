"""The reference model's mixture-of-experts feed-forward (DeepSeek-style): many narrow routed experts,
top-k softmax routing, and shared experts every token passes through.

[Note: the reference MoE layer]
The router is a plain ``nn.Linear`` named ``router``, which the default conversion policy keeps in high
precision (``keep_routers``: a few bits of error reorder the experts); its logits are taken to FP32
before the softmax. Each token goes to the ``top_k`` experts of highest probability, weighted by those
probabilities renormalised to sum to one. No token is dropped (no capacity limit): the ``T * top_k``
(token, expert) pairs are sorted by expert (a stable sort, so the order is the same on every run),
the offsets are the cumulative counts (``lowprec.nn.routing.expert_counts``, of a fixed shape), and the
routed experts are three ``lowprec.nn.GroupedLinear``s (``w1`` gate, ``w3`` up, ``w2`` down: a SwiGLU each,
the names of the dense feed-forward), which ``convert`` binds to the recipe; under ``torch.compile`` they
run in the graph where they need no count on the host (BF16, and fp8-current or fp8-rowwise on an sm90 GPU),
outside it otherwise (see [Note: experts under torch.compile] in ``lowprec.nn.routing``).
Each pair's output is put back in token order by a gather, multiplied by its weight and summed over the
token's ``top_k`` experts. The dispatch and the combine are permutations whose gradients are gathers too (no
second sort, no accumulation by index: [Note: dispatch and combine] in ``lowprec.nn.dispatch``), so the layer
is deterministic on any device. The shared experts
are one dense SwiGLU of ``n_shared`` experts' width, added to every token.

Under expert parallelism (:func:`parallelize_experts`; see [Note: expert parallelism] in
``lowprec.distributed.expert_parallel``) each rank holds a slice of the experts: the grouped rows go to
their experts' ranks by all-to-all and come back before the combine, which is unchanged.

No auxiliary balancing loss is computed (the training loop's loss is the language model's alone). With
``MoEConfig.balance_rate`` > 0 the layer balances its experts as DeepSeek-V3 does, without a loss (see
[Note: auxiliary-loss-free balancing]); at 0 (``moe-tiny``) the experts stay near the balance of their
random initialisation. An expert that receives no token is handled by ``GroupedLinear`` (its gradient is
zero).

[Note: auxiliary-loss-free balancing]
Each layer keeps a bias per expert (the buffer ``expert_bias``, float32, zero at first) that is added to the
routing probabilities to choose each token's ``top_k`` experts, and only for that: the chosen experts'
weights are their probabilities without it, renormalised. Training forwards (not evaluation, not a
recomputed forward) count the tokens each expert received (``expert_load``); after each optimizer step
that was taken, :func:`balance_experts` moves every bias by ``balance_rate`` toward balance (up for an
expert that received fewer tokens than the mean over the experts, down for more, unchanged at the mean)
and clears the counts; a skipped step clears them without moving the biases (its weights did not move
either). Under data or expert parallelism the counts are summed over the ranks first, in one all-reduce
for every layer, so every rank moves its biases alike. The bias is part of the model's state (saved,
resumed, exported as ERNIE 4.5's ``e_score_correction_bias``, which routes the same way).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lowprec._checks import describe, fail
from lowprec.convert_hf_moe import HFGroupedExperts
from lowprec.distributed.expert_parallel import ExpertParallel, shard_experts, shard_grouped
from lowprec.nn import GroupedLinear, SwiGLU
from lowprec.nn.dispatch import combine, dispatch, expert_order, inverse_permutation
from lowprec.nn.grouped import route
from lowprec.nn.recomputation import recomputing
from lowprec.nn.routing import expert_counts, outside_graphs

__all__ = ["MoEConfig", "MoEFeedForward", "RoutedExperts", "balance_experts", "parallelize_experts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """The experts of each block of a reference MoE model; each expert is ``ModelConfig.ffn_dim`` wide."""

    n_experts: int
    """Routed experts per block."""
    top_k: int
    """Routed experts each token passes through."""
    n_shared: int = 1
    """Shared experts every token passes through (one SwiGLU ``n_shared * ffn_dim`` wide); 0 for none."""
    balance_rate: float = 0.0
    """Auxiliary-loss-free balancing: how far each expert's routing bias moves per optimizer step (DeepSeek-V3
    uses 0.001); 0 for no bias. See [Note: auxiliary-loss-free balancing]."""

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "n_shared"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "n_shared" else 1):
                fail(f"moe.{name}", "a positive int" if name != "n_shared" else "a non-negative int", describe(v))
        if self.top_k > self.n_experts:
            fail("moe.top_k", f"at most n_experts={self.n_experts}", self.top_k)
        r = self.balance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            fail("moe.balance_rate", "a finite number >= 0", describe(r))


class RoutedExperts(nn.Module):
    """``n_experts`` SwiGLU experts of width ``hidden`` on tokens grouped by expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = GroupedLinear(n_experts, dim, hidden)
        self.w3 = GroupedLinear(n_experts, dim, hidden)
        self.w2 = GroupedLinear(n_experts, hidden, dim)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and all(m.takes_offsets(x) for m in (self.w1, self.w3, self.w2)):
            return self.w2(self.act(self.w1(x, offsets), self.w3(x, offsets)), offsets)  # in the graph
        return self._counted(x, offsets)

    @outside_graphs  # reads the counts on the host: see [Note: experts under torch.compile]
    def _counted(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        g = route(x, offsets)  # the counts read on the host once for the three projections
        return self.w2(self.act(self.w1(x, g), self.w3(x, g)), g)  # (N, dim)


class MoEFeedForward(nn.Module):
    """Routed experts plus shared experts; see [Note: the reference MoE layer]. ``shared``: the shared
    experts' dense SwiGLU (built by the model, as its dense feed-forward), or None."""

    def __init__(self, dim: int, hidden: int, moe: MoEConfig, shared: nn.Module | None) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.balance_rate = float(moe.balance_rate)
        self.router = nn.Linear(dim, moe.n_experts, bias=False)
        if self.balance_rate > 0:  # see [Note: auxiliary-loss-free balancing]
            self.register_buffer("expert_bias", torch.zeros(moe.n_experts))
            self.register_buffer("expert_load", torch.zeros(moe.n_experts), persistent=False)
        self.experts = RoutedExperts(moe.n_experts, dim, hidden)
        self.shared = shared
        self.ep: ExpertParallel | None = None
        """Set by :func:`parallelize_experts`: the group this layer's experts are split over."""

    def reset_balance(self) -> None:
        """Zero routing biases and token counts (see [Note: auxiliary-loss-free balancing]); nothing without."""
        if self.balance_rate > 0:
            with torch.no_grad():
                self.expert_bias.zero_()
                self.expert_load.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts and their weights (renormalised probabilities), each (N, k)."""
        probs = self.router(x).float().softmax(dim=-1)  # (N, E)
        if self.balance_rate > 0:  # the bias chooses, the probabilities weigh
            experts = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices  # (N, k)
            weights = probs.gather(1, experts)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        return weights / weights.sum(dim=-1, keepdim=True), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # (N, D)
        weights, experts = self.route(flat)  # (N, k)
        pairs = experts.flatten()  # (N*k,) the expert of each (token, slot)
        order = expert_order(pairs, self.experts.w1.num_experts)  # (N*k,) pairs grouped by expert
        counts = expert_counts(pairs, self.experts.w1.num_experts)  # (E,)
        if self.balance_rate > 0 and self.training and torch.is_grad_enabled() and not recomputing():
            self.expert_load += counts
        inverse = inverse_permutation(order)
        rows = dispatch(flat, order, inverse, self.top_k)  # (N*k, D) in expert order
        y = self._run_experts(rows, counts)  # (N*k, D)
        y = combine(y, order, inverse).view(B * T, self.top_k, D)  # (N, k, D) back in token order
        out = (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)  # (N, D)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(B, T, D)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(rows, counts.cumsum(0)) if self.ep is None else self.ep.run(self.experts, rows, counts)


def parallelize_experts(model: nn.Module, ep: ExpertParallel) -> int:
    """Split the routed experts of every MoE layer of ``model`` over ``ep``'s ranks: the reference model's
    :class:`MoEFeedForward` and the Hugging Face experts ``lowprec.convert`` runs (``HFGroupedExperts``),
    after ``lowprec.convert``, before FSDP2 or DDP wrap the model; the number of MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    hf = [m for m in model.modules() if isinstance(m, HFGroupedExperts)]
    if not layers and not hf:
        fail("ep", "a model with mixture-of-experts layers (a reference MoE preset such as moe-tiny, or a Hugging "
             "Face MoE whose experts lowprec.convert runs)", f"{type(model).__name__} without any")
    for m in layers:
        for lin in (m.experts.w1, m.experts.w3, m.experts.w2):
            shard_grouped(lin, ep.group, ep.replicas)
        m.ep = ep
    for m in hf:
        shard_experts(m, m.parameter_names(), m.num_experts, ep.group, ep.replicas)
        m.ep = ep
    return len(layers) + len(hf)


def balance_experts(model: nn.Module, taken: bool = True, group: dist.ProcessGroup | None = None) -> int:
    """After an optimizer step: move the routing bias of every balancing :class:`MoEFeedForward` of
    ``model`` toward balance by the tokens counted since the last call (``taken``: the step was taken; a
    skipped one only clears the counts), the counts summed over ``group``'s ranks when torch.distributed is
    initialized (one all-reduce for all layers); the number of layers. See [Note: auxiliary-loss-free
    balancing]."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward) and m.balance_rate > 0]
    if not layers:
        return 0
    if taken:
        loads = torch.stack([m.expert_load for m in layers])  # (L, E)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)  # a sum: every rank moves its biases alike
        for m, load in zip(layers, loads):
            m.expert_bias += m.balance_rate * torch.sign(load.mean() - load)
    for m in layers:
        m.expert_load.zero_()
    return len(layers)
