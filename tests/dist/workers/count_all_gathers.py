"""The trainer under torchrun, recording every FSDP parameter all-gather on each student.

Run: torchrun --nproc-per-node 2 -m tests.dist.workers.count_all_gathers <out.json> <trainer overrides...>
Each rank writes [[in_backward, gathered numel], ...] in call order to <out.json>.<rank>: in_backward is
whether autograd's engine was running the backward when FSDP issued the gather (its pre-backward unshard).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from apps.main import train


def main(out: str, overrides: list[str]) -> None:
    calls = []

    def recording(original):
        def recorded(output, *args, **kwargs):
            calls.append([torch._C._current_graph_task_id() != -1, output.numel()])
            return original(output, *args, **kwargs)
        return recorded
    # FSDP2 calls one or the other, depending on the torch version (the output tensor comes first in both).
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, recording(getattr(dist, name)))
    try:
        train.main(overrides)
    finally:
        Path(f"{out}.{os.environ['RANK']}").write_text(json.dumps(calls))  # a test worker may read torchrun's env


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
