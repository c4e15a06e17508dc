"""A real one-node SLURM cluster for the stool tests, set up by setup/slurm_local.sh when possible.

The session fixture runs the script as root when slurm is installed or apt-get can install it, and
skips every test here with the reason otherwise; every such skip goes through `cannot_run`, so that
LINGUA_REQUIRE_SLURM=1 (CI) turns it into a failure. Jobs are watched with squeue / scontrol (sacct
would need slurmdbd); each wait has a hard deadline after which the job is cancelled and the test
fails with the job's state and logs.
"""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTITION = "debug"
REQUEUE_SETTLE_S = 2.0  # seen PENDING (held) this long before a requeued job's start is moved to now


def cannot_run(reason: str):
    """Skip, unless LINGUA_REQUIRE_SLURM=1 (set by .ci/run): then it fails. The only way tests/slurm skips."""
    if os.environ.get("LINGUA_REQUIRE_SLURM") == "1":
        pytest.fail(f"LINGUA_REQUIRE_SLURM=1 but the SLURM tests cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The partition name of a running local cluster (idempotent setup)."""
    installed = all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch"))
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        cannot_run("SLURM tests need root to install and start slurmctld/slurmd/munged (setup/slurm_local.sh).")
    if not installed and shutil.which("apt-get") is None:
        cannot_run("SLURM is not installed and apt-get is not available to install it.")
    try:
        result = subprocess.run(["bash", str(ROOT / "setup" / "slurm_local.sh")], capture_output=True, text=True,
                                timeout=900, env=dict(os.environ, SLURM_LOCAL_PARTITION=PARTITION))
    except subprocess.TimeoutExpired:
        pytest.fail("setup/slurm_local.sh did not finish within 900s.")
    output = (result.stdout + result.stderr)[-3000:]
    if result.returncode != 0:
        if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
            cannot_run(f"Could not install SLURM with apt-get (no network or no package?):\n{output}")
        pytest.fail(f"setup/slurm_local.sh failed:\n{output}")
    return PARTITION


@pytest.fixture
def jobs():
    """Job ids submitted by a test; whatever is still queued at the end is cancelled."""
    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        subprocess.run(["scancel", job_id], capture_output=True)


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict ({} once the job has left slurmctld's memory)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return {}
    return dict(re.findall(r"(\S+?)=(\S*)", result.stdout))


def queue_state(job_id: str) -> str:
    """PENDING / RUNNING / ... while the job is in the queue, "" after it left."""
    result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return result.stdout.strip()


def wait_for(predicate, timeout: float, what: str, job_id: str, describe=lambda: "", poll: float = 1.0):
    """Poll until predicate() is truthy; on timeout cancel the job and fail with its state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    subprocess.run(["scancel", job_id], capture_output=True)
    pytest.fail(f"HANG: {what} did not happen within {timeout}s for job {job_id}: {job_info(job_id)}\n{describe()}")


def wait_for_job_end(job_id: str, timeout: float, describe=lambda: "") -> dict[str, str]:
    """Wait until the job leaves the queue; a requeued job's 120s BeginTime hold is cut short.

    slurmctld holds every requeued job for two minutes (BeginTime); that is queue policy, not
    something stool controls, so the test moves the start time to now to keep the run short, but
    only after it has been seen held for REQUEUE_SETTLE_S: restarting at once races slurmd's cleanup of
    the previous run ("Job credential revoked"), which is over by then (was 5 s; 2 s measured enough
    in 2 x 5 requeues on the loaded 2-core machine).
    """
    held_since = []

    def ended():
        state = queue_state(job_id)
        if state == "PENDING" and job_info(job_id).get("Reason") == "BeginTime":
            held_since.append(time.time())
            if time.time() - held_since[0] >= REQUEUE_SETTLE_S:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
                held_since.clear()
        return not state

    wait_for(ended, timeout, "job completion", job_id, describe, poll=1.0)
    return job_info(job_id)


def tail(path: Path, chars: int = 4000) -> str:
    return f"--- {path}\n{path.read_text()[-chars:]}" if path.exists() else f"--- {path} (missing)"


def describe_dump(dump_dir: Path) -> str:
    """The logs of a dump dir, for failure messages."""
    parts = [tail(p) for p in sorted((dump_dir / "logs").rglob("*")) if p.is_file()]
    parts += [tail(p) for p in sorted((dump_dir / "submitit").glob("*.out"))]
    parts += [tail(p) for p in sorted((dump_dir / "submitit").glob("*.err"))]
    return "\n".join(parts)[-12000:]
