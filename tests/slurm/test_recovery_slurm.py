"""stool's in-job restarts on the real one-node SLURM cluster (issue 45): a job whose rank is SIGKILLed reruns its
launch step and finishes; a job that crashes at the same step three times stops with one sentence.

Cost on 2 cores: ~1.5 min for the SIGKILL (2 launch steps of 3 ranks), ~2 min for the crash loop (4 steps)."""

import json
import os
import signal

import pytest

from lingua.run.dump_dir import RunDir, read_jsonl
from tests.fault_injection import ENV_VAR
from tests.runs import FAULTY_TRAINER
from tests.slurm.conftest import describe_dump, wait_for, wait_for_job_end
from tests.slurm.test_stool_slurm import (distill_argv, kd_inputs, run_stool, train_rows,  # noqa: F401 (fixtures)
                                         trainer_ready)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def with_injected_failure(argv: list[str], spec: str) -> list[str]:
    """stool's argv for the trainer with `spec` injected (tests/fault_injection.py): the job runs that module, from a
    code snapshot that holds tests/, and reads the spec from its environment (the job's line holds only config=)."""
    split = argv.index("--")
    exports = next(item for item in argv[:split] if item.startswith("exports={"))
    harness = [f"script={FAULTY_TRAINER}", "code_dirs=[apps,lingua,setup,configs,tests]",
               exports.removesuffix("}") + f", {ENV_VAR}: '{spec}'}}"]
    # stool fills preemption_grace_s for apps.main.train only; the harness runs the same trainer with the same value.
    return [item for item in argv[:split] if item != exports] + harness + argv[split:] + ["preemption_grace_s=60"]


def running_pid(dump_dir, rank: int):
    try:
        record = json.loads(RunDir(dump_dir).status(rank).read_text())
    except (OSError, ValueError):
        return None
    return record["pid"] if record["state"] == "running" else None


@pytest.mark.timeout(900)
def test_a_sigkilled_rank_reruns_the_launch_step_and_the_job_finishes(slurm_cluster, jobs, tmp_path, kd_inputs):
    dump_dir = tmp_path / "dump"
    job_id = run_stool(distill_argv("sbatch", slurm_cluster, dump_dir, *kd_inputs, steps=8,
                                    **{"checkpoint.dump.every": 3}), jobs)
    wait_for(lambda: any(r["step"] >= 4 for r in train_rows(dump_dir)), 400, "step 4", job_id,
             lambda: describe_dump(dump_dir), poll=0.2)
    os.kill(running_pid(dump_dir, 1), signal.SIGKILL)
    info = wait_for_job_end(job_id, 540, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{logs}"
    assert "in-job restart 1 of 3" in (dump_dir / "logs" / f"{job_id}.stdout").read_text(), logs
    assert sorted({r["step"] for r in train_rows(dump_dir)}) == list(range(1, 9)), logs
    (crash,) = read_jsonl(RunDir(dump_dir).recovery)
    assert crash["first_rank"] == 1 and crash["resumed_from"] == 3, crash
    assert train_rows(dump_dir)[-1]["recovery/restarts"] == 1


@pytest.mark.timeout(900)
def test_a_job_crashing_at_the_same_step_three_times_stops_with_the_sentence(slurm_cluster, jobs, tmp_path,
                                                                              kd_inputs):
    dump_dir = tmp_path / "dump"
    job_id = run_stool(with_injected_failure(distill_argv("sbatch", slurm_cluster, dump_dir, *kd_inputs, steps=8,
                                                          **{"checkpoint.dump.every": 3}), "raise:0@4"), jobs)
    info = wait_for_job_end(job_id, 840, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "FAILED", f"{info}\n{logs}"
    batch = (dump_dir / "logs" / f"{job_id}.stdout").read_text()
    assert "in-job restart 3 of 3" in batch and "in-job restart 4" not in batch, logs
    sentence = "error: the run crashed at step 4 3 times in a row, the last time first on rank 0 (student, it failed)"
    assert sentence in (dump_dir / "logs" / job_id / f"{job_id}_0.log").read_text(), logs
    assert [row["step"] for row in read_jsonl(RunDir(dump_dir).recovery)] == [4, 4, 4]
