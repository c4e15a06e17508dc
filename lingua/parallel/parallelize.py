"""Building the student sharded: on the meta device, then activation checkpointing, torch.compile and FSDP2, then
each rank's own storage and the initial weights."""

import logging
from functools import partial
from typing import Callable

import torch

from lingua.parallel.launch_plan import DistributedArgs

logger = logging.getLogger(__name__)


def build_sharded(make_model: Callable[[], torch.nn.Module], device: torch.device, mesh, args: DistributedArgs,
                  no_recompute_ops=None) -> torch.nn.Module:
    """`make_model()` on the meta device, parallelised over `mesh` (`parallelize_model`), given storage on `device`
    (`to_empty`: each rank its shard), then `init_weights()`: a rank holds its shard and, while one is drawn, one
    full parameter (`init_trunc_normal`), never the whole model (Meta Lingua's and torchtitan's order).

    The weights are those of `make_model()` built whole and initialised on every rank, then sharded: the same
    seeded draws in the same order, each rank keeping its slice, whatever the number of students
    (tests/dist/test_sharded_init.py compares them bit for bit). `init_weights` must rebuild the buffers too:
    `to_empty` leaves every tensor uninitialised."""
    with torch.device("meta"):
        model = make_model()
    model = parallelize_model(model, mesh, args, no_recompute_ops)
    model.to_empty(device=device)
    model.init_weights()
    return model


def parallelize_model(model: torch.nn.Module, mesh, args: DistributedArgs, no_recompute_ops=None):
    """Activation checkpointing, torch.compile and FSDP2 (per block, then the root) over `mesh`
    (the students' mesh from the Topology; None in a single process: no sharding).

    A world of one student has nothing to shard, and FSDP's per-block hooks doubled the host's work of a small
    student's step (docs/benchmarks.md, 2026-12-06): in fp32 it is left plain; in bf16 it is one FSDP unit (the
    root), for FSDP's mixed precision (bf16 compute, fp32 weights and gradient reduction) and nothing else.
    Checkpoints stay DCP's: a plain model's saves load into a sharded one and back (tests/unit/lingua/test_checkpoint.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args.validate()
    if args.activation_checkpointing != "none":
        _apply_activation_checkpointing(model, args.activation_checkpointing, no_recompute_ops)
    if args.compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    one_student = mesh is not None and mesh.size() == 1
    if mesh is None or (one_student and args.model_dtype == "fp32"):
        return model
    param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.model_dtype]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard = partial(fully_shard, mesh=mesh, mp_policy=policy)
    if one_student:
        shard(model, reshard_after_forward=False)
        return model
    n_layers = len(model.layers)
    for i, block in enumerate(model.layers):
        # The last block's params are needed right away by the root's backward: don't reshard them.
        shard(block, reshard_after_forward=i < n_layers - 1)
    # The root (embeddings, final norm, head) stays unsharded from its forward to the end of its backward:
    # resharding it would all-gather it again in every micro-batch's backward (configs/llama_1B.yaml: 2 x 128k
    # x 2048 bf16 = 1 GB per micro-batch), though the fused loss already computed the head's gradient in forward.
    # False, not the default: since torch 2.8 an explicit True overrides FSDP's keep-the-root-unsharded rule, and
    # False means the same on every version this project supports.
    shard(model, reshard_after_forward=False)
    return model


def _apply_activation_checkpointing(model, mode: str, no_recompute_ops) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    context_fn = None
    if mode == "selective":
        save_ops = set(no_recompute_ops or ())

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = partial(create_selective_checkpoint_contexts, policy)
    for i, block in enumerate(model.layers):
        kwargs = dict(preserve_rng_state=False)
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        model.layers[i] = checkpoint_wrapper(block, **kwargs)
