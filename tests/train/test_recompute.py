"""Activation recomputation (``--recompute``): the same numbers as without, bit for bit, for less memory.

Each recipe trains a small model two steps of two micro-batches (the weight casts cached between them, as
``lowprec train --grad-accum 2`` does) with no recomputation, then with ``full`` and ``selective``: the
losses, every step's gradients and the delayed-scaling histories must be equal, bit for bit. Memory is
counted as the bytes of the storages a forward made that are still alive when it ends: what backward will
read. (``saved_tensors_hooks`` alone cannot count it under checkpointing: checkpoint installs its own
hooks inside each block, keeps the block's input in its own frame, and selective checkpointing keeps its
cache outside autograd; for ``none`` the two counts are checked against each other.)
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import lowprec
from lowprec.cli import main
from lowprec.nn import cached_weight_casts, fp8_activations
from lowprec.nn.probe import reporting_to
from lowprec.nn.recomputation import recomputation
from lowprec.plan import PlanConfig, Training
from lowprec.plan.activations import RECOMPUTE
from lowprec.plan.measured import compare_recompute
from lowprec.train.config import RESUME_MUST_MATCH, TrainConfig
from lowprec.train.loop import train
from lowprec.train.model import ModelConfig, build_model, preset
from lowprec.train.moe_model import MoEConfig
from lowprec.train.recompute import Recompute, recompute_blocks, recompute_mode

MICRO = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=64, max_seq_len=64)
MOE = ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=64,
                  moe=MoEConfig(n_experts=4, top_k=2, n_shared=1))
MODES = ("full", "selective")


def _model(cfg: ModelConfig, recipe: str, mode: str, act: str | None = None) -> torch.nn.Module:
    model = build_model(cfg, seed=0)
    report = lowprec.convert(model, recipe, lowprec.Policy(saved_activations=fp8_activations(act) if act else None))
    assert report.coverage().converted > 0  # the recipe runs: not a test of high precision alone
    recompute_blocks(model, mode)
    return model


def _batch(gen: torch.Generator, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=gen)


@functools.cache
def _train(recipe: str, mode: str, cfg: ModelConfig = MICRO, act: str | None = None, seed: int = 0):
    """(losses, each step's gradients, delayed histories and counts, the generator's state after) of two steps
    of two micro-batches in plain SGD; ``seed`` seeds torch's generator (stochastic rounding draws from it)."""
    model = _model(cfg, recipe, mode, act)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data, losses, grads = torch.Generator().manual_seed(1), [], []
    torch.manual_seed(seed)
    for _ in range(2):
        with cached_weight_casts(model):
            for _ in range(2):
                x = _batch(data, cfg.vocab_size)
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
                (loss / 2).backward()
                losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    states = [m.delayed_state for m in model.modules() if getattr(m, "delayed_state", None) is not None]
    return losses, grads, [(s.history, s.count) for s in states], torch.get_rng_state()


def _assert_same(a, b) -> None:
    assert a[0] == b[0]  # the losses, bit for bit
    for step_a, step_b in zip(a[1], b[1], strict=True):
        assert all(torch.equal(ga, gb) for ga, gb in zip(step_a, step_b, strict=True))
    assert len(a[2]) == len(b[2])
    for (ha, ca), (hb, cb) in zip(a[2], b[2]):
        assert torch.equal(ha, hb) and torch.equal(ca, cb)
    assert torch.equal(a[3], b[3])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8-current", "fp8-delayed", "mxfp8"])
def test_recompute_gives_the_losses_gradients_and_histories_of_none_bit_for_bit(recipe, mode):
    ref = _train(recipe, "none")
    _assert_same(_train(recipe, mode), ref)
    if recipe == "fp8-delayed":  # the histories compared are real: every layer recorded every micro-batch
        assert ref[2] and all(bool((count[:2] == 4).all()) for _, count in ref[2])


@pytest.mark.parametrize("mode", MODES)
def test_nvfp4_stochastic_rounding_is_reproduced_under_recompute(mode):
    """NVFP4 rounds gradients stochastically from torch's global generator (drawn in backward, not seeded
    per call); checkpoint restores the generator around each recomputation, so backward draws what it draws
    without recomputation. The draws matter: another seed gives other gradients."""
    ref = _train("nvfp4", "none")
    _assert_same(_train("nvfp4", mode), ref)
    other = _train("nvfp4", "none", seed=1)
    assert other[0][0] == ref[0][0]  # the first forward draws nothing
    assert not all(torch.equal(a, b) for a, b in zip(other[1][0], ref[1][0]))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_saved_activations_compose_with_recompute(mode):
    _assert_same(_train("fp8-current", mode, act="1x64"), _train("fp8-current", "none", act="1x64"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_a_mixture_of_experts_recomputes_bit_for_bit(mode, recipe):
    """fp8-delayed too: the experts' batched casts neither record nor fold in a recomputed forward, so every
    expert's history is the one without recompute."""
    _assert_same(_train(recipe, mode, MOE), _train(recipe, "none", MOE))


class _Ops(TorchDispatchMode):
    """Counts the operators run."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> Counter:
    model = _model(MICRO, "bf16", mode)
    x = _batch(torch.Generator().manual_seed(0), MICRO.vocab_size)
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    with _Ops() as ops:
        loss.backward()
    return ops.counts


def test_selective_recomputes_no_gemm_and_full_recomputes_every_block():
    mm, rsqrt, attention = (torch.ops.aten.mm.default, torch.ops.aten.rsqrt.default,
                            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    none, selective, full = (_backward_ops(m) for m in ("none", "selective", "full"))
    # q, k, v, o, gate, up run again, not down: torch stops recomputing a block once it has every tensor
    # backward needs, and the down projection's matmul saves its inputs before it runs
    assert selective[mm] == none[mm] and full[mm] == none[mm] + 6 * MICRO.n_layers
    assert selective[rsqrt] == full[rsqrt] == none[rsqrt] + 2 * MICRO.n_layers  # the blocks' norms, again
    assert selective[attention] == none[attention] == 0 and full[attention] == MICRO.n_layers


class _Alive(TorchDispatchMode):
    """The storages each operator makes (not one it was given: parameters, state), weakly held."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.given: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.made:
                self.given.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s, ptr = t.untyped_storage(), t.untyped_storage().data_ptr()
                held = self.made.get(ptr)
                if ptr not in self.given and (held is None or held[0].expired()):  # new, or a freed one's address
                    self.made[ptr] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.made.values() if not ref.expired())


TOKENS = (2, 16)


def _kept_for_backward(mode: str) -> tuple[int, int]:
    """(bytes alive after the tiny model's forward and loss, bytes saved_tensors_hooks saw less the token ids,
    made before the forward, plus the loss): the model in BF16 under the bf16 recipe, as on a GPU, and the
    loss taken in FP32 as the trainer takes it."""
    model = _model(preset("tiny"), "bf16", mode).to(torch.bfloat16)
    x = torch.randint(0, 256, TOKENS, generator=torch.Generator().manual_seed(0))
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Alive() as alive:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
    kept = alive.alive_bytes()
    loss.backward()
    return kept, sum(saved.values()) - x.nbytes + loss.nbytes


@functools.cache
def _kept() -> dict[str, int]:
    return {mode: _kept_for_backward(mode)[0] for mode in ("none", "selective", "full")}


def test_full_keeps_less_than_selective_which_keeps_less_than_none():
    kept = _kept()
    assert kept["full"] < kept["selective"] < kept["none"]
    none, hooked = _kept_for_backward("none")
    assert none == hooked  # without checkpointing what stays alive is what autograd saved
    cfg, tokens = preset("tiny"), TOKENS[0] * TOKENS[1]
    # full: each block's input (BF16), then the final norm's and the head's inputs and the FP32 log-probabilities
    blocks = cfg.n_layers * tokens * cfg.dim * 2
    assert blocks < kept["full"] < blocks + tokens * (2 * cfg.dim * 2 + cfg.vocab_size * 4) + 8192
    # selective: besides what full keeps, per token and block the GEMMs' outputs (q, k, v, o, gate, up, down)
    # and attention's output in BF16 and its log-sum-exp in FP32
    kv = cfg.n_kv_heads * cfg.head_dim
    per_token = 2 * (4 * cfg.dim + 2 * kv + 2 * cfg.ffn_dim) + 4 * cfg.n_heads
    assert kept["selective"] - kept["full"] == cfg.n_layers * tokens * per_token


def test_the_planner_figures_each_mode_as_the_trainer_keeps_it():
    """The planner's activations for the tiny model's none within 10% and selective within 2% of what the
    trainer keeps (full's figure adds one block rebuilt in backward, which a count after the forward cannot
    see; none's leaves out the attention output's reshaped copy that the output projection saves)."""
    config = PlanConfig(model="ref-tiny", recipe="bf16", gpu="h200", gpus=1,
                        training=Training(seq=TOKENS[1], micro_batch=TOKENS[0]))
    kept = _kept()
    rows = compare_recompute(config, activations={m: kept[m] for m in ("none", "selective")})
    assert [r.mode for r in rows] == ["none", "selective"]
    assert abs(rows[0].activations_error) <= 0.10 and abs(rows[1].activations_error) <= 0.02, rows
    assert rows[1].planned_activations < rows[0].planned_activations


class _Receiver:
    """Counts the reports a sampled step's collector would receive."""

    def __init__(self) -> None:
        self.reports: Counter = Counter()

    def forward(self, *args) -> None:
        self.reports["forward"] += 1

    def backward(self, *args) -> None:
        self.reports["backward"] += 1


def test_recomputation_reports_no_telemetry_twice():
    """A recomputed forward does not report its casts to a sampled step's collector a second time."""
    counts = {}
    for mode in ("none", "full", "selective"):
        model = _model(MICRO, "fp8-current", mode)
        x = _batch(torch.Generator().manual_seed(0), MICRO.vocab_size)
        with reporting_to(_Receiver()) as receiver:
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        counts[mode] = receiver.reports
    assert counts["none"]["forward"] > 0 and counts["full"] == counts["selective"] == counts["none"]


def test_the_setting_is_checked_and_a_resumed_run_may_change_it():
    assert TrainConfig(recompute="selective").recompute == "selective"
    with pytest.raises(ValueError, match="recompute: expected one of 'none', 'selective', 'full', got 'half'"):
        TrainConfig(recompute="half")
    assert "recompute" not in RESUME_MUST_MATCH  # the same numbers bit for bit
    assert [m.value for m in Recompute] == list(RECOMPUTE)  # one list of names


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="recompute: expected 'none' for a model without an nn.ModuleList"):
        recompute_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), "full")
    assert recompute_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), "none") == []


def test_lowprec_train_recompute_full_runs_end_to_end(tmp_path):
    args = ["train", "--model", "tiny", "--recompute", "full", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
            "--val-batches", "1", "--out", str(tmp_path / "run"), "--json", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert '"steps": 3' in result.stdout and '"diverged": false' in result.stdout


def test_the_trainer_recomputes_bit_for_bit_through_its_bf16_start_and_gradient_accumulation(data):
    """``train`` with fp8-delayed: a BF16 first step recording the amaxes (lazy initialisation, whose hook on
    each output records grad_output's amax in backward), two micro-batches a step, telemetry sampled at the
    delayed step; the losses, gradient norms, weights and delayed histories after two steps are those without."""
    mode = "selective"
    cfg = TrainConfig(recipe="fp8-delayed", steps=2, batch_size=2, seq_len=16, grad_accum=2, hp_start_steps=1,
                      eval_every=2, val_batches=1, warmup_steps=1, telemetry_every=2, tensorboard=False,
                      progress=False)
    models = {m: build_model(dataclasses.replace(MICRO, vocab_size=256), seed=0) for m in ("none", mode)}
    results = {m: train(models[m], data, dataclasses.replace(cfg, recompute=m)) for m in models}
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r[key] for r in results[mode].history] == [r[key] for r in results["none"].history]
    ref = models["none"].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in models[mode].state_dict().items())
    assert any(k.endswith("_extra_state") for k in ref)  # the delayed histories are in the state compared


def test_the_delayed_bank_neither_records_nor_folds_in_a_recomputed_forward():
    layer = lowprec.nn.Linear(32, 32, bias=False, recipe="fp8-delayed")  # a bank of its own, folded by its forward
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    layer(x).sum().backward()
    state, bank = layer.delayed_state, layer.delayed_state.bank
    counts = state.count  # a reader folds: every role recorded once
    assert counts.tolist() == [1, 1, 1]
    layer(2 * x).sum().backward()  # pending: input, weight and grad_output amaxes, not folded yet
    pending = [t.clone() for t in (bank.pending, bank.dy_pending, bank.dy_records)]
    assert torch.equal(state.last(lowprec.recipes.Role.INPUT), (2 * x).detach().abs().amax())  # read, not folded
    with recomputation():
        layer(3 * x)
    assert all(torch.equal(a, b) for a, b in zip(pending, (bank.pending, bank.dy_pending, bank.dy_records)))
    assert bank.count[state.row].tolist() == [1, 1, 1]
    assert state.count.tolist() == [2, 2, 2]  # the second step's amaxes, once each


def test_a_second_call_is_refused_and_names_keep():
    """Blocks keep their names and state_dict keys; checkpointing them twice is refused, naming the call."""
    model = build_model(MICRO, seed=0)
    keys = list(model.state_dict())
    assert len(recompute_blocks(model, "selective")) == MICRO.n_layers
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="recompute: expected one call per model, got a second call \\('full'\\)"):
        recompute_blocks(model, "full")


def test_a_deep_copy_checkpoints_its_own_blocks():
    """A copy of a checkpointed model (an EMA, a reference) runs and trains its own weights, not the original's."""
    import copy

    model = build_model(MICRO, seed=0)
    recompute_blocks(model, "full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    plain = build_model(MICRO, seed=0)
    plain.load_state_dict(twin.state_dict())
    x = _batch(torch.Generator().manual_seed(0), MICRO.vocab_size)
    twin(x).sum().backward()
    plain(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(twin.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_checkpointed_model_saved_whole_loads_and_recomputes(tmp_path):
    """``torch.save(model)`` of a checkpointed model reads back (a bound method would save as a lookup that
    fails on loading) as a model that still recomputes and gives the original's gradients."""
    model = build_model(MICRO, seed=0)
    recompute_blocks(model, "selective")
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert [recompute_mode(b) for b in loaded.layers] == [Recompute.SELECTIVE] * MICRO.n_layers
    assert all(vars(b)["forward"].args == (b,) for b in loaded.layers)  # each block bound to itself
    x = _batch(torch.Generator().manual_seed(0), MICRO.vocab_size)
    model(x).sum().backward()
    loaded(x).sum().backward()
    for p, q in zip(model.parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_block_the_compiler_breaks_recomputes_without_recording_twice():
    """A compiled block whose body has a graph break (the compiler cannot take the checkpoint in one graph)
    still recomputes without recording the delayed amaxes a second time: the counts of a run without."""
    def run(mode: str):
        torch._dynamo.reset()
        model = _model(MICRO, "fp8-delayed", mode)
        for block in model.layers:
            inner = block.attention.forward

            def broken(*args, _inner=inner, **kwargs):
                torch._dynamo.graph_break()
                return _inner(*args, **kwargs)

            block.attention.forward = broken
            block.compile(backend="eager")
        x = _batch(torch.Generator().manual_seed(0), MICRO.vocab_size)
        for _ in range(2):
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        return [m.delayed_state.count.clone() for m in model.modules() if getattr(m, "delayed_state", None) is not None]

    plain, full = run("none"), run("full")
    torch._dynamo.reset()
    assert plain and all(torch.equal(a, b) for a, b in zip(plain, full, strict=True))
