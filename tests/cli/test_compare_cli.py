"""``lowprec compare`` tells how far it is while it runs: which recipe of how many, the share of the
whole comparison done, and tokens/s, before a recipe ends."""
from __future__ import annotations

from click.testing import CliRunner

from lowprec.cli import main
from lowprec.cli.compare_cmd import ProgressLines
from lowprec.train.compare import Progress


def test_a_line_every_tenth_of_a_recipe_with_the_overall_share_and_median_tokens_per_s(capsys):
    lines = ProgressLines(n_recipes=2, steps=20)
    for index, recipe in enumerate(["bf16", "mxfp8"]):
        for step in range(1, 21):
            lines.step(Progress(recipe, index, 2, 20, {"step": step, "loss": 1.0 / step,
                                                       "tokens_per_s": 100.0 * (index + 1) * step}))
    out = capsys.readouterr().err.splitlines()
    assert len(out) == 20  # every second step of 20, per recipe
    assert out[0] == "[1/2] bf16 step 2/20 (5% of the comparison): loss 0.5000, 150 tokens/s"
    assert out[9] == "[1/2] bf16 step 20/20 (50% of the comparison): loss 0.0500, 1,050 tokens/s"
    # a new recipe: its own rates, from its first step
    assert out[10] == "[2/2] mxfp8 step 2/20 (55% of the comparison): loss 0.5000, 300 tokens/s"
    assert out[-1] == "[2/2] mxfp8 step 20/20 (100% of the comparison): loss 0.0500, 2,100 tokens/s"


def test_compare_prints_progress_before_each_recipe_ends(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--recipes", "bf16,fp8-current", "--steps", "2", "--batch-size",
                                       "2", "--seq-len", "16", "--val-batches", "1", "--no-tensorboard", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in lines] == [
        "[1/2] bf16 step 1/2 (25% of the comparison)", "[1/2] bf16 step 2/2 (50% of the comparison)", "[1/2] bf16",
        "[2/2] fp8-current step 1/2 (75% of the comparison)", "[2/2] fp8-current step 2/2 (100% of the comparison)",
        "[2/2] fp8-current"]
    assert all(line.endswith(" tokens/s") for line in lines)
