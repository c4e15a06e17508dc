"""Startup phase spans and per-step timers.

Startup: `with phases.span("model_build"): ...` appends one JSON line per phase to
`dump_dir/startup.<rank>.jsonl`, with the rank's peak memory at the phase's end; `phase_table` (rank 0) prints
min / max / slowest rank per phase and the highest peak.
Steps: `StepTimer` accumulates seconds per named part of a step (data, teacher_wait, fwd_bwd, ...), host
clocks on CPU and CUDA events on GPU, and when this rank reached the step's first collective.
"""

import contextlib
import json
import logging
import os
import time
from collections import defaultdict
from typing import Any, Optional

import torch

from lingua.metrics import GIB, host_peak_rss_gib
from lingua.run.dump_dir import RunDir, read_startup

logger = logging.getLogger(__name__)

STARTUP_PHASES = (
    "process_group_init", "mesh", "model_build", "teacher_load", "teacher_handshake", "checkpoint_load",
    "data_init", "compile_warmup", "first_step", "first_teacher_round_trip",
)


def peak_memory() -> dict[str, float]:
    """This process's peak memory so far, in GiB: `peak_rss_gib`, resident host memory (ru_maxrss: never reset, so a
    phase that raises it is the phase that needed it), and where CUDA is in use `gpu_peak_gib`, what torch's
    allocator held at most on the current device since its peak was last reset."""
    peaks = {"peak_rss_gib": round(host_peak_rss_gib(), 3)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never initialises CUDA for a CPU run
        peaks["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return peaks


class PhaseLog:
    """Writes startup spans for one rank. Timestamps are wall-clock so ranks can be compared; memory is the
    rank's peak when the span is recorded (`peak_memory`)."""

    def __init__(self, dump_dir: Optional[str], rank: int, role: str):
        self.rank, self.role = rank, role
        self.path = RunDir(dump_dir).startup(rank) if dump_dir else None
        self.durations: dict[str, float] = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # a restart rewrites its own startup record

    def record(self, phase: str, start: float, end: float) -> None:
        self.durations[phase] = end - start
        peaks = peak_memory()
        logger.info(f"startup phase {phase}: {end - start:.2f}s, peak resident {peaks['peak_rss_gib']:.2f} GiB"
                    + (f", GPU {peaks['gpu_peak_gib']:.2f} GiB" if "gpu_peak_gib" in peaks else ""))
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(rank=self.rank, role=self.role, phase=phase, start=start,
                                        end=end, seconds=end - start, pid=os.getpid(), **peaks)) + "\n")

    @contextlib.contextmanager
    def span(self, phase: str):
        start = time.time()
        try:
            yield
        finally:
            self.record(phase, start, time.time())


def read_phase_files(dump_dir: str, world_size: Optional[int] = None,
                     field: str = "seconds") -> dict[str, dict[int, float]]:
    """phase -> {rank: seconds} (or another `field` of the records: `peak_rss_gib`, `gpu_peak_gib`; a record
    without it is left out) from the `startup.<rank>.jsonl` files in `dump_dir` (see `read_startup`)."""
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for row in read_startup(dump_dir, world_size):
        if field in row:
            table[row["phase"]][row["rank"]] = row[field]
    return dict(table)


def phase_table(dump_dir: str, world_size: Optional[int] = None) -> str:
    """`format_phase_table` of the ranks' files in `dump_dir`: seconds, host peak and (on CUDA) GPU peak."""
    return format_phase_table(read_phase_files(dump_dir, world_size),
                              read_phase_files(dump_dir, world_size, "peak_rss_gib"),
                              read_phase_files(dump_dir, world_size, "gpu_peak_gib"))


def format_phase_table(table: dict[str, dict[int, float]], peaks: Optional[dict] = None,
                       gpu_peaks: Optional[dict] = None) -> str:
    """Min / max / slowest rank per phase, in the order phases first appear; with `peaks` (phase -> {rank: GiB}) the
    highest peak resident memory at the phase's end and its rank, and with `gpu_peaks` the highest GPU peak."""
    columns = [(name, values) for name, values in (("peak GiB", peaks), ("GPU GiB", gpu_peaks)) if values]
    lines = [f"{'phase':<26} {'ranks':>5} {'min s':>8} {'max s':>8} {'slowest':>8}"
             + "".join(f" {name:>9} {'at':>4}" for name, _ in columns)]
    for phase, per_rank in table.items():
        slowest = max(per_rank, key=per_rank.get)
        line = (f"{phase:<26} {len(per_rank):>5} {min(per_rank.values()):>8.2f} "
                f"{per_rank[slowest]:>8.2f} {'r' + str(slowest):>8}")
        for _, values in columns:
            gib = values.get(phase, {})
            highest = max(gib, key=gib.get) if gib else None
            line += f" {gib[highest]:>9.2f} {'r' + str(highest):>4}" if gib else f" {'-':>9} {'-':>4}"
        lines.append(line)
    return "\n".join(lines)


class StepTimer:
    """Seconds per part of the current step (`reset()` at the start of each step), and this rank's arrival.

    A part opened inside another (teacher_wait inside fwd_bwd) counts as its own, not in the enclosing part.
    CPU: the host clock. CUDA: the host only queues the GPU's work, so its clock would time kernel launches and
    leave the real time to the next sync; a part is timed by CUDA events recorded around it on the current
    stream, i.e. how long it held the stream up (waits on NCCL included). `read()` resolves them, waiting for
    the step's last event: call it on log steps only.

    Arrival: every rank of the training group leaves the step's agreed control point (a collective) at the
    same moment, `common_point()`; `arrive()` marks when this rank reaches the next step's first collective
    (the first forward's all-gather). Gathered over ranks, the latest arrival names the rank the others
    waited for, whose own lateness (a slow data read, a stall) falls outside every timed part.
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.left_common_point = time.perf_counter()
        self.arrival_s = 0.0  # seconds from the last common point to this step's first collective
        self.reset()

    def reset(self) -> None:
        """A new step: no part timed yet."""
        self.entered: set[str] = set()  # the parts opened this step (known on the host, no sync)
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Optional[str], Any, Any]] = []  # CUDA: (part, enclosing part, start, end)
        self._open: list[str] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, name: str, enclosing: Optional[str], seconds: float) -> None:
        self._seconds[name] += seconds
        if enclosing is not None:
            self._seconds[enclosing] -= seconds

    @contextlib.contextmanager
    def part(self, name: str):
        enclosing = self._open[-1] if self._open else None
        self._open.append(name)
        self.entered.add(name)
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            self._open.pop()
            if self.cuda:
                self._events.append((name, enclosing, start, end))
            else:
                self._add(name, enclosing, end - start)

    def common_point(self) -> None:
        """This rank just left a collective every rank of its group leaves together (the agreed control point)."""
        self.left_common_point = time.perf_counter()

    def arrive(self) -> None:
        """This rank is about to issue the step's first collective. Host time, on CUDA too: the host synced at the
        common point, so it queues the collective when it gets here."""
        self.arrival_s = time.perf_counter() - self.left_common_point

    def read(self) -> dict[str, float]:
        """Each part's own seconds this step. On CUDA this waits for the step's last event (log steps only)."""
        if self._events:
            self._events[-1][3].synchronize()  # the parts' events are on one stream: the last one ends after all
            for name, enclosing, start, end in self._events:
                self._add(name, enclosing, start.elapsed_time(end) / 1e3)
            self._events = []
        return dict(self._seconds)
