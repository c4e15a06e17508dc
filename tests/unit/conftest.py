"""Fixtures of the in-process tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def train_group(tmp_path_factory):
    """A 1-rank gloo world plus a separate group over it (so nothing uses the default group)."""
    owns_world = not dist.is_initialized()
    if owns_world:  # a file rendezvous: no port to race the slow tier's launches for (run_tests.sh runs both)
        store = tmp_path_factory.mktemp("rendezvous") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    group = dist.new_group([0])
    yield group
    if owns_world:
        dist.destroy_process_group()
