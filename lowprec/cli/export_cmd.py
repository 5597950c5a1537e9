"""``lowprec export RUN_DIR|CHECKPOINT --format F --out DIR``: a trained run written in a serving layout."""
from __future__ import annotations

from pathlib import Path

import click

from lowprec.cli.app import main


@main.command("export")
@click.argument("source", metavar="RUN_DIR|CHECKPOINT")
@click.option("--format", "fmt", required=True,
              help="hf (BF16), fp8 (DeepSeek-V3 / Qwen-FP8 128x128 blocks), or another format "
                   "lowprec.export.formats() lists (compressed-tensors, modelopt-nvfp4, mxfp4).")
@click.option("--scheme", default=None, help="The format's scheme, for a format that has schemes "
              "(compressed-tensors: fp8-dynamic, fp8-block, nvfp4, mxfp4, mxfp8).")
@click.option("--out", required=True, help="The directory to write (new or empty; see --overwrite).")
@click.option("--model", "model_spec", default=None,
              help="The Hugging Face config file or directory the run trained, where its parameter shapes are "
                   "no preset's (a preset is found by its shapes).")
@click.option("--overwrite", is_flag=True, help="Replace --out if it holds files.")
@click.option("--calibrate", "n_calibrate", type=int, default=None, metavar="N",
              help="Calibrate activation scales on N batches of the run's validation data (or of --data), for "
                   "formats that store them (compressed-tensors nvfp4, modelopt-nvfp4: full NVFP4 instead of "
                   "weight-only).")
@click.option("--data", "data_path", default=None,
              help="With --calibrate: the data to calibrate on, where the run's is not the embedded corpus.")
@click.option("--json", "as_json", is_flag=True, help="Print the export report as JSON.")
def export_cmd(source: str, fmt: str, scheme: str | None, out: str, model_spec: str | None, overwrite: bool,
               n_calibrate: int | None, data_path: str | None, as_json: bool) -> None:
    """Write the newest checkpoint of a run (or a given checkpoint) as a Hugging Face model in --format: the
    trained low-precision weights as they were where they fit the format, else quantized from the FP32
    masters; the report says which, per layer (also in DIR/export_report.json)."""
    from lowprec._checks import fail
    from lowprec.export import export, get_layout  # the export's imports: only this command pays for them
    from lowprec.export.directory import check_out
    from lowprec.export.run_data import calibration_batches
    from lowprec.export.source import load_trained

    layout = get_layout(fmt, scheme)  # a bad --format or --scheme is refused before the checkpoint is read
    if n_calibrate is not None and n_calibrate < 1:
        fail("--calibrate", "a positive number of batches", n_calibrate)
    if data_path is not None and n_calibrate is None:
        fail("--data", "--calibrate N with it (--data is the data to calibrate on)", repr(data_path))
    check_out(Path(out), overwrite, "--out")
    trained = load_trained(source, model_spec)
    batches, used = None, None
    if n_calibrate is not None:  # a format without calibrated activations only notes it: no data is read for it
        batches, used = calibration_batches(trained, n_calibrate, data_path) if getattr(
            layout, "calibrates", False) else ((), None)
    report = export(trained.model, out, fmt, scheme, masters=trained.masters, overwrite=overwrite,
                    trained_on=trained.trained_on, calibrate=batches)
    if as_json:
        click.echo(report.to_json())
        return
    click.echo(f"{source}: step {trained.step} of {trained.spec}, trained in {trained.recipe} on "
               f"{trained.trained_on}")
    if used is not None:
        click.echo(used)
    click.echo(str(report))

