"""Startup phase spans and per-step timers.

Startup: `with phases.span("model_build"): ...` appends one JSON line per phase to
`dump_dir/startup.<rank>.jsonl`; `format_phase_table` (rank 0) prints min / max / slowest rank per phase.
Steps: `StepTimer` accumulates seconds per named part of a step (data, teacher_wait, fwd_bwd, ...).
"""

import contextlib
import json
import logging
import os
import time
from collections import defaultdict
from typing import Optional

from lingua.rundir import RunDir, read_startup

logger = logging.getLogger(__name__)

STARTUP_PHASES = (
    "process_group_init", "mesh", "model_build", "teacher_load", "teacher_handshake", "checkpoint_load",
    "data_init", "compile_warmup", "first_step", "first_teacher_round_trip",
)


class PhaseLog:
    """Writes startup spans for one rank. Timestamps are wall-clock so ranks can be compared."""

    def __init__(self, dump_dir: Optional[str], rank: int, role: str):
        self.rank, self.role = rank, role
        self.path = RunDir(dump_dir).startup(rank) if dump_dir else None
        self.durations: dict[str, float] = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # a restart rewrites its own startup record

    def record(self, phase: str, start: float, end: float) -> None:
        self.durations[phase] = end - start
        logger.info(f"startup phase {phase}: {end - start:.2f}s")
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(rank=self.rank, role=self.role, phase=phase, start=start,
                                        end=end, seconds=end - start, pid=os.getpid())) + "\n")

    @contextlib.contextmanager
    def span(self, phase: str):
        start = time.time()
        try:
            yield
        finally:
            self.record(phase, start, time.time())


def read_phase_files(dump_dir: str, world_size: Optional[int] = None) -> dict[str, dict[int, float]]:
    """phase -> {rank: seconds} from the `startup.<rank>.jsonl` files in `dump_dir` (see `read_startup`)."""
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for row in read_startup(dump_dir, world_size):
        table[row["phase"]][row["rank"]] = row["seconds"]
    return dict(table)


def format_phase_table(table: dict[str, dict[int, float]]) -> str:
    """Min / max / slowest rank per phase, in the order phases first appear."""
    lines = [f"{'phase':<26} {'ranks':>5} {'min s':>8} {'max s':>8} {'slowest':>8}"]
    for phase, per_rank in table.items():
        slowest = max(per_rank, key=per_rank.get)
        lines.append(f"{phase:<26} {len(per_rank):>5} {min(per_rank.values()):>8.2f} "
                     f"{per_rank[slowest]:>8.2f} {'r' + str(slowest):>8}")
    return "\n".join(lines)


class StepTimer:
    """Seconds per part of the current step; `reset()` at the start of each step."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.seconds = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
