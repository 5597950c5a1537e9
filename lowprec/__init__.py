"""lowprec: train language models in low precision (FP8, MX, NVFP4) with PyTorch."""
from lowprec import formats

__version__ = "0.1.0"
__all__ = ["formats", "__version__"]
