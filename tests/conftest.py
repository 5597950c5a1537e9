"""Shared test fixtures. The helpers themselves live in ``tests/helpers.py`` so tests can import them."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import SQNR_FLOORS, sqnr

# Triton's kernels run on the CPU through its interpreter in these tests (tests/kernels, tests/train, ...).
# The switch must be set before anything imports triton: Triton decorates its own standard functions
# (tl.cdiv, ...) when it is first imported, for the interpreter only if this is set then, and libraries the tests import
# (lightning, compressed-tensors) import triton. No route picks Triton for a CPU tensor unless a test
# forces it, so the switch changes nothing else.
os.environ["TRITON_INTERPRET"] = "1"

# CI runs the suite as two pytest workers on two cores; torch's default of one thread per core would
# put four busy threads on two cores, and the many small element-wise kernels of emulated
# quantization slow down several-fold while the threads wait on each other.
torch.set_num_threads(1)

# Inductor's CPU code generation inlines an element-wise chain into each of its readers until the chain holds 50
# operations (30 on a GPU, and 12 reads instead of 8); the reference casts' rounding chains then make C++ kernels
# of tens of kilobytes whose generation took most of an inductor-compiled test's time. Storing a buffer past 8
# operations (and 8 reads) halves it (the tensor-parallel run with --compile: 129 s -> 70 s). It changes which
# intermediates are stored, each in its own dtype as eager stores it, not what is computed. Ranks forked by the
# tests inherit it; a torchrun subprocess compiles with inductor's defaults. (Imported here, after the switch above:
# inductor's config imports triton.)
import torch._inductor.config as inductor_config  # noqa: E402

inductor_config.realize_opcount_threshold = 8
inductor_config.realize_acc_reads_threshold = 8


WARNING_MODULES = ("lowprec.convert", "lowprec.integrations.conversion", "lowprec.policy", "lowprec.telemetry.sample",
                   "lowprec.unseen")
"""The modules that define lowprec's warning classes (``tests/test_conftest.py`` holds the list to the code)."""


def pytest_configure(config):
    """In pytest-xdist's controller, import lowprec's warning classes before any worker reports one. The
    controller imports a reported warning's module from one thread per worker; two workers reporting lowprec
    warnings at once made two threads import lowprec together, and one saw a partially initialized module
    (an ImportError that took a worker down)."""
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        import importlib

        for name in WARNING_MODULES:
            importlib.import_module(name)


@pytest.fixture(name="triton_cpu")
def triton_cpu_fixture(monkeypatch):
    """The CPU taken for a device that runs Triton: plans route the casts to the kernels, which run through
    Triton's interpreter (set above), opaque operators in a compiled graph as on a GPU."""
    import dataclasses
    import importlib

    route_module = importlib.import_module("lowprec.kernels.route")  # the package exports a function of that name
    plan_module = importlib.import_module("lowprec.nn.plan")
    cpu = route_module.capability("cpu")
    monkeypatch.setattr(route_module, "capability", lambda device: dataclasses.replace(cpu, triton=True))
    plan_module.operand_plan.cache_clear()
    plan_module.layer_plan.cache_clear()
    yield
    plan_module.operand_plan.cache_clear()
    plan_module.layer_plan.cache_clear()


@pytest.fixture(name="sqnr")
def sqnr_fixture():
    """:func:`tests.helpers.sqnr`, for tests that prefer a fixture to an import."""
    return sqnr


@pytest.fixture(name="sqnr_floors")
def sqnr_floors_fixture() -> dict[str, float]:
    """A copy of :data:`tests.helpers.SQNR_FLOORS`, so a test cannot change the shared one."""
    return dict(SQNR_FLOORS)


@pytest.fixture(name="fake_cuda")
def fake_cuda_fixture(monkeypatch):
    """``fake_cuda((name, (major, minor), memory_gb), ...)`` makes torch report these CUDA devices, so
    the device lookups (``lowprec.kernels.capability``, ``lowprec info``) run on a CPU-only machine."""
    import importlib
    from types import SimpleNamespace

    cap = importlib.import_module("lowprec.kernels.capability")
    cap._capability.cache_clear()

    def install(*devices: tuple[str, tuple[int, int], float]) -> None:
        props = [SimpleNamespace(name=name, major=sm[0], minor=sm[1], total_memory=int(gb * 1e9))
                 for name, sm, gb in devices]
        index = lambda d: d.index if isinstance(d, torch.device) else int(d)  # noqa: E731
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[index(d)])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: props[index(d)].name)
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda d: (props[index(d)].major, props[index(d)].minor))
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(cap, "_KNOWN", {})

    yield install
    cap._capability.cache_clear()  # the fake devices' capabilities must not outlive the test
