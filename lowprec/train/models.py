"""Which model to train: a preset of the reference decoder, or a Hugging Face causal LM.

A Hugging Face model comes from a local directory (``config.json``, and weights if present) or a
``config.json`` file, through ``transformers`` (the optional ``hf`` extra). It is wrapped so that,
like the reference model, it maps token ids (B, T) to logits (B, T, vocab); its LM head keeps its
Hugging Face name, ``lm_head``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import nn

from lowprec._checks import fail
from lowprec.train.hf_fields import check_fields
from lowprec.train.model import PRESETS, Transformer, build_model


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    """The preset name or the path it was loaded from."""
    config: dict[str, Any]
    n_params: int

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model takes, as its config states it (None where it states none)."""
        for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
            if isinstance(self.config.get(key), int):
                return self.config[key]
        return None


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM seen as ``tokens -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits  # (B, T, vocab)


def _safetensors_weights(path: Path) -> bool:
    """Whether the directory ``path`` holds weights; refuses pickled ones (``pytorch_model*.bin``), which
    lowprec never loads (unpickling a file can run any code), saying how to convert them."""
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return path.is_dir()
    pickles = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    if pickles:
        convert = (f"python -c \"from transformers import AutoModelForCausalLM as M; "
                   f"M.from_pretrained('{path}').save_pretrained('{path}')\"")
        fail("model", "weights in .safetensors files (lowprec loads no pickled weights)",
             f"{pickles[0]} in {str(path)!r}; convert a checkpoint you trust once with: {convert}")
    return False


try:  # what transformers' config classes raise when a validator refuses a value (huggingface_hub >= 1.0)
    from huggingface_hub.errors import StrictDataclassError as _ValidationError
except ImportError:
    class _ValidationError(Exception):
        """Stands for the error an older huggingface_hub cannot raise."""


def _check_stated_shape(path: Path, transformers: Any) -> None:
    """Refuses a config that leaves out a field of the model's shape, naming them all: transformers would
    fill each from its config class's default (Llama-7B's 32 layers, 11008 wide) without a word."""
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # transformers says what is wrong with the file
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if isinstance(model_type, str) and model_type in transformers.CONFIG_MAPPING:  # else transformers refuses it
        check_fields(cfg, "model", transformers.CONFIG_MAPPING[model_type].attribute_map, got=repr(str(file)))


def _load_hf(path: Path, vocab_size: int, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    has_weights = _safetensors_weights(path)
    try:
        import transformers
    except ImportError:
        fail("model", "a preset or, with the optional 'hf' extra (pip install 'lowprec[hf]') installed, a "
             "Hugging Face config", f"{str(path)!r} but transformers is not installed", ValueError)
    _check_stated_shape(path, transformers)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
        if config.vocab_size < vocab_size:
            fail("model", f"a vocabulary of at least {vocab_size} tokens for this data", config.vocab_size)
        if has_weights:
            # use_safetensors: never a fallback onto pickled weights
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True)
        else:
            torch.manual_seed(seed)  # transformers initialises from the global generator
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, KeyError, TypeError, ValueError, safetensors.SafetensorError, _ValidationError) as e:
        if str(e).startswith("model: expected"):
            raise
        # a config class's validator (hidden size not a multiple of the heads) says why in its cause
        cause = e.__cause__ if isinstance(e, _ValidationError) and e.__cause__ is not None else e
        why = " ".join(str(cause).split()).split(". ")[0].rstrip(".") or type(e).__name__  # its first sentence
        raise ValueError(f"model: expected a Hugging Face causal LM that transformers loads, got {str(path)!r} "
                         f"({why})") from e
    return HFCausalLM(model), config.to_dict()


def describe_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    """The model a state's parameter shapes are: the preset's name where they are one's (built with the
    vocabulary of the first parameter, the embedding), and the parameter count."""
    n = sum(math.prod(shape) for shape in shapes.values())
    vocab = next(iter(shapes.values()), [0])[0] if shapes else 0
    for name, cfg in PRESETS.items():
        with torch.device("meta"):  # shapes only: no storage, no initialisation
            preset = Transformer(replace(cfg, vocab_size=max(vocab, 1)))
        if {k: list(p.shape) for k, p in preset.named_parameters()} == {k: list(v) for k, v in shapes.items()}:
            return f"preset {name!r} ({n:,} parameters)"
    return f"a model of {n:,} parameters in {len(shapes)} tensors"


def check_model_spec(spec: str) -> str:
    """``spec`` if it names a preset or an existing path, else ``ValueError`` listing the presets."""
    if spec not in PRESETS and not Path(spec).exists():
        fail("model", "one of " + ", ".join(map(repr, PRESETS)) + " or a path to a Hugging Face config",
             repr(spec))
    return spec


def load_model(spec: str, *, vocab_size: int = 256, seed: int = 0) -> tuple[nn.Module, ModelSpec]:
    """``spec``: a preset name (``tiny``, ``small``, ``125m``, ``350m``, ``1b``) or a Hugging Face path.

    The reference decoder is built with ``vocab_size`` (the data's) and initialised from ``seed``.
    """
    if spec in PRESETS:
        cfg = replace(PRESETS[spec], vocab_size=vocab_size)
        model: nn.Module = build_model(cfg, seed)
        config = asdict(cfg)
        if cfg.moe is None:  # a dense preset's config reads as it always has
            del config["moe"]
    else:
        model, config = _load_hf(Path(check_model_spec(spec)), vocab_size, seed)
    return model, ModelSpec(name=spec, config=config, n_params=sum(p.numel() for p in model.parameters()))
