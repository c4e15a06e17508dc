"""Fixtures of the in-process tests."""

import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def train_group():
    """A 1-rank gloo world plus a separate group over it (so nothing uses the default group)."""
    owns_world = not dist.is_initialized()
    if owns_world:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0])
    yield group
    if owns_world:
        dist.destroy_process_group()
