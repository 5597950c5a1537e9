"""``lowprec.export(model, out_dir, format)``: a trained model written in a layout serving engines load.

[Note: what an export writes]
The model is walked once (``lowprec.export.walk``) into the Hugging Face architecture it is written as, with
each linear's FP32 master and, where the recipe quantized it, its forward weight cast. Each linear that ran
quantized goes to the format, which writes the trained codes as they are where they are its own (as trained)
and quantizes the master otherwise (from the FP32 master); a linear kept in high precision (by the policy, its
shape, its size, the format) is written as a BF16 ``weight`` and named in the config the format writes.
Embeddings, norms and biases are written in BF16. ``config.json``, ``model.safetensors``, the format's other
files and ``export_report.json`` are written together (see [Note: writing an export atomically] in
``lowprec.export.directory``).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from lowprec._checks import describe, fail
from lowprec.export.calibrate import input_amax
from lowprec.export.directory import check_out, write_directory
from lowprec.export.hf_model import walk_hf
from lowprec.export.layout import LayerWeight, Layout
from lowprec.export.reference import walk_reference
from lowprec.export.registry import get_layout
from lowprec.export.report import KEPT, REPORT_FILE, ExportReport, LayerExport
from lowprec.export.walk import ExportLinear, Masters, WalkedModel
from lowprec.train.model import Transformer
from lowprec.train.models import HFCausalLM

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HP_DTYPE = torch.bfloat16
"""What everything the format does not quantize is written in."""


FP32_TENSORS = ("e_score_correction_bias",)
"""Tensors written in FP32, as their architecture holds them: ERNIE 4.5's routing bias is added to FP32
probabilities to choose the experts, and BF16 would round it (a bias of 0.1 by 2^-11) into another choice."""

def _walk(model: nn.Module, masters: Masters, device: torch.device | None) -> WalkedModel:
    if isinstance(model, Transformer):
        return walk_reference(model, masters, device)
    if isinstance(model, HFCausalLM):
        return walk_hf(model.model, "model.", masters, device)
    if hasattr(model, "config") and hasattr(model.config, "to_dict") and hasattr(model, "lm_head"):
        return walk_hf(model, "", masters, device)  # a transformers causal LM itself
    fail("model", "lowprec's reference Transformer or a Hugging Face causal LM (lowprec.train.models.HFCausalLM "
         "or a transformers PreTrainedModel)", describe(model), TypeError)


def _written(tensors: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {str(t.dtype).removeprefix('torch.')}" for k, t in tensors.items())


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        fail(f"weight {name!r}", "finite values (an export writes no NaN or inf)", "non-finite values")


def _hp_weight(w: LayerWeight) -> torch.Tensor:
    """``w``'s master in BF16, in the order its reader stores it (a fused weight held ``(E, in, out)``
    transposed back)."""
    hp = w.master.to(HP_DTYPE)
    return hp.transpose(1, 2) if w.fused is not None and w.fused.transposed else hp


def _key(layout: Layout, w: LayerWeight, suffix: str) -> str:
    """Where a tensor of ``w`` is stored: ``<module>.<suffix>`` for a module's linear; a fused experts'
    parameter under its own name when it is the plain weight, else as the layout names it (see [Note: fused
    expert weights] in ``lowprec.export.layout``)."""
    if w.fused is None:
        return f"{w.name}.{suffix}"
    if suffix == "weight" and not hasattr(layout, "tensor_name"):
        return w.name
    if not hasattr(layout, "tensor_name"):
        fail("format", "a layout that names the tensors of fused experts (tensor_name)", layout.name)
    return layout.tensor_name(w.name, suffix)


def _linear(lin: ExportLinear, layout: Layout, tensors: dict[str, torch.Tensor]) -> LayerExport:
    """Writes one linear into ``tensors``; its report row."""
    w = lin.weight
    _check_finite(w.name, w.master)
    keeps = getattr(layout, "keeps", None)
    kept = lin.kept or (keeps(w) if keeps is not None else None)
    if kept is not None:
        out, how, reason = {"weight": _hp_weight(w)}, KEPT, kept
        tensors[w.name if w.fused is not None else f"{w.name}.weight"] = out["weight"].contiguous()
    else:
        out, how = layout.write_layer(w)
        reason = lin.note
        if w.fused is not None and w.fused.transposed and set(out) == {"weight"}:
            out = {"weight": out["weight"].transpose(1, 2)}  # a plain weight in the reader's storage order
        tensors.update({_key(layout, w, k): v.contiguous() for k, v in out.items()})
    if lin.bias is not None:
        _check_finite(f"{w.name}.bias", lin.bias)
        tensors[f"{w.name}.bias"] = lin.bias.to(HP_DTYPE)
    return LayerExport(w.name, lin.source, tuple(w.master.shape), _written(out), how, reason)


def _kept_module(row: LayerExport, fused: bool) -> str:
    """The module a config names as not converted: a fused experts' parameter by its experts module."""
    return row.name.rsplit(".", 1)[0] if fused else row.name


def _config(walked: WalkedModel, layout: Layout, kept: list[str]) -> dict:
    config = {**walked.config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    config.update(layout.config(kept))
    return config


def _quantized(walked: WalkedModel, layout: Layout) -> dict[str, str]:
    """The linears ``layout`` will write quantized (neither kept by the walk nor by the format): exported name
    -> name in the model."""
    keeps = getattr(layout, "keeps", None)
    return {lin.weight.name: lin.source for lin in walked.linears
            if lin.kept is None and (keeps is None or keeps(lin.weight) is None)}


def _calibrated(model: nn.Module, walked: WalkedModel, layout: Layout, format: str, scheme: str | None,
                calibrate: Iterable[torch.Tensor] | None, notes: list[str]) -> Layout:
    """``layout`` with each quantized linear's input amax from ``calibrate`` where its activations take a
    calibrated scale (see [Note: calibrating activation scales] in ``lowprec.export.calibrate``); as it is
    otherwise, with a note when batches were given to a format that has no use for them."""
    if calibrate is None:
        return layout
    if not getattr(layout, "calibrates", False):
        notes.append(f"calibrate= given, not used: {layout.name}{f' {scheme}' if scheme else ''} quantizes "
                     "activations at run time (dynamic) or not at all; no calibration was run")
        return layout
    c = input_amax(model, calibrate, _quantized(walked, layout))
    batches = f"{c.batches} batch" + ("" if c.batches == 1 else "es")
    notes.append(f"activation scales calibrated on {batches} ({c.tokens} tokens): each quantized "
                 "linear's input amax (max |x|), taken before its cast in evaluation mode")
    return get_layout(format, scheme, input_amax=c.input_amax)


def export(model: nn.Module, out_dir: str | Path, format: str = "hf", scheme: str | None = None, *,
           masters: Mapping[str, torch.Tensor | None] | None = None, overwrite: bool = False,
           trained_on: str | torch.device | None = None,
           calibrate: Iterable[torch.Tensor] | None = None) -> ExportReport:
    """Write ``model`` (lowprec's reference decoder, or a Hugging Face causal LM; converted by
    ``lowprec.convert`` and trained, or not) into ``out_dir`` in ``format`` (``hf``, ``fp8``, and the formats
    ``lowprec.export.formats()`` lists; ``scheme`` for a format that takes one). See [Note: what an export
    writes].

    ``masters``: FP32 master weights by parameter name (an optimizer's, when the parameters are BF16 or FP8);
    without, each parameter widened to FP32 is its master. ``overwrite``: replace an ``out_dir`` that holds
    files. ``trained_on``: the device the model trained on, when not where it is now: the small-layer rule
    that kept layers in high precision there is judged for that device. ``calibrate``: token batches (int64
    tensors (B, T)) the model runs on to record each quantized linear's input amax, for formats whose
    activations take a calibrated scale (``compressed-tensors --scheme nvfp4``, ``modelopt-nvfp4``: written as
    full NVFP4 then, weight-only without); other formats note that they do not use it.
    Returns the report (also written as ``export_report.json``): each linear, what it was written as, and
    whether its codes are the trained ones, the master's, or it was kept in high precision and why.
    """
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module (lowprec's reference decoder or a Hugging Face causal LM)",
             describe(model), TypeError)
    layout = get_layout(format, scheme)  # an unknown format or scheme is refused before any work
    out = Path(out_dir)
    check_out(out, overwrite)
    device = torch.device(trained_on) if trained_on is not None else None
    taken = Masters(model, masters)
    walked = _walk(model, taken, device)
    taken.check_all_taken()
    calibration_notes: list[str] = []
    layout = _calibrated(model, walked, layout, format, scheme, calibrate, calibration_notes)
    tensors: dict[str, torch.Tensor] = {}
    rows = [_linear(lin, layout, tensors) for lin in walked.linears]
    for name, t in walked.tensors.items():
        _check_finite(name, t)
        tensors[name] = t.to(torch.float32 if name.endswith(FP32_TENSORS) else HP_DTYPE).contiguous()
    fused = {lin.weight.name for lin in walked.linears if lin.weight.fused is not None}
    kept = list(dict.fromkeys([_kept_module(r, r.name in fused) for r in rows if r.how == KEPT]
                              + walked.kept_modules))
    recipe = next((lin.weight.recipe for lin in walked.linears if lin.weight.recipe is not None), None)
    report = ExportReport(format, scheme, str(out), walked.architecture, recipe, rows,
                          [*walked.notes, *calibration_notes])
    fused_written = any(lin.weight.fused is not None and r.how != KEPT for lin, r in zip(walked.linears, rows))
    if fused_written and (note := getattr(layout, "fused_note", None)):
        report.notes.append(note)
    if widened := taken.widened():
        report.notes.append(f"{len(widened)} parameters held in fewer bits than FP32 (the first: {widened[0]}) had no "
                            "master given (masters=): their values as held were taken as their masters")
    config = _config(walked, layout, kept)
    extra = layout.extra_files(kept)
    report.files = sorted([CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE, *extra])

    def fill(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
        (tmp / REPORT_FILE).write_text(report.to_json() + "\n")

    write_directory(out, fill, overwrite)
    return report
