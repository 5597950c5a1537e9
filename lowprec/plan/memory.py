"""Memory per GPU of training a model with a recipe, under ZeRO and tensor/pipeline/expert parallelism.

[Note: the accounting]
Per parameter held by a GPU: the BF16 weight (2 B), the gradient (2 B in BF16 or 4 B in FP32), the
FP32 master weight (4 B) and the optimizer moments (8 B for AdamW, fewer with ``optim_states``): 16 B per
parameter for BF16 mixed precision with AdamW, as in the ZeRO paper (arXiv 1910.02054). ZeRO stage
1 shards master weights and moments over the data-parallel ranks, stage 2 also gradients, stage 3
also weights.

[Note: the weight casts]
What lowprec's Linear keeps of its weight's casts (see [Note: what backward keeps] in
``lowprec.nn.function``) depends on gradient accumulation. Without it (``grad_accum`` 1) a layer
casts its weight at every forward and drops the cast once the GEMM has run, and backward casts
weight.T again from the parameter and drops that after the data-gradient GEMM: at most one layer's
forward cast and one layer's transposed cast are alive at a time, a transient counted as the
largest of each, not per parameter. With ``grad_accum`` > 1 the step runs inside
``cached_weight_casts``, which keeps both casts of every layer from the first micro-batch to the
optimizer step. A stochastically rounded weight.T cast is not made again (a second draw would
differ): each forward saves its own for backward, one per micro-batch in flight, or under gradient
accumulation the one cached cast. A layer casts the weight it computes with, gathered under ZeRO-3,
so ZeRO shards none of these.

[Note: FP8 primary weights]
With ``fp8_weights`` (``lowprec.convert(..., fp8_weights=True)``) the quantized linears hold no BF16
weight: their weights are E4M3 codes with FP32 scales, per tensor where the recipe's weight casts are
per-tensor E4M3 (1 + 4/numel bytes per parameter), else in 128x128 blocks (1 + 4/16384). Where the
stored codes are the recipe's weight casts (fp8-current, fp8-delayed, fp8-blockwise) the GEMMs read
them and no cast is made, but backward copies one layer's codes transposed at a time; other recipes
decode and cast as without FP8 weights. Masters and gradients are as before (each weight keeps its
FP32 master in the optimizer), so the option saves 1 byte per quantized parameter.

Tensor parallelism (``tp``) splits every block linear and the vocabulary; norms and latent
down-projections stay whole. Pipeline parallelism (``pp``) gives each stage a balanced share of
the layers; stage 0 holds the embedding and the last stage the LM head. Expert parallelism
(``ep``) splits the routed experts, whose states ZeRO then shards over the remaining dp / ep ranks.

Activations: a 1F1B pipeline schedule keeps ``pp - stage`` micro-batches in flight on a stage
(so stage 0 holds as many layer-activations as one GPU without pipelining); with ``tp > 1``
sequence parallelism is assumed, so every activation is split ``tp`` ways. What a block saves
per token is :func:`lowprec.plan.activations.block_bytes`.

Overhead is a heuristic, not a measurement: a fixed allowance for the CUDA context, communication
buffers and GEMM workspaces, two gathered blocks under ZeRO-3 (the one computing and the one
prefetched), and a fraction of the rest for allocator fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import check_choice, check_positive_int, fail
from lowprec.nn.saved import SavedActivations
from lowprec.optim.states import StateFormat
from lowprec.plan.activations import RECOMPUTE, block_bytes, output_saved
from lowprec.plan.layers import BlockKind, block_linears, block_norm_params, blocks_in, check_parallel_fits
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import GRAD_BYTES, HP_BYTES, MASTER_BYTES, OPTIMIZERS, RecipeCost, Storage, saved_storage
from lowprec.plan.units import GB, count


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel:
    gpus: int
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism)."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel degree, within the data-parallel ranks."""
    zero: int = 0
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights."""

    def __post_init__(self) -> None:
        for name in ("gpus", "tp", "pp", "ep"):
            check_positive_int(name, getattr(self, name))
        check_choice("zero", self.zero, (0, 1, 2, 3))
        if self.gpus % (self.tp * self.pp):
            fail("gpus", f"a multiple of tp x pp = {self.tp * self.pp}", self.gpus)
        if self.dp % self.ep:
            fail("ep", f"a divisor of the data-parallel degree gpus / (tp x pp) = {self.dp}", self.ep)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True, kw_only=True, slots=True)
class Training:
    seq: int = 4096
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel rank. Above 1 every layer keeps both of
    its weight's casts for the step (``cached_weight_casts``, as ``lowprec train`` does); see
    [Note: the weight casts]. A pipeline runs at least ``pp`` micro-batches per step whatever this says."""
    recompute: str = "none"
    """``none``, ``selective`` or ``full`` activation recomputation."""
    optimizer: str = "adamw"
    optim_states: str = "fp32"
    """How AdamW stores its moments, as ``lowprec train --optim-states``: ``fp32``, ``bf16``, ``fp8`` or ``int8``
    (bytes per value from :class:`lowprec.optim.states.StateFormat`, per-group scales included)."""
    master_weights: bool = True
    """FP32 master weights; False: BF16 weights rounded stochastically instead (``--no-master-weights``)."""
    grad_dtype: str = "bf16"
    """Dtype gradients are kept and reduced in; ``fp32`` for FP32 accumulation."""
    fp8_weights: bool = False
    """Quantized linears' weights stored in FP8 with no BF16 copy (``convert(..., fp8_weights=True)``):
    see [Note: FP8 primary weights]."""
    overhead_gb: float = 2.0
    """Fixed allowance per GPU: CUDA context, communication buffers, GEMM workspaces."""
    fragmentation: float = 0.05
    """Allocator fragmentation, as a fraction of everything else."""
    saved_activations: SavedActivations | None = None
    """How norms and SwiGLU keep their inputs for backward (``Policy.saved_activations``): None in BF16,
    or FP8 (``lowprec.nn.fp8_activations("1x128")``)."""

    def __post_init__(self) -> None:
        check_positive_int("seq", self.seq)
        check_positive_int("micro_batch", self.micro_batch)
        check_positive_int("grad_accum", self.grad_accum)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("optim_states", self.optim_states, [f.value for f in StateFormat])
        if not isinstance(self.master_weights, bool):
            fail("master_weights", "a bool", repr(self.master_weights), TypeError)
        check_choice("grad_dtype", self.grad_dtype, GRAD_BYTES)
        if not self.overhead_gb >= 0:
            fail("overhead_gb", "a non-negative number of GB", self.overhead_gb)
        if not 0 <= self.fragmentation < 1:
            fail("fragmentation", "a fraction in [0, 1)", self.fragmentation)
        if self.saved_activations is not None and not isinstance(self.saved_activations, SavedActivations):
            fail("saved_activations", "None or a lowprec.nn.SavedActivations", repr(self.saved_activations), TypeError)

    @property
    def act(self) -> Storage:
        """How the norms' and SwiGLU's inputs are stored."""
        return saved_storage(self.saved_activations)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.seq * self.micro_batch


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    bytes: float
    formula: str


@dataclass(frozen=True, slots=True)
class StageMemory:
    stage: int
    layers: tuple[int, int]
    """``(dense, moe)`` blocks on this stage."""
    components: tuple[Component, ...]

    @property
    def total(self) -> float:
        return sum(c.bytes for c in self.components)


@dataclass(frozen=True, slots=True)
class _Params:
    """Parameters one GPU of a stage holds, before ZeRO sharding."""

    dense: float
    """All but the routed experts: ZeRO shards these over dp."""
    expert: float
    """Routed experts: ZeRO shards these over dp / ep."""
    quantized: float
    """Parameters of the linears whose weight the recipe casts."""
    lp: float
    """Bytes of every layer's forward weight cast (``fprop.rhs``)."""
    lp_t: float
    """Bytes of every layer's transposed weight cast (``dgrad.rhs``)."""
    lp_max: float
    """Bytes of the largest single weight's forward cast."""
    lp_t_max: float
    """Bytes of the largest single weight's transposed cast."""
    largest_block: float


def stage_layers(m: ModelSpec, pp: int, stage: int) -> tuple[int, int]:
    """``(dense, moe)`` blocks on ``stage`` of a balanced split; dense blocks come first."""
    lo, hi = stage * m.n_layers // pp, (stage + 1) * m.n_layers // pp
    dense = max(0, min(hi, m.n_dense_layers) - lo)
    return dense, hi - lo - dense


def _casts(lin, recipe: RecipeCost, n: float) -> tuple[float, float]:
    """Bytes of the forward and transposed casts of ``n`` elements of ``lin``'s weight."""
    if not lin.quantized:
        return 0.0, 0.0
    lp = n * recipe.weight.bytes_per_element(lin.d_in, n) if recipe.weight else 0.0
    lp_t = n * recipe.weight_t.bytes_per_element(lin.d_out, n) if recipe.weight_t else 0.0
    return lp, lp_t


def _block_params(m: ModelSpec, kind: BlockKind, recipe: RecipeCost, tp: int, ep: int) -> _Params:
    dense = expert = quant = lp = lp_t = lp_max = lp_t_max = 0.0
    for lin in block_linears(m, *kind):
        one = lin.d_in * lin.d_out / lin.shards(tp)  # one weight (one expert): what one Linear casts
        n = one * lin.copies / (ep if lin.expert else 1)
        fwd, t = _casts(lin, recipe, n)
        one_fwd, one_t = _casts(lin, recipe, one)
        quant += n if fwd or t else 0.0
        lp, lp_t, lp_max, lp_t_max = lp + fwd, lp_t + t, max(lp_max, one_fwd), max(lp_t_max, one_t)
        if lin.expert:
            expert += n
        else:
            dense += n
    dense += block_norm_params(m)
    return _Params(dense, expert, quant, lp, lp_t, lp_max, lp_t_max, dense + expert)


def stage_blocks(m: ModelSpec, recipe: RecipeCost, pp: int, stage: int) -> dict[BlockKind, int]:
    """The blocks of each kind on ``stage``: the last ones the recipe keeps in BF16 sit on the last stages."""
    lo, hi = stage * m.n_layers // pp, (stage + 1) * m.n_layers // pp
    return blocks_in(m, lo, hi, recipe.hp_blocks(m.n_layers), recipe.min_features)


def _stage_params(m: ModelSpec, recipe: RecipeCost, par: Parallel, stage: int) -> _Params:
    blocks = [(_block_params(m, kind, recipe, par.tp, par.ep), n)
              for kind, n in stage_blocks(m, recipe, par.pp, stage).items()]
    table = m.vocab * m.d_model / par.tp  # vocabulary-parallel embedding and LM head
    extra = table if stage == 0 else 0.0
    if stage == par.pp - 1:  # a tied head shares the embedding only when both sit on one stage
        extra += m.d_model + (table if not m.tied_embeddings or par.pp > 1 else 0.0)
    total = lambda f: sum(getattr(p, f) * n for p, n in blocks)  # noqa: E731
    largest = lambda f: max((getattr(p, f) for p, n in blocks if n), default=0.0)  # noqa: E731
    return _Params(total("dense") + extra, total("expert"), total("quantized"), total("lp"), total("lp_t"),
                   largest("lp_max"), largest("lp_t_max"), largest("largest_block"))


def _sharded(name: str, per_param: float, p: _Params, par: Parallel, sharded: bool) -> Component:
    div, div_e = (par.dp, par.dp // par.ep) if sharded else (1, 1)
    nbytes = per_param * (p.dense / div + p.expert / div_e)
    formula = f"{per_param:g} B x {count(p.dense)} params" + (f" / dp {div}" if div > 1 else "")
    if p.expert:
        formula += f" + {per_param:g} B x {count(p.expert)} expert params" + (f" / {div_e}" if div_e > 1 else "")
    return Component(name, nbytes, formula)


def _weight_casts(p: _Params, recipe: RecipeCost, par: Parallel, train: Training, stage: int) -> list[Component]:
    """What lowprec's Linear keeps of its weight's casts; see [Note: the weight casts]."""
    if recipe.weight is None and recipe.weight_t is None:
        return [Component("low-precision weight copy", 0.0, "none: the GEMMs read the BF16 weights")]

    def per_param(nbytes: float) -> str:
        return f"{nbytes / p.quantized if p.quantized else 0.0:.4g} B x {count(p.quantized)} params"

    fwd_name, t_name = f"low-precision weight copy ({recipe.name})", f"transposed weight copy ({recipe.name})"
    if train.grad_accum > 1:
        held = f", every layer's, held for the step of {train.grad_accum} micro-batches" + (
            " (cast from the gathered weights: ZeRO-3 does not shard them)" if par.zero >= 3 else "")
        return [Component(name, nbytes, per_param(nbytes) + held)
                for name, nbytes, cast in ((fwd_name, p.lp, recipe.weight), (t_name, p.lp_t, recipe.weight_t)) if cast]
    out, transient, parts = [], 0.0, []
    if recipe.weight:
        transient += p.lp_max
        parts.append(f"the largest forward cast ({count(p.lp_max)} B)")
    if recipe.weight_t_saved:
        in_flight = par.pp - stage
        out.append(Component(t_name, p.lp_t * in_flight, per_param(p.lp_t) + f" x {in_flight} micro-batch(es) "
                             "in flight: stochastically rounded, so saved for backward"))
    elif recipe.weight_t:
        transient += p.lp_t_max
        parts.append(f"the largest transposed cast ({count(p.lp_t_max)} B)")
    if parts:
        name = f"weight casts ({recipe.name}), one layer at a time"
        out.insert(0, Component(name, transient, " + ".join(parts) + ", each dropped after its GEMM"))
    return out


def _fp8_weights(p: _Params, recipe: RecipeCost, par: Parallel) -> list[Component]:
    """[Note: FP8 primary weights]: the quantized linears' weights as stored codes and scales."""
    div = par.dp if par.zero >= 3 else 1  # experts' codes counted as sharded over dp alike
    stored = p.lp if recipe.fp8_weight_direct else p.quantized * recipe.fp8_weight.bytes_per_element(1, p.quantized)
    hp = _sharded("weights (bf16)", HP_BYTES, p, par, par.zero >= 3)
    rest = count(p.dense + p.expert - p.quantized)
    hp = Component(hp.name, hp.bytes - HP_BYTES * p.quantized / div,
                   f"{HP_BYTES} B x {rest} params not stored in FP8" + (f" / dp {div}" if div > 1 else ""))
    how = "read by the GEMMs as stored" if recipe.fp8_weight_direct else "decoded and cast at each forward"
    fp8 = Component("weights (fp8)", stored / div, f"{stored / p.quantized if p.quantized else 0:.4g} B x "
                    f"{count(p.quantized)} params" + (f" / dp {div}" if div > 1 else "") + f", {how}")
    out = [hp, fp8]
    if recipe.fp8_weight_direct:  # backward transposes one layer's codes at a time
        out.append(Component(f"weight casts ({recipe.name}), one layer at a time", p.lp_t_max,
                             f"the largest transposed copy of the codes ({count(p.lp_t_max)} B), dropped after dgrad"))
    return out


def _states(p: _Params, recipe: RecipeCost, par: Parallel, train: Training, stage: int) -> list[Component]:
    if train.fp8_weights and recipe.fp8_weight is not None:
        out = _fp8_weights(p, recipe, par)
        out += [] if recipe.fp8_weight_direct else _weight_casts(p, recipe, par, train, stage)
    else:
        out = [_sharded("weights (bf16)", HP_BYTES, p, par, par.zero >= 3)]
        out += _weight_casts(p, recipe, par, train, stage)
    grad = GRAD_BYTES[train.grad_dtype]
    out.append(_sharded(f"gradients ({train.grad_dtype})", grad, p, par, par.zero >= 2))
    if train.master_weights:
        out.append(_sharded("master weights (fp32)", MASTER_BYTES, p, par, par.zero >= 1))
    opt = OPTIMIZERS[train.optimizer]
    if train.optim_states == "fp32":
        out.append(_sharded(f"optimizer moments ({opt.name})", opt.moment_bytes, p, par, par.zero >= 1))
    else:  # what lowprec.optim.AdamWLP stores: two moments, codes and per-group scales
        per_param = 2 * StateFormat(train.optim_states).bytes_per_value
        out.append(_sharded(f"optimizer moments ({opt.name}, {train.optim_states})", per_param, p, par, par.zero >= 1))
    return out


def _activations(m: ModelSpec, recipe: RecipeCost, par: Parallel, train: Training, stage: int) -> list[Component]:
    counts = stage_blocks(m, recipe, par.pp, stage)
    in_flight = par.pp - stage  # 1F1B: stage s holds pp - s micro-batches
    scale = train.tokens * in_flight / par.tp
    groups: dict[str, float] = {}
    for kind, n in counts.items():
        for group, per_token in block_bytes(m, kind.moe, recipe, train.recompute, train.act, *kind[1:]).items():
            groups[group] = groups.get(group, 0.0) + per_token * n
    where = f"{in_flight} micro-batch(es) x {train.tokens} tokens" + (f" / tp {par.tp}" if par.tp > 1 else "")
    n = sum(counts.values())
    out = [Component(f"activations: {g}", b * scale, f"{count(b)} B/token summed over {n} layers x {where}")
           for g, b in groups.items() if b]
    if train.recompute == "full" and sum(counts.values()):
        worst = max(sum(block_bytes(m, kind.moe, recipe, "none", train.act, *kind[1:]).values())
                    for kind in counts)
        out.append(Component("activations: recomputed block", worst * train.tokens / par.tp,
                             f"{count(worst)} B/token, one block rebuilt at a time"))
    if stage == par.pp - 1:
        per_token = sum(s.bytes(recipe, train.act) for s in output_saved(m))
        out.append(Component("activations: output", per_token * train.tokens / par.tp,
                             f"{count(per_token)} B/token (final norm, LM head input, FP32 logits)"))
    return out


def stage_memory(m: ModelSpec, recipe: RecipeCost, par: Parallel, train: Training, stage: int) -> StageMemory:
    p = _stage_params(m, recipe, par, stage)
    parts = _states(p, recipe, par, train, stage) + _activations(m, recipe, par, train, stage)
    rest = sum(c.bytes for c in parts)
    gather = 2 * p.largest_block * HP_BYTES if par.zero == 3 else 0.0
    overhead = train.overhead_gb * GB + gather + train.fragmentation * rest
    formula = f"{train.overhead_gb:g} GB fixed + {train.fragmentation:g} x the rest" + (
        f" + 2 gathered blocks x {count(p.largest_block)} params x 2 B" if gather else "")
    parts.append(Component("overhead", overhead, formula))
    return StageMemory(stage, stage_layers(m, par.pp, stage), tuple(parts))


def check_layout(m: ModelSpec, par: Parallel) -> None:
    check_parallel_fits(m, par.tp, par.ep)
    if par.pp > m.n_layers:
        fail("pp", f"at most the {m.n_layers} layers of {m.name}", par.pp)


def memory_per_gpu(m: ModelSpec, recipe: RecipeCost, par: Parallel, train: Training) -> StageMemory:
    """Memory of the fullest pipeline stage."""
    check_layout(m, par)
    return max((stage_memory(m, recipe, par, train, s) for s in range(par.pp)), key=lambda s: s.total)


def fewest_gpus(m: ModelSpec, recipe: RecipeCost, capacity_gb: float, train: Training, *, tp: int = 1,
                pp: int = 1, ep: int = 1, zero: int = 0, max_dp: int = 1 << 20) -> int | None:
    """The fewest GPUs (tp x pp x dp, dp a multiple of ep) whose fullest stage fits, or None."""
    def fits(k: int) -> bool:
        par = Parallel(gpus=tp * pp * ep * k, tp=tp, pp=pp, ep=ep, zero=zero)
        return memory_per_gpu(m, recipe, par, train).total <= capacity_gb * GB

    hi = max(1, max_dp // ep)
    if not fits(hi):
        return None
    lo = 1  # memory never grows with dp, so the smallest fitting dp is found by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return tp * pp * ep * lo


def updated_params(m: ModelSpec, recipe: RecipeCost, par: Parallel, stage: int) -> float:
    """Parameters whose optimizer update one GPU of ``stage`` runs: its shard under ZeRO 1 and above."""
    p = _stage_params(m, recipe, par, stage)
    div, div_e = (par.dp, par.dp // par.ep) if par.zero >= 1 else (1, 1)
    return p.dense / div + p.expert / div_e
