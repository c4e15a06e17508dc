"""Rank facts at start: what the launcher's environment means (torchrun, srun), which GPU a local rank
expects and what a gathered map that binds wrongly says (hang_bug_ideas.md: "A rank on the wrong device"), and
which startup phase files belong to this launch. The gathering itself runs in every torchrun test (on CPU: no GPU rows)."""

import json
import os

import pytest

from lingua.distributed import device_map_problems
from lingua.parallel.launch_plan import LaunchEnv, expected_cuda_index, read_launch_env
from lingua.timing import PhaseLog, read_phase_files

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launch_env(monkeypatch):
    """A clean launch environment; returns a setter for the variables of one case."""
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith("SLURM_"):
            monkeypatch.delenv(key)

    def set_env(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
    return set_env


# What srun puts in a task's environment (observed on a real one-node cluster: `srun --ntasks=3`).
SRUN_TASK = dict(SLURM_PROCID=1, SLURM_LOCALID=1, SLURM_NTASKS=3, SLURM_STEP_ID=0, SLURM_STEP_NUM_TASKS=3,
                 SLURM_STEP_TASKS_PER_NODE=3, SLURM_TASKS_PER_NODE=3)


def test_srun_tasks_with_the_rendezvous_stool_exports(launch_env):
    launch_env(**SRUN_TASK, MASTER_ADDR="node1", MASTER_PORT=12345)  # what submit.slurm exports before srun
    assert read_launch_env() == LaunchEnv(1, 3, 1, 3, "node1", 12345, "slurm")


def test_srun_tasks_without_master_addr_are_an_error_not_lone_rank_zeros(launch_env):
    launch_env(**SRUN_TASK)
    with pytest.raises(ValueError, match=r"^srun started 3 tasks but MASTER_ADDR is not set, .* export MASTER_ADDR "
                                         r".* and MASTER_PORT before srun, or submit with `python -m lingua.stool`"):
        read_launch_env()


def test_a_batch_shell_of_a_multi_task_job_is_not_a_rank(launch_env):
    # sbatch --ntasks=3 runs the script itself as one process with SLURM_NTASKS=3 and no step id.
    launch_env(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=3, SLURM_TASKS_PER_NODE=3, MASTER_ADDR="node1")
    with pytest.raises(ValueError, match=r"^This SLURM job has 3 tasks but this process was not started by srun"):
        read_launch_env()


def test_single_task_steps_and_plain_processes_are_one_rank(launch_env):
    # srun --ntasks=1 inside a 3-task job: the step's own count wins.
    launch_env(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=1, SLURM_STEP_ID=1, SLURM_STEP_NUM_TASKS=1)
    assert read_launch_env() == LaunchEnv(0, 1, 0, 1, None, None, "single")


def test_torchrun_inside_a_slurm_step_wins(launch_env):
    launch_env(**SRUN_TASK, RANK=4, WORLD_SIZE=8, LOCAL_RANK=0, LOCAL_WORLD_SIZE=4, MASTER_ADDR="n1", MASTER_PORT=29500)
    assert read_launch_env() == LaunchEnv(4, 8, 0, 4, "n1", 29500, "torchrun")


def test_phase_files_of_an_earlier_larger_launch_are_left_out(tmp_path):
    for rank, seconds in ((0, 1.0), (1, 2.0), (2, 9.0), (3, 7.0)):  # an earlier launch of 4 ranks
        PhaseLog(str(tmp_path), rank, "student").record("model_build", 100.0, 100.0 + seconds)
    for rank, seconds in ((0, 3.0), (1, 4.0)):  # this launch: 2 ranks, their own files rewritten
        PhaseLog(str(tmp_path), rank, "student").record("model_build", 200.0, 200.0 + seconds)
    assert json.loads((tmp_path / "startup.3.jsonl").read_text())["seconds"] == 7.0  # still on disk
    assert read_phase_files(str(tmp_path), world_size=2) == {"model_build": {0: 3.0, 1: 4.0}}
    assert read_phase_files(str(tmp_path)) == {"model_build": {0: 3.0, 1: 4.0, 2: 9.0, 3: 7.0}}


def test_expected_gpu_per_local_rank():
    assert [expected_cuda_index(r, 8, 8) for r in range(8)] == list(range(8))  # torchrun: the node's GPUs
    assert [expected_cuda_index(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]  # srun --gpus-per-task=1
    with pytest.raises(ValueError, match="Local rank 5 has no GPU: only 4 visible to it for 8 local ranks"):
        expected_cuda_index(5, 8, 4)


def row(rank, local_rank, host="node1", uuid="", problem=""):
    return dict(rank=rank, local_rank=local_rank, host=host, gpu_uuid=uuid, problem=problem)


def test_a_gpu_shared_by_two_ranks_of_one_host_is_named():
    rows = [row(0, 0, uuid="GPU-a"), row(1, 1, uuid="GPU-a"), row(2, 0, host="node2", uuid="GPU-a"),
            row(3, 1, host="node2", uuid="GPU-b")]
    assert device_map_problems(rows) == ["ranks [0, 1] on node1 share one GPU (GPU-a)"]


def test_per_rank_problems_come_first_and_cpu_rows_are_fine():
    rows = [row(0, 0, uuid="GPU-a"), row(1, 1, uuid="GPU-b", problem="bound to cuda:0, expected cuda:1"),
            row(2, 0, host="cpu-box"), row(3, 1, host="cpu-box")]
    assert device_map_problems(rows) == ["rank 1 (local rank 1 on node1) bound to cuda:0, expected cuda:1"]
    assert device_map_problems([row(0, 0), row(1, 1)]) == []
