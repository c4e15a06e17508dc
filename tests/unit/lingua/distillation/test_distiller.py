"""The Distiller's seam: what the loop's six calls do with the roads' hooks (pause, control point, first step, STOP)."""

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.distiller import Distiller
from lingua.parallel.collectives import AgreedError


class RecordingDistiller(Distiller):
    """A road whose hooks record their calls; its teacher reports an error bit and a preemption bit."""

    first_round_trip = (1.0, 2.0)

    def __init__(self, teacher_error: bool = False):
        super().__init__(DistillationArgs())
        self.calls, self.teacher_error = [], teacher_error

    def announce_pause(self, pause_follows: bool) -> None:
        self.calls.append(("pause", pause_follows))

    def control_flags(self) -> dict:
        return {"teacher_error": torch.tensor(int(self.teacher_error)), "teacher_preempt": torch.tensor(0)}

    def after_agreement(self, flags: dict) -> None:
        self.calls.append(("agreed", dict(flags)))
        if flags["teacher_error"]:
            raise AgreedError("the teacher failed")

    def mark_first_step_done(self) -> None:
        self.calls.append(("first_step_done",))

    def stop(self, step: int, error: bool = False) -> None:
        self.calls.append(("stop", step, error))

    def report_exit(self) -> None:
        self.calls.append(("exit",))


class Phases:
    def __init__(self):
        self.spans = []

    def record(self, name: str, start: float, end: float) -> None:
        self.spans.append((name, start, end))


def test_begin_step_announces_whether_a_pause_follows():
    distiller = RecordingDistiller()
    distiller.begin_step(1, 1.0, pause_follows=True)
    distiller.begin_step(2, 1.0)
    assert distiller.calls == [("pause", True), ("pause", False)]


def test_the_control_point_agrees_the_loops_and_the_teachers_flags_and_ends_the_first_step_once():
    distiller, phases = RecordingDistiller(), Phases()
    distiller.phases = phases
    for step in (1, 2):
        flags = distiller.agree({"preempt": step == 2, "save_due": False}, None, torch.device("cpu"))
        assert flags == {"preempt": step == 2, "save_due": False, "teacher_error": False, "teacher_preempt": False}
    assert [call[0] for call in distiller.calls] == ["agreed", "first_step_done", "agreed"]
    assert phases.spans == [("first_teacher_round_trip", 1.0, 2.0)]  # recorded once, after the first agreement


def test_an_agreed_teacher_error_is_raised_before_the_first_step_is_marked_done():
    distiller = RecordingDistiller(teacher_error=True)
    with pytest.raises(AgreedError):
        distiller.agree({"preempt": False}, None, torch.device("cpu"))
    assert [call[0] for call in distiller.calls] == ["agreed"] and not distiller.first_step_done


def test_the_session_sends_stop_at_the_end_error_on_an_agreed_error_and_nothing_on_a_rank_own_error():
    step = 7
    ended = RecordingDistiller()
    with ended.session(lambda: step):
        pass
    assert ended.calls == [("stop", 7, False), ("exit",)]
    agreed = RecordingDistiller()
    with pytest.raises(AgreedError), agreed.session(lambda: step):
        raise AgreedError("non-finite loss on every student")
    assert agreed.calls == [("stop", 7, True), ("exit",)]
    own = RecordingDistiller()
    with pytest.raises(RuntimeError), own.session(lambda: step):
        raise RuntimeError("this rank's own failure")
    assert own.calls == [("exit",)]  # its peers may be blocked in a collective: no STOP, no ERROR
