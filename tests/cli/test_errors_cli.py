"""Bad input and a failing machine end ``lowprec train`` / ``compare`` with one line and status 1, saying
what to change: no traceback, no bare library message."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import app, compare_cmd, main, train_cmd

SMALL = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--quiet", "--no-tensorboard"]


def _one_line(*args: str) -> str:
    """The single line a failing command printed (asserting it is one, with status 1)."""
    result = CliRunner().invoke(main, list(args))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["train", "compare"])
def test_cuda_on_a_machine_without_it(tmp_path, command):
    # it was 43 lines, ending in torch's "Torch not compiled with CUDA enabled"
    line = _one_line(command, "--device", "cuda", "--out", str(tmp_path), *SMALL)
    assert line.startswith("Error: device: expected cpu or a device this machine has, got 'cuda' (")


def test_a_cuda_device_index_the_machine_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = _one_line("train", "--device", "cuda:2", "--out", str(tmp_path), *SMALL)
    assert line == "Error: device: expected one of cpu, cuda:0, cuda:1, got 'cuda:2'"


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 8796093022208 bytes. Error code 12 (Cannot allocate memory)"),
], ids=["cuda", "cpu"])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_running_out_of_memory_says_what_to_reduce(tmp_path, monkeypatch, command, error):
    def run_out(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(train_cmd, "train", run_out)
    monkeypatch.setattr(compare_cmd, "compare", run_out)
    line = _one_line(command, "--out", str(tmp_path), *SMALL)
    what = ". ".join(str(error).split(". ")[:2])  # where and how much, not the allocator's advice
    assert line == f"Error: out of memory ({what}): {app.OUT_OF_MEMORY_HINT}" and "--batch-size" in line


def test_a_pickled_hugging_face_checkpoint_is_refused_with_how_to_convert_it(tmp_path):
    # it was refused by torch's unpickler after transformers was imported: 53 lines
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "vocab_size": 256}')
    (model / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle: never opened
    line = _one_line("train", "--model", str(model), "--out", str(tmp_path / "out"), *SMALL)
    assert line.startswith("Error: model: expected weights in .safetensors files (lowprec loads no pickled weights), "
                           f"got pytorch_model.bin in '{model}'; convert a checkpoint you trust once with: python -c")
    assert f"M.from_pretrained('{model}').save_pretrained('{model}')" in line


@pytest.mark.parametrize("error, shown", [
    (KeyError("/model/nope"), "Error: KeyError: /model/nope"),
    (TypeError("'>' not supported between instances of 'str' and 'int'"),
     "Error: TypeError: '>' not supported between instances of 'str' and 'int'"),
    (ValueError("steps: expected a positive int, got 0"), "Error: steps: expected a positive int, got 0"),
    (OSError("a message\nover two lines"), "Error: OSError: a message over two lines"),
])
def test_a_library_error_says_what_kind_it_is(tmp_path, monkeypatch, error, shown):
    def fails(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(train_cmd, "train", fails)
    assert _one_line("train", "--out", str(tmp_path), *SMALL) == shown


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(*_args, **_kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(train_cmd, "train", bug)
    result = CliRunner().invoke(main, ["train", "--out", str(tmp_path), *SMALL])
    assert isinstance(result.exception, ZeroDivisionError)


@pytest.mark.parametrize("extra, expected", [
    ([], "Error: data: expected token ids below 262,144 (the largest vocabulary inferred from the data; if the ids "
         "are right, give the vocabulary: vocab_size, --vocab-size), got 3,000,000 at position 7 of '"),
    (["--vocab-size", "1000"], "Error: data: expected token ids below the vocabulary size 1,000, got 3,000,000 at "
                               "position 7 of '"),
    (["--vocab-size", "0"], "Error: vocab_size: expected a positive int, got 0"),
])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_stray_token_id_is_refused_before_a_model_is_built(tmp_path, command, extra, expected):
    ids = np.arange(500, dtype=np.int64) % 256
    ids[7] = 3_000_000  # it built a 3M-row embedding and was killed at 24 GB
    np.save(tmp_path / "ids.npy", ids)
    line = _one_line(command, "--data", str(tmp_path / "ids.npy"), *extra, "--out", str(tmp_path / "out"), *SMALL)
    assert line.startswith(expected)


def test_resuming_on_changed_data_says_what_changed(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    out = str(tmp_path / "run")
    first = CliRunner().invoke(main, ["train", "--data", str(text), "--out", out, *SMALL])
    assert first.exit_code == 0, first.output
    text.write_text("the quick brown fox jumps over the lazy cat\n" * 41)
    line = _one_line("train", "--data", str(text), "--out", out, "--resume", *SMALL[:1], "2", *SMALL[2:])
    assert line.startswith("Error: data: expected the data the checkpoint was trained on")
    # it read "(text: small.txt (1 files)), got text: small.txt (1 files)": now sizes and hashes differ
    assert f"(text: {text} (1 file, 1,760 bytes, sha256 " in line and f"got text: {text} (1 file, 1,804 bytes, " in line


@pytest.mark.parametrize("files, why", [
    ({"config.json": '{"model_type": "nope"}'}, "has model type `nope` but Transformers does not recognize"),
    ({"config.json": '{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, '
                     '"num_hidden_layers": 1, "num_attention_heads": 2}', "model.safetensors": "not a header"},
     "Error while deserializing header"),
    # it was a traceback from the config class's validator
    ({"config.json": '{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, '
                     '"num_hidden_layers": 1, "num_attention_heads": 5}'},
     "(The hidden size (64) is not a multiple of the number of attention heads (5))"),
], ids=["unknown-type", "corrupt-weights", "invalid-heads"])
def test_a_hugging_face_model_transformers_cannot_load_is_one_line(tmp_path, files, why):
    pytest.importorskip("transformers")
    model = tmp_path / "hf"
    model.mkdir()
    for name, text in files.items():
        (model / name).write_text(text)
    line = _one_line("train", "--model", str(model), "--out", str(tmp_path / "out"), *SMALL)
    assert line.startswith(f"Error: model: expected a Hugging Face causal LM that transformers loads, got '{model}' (")
    assert why in line


def test_a_hugging_face_config_without_its_shape_is_one_line_naming_every_missing_field(tmp_path):
    pytest.importorskip("transformers")
    model = tmp_path / "hf"
    model.mkdir()
    # it was filled with Llama-7B's defaults and killed for memory after 71 s, printing nothing
    (model / "config.json").write_text('{"model_type": "llama", "vocab_size": 256}')
    line = _one_line("train", "--model", str(model), "--out", str(tmp_path / "out"), *SMALL)
    assert line.endswith(f"got '{model / 'config.json'}' without hidden_size, num_hidden_layers, "
                         "num_attention_heads, intermediate_size")
    assert not (tmp_path / "out" / "checkpoints").exists()
