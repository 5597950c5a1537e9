"""One source for "native": the planner, ``lowprec info`` and the docs say of every preset recipe on every
device what the kernels decide there (the path a converted layer takes), and time an emulated GEMM as
a high-precision GEMM plus its casts' traffic, a folded one as an FP8 GEMM plus its folding's traffic."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path as FilePath

import pytest
from click.testing import CliRunner

import lowprec
from lowprec import recipes as R
from lowprec.cli import main
from lowprec.convert import recipe_paths
from lowprec.plan.gemm_paths import DEVICES, Path, gemm_paths, paths_table
from lowprec.plan.gpus import GPU, GPUS
from lowprec.plan.layers import count_params
from lowprec.plan.models import ModelSpec, all_presets
from lowprec.plan.recipes import get_recipe
from lowprec.plan.throughput import flop_terms

KERNEL_WORDS = {"cublas": "native", "folded": "folded", "emulated": "emulated", "hp": "hp"}
"""``recipe_paths`` (what a converted layer runs) in the planner's and info's words."""
CUDA = {name: cap.sm for name, cap in DEVICES.items() if cap.sm}


def _kernels(fake_cuda) -> dict[tuple[str, str], list[str]]:
    """The words of the path a converted layer takes, per (device, recipe): on the CPU and on a
    device of each compute capability of the table (faked)."""
    fake_cuda(*((name, sm, 80.0) for name, sm in CUDA.items()))
    devices = {"cpu": "cpu"} | {name: f"cuda:{i}" for i, name in enumerate(CUDA)}
    return {(name, r): [KERNEL_WORDS[recipe_paths(R.get(r), dev)[g]] for g in ("fprop", "dgrad", "wgrad")]
            for name, dev in devices.items() for r in R.names()}


def test_info_says_what_the_kernels_decide_for_every_recipe_and_device(fake_cuda):
    kernels = _kernels(fake_cuda)
    r = CliRunner().invoke(main, ["info", "--json"])
    assert r.exit_code == 0, r.output
    names = {"cpu": "cpu"} | {f"cuda:{i}": name for i, name in enumerate(CUDA)}
    rows = json.loads(r.output)["recipe paths"]
    assert len(rows) == len(kernels)
    for row in rows:  # "emulated (bf16)": the word, then the dtype of the high-precision GEMM
        words = [row[g].split(" (")[0] for g in ("fprop", "dgrad", "wgrad")]
        assert words == kernels[names[row["device"]], row["recipe"]], row
    devices = {d["device"]: d["native"] for d in json.loads(r.output)["devices"]}
    # block-scaled formats are called native on Blackwell alone, where lowprec's GEMMs take its tensor cores
    for i, (name, sm) in enumerate(CUDA.items()):
        assert any(f in devices[f"cuda:{i}"] for f in ("mxfp", "nvfp4")) == (sm[0] >= 10), name


def _row(name: str, sm: tuple[int, int]) -> GPU:
    peaks = dict(bf16=100, fp16=100, fp32=10, fp8=200, mxfp8=200, mxfp6=400, mxfp4=400, nvfp4=400)
    return GPU(key=name, name=name, vendor="NVIDIA", arch=f"sm{sm[0]}{sm[1]}", memory_gb=80, hbm_tb_s=3,
               link_gb_s=900, link="l", peaks=tuple(peaks.items()), source="s")


def test_the_planner_times_each_gemm_as_the_kernels_run_it(fake_cuda):
    kernels = _kernels(fake_cuda)
    m = all_presets()["llama-3-8b"]
    for name, sm in CUDA.items():
        gpu = _row(name, sm)  # a row with every peak: only the kernels' decision says which one a GEMM gets
        for r in R.names():
            terms = {t.name: t for t in flop_terms(m, get_recipe(r), gpu, 4096, "none")}
            linears = [terms[f"linears: {g}"] for g in ("fprop", "dgrad", "wgrad")]
            assert [t.path.value for t in linears] == kernels[name, r], (name, r)
            for t in linears:
                expected = gpu.peak(t.emulated_in if t.path is Path.EMULATED else t.gemm)[0]
                cast = t.path in (Path.EMULATED, Path.FOLDED)
                assert t.tflops == expected and (t.cast_bytes > 0) == cast, (name, r)
                assert t.path is not Path.FOLDED or t.gemm == "fp8", (name, r)  # folded: FP8 tensor cores


def test_the_accelerator_tables_rows_follow_the_kernels_too():
    m = all_presets()["llama-3-8b"]
    for gpu in GPUS.values():
        for r in R.names():
            terms = {t.name: t for t in flop_terms(m, get_recipe(r), gpu, 4096, "none")}
            planned = [terms[f"linears: {g}"].path for g in ("fprop", "dgrad", "wgrad")]
            assert planned == [p.path for p in gemm_paths(R.get(r), gpu.capability)], (gpu.key, r)


def test_the_docs_table_of_paths_is_the_kernels_decision():
    docs = (FilePath(__file__).parents[2] / "docs" / "kernels.md").read_text()
    assert paths_table(DEVICES) in docs


# TINY: d 64, 2 blocks of q 64x64, k and v 64x32, o 64x64, gate and up 64x128, down 128x64
TINY = ModelSpec(name="tiny", vocab=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128)
INPUTS, OUTPUTS = 6 * 64 + 128, 3 * 64 + 2 * 32 + 2 * 128  # per token and block: q k v o gate up down
WEIGHTS = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128


def test_an_emulated_gemm_is_a_bf16_gemm_plus_its_casts_traffic_by_hand():
    tokens, b = 256, 1 + 1 / 32  # MXFP8: E4M3 and one E8M0 scale per 32
    per_element = (2 + b) + (b + 2)  # cast: read BF16, write MXFP8; widen: read it, write BF16
    terms = {t.name: t for t in flop_terms(TINY, get_recipe("mxfp8"), GPUS["a100"], 128, "none", tokens)}
    fprop, dgrad, wgrad = (terms[f"linears: {g}"] for g in ("fprop", "dgrad", "wgrad"))
    assert fprop.path is Path.EMULATED and fprop.emulated_in == "bf16"
    assert fprop.cast_bytes == pytest.approx(2 * (INPUTS + WEIGHTS / tokens) * per_element, rel=1e-12)
    assert dgrad.cast_bytes == pytest.approx(2 * (OUTPUTS + WEIGHTS / tokens) * per_element, rel=1e-12)
    assert wgrad.cast_bytes == pytest.approx(2 * (OUTPUTS + INPUTS) * per_element, rel=1e-12)
    assert fprop.tflops == 312 and fprop.cast_seconds == pytest.approx(fprop.cast_bytes / 2.039e12)


def test_a_folded_gemm_is_an_fp8_gemm_plus_a_byte_read_and_written_per_element_by_hand():
    tokens, per_element = 256, 2  # its code read, its FP8 code written
    terms = {t.name: t for t in flop_terms(TINY, get_recipe("mxfp8"), GPUS["h100"], 128, "none", tokens)}
    fprop, dgrad, wgrad = (terms[f"linears: {g}"] for g in ("fprop", "dgrad", "wgrad"))
    assert fprop.path is Path.FOLDED and fprop.gemm == "fp8" and fprop.tflops == 1979
    assert fprop.cast_bytes == pytest.approx(2 * (INPUTS + WEIGHTS / tokens) * per_element, rel=1e-12)
    assert dgrad.cast_bytes == pytest.approx(2 * (OUTPUTS + WEIGHTS / tokens) * per_element, rel=1e-12)
    assert wgrad.cast_bytes == pytest.approx(2 * (OUTPUTS + INPUTS) * per_element, rel=1e-12)
    assert fprop.cast_seconds == pytest.approx(fprop.cast_bytes / 3.35e12)


def test_nvfp4_on_blackwell_is_planned_faster_than_bf16_now_that_its_gemms_are_native():
    def tokens_per_s(recipe):
        return lowprec.plan.plan(lowprec.plan.PlanConfig(model="llama-3-8b", recipe=recipe, gpu="b200",
                                                         gpus=8, zero=3)).throughput.tokens_per_s
    assert tokens_per_s("bf16") < tokens_per_s("fp8-current") and tokens_per_s("bf16") < tokens_per_s("nvfp4")


@pytest.mark.parametrize("preset", ["small", "125m"])
def test_the_blocks_nvfp4_keeps_in_bf16_are_the_ones_convert_keeps(preset):
    from lowprec.train.model import PRESETS, build_model

    model = build_model(PRESETS[preset])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = lowprec.convert(model, "nvfp4")
    converted = sum(lr.in_features * lr.out_features for lr in report.converted)
    m = all_presets()[f"ref-{preset}"]
    hp_blocks = get_recipe("nvfp4").hp_blocks(m.n_layers)
    assert hp_blocks == math.ceil(0.15 * m.n_layers) > 0
    assert count_params(m, hp_blocks).quantized == converted < count_params(m).quantized
