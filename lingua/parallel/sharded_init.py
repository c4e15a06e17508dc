"""A sharded (DTensor) weight's slice of the seeded draw its whole tensor would get, with as little memory as torch
allows: the weights of a student built sharded are those of the whole model, whatever the number of students.

Every rank draws the same full tensor from the same generator (the stream must advance as it would for the whole
model) and keeps its slice. torch's `nn.init.trunc_normal_` (2.13: rejection sampling) holds about three more
tensors of the weight's size while it draws (a redraw, `torch.where`'s result, the masks): 1.2 GiB for a 0.375 GiB
embedding, beside the rank's shards. `trunc_normal_shard_` makes the same draws in the same order into one full
buffer and keeps only this rank's slice and the few rejected places (a little over the weight's size at once),
where a probe shows that this gives torch's own numbers and generator state on this torch, device and dtype; else
torch's own function draws the full tensor (another torch's algorithm: more memory, never other numbers).
Measured: docs/results/2026-12-07-scale-build.md.
"""

from functools import lru_cache, partial
from typing import Callable, Optional

import torch
from torch import nn

PROBE_SHAPE = (4096,)  # at 3 std about 11 draws are rejected: the probe goes through the redraw rounds
PROBE_SEED = 20261207


def trunc_normal_shard_(weight, std: float, generator: Optional[torch.Generator]) -> None:
    """Fill the DTensor `weight` with its slice of `nn.init.trunc_normal_(full, 0, std, -3 std, 3 std, generator)`
    on a full tensor of its shape (no communication: every rank draws the same)."""
    local = weight.to_local()
    if draws_like_torch(local.device, local.dtype):
        _draw_slice(tuple(weight.shape), local, std, generator, partial(my_part, weight))
        return
    full = torch.empty(weight.shape, dtype=local.dtype, device=local.device)
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    local.copy_(my_part(weight, full))


def my_part(weight, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` where the DTensor `weight` places it: a view (`torch.chunk` along each sharded
    mesh dimension in turn, as DTensor's `Shard` splits), or for other placements `distribute_tensor`'s copy."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # see lingua/checkpoint.py

    mesh, coordinate = weight.device_mesh, weight.device_mesh.get_coordinate()
    if not all(type(p) in (Shard, Replicate) for p in weight.placements):
        # src_data_rank=None: every rank holds the same full tensor, so each keeps its part without communicating.
        return distribute_tensor(full, mesh, weight.placements, src_data_rank=None).to_local()
    part = full
    for mesh_dim, placement in enumerate(weight.placements):
        if isinstance(placement, Shard):
            chunks, index = torch.chunk(part, mesh.size(mesh_dim), dim=placement.dim), coordinate[mesh_dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)  # past the rows: none
    return part


def _draw_slice(shape: tuple, local: torch.Tensor, std: float, generator: Optional[torch.Generator],
                my_slice: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """torch 2.13's rejection sampling of a truncated normal (nn.init, p > 0.3) over a full tensor of `shape`, kept
    as `my_slice` of it in `local`: a rejected element takes the next round's draw at its place, until none is.
    Held at once: the full buffer, this rank's slice and the rejected places (0.3% of them at 3 std)."""
    draw = torch.empty(shape, dtype=local.dtype, device=local.device)
    flat = draw.view(-1)
    # The bounds in the weight's dtype, as torch compares them.
    low, high = (draw.new_tensor(bound, device="cpu").item() for bound in (-3 * std, 3 * std))
    draw.normal_(0.0, std, generator=generator)
    local.copy_(my_slice(draw))
    pending = _out_of_range(flat, low, high)  # flat indices still rejected
    redrawn_at, redrawn_to = [], []
    while pending.numel():
        draw.normal_(0.0, std, generator=generator)  # a whole redraw, as torch's `empty_like(result).normal_`
        values = flat[pending]
        accepted = (values >= low) & (values <= high)
        redrawn_at.append(pending[accepted])
        redrawn_to.append(values[accepted])
        pending = pending[~accepted]
    if redrawn_at:
        # Mark the redrawn places in the buffer (NaN elsewhere: never a draw) and take this rank's slice of them.
        draw.fill_(float("nan"))
        flat[torch.cat(redrawn_at)] = torch.cat(redrawn_to)
        mine = my_slice(draw)
        redrawn = mine.isnan().logical_not_()
        local[redrawn] = mine[redrawn]


def _out_of_range(flat: torch.Tensor, low: float, high: float, chunk: int = 2**24) -> torch.Tensor:
    """Indices of `flat` outside [low, high], compared a chunk at a time (no mask of the whole tensor)."""
    found = [start + torch.nonzero((part < low) | (part > high)).view(-1)
             for start, part in zip(range(0, flat.numel(), chunk), flat.split(chunk))]
    return torch.cat(found) if found else torch.empty(0, dtype=torch.long, device=flat.device)


@lru_cache(maxsize=None)
def draws_like_torch(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `_draw_slice` gives `nn.init.trunc_normal_`'s numbers and leaves the generator where it does, on a
    probe of PROBE_SHAPE from its own generator (the model's is not touched)."""
    if device.type == "meta":
        return False
    theirs, ours = (torch.Generator(device=device).manual_seed(PROBE_SEED) for _ in range(2))
    std = 0.02
    expected = torch.empty(PROBE_SHAPE, dtype=dtype, device=device)
    nn.init.trunc_normal_(expected, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=theirs)
    got = torch.empty(PROBE_SHAPE, dtype=dtype, device=device)
    _draw_slice(PROBE_SHAPE, got, std, ours, lambda full: full)
    return torch.equal(expected, got) and torch.equal(theirs.get_state(), ours.get_state())
