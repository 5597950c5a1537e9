"""lowprec: train language models in low precision (FP8, MX, NVFP4) with PyTorch.

    report = lowprec.convert(model, "mxfp8")   # swap linears, bind a recipe
    print(report)                              # what became what, and why
    with lowprec.autocast(enabled=False):      # a region in high precision
        ...
    lowprec.export(model, "out", format="fp8") # write it as serving engines load it
"""
from lowprec import formats, optim, quant, recipes
from lowprec.autocast import autocast
from lowprec.convert import ConversionReport, convert, recipe_paths
from lowprec.policy import Policy
from lowprec.policy_file import load_policy, save_policy
from lowprec.quant import QuantizedTensor, dequantize, quantize
from lowprec.recipes import Recipe

__version__ = "0.1.0"


def __getattr__(name: str):
    # lowprec.export (a callable package: lowprec.export(model, out_dir, format)) is imported when first
    # asked for, so that `import lowprec` does not pay for the trainer it builds on
    if name == "export":
        import importlib

        return importlib.import_module("lowprec.export")
    raise AttributeError(f"module 'lowprec' has no attribute {name!r}")

__all__ = [
    "ConversionReport", "Policy", "QuantizedTensor", "Recipe", "autocast", "convert", "dequantize", "export", "formats",
    "load_policy", "optim", "quant", "quantize", "recipe_paths", "recipes", "save_policy", "__version__",
]
