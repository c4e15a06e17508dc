"""A transformers teacher sharded tensor-parallel over its replica's group (distillation.teacher_tp > 1).

Why our own plan and not transformers' `from_pretrained(..., tp_plan="auto", device_mesh=mesh)`: in
transformers 5.23 a `tp_plan` makes `DistributedConfig` derive `tp_size` from the WORLD_SIZE environment
variable (transformers/distributed/configuration_utils.py:144-152), and `from_pretrained` then replaces the
mesh it was given by one `initialize_distributed_mesh` builds over the whole world
(transformers/modeling_utils.py:4236-4240, transformers/distributed/utils.py:321). With 3 ranks and a mesh
over ranks 1-2 the weights were cut in three (embed_tokens 171 and 170 rows of 512, q_proj 22 and 20 rows
of 64) and the first forward waited for rank 0 in a collective of that world mesh. A teacher's group is a
subset of the job, so here the plan is applied with torch's own `parallelize_module` on a `DeviceMesh` made
from the replica's group (`DeviceMesh.from_group`: no collective on the default group, ever).

The plan is the model's own (`config.base_model_tp_plan`, the facts transformers keeps per architecture),
mapped to torch's styles, plus two rows of ours:

    embed_tokens   RowwiseParallel(input_layouts=Replicate())  rows = vocabulary, one all-reduce
    lm_head        ColwiseParallel(use_local_output=True)      rows = vocabulary, no communication: each rank
                                                               computes the logits of its own vocabulary slice
                                                               (`vocab_parallel.py` turns slices into outputs)

Attention modules reshape with `-1` heads and keep `num_key_value_groups` (a ratio), so each rank runs its
`num_attention_heads / teacher_tp` heads unchanged; the head counts must divide (`check_heads_divide`).
Weights are sliced locally from the full checkpoint every rank reads (`src_data_rank=None`): loading
needs no collective either, so a rank that fails to load cannot leave the others waiting in one.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# transformers' plan styles -> torch's; None: the module stays replicated (a per-head norm, for example).
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": None,
}


def shard_bounds(vocab: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of vocabulary rows on `tp_rank`: torch.chunk's split, the one DTensor's Shard(0) uses."""
    width = -(-vocab // tp_size)
    start = min(tp_rank * width, vocab)
    return start, min(start + width, vocab)


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the teacher's vocabulary and the group holding the other slices."""

    group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    vocab: int  # rows of the teacher's whole output head
    start: int
    end: int

    @classmethod
    def of(cls, group, vocab: int) -> "VocabShard":
        tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, tp_rank, tp_size, vocab, *shard_bounds(vocab, tp_size, tp_rank))

    @property
    def width(self) -> int:
        """Rows of the widest slice: what every rank pads its slice to in a collective."""
        return -(-self.vocab // self.tp_size)

    @property
    def leader(self) -> int:
        """Global rank of the group's first rank, which assembles the outputs."""
        return dist.get_global_rank(self.group, 0)


def head_counts(config: dict) -> Optional[tuple[int, int]]:
    """(attention heads, KV heads) from a config.json's dict (its text config's for a multimodal one), or None."""
    for section in (config, config.get("text_config") or {}):
        heads = section.get("num_attention_heads")
        if isinstance(heads, int) and not isinstance(heads, bool):
            kv_heads = section.get("num_key_value_heads")
            return heads, kv_heads if isinstance(kv_heads, int) and not isinstance(kv_heads, bool) else heads
    return None


def read_teacher_config(path) -> Optional[dict]:
    """A local teacher's config.json as a dict; None when there is none (a hub id) or it does not parse."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def heads_problem(config: dict, teacher_tp: int, where: str) -> Optional[str]:
    """The sentence for a teacher whose attention or KV head count does not divide by `teacher_tp`, else None."""
    counts = head_counts(config)
    if teacher_tp == 1 or counts is None:
        return None
    heads, kv_heads = counts
    if heads % teacher_tp == 0 and kv_heads % teacher_tp == 0:
        return None
    return (f"distillation.teacher_tp={teacher_tp}; the teacher has {heads} attention heads and {kv_heads} KV heads "
            f"({where}), and tensor parallelism gives each rank whole heads: use a teacher_tp that divides both.")


def tensor_parallel_plan(model) -> dict:
    """The base model's plan as torch styles ({module path pattern: style}); unknown styles are refused."""
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in its transformers config "
                         f"(base_model_tp_plan); serve it with distillation.teacher_tp=1")
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ValueError(f"{type(model).__name__}'s tensor-parallel plan uses the style(s) {', '.join(unknown)}, "
                         f"which this trainer does not map to torch's; serve it with distillation.teacher_tp=1")
    styles = {path: STYLES[style]() for path, style in plan.items() if STYLES[style] is not None}
    styles["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    return styles


def shard_teacher(model, group, device: torch.device) -> VocabShard:
    """Shard `model` (loaded on the host) over `group` in place, onto `device`; returns this rank's vocabulary
    slice of the output head, whose forward then yields only that slice's logits."""
    ranks = dist.get_process_group_ranks(group)
    mesh = DeviceMesh.from_group(group, device.type, mesh=torch.tensor(ranks, dtype=torch.int))
    problem = heads_problem(model.config.to_dict(), len(ranks), "its config")
    if problem is not None:  # a hub teacher, whose config.json the validation pass could not read
        raise ValueError(problem)
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    parallelize_module(model.base_model, mesh, tensor_parallel_plan(model), src_data_rank=None)
    if tied:  # sliced once, from the embedding's shard (same rows, same Shard(0))
        head.weight = model.get_input_embeddings().weight
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=True), src_data_rank=None)
    if tied:  # the style wrapped the shard in a parameter of its own: one copy of the shared rows, as before
        head.weight = model.get_input_embeddings().weight
    model.to(device)  # the replicated rest: norms, rotary buffers
    shard = VocabShard.of(group, int(head.weight.shape[0]))
    local_rows = head.weight.to_local().shape[0]
    assert local_rows == shard.end - shard.start, (local_rows, shard)  # our bounds are DTensor's
    return shard
