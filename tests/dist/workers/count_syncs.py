"""The trainer under torchrun, with every tensor -> Python conversion a student makes counted per step.

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.count_syncs <out.json> <trainer overrides...>

On CUDA each `.item()`, `.tolist()`, `bool()`, `int()`, `float()`, `.numpy()` of a device tensor blocks
the host until the GPU has caught up. No GPU here, so this counts the calls themselves (a proxy: on CPU
they are cheap, but a call per micro-batch on CPU is a host sync per micro-batch on CUDA). Counted in
each student's main thread between one step's start and the next (the data producer is not the step).
Each student writes {step: [count, [call sites]]} to <out.json>.<train rank>. With COUNT_SYNCS_TTY=1 in the
environment rank 0's progress line behaves as on a terminal (redrawn every step).
"""

import json
import os
import sys
import threading
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from apps.main import train
from lingua.metrics import ProgressLine
from lingua.timing import StepTimer

CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")
counts: dict = defaultdict(list)  # step -> call sites
current = {"step": None}


def call_site() -> str:
    """The innermost frame of our code that made the conversion."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/lingua/" in frame.filename or "/apps/" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def counting(name: str):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        if current["step"] is not None and threading.current_thread() is threading.main_thread():
            counts[current["step"]].append(call_site())
        return original(self, *args, **kwargs)
    return wrapper


def as_on_a_terminal() -> None:
    """Every ProgressLine believes its stream is a terminal."""
    init = ProgressLine.__init__

    def init_on_a_terminal(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.is_tty = True
    ProgressLine.__init__ = init_on_a_terminal


def main(out: str, overrides: list[str]) -> None:
    if os.environ.get("COUNT_SYNCS_TTY") == "1":  # a test worker may read its launcher's env
        as_on_a_terminal()
    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    reset = StepTimer.reset

    def step_starts(timer):  # the loop resets the timer first thing in every step
        current["step"] = (current["step"] or 0) + 1
        reset(timer)
    StepTimer.reset = step_starts
    original_train = train.train

    def train_and_report(args, topo, *rest):
        try:
            original_train(args, topo, *rest)
        finally:
            current["step"] = None
            Path(f"{out}.{topo.train_rank}").write_text(json.dumps({s: [len(c), c] for s, c in counts.items()}))
    train.train = train_and_report
    train.main(overrides)


if __name__ == "__main__":
    from tests.dist.workers import run_worker

    run_worker(main, sys.argv[1], sys.argv[2:])
