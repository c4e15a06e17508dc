"""Each rank of a tensor-parallel teacher reads only its shards from the checkpoint, and gets exactly the shards
that loading the whole teacher on the host and slicing it gives.
Run: torchrun --nproc-per-node 2 -m tests.dist.workers.tp_load <out_dir> <teacher_dir>...

For every teacher (the test passes one safetensors file with an untied head, an uneven vocabulary and biases,
and several files and an index with a tied head), in fp32 and in bf16 (cast while reading), each rank loads it
both ways and compares every parameter's local shard and every buffer bit for bit, and the hidden states of a
forward. Rank r writes its comparisons to <out_dir>/rank<r>.json.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lingua.distillation.args import DistillationArgs
from lingua.distillation.teacher.model import TeacherModel, load_teacher
from lingua.distillation.teacher.tensor_parallel import shard_teacher
from tests.dist.workers import run_worker, say


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def compare(teacher_dir: str, dtype: str, group) -> dict:
    args = DistillationArgs(teacher_path=teacher_dir, teacher_dtype=dtype, logits_chunk_rows=2)
    streamed = TeacherModel(args, torch.device("cpu"), tp_group=group)
    sliced, _ = load_teacher(args, torch.device("cpu"), place=False)
    shard_teacher(sliced, group, torch.device("cpu"))
    a, b = dict(streamed.model.named_parameters()), dict(sliced.named_parameters())
    buffers_a, buffers_b = dict(streamed.model.named_buffers()), dict(sliced.named_buffers())
    tokens = torch.randint(3, streamed.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden_a, hidden_b = streamed.hidden_states(tokens), sliced.get_decoder()(input_ids=tokens).last_hidden_state
    outputs = streamed.sparse_outputs(hidden_a, "topk", 8, torch.float32, streamed.vocab_size)
    head, embedding = streamed.model.get_output_embeddings(), streamed.model.get_input_embeddings()
    return {
        "names_equal": sorted(a) == sorted(b) and sorted(buffers_a) == sorted(buffers_b),
        "unequal_parameters": [name for name in a if not torch.equal(local(a[name]), local(b[name]))],
        "unequal_buffers": [name for name in buffers_a if not torch.equal(buffers_a[name], buffers_b[name])],
        "meta_left": [name for name, p in a.items() if local(p).is_meta],
        "dtensors": sum(hasattr(p, "to_local") for p in a.values()),
        "tied": head.weight is embedding.weight,
        "config_tied": bool(streamed.model.config.tie_word_embeddings),
        "hidden_equal": bool(torch.equal(hidden_a, hidden_b)),
        "dtypes": sorted({str(p.dtype) for p in a.values()}),
        "outputs": None if outputs is None else list(outputs.values.shape),
        "tp_rank": streamed.shard.tp_rank,
        "shard": [streamed.shard.start, streamed.shard.end],
        "read_bytes": streamed.checkpoint.read_bytes,
        "total_bytes": streamed.checkpoint.total_bytes,
    }


def main() -> None:
    out_dir, teacher_dirs = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    group = dist.new_group([0, 1], group_desc="teacher_tp_0")
    results = {f"{teacher_dir}:{dtype}": compare(teacher_dir, dtype, group)
               for teacher_dir in teacher_dirs for dtype in ("fp32", "bf16")}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    say(f"TP LOAD DONE rank {dist.get_rank()}")
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(main)
