"""The trainer under torchrun, counting FSDP's gradient reduce-scatters on each student.

Run: torchrun --nproc-per-node 2 -m tests.dist.workers.count_reduce_scatters <out.json> <trainer overrides...>
Each rank writes its count to <out.json>.<rank>.
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from apps.main import train


def main(out: str, overrides: list[str]) -> None:
    calls = []

    def counting(original):
        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)
        return counted
    # FSDP2 calls one or the other, depending on the torch version.
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))
    try:
        train.main(overrides)
    finally:
        Path(f"{out}.{os.environ['RANK']}").write_text(str(len(calls)))  # a test worker may read torchrun's env


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
