"""``kernels.route`` and ``kernels.cast``: every route (fused on Triton through the interpreter, one
cast transposed, separate) gives the reference's casts, the same Hadamard side and the same amax;
the route is chosen once, from what the kernels cover."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from lowprec import kernels as K
from lowprec.kernels import CastSpec, Pairing, cast, route
from lowprec.quant import blockwise, hadamard, mx, nvfp4, quantize, rowwise, tensorwise
from tests.kernels.test_triton_quant import assert_same

PAIRS = [("e4m3", tensorwise()), ("e4m3", rowwise()), ("e4m3", blockwise(1, 128)), ("e4m3", mx(32, "ceil"))]


@pytest.mark.parametrize("fmt,g", PAIRS, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_sides_equal_the_reference_on_every_backend(fmt, g, backend):
    # 128 x 256: whole tiles, the kernels' unmasked path; per-tensor shares one cast for both sides
    x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    spec = CastSpec.of(fmt, g)
    r = route(spec, spec, "cpu", backend=backend)
    want = {"triton": Pairing.FUSED, "torch": Pairing.TRANSPOSED if g == tensorwise() else Pairing.SEPARATE}
    assert r.pairing is want[backend]
    q, qt, amax = cast(x, r)
    assert amax is None
    assert_same(q, quantize(x, fmt, g))
    assert_same(qt, quantize(x.t(), fmt, g))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_side_alone(backend):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    spec = CastSpec.of("e4m3", blockwise(1, 32))
    q, qt, _ = cast(x, route(None, spec, "cpu", backend=backend))
    assert q is None and qt is not None
    assert_same(qt, quantize(x.t(), "e4m3", blockwise(1, 32)))
    q, qt, _ = cast(x, route(spec, None, "cpu", backend=backend))
    assert qt is None
    assert_same(q, quantize(x, "e4m3", blockwise(1, 32)))


def test_backends_agree_with_hadamard_and_amax():
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(-40, 40, (96, 64), generator=g).float() / 4).bfloat16()  # exact Hadamard sums
    a, b = CastSpec.of("e2m1", nvfp4(16)), CastSpec.of("e2m1", nvfp4(16), hadamard_seed=7)
    out = {be: cast(x, route(a, b, "cpu", backend=be), record_amax=True) for be in ("torch", "triton")}
    for i in range(2):
        assert_same(out["triton"][i], out["torch"][i])
    assert out["triton"].amax.item() == out["torch"].amax.item() == x.float().abs().amax().item()
    ref_t = quantize(hadamard(x.t(), 16, seed=7), "e2m1", nvfp4(16))  # 96 tokens: no padding needed
    assert_same(out["torch"].transposed, ref_t)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_delayed_scale_serves_both_sides_and_the_amax_of_the_input_is_recorded(backend):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, 3] = math.inf
    scale = torch.tensor(0.01)
    spec = CastSpec.of("e4m3", tensorwise(), delayed=True)
    q, qt, amax = cast(x, route(spec, spec, "cpu", backend=backend), scale_k=scale, scale_t=scale, record_amax=True)
    assert amax.item() == math.inf
    assert_same(q, quantize(x, "e4m3", tensorwise(), scale=scale))
    assert_same(qt, quantize(x.t(), "e4m3", tensorwise(), scale=scale))


def test_the_route_decides_once_from_the_device_and_what_the_kernels_cover():
    e4m3, row = CastSpec.of("e4m3", tensorwise()), CastSpec.of("e4m3", rowwise())
    cpu = route(e4m3, row, "cpu")
    assert (cpu.backend_k, cpu.backend_t, cpu.pairing) == (K.Backend.TORCH, K.Backend.TORCH, Pairing.SEPARATE)
    # a delayed side and a current one cannot share one pass (the given scale serves both sides)
    assert route(CastSpec.of("e4m3", tensorwise(), delayed=True), row, "cpu", "triton").pairing is Pairing.SEPARATE
    # two delayed sides of different formats would need two scales
    d4, d5 = CastSpec.of("e4m3", tensorwise(), delayed=True), CastSpec.of("e5m2", tensorwise(), delayed=True)
    assert route(d4, d5, "cpu", "triton").pairing is Pairing.SEPARATE
    assert route(d4, d4, "cpu", "triton").pairing is Pairing.FUSED
    with pytest.raises(ValueError, match="along_k/transposed: expected at least one side"):
        route(None, None, "cpu")
    with pytest.raises(ValueError, match="backend: expected one of 'torch', 'triton', got 'cuda'"):
        route(e4m3, None, "cpu", "cuda")


@pytest.mark.parametrize("m,k", [(1, 1), (7, 33), (128, 256), (130, 96), (4096, 4128)])
def test_a_routes_launch_template_equals_the_launch_worked_out_in_full(m, k):
    # compiled code takes a route's template (a few integer operations) for the full planning
    from lowprec.kernels.triton_plan import launch, template

    pairs = [(CastSpec.of("e4m3", tensorwise()), CastSpec.of("e5m2", tensorwise())),
             (CastSpec.of("e4m3", tensorwise(), delayed=True), CastSpec.of("e4m3", tensorwise(), delayed=True)),
             (CastSpec.of("e4m3", rowwise()), CastSpec.of("e4m3", rowwise())),
             (CastSpec.of("e4m3", blockwise(1, 128)), CastSpec.of("e4m3", blockwise(128, 128))),
             (CastSpec.of("e4m3", mx(32, "ceil")), None), (None, CastSpec.of("e2m1", mx(32), "stochastic")),
             (CastSpec.of("e2m1", nvfp4(16, True)), CastSpec.of("e2m1", nvfp4(16), "stochastic", hadamard_seed=7))]
    for a, b in pairs:
        for given in (False, True) if (a or b).delayed else (False,):
            for record in (False, True):
                assert template(a, b, given).launch(m, k, record) == launch(a, b, m, k, True, given, False, False,
                                                                            record), (a, b, given, record)
