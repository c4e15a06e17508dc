"""Whether the students' wait on their teachers is the teachers' capacity or each request's round trip, and the
one change that would remove it: the run's warning when students wait more than TEACHER_BOUND_SHARE of a step.

A teacher busy most of its time has no idle time left to absorb the students' requests: it is the bottleneck, and
more teacher ranks (or a smaller teacher, or the offline cache) remove the wait. A teacher idle most of its time is
not: the students wait for a round trip their step does not hide (no look-ahead, ranks sharing cores, the transfer),
and more teacher ranks would not change that; the look-ahead, a core per rank or the offline cache do.
"""

import math
import os
from dataclasses import dataclass
from typing import Optional

from lingua.distillation.args import MAX_PREFETCH

TEACHER_BOUND_SHARE = 0.3  # warn when students wait on the teacher more than this share of a step
TEACHER_SATURATED_SHARE = 0.8  # a teacher busy this share of its time (or more) has no idle time to absorb requests


@dataclass(frozen=True)
class TeacherWait:
    """What one log row measured, and the launch it measured."""
    step_s: float  # the step's wall time
    wait_s: float  # of it, the students' wait on the teacher
    busy_share: float  # the (busiest) teacher's share of time computing, over the last log window
    teacher_ranks: int  # the teacher's ranks today (replicas x tp)
    tp: int  # ranks per replica
    students: int
    prefetch: int  # the look-ahead in use (distillation.prefetch, "auto" resolved)
    shared_cores: Optional[str] = None  # "3 ranks x 1 threads on 2 cores" where the ranks oversubscribe a CPU node
    rank_key: str = "distillation.n_teacher_ranks"  # the setting that gives the (busiest) teacher more ranks

    @property
    def wait_share(self) -> float:
        return self.wait_s / max(self.step_s, 1e-9)


def oversubscribed_cores(device_type: str, ranks_on_node: int, threads_per_rank: int) -> Optional[str]:
    """"3 ranks x 1 threads on 2 cores" where a CPU node's ranks need more cores than it has (as `resolve_prefetch`
    counts them), else None."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device_type == "cuda" or ranks_on_node * threads_per_rank <= cores:
        return None
    return f"{ranks_on_node} ranks x {threads_per_rank} threads on {cores} cores"


def teacher_ranks_to_keep_up(n_teachers: int, n_students: int, busy_share: float, step_s: float,
                             wait_s: float) -> int:
    """Teacher replicas that would remove the students' wait, from what was measured: the teachers need
    busy_share * step_s of work per step today; with k times more of them each needs 1/k of it, and with
    look-ahead that hides behind the students' own compute (step_s - wait_s). Rounded up to a count the
    students divide evenly among."""
    compute_s = max(step_s - wait_s, 1e-9)
    needed = math.ceil(n_teachers * busy_share * step_s / compute_s - 1e-9)
    candidates = [k for k in range(max(needed, 1), n_students + 1) if n_students % k == 0]
    return candidates[0] if candidates else n_students


def teacher_wait_advice(m: TeacherWait) -> Optional[str]:
    """The warning for this row, or None where the students wait at most TEACHER_BOUND_SHARE of the step. It names
    the teacher the bottleneck only where it is busy TEACHER_SATURATED_SHARE of its time or more, and its remedy
    always changes something in the launch."""
    if m.wait_share <= TEACHER_BOUND_SHARE:
        return None
    waiting = f"students spend {m.wait_share:.0%} of the step waiting on the teacher, which is busy {m.busy_share:.0%} " \
              f"of its time"
    if m.busy_share >= TEACHER_SATURATED_SHARE:
        return f"{waiting}: the teacher is the bottleneck. {more_capacity(m)}"
    return (f"{waiting}: not the bottleneck (more teacher ranks would not remove the wait), the students wait for "
            f"each request's round trip, which their step does not hide. {hide_the_round_trip(m)}")


def more_capacity(m: TeacherWait) -> str:
    """A saturated teacher: the rank count that would keep up (when it is more than today's), else a lighter teacher."""
    lighter = "a smaller teacher, or the offline cache (docs/teacher_cache.md), which has no teacher in the step"
    needed = teacher_ranks_to_keep_up(m.teacher_ranks // m.tp, m.students, m.busy_share, m.step_s, m.wait_s) * m.tp
    if needed > m.teacher_ranks:
        return (f"About {needed} teacher ranks would keep up with {m.students} students ({m.rank_key}={needed}, "
                f"{m.students + needed} ranks in all instead of {m.students + m.teacher_ranks}); "
                f"or use {lighter}.")
    if m.prefetch == 0 and m.shared_cores is None:
        return ("Set distillation.prefetch=1: each request goes out a micro-batch ahead, so the teacher computes "
                f"during the students' whole step; or use {lighter}.")
    return f"More ranks would not keep up with {m.students} students: use {lighter}."


def hide_the_round_trip(m: TeacherWait) -> str:
    """An idle teacher: what hides its round trip behind the students' step, given the look-ahead and the cores."""
    cache = "the offline cache (docs/teacher_cache.md), which has no teacher in the step"
    if m.prefetch == 0 and m.shared_cores is not None:
        return (f"The {m.shared_cores} oversubscribe them, so the teacher's forward takes its turn on the students' "
                f"cores and distillation.prefetch=0 (auto's choice here) sends each request only when it is needed: "
                f"give each rank its own cores (then distillation.prefetch=1 hides the teacher behind the students' "
                f"whole step), or train from {cache}.")
    if m.prefetch == 0:
        return ("Set distillation.prefetch=1: each request goes out a micro-batch ahead, so the teacher computes "
                "during the students' whole step.")
    if m.prefetch < MAX_PREFETCH:
        return (f"Set distillation.prefetch={MAX_PREFETCH}: a second request in flight hides a round trip longer "
                f"than one micro-batch (prefetch={m.prefetch} today).")
    return (f"With distillation.prefetch={m.prefetch} already, the replies' transfer is the wait: a smaller "
            f"distillation.k sends fewer values per position, or train from {cache}.")
