"""``lowprec.nn.GroupedLinear`` against a loop of ``lowprec.nn.Linear``s, one per expert, bit for bit.

Each expert of a grouped layer must compute exactly what a Linear with its weight and the same recipe
computes on its rows: the same casts (per expert scales, wgrad over the expert's tokens) and the same
GEMMs, so the outputs and every gradient are equal, not close, on any CPU. The one recipe that draws
random bits (nvfp4: stochastic rounding of grad_output, in backward only) draws them from the global
generator; both sides are seeded alike and cast the experts in the same order (0 to E-1), so it is
compared bit for bit too.
"""
from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec import recipes as R
from lowprec.nn import GroupedLinear, Linear
from lowprec.nn.grouped import route
from tests.nn.common import bits, randn

E, IN, OUT = 4, 128, 256
COUNTS = (5, 0, 40, 19)
"""Unbalanced experts, one without tokens, counts not multiples of any block."""
DELAYED = tuple(n for n in R.names() if R.get(n).uses_delayed_scaling)


def offsets_of(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def make(recipe, counts=COUNTS, bias=True, dtype=torch.float32):
    """A grouped layer with random weights, a Linear per expert holding copies of them, and the input and
    output gradient for ``counts``."""
    g = GroupedLinear(len(counts), IN, OUT, bias=bias, recipe=recipe, dtype=dtype)
    with torch.no_grad():
        g.weight.copy_(randn(len(counts), OUT, IN, seed=1, scale=IN**-0.5))
        if bias:
            g.bias.copy_(randn(len(counts), OUT, seed=2, scale=0.1))
    lins = []
    for e in range(len(counts)):
        lin = Linear(IN, OUT, bias=bias, recipe=recipe, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(g.weight[e])
            if bias:
                lin.bias.copy_(g.bias[e])
        lins.append(lin)
    t = sum(counts)
    return g, lins, randn(t, IN, seed=3, dtype=dtype), randn(t, OUT, seed=4, scale=0.01, dtype=dtype)


def grouped_step(g, x, dy, counts):
    x = x.clone().requires_grad_()
    torch.manual_seed(7)
    y = g(x, offsets_of(counts))
    y.backward(dy)
    return y, x.grad, g.weight.grad, g.bias.grad if g.bias is not None else None


def loop_step(lins, x, dy, counts):
    """Each expert's forward and backward on its rows, expert 0 first (the order the grouped backward
    casts them in, which matters where rounding is stochastic)."""
    torch.manual_seed(7)
    ys, dxs, dws, dbs = [], [], [], []
    for lin, x_e, dy_e in zip(lins, x.split(counts), dy.split(counts)):
        x_e = x_e.clone().requires_grad_()
        y_e = lin(x_e)
        y_e.backward(dy_e)
        ys.append(y_e)
        dxs.append(x_e.grad)
        dws.append(lin.weight.grad if lin.weight.grad is not None else torch.zeros_like(lin.weight))
        if lin.bias is not None:
            dbs.append(lin.bias.grad if lin.bias.grad is not None else torch.zeros_like(lin.bias))
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws), torch.stack(dbs) if dbs else None


def assert_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what} differs; max |diff| {(got - want).abs().max()}"


def assert_like_loop(recipe, counts=COUNTS, bias=True, dtype=torch.float32):
    g, lins, x, dy = make(recipe, counts, bias, dtype)
    got, want = grouped_step(g, x, dy, counts), loop_step(lins, x, dy, counts)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
        if b is None:
            assert a is None, name
        else:
            assert_bits(a, b, name)
    return got


@pytest.mark.parametrize("recipe", [None, *R.names()])
def test_equals_a_loop_of_linears(recipe):
    _, _, dw, db = assert_like_loop(recipe)
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(db[1]) == 0  # the expert without tokens
    assert torch.count_nonzero(dw[0]) > 0


@pytest.mark.parametrize("recipe", [n for n in R.names() if R.get(n).hp_dtype is None])
def test_every_low_precision_recipe_batches_its_experts(recipe, monkeypatch):
    """No recipe's experts loop outside a sampled telemetry step: their casts are made for all experts at once
    (NVFP4's too: each expert's global scale its own, its stochastic rounding drawing what a loop would draw,
    its Hadamard transform block by block), equal to the loop of Linears bit for bit."""
    from lowprec.nn import grouped
    from lowprec.nn import grouped_casts as GC

    def loop(*args):
        raise AssertionError("the experts looped")

    monkeypatch.setattr(grouped.GroupedFunction, "apply", loop)
    monkeypatch.setattr(grouped.GroupedLinear, "_delayed", loop)
    g = make(recipe)[0]
    assert GC.batched_kind(g.plan()) is not None
    assert_like_loop(recipe)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-blockwise", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("counts", [(64, 0, 0, 0), (0, 0, 0, 1), (1, 2, 3, 130), (3, 3)])
def test_groups_of_any_size(recipe, counts):
    assert_like_loop(recipe, counts, bias=False)


@pytest.mark.parametrize("recipe", ["fp16", "fp8-current", "mxfp8", "nvfp4"])
def test_bfloat16_layer(recipe):
    y = assert_like_loop(recipe, dtype=torch.bfloat16)[0]
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", [None, "bf16", "fp8-current", "mxfp8"])
def test_under_torch_autocast(recipe):
    """Outputs in the autocast dtype, gradients in the parameters' and input's, as Linear's."""
    g, lins, x, dy = make(recipe)
    with torch.autocast("cpu", torch.bfloat16):
        got, want = grouped_step(g, x, dy.bfloat16(), COUNTS), loop_step(lins, x, dy.bfloat16(), COUNTS)
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
        assert_bits(a, b, name)


@pytest.mark.parametrize("recipe", [None, *(n for n in R.names() if n not in DELAYED)])
def test_inference_equals_a_loop_of_linears(recipe):
    g, lins, x, _ = make(recipe)
    g.eval()
    with torch.no_grad():
        got = g(x, offsets_of(COUNTS))
        want = torch.cat([lin.eval()(x_e) for lin, x_e in zip(lins, x.split(COUNTS))])
    assert_bits(got, want, "y")


def test_no_tokens_at_all():
    g, _, _, _ = make("fp8-current", (0, 0, 0, 0))
    x = torch.zeros(0, IN, requires_grad=True)
    y = g(x, offsets_of((0, 0, 0, 0)))
    y.sum().backward()
    assert y.shape == (0, OUT) and torch.count_nonzero(g.weight.grad) == 0


@pytest.mark.parametrize("frozen", ["input", "weight"])
def test_frozen_input_or_weight(frozen):
    """Backward runs only the GEMMs whose gradients are asked for, and casts (and draws) as Linear's does."""
    g, lins, x, dy = make("nvfp4")
    if frozen == "weight":
        for w in (g.weight, *(lin.weight for lin in lins)):
            w.requires_grad_(False)
    torch.manual_seed(7)
    xg = x.clone().requires_grad_(frozen != "input")
    g(xg, offsets_of(COUNTS)).backward(dy)
    torch.manual_seed(7)
    dxs = []
    for lin, x_e, dy_e in zip(lins, x.split(COUNTS), dy.split(COUNTS)):
        x_e = x_e.clone().requires_grad_(frozen != "input")
        lin(x_e).backward(dy_e)
        dxs.append(x_e.grad)
    assert_bits(g.bias.grad, torch.stack([lin.bias.grad for lin in lins]), "dbias")
    if frozen == "weight":
        assert g.weight.grad is None
        assert_bits(xg.grad, torch.cat(dxs), "dx")
    else:
        assert xg.grad is None
        assert_bits(g.weight.grad, torch.stack([lin.weight.grad for lin in lins]), "dweight")


def test_shape_the_recipe_cannot_take_runs_in_high_precision():
    g = GroupedLinear(2, 40, 24, recipe="fp8-current")
    x = randn(6, 40, seed=5)
    with pytest.warns(UserWarning, match="GroupedLinear.*runs in high precision: in_features=40"):
        y = g(x, offsets_of((2, 4)))
    want = torch.cat([x_e @ w.t() for x_e, w in zip(x.split((2, 4)), g.weight)])
    assert_bits(y, want, "y")


def test_autocast_to_delayed_scaling_gives_each_expert_a_history():
    g, _, x, dy = make("fp8-current")
    with lowprec.autocast("fp8-delayed"):
        grouped_step(g, x, dy, COUNTS)
    assert [s.recorded for _, s in g.delayed_states()] == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize("x, offsets, exc, message", [
    (torch.ones(6, IN, dtype=torch.int32), [2, 2, 2, 6], TypeError, "x: expected a float32"),
    (torch.ones(6, IN, dtype=torch.float8_e4m3fn), [2, 2, 2, 6], TypeError, "x: expected a float32"),
    (torch.ones(2, 3, IN), [2, 2, 2, 6], ValueError, r"x: expected a 2-D tensor \(tokens, in_features=128\)"),
    (torch.ones(6, IN + 1), [2, 2, 2, 6], ValueError, "x: expected a 2-D tensor"),
    (torch.ones(6, IN), torch.tensor([2.0, 2, 2, 6]), TypeError, "offsets: expected an integer tensor"),
    (torch.ones(6, IN), [2, 2, 6], ValueError, r"offsets: expected shape \(4,\) \(one per expert\)"),
    (torch.ones(6, IN), [2, 1, 2, 6], ValueError, r"offsets: expected non-decreasing .*, got \[2, 1, 2, 6\]"),
    (torch.ones(6, IN), [-1, 2, 2, 6], ValueError, "offsets: expected non-decreasing"),
    (torch.ones(6, IN), [2, 2, 2, 5], ValueError, r"offsets: expected a last value equal to .* \(6\), got 5"),
])
def test_bad_input_is_refused(x, offsets, exc, message):
    g = GroupedLinear(E, IN, OUT, recipe="fp8-current")
    offsets = torch.tensor(offsets) if isinstance(offsets, list) else offsets
    with pytest.raises(exc, match="^" + message):
        g(x, offsets)


@pytest.mark.parametrize("recipe", [None, "fp8-current", "fp8-blockwise"])
def test_a_routing_read_once_serves_like_the_offsets(recipe):
    """``route`` reads the offsets on the host once; a layer given it computes what the offsets give."""
    g, _, x, dy = make(recipe)
    want = grouped_step(g, x, dy, COUNTS)
    g.weight.grad = g.bias.grad = None
    xr = x.clone().requires_grad_()
    y = g(xr, route(xr, offsets_of(COUNTS)))
    y.backward(dy)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), (y, xr.grad, g.weight.grad, g.bias.grad), want):
        assert_bits(a, b, name)


def test_a_routing_of_other_rows_or_experts_is_refused():
    g = GroupedLinear(E, IN, OUT, recipe="fp8-current")
    x = torch.ones(6, IN)
    with pytest.raises(ValueError, match=r"^offsets: expected groups of the 6 rows of x, got 5 rows$"):
        g(x, route(torch.ones(5, IN), torch.tensor([2, 2, 2, 5])))
    with pytest.raises(ValueError, match=r"^offsets: expected groups of 4 experts \(one per expert\), got 3$"):
        g(x, route(x, torch.tensor([2, 2, 6])))
    with pytest.raises(ValueError, match=r"^offsets: expected a 1-D tensor \(one per expert\)"):
        route(x, torch.tensor(6))


@pytest.mark.parametrize("kw, message", [
    ({"num_experts": 0}, "num_experts: expected a positive int, got 0"),
    ({"in_features": 2.0}, "in_features: expected a positive int"),
    ({"recipe": "fp9"}, "recipe: expected one of"),
])
def test_bad_arguments_are_refused(kw, message):
    args = {"num_experts": E, "in_features": IN, "out_features": OUT, **kw}
    with pytest.raises((ValueError, TypeError), match="^" + message):
        GroupedLinear(**args)


def test_trains_in_fp8_current():
    """A few SGD steps on a regression onto another set of experts lower the loss."""
    counts = (30, 10, 0, 24)
    g = GroupedLinear(4, IN, 64, bias=True, recipe="fp8-current")
    teacher = randn(4, 64, IN, seed=11, scale=IN**-0.5)
    x = randn(sum(counts), IN, seed=12)
    target = torch.cat([x_e @ w.t() for x_e, w in zip(x.split(counts), teacher)])
    opt = torch.optim.SGD(g.parameters(), lr=4.0)
    losses = []
    for _ in range(10):
        loss = (g(x, offsets_of(counts)) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("recipe", DELAYED)
def test_delayed_experts_keep_a_history_each_and_equal_a_loop_of_linears_step_after_step(recipe):
    """Each expert scales by its own amax history, as a Linear of its weight does: over steps whose inputs
    grow (so the delayed scales lag), the outputs and gradients stay equal bit for bit; the expert without
    tokens records nothing."""
    g, lins, x, dy = make(recipe)
    for step in range(4):
        xs, dys = x * (1.5 ** step), dy * (2.0 ** step)
        for p in (*g.parameters(), *(p for lin in lins for p in lin.parameters())):
            p.grad = None
        got, want = grouped_step(g, xs, dys, COUNTS), loop_step(lins, xs, dys, COUNTS)
        for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
            assert_bits(a, b, f"step {step} {name}")
    states = dict(g.delayed_states())
    assert sorted(states) == list(range(E))
    for e, lin in enumerate(lins):
        assert states[e].recorded == lin.delayed_state.recorded
        assert torch.equal(states[e].history, lin.delayed_state.history)
    assert states[1].recorded == [0, 0, 0] and states[0].recorded == [4, 4, 4]


def test_a_recipe_delayed_on_some_sides_only_loops_and_equals_a_loop_of_linears():
    """Delayed forward casts with current gradient ones (an operand scaled by delay on one side and by its
    amax on the other): not batched (``batched_kind`` None), each expert through a Linear's autograd function,
    equal to a loop of Linears bit for bit over steps; the batched path takes the all-delayed recipe."""
    import dataclasses

    from lowprec.nn import grouped_casts as GC

    mixed = dataclasses.replace(R.get("fp8-delayed"), name="delayed-forward", wgrad=R.get("fp8-current").wgrad)
    g, lins, x, dy = make(mixed)
    assert GC.batched_kind(g.plan()) is None and GC.batched_kind(make("fp8-delayed")[0].plan()) is GC.TENSOR
    for step in range(3):
        for p in (*g.parameters(), *(p for lin in lins for p in lin.parameters())):
            p.grad = None
        got, want = grouped_step(g, x * 2.0 ** step, dy, COUNTS), loop_step(lins, x * 2.0 ** step, dy, COUNTS)
        for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
            assert_bits(a, b, f"step {step} {name}")


def test_delayed_experts_batched_record_non_finite_and_outlier_amaxes_as_a_loop_of_linears():
    """The experts' casts batched under delayed scaling (one cast of all rows, each expert scaled by its own
    history): a step with an infinite input in one expert's rows and a step with an outlier in another's leave
    every history and outlier count as a loop of delayed Linears leaves them, and the steps after stay equal
    bit for bit."""
    g, lins, x, dy = make("fp8-delayed")
    bad_inf, bad_big = x.clone(), x.clone()
    bad_inf[COUNTS[0] + 3, 7] = float("inf")  # expert 2's rows
    bad_big[sum(COUNTS) - 1, 0] = 1e6  # expert 3's rows: an outlier of more than 2^8 times its history
    for step, xs in enumerate((x, bad_inf, x, bad_big, x)):
        for p in (*g.parameters(), *(p for lin in lins for p in lin.parameters())):
            p.grad = None
        got, want = grouped_step(g, xs, dy, COUNTS), loop_step(lins, xs, dy, COUNTS)
        if step in (0, 2, 4):
            for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
                assert_bits(a, b, f"step {step} {name}")
    for e, s in g.delayed_states():
        lin = lins[e].delayed_state
        assert s.recorded == lin.recorded and s.outliers.tolist() == lin.outliers.tolist(), e
        assert torch.equal(s.history, lin.history), e
    assert dict(g.delayed_states())[3].outliers.tolist()[0] == 1


@pytest.mark.parametrize("recipe", DELAYED)
def test_a_high_precision_start_records_each_experts_amaxes_as_a_linear_of_its_weight(recipe):
    """Inside ``autocast("bf16", record_amax=True)`` (the trainer's ``--hp-start-steps``) experts bound to a
    delayed recipe compute in BF16, unchanged by recording, and each expert with tokens records into its own
    history what a Linear of its weight records in the same region (input and weight in forward, the output
    gradient in backward); the expert without tokens records nothing. The first delayed step after the region
    then scales every expert from its history, equal to the Linears' bit for bit."""
    g, lins, x, dy = make(recipe)
    with lowprec.autocast("bf16", record_amax=False):
        plain = grouped_step(g, x, dy, COUNTS)
    for p in g.parameters():
        p.grad = None
    assert all(s.recorded == [0, 0, 0] for _, s in g.delayed_states())
    with lowprec.autocast("bf16", record_amax=True):
        got, want = grouped_step(g, x, dy, COUNTS), loop_step(lins, x, dy, COUNTS)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, plain):
        assert_bits(a, b, f"recorded {name}")  # recording changes no value
    states = dict(g.delayed_states())
    for e, lin in enumerate(lins):
        assert states[e].recorded == lin.delayed_state.recorded == ([0, 0, 0] if COUNTS[e] == 0 else [1, 1, 1])
        assert torch.equal(states[e].history, lin.delayed_state.history), e
    for p in (*g.parameters(), *(p for lin in lins for p in lin.parameters())):
        p.grad = None
    got, want = grouped_step(g, x * 3, dy, COUNTS), loop_step(lins, x * 3, dy, COUNTS)  # delayed: scales lag
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
        assert_bits(a, b, f"first delayed step {name}")


def test_delayed_experts_record_nothing_in_a_high_precision_evaluation():
    g, _, x, _ = make(DELAYED[0])
    g.eval()
    with lowprec.autocast("bf16", record_amax=True):
        g(x, torch.tensor(COUNTS).cumsum(0))
    assert all(s.recorded == [0, 0, 0] for _, s in g.delayed_states())


def test_delayed_experts_histories_travel_in_the_state_dict():
    """Saved as one (E, rows, roles) tensor; loaded into a fresh layer, every expert's history is back and
    the next step equals the saved layer's; a layer of other experts is refused, naming the state; a layer
    under a current recipe ignores it."""
    g, _, x, dy = make("fp8-delayed")
    grouped_step(g, x, dy, COUNTS)
    sd = g.state_dict()
    assert sd["_extra_state"].shape[0] == E
    fresh = GroupedLinear(E, IN, OUT, bias=True, recipe="fp8-delayed")
    fresh.load_state_dict(sd)
    for (e, a), (_, b) in zip(g.delayed_states(), fresh.delayed_states(), strict=True):
        assert torch.equal(a.history, b.history) and a.recorded == b.recorded, e
    g.weight.grad = g.bias.grad = None
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), grouped_step(fresh, x, dy, COUNTS),
                          grouped_step(g, x, dy, COUNTS)):
        assert_bits(a, b, name)
    other = GroupedLinear(E + 1, IN, OUT, bias=True, recipe="fp8-delayed")
    with pytest.raises(ValueError, match=r"^state_dict: expected GroupedLinear\(5, 128, 256\): one delayed"):
        other.set_extra_state(sd["_extra_state"])
    current = GroupedLinear(E, IN, OUT, bias=True, recipe="fp8-current")
    current.load_state_dict(sd)
    assert current.delayed_states() == []
    assert "_extra_state" not in GroupedLinear(E, IN, OUT, recipe="fp8-delayed").state_dict() or \
        GroupedLinear(E, IN, OUT, recipe="fp8-delayed").state_dict()["_extra_state"] is None  # nothing recorded
