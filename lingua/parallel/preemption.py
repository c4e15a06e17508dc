"""Preemption: signal handlers only set a local flag; the training loop agrees on it across ranks.

After the agreed save, a SLURM job is requeued (`requeue_if_slurm`; submitit requeues its own). A run that nothing
requeues (torchrun, a plain process) ends with `RunStopped`, a non-zero exit whose sentence says where it stopped,
so that torchrun --max-restarts resumes it instead of reporting an unfinished run as finished.
"""

import logging
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from lingua.errors import RunStopped

logger = logging.getLogger(__name__)


class PreemptionFlag:
    """SIGUSR2/SIGTERM set `requested`; the training loop agrees on it across ranks before acting.

    The handlers stay installed until the process exits: a late signal during shutdown is ignored
    rather than killing a rank that is saving or leaving its last barrier.
    """

    def __init__(self, signals=(signal.SIGUSR2, signal.SIGTERM)):
        self.requested = False
        self.signal_name: Optional[str] = None
        self.unfinished: Optional[str] = None  # the sentence of a run stopped early that nothing requeues
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        # Logging from a signal handler can deadlock on the handler lock; write raw bytes.
        os.write(sys.stderr.fileno(), f"received {self.signal_name}: will save and stop at the next agreed point\n".encode())

    def flags(self, injected: bool = False) -> dict:
        """This rank's part of the step's agreed flags: a stop asked for, and by which signal (the end names it)."""
        return dict(preempt=self.requested or injected, preempt_sigterm=self.signal_name == "SIGTERM",
                    preempt_sigusr2=self.signal_name == "SIGUSR2")

    def stopped(self, step: int, steps: int, agreed: dict, is_train_master: bool, dump_dir: str) -> None:
        """After the preemption save at `step` (every student, on the agreed `flags`): SLURM requeues the job as
        before; elsewhere a run stopped before its last step must end non-zero (`end`), said in one sentence."""
        if os.environ.get("SLURM_JOB_ID") is not None:  # the job's fact, the same on every rank
            requeue_if_slurm(is_train_master, dump_dir)
        elif step < steps:
            self.unfinished = stopped_sentence(step, steps, agreed)

    def end(self) -> None:
        """After the process groups are gone (every rank left cleanly): a run stopped early exits non-zero."""
        if self.unfinished is not None:
            raise RunStopped(self.unfinished)

    def ignore_further(self) -> None:
        """After the stop is decided, later signals are moot: ignore them through interpreter exit
        (Python resets its own handlers to the default action at shutdown, which would kill us)."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)


def stopped_sentence(step: int, steps: int, agreed: dict) -> str:
    """`stopped at step 11 of 30 on SIGTERM; ...`: the signal as the students agreed on it."""
    what = ("SIGTERM" if agreed.get("preempt_sigterm") else "SIGUSR2" if agreed.get("preempt_sigusr2") else
            "a teacher rank's preemption signal" if agreed.get("teacher_preempt") else "an injected preemption")
    return (f"stopped at step {step} of {steps} on {what}, its checkpoint saved; relaunch to resume (torchrun "
            f"--max-restarts does so itself)")


REQUEUE_TIMEOUT_S = 60  # seconds for `scontrol requeue` to answer (submitit's own requeue waits as long)


@contextmanager
def sigterm_ignored():
    """SIGTERM ignored in this process and in the programs it starts meanwhile (an ignored signal survives exec).

    `scontrol requeue` ends the job's steps with SIGTERM at once: in a rank that runs it, that signal would kill
    scontrol after the job was requeued but before it exits 0, and the requeue would read as a failure. Main thread
    only (Python sets handlers there); SLURM's SIGKILL KillWait seconds later still ends a process that hangs.
    """
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def requeue_if_slurm(is_train_master: bool, dump_dir: Optional[str] = None) -> None:
    """After a preemption save, one rank asks SLURM to requeue the job (submitit requeues by itself), first leaving
    the marker that tells stool's job script this requeue was no failure (lingua/slurm.py, max_failure_requeues)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not is_train_master or job_id is None or os.environ.get("SUBMITIT_EXECUTOR"):
        return
    if dump_dir is not None:
        marker = Path(dump_dir) / "logs" / f"requeued_by_preemption.{job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    try:  # bounded, as submitit's own requeue: a stuck controller must not hold this rank with SIGTERM ignored
        with sigterm_ignored():  # the requeue's own SIGTERM must not kill scontrol before it reports
            result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                                    timeout=REQUEUE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.error(f"scontrol requeue {job_id} did not answer within {REQUEUE_TIMEOUT_S} s; requeue the job by hand")
        return
    if result.returncode == 0:
        logger.info(f"requeued SLURM job {job_id}")
    else:
        logger.error(f"scontrol requeue {job_id} failed: {result.stderr.strip()}")
