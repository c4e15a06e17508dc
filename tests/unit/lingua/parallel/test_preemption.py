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
