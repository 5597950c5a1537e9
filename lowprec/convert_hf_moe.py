"""Hugging Face mixtures of experts in ``convert``: the experts module transformers builds (fused 3-D
parameters) replaced by :class:`HFGroupedExperts`, which computes the same function through two
``lowprec.nn.GroupedLinear``; the router beside it stays in high precision.

[Note: Hugging Face experts]
transformers 5 builds the routed experts of a MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3,
GPT-OSS and most others) as one module decorated by its ``use_experts_implementation``, which records
the layout on the module: a first projection ``gate_up_proj`` (or ``up_proj`` without a gate) and
``down_proj``, 3-D, stored [E, out, in] or, with ``is_transposed`` (GPT-OSS), [E, in, out]; biases
``*_bias`` [E, out] with ``has_bias``; and the activation as the method ``_apply_gate`` (halves
``act(gate) * up`` by default, GPT-OSS's interleaved and clamped GLU of its own). Its forward takes the
tokens (T, H), each token's top-k experts (T, k) and their routing weights (T, k); the router
(``mlp.gate``, GPT-OSS's ``mlp.router``) is a module of its own applying one [E, H] weight with ``F.linear``.

:class:`HFGroupedExperts` holds the same parameter objects under the same names (so ``state_dict``,
checkpoints, optimizers and ``.to()`` see the experts' parameters as transformers lays them out, and a
transformers checkpoint loads into it), takes the module's settings (its activation and constants) so
that the class's own ``_apply_gate`` runs on it, and computes:
1. the (token, expert) pairs slot by slot (the first choice of every token, then the second, ...), sorted
   by expert with a stable sort: each expert's tokens in the order transformers' eager loop takes them;
   the offsets are the cumulative counts;
2. the first projection as a ``GroupedLinear`` over the sorted tokens, the model's activation, and the
   down projection as a second ``GroupedLinear``;
3. each pair's output times its routing weight, cast to the tokens' dtype, and each token's k outputs
   summed one after another in the order of their experts' indices, gathered back; the dispatch and the
   gather back are permutations whose gradients are gathers too ([Note: dispatch and combine] in
   ``lowprec.nn.dispatch``), so backward is the same on any device too.
Without a recipe this is the eager loop's arithmetic (the same rows for each expert's GEMMs, the same
products, the same sums in the same order), so a model gives the eager implementation's logits bit for bit;
transformers' default ``grouped_mm`` implementation sums differently (each token's k outputs in FP32).

A ``GroupedLinear`` reads its weight as ``self.weight`` (E, out, in). Here the weight is this module's
parameter, so the two ``GroupedLinear`` hold none of their own and are not submodules: each forward
points them at the parameters as they are then (a transposed view where transformers stores [E, in, out]:
nothing is copied, and gradients reach the parameter itself), so a parameter that ``.to()``, FSDP or a
checkpoint replaces is the one the next forward runs.

Not converted, and so named as weights lowprec cannot see into: experts with a norm after each expert
(``has_post_expert_norm``), experts sharded by transformers' own expert parallelism, and any whose
parameters are not exactly those above. ModuleList experts (one MLP of ``nn.Linear`` per expert) need
nothing here: ``convert`` converts their linears one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from lowprec._checks import describe, fail
from lowprec.conversion_report import LayerReport
from lowprec.nn import GroupedLinear
from lowprec.nn.delayed import DelayedState
from lowprec.nn.dispatch import combine, dispatch, expert_order, inverse_permutation
from lowprec.nn.linear import OptionalExtraState, drop_empty_extra_state
from lowprec.nn.plan import Kept
from lowprec.nn.routing import expert_counts, outside_graphs
from lowprec.policy import Policy

__all__ = ["HFGroupedExperts", "HFMoE", "Projection", "hf_moe_layers", "hf_projections", "router_row",
           "swap_hf_experts"]

_LAYOUT = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
"""What transformers' ``use_experts_implementation`` records on an experts module."""
ROUTER_KEPT = "MoE router / gate (kept by policy)"
ROUTER_NOT_CONVERTED = ("MoE router / gate: a Hugging Face router applies its own weight (F.linear), which lowprec "
                        "does not convert: it runs in the model's precision")


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection of Hugging Face experts: its parameters' names on the module and one expert's shape."""

    weight: str
    """``gate_up_proj``, ``up_proj`` or ``down_proj``."""
    bias: str | None
    in_features: int
    out_features: int
    transposed: bool
    """Stored [E, in, out] (GPT-OSS) rather than [E, out, in]."""


def _projection(m: nn.Module, name: str, transposed: bool, bias: bool) -> Projection | None:
    w = m._parameters.get(name)
    if w is None or w.dim() != 3 or w.shape[0] != m.num_experts:
        return None
    in_f, out_f = (w.shape[1], w.shape[2]) if transposed else (w.shape[2], w.shape[1])
    b = m._parameters.get(f"{name}_bias") if bias else None
    if bias and (b is None or tuple(b.shape) != (m.num_experts, out_f)):
        return None
    return Projection(name, f"{name}_bias" if bias else None, in_f, out_f, transposed)


def hf_projections(m: nn.Module) -> tuple[Projection, Projection] | None:
    """The first and down projections of ``m`` when it is experts lowprec converts (see [Note: Hugging
    Face experts]), else None."""
    if isinstance(m, HFGroupedExperts):
        return m.projections
    if not all(isinstance(getattr(m, f, None), bool) for f in _LAYOUT) or not hasattr(m, "_apply_gate"):
        return None
    if m.has_post_expert_norm or getattr(m, "_is_expert_parallel", False) or not isinstance(
            getattr(m, "num_experts", None), int):
        return None
    first = _projection(m, "gate_up_proj" if m.has_gate else "up_proj", m.is_transposed, m.has_bias)
    down = _projection(m, "down_proj", m.is_transposed, m.has_bias)
    if first is None or down is None or len(m._parameters) != 2 + 2 * m.has_bias \
            or any(True for c in m.children() for _ in c.parameters()):
        return None
    width = first.out_features // 2 if m.has_gate else first.out_features  # the activation's output
    if down.in_features != width or down.out_features != first.in_features:
        return None
    return first, down


class HFGroupedExperts(OptionalExtraState):
    """A Hugging Face experts module's parameters (the same objects, under the same names) and activation,
    run through two ``GroupedLinear``; see [Note: Hugging Face experts]."""

    def __init__(self, experts: nn.Module, projections: tuple[Projection, Projection]) -> None:
        super().__init__()
        self.hf_class = type(experts)
        """The class replaced: its ``_apply_gate`` is the activation."""
        for key, value in vars(experts).items():  # the settings the activation reads (act_fn's kind, limits)
            if not key.startswith("_") and key != "training" and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, key, value)
        for key, child in experts.named_children():  # the activation module (it holds no parameter)
            self.add_module(key, child)
        for p in projections:
            for name in (p.weight, p.bias):
                if name is not None:
                    self.register_parameter(name, experts._parameters[name])
        self.projections = projections
        self._grouped = tuple(GroupedLinear(self.num_experts, p.in_features, p.out_features, bias=p.bias is not None,
                                            device="meta") for p in projections)
        self.register_state_dict_post_hook(drop_empty_extra_state)  # Hugging Face's keys alone, unless delayed
        self.ep = None
        """Expert parallelism (``lowprec.distributed.expert_parallel.ExpertParallel``), or None: every expert
        here. Set by ``lowprec.train.moe_model.parallelize_experts``, which splits the parameters."""
        self.train(experts.training)

    def parameter_names(self) -> tuple[str, ...]:
        """The experts' parameters on this module, stacked by expert along dim 0 in either layout."""
        return tuple(name for p in self.projections for name in (p.weight, p.bias) if name is not None)

    def named_delayed_states(self) -> list[tuple[str, DelayedState]]:
        """``(suffix, state)`` of each expert's delayed-scaling state in either projection, named after the
        projection's weight (``.gate_up_proj#expert3``)."""
        return [(f".{p.weight}{suffix}", state) for g, p in zip(self._grouped, self.projections)
                for suffix, state in g.named_delayed_states()]

    def get_extra_state(self):
        # the two GroupedLinear are not submodules (their parameters are this module's): their experts'
        # delayed-scaling histories travel here, as one (2, E, rows, roles) tensor
        states = [g.get_extra_state() for g in self.grouped()]
        return None if any(s is None for s in states) else torch.stack(states)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.shape[0] != len(self._grouped):
            fail("state_dict", f"{self.hf_class.__name__} experts: a delayed-scaling state for each of its "
                 f"{len(self._grouped)} projections", describe(state))
        for g, s in zip(self.grouped(), state):
            g.set_extra_state(s)

    def grouped(self) -> tuple[GroupedLinear, GroupedLinear]:
        """The two ``GroupedLinear``, pointed at this module's parameters as they are now (weights as
        (E, out, in): a transposed view of a parameter stored [E, in, out])."""
        for g, p in zip(self._grouped, self.projections):
            w = getattr(self, p.weight)
            g._parameters["weight"] = w.transpose(1, 2) if p.transposed else w  # not a parameter of its own
            if p.bias is not None:
                g._parameters["bias"] = getattr(self, p.bias)
            g.training = self.training
        return self._grouped

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = self._check(hidden_states, top_k_index, top_k_weights)
        expert = top_k_index.t().reshape(-1)  # (k*T,): slot by slot, as the eager loop takes them
        order = expert_order(expert, self.num_experts)  # (S,) pairs grouped by expert, stably
        if not torch.compiler.is_compiling():  # a graph cannot read the indices (see lowprec.nn.routing)
            outside = expert[(expert < 0) | (expert >= self.num_experts)]
            if outside.numel():
                fail("top_k_index", f"expert indices in [0, {self.num_experts})", int(outside[0]))
        counts = expert_counts(expert, self.num_experts)  # (E,)
        rows = dispatch(hidden_states, order, inverse_permutation(order), k, slot_major=True)  # (S, H)
        y = self._run_experts(rows, counts)  # (S, H)
        y = (y * top_k_weights.t().reshape(-1).index_select(0, order)[:, None]).to(hidden_states.dtype)
        return _combine(y, order, top_k_index)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self.ep.run(self._experts, rows, counts)  # outside compiled graphs
        if torch.compiler.is_compiling() and all(g.takes_offsets(rows) for g in self.grouped()):
            return self._experts(rows, counts.cumsum(0))  # in the graph
        return self._counted(rows, counts.cumsum(0))

    @outside_graphs  # reads the counts on the host: see [Note: experts under torch.compile]
    def _counted(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._experts(rows, offsets)

    def _experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The experts this process holds (all, or its slice under expert parallelism) on ``rows`` grouped
        by expert, ``offsets`` one per expert held."""
        first, down = self.grouped()
        h = first(rows, offsets)  # (S, out of the first projection)
        h = self.hf_class._apply_gate(self, h) if self.has_gate else self.act_fn(h)  # (S, I)
        return down(h, offsets)  # (S, H)

    def _check(self, x, index, weights) -> tuple[int, int]:
        if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.dtype.is_floating_point:
            fail("top_k_index", "an integer tensor (tokens, top_k)", describe(index))
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != index.shape[0]:
            fail("hidden_states", f"a 2-D tensor ({index.shape[0]} tokens, hidden)", describe(x))
        if not isinstance(weights, torch.Tensor) or weights.shape != index.shape:
            fail("top_k_weights", f"a tensor of shape {tuple(index.shape)} (one weight per choice)", describe(weights))
        return index.shape

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{p.weight}={p.in_features}->{p.out_features}" for p in self.projections)
        recipe = self._grouped[0].recipe
        return (f"{self.hf_class.__name__}: {self.num_experts} experts, {shapes}, "
                f"recipe={recipe.name if recipe is not None else None}")


def _combine(y: torch.Tensor, order: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Each token's k outputs ``y`` (S, H) (pairs in ``order``) summed one after another in the order of
    their experts' indices, as the eager loop adds them expert by expert; by a gather."""
    tokens, k = top_k_index.shape
    rank = top_k_index.argsort(dim=-1, stable=True).argsort(dim=-1)  # (T, k): the place of each choice by expert index
    slot, token = order // tokens, order % tokens
    place = token * k + rank[token, slot]  # (S,) where each sorted pair goes in (T, k)
    y = combine(y, place, inverse_permutation(place)).view(tokens, k, -1)  # (T, k, H)
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out  # (T, H)


def _router(model: nn.Module, name: str, projections: tuple[Projection, Projection]) -> tuple[str, nn.Module] | None:
    """The router beside the experts named ``name``: a module of its own (not an ``nn.Linear``, which
    ``convert`` takes as a linear) holding one (E, H) weight, and a bias at most; by name."""
    parent_name, _, experts_leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    shape = (parent.get_submodule(experts_leaf).num_experts, projections[0].in_features)
    for leaf, m in parent.named_children():
        w = m._parameters.get("weight")
        if leaf == experts_leaf or isinstance(m, nn.Linear) or w is None or tuple(w.shape) != shape:
            continue
        if set(m._parameters) <= {"weight", "bias"} and not any(True for c in m.children() for _ in c.parameters()):
            return (f"{parent_name}.{leaf}" if parent_name else leaf), m
    return None


def _experts(model: nn.Module) -> list[tuple[str, nn.Module, tuple[Projection, Projection]]]:
    return [(n, m, p) for n, m in model.named_modules() if n and (p := hf_projections(m)) is not None]


def hf_moe_layers(model: nn.Module) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """What ``convert`` reports of the Hugging Face experts of ``model`` (converted or not), by row name:
    each projection's weight (the parameter itself, which outlives the module replaced) and each router."""
    out: list[tuple[str, nn.Module | nn.Parameter]] = []
    for name, m, projections in _experts(model):
        out += [(f"{name}.{p.weight}", m._parameters[p.weight]) for p in projections]
        if (router := _router(model, name, projections)) is not None:
            out.append(router)
    return out


class HFMoE(NamedTuple):
    """One Hugging Face MoE block as ``convert`` finds it: its experts (replaced) and its router."""

    name: str
    """The experts module's name (``model.layers.0.mlp.experts``)."""
    experts: HFGroupedExperts
    router: tuple[str, nn.Module] | None
    """The router's name and module, None where there is none beside the experts."""


def swap_hf_experts(model: nn.Module) -> list[HFMoE]:
    """Replace every Hugging Face experts module lowprec converts by an :class:`HFGroupedExperts` (in
    place; one already replaced stays); returns them all, with their routers."""
    out = []
    for name, m, projections in _experts(model):
        if not isinstance(m, HFGroupedExperts):
            parent_name, _, leaf = name.rpartition(".")
            m = HFGroupedExperts(m, projections)
            setattr(model.get_submodule(parent_name), leaf, m)
        out.append(HFMoE(name, m, _router(model, name, projections)))
    return out


def router_row(name: str, router: nn.Module, policy: Policy) -> LayerReport:
    """The report's row of a Hugging Face router: kept in high precision, by policy (``keep_routers``) or
    because it is not a linear ``convert`` can swap."""
    w = router._parameters["weight"]
    params = sum(p.numel() for p in router.parameters(recurse=False))
    if policy.keep_routers:
        return LayerReport(name, w.shape[1], w.shape[0], False, ROUTER_KEPT, params, Kept.POLICY)
    return LayerReport(name, w.shape[1], w.shape[0], False, ROUTER_NOT_CONVERTED, params, Kept.UNSUPPORTED)
