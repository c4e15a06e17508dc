"""The trainer under torchrun on GPUs, every step's micro-batches under `torch.cuda.set_sync_debug_mode("error")`:
a host sync anywhere in `train_step` (data, teacher requests and waits, forward, backward) raises with its line.

Run: torchrun --nproc-per-node <n> -m tests.gpu.workers.sync_debug <trainer overrides...>
Steps before FIRST_CHECKED_STEP are let through: the first initialises FSDP and compiles, the second may recompile.
"""

import sys

import torch

from apps.main import train

FIRST_CHECKED_STEP = 3


def main(overrides: list[str]) -> None:
    train_step = train.train_step

    def train_step_without_syncs(args, model, distiller, feed, step, *rest):
        if step < FIRST_CHECKED_STEP:
            return train_step(args, model, distiller, feed, step, *rest)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train_step(args, model, distiller, feed, step, *rest)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    train.train_step = train_step_without_syncs
    train.main(overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
