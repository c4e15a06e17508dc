"""lingua.parallel.preemption's requeue: `scontrol requeue` outlives the SIGTERM its own requeue sends the job."""

import logging
import os
import signal
import stat
from pathlib import Path

import pytest

from lingua.parallel.preemption import requeue_if_slurm

pytestmark = pytest.mark.timeout(60)


def fake_scontrol(tmp_path: Path, monkeypatch) -> Path:
    """An `scontrol` first on PATH that records its arguments, then, as SLURM does once a job is requeued, gets
    SIGTERM before it exits 0. Returns the file its arguments go to."""
    calls = tmp_path / "scontrol_calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nkill -TERM $$\nexit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_the_requeue_is_reported_done_though_slurm_sigterms_the_job_at_once(tmp_path, monkeypatch, caplog):
    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="lingua.parallel.preemption"):
        requeue_if_slurm(True, str(tmp_path))
    assert calls.read_text() == "requeue 7\n"
    assert (tmp_path / "logs" / "requeued_by_preemption.7.2").exists()  # left before the requeue
    assert [r.getMessage() for r in caplog.records] == ["requeued SLURM job 7"]
    assert signal.getsignal(signal.SIGTERM) is handler  # the trainer's own handler is back


def test_only_the_train_master_requeues_and_never_under_submitit(tmp_path, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    requeue_if_slurm(False, str(tmp_path))
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    requeue_if_slurm(True, str(tmp_path))
    assert not calls.exists() and not (tmp_path / "logs").exists()


def test_a_controller_that_never_answers_is_given_up_on_with_a_sentence(tmp_path, monkeypatch, caplog):
    """SIGTERM is ignored around the requeue, so a stuck `scontrol` must not hold the rank: bounded, then logged."""
    from lingua.parallel import preemption

    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setattr(preemption, "REQUEUE_TIMEOUT_S", 0.5)
    handler = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="lingua.parallel.preemption"):
        requeue_if_slurm(True, str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        "scontrol requeue 7 did not answer within 0.5 s; requeue the job by hand"]
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.fixture
def preemption_flag():
    """A PreemptionFlag installs SIGUSR2/SIGTERM handlers: they are put back after the test."""
    from lingua.parallel.preemption import PreemptionFlag

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    yield PreemptionFlag()
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_run_stopped_early_that_nothing_requeues_ends_in_one_sentence(tmp_path, monkeypatch, preemption_flag):
    from lingua.errors import RunStopped

    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    os.kill(os.getpid(), signal.SIGTERM)  # `kill <pid>`: the handler only notes it
    agreed = preemption_flag.flags()
    assert agreed == dict(preempt=True, preempt_sigterm=True, preempt_sigusr2=False)
    preemption_flag.stopped(11, 30, agreed, True, str(tmp_path))
    with pytest.raises(RunStopped, match=r"^stopped at step 11 of 30 on SIGTERM, its checkpoint saved; relaunch to "
                                         r"resume \(torchrun --max-restarts does so itself\)$"):
        preemption_flag.end()
    assert not calls.exists()  # no scontrol outside SLURM


def test_a_run_preempted_at_its_last_step_or_under_slurm_ends_cleanly(tmp_path, monkeypatch, preemption_flag):
    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    preemption_flag.stopped(30, 30, dict(preempt=True, teacher_preempt=True), True, str(tmp_path))
    preemption_flag.end()  # finished: nothing to resume
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    preemption_flag.stopped(11, 30, preemption_flag.flags(injected=True), True, str(tmp_path))
    preemption_flag.end()  # SLURM requeues it, as before
    assert calls.read_text() == "requeue 7\n"


def test_the_sentence_names_the_signal_the_students_agreed_on():
    from lingua.parallel.preemption import stopped_sentence

    words = {key: stopped_sentence(3, 6, {key: True}).split(", its")[0] for key in
             ("preempt_sigusr2", "teacher_preempt", "preempt")}
    assert words == {"preempt_sigusr2": "stopped at step 3 of 6 on SIGUSR2",
                     "teacher_preempt": "stopped at step 3 of 6 on a teacher rank's preemption signal",
                     "preempt": "stopped at step 3 of 6 on an injected preemption"}
