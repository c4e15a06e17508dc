"""The student built sharded (`build_sharded`) against the whole-model build it replaced, bit for bit, on 1, 2 and
3 students.

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.sharded_init <out_dir>
For each S in 1, 2, 3 (the students are ranks 0..S-1 on their own group; the others wait) and each config
(`CONFIGS`: untied and tied embeddings, bf16 and fp32, activation checkpointing, torch's own draws):
  whole    fe3c385's `build_model`: LMTransformer built and `init_weights()` on every rank from the seed, then
           `parallelize_model` shards it
  sharded  `build_sharded`: built on the meta device, parallelised, `to_empty`, then initialised shard by shard
and a reference, the whole model initialised and never sharded. Each student writes <out>/S<S>.rank<r>.json: per
config, how many tensors were compared, its local elements, and every name whose local shard differs from the whole
build's, whose gathered tensor or buffer (RoPE tables) differs from the reference's, or whose forward differs.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from apps.main.transformer import LMTransformer, LMTransformerArgs
from lingua.parallel import sharded_init
from lingua.parallel.launch_plan import DistributedArgs
from lingua.parallel.parallelize import build_sharded, parallelize_model

# Odd sizes, so three students shard unevenly (97 vocabulary rows: 33, 33, 31).
MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seqlen=32, rope_theta=5000.0,
             multiple_of=16, init_std_factor="current_depth", seed=7)
# name: (model overrides, distributed overrides, whether the shards are drawn by torch's trunc_normal_ on the full
# tensor: the fallback of lingua/parallel/sharded_init.py where its own draws differ from this torch's)
CONFIGS = {
    "untied_bf16": (dict(), dict(model_dtype="bf16"), False),
    "tied_bf16": (dict(tie_embeddings=True), dict(model_dtype="bf16"), False),
    "untied_fp32_checkpointed": (dict(), dict(model_dtype="fp32", activation_checkpointing="full"), False),
    "tied_fp32": (dict(tie_embeddings=True), dict(model_dtype="fp32"), False),
    "untied_bf16_torch_draws": (dict(), dict(model_dtype="bf16"), True),
}


def whole_init(args: LMTransformerArgs) -> LMTransformer:
    """fe3c385's build before its sharding: the whole model on every rank, initialised from the seed."""
    torch.manual_seed(args.seed)
    model = LMTransformer(args)
    model.init_weights()
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(config: str, mesh) -> dict:
    model_overrides, distributed_overrides, torch_draws = CONFIGS[config]
    args = LMTransformerArgs(**MODEL, **model_overrides)
    distributed = DistributedArgs(**distributed_overrides)
    reference = whole_init(args)
    whole = parallelize_model(whole_init(args), mesh, distributed)
    torch.manual_seed(args.seed)
    draws_like_torch = sharded_init.draws_like_torch
    if torch_draws:
        sharded_init.draws_like_torch = lambda device, dtype: False
    try:
        sharded = build_sharded(lambda: LMTransformer(args), torch.device("cpu"), mesh, distributed)
    finally:
        sharded_init.draws_like_torch = draws_like_torch
    differ = []
    whole_state, sharded_state, reference_state = whole.state_dict(), sharded.state_dict(), reference.state_dict()
    assert whole_state.keys() == sharded_state.keys() == reference_state.keys()
    for name in reference_state:
        mine, today = sharded_state[name], whole_state[name]
        if type(mine) is not type(today) or not torch.equal(local(mine), local(today)):
            differ.append(f"local {name}")
        if not torch.equal(full(mine), reference_state[name]):
            differ.append(f"full {name}")
    buffers = dict(reference.named_buffers())
    for name, buffer in sharded.named_buffers():
        if not torch.equal(buffer, buffers[name]):
            differ.append(f"buffer {name}")
    tied = sharded.output.weight is sharded.tok_embeddings.weight
    if tied != args.tie_embeddings:
        differ.append("tie")
    local_elements = sum(local(p).numel() for p in sharded.parameters())  # before a forward unshards the root
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.equal(sharded(tokens), whole(tokens)):
            differ.append("forward")
    return dict(compared=len(reference_state) + len(buffers), differ=differ, tied=tied, local_elements=local_elements,
                elements=sum(p.numel() for p in reference.parameters()))


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for students in range(1, world + 1):
        ranks = list(range(students))
        group = dist.new_group(ranks)  # every rank creates every group, members or not
        if rank not in ranks:
            continue
        mesh = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(ranks), mesh_dim_names=("dp_shard",))
        result = {config: compare(config, mesh) for config in CONFIGS}
        Path(out_dir, f"S{students}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests.dist.workers import run_worker

    run_worker(main, *sys.argv[1:])
