"""Failure injection for tests: `inject_failure=<kind>:<where>` makes one rank fail on purpose.

    raise:<train_rank>@<step>            that student raises during that step
    bug:<train_rank>@<step>              that student hits a bug during that step (a plain ValueError from a
                                         tuple unpacked wrongly: a traceback, not a user's sentence)
    nan:<train_rank>@<step>              its loss is not finite at that step
    stall:<train_rank>@<step>            it is STALL_S late to that step (a straggler)
    preempt:<train_rank>@<step>          it votes to preempt at that step, as if SIGUSR2 had just arrived
    disk_full:<train_rank>@<step>        its checkpoint writer finds the disk full (ENOSPC) from that step on
    teacher_load:<teacher_index>         that teacher fails to load
    teacher_serve:<teacher_index>@<step> that teacher fails while serving a request of that step
"""

import errno
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lingua.errors import ConfigError

STALL_S = 4.0  # how late inject_failure=stall:... makes a student
STEP_KINDS = ("raise", "bug", "nan", "stall", "preempt", "disk_full", "teacher_serve")  # the kinds given as <rank>@<step>


@dataclass(frozen=True)
class InjectedFailure:
    kind: str  # "raise" | "bug" | "nan" | "stall" | "preempt" | "disk_full" | "teacher_load" | "teacher_serve"
    rank: int  # train rank, or the teacher's index among teachers for teacher_*
    step: int  # 0 for teacher_load


def parse_injected_failure(spec: Optional[str]) -> Optional[InjectedFailure]:
    if not spec:
        return None
    kind, _, where = spec.rpartition(":") if ":" in spec else ("raise", "", spec)
    rank, _, step = where.partition("@")
    valid = kind in STEP_KINDS and rank.isdigit() and step.isdigit() or \
        kind == "teacher_load" and rank.isdigit() and not step
    if not valid:
        raise ConfigError(f"inject_failure={spec!r}; use raise:<train_rank>@<step>, bug:<train_rank>@<step>, "
                          f"nan:<train_rank>@<step>, stall:<train_rank>@<step>, preempt:<train_rank>@<step>, "
                          f"disk_full:<train_rank>@<step>, "
                          f"teacher_load:<teacher_index> or teacher_serve:<teacher_index>@<step>.")
    return InjectedFailure(kind, int(rank), int(step or 0))


def step_and_rank(step: int, train_rank: int) -> tuple[int, int]:
    """The bug inject_failure=bug:... plants: a tuple unpacked wrongly, so Python itself raises the plain
    `ValueError: too many values to unpack (expected 2)` here, with this file and line in its traceback."""
    step_seen, rank_seen = (step, train_rank, "one value too many")
    return step_seen, rank_seen


def disk_full(*args, **kwargs):
    """DCP's storage writer as it fails on a full disk (what inject_failure=disk_full:... puts in its place)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FaultInjector:
    """The loop's one hook for injected failures; does nothing without `inject_failure`."""

    def __init__(self, spec: Optional[str], train_rank: int):
        self.failure = parse_injected_failure(spec)
        self.train_rank = train_rank

    def _due(self, kind: str, step: int) -> bool:
        f = self.failure
        return f is not None and f.kind == kind and (f.rank, f.step) == (self.train_rank, step)

    def before_step(self, step: int) -> None:
        if self._due("raise", step):
            raise RuntimeError(f"injected failure on train rank {self.train_rank} at step {step}")
        if self._due("bug", step):
            step_and_rank(step, self.train_rank)
        if self._due("stall", step):
            time.sleep(STALL_S)
        if self._due("disk_full", step):
            from torch.distributed.checkpoint import filesystem

            filesystem._write_item = disk_full

    def preempt(self, step: int) -> bool:
        return self._due("preempt", step)

    def nonfinite(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Whether the step's loss is not finite on this rank (a device flag for the agreement; forced when injected)."""
        if self._due("nan", step):
            return torch.ones((), dtype=torch.bool, device=loss.device)
        return ~torch.isfinite(loss)

    @staticmethod
    def teacher_load_fails(spec: Optional[str], teacher_index: int) -> bool:
        failure = parse_injected_failure(spec)
        return failure is not None and failure.kind == "teacher_load" and failure.rank == teacher_index

    @staticmethod
    def teacher_serve_fails_at(spec: Optional[str], teacher_index: int) -> Optional[int]:
        """The step whose request this teacher fails to serve, if any."""
        failure = parse_injected_failure(spec)
        hit = failure is not None and failure.kind == "teacher_serve" and failure.rank == teacher_index
        return failure.step if hit else None
