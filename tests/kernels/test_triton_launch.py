"""The launch cache: a launch whose site and argument specialisation it has met goes straight to the kernel
Triton compiled for them, with every parameter in order; anything else takes Triton's ordinary launch.

No GPU here: a stand-in kernel records which path each launch took and with what."""
import inspect

import pytest
import torch

from lowprec.kernels import triton_launch


class _Compiled:
    function = object()

    def __init__(self, log, serial):
        self.log, self.serial = log, serial

    def __getitem__(self, grid):
        assert len(grid) == 3  # Triton's CompiledKernel[grid] reads grid[0..2]

        def runner(*args):
            if self.fail:
                raise TypeError("function takes exactly 3 arguments (5 given)")
            self.log.append(("direct", grid, args, self.serial))
        return runner

    fail = False


class _Kernel:
    """Parameters (x_ptr, n, A: constexpr, B: constexpr = 7), as Triton's JITFunction exposes them."""

    def __init__(self, compiled=True):
        def f(x_ptr, n, A, B=7):
            pass
        self.signature = inspect.signature(f)
        self.arg_names = list(self.signature.parameters)
        self.log, self.compiled = [], compiled

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("bound", grid, args, kw))
            return _Compiled(self.log, len(self.log)) if self.compiled else None
        return launch


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    triton_launch._CACHE.clear()
    triton_launch._REFUSED.clear()
    yield
    triton_launch._CACHE.clear()
    triton_launch._REFUSED.clear()


def test_second_launch_goes_to_the_compiled_kernel_with_every_parameter_in_order():
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, 64), {"A": 3, "num_warps": 4}, site=("plan", 1))
    triton_launch.run(k, (4,), (x, 64), {"A": 3, "num_warps": 4}, site=("plan", 1))
    assert k.log[0] == ("bound", (4,), (x, 64), {"A": 3, "num_warps": 4})
    kind, grid, args, serial = k.log[1]
    assert (kind, grid, serial) == ("direct", (4, 1, 1), 1)
    assert args[0] is x and args[1:] == (64, 3, 7)  # constants after the runtime arguments, defaults filled


def test_each_entry_launches_the_kernel_compiled_for_it():
    k, x = _Kernel(), torch.zeros(64)
    for site in (1, 2, 1, 2):
        triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=site)
    # compiled at the first and second launches (serials 1 and 2), then each site gets its own
    assert [(e[0], e[-1] if e[0] == "direct" else None) for e in k.log] == [
        ("bound", None), ("bound", None), ("direct", 1), ("direct", 2)]


@pytest.mark.parametrize("first,then", [(1, 17), (17, 1), (1, True), (16, 24), (1, 1.0), (64, 2**31 + 64),
                                        (2**31 + 64, 2**63 + 64)])
def test_ints_triton_specialises_apart_are_never_confused(first, then):
    # 1 becomes a constant, 16 | n sets divisibility, a bool is u1, a float fp32, 2^31 + 64 is i64, 2^63 + 64 u64
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, first), {"A": 3}, site=0)
    triton_launch.run(k, (4,), (x, then), {"A": 3}, site=0)
    assert [e[0] for e in k.log] == ["bound", "bound"]


@pytest.mark.parametrize("first,then", [(64, 4096), (17, 33), (2**31 + 16, 2**31 + 4096)])
def test_ints_triton_binds_alike_share_the_compiled_kernel_whatever_the_grid(first, then):
    """A size that changes at each call (experts' routed tokens) but not its class (1 or not, 16 dividing
    it or not, i32/i64/u64) launches the kernel already compiled, on the grid of this launch."""
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, first), {"A": 3}, site=0)
    triton_launch.run(k, (9, 2), (x, then), {"A": 3}, site=0)
    assert [e[0] for e in k.log] == ["bound", "direct"]
    assert k.log[1][1] == (9, 2, 1) and k.log[1][2][1] == then


def test_constants_derived_from_sizes_are_never_confused():
    """Two launches of one site whose sizes fall in one int class but whose caller derived another constant
    from them (a tile's evenness) launch the kernel compiled for each constant."""
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, 64), {"A": 1}, site=0)  # 64 rows: whole tiles of 64
    triton_launch.run(k, (4,), (x, 80), {"A": 0}, site=0)  # 80 rows: a partial tile, same int class
    triton_launch.run(k, (4,), (x, 128), {"A": 1}, site=0)
    assert [e[0] for e in k.log] == ["bound", "bound", "direct"]
    assert k.log[1][3] == {"A": 0} and k.log[2][2][2] == 1


@pytest.mark.parametrize("change", ["site", "int", "dtype", "alignment", "device"])
def test_a_launch_triton_would_bind_differently_is_bound_again(change, monkeypatch):
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=1)
    args, grid, site = (x, 64), (4,), 1
    if change == "site":
        site = 2
    elif change == "int":
        args = (x, 65)  # 64 is divisible by 16, 65 is not: Triton specialises on it
    elif change == "dtype":
        args = (torch.zeros(64, dtype=torch.float64), 64)
    elif change == "alignment":
        args = (x[1:], 64)  # 4 bytes past an aligned address
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    triton_launch.run(k, grid, args, {"A": 3}, site=site)
    assert [e[0] for e in k.log] == ["bound", "bound"]


def test_same_specialisation_other_tensor_uses_the_cache():
    k = _Kernel()
    triton_launch.run(k, (1,), (torch.zeros(64), 32), {"A": 1}, site=0)
    y = torch.ones(64)
    triton_launch.run(k, (1,), (y, 32), {"A": 1}, site=0)
    assert k.log[1][0] == "direct" and k.log[1][2][0] is y


def test_interpreted_kernels_are_never_cached():
    k = _Kernel(compiled=False)  # the interpreter's launch returns no compiled kernel
    for _ in range(3):
        triton_launch.run(k, (1,), (torch.zeros(4), 4), {"A": 1}, site=0)
    assert [e[0] for e in k.log] == ["bound"] * 3
    assert not triton_launch._CACHE


def test_an_error_after_the_first_direct_launch_is_the_callers(monkeypatch):
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)
    triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)  # direct, accepted
    monkeypatch.setattr(_Compiled, "fail", True)
    with pytest.raises(TypeError):  # not taken for a refusal: the cache stays on and the error surfaces
        triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)
    assert not triton_launch._REFUSED and triton_launch._CACHE


def test_a_launcher_that_refuses_the_arguments_turns_the_cache_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(_Compiled, "fail", True)
    k, x = _Kernel(), torch.zeros(64)
    triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)
    with pytest.warns(UserWarning, match="ordinary launch path"):
        triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)  # the direct launch raises: launched anyway
    triton_launch.run(k, (4,), (x, 64), {"A": 3}, site=0)
    assert [e[0] for e in k.log] == ["bound"] * 3 and not triton_launch._CACHE


@pytest.mark.parametrize("cuda", [True, False])
def test_the_casts_launch_through_the_cache_on_a_gpu_only(cuda, monkeypatch):
    from lowprec.kernels import triton_ops

    seen = []
    monkeypatch.setattr(triton_launch, "run", lambda kernel, grid, args, meta, site: seen.append(("cache", meta, site)))
    k = _Kernel()
    x = type("X", (), {"is_cuda": cuda})()
    triton_ops._launch(k, (2,), (1, 2), {"A": 5}, x, (9, 9), hw=True)
    triton_ops._launch(k, (2,), (1, 2), {"A": 5}, x, (9, 9))  # a kernel without HW (the amax kernel)
    if cuda:
        assert seen == [("cache", {"A": 5, "HW": True}, (9, 9)), ("cache", {"A": 5}, (9, 9))] and not k.log
    else:
        assert not seen and [e[3] for e in k.log] == [{"A": 5, "HW": False}, {"A": 5}]


def _in_a_thread(fn):
    """``fn()`` on a new thread (Triton's allocator is a context variable: a thread starts without one, as
    autograd's backward thread does), its result or exception returned."""
    import threading

    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_device_workspace_gives_a_thread_without_an_allocator_one_from_torch():
    from triton.runtime import _allocation

    def run():
        before = _allocation._allocator.get()
        triton_launch.device_workspace()
        return before, _allocation._allocator.get()

    before, after = _in_a_thread(run)
    assert isinstance(before, _allocation.NullAllocator)
    assert after is triton_launch._torch_workspace


def test_device_workspace_keeps_an_allocator_already_set():
    import triton
    from triton.runtime import _allocation

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    def run():
        triton.set_allocator(mine)
        triton_launch.device_workspace()
        return _allocation._allocator.get()

    assert _in_a_thread(run) is mine
