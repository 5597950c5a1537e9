"""The Triton kernels run on the CPU through Triton's interpreter in these tests.

The interpreter is chosen when a kernel is decorated, so the switch is set here, before any test
module of this folder imports ``lowprec.kernels.triton_*``. On a machine with a GPU the same kernels
are checked at full size by ``benchmarks/bench_quant.py``.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
