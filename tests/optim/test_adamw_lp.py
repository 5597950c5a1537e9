"""AdamWLP: FP32 moments within float32 rounding of torch's AdamW; BF16/FP8/8-bit moments stay within a bound of it;
state_dict round trips through lowprec.optim.Optimizer; memory; bad input."""
from __future__ import annotations

import io

import pytest
import torch

from lowprec.optim import AdamWLP, Optimizer
from lowprec.optim.states import StateFormat
from tests.optim.common import assert_same_state, batch, bits, clone_state, mlp, mse

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _steps(opt, model, first: int, n: int, dtype=torch.float32) -> None:
    for s in range(first, first + n):
        x, y = batch(s, dtype)
        if isinstance(opt, Optimizer):
            opt.backward(mse(model, x, y))
            opt.step()
        else:
            opt.zero_grad()
            mse(model, x, y).backward()
            opt.step()


def test_fp32_states_follow_torch_adamw_within_rounding():
    """The same formulas as torch's AdamW, rounded op by op (see [Note: the AdamW update]): after 5 steps
    every weight is within 4 float32 ulps of torch's, of its own magnitude or of the largest step's
    (lr / (1 - beta1), the first), and many are equal."""
    a, b = mlp(), mlp()
    _steps(torch.optim.AdamW(a.parameters(), foreach=False, **HP), a, 0, 5)
    _steps(AdamWLP(b.parameters(), states="fp32", **HP), b, 0, 5)
    for p, q in zip(a.parameters(), b.parameters()):
        p, q = p.detach(), q.detach()
        scale = p.abs().clamp_min(HP["lr"] / (1 - HP["betas"][0]))
        assert ((p - q).abs() <= 4 * 2.0**-23 * scale).all()
        assert (p == q).float().mean() >= 0.4


@pytest.mark.parametrize(("states", "bound"), [("bf16", 0.01), ("fp8", 0.08), ("int8", 0.08)])
def test_low_precision_states_stay_near_fp32_adamw(states, bound):
    """After 10 steps, each weight is within ``bound`` x (steps x lr) of FP32 AdamW's: every step moves a
    weight by about lr, and the compressed moments change each step's direction by a fraction of it."""
    ref, lp = mlp(), mlp()
    _steps(torch.optim.AdamW(ref.parameters(), foreach=False, **HP), ref, 0, 10)
    _steps(AdamWLP(lp.parameters(), states=states, **HP), lp, 0, 10)
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), mlp().parameters()))
    gap = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), lp.parameters()))
    assert moved > 0.5 * 10 * HP["lr"]  # the weights did move
    assert 0 < gap <= bound * 10 * HP["lr"]


@pytest.mark.parametrize("states", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("masters", [True, False])
def test_state_dict_round_trip_continues_bit_for_bit(states, masters):
    """Through lowprec.optim.Optimizer over BF16 parameters, with FP32 masters or stochastic rounding."""
    def build(model):
        return Optimizer(model.parameters(), AdamWLP, states=states, master_weights=masters,
                         stochastic_rounding=not masters, seed=3, **HP)

    model = mlp(torch.bfloat16)
    opt = build(model)
    _steps(opt, model, 0, 3, torch.bfloat16)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _steps(opt, model, 3, 3, torch.bfloat16)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = mlp(torch.bfloat16, seed=9)
    resumed.load_state_dict(saved["model"])
    opt2 = build(resumed)
    opt2.load_state_dict(saved["opt"])
    inner = opt2.optimizer.state[opt2.param_groups[0]["params"][0]]
    assert inner["exp_avg"].dtype == {"bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}[states]
    _steps(opt2, resumed, 3, 3, torch.bfloat16)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(bits(p), bits(q))
    assert_same_state(clone_state(opt.state_dict()), clone_state(opt2.state_dict()))


def test_a_skipped_step_leaves_the_compressed_moments_as_they_were():
    model = mlp()
    opt = Optimizer(model.parameters(), AdamWLP, states="fp8", **HP)
    _steps(opt, model, 0, 2)
    before = clone_state(opt.state_dict()["optimizer"])
    x, y = batch(2)
    opt.backward(mse(model, x, y) * float("nan"))
    assert opt.step().skipped
    assert_same_state(before, clone_state(opt.state_dict()["optimizer"]))


@pytest.mark.parametrize("states", ["fp8", "int8"])
def test_states_take_at_most_half_of_fp32_adamws_bytes(states):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    ref = torch.optim.AdamW(model.parameters())
    lp = AdamWLP(model.parameters(), states=states)
    model(torch.randn(4, 256)).sum().backward()
    ref.step()
    lp.step()
    fp32 = sum(v.numel() * v.element_size() for s in ref.state.values() for k, v in s.items() if k != "step")
    assert fp32 == 8 * sum(p.numel() for p in model.parameters())
    assert lp.state_bytes() <= 0.5 * fp32
    assert lp.state_bytes() == pytest.approx(fp32 / 8 * 2 * StateFormat(states).bytes_per_value, rel=1e-3)


def test_bad_input():
    params = list(mlp().parameters())
    with pytest.raises(ValueError, match=r"states: expected one of 'fp32', 'bf16', 'fp8', 'int8', got 'fp4'"):
        AdamWLP(params, states="fp4")
    with pytest.raises(ValueError, match=r"betas: expected two numbers in \[0, 1\)"):
        AdamWLP(params, betas=(0.9, 1.0))
    model = mlp()
    opt = AdamWLP(model.parameters(), states="fp8")
    mse(model, *batch(0)).backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].float()
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\]\['exp_avg'\]: expected a torch.uint8 tensor "
                                         r"of shape \(16, 8\), got a torch.float32 tensor"):
        opt.load_state_dict(sd)
    sd = AdamWLP(mlp().parameters(), states="int8").state_dict()
    sd["state"] = {0: {"step": torch.tensor(1.0)}}
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\]: expected the keys of fp8 moments"):
        opt.load_state_dict(sd)
