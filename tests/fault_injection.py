"""The trainer with one failure injected, for the tests: `python -m tests.fault_injection inject_failure=<kind>:<where>
<the trainer's overrides>` runs `apps.main.train`'s main with the failure installed on a seam of the product (nothing in
the product knows about it). `tests/runs.py`'s `torchrun` launches this module when the overrides hold an
`inject_failure=`; a SLURM test, whose job line holds only `config=`, sets LINGUA_INJECT_FAILURE in stool's exports.

    raise:<train_rank>@<step>            that student raises during that step
    bug:<train_rank>@<step>              that student hits a bug during that step (a plain ValueError from a
                                         tuple unpacked wrongly: a traceback, not a user's sentence)
    nan:<train_rank>@<step>              its loss is not finite at that step
    stall:<train_rank>@<step>            it is STALL_S late to that step (a straggler)
    preempt:<train_rank>@<step>          it votes to preempt at that step, as if SIGUSR2 had just arrived
    disk_full:<train_rank>@<step>        its checkpoint writer finds the disk full (ENOSPC) from that step on
    teacher_load:<teacher_index>         that teacher fails to load
    teacher_serve:<teacher_index>@<step> that teacher fails while serving a request of that step

The seams: `apps.main.train.train` and `distillation_process` (which rank this process is: its train rank, or its
index among the teacher ranks), `train_step` (a student's forward/backward: the faults before it, the non-finite loss
and the preemption vote after it), the `TeacherModel` the server loads, and the server's `_check_headers` (the
replica leader) and `_forward` (a follower) of a request.
"""

if __name__ == "__main__":  # first, before the slow imports: see hold_sigterm
    from lingua.cli.entry import hold_sigterm

    hold_sigterm()

import errno
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from lingua.errors import ConfigError

ENV_VAR = "LINGUA_INJECT_FAILURE"  # the spec where the command line cannot carry it (a SLURM job's step)
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


def fail_to_load(*args, **kwargs):
    """The teacher's model as it fails to load (what inject_failure=teacher_load:... puts in its place)."""
    raise RuntimeError("injected teacher load failure (inject_failure=teacher_load:...)")


def fail_to_serve(step: int, fails_at: int) -> None:
    if step == fails_at:
        raise RuntimeError("injected teacher failure (inject_failure=teacher_serve:...)")


def install(failure: InjectedFailure) -> None:
    """Wrap the trainer's seams so that `failure` happens on its rank at its step."""
    import apps.main.train as trainer

    if failure.kind.startswith("teacher_"):
        serve = trainer.distillation_process

        @functools.wraps(serve)
        def distillation_process(args, topo, *rest, **kwargs):
            if topo.teacher_ranks.index(topo.global_rank) == failure.rank:
                install_on_teacher(failure)
            return serve(args, topo, *rest, **kwargs)

        trainer.distillation_process = distillation_process
        return
    train, train_step, student = trainer.train, trainer.train_step, {}

    @functools.wraps(train)
    def train_on_rank(args, topo, phases, preemption):
        student.update(rank=topo.train_rank, preemption=preemption)
        return train(args, topo, phases, preemption)

    @functools.wraps(train_step)
    def train_step_with_failure(args, model, distiller, feed, step, *rest, **kwargs):
        due = (student["rank"], step) == (failure.rank, failure.step)
        if due and failure.kind == "raise":
            raise RuntimeError(f"injected failure on train rank {student['rank']} at step {step}")
        if due and failure.kind == "bug":
            step_and_rank(step, student["rank"])
        if due and failure.kind == "stall":
            time.sleep(STALL_S)
        if due and failure.kind == "disk_full":
            from torch.distributed.checkpoint import filesystem

            filesystem._write_item = disk_full
        metrics, micro_batches = train_step(args, model, distiller, feed, step, *rest, **kwargs)
        if due and failure.kind == "nan":
            metrics["loss/total"] = metrics["loss/total"] * float("nan")
        if due and failure.kind == "preempt":
            student["preemption"].requested = True  # what SIGUSR2's handler sets; the step's vote reads it
        return metrics, micro_batches

    trainer.train, trainer.train_step = train_on_rank, train_step_with_failure


def install_on_teacher(failure: InjectedFailure) -> None:
    from lingua.distillation.online import server

    if failure.kind == "teacher_load":
        server.TeacherModel = fail_to_load
        return
    check_headers, forward = server.TeacherServer._check_headers, server.TeacherServer._forward

    def check_headers_failing(self, headers, students):  # the replica's leader: the failure is answered as an error
        if {header.op for header in headers.values()} == {server.Op.FORWARD}:
            fail_to_serve(headers[students[0][0]].step, failure.step)
        return check_headers(self, headers, students)

    def forward_failing(self, students, headers):  # a follower of the replica: before its part of the forward
        fail_to_serve(headers[students[0][0]].step, failure.step)
        return forward(self, students, headers)

    server.TeacherServer._check_headers, server.TeacherServer._forward = check_headers_failing, forward_failing


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    spec = os.environ.get(ENV_VAR)
    spec = next((item.partition("=")[2] for item in argv if item.startswith("inject_failure=")), spec)
    failure = parse_injected_failure(spec)
    if failure is not None:
        install(failure)
    from apps.main.train import main as train_main

    train_main([item for item in argv if not item.startswith("inject_failure=")])


if __name__ == "__main__":
    from lingua.cli.entry import run_cli

    run_cli(main)
