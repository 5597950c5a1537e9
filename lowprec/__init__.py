"""lowprec: train language models in low precision (FP8, MX, NVFP4) with PyTorch.

    report = lowprec.convert(model, "mxfp8")   # swap linears, bind a recipe
    print(report)                              # what became what, and why
    with lowprec.autocast(enabled=False):      # a region in high precision
        ...
"""
from lowprec import formats, optim, quant, recipes
from lowprec.autocast import autocast
from lowprec.convert import ConversionReport, convert, recipe_paths
from lowprec.policy import Policy
from lowprec.policy_file import load_policy, save_policy
from lowprec.quant import QuantizedTensor, dequantize, quantize
from lowprec.recipes import Recipe

__version__ = "0.1.0"
__all__ = [
    "ConversionReport", "Policy", "QuantizedTensor", "Recipe", "autocast", "convert", "dequantize", "formats",
    "load_policy", "optim", "quant", "quantize", "recipe_paths", "recipes", "save_policy", "__version__",
]
