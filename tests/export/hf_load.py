"""Loading an exported directory with transformers on a CPU, as a user without an FP8 or FP4 GPU does."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def load_causal_lm(path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` in evaluation mode, its CPU paths' warnings
    silenced. An ``mxfp4`` checkpoint (GPT-OSS's layout) is loaded dequantized, as its quantizer's message
    advises for a CPU: from transformers 5.25 on, with Triton 3.5 and the ``kernels`` package installed (a
    dependency of transformers since), transformers fetches its MXFP4 kernels from the Hugging Face Hub
    instead, which an offline machine cannot (and which does not trust the repository without
    ``trust_remote_code``); before, it dequantized on a CPU by itself."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()  # the CPU paths warn that they dequantize
    config = json.loads((Path(path) / "config.json").read_text())
    extra = {}
    if config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **extra).eval()
