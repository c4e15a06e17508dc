"""A sharded weight's slice of the draw its whole tensor would get (lingua/parallel/sharded_init.py): the same
numbers and the same generator state as torch's `nn.init.trunc_normal_` on the whole tensor."""

import pytest
import torch
from torch import nn

from lingua.parallel import sharded_init


@pytest.mark.timeout(30)
def test_the_probe_goes_through_the_redraws_and_finds_torchs_draws_on_this_torch():
    probe = torch.empty(sharded_init.PROBE_SHAPE).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(
        sharded_init.PROBE_SEED))
    assert (probe.abs() > 0.06).sum() >= 5  # rejected in the first round: the probe checks the redraw rounds too
    assert sharded_init.draws_like_torch(torch.device("cpu"), torch.float32)
    assert sharded_init.draws_like_torch(torch.device("cpu"), torch.bfloat16)
    assert not sharded_init.draws_like_torch(torch.device("meta"), torch.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape, parts", [((97, 64), 3), ((1000, 37), 2), ((5,), 2), ((2, 300_000), 1)])
def test_each_part_holds_torchs_numbers_and_the_generator_ends_where_torchs_does(shape, parts):
    """Row blocks as FSDP's Shard(0) cuts them (torch.chunk): each drawn alone from the same generator state."""
    std = 0.37
    whole_generator = torch.Generator().manual_seed(3)
    whole = torch.empty(shape)
    nn.init.trunc_normal_(whole, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=whole_generator)
    for index in range(parts):
        generator = torch.Generator().manual_seed(3)
        local = torch.full_like(torch.chunk(torch.empty(shape), parts)[index], float("inf"))  # no draw left in it
        sharded_init._draw_slice(shape, local, std, generator, lambda full: torch.chunk(full, parts)[index])
        assert torch.equal(local, torch.chunk(whole, parts)[index])
        assert torch.equal(generator.get_state(), whole_generator.get_state())  # the next weight's draws agree too
