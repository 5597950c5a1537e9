"""The Hugging Face Trainer trains a Llama converted by lowprec.convert, and TelemetryCallback writes the
telemetry.csv that lowprec's own reader and ``lowprec inspect`` read."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the integrations extra (transformers) is not installed")
import transformers
from click.testing import CliRunner

import lowprec
from lowprec.cli import main
from lowprec.integrations.hf import TelemetryCallback
from lowprec.telemetry import NothingToSample
from lowprec.telemetry.records import read_records
from tests.integrations.common import POLICY

STEPS, EVERY = 4, 2


def tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def token_rows(n: int, seq_len: int = 12) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (n, seq_len), generator=gen)  # (n, T)
    return [{"input_ids": r, "labels": r} for r in rows]


def _train(model, out, callback) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_rows(16), callbacks=[callback])
    trainer.train()
    return trainer


def test_hf_trainer_trains_a_converted_llama_and_writes_telemetry(tmp_path):
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")
        report = lowprec.convert(model, "fp8-current", POLICY)
    converted = {lr.name for lr in report.converted}
    assert len(converted) == 14 and "lm_head" not in converted  # q, k, v, o, gate, up, down per block
    run = tmp_path / "run"
    trainer = _train(model, tmp_path / "hf", TelemetryCallback(run, every=EVERY))

    assert trainer.state.global_step == STEPS
    assert all(isinstance(model.get_submodule(name), lowprec.nn.Linear) for name in converted)
    records = read_records(run / "telemetry.csv")  # lowprec's own reader
    assert {r.step for r in records} == set(range(EVERY, STEPS + 1, EVERY))
    assert {r.layer for r in records} == converted
    assert {(r.gemm, r.operand) for r in records} == {
        ("fprop", "input"), ("fprop", "weight"), ("dgrad", "weight"), ("dgrad", "grad_output"),
        ("wgrad", "input"), ("wgrad", "grad_output")}
    assert all(r.sqnr_db > 20 for r in records if r.operand != "grad_output")  # E4M3 casts of finite data

    result = CliRunner().invoke(main, ["inspect", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "inspect.html").is_file() and f"{len(converted)} layers" in result.output


def test_telemetry_on_an_unconverted_model_says_there_is_nothing_to_sample(tmp_path):
    with pytest.warns(NothingToSample, match="no linear was converted"):
        _train(tiny_llama(), tmp_path / "hf", TelemetryCallback(tmp_path / "run", every=EVERY))
    assert not (tmp_path / "run" / "telemetry.csv").exists()
