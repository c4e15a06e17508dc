"""FSDP2 checkpoint resume and sharded gradient clipping on CPU/gloo.

Run: torchrun --nproc-per-node N -m tests.dist.workers.checkpoint_worker <first|resume> <ckpt_root> <out_dir>
Ranks 0 and 1 are the training ranks (FSDP2 over a 1-D mesh on the training group). With N=3, rank 2
is a bystander (like a teacher) that only joins the final world barrier: a checkpoint collective on
the default group would pair with it and then hang instead of finishing.

  first   checks clip_grad_norm_ against an unsharded reference, then trains 3 steps, saves, trains
          3 more and writes the losses of steps 4-6 to <out_dir>/first.rank<r>.json.
  crash   trains steps 1-6 again and saves step 6, but rank 1's write fails after its shard is on
          disk (a full disk): both ranks stop in one agreed sentence and the partial 0000000006.tmp goes.
  resume  builds the model from a different seed, loads the checkpoint, trains steps 4-6 and writes
          <out_dir>/resume.rank<r>.json.
"""

import json
import logging
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lingua.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery
from lingua.optim import OptimArgs, build_optimizer, clip_grad_norm_

STUDENTS = [0, 1]
VOCAB, DIM, N_STEPS = 32, 16, 9
OPTIM = OptimArgs(lr=1e-2, warmup=2, scheduler="cosine", clip=0.5)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_model(seed: int, mesh=None) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyLM()
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def batch(step: int, train_rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1000 * step + train_rank))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_clipping(mesh, train_rank: int) -> dict:
    """clip_grad_norm_ on FSDP2 shards vs the same gradients computed without sharding."""
    reference = build_model(0)
    # FSDP averages gradients over ranks: the reference averages the two ranks' losses.
    (sum(lm_loss(reference, batch(1, r)) for r in range(len(STUDENTS))) / len(STUDENTS)).backward()
    reference_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()

    sharded = build_model(0, mesh)
    lm_loss(sharded, batch(1, train_rank)).backward()
    max_norm = reference_norm / 2
    sharded_norm = float(clip_grad_norm_(sharded.parameters(), max_norm))
    clipped = {name: full(p.grad) for name, p in sharded.named_parameters()}
    clipped_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped.values()])).item()
    scale = max_norm / (reference_norm + 1e-6)
    max_grad_error = max((clipped[name] - p.grad * scale).abs().max().item()
                         for name, p in reference.named_parameters())
    return dict(reference_norm=reference_norm, sharded_norm=sharded_norm, clipped_norm=clipped_norm,
                max_norm=max_norm, max_grad_error=max_grad_error)


def train_steps(model, optimizer, scheduler, steps, train_rank) -> tuple[list[float], list[float]]:
    losses, grad_norms = [], []
    for step in steps:
        loss = lm_loss(model, batch(step, train_rank))
        loss.backward()
        grad_norms.append(float(clip_grad_norm_(model.parameters(), OPTIM.clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grad_norms


def checksum(model) -> float:
    return sum(full(p.detach()).double().sum().item() for p in model.parameters())


def main(phase: str, ckpt_root: str, out_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Short timeout: a collective that waits on the bystander fails the run instead of hanging it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    train_group = dist.new_group(STUDENTS)
    if rank not in STUDENTS:
        dist.barrier(group=dist.group.WORLD)
        dist.destroy_process_group()
        return
    train_rank = STUDENTS.index(rank)
    mesh = DeviceMesh.from_group(train_group, "cpu", mesh=torch.tensor(STUDENTS), mesh_dim_names=("dp_shard",))
    ckpt = CheckpointManager(CheckpointArgs(dump=SaveEvery(3, 1), eval=SaveEvery(0, 0)), ckpt_root, train_group,
                             train_rank, len(STUDENTS))
    result = {}
    if phase == "first":
        result["clip"] = check_clipping(mesh, train_rank)
        model = build_model(0, mesh)
        optimizer, scheduler = build_optimizer(model, OPTIM, N_STEPS)
        result["losses_before"], _ = train_steps(model, optimizer, scheduler, range(1, 4), train_rank)
        train_state = dict(step=3, scheduler=scheduler.state_dict(), data=dict(next_step=4, train_rank=train_rank))
        ckpt.save(model, optimizer, train_state, 3, dict(model=dict(dim=DIM), steps=N_STEPS))
    elif phase == "crash":
        model = build_model(0, mesh)
        optimizer, scheduler = build_optimizer(model, OPTIM, N_STEPS)
        train_steps(model, optimizer, scheduler, range(1, 7), train_rank)
        if train_rank == 1:
            real_save = dcp.save

            def write_then_fail(state, *, checkpoint_id, process_group):
                real_save(state, checkpoint_id=checkpoint_id, process_group=process_group)
                raise OSError("disk full (injected after rank 1 wrote its shard)")

            dcp.save = write_then_fail
        train_state = dict(step=6, scheduler=scheduler.state_dict(), data=dict(next_step=7, train_rank=train_rank))
        ckpt.save(model, optimizer, train_state, 6, dict(model=dict(dim=DIM), steps=N_STEPS))
        raise AssertionError("the injected save failure did not happen")
    else:
        model = build_model(999, mesh)
        optimizer, scheduler = build_optimizer(model, OPTIM, N_STEPS)
        train_state = ckpt.load(model, optimizer)
        assert train_state is not None and train_state["data"]["train_rank"] == train_rank, train_state
        scheduler.load_state_dict(train_state["scheduler"])
    start = train_state["data"]["next_step"]
    result["lr_at_resume"] = scheduler.get_last_lr()
    result["losses"], result["grad_norms"] = train_steps(model, optimizer, scheduler, range(start, start + 3),
                                                         train_rank)
    result["checksum"] = checksum(model)
    Path(out_dir, f"{phase}.rank{train_rank}.json").write_text(json.dumps(result))
    if dist.get_world_size() > len(STUDENTS):
        dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests.dist.workers import run_worker

    run_worker(main, *sys.argv[1:4])
