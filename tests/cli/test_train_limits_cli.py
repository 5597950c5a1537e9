"""``lowprec train`` refuses what cannot run in one line naming the option and every real limit, before it
makes anything: data too small for one sequence, a --seq-len over the data's or the model's limit, an --out
that is a file, --resume without a run, a resume with another model."""
from __future__ import annotations

from click.testing import CliRunner

from lowprec.cli import main

SMALL = ["--steps", "1", "--batch-size", "2", "--val-batches", "1", "--quiet", "--no-tensorboard", "--telemetry-every",
         "0"]


def _one_line(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_data_too_small_for_one_sequence_says_its_size_and_the_least_it_needs(tmp_path):
    (tmp_path / "d.txt").write_text("hello world!")
    out = tmp_path / "out"
    line = _one_line("train", "--data", str(tmp_path / "d.txt"), "--out", str(out), *SMALL)
    # it read "seq_len: expected at most -1 (the validation split has 1 tokens), got 128"
    assert line.startswith("Error: --data: expected at least 2,600 tokens, for one sequence of --seq-len 128 in each "
                           "of the training and validation (last 5%) splits, got text: ")
    assert line.endswith(": 12 tokens") and not out.exists()


def test_a_seq_len_over_a_limit_names_every_limit_at_once(tmp_path):
    (tmp_path / "d.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 1000)  # 44,000 tokens
    limits = (f"the least of 2,198 (--data text: {tmp_path / 'd.txt'} (1 file, 44,000 bytes, sha256 ")
    # it named the data's limit at 1000000, then the model's at 100000 (the tiny model's max positions: 1024)
    for seq_len, least in (("1000000", "1,024"), ("100000", "1,024"), ("1500", "1,024")):
        line = _one_line("train", "--data", str(tmp_path / "d.txt"), "--seq-len", seq_len,
                         "--out", str(tmp_path / "out"), *SMALL)
        assert line.startswith(f"Error: --seq-len: expected at most {least}, {limits}"), line
        assert line.endswith(f"and 1,024 (the model's max positions), got {int(seq_len):,}"), line
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    # it was a bare "FileExistsError: [Errno 17] File exists"
    assert _one_line("train", "--out", str(tmp_path / "f"), "--seq-len", "16", *SMALL) == (
        f"Error: --out: expected a directory lowprec can write, got '{tmp_path / 'f'}', an existing file")


def test_resume_without_a_run_directory_is_refused_and_makes_nothing(tmp_path):
    out = tmp_path / "none"
    # it made the directory and its lock file, then said there was no checkpoint
    assert _one_line("train", "--out", str(out), "--resume", "--seq-len", "16", *SMALL) == (
        f"Error: --resume: expected --out naming the directory of the run to continue, got --out '{out}', which "
        "does not exist (start without --resume)")
    assert not out.exists()


def test_a_resume_with_another_model_names_both(tmp_path):
    out = str(tmp_path / "run")
    assert CliRunner().invoke(main, ["train", "--out", out, "--seq-len", "16", *SMALL]).exit_code == 0
    line = _one_line("train", "--out", out, "--resume", "--model", "small", "--seq-len", "16", "--steps", "2",
                     *SMALL[2:])
    # it read "expected the model the checkpoint was trained on (same parameter names and shapes), got a different one"
    assert line == ("Error: model: expected the model the checkpoint was trained on, preset 'tiny' (1,672,896 "
                    "parameters), got preset 'small' (12,786,048 parameters)")
