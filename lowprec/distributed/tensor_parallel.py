"""Tensor and sequence parallelism for Llama-style decoders, with lowprec's Linear inside.

[Note: tensor parallelism]
With ``W`` ranks in the tensor-parallel group, every decoder block's attention and feed-forward are split
as Megatron-LM splits them, and the residual stream between them is split along the sequence:

* **colwise** layers (attention's q, k and v, the feed-forward's gate and up) hold rows
  ``r*N/W .. (r+1)*N/W - 1`` of their weight (a ``DTensor``, ``Shard(0)``): each rank computes its slice
  of the outputs: its attention heads, its part of the hidden width;
* **rowwise** layers (attention's output projection, the feed-forward's down projection) hold the matching
  columns (``Shard(1)``): each rank's product is a partial sum over its part of K;
* **sequence parallelism**: between the regions each rank holds ``T/W`` positions of the residual stream,
  so the norms run on a slice. A region's input is all-gathered along the sequence before its colwise
  layers (backward: the partial input gradients are reduce-scattered); a region's output, the rowwise
  layer's partial sums, is reduce-scattered along the sequence (backward: all-gathered). The first block
  splits its input, the embedding's output, along the sequence; the final norm's input is gathered, so the
  LM head and the loss run on the whole sequence on every rank, as one process runs them (their weights
  and gradients are equal on every rank; the head's work is repeated W times, not split).

The norms inside the blocks see one slice of the positions, so their weight gradients are partial: a hook
sums them over the group as autograd makes them. The weights of the split layers are DTensors, so
``torch.distributed.checkpoint`` saves them at their global shapes, ``lowprec.ranks.local`` takes each
rank's part, and a gradient norm sums their squares over the ranks (``lowprec.ranks.replicas``). The
layers' ``in_features``/``out_features`` are the local widths, so their plans (MX and block tiles, the
small-layer rule) are made for the GEMMs each rank runs: a split must leave whole blocks of the recipe.

[Note: amaxes under tensor parallelism]
One process casts each GEMM operand whole. Under tensor parallelism a rank holds a part of some of them:
the split weights, a colwise layer's output gradient, a rowwise layer's input. Per-tensor current scales
(fp8-current) are agreed: every rank takes the max over the group of the parts' amaxes (one all-reduce of
one number per operand, ``lowprec.nn.casts.agreed_scale``), so a rank casts its part exactly as one process
casts the whole. A split weight is agreed once a step: backward casts weight.T again with the scale forward
agreed (the same format, one scale per tensor), not with a second all-reduce of the same amax. Blocks of
1x128, 128x128 and MX blocks of 32 lie inside a rank's part when the local widths are multiples of the block
(checked when the model is split), so their scales are one process's.
A row scale (fp8-rowwise) along a split K (a colwise layer's output gradient and ``weight.T`` in dgrad, a
rowwise layer's input and weight in fprop) is taken over each rank's part of the row: a finer scale than one
process's, not agreed. NVFP4's global scale is the part's. Delayed histories are made to agree over the
default group by ``lowprec.distributed.amax.sync_amaxes``, as under data parallelism.

[Note: the sequence gathered in FP8]
Where every colwise layer of a region casts their common input alike (q, k and v; gate and up: ``convert``
groups them to share one cast, ``lowprec.nn.casts.InputShare``), per tensor by current scaling (fp8-current),
the input is cast before it is gathered rather than after: each rank casts its positions with the scale agreed
over the group, the E4M3 codes are all-gathered (one byte per value instead of the activations' two or four),
and the gathered codes with the one scale are the layers' casts, handed to them through their share: the codes
one process makes casting the whole input, for a quarter or half of the bytes. The layers' input, for anything
that reads it in high precision, is the codes decoded (the values the GEMMs see). Compiled code consults no
share: it gathers the same codes and decodes them, and the layers cast the decoded values again, which gives
back the same codes: the decoded amax (448 times the scale, rounded to the activations' dtype) gives back the
agreed scale, and a code decoded to BF16 or FP32 and divided by its scale lies well within half a step of E4M3
from the code. The exception is a decoded value below the activations' normal range: FP16 activations, whose
subnormals start near 6e-5, are gathered in FP16 under compile; BF16 activations whose amax is below about
2e-35 can lose a small code there. Other recipes and evaluation gather the input in its own dtype and cast
after the gather.

Each rank runs the whole forward on the same tokens, so a run of ``W`` tensor-parallel ranks trains like
one process on the same batch, up to the order of the partial sums (a rowwise layer's sum over K is
two partial sums added) and, for row scales, the finer scales.

Not built: a vocabulary-parallel LM head, mixtures of experts, FP8 primary
weights, and FSDP2's FP8 all-gather of split weights (they are gathered in their dtype). Over tensor-parallel
groups :func:`split_tensor_parallel` makes the data-parallel mesh ``lowprec train`` wraps with DDP or FSDP2.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from lowprec import kernels as K
from lowprec._checks import describe, fail
from lowprec.distributed.launch import transformer_blocks
from lowprec.distributed.replica_grads import summed_over
from lowprec.distributed.replica_grads import waited as _wait
from lowprec.distributed.traffic import labelled
from lowprec.nn import Linear
from lowprec.nn.casts import InputShare, agreed_scale
from lowprec.nn.plan import OperandPlan
from lowprec.nn.recomputation import recomputing
from lowprec.ranks import is_dtensor

SEQ_DIM = 1
"""The sequence dimension of the residual stream, (batch, sequence, width)."""


@dataclass(frozen=True, slots=True)
class Family:
    """Where a family of models keeps its split layers: the names of a block's attention and feed-forward
    modules, and of the linears in each, colwise then rowwise."""

    attention: str
    attention_col: tuple[str, ...]
    attention_row: str
    ffn: str
    ffn_col: tuple[str, ...]
    ffn_row: str
    final_norm: str
    """The final norm's path from the model (its input is gathered along the sequence)."""


FAMILIES = (
    Family("attention", ("wq", "wk", "wv"), "wo", "feed_forward", ("w1", "w3"), "w2", "norm"),  # lowprec's
    Family("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj", "mlp", ("gate_proj", "up_proj"), "down_proj",
           "model.norm"),  # Hugging Face Llama, Mistral, Qwen2/3
)


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _wait(funcol.all_gather_single(x.contiguous(), SEQ_DIM, group))


def _part(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), SEQ_DIM)[dist.get_rank(group)].contiguous()


class _Resplit(torch.autograd.Function):
    """Between a tensor every rank holds whole and each rank's positions of it, with no sum either way:
    ``gather`` False takes this rank's part (backward gathers the parts), True gathers every rank's for work
    every rank repeats whole (backward takes this rank's part of a gradient that is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group, gather: bool):
        ctx.group, ctx.gather = group, gather
        return _gather(x, group) if gather else _part(x, group)

    @staticmethod
    def backward(ctx, g):
        return (_part(g, ctx.group) if ctx.gather else _gather(g, ctx.group)), None, None


@dataclass(frozen=True, slots=True)
class FP8Gather:
    """A region whose input is gathered as E4M3 codes (see [Note: the sequence gathered in FP8])."""

    op: OperandPlan
    """The colwise layers' input plan: per tensor, current scaling, one format on both sides."""
    share: InputShare
    """The layers' share, which takes the gathered casts."""
    group: dist.ProcessGroup


def _fp8_gather(cols: list[Linear], group: dist.ProcessGroup) -> FP8Gather | None:
    """The region's FP8 gather, where its colwise layers (split already) cast their input as one."""
    share = cols[0].state.share
    if share is None or any(lin.state.share is not share for lin in cols):
        return None
    plans = [lin.plan() for lin in cols]
    if any(p is None or p.hp_dtype is not None or p.hp_reason is not None for p in plans):
        return None  # a layer that reads its input in high precision
    op = plans[0].input
    route = op.both
    if any(p.input != op for p in plans) or route is None or not op.shareable or op.delayed:
        return None
    a, b = route.along_k, route.transposed
    if a is None or b is None or a.fmt is not b.fmt:
        return None
    if any(not s.granularity.per_tensor or s.hadamard_seed is not None for s in (a, b)):
        return None
    return FP8Gather(op, share, group)


def _gathered_codes(x: torch.Tensor, op: OperandPlan, group: dist.ProcessGroup):
    """Every rank's positions of ``x`` (B, T, D) as E4M3 codes with one agreed scale: the cast of the whole,
    (B * W * T, D), and ``x.dtype``'s view of its shape."""
    b, t, d = x.shape
    x2 = x.detach().reshape(-1, d)
    q = K.cast(x2, op.along_k, scale_k=agreed_scale(x2, op.along_k.along_k, group)).along_k
    with labelled("tp_sequence"):
        codes = _wait(funcol.all_gather_single(q.data.view(torch.uint8).view(b, t, d), SEQ_DIM, group))
    data = codes.view(q.data.dtype).reshape(-1, d)  # (B*T, D), each rank's positions in their place
    return type(q)(data, q.scale, q.fmt, q.granularity, data.shape, x.dtype), (b, -1, d)


class _GatherCodes(torch.autograd.Function):
    """Every rank's positions of ``x``, gathered as E4M3 codes with one agreed scale (see [Note: the sequence
    gathered in FP8]); the casts are put in ``out``. Backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, gather: FP8Gather, out: list):
        ctx.group = gather.group
        qx, shape = _gathered_codes(x, gather.op, gather.group)
        data = qx.data
        qx_t = type(qx)(data.t().contiguous(), qx.scale, qx.fmt, qx.granularity, data.t().shape, x.dtype)
        out.append((qx, qx_t))
        return qx.dequantize(x.dtype).view(shape)

    @staticmethod
    def backward(ctx, g):
        return _wait(funcol.reduce_scatter_single(g.contiguous(), "sum", SEQ_DIM, ctx.group)), None, None


class _GatherDecoded(torch.autograd.Function):
    """Compiled code's FP8 gather: the codes gathered as in eager code, decoded, and cast again by the layers
    (no share to hand them): the same codes, since decoding a code and casting it with the scale it was made
    with gives it back, and the decoded amax is the agreed one (see [Note: the sequence gathered in FP8])."""

    @staticmethod
    def forward(ctx, x, op: OperandPlan, group: dist.ProcessGroup):
        ctx.group = group
        qx, shape = _gathered_codes(x, op, group)
        return qx.dequantize(x.dtype).view(shape)

    @staticmethod
    def backward(ctx, g):
        return _wait(funcol.reduce_scatter_single(g.contiguous(), "sum", SEQ_DIM, ctx.group)), None, None


def _gather_region(x: torch.Tensor, group: dist.ProcessGroup, gather: FP8Gather | None) -> torch.Tensor:
    """A region's input, every rank's positions: in FP8 where ``gather`` says and the step trains (eager code
    hands the gathered casts to the layers, compiled code their decoded values), else in the input's dtype."""
    compiling = torch.compiler.is_compiling()
    # FP16 activations: a small code decoded could fall below FP16's subnormals, and cast again differ
    if gather is None or not torch.is_grad_enabled() or x.is_inference() or (compiling and x.dtype == torch.float16):
        with labelled("tp_sequence"):
            return funcol.all_gather_single_autograd(x.contiguous(), SEQ_DIM, group)
    if compiling:
        return _GatherDecoded.apply(x, gather.op, gather.group)
    out: list = []
    y = _GatherCodes.apply(x, gather, out)
    # the key each colwise layer's input_casts looks the share up by (training: the transposed cast too)
    gather.share.put(y, (y._version, y.shape, y.stride(), y.dtype, y.device, gather.op, True), out[0])
    return y


def _scatter_region(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A region's output, the rowwise layer's partial sums, summed and split along the sequence."""
    with labelled("tp_sequence"):
        return funcol.reduce_scatter_single_autograd(y.contiguous(), "sum", SEQ_DIM, group)


def _check_positions(x: torch.Tensor, size: int, where: str) -> None:
    if x.dim() != 3 or x.shape[SEQ_DIM] % size:
        fail(where, f"a (batch, sequence, width) tensor whose sequence divides into the {size} tensor-parallel "
             "ranks", describe(x))


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Callable]:
    """A module call's hidden states (its first argument, or ``hidden_states``) and how to put a new one back."""
    if args:
        return args[0], lambda y: ((y, *args[1:]), kwargs)
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], lambda y: (args, {**kwargs, "hidden_states": y})
    fail("hidden_states", "the block's input as its first argument or hidden_states=", f"{len(args)} arguments "
         f"and {sorted(kwargs)}")


def _input_hook(fn, size: int, where: str, once: bool = False):
    """A pre-hook putting ``fn`` of the module's hidden states in their place. ``once``: not in a recomputed
    forward: a checkpoint that calls the module itself again (Hugging Face's ``gradient_checkpointing``)
    passes the inputs the first call got after this hook, split already. lowprec's own recomputation runs
    the block's inner forward, past its hooks, and never meets this."""
    def hook(module, args, kwargs):
        if once and recomputing():
            return None
        x, put = _hidden(args, kwargs)
        _check_positions(x, size, where)
        return put(fn(x))
    return hook


def _output_hook(fn):
    def hook(module, args, kwargs, out):
        if isinstance(out, tuple):  # Hugging Face attention: (output, weights)
            return (fn(out[0]), *out[1:])
        return fn(out)
    return hook


def _check_split(lin: nn.Module, size: int, dim: int, name: str) -> None:
    """``lin`` can be split over ``size`` ranks along ``dim`` (0: colwise, 1: rowwise)."""
    if not isinstance(lin, Linear):
        fail(name, "a lowprec.nn.Linear (call lowprec.convert before tensor_parallel.parallelize; a layer kept in "
             "high precision is a Linear too)", describe(lin), TypeError)
    if lin._codes is not None:
        fail(name, "a Linear with a plain weight (FP8 primary weights are not split by tensor parallelism yet)",
             "an FP8 weight")
    side = "out_features" if dim == 0 else "in_features"
    features = getattr(lin, side)
    # each rank's part must hold whole blocks of the recipe's casts (see [Note: amaxes under tensor parallelism])
    multiple = size * (lin.recipe.required_multiple() if lin.recipe is not None else 1)
    if features % multiple:
        fail(name, f"{side} a multiple of {multiple} ({size} tensor-parallel ranks"
             + (f" x {lin.recipe.name}'s multiple of {multiple // size})" if multiple > size else ")"), features)
    if lin.bias is not None and dim == 1:
        fail(name, "bias=False for a rowwise layer (its bias would be added once per rank)", "a bias")


def _split_weight(lin: Linear, mesh, dim: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    size = mesh.size()
    w = lin.weight
    lin.weight = nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(dim)]), requires_grad=w.requires_grad)
    lin.weight._lowprec_tensor_parallel = True  # FSDP2 shards it further (lowprec.distributed.launch.wrap)
    if lin.bias is not None:
        b = lin.bias
        lin.bias = nn.Parameter(distribute_tensor(b.detach(), mesh, [Shard(0)]), requires_grad=b.requires_grad)
        lin.bias._lowprec_tensor_parallel = True
    if dim == 0:
        lin.out_features //= size
    else:
        lin.in_features //= size
    lin.state.group = mesh.get_group()
    if lin.recipe is not None:  # the plan for the local GEMM, whose shape decides tiles and blocks
        lin.set_recipe(lin.recipe, policy_reason=lin.policy_reason, min_features=lin.min_features,
                       share=lin.state.share, recast_input=lin.recast_input)


def _family(block: nn.Module) -> Family:
    for fam in FAMILIES:
        att, ffn = getattr(block, fam.attention, None), getattr(block, fam.ffn, None)
        if att is not None and ffn is not None and all(hasattr(att, n) for n in (*fam.attention_col,
                                                                                   fam.attention_row)):
            if not all(hasattr(ffn, n) for n in (*fam.ffn_col, fam.ffn_row)):
                fail("model", "dense feed-forwards (mixtures of experts are not split by tensor parallelism yet)",
                     type(ffn).__name__)
            return fam
    fail("model", "a Llama-style decoder (lowprec's reference model or a Hugging Face Llama, Mistral or Qwen): "
         "blocks with attention q/k/v/o and a SwiGLU feed-forward", type(block).__name__)


def _module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        fail("model", f"a final norm at {path!r}", "none there")


def _sum_grads(p: nn.Parameter, group: dist.ProcessGroup) -> None:
    p.register_hook(lambda g: _wait(funcol.all_reduce(g, "sum", group)))


@torch.no_grad()
def sum_partial_grads(model: nn.Module) -> int:
    """Under FSDP2 over tensor-parallel groups: sum the gradients of the parameters that see a slice of the
    positions (the norms inside the blocks) over their tensor-parallel group. ``fully_shard`` replaces those
    parameters by its own, so the hooks :func:`parallelize` put on them no longer run; their gradients are
    FSDP2's shards, equal in shape on every rank of a tensor-parallel group (one all-reduce each). Call after
    the last backward of a step, before the optimizer step; parameters that are not FSDP2's (their hooks ran)
    are left alone. Returns how many gradients it summed."""
    n = 0
    for m in model.modules():
        group = getattr(m, "_lowprec_partial_grads", None)
        if group is None:
            continue
        for p in m.parameters(recurse=False):
            if is_dtensor(p) and p.grad is not None:
                local = p.grad.to_local()
                local.copy_(_wait(funcol.all_reduce(local, "sum", group)))
                n += 1
    return n


_HEADS = ("n_heads", "n_kv_heads")
"""lowprec's attention counts its heads; Hugging Face's infers them from the width."""


def _check_heads(att: nn.Module, size: int, name: str) -> None:
    for attr in _HEADS:
        n = getattr(att, attr, None)
        if n is not None and n % size:
            fail(name, f"{attr} divisible by the {size} tensor-parallel ranks", n)


def _set_heads(att: nn.Module, size: int) -> None:
    for attr in _HEADS:
        if getattr(att, attr, None) is not None:
            setattr(att, attr, getattr(att, attr) // size)


@dataclass(frozen=True, slots=True)
class Split:
    """What :func:`parallelize` did."""

    linears: int
    """Linears split (colwise and rowwise)."""
    fp8_gathered: tuple[str, ...]
    """The regions whose input is gathered in FP8 (see [Note: the sequence gathered in FP8])."""


def split_tensor_parallel(model: nn.Module, tp: int, fsdp2: bool = False) -> tuple[Split, object | None]:
    """``lowprec train --tp``: the ranks as a (data-parallel, tensor-parallel) mesh of ``world / tp`` replicas of
    ``tp`` ranks (consecutive ranks in one tensor-parallel group), ``model`` split over its tensor-parallel
    group. Returns what was split and the data-parallel ``DeviceMesh`` (None for one replica), over which the
    caller wraps the model: DDP (its group), whose replicas' split weights are averaged here
    (:func:`average_over_replicas`), or with ``fsdp2`` FSDP2 (the mesh), which shards the split weights further
    and averages them itself (then call :func:`sum_partial_grads` after backward)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tp:
        fail("tp", f"a divisor of the number of ranks ({world})", tp)
    mesh = init_device_mesh(next(model.parameters()).device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    split = parallelize(model, mesh["tp"])
    if world == tp:
        return split, None
    if not fsdp2:
        average_over_replicas(model, mesh["dp"].get_group())
    return split, mesh["dp"]


def average_over_replicas(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Average the gradients of ``model``'s split weights (DTensors) over the data-parallel ``group`` as autograd
    makes them, the part DDP leaves alone (``lowprec.distributed.launch.wrap`` ignores DTensors); returns how
    many parameters it hooked."""
    mean = summed_over(group, dist.get_world_size(group))
    hooked = [p for p in model.parameters() if is_dtensor(p) and p.requires_grad]
    for p in hooked:
        p.register_hook(mean)
    return len(hooked)


def parallelize(model: nn.Module, mesh=None) -> Split:
    """Split ``model`` (converted by ``lowprec.convert``, on this rank's device) over the ranks of ``mesh``, a
    1-D ``DeviceMesh`` (None: the whole default group) as [Note: tensor parallelism] says; returns what it
    split. Every rank must call it with the same model, and then feed every rank the same tokens."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        fail("mesh", "an initialized process group (launch through torchrun)", "none")
    if mesh is None:
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        fail("mesh", "a 1-D torch.distributed.DeviceMesh", describe(mesh), TypeError)
    if any(is_dtensor(p) for p in model.parameters()):
        fail("model", "a model with no DTensor parameters yet (split before FSDP2 and without expert "
             "parallelism)", "DTensor parameters")
    size, group = mesh.size(), mesh.get_group()
    blocks = transformer_blocks(model)
    if not blocks:
        fail("model", "a decoder with its blocks in an nn.ModuleList", type(model).__name__)
    fam = _family(blocks[0])
    # every check before anything changes: a refused model is left as it was
    final_norm = _module(model, fam.final_norm)
    plan = []  # (block, region, [(linear, dim)])
    for i, block in enumerate(blocks):
        if _family(block) != fam:
            fail("model", f"blocks of one kind ({type(blocks[0]).__name__})", type(block).__name__)
        for region, col, row in ((fam.attention, fam.attention_col, fam.attention_row),
                                 (fam.ffn, fam.ffn_col, fam.ffn_row)):
            where, mod = f"blocks[{i}].{region}", getattr(block, region)
            lins = [(getattr(mod, n), 0, f"{where}.{n}") for n in col] + [(getattr(mod, row), 1, f"{where}.{row}")]
            for lin, dim, name in lins:
                _check_split(lin, size, dim, name)
            plan.append((mod, where, lins))
        _check_heads(getattr(block, fam.attention), size, f"blocks[{i}].{fam.attention}")
    gathers = {}
    for mod, where, lins in plan:
        for lin, dim, _ in lins:
            _split_weight(lin, mesh, dim)
        gather = gathers[where] = _fp8_gather([lin for lin, dim, _ in lins if dim == 0], group)
        mod.register_forward_pre_hook(
            _input_hook(lambda x, gather=gather: _gather_region(x, group, gather), size, where), with_kwargs=True)
        mod.register_forward_hook(_output_hook(lambda y: _scatter_region(y, group)), with_kwargs=True)
    for block in blocks:
        _set_heads(getattr(block, fam.attention), size)
        for m in block.modules():  # the norms: a slice of the positions each
            own = [p for p in m.parameters(recurse=False) if not is_dtensor(p) and p.requires_grad]
            for p in own:
                _sum_grads(p, group)
            if own:
                m._lowprec_partial_grads = group  # for sum_partial_grads, where FSDP2 replaces the parameters
    blocks[0].register_forward_pre_hook(
        _input_hook(lambda x: _Resplit.apply(x, group, False), size, "blocks[0]", once=True), with_kwargs=True)
    final_norm.register_forward_pre_hook(
        _input_hook(lambda x: _Resplit.apply(x, group, True), size, fam.final_norm), with_kwargs=True)
    return Split(sum(len(lins) for _, _, lins in plan), tuple(w for w, g in gathers.items() if g is not None))
