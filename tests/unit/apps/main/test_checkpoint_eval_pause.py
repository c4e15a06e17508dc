"""An in-process checkpoint evaluation is a long pause every rank knows of: the students' marking rule, the
teacher's two-way timeout switch, the students' own timeouts around it, and its agreed outcome."""

import json
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import apps.main.checkpoint_eval as checkpoint_eval
import lingua.distillation.online.serving_clock as serving_clock
import lingua.parallel.timeouts as timeouts
from apps.main.checkpoint_eval import (CheckpointEvalFailed, CheckpointEvalStopped, CheckpointEvaluation,
                                       EvalAtCheckpointArgs, HarnessArgs)
from lingua.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery
from lingua.distillation.online.bridge import Op, RequestHeader
from lingua.distillation.micro_batches import MicroBatchFeed
from lingua.distillation.online.serving_clock import TimeoutSwitch
from lingua.errors import DataError

INIT_S, TRAIN_S = 600.0, 300.0


def train_args(eval_every: int, enabled: bool = True, async_eval_gpus=None):
    eval_section = EvalAtCheckpointArgs(harness=HarnessArgs(tasks=["pydocs_cloze"] if enabled else None))
    return SimpleNamespace(eval=eval_section, async_eval_gpus=async_eval_gpus, name="run",
                           checkpoint=CheckpointArgs(dump=SaveEvery(every=0), eval=SaveEvery(every=eval_every)),
                           distributed=SimpleNamespace(init_timeout_s=INIT_S, train_timeout_s=TRAIN_S))


def evaluation(args, tmp_path, topo=None) -> CheckpointEvaluation:
    manager = CheckpointManager(args.checkpoint, str(tmp_path), object(), 0, 1)
    return CheckpointEvaluation(args, topo or SimpleNamespace(distributed=False, is_train_master=True), manager)


class Loader:
    def __init__(self):
        self.drawn = 0

    def __next__(self):
        self.drawn += 1
        return {"n": self.drawn}

    def state_dict(self):
        return {"drawn": self.drawn}


class Student:
    """The student's side of the loop as train() runs it: announce, then the step's micro-batches and their
    requests (look-ahead included); each request's header as the client would build it."""

    def __init__(self):
        self.pause_follows, self.in_training, self.posted = False, False, []  # posted: (posting step, header)
        self.step = 0

    def announce_pause(self, pause_follows: bool) -> None:
        self.pause_follows = pause_follows

    def submit(self, batch, step, micro_step):  # the header as TeacherClient._post builds it
        header = RequestHeader(Op.FORWARD, step, micro_step, 1, 1, 0,
                               in_training=int(self.in_training and not self.pause_follows))
        header.marked = self.pause_follows
        self.posted.append((self.step, header))


def run_students(evaluation: CheckpointEvaluation, steps: int, grad_acc: int, prefetch: int):
    """The requests in the order they are posted, and after which of them an evaluation pause starts."""
    student = Student()
    feed = MicroBatchFeed(Loader(), student, grad_acc, prefetch, steps)
    pauses = []  # index into student.posted of the last request posted before each evaluation
    for step in range(1, steps + 1):
        student.step = step
        student.announce_pause(evaluation.announces_pause(step, feed))
        for mb in feed.start_step(step):
            feed.submit_ahead(mb)
        feed.finish_step(step)
        student.in_training = True  # mark_first_step_done, after the first step's agreement
        if "eval" in evaluation.checkpoint.should_save(step, last_step=step == steps):
            pauses.append(len(student.posted) - 1)
    assert student.posted[-1][0] == max(1, feed.last_request_step())  # where the look-ahead sends the last one
    return student.posted, pauses


def teacher_waits(posted, pauses) -> list[tuple[bool, float]]:
    """The teacher's side: (whether the wait after each request spans an evaluation, the timeout in force then)."""
    switch = TimeoutSwitch(SimpleNamespace(), (INIT_S, TRAIN_S))
    waits = []
    for i, (_, header) in enumerate(posted):
        switch.observe([header, header])
        waits.append((i in pauses, switch.timeout_s))
    return waits


@pytest.mark.parametrize("steps", [6, 7])
@pytest.mark.parametrize("grad_acc,prefetch", [(1, 0), (2, 0), (1, 1), (2, 1), (2, 2), (1, 2), (3, 2)])
def test_every_wait_across_an_evaluation_is_generous(tmp_path, monkeypatch, grad_acc, prefetch, steps):
    monkeypatch.setattr(serving_clock, "set_collective_timeout", lambda topo, seconds: None)
    posted, pauses = run_students(evaluation(train_args(eval_every=3), tmp_path), steps=steps,
                                  grad_acc=grad_acc, prefetch=prefetch)
    assert len(pauses) == 2
    marked = {(s, h.step, h.micro_step) for s, h in posted if h.marked}
    last_request_step = posted[-1][0]  # look-ahead sent the launch's last request then: later steps send none
    assert marked == {(s, h.step, h.micro_step) for s, h in posted if s in (3, 6) or 6 >= s >= last_request_step}
    waits = teacher_waits(posted, pauses)
    assert all(timeout == INIT_S for paused, timeout in waits if paused)
    # Every other wait once training runs is short, but those after a marked request (the step before a pause).
    first_in_training = next(i for i, (s, _) in enumerate(posted) if s > 1)
    assert all(timeout == TRAIN_S for i, (paused, timeout) in enumerate(waits)
               if i >= first_in_training and not posted[i][1].marked)


def test_marking_with_look_ahead_and_accumulation(tmp_path):
    """grad_acc=2, prefetch=1, eval every 3: during step 3 the student posts (3, 1) and the next step's (4, 0);
    (3, 0) went out during step 2 and is not marked."""
    posted, _ = run_students(evaluation(train_args(eval_every=3), tmp_path), steps=4, grad_acc=2, prefetch=1)
    assert [(s, h.step, h.micro_step) for s, h in posted if h.marked] == [(3, 3, 1), (3, 4, 0)]
    assert [(s, h.step, h.micro_step) for s, h in posted if s == 2] == [(2, 2, 1), (2, 3, 0)]


def test_last_step_evaluation_marks_the_launch_last_request(tmp_path):
    """The last step evaluates only on the cadence; look-ahead sent its request a step early, so that step marks."""
    posted, pauses = run_students(evaluation(train_args(eval_every=3), tmp_path), steps=6, grad_acc=1, prefetch=1)
    assert [(s, h.step) for s, h in posted if h.marked] == [(3, 4), (5, 6)]
    posted, pauses = run_students(evaluation(train_args(eval_every=3), tmp_path), steps=5, grad_acc=1, prefetch=1)
    assert [(s, h.step) for s, h in posted if h.marked] == [(3, 4)]  # step 5 saves a dump checkpoint only


@pytest.mark.parametrize("args", [train_args(eval_every=3, enabled=False), train_args(eval_every=3, async_eval_gpus=1),
                                  train_args(eval_every=0)], ids=["no eval section", "async", "no eval checkpoints"])
def test_nothing_is_marked_without_an_in_process_evaluation(tmp_path, args):
    posted, _ = run_students(evaluation(args, tmp_path), steps=7, grad_acc=2, prefetch=1)
    assert not any(h.marked for _, h in posted)


def test_timeout_switch_goes_both_ways(monkeypatch):
    switched = []
    monkeypatch.setattr(serving_clock, "set_collective_timeout", lambda topo, seconds: switched.append(seconds))
    switch = TimeoutSwitch(SimpleNamespace(), (INIT_S, TRAIN_S))
    armed = []
    switch.hang_watch = SimpleNamespace(arm=armed.append, cancel=lambda: None)

    def request(in_training: int, pause_follows: int = 0):  # as TeacherClient._post marks them
        switch.observe([RequestHeader(Op.FORWARD, 5, 0, 1, 1, r, in_training=int(in_training and not pause_follows))
                        for r in range(2)])
        switch.arm()
        return switch.timeout_s

    assert request(0) == INIT_S and switched == []  # the first step: generous from the start
    assert request(1) == TRAIN_S and switched == [TRAIN_S]
    assert request(1, pause_follows=1) == INIT_S and switched == [TRAIN_S, INIT_S]
    assert request(1, pause_follows=1) == INIT_S and switched == [TRAIN_S, INIT_S]  # no switch without a change
    assert request(1) == TRAIN_S and switched == [TRAIN_S, INIT_S, TRAIN_S]
    assert armed == [INIT_S, TRAIN_S, INIT_S, INIT_S, TRAIN_S]  # the hang watch follows the timeout in force
    switch.observe([RequestHeader(Op.STOP, 9, 0, 0, 0, 0, in_training=0)], stop=True)
    assert switch.timeout_s == TRAIN_S


def test_students_wait_under_the_generous_timeout_and_go_back(tmp_path, monkeypatch):
    switched, armed = [], []
    monkeypatch.setattr(timeouts, "set_collective_timeout", lambda topo, seconds: switched.append(seconds))
    monkeypatch.setattr(checkpoint_eval, "eval_args_for", lambda args, step, step_dir: None)
    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", lambda eval_args: switched.append("eval"))
    monkeypatch.setattr(checkpoint_eval, "first_error", lambda error, group, what: switched.append("agree"))
    topo = SimpleNamespace(distributed=True, is_train_master=True, train_group=object())
    hang_watch = SimpleNamespace(arm=lambda seconds, step: armed.append(seconds))
    evaluation(train_args(eval_every=3), tmp_path, topo).after_save(["eval"], 3, tmp_path, hang_watch, TRAIN_S)
    assert switched == [INIT_S, "eval", "agree", TRAIN_S] and armed == [INIT_S, TRAIN_S]


@pytest.mark.parametrize("fails", ["user", "bug"])
def test_single_student_outcome(tmp_path, monkeypatch, caplog, fails):
    def evaluate(eval_args):
        raise DataError("the task's data is missing") if fails == "user" else RuntimeError("boom")

    monkeypatch.setattr(checkpoint_eval, "eval_args_for", lambda args, step, step_dir: None)
    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", evaluate)
    run = evaluation(train_args(eval_every=3), tmp_path)
    if fails == "user":
        run.after_save(["eval"], 3, tmp_path)
        assert "failed on train rank 0: the task's data is missing; training goes on" in caplog.text
    else:
        with pytest.raises(CheckpointEvalFailed, match="RuntimeError: boom") as raised:
            run.after_save(["eval"], 3, tmp_path)
        assert isinstance(raised.value.__cause__, RuntimeError)


# ---------------------------------------------------------------- two students, a real gloo group

def agreed_outcome_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One of two students: rank 0's evaluation fails with a user error at step 3, with a bug at step 6."""
    from lingua.parallel.timeouts import group_timeouts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    topo = SimpleNamespace(distributed=True, is_train_master=rank == 0, train_group=group,
                           all_groups=lambda: [group], group_names={})
    seen = {}

    def evaluate(eval_args):
        seen["during"] = list(group_timeouts(group).values())
        raise DataError("no data for the task") if eval_args == 3 else RuntimeError("lm-eval broke")

    checkpoint_eval.eval_args_for = lambda args, step, step_dir: step
    checkpoint_eval.evaluate_checkpoint = evaluate
    args = train_args(eval_every=3)
    manager = CheckpointManager(args.checkpoint, out_dir, group, rank, 2)
    run = CheckpointEvaluation(args, topo, manager)
    result = {}
    run.after_save(["eval"], 3, out_dir, None, TRAIN_S)  # a user error: training goes on
    result["after_user_error"] = list(group_timeouts(group).values())
    try:
        run.after_save(["eval"], 6, out_dir, None, TRAIN_S)
    except (CheckpointEvalFailed, CheckpointEvalStopped) as err:
        result["raised"] = type(err).__name__
        result["words"] = str(err)
        result["cause"] = type(err.__cause__).__name__ if err.__cause__ is not None else None
    result["during"] = seen.get("during")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_agreed_outcome_on_two_students(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=agreed_outcome_rank, args=(rank, str(tmp_path / "init"), str(tmp_path)))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["during"][0] == INIT_S and all(t == TRAIN_S for r in ranks for t in r["after_user_error"])
    assert ranks[0]["raised"] == "CheckpointEvalFailed" and ranks[0]["cause"] == "RuntimeError"
    assert ranks[1]["raised"] == "CheckpointEvalStopped" and ranks[1]["cause"] is None
    for r in ranks:
        assert "checkpoint evaluation of step 6 failed on train rank 0: RuntimeError: lm-eval broke" in r["words"]
