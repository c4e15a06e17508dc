"""The trainer under torchrun, recording FSDP's collectives on each student: its gradient reduce-scatters and its
parameter all-gathers.

Run: torchrun --nproc-per-node 2 -m tests.dist.workers.count_fsdp_collectives <out.json> <trainer overrides...>
Each rank writes {"reduce_scatters": count, "all_gathers": [[in_backward, gathered numel], ...]} to
<out.json>.<rank>, the gathers in call order: in_backward is whether autograd's engine was running the backward
when FSDP issued the gather (its pre-backward unshard).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from apps.main import train


def main(out: str, overrides: list[str]) -> None:
    reduce_scatters, all_gathers = [], []

    def counting(original):
        def counted(*args, **kwargs):
            reduce_scatters.append(1)
            return original(*args, **kwargs)
        return counted

    def recording(original):
        def recorded(output, *args, **kwargs):
            all_gathers.append([torch._C._current_graph_task_id() != -1, output.numel()])
            return original(output, *args, **kwargs)
        return recorded
    # FSDP2 calls one name or the other, depending on the torch version (an all-gather's output comes first).
    for names, wrap in ((("reduce_scatter_tensor", "reduce_scatter_single"), counting),
                        (("all_gather_into_tensor", "all_gather_single"), recording)):
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, wrap(getattr(dist, name)))
    try:
        train.main(overrides)
    finally:
        Path(f"{out}.{os.environ['RANK']}").write_text(  # a test worker may read torchrun's env
            json.dumps({"reduce_scatters": len(reduce_scatters), "all_gathers": all_gathers}))


if __name__ == "__main__":
    from tests.dist.workers import run_worker

    run_worker(main, sys.argv[1], sys.argv[2:])
