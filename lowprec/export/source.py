"""A trained model rebuilt from a run's checkpoint, ready to export.

[Note: what a checkpoint says about its model]
A checkpoint holds the run's settings (recipe, dtype, policy, FP8 weights: ``TrainConfig``), the parameter
shapes, the model's state and the optimizer's (with the FP32 masters of BF16 or FP8 parameters). It does not
name the model it trained. A preset is found by its shapes, as resuming does (the vocabulary is the
embedding's first dimension); a model built from a Hugging Face config has no preset's shapes, and its config
must be named (``model``, ``--model``), which is then checked against the shapes. The model is rebuilt as the
trainer built it (cast to the run's dtype, converted with the run's recipe, policy and FP8 weights), its state
loaded, and the masters taken from the optimizer's state by parameter name. It is rebuilt on the CPU; the
device the run trained on is kept, since which layers ran quantized can depend on it.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowprec
from lowprec import recipes
from lowprec._checks import fail
from lowprec.distributed.named_state import optimizer_state_by_name
from lowprec.telemetry.control import ControlConfig
from lowprec.train.checkpoint import CheckpointError, load_checkpoint
from lowprec.train.config import TrainConfig
from lowprec.train.loop import build_optimizer
from lowprec.train.model import PRESETS, Transformer
from lowprec.train.models import describe_shapes, load_model


@dataclass(frozen=True, slots=True)
class TrainedModel:
    """A run's model as its checkpoint left it (see [Note: what a checkpoint says about its model])."""

    model: nn.Module
    masters: dict[str, torch.Tensor | None]
    """FP32 masters by parameter name, where the optimizer keeps them (else the entry is None or absent)."""
    recipe: str
    trained_on: str
    """The device the run trained on (``cuda``, ``cpu``)."""
    step: int
    spec: str
    """The preset's name or the Hugging Face config's path."""
    config: TrainConfig | None = None
    """The run's settings, as rebuilt here (on the CPU)."""
    data: dict[str, Any] | None = None
    """What the checkpoint records of the run's data: its ``source`` and ``fingerprint``."""


def _checkpoint_path(path: str | Path) -> Path:
    """A checkpoint's JSON or directory, or a run directory (its ``checkpoints``). A checkpoint's tensors
    file (``step_*.safetensors``) stands for the JSON beside it, which holds its checksum and settings."""
    p = Path(path)
    if not p.exists():
        fail("checkpoint", "a run directory of lowprec train or a checkpoint (step_*.json or its directory)",
             f"{str(p)!r}, which does not exist", FileNotFoundError)
    if p.is_file() and p.suffix == ".safetensors":
        if not p.with_suffix(".json").is_file():
            fail("checkpoint", f"a checkpoint's step_*.json (the tensors file {p.name} is read through it)",
                 f"{str(p)!r}, with no {p.with_suffix('.json').name} beside it", FileNotFoundError)
        return p.with_suffix(".json")
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def _preset_for(shapes: dict[str, list[int]]) -> str | None:
    """The preset whose parameters have ``shapes`` with the embedding's vocabulary, or None."""
    vocab = shapes.get("tok_embeddings.weight", [0])[0]
    for name, cfg in PRESETS.items():
        with torch.device("meta"):  # shapes only
            m = Transformer(replace(cfg, vocab_size=max(vocab, 1)))
        if {k: list(p.shape) for k, p in m.named_parameters()} == shapes:
            return name
    return None


def _train_config(saved: dict[str, Any], where: str) -> TrainConfig:
    """The run's settings as a config that rebuilds its model here (one process, on the CPU, eager)."""
    known = {f.name for f in fields(TrainConfig)}
    try:
        kw = {k: v for k, v in saved.items() if k in known}
        kw["control"] = ControlConfig(**saved.get("control", {}))
        return TrainConfig(**{**kw, "device": "cpu", "parallel": "none", "compile": None})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: expected a run's settings in {where}, got {e}") from e


def _rebuild(spec: str, shapes: dict[str, list[int]], cfg: TrainConfig) -> nn.Module:
    vocab = shapes.get("tok_embeddings.weight", [256])[0]
    model, _ = load_model(spec, vocab_size=vocab)
    mine = {k: list(p.shape) for k, p in model.named_parameters()}
    if mine != shapes:
        fail("model", f"the model the checkpoint was trained on, {describe_shapes(shapes)}",
             f"{spec!r}, {describe_shapes(mine)}")
    model.to(dtype=cfg.torch_dtype)
    policy = dataclasses.replace(cfg.policy_object() or lowprec.Policy(), saved_activations=cfg.saved_activations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulation and small-layer notes: the export report says what matters
        lowprec.convert(model, recipes.get(cfg.recipe), policy, fp8_weights=cfg.fp8_weights)
    return model


def load_trained(path: str | Path, model: str | None = None) -> TrainedModel:
    """The model of the newest checkpoint of a run directory, or of a checkpoint (its JSON or directory),
    rebuilt with its weights and masters (see [Note: what a checkpoint says about its model]). ``model``: the
    Hugging Face config the run trained, where its shapes are no preset's."""
    step, state = load_checkpoint(_checkpoint_path(path))
    where = repr(str(path))
    try:
        info = state["run"]
        saved, shapes = dict(info["train_config"]), {k: list(v) for k, v in info["param_shapes"].items()}
        model_state, optim_state = state["model"], state["optimizer"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint: expected a run's settings, model and optimizer in {where}, "
                              f"got {e!r}") from e
    spec = model if model is not None else _preset_for(shapes)
    if spec is None:
        fail("model", "the Hugging Face config the run trained (--model PATH): its parameter shapes are no "
             "preset's", f"none for {describe_shapes(shapes)}")
    cfg = _train_config(saved, where)
    net = _rebuild(spec, shapes, cfg)
    opt = build_optimizer(net, cfg, recipes.get(cfg.recipe))
    try:
        net.load_state_dict(model_state)
        masters = optimizer_state_by_name(net, opt, optim_state, where)["master_weights"]
    except (KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint: expected state that fits {spec!r} in {where}, got "
                              f"{' '.join(str(e).split())[:200]}") from e
    opt.remove_hooks()
    return TrainedModel(net, dict(masters), cfg.recipe if isinstance(cfg.recipe, str) else cfg.recipe.name,
                        str(saved.get("device", "cpu")), step, spec, cfg,
                        dict(info["data"]) if isinstance(info.get("data"), dict) else None)
