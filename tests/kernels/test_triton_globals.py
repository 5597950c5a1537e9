"""Every Triton kernel reads module-level numbers only as ``tl.constexpr``.

Compiled Triton refuses a kernel that reads a plain int, float or bool global ("Cannot access global
variable ... from within @jit'ed function"), while the interpreter the CPU tests run through accepts it: a
kernel can pass every test here and fail to compile on the GPU. This reads each kernel's names instead.
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import lowprec.kernels  # noqa: E402

PLAIN = 7  # a plain global, as a kernel must not read it


def plain_globals(kernel) -> list[str]:
    """The names ``kernel`` reads that are module-level ints, floats or bools not wrapped in tl.constexpr."""
    fn = kernel.fn
    return [n for n in fn.__code__.co_names if isinstance(fn.__globals__.get(n), (int, float, bool))
            and not isinstance(fn.__globals__[n], tl.constexpr)]


def _is_kernel(obj) -> bool:
    """A ``@triton.jit`` function: compiled, or wrapped for the interpreter (``TRITON_INTERPRET=1``)."""
    return type(obj).__module__.startswith("triton.runtime") and callable(getattr(obj, "fn", None))


def _kernels():
    names = [f"lowprec.kernels.{m.name}" for m in pkgutil.iter_modules(lowprec.kernels.__path__)]
    for name in [*names, "lowprec.optim.fused"]:
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if _is_kernel(obj) and obj.fn.__module__ == name:
                yield f"{name}.{attr}", obj


KERNELS = dict(_kernels())


def test_the_scan_finds_the_kernels_and_a_plain_global():
    assert len(KERNELS) >= 20 and "lowprec.kernels.triton_tiles.cast_kernel" in KERNELS

    @triton.jit
    def reads_plain(x_ptr):
        tl.store(x_ptr, PLAIN)

    assert plain_globals(reads_plain) == ["PLAIN"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_reads_no_plain_global(name):
    assert plain_globals(KERNELS[name]) == [], f"{name}: pass these as tl.constexpr parameters or wrap them"
