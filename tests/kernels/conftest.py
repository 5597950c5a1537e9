"""The Triton kernels run on the CPU through Triton's interpreter in these tests: ``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` before anything imports triton (the interpreter is chosen when a kernel, and
Triton's own standard functions, are decorated). On a machine with a GPU the same kernels are checked at
full size by ``benchmarks/bench_quant.py``.
"""
