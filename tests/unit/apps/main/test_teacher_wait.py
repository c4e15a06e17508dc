"""The teacher-wait warning names a bottleneck only where the teacher is one, and its remedy changes the launch."""

import re

import pytest

from apps.main.report import busy_shares
from apps.main.teacher_wait import (TEACHER_BOUND_SHARE, TeacherWait, oversubscribed_cores, teacher_ranks_to_keep_up,
                                    teacher_wait_advice)

CPU_DEMO = "3 ranks x 1 threads on 2 cores"


def measured(wait_share: float, busy: float, prefetch: int = 1, shared_cores=None, teacher_ranks: int = 1,
             students: int = 2, tp: int = 1, **extra) -> TeacherWait:
    return TeacherWait(step_s=1.0, wait_s=wait_share, busy_share=busy, teacher_ranks=teacher_ranks, tp=tp,
                       students=students, prefetch=prefetch, shared_cores=shared_cores, **extra)


def test_no_warning_while_the_students_wait_little():
    assert teacher_wait_advice(measured(TEACHER_BOUND_SHARE, busy=1.0)) is None
    assert teacher_wait_advice(measured(0.05, busy=0.2, prefetch=0, shared_cores=CPU_DEMO)) is None


def test_the_issues_cpu_run_is_not_called_a_bottleneck_and_gets_a_remedy_that_changes_something():
    """2+1 on 2 cores, auto picked prefetch=0: waiting 35%, teacher busy 28% (issue 51's first warning)."""
    advice = teacher_wait_advice(measured(0.35, busy=0.28, prefetch=0, shared_cores=CPU_DEMO))
    assert advice.startswith("students spend 35% of the step waiting on the teacher, which is busy 28% of its time")
    assert "is the bottleneck" not in advice and "not the bottleneck" in advice
    assert "n_teacher_ranks" not in advice and "would keep up" not in advice
    assert CPU_DEMO in advice and "distillation.prefetch=1" in advice and "offline cache" in advice


@pytest.mark.parametrize("prefetch, shared, expected", [
    (0, None, "Set distillation.prefetch=1"),
    (1, None, "Set distillation.prefetch=2"),
    (2, None, "distillation.k"),
    (1, CPU_DEMO, "Set distillation.prefetch=2"),  # a look-ahead already on: the next one up
])
def test_an_idle_teacher_gets_the_change_that_hides_its_round_trip(prefetch, shared, expected):
    advice = teacher_wait_advice(measured(0.5, busy=0.3, prefetch=prefetch, shared_cores=shared))
    assert "not the bottleneck" in advice and expected in advice, advice
    assert f"Set distillation.prefetch={prefetch}" not in advice  # never today's value


def test_a_saturated_teacher_is_the_bottleneck_and_the_rank_count_is_more_than_today():
    # Teacher-bound with look-ahead: the step is the teacher's request time, the students compute 0.4 s of it.
    advice = teacher_wait_advice(measured(0.6, busy=0.95, prefetch=1, teacher_ranks=1, students=4))
    assert "the teacher is the bottleneck" in advice
    suggested = int(re.search(r"distillation\.n_teacher_ranks=(\d+)", advice).group(1))
    assert suggested == teacher_ranks_to_keep_up(1, 4, 0.95, 1.0, 0.6) == 4 and suggested > 1
    assert "8 ranks in all instead of 5" in advice
    # Several teachers: the busiest one's setting.
    several = teacher_wait_advice(measured(0.6, busy=0.95, teacher_ranks=1, students=4,
                                           rank_key="teacher 1's n_teacher_ranks in distillation.teachers"))
    assert "teacher 1's n_teacher_ranks in distillation.teachers=4" in several


def test_tensor_parallel_replicas_are_counted_in_replicas_then_ranks():
    advice = teacher_wait_advice(measured(0.6, busy=0.9, teacher_ranks=2, tp=2, students=4))
    needed = teacher_ranks_to_keep_up(1, 4, 0.9, 1.0, 0.6) * 2
    assert f"About {needed} teacher ranks" in advice and needed % 2 == 0 and needed > 2


@pytest.mark.parametrize("prefetch, shared", [(0, None), (0, CPU_DEMO), (2, None)])
def test_a_saturated_teacher_that_more_ranks_would_not_help_never_suggests_todays_count(prefetch, shared):
    # Saturated but already as many replicas as the estimate asks for (2 students on 2 teacher ranks).
    advice = teacher_wait_advice(measured(0.35, busy=0.85, prefetch=prefetch, shared_cores=shared, teacher_ranks=2))
    assert "the teacher is the bottleneck" in advice
    assert "n_teacher_ranks" not in advice and "today" not in advice
    assert ("Set distillation.prefetch=1" in advice) == (prefetch == 0 and shared is None)
    assert "smaller teacher" in advice


def test_the_busy_share_is_the_windows_not_since_the_handshake():
    before = {"kd/teacher_busy_s": 1.0, "kd/teacher_idle_s": 9.0}  # a long idle startup
    after = {"kd/teacher_busy_s": 4.0, "kd/teacher_idle_s": 10.0}
    assert busy_shares({}, after) == {}  # the first row has no window
    assert busy_shares(before, after) == {"": pytest.approx(0.75)}
    several = {"kd/0/teacher_busy_s": 2.0, "kd/0/teacher_idle_s": 2.0, "kd/1/teacher_busy_s": 1.0,
               "kd/1/teacher_idle_s": 1.0}
    later = {"kd/0/teacher_busy_s": 3.0, "kd/0/teacher_idle_s": 3.0, "kd/1/teacher_busy_s": 1.9,
             "kd/1/teacher_idle_s": 1.1}
    assert busy_shares(several, later) == {"0": pytest.approx(0.5), "1": pytest.approx(0.9)}


def test_oversubscribed_cores_counts_ranks_times_threads():
    assert oversubscribed_cores("cuda", 64, 64) is None
    assert oversubscribed_cores("cpu", 1, 1) is None
    assert re.fullmatch(r"100000 ranks x 1 threads on \d+ cores", oversubscribed_cores("cpu", 100000, 1))


def test_the_reporter_warns_once_from_the_second_log_row_with_the_windows_busy_share(caplog):
    """StepReporter.check_bottleneck: the first row only starts the window (the startup's idle time would dilute the
    busy share), the second warns with the window's share, and a later row never warns again."""
    import logging
    from types import SimpleNamespace

    import torch

    from apps.main.report import StepReporter

    reporter = StepReporter.__new__(StepReporter)  # only what check_bottleneck reads
    reporter.topo = SimpleNamespace(teacher_ranks=[2], teacher_tp=1, student_ranks=[0, 1], local_world_size=3,
                                    device=torch.device("cuda"))  # a GPU each: no shared cores in the advice
    reporter.distiller = SimpleNamespace(prefetch=1)
    reporter.warned_teacher_bound, reporter.teacher_clocks = False, {}

    def row(busy_s, idle_s):
        return {"speed/step_time_s": 1.0, "speed/teacher_wait_s": 0.5, "kd/teacher_busy_s": busy_s,
                "kd/teacher_idle_s": idle_s}
    with caplog.at_level(logging.WARNING, logger="train"):
        reporter.check_bottleneck(row(1.0, 20.0))  # since the handshake: 5% busy, mostly the startup
        assert caplog.records == []
        reporter.check_bottleneck(row(1.95, 20.05))  # this window: 95% busy
        reporter.check_bottleneck(row(2.0, 30.0))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("students spend 50% of the step waiting on the teacher, which is busy 95% of its time: "
                              "the teacher is the bottleneck. About 2 teacher ranks would keep up with 2 students "
                              "(distillation.n_teacher_ranks=2, 4 ranks in all instead of 3)"), warning
