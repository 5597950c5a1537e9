"""The Triton-or-reference choices that are not casts, each made by one function of ``lowprec.kernels.route``
from what its caller knows (device, dtype, granularity, compiling or not)."""
from __future__ import annotations

import importlib

import pytest
import torch

from lowprec.kernels.capability import cuda_capability, host_capability
from lowprec.quant import blockwise, mx, rowwise, tensorwise

route_module = importlib.import_module("lowprec.kernels.route")  # the package exports a function of that name
Backend = route_module.Backend
CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device that runs Triton (``triton`` as given), without asking CUDA."""
    def use(triton: bool = True) -> None:
        cap = cuda_capability((9, 0), triton=triton)
        monkeypatch.setattr(route_module, "capability",
                            lambda device: cap if torch.device(device).type == "cuda" else host_capability("cpu"))
    return use


def test_an_emulated_gemm_decodes_block_operands_by_triton_only_into_bf16_on_a_device_that_runs_it(hopper):
    hopper()
    assert route_module.emulated_operand_backend(CUDA, torch.bfloat16) is Backend.TRITON
    assert route_module.emulated_operand_backend(CUDA, torch.float32) is Backend.TORCH
    assert route_module.emulated_operand_backend("cpu", torch.bfloat16) is Backend.TORCH
    hopper(triton=False)  # a CUDA install without Triton takes the reference
    assert route_module.emulated_operand_backend(CUDA, torch.bfloat16) is Backend.TORCH


def test_saved_activations_dequantize_by_triton_in_eager_code_for_bf16_blocks_it_tiles(hopper):
    hopper()
    choose = route_module.saved_dequantize_backend
    assert choose(CUDA, torch.bfloat16, blockwise(1, 128), compiling=False) is Backend.TRITON
    assert choose(CUDA, torch.bfloat16, blockwise(1, 128), compiling=True) is Backend.TORCH  # the compiler fuses
    assert choose(CUDA, torch.float32, blockwise(1, 128), compiling=False) is Backend.TORCH
    for g in (blockwise(1, 96), blockwise(1, 256), tensorwise(), rowwise(), mx(32)):  # not tiled by the kernel
        assert choose(CUDA, torch.bfloat16, g, compiling=False) is Backend.TORCH
    assert choose("cpu", torch.bfloat16, blockwise(1, 128), compiling=False) is Backend.TORCH
    assert choose("cpu", torch.bfloat16, blockwise(1, 128), compiling=False, backend="triton") is Backend.TRITON
    with pytest.raises(ValueError, match="backend"):
        choose("cpu", torch.bfloat16, blockwise(1, 128), compiling=False, backend="cuda")


def test_saved_activations_cast_by_the_reference_in_compiled_code_and_on_the_route_in_eager_code(hopper):
    hopper()
    choose = route_module.saved_cast_backend
    assert choose("e4m3", blockwise(1, 128), CUDA, compiling=False) is Backend.TRITON
    assert choose("e4m3", blockwise(1, 128), CUDA, compiling=True) is Backend.TORCH
    assert choose("e4m3", blockwise(1, 128), "cpu", compiling=False) is Backend.TORCH
    assert choose("e4m3", blockwise(1, 128), "cpu", compiling=True, backend="triton") is Backend.TRITON


def test_a_direct_quantize_that_does_not_saturate_and_requantizing_other_dtypes_take_the_reference(hopper):
    hopper()
    spec = route_module.CastSpec.of("e4m3", tensorwise())
    assert route_module.quantize_backend(spec, CUDA) is Backend.TRITON
    assert route_module.quantize_backend(spec, CUDA, saturate=False) is Backend.TORCH
    assert route_module.requantize_backend(CUDA, torch.bfloat16) is Backend.TRITON
    assert route_module.requantize_backend(CUDA, torch.float16) is Backend.TORCH


def test_adamw_takes_its_fused_step_as_asked_or_where_cuda_runs_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert route_module.fused_adamw_step(None) is False
    assert route_module.fused_adamw_step(False) is False
    monkeypatch.setattr(route_module, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="fused.*False where Triton is not installed"):
        route_module.fused_adamw_step(True)
