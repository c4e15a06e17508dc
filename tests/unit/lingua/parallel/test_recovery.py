"""In-job restarts (lingua/parallel/recovery.py): the store per attempt, the previous generation's crash read from
its status files, the crash loop's sentence, recovery.jsonl and its metrics; the dump dir passing to a restarted
generation; checkpoint.dump.every_minutes; stool's restart loop. The launches themselves: tests/dist/test_recovery.py."""

import json
import os
import socket
import subprocess
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lingua.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery
from lingua.run.owner import OWNER, DumpDirOwner, launch_key
from lingua.errors import ConfigError
from lingua.parallel.launch_plan import LaunchEnv
from lingua.parallel.recovery import (
    CRASH_LOOP,
    RecoveryLog,
    Restarts,
    attempt_store,
    crash_loop_sentence,
    keep_previous_status,
    read_crash,
    unsafe_restart_sentence,
)
from lingua.run.dump_dir import RunDir, read_jsonl
from tests.runs import free_port

HOST = socket.gethostname()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write_status(dump, rank: int, state: str, step=None, pid=None, at=100.0, error="", role="student") -> None:
    path = RunDir(dump).status(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dict(rank=rank, role=role, host=HOST, pid=pid or dead_pid(), started=None, state=state, error=error,
                  time=at, heartbeat=at)
    if step is not None:
        record["step"] = step
    path.write_text(json.dumps(record))


def test_each_attempt_reads_only_its_own_keys_on_the_launchers_store():
    """The stale key of attempt 0 (a dead rank's address) is invisible to attempt 1, which meets its own peers."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    launch = LaunchEnv(0, 2, 0, 2, "127.0.0.1", port, "torchrun")
    first = attempt_store(launch, Restarts(count=0, max=3, agent_store=True), timedelta(seconds=5))
    first.set("rank_1_address", "dead:1")
    second = attempt_store(launch, Restarts(count=1, max=3, agent_store=True), timedelta(seconds=5))
    assert second.check(["rank_1_address"]) is False
    second.set("rank_1_address", "alive:2")
    assert first.get("rank_1_address") == b"dead:1" and second.get("rank_1_address") == b"alive:2"
    assert server.num_keys() >= 2
    # Without the launcher's shared store (c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, srun): the usual address.
    assert attempt_store(launch, Restarts(count=1, max=3, agent_store=False), timedelta(seconds=5)) is None
    assert attempt_store(LaunchEnv(0, 1, 0, 1, None, None, "single"), Restarts(), timedelta(seconds=5)) is None


def test_only_several_agents_on_a_shared_store_with_restarts_are_told_at_startup():
    assert unsafe_restart_sentence(Restarts(max=3, agent_store=True, agents=1)) is None  # the prefix suffices
    assert unsafe_restart_sentence(Restarts(max=0, agent_store=True, agents=2)) is None  # no restarts
    assert unsafe_restart_sentence(Restarts(max=3, agent_store=False, agents=2)) is None  # a store per round
    sentence = unsafe_restart_sentence(Restarts(max=3, agent_store=True, agents=2))
    assert "PyTorch #135712" in sentence and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in sentence
    assert sentence.count(". ") == 0 and sentence.endswith(".")


def test_a_sigkilled_rank_is_the_crash_read_from_the_previous_status_files(tmp_path):
    write_status(tmp_path, 0, "lost_peer", step=12, pid=os.getpid(), at=105.0)
    write_status(tmp_path, 1, "running", step=11, at=101.0)  # killed: its process is gone, its step lags
    write_status(tmp_path, 2, "lost_peer", pid=os.getpid(), at=105.5, role="teacher")
    for rank in range(3):
        keep_previous_status(tmp_path, rank)
        assert not RunDir(tmp_path).status(rank).exists()
    crash = read_crash(tmp_path, 3, HOST)
    assert crash == dict(step=12, first_rank=1, role="student", how="its process is gone", time=105.0,
                         crash_loop=False)


def test_a_clean_end_or_no_previous_generation_is_no_crash(tmp_path):
    assert read_crash(tmp_path, 2, HOST) is None
    for rank in range(2):
        write_status(tmp_path, rank, "done", step=30)
        keep_previous_status(tmp_path, rank)
    assert read_crash(tmp_path, 2, HOST) is None
    keep_previous_status(tmp_path, 0)  # a launch that left no status: an older previous one is not read again
    assert not RunDir(tmp_path).previous_status(0).exists()


def test_a_rank_on_another_host_that_never_wrote_its_end_is_the_one_that_stopped(tmp_path):
    write_status(tmp_path, 0, "lost_peer", step=7, pid=os.getpid(), at=50.0)
    path = RunDir(tmp_path).status(1)
    write_status(tmp_path, 1, "running", step=7, at=40.0)
    path.write_text(json.dumps(dict(json.loads(path.read_text()), host="another-node")))  # no pid to check
    for rank in range(2):
        keep_previous_status(tmp_path, rank)
    crash = read_crash(tmp_path, 2, HOST)
    assert crash["first_rank"] == 1 and crash["step"] == 7 and crash["time"] == 50.0


def test_the_third_crash_in_a_row_at_one_step_is_the_sentence_naming_the_step_and_the_rank(tmp_path):
    crash = dict(step=4, first_rank=0, role="student", how="it failed", time=1.0)
    assert crash_loop_sentence([], crash, tmp_path) is None
    history = [dict(crash, stop=None)] * (CRASH_LOOP - 2)
    assert crash_loop_sentence(history, crash, tmp_path) is None
    history = [dict(crash, step=9)] + [dict(crash, stop=None)] * (CRASH_LOOP - 1)
    sentence = crash_loop_sentence(history, crash, tmp_path)
    assert sentence.startswith(f"the run crashed at step 4 {CRASH_LOOP} times in a row, the last time first on rank 0")
    assert str(RunDir(tmp_path).rank_log(0)) in sentence
    assert crash_loop_sentence(history[:-1] + [dict(crash, step=5)], crash, tmp_path) is None  # not in a row
    assert crash_loop_sentence(history, dict(crash, step=None), tmp_path) is None  # a crash before any step


def test_recovery_log_records_steps_redone_and_seconds_and_the_metrics_fields(tmp_path):
    crash = dict(step=14, first_rank=0, role="student", how="its process is gone", time=time.time() - 30,
                 crash_loop=False, stop=None)
    with open(RunDir(tmp_path).recovery, "w") as f:
        f.write(json.dumps(dict(crash, resumed_from=None, steps_redone=None, recovery_s=None)) + "\n")
    log = RecoveryLog(tmp_path, crash, active=True)
    log.first_step_done(11)  # resumed from step 10: steps 11-13 were done before the crash
    log.first_step_done(12)  # only the first step counts
    (row,) = read_jsonl(RunDir(tmp_path).recovery)
    assert row["resumed_from"] == 10 and row["steps_redone"] == 3 and 29 < row["recovery_s"] < 60
    assert log.fields == {"recovery/restarts": 1, "recovery/steps_redone": 3, "recovery/last_s": row["recovery_s"]}
    assert log.summary_line().startswith("recovered from 1 crash(es) (recovery.jsonl): step 14, rank 0 (student)")
    fresh = RecoveryLog(tmp_path / "other", None, active=True)
    fresh.first_step_done(1)
    assert fresh.fields == {} and fresh.summary_line() is None  # a run without crashes logs nothing new


def test_a_restarted_rank_0_of_the_same_agent_takes_the_dump_dir_at_once_another_launch_does_not(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    key = launch_key(LaunchEnv(0, 3, 0, 3, "127.0.0.1", 1111, "torchrun"), env)
    assert key == launch_key(LaunchEnv(0, 3, 0, 3, "127.0.0.1", 2222, "torchrun"), env)  # a new port per round
    record = dict(launch=key, host=HOST, pid=os.getpid() + 1, started=None, job=None, restart=0, since=1.0,
                  heartbeat=time.time(), stale_after_s=60.0, agent=[HOST, os.getppid()])
    (tmp_path / OWNER).write_text(json.dumps(record))
    owner = DumpDirOwner(tmp_path, LaunchEnv(0, 3, 0, 3, "127.0.0.1", 2222, "torchrun"), 5, env)
    assert owner.same_agent(record) and not owner.same_agent(dict(record, agent=[HOST, 1]))
    assert owner.take().held and json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_checkpoints_by_minutes_are_a_flag_the_students_agree_on(monkeypatch):
    manager = CheckpointManager.__new__(CheckpointManager)
    manager.args, manager.step_on_disk = CheckpointArgs(dump=SaveEvery(every=1000, every_minutes=0.5)), None
    manager.last_save_time = time.monotonic()
    assert not manager.minutes_due()
    manager.last_save_time -= 31
    assert manager.minutes_due()
    assert manager.should_save(7, timed=True) == ["dump"] and manager.should_save(7) == []
    manager.args.dump.every_minutes = 0.0
    assert not manager.minutes_due()
    with pytest.raises(ConfigError, match="every_minutes"):
        CheckpointArgs(eval=SaveEvery(every_minutes=5)).validate()
    with pytest.raises(ConfigError, match="every_minutes"):
        CheckpointArgs(dump=SaveEvery(every_minutes=-1)).validate()


@pytest.mark.slow  # it runs bash (under a second)
def test_the_job_script_reruns_a_failed_step_but_not_a_sentence_and_caps_failure_requeues(tmp_path):
    from lingua.slurm import recovery_lines, restart_loop

    args = SimpleNamespace(max_restarts=2, max_failure_requeues=1)
    counter = tmp_path / "runs"

    def run(codes: list[int], env: dict) -> tuple[int, int, str]:
        launch = f'n=$(cat {counter} 2>/dev/null | wc -l); echo x >> {counter}; codes=({" ".join(map(str, codes))}); ' \
                 'exit "${codes[$n]}"'
        script = "\n".join(["#!/bin/bash", *recovery_lines(args, tmp_path), *restart_loop(args, f"bash -c '{launch}'")])
        counter.unlink(missing_ok=True)
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=dict(os.environ, **env))
        return done.returncode, len(counter.read_text().split()) if counter.exists() else 0, done.stdout + done.stderr

    first_start = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}
    assert run([137, 1, 0], first_start)[:2] == (0, 3)  # a rank died twice: two in-job restarts, then done
    assert run([137, 137, 137, 0], first_start)[:2] == (137, 3)  # past max_restarts: the job fails
    assert run([2, 0], first_start)[:2] == (2, 1)  # a sentence (a config error, a crash loop): no rerun
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "requeued_by_preemption.7.0").touch()
    assert run([0], {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})[:2] == (0, 1)  # our own requeue: not counted
    assert run([0], {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"})[:2] == (0, 1)  # a node failure: 1 of 1
    code, runs, out = run([0], {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"})
    assert (code, runs) == (1, 0) and "requeued after a failure more than 1 times" in out
