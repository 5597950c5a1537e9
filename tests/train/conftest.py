"""Training tests run torch on one thread.

CI runs the suite as two pytest workers on two cores; torch's default of one thread per core then
puts four busy threads on two cores, and the many small element-wise kernels of emulated
quantization slow down tenfold while the threads wait on each other.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
