"""The loss tests' tensors are tiny: a thread pool's wake-ups cost more than the math (10+ ms an op on a busy
machine), so every test here runs on one thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
