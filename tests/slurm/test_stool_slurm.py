"""stool against a real one-node SLURM cluster (see conftest.py): srun, sbatch, USR2, requeue, resume.

Order: srun smoke tests; the requeue plumbing with a fake trainer (no torch); then the real
trainer (2 students + 1 tiny teacher on CPU) submitted, preempted with USR2, requeued and resumed,
through sbatch and through submitit.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.slurm.conftest import ROOT, cannot_run, describe_dump, wait_for, wait_for_job_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PY = sys.executable


def srun(partition: str, ntasks: int, command: list[str], timeout: float, env: dict | None = None):
    cmd = ["srun", f"--partition={partition}", f"--ntasks={ntasks}", "--cpus-per-task=1", "--kill-on-bad-exit=1",
           *command]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"HANG: {' '.join(cmd)} did not finish within {timeout}s: {err.stdout}{err.stderr}")


def run_stool(argv: list[str], jobs: list[str]) -> str:
    """`python -m lingua.stool ...` with no terminal; returns the submitted job id."""
    result = subprocess.run([PY, "-m", "lingua.stool", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=180, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"submitted job (\d+)", result.stdout)
    assert match, result.stdout
    jobs.append(match.group(1))
    return match.group(1)


def read_rows(dump_dir: Path) -> list[dict]:
    path = dump_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checkpoint_steps(dump_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (dump_dir / "checkpoints").glob("[0-9]" * 10))


def preempt_when(dump_dir: Path, job_id: str, min_step: int, timeout: float) -> float:
    """Once metrics reach min_step, send USR2 to the job's steps (every rank); returns the time."""
    wait_for(lambda: any(r.get("step", 0) >= min_step for r in read_rows(dump_dir)), timeout,
             f"metrics step {min_step}", job_id, lambda: describe_dump(dump_dir), poll=0.2)  # a file read: poll often
    # Without --batch/--full, scancel signals the job steps only: every srun task (rank) gets USR2,
    # the batch shell does not (it would die of it).
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    return time.time()


# ---------------------------------------------------------------- the cluster itself

@pytest.mark.timeout(180)
def test_srun_runs_three_tasks_on_two_cores(slurm_cluster):
    result = srun(slurm_cluster, 3, ["bash", "-c", 'echo "$SLURM_PROCID $SLURM_NTASKS $SLURM_LOCALID"'], 120)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:-1]) == ["0 3 0", "1 3 1", "2 3 2"]


@pytest.mark.timeout(300)
def test_three_task_gloo_all_reduce_under_srun(slurm_cluster):
    code = ("import os, torch, torch.distributed as dist\n"
            "rank, world = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS'])\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + os.environ['PORT'], rank=rank,"
            " world_size=world)\n"
            "t = torch.tensor([float(rank)])\n"
            "dist.all_reduce(t, group=dist.group.WORLD)\n"
            "print('sum', int(t.item()))\n"
            "dist.destroy_process_group()\n")
    port = str(20000 + os.getpid() % 20000)
    result = srun(slurm_cluster, 3, [PY, "-c", code], 240, env={"PORT": port, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sum", "3"] * 3


@pytest.mark.timeout(120)
def test_kill_on_bad_exit_ends_the_step(slurm_cluster):
    start = time.time()
    result = srun(slurm_cluster, 3, ["bash", "-c", 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; sleep 300'], 90)
    assert result.returncode != 0
    assert time.time() - start < 60


# ---------------------------------------------------------------- requeue plumbing, fake trainer

@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher, torchrun", [("sbatch", False), ("submitit", False), ("sbatch", True)],
                         ids=["sbatch", "submitit", "sbatch-torchrun"])
def test_fake_trainer_preempt_requeue_resume(slurm_cluster, jobs, tmp_path, launcher, torchrun):
    steps = 40
    dump_dir = tmp_path / "dump"
    config = tmp_path / "fake.yaml"
    # The first run steps slowly so that USR2 lands mid-run; the requeued run (nothing signals it) does not wait.
    config.write_text(yaml.safe_dump({"dump_dir": str(dump_dir), "steps": steps, "step_s": 0.25,
                                      "resumed_step_s": 0.0}))
    job_id = run_stool([f"launcher={launcher}", "script=tests.slurm.fake_trainer", f"config={config}", "ngpus=0",
                        "ntasks_per_node=3", "ncpu=1", f"partition={slurm_cluster}", "code_dirs=[lingua,tests]",
                        "signal_grace_s=30", f"torchrun_per_node={str(torchrun).lower()}"], jobs)

    preempt_when(dump_dir, job_id, 5, 120)
    info = wait_for_job_end(job_id, 300, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{logs}"
    assert info.get("Restarts") == "1", f"{info}\n{logs}"

    saved = [s for s in checkpoint_steps(dump_dir) if s != steps]
    assert len(saved) == 1 and 5 <= saved[0] < steps, (checkpoint_steps(dump_dir), logs)
    rows = read_rows(dump_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), logs  # resumed exactly after the save
    assert {r["restart"] for r in rows if r["step"] <= saved[0]} == {0}
    assert {r["restart"] for r in rows if r["step"] > saved[0]} == {1}
    assert f"start restart=1 resumed_from={saved[0]}" in logs
    assert f"cwd={dump_dir / 'code'}" in logs  # the requeued job ran the snapshot
    if launcher == "sbatch":
        batch_log = (dump_dir / "logs" / f"{job_id}.stdout").read_text()
        assert f"job {job_id} restart 0" in batch_log and f"job {job_id} restart 1" in batch_log
        rank0 = (dump_dir / "logs" / job_id / (f"{job_id}_node0.log" if torchrun else f"{job_id}_0.log")).read_text()
        assert "start restart=0" in rank0 and "start restart=1" in rank0  # the second run appended
    else:
        rank0 = (dump_dir / "submitit" / f"{job_id}_0_log.out").read_text()
        assert "start restart=0" in rank0 and "start restart=1" in rank0
        assert f"Requeued job {job_id}" in rank0  # by submitit's own preemption path, on rank 0


# ---------------------------------------------------------------- the real trainer

@pytest.fixture(scope="module")
def trainer_ready():
    result = subprocess.run([PY, "-c", "import apps.main.train"], cwd=ROOT, capture_output=True, text=True,
                            timeout=180)
    if result.returncode != 0:
        cannot_run(f"apps.main.train is not importable: {result.stderr.strip().splitlines()[-1:]}")
    if not (ROOT / "configs" / "distill_exps" / "debug_cpu.yaml").exists():
        cannot_run("configs/distill_exps/debug_cpu.yaml does not exist.")


@pytest.fixture(scope="module")
def kd_inputs(tmp_path_factory, trainer_ready):
    """A corpus whose source is named like debug_cpu.yaml's (pydocs), and a tiny random teacher."""
    from setup.make_tiny_teacher import make_tiny_teacher
    from tests.runs import write_corpus

    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    (corpus / "text").rename(corpus / "pydocs")
    teacher = make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", seed=0)
    return corpus, teacher


def distill_argv(launcher: str, partition: str, dump_dir: Path, corpus: Path, teacher: Path, steps: int,
                 **extra) -> list[str]:
    """stool options for 2 students + 1 teacher on CPU, then training overrides after `--`."""
    overrides = {
        "steps": steps, "data.root_dir": corpus, "distillation.teacher_path": teacher,
        "data.tokenizer.path": teacher, "data.batch_size": 2, "data.seq_len": 32, "data.load_async": "false",
        "model.dim": 32, "model.max_seqlen": 32, "distillation.k": 8, "logging.freq": 1,
        "checkpoint.dump.every": 1000, "distributed.init_timeout_s": 120, "distributed.train_timeout_s": 60,
        **extra}  # the test's own settings win
    return [f"launcher={launcher}", "config=configs/distill_exps/debug_cpu.yaml", f"dump_dir={dump_dir}", "ngpus=0",
            "ntasks_per_node=3", "ncpu=1", f"partition={partition}", "signal_grace_s=60",
            "exports={HF_HUB_OFFLINE: '1', TRANSFORMERS_OFFLINE: '1', WANDB_MODE: disabled,"
            " TOKENIZERS_PARALLELISM: 'false'}",
            "--", *[f"{k}={v}" for k, v in overrides.items()]]


def train_rows(dump_dir: Path) -> list[dict]:
    return [r for r in read_rows(dump_dir) if "loss/ce" in r]


@pytest.mark.timeout(1200)
def test_distill_job_trains_checkpoints_and_relaunches_by_hand(slurm_cluster, jobs, tmp_path, kd_inputs):
    """A job that stops at step 3 of 6 (as a crash after a save would) goes on with `sbatch submit.slurm`."""
    dump_dir = tmp_path / "dump"
    job_id = run_stool(distill_argv("sbatch", slurm_cluster, dump_dir, *kd_inputs, steps=6, exit_after_steps=3), jobs)
    info = wait_for_job_end(job_id, 540, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{logs}"
    rows = train_rows(dump_dir)
    assert [r["step"] for r in rows] == [1, 2, 3], logs
    assert all(r["loss/kd"] >= 0 and r["loss/ce"] > 0 for r in rows)
    assert checkpoint_steps(dump_dir) == [3]
    assert sorted(p.name for p in (dump_dir / "logs" / job_id).iterdir()) == [f"{job_id}_{r}.log" for r in range(3)]
    teacher_log = dump_dir / "logs" / "rank_2.log"
    assert teacher_log.read_text().count("STOP received") == 1, logs  # the students stopped the teacher

    relaunch = subprocess.run(["sbatch", "--parsable", str(dump_dir / "submit.slurm")], capture_output=True, text=True,
                              timeout=60)
    assert relaunch.returncode == 0, relaunch.stderr
    second = relaunch.stdout.strip().split(";")[0]
    jobs.append(second)
    info = wait_for_job_end(second, 540, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{logs}"
    assert [r["step"] for r in train_rows(dump_dir)] == list(range(1, 7)), logs
    assert 6 in checkpoint_steps(dump_dir)
    assert (dump_dir / "checkpoints" / f"{6:010d}" / "params.json").exists()
    assert "resumed from step 3" in (dump_dir / "logs" / "rank_0.log").read_text()
    assert teacher_log.read_text().count("STOP received") == 2, logs


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_distill_job_preempted_requeued_resumes(slurm_cluster, jobs, tmp_path, kd_inputs, launcher):
    steps = 40
    dump_dir = tmp_path / "dump"
    job_id = run_stool(distill_argv(launcher, slurm_cluster, dump_dir, *kd_inputs, steps=steps), jobs)
    preempt_when(dump_dir, job_id, 3, 600)
    info = wait_for_job_end(job_id, 540, lambda: describe_dump(dump_dir))
    logs = describe_dump(dump_dir)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{logs}"
    assert info.get("Restarts") == "1", f"{info}\n{logs}"

    saved = [s for s in checkpoint_steps(dump_dir) if s != steps]
    assert len(saved) == 1 and 3 <= saved[0] < steps, (checkpoint_steps(dump_dir), logs)
    assert [r["step"] for r in train_rows(dump_dir)] == list(range(1, steps + 1)), logs
    rank_logs = [p.read_text() for p in (dump_dir / "logs").glob("rank_*.log")]
    assert sum(f"resumed from step {saved[0]}" in text for text in rank_logs) == 2, logs  # both students
    # The teacher was told to stop before the requeue, and again at the end.
    assert (dump_dir / "logs" / "rank_2.log").read_text().count("STOP received") == 2, logs
