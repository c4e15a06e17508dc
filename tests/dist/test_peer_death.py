"""A rank dies mid-run (2 students + 1 tiny teacher): the job ends within seconds, whatever the collective
timeouts, and the survivors say which rank stopped, in one sentence each, instead of a wall of gloo tracebacks.
See `RankStatus` in lingua/parallel/rank_status.py for how they find out."""

import json
import os
import signal
import time

import pytest

from lingua.rundir import RunDir
from tests.runs import distill_overrides, rank_exit_codes, rank_outputs, rank_pid, torchrun, wait_for_step

pytestmark = pytest.mark.slow  # every test here launches processes

LIMIT_S = 60  # each scenario takes 15-30 s on 2 busy cores, startup included


def survivor_lines(outputs: dict, rank: int) -> list[str]:
    return (outputs[rank].get("stdout", "") + outputs[rank].get("stderr", "")).splitlines()


def assert_survivors_name(outputs: dict, exit_codes: dict, dump, dead: int, survivors: list[int], tail: str) -> None:
    """Each survivor: exactly the sentence naming `dead` and its log, exit code 1, not one traceback line."""
    sentence = f"error: rank {dead} (student) stopped; its log is {RunDir(dump).rank_log(dead)}"
    for rank in survivors:
        lines = survivor_lines(outputs, rank)
        assert [line for line in lines if line.startswith("error: ")] == [sentence], (rank, lines[-30:], tail)
        assert not any("Traceback" in line for line in lines), (rank, lines)
        assert exit_codes.get(rank) == 1, (rank, exit_codes, tail)
        status = json.loads(RunDir(dump).status(rank).read_text())
        assert status["state"] == "lost_peer", status


@pytest.mark.timeout(120)
def test_a_student_raising_mid_step_is_named_by_the_others(corpus, tiny_teacher, tmp_path):
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    start = time.time()
    # Timeouts far above the limit: ending in time proves nobody waited one out.
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=50, inject_failure="raise:1@3",
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300}),
                      timeout=LIMIT_S, log_dir=logs)
    elapsed = time.time() - start
    assert result.returncode != 0
    assert elapsed < LIMIT_S, f"took {elapsed:.0f}s: some rank waited out a timeout"
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    # The rank that failed keeps its own traceback: it is the root cause. It still cleans up.
    failed = "\n".join(survivor_lines(outputs, 1))
    assert "RuntimeError: injected failure on train rank 1 at step 3" in failed
    assert "lingua.distributed: process group destroyed" in failed, failed[-4000:]
    assert json.loads(RunDir(dump).status(1).read_text())["state"] == "failed"
    assert_survivors_name(outputs, codes, dump, dead=1, survivors=[0, 2], tail=result.stdout[-4000:])


@pytest.mark.timeout(120)
def test_a_sigkilled_student_is_named_by_the_others_on_its_host(corpus, tiny_teacher, tmp_path):
    """SIGKILL leaves no note: the survivors see that rank 1's process (same host) is gone. On another host
    they would say "a peer rank stopped" and point at the logs folder."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    killed = []

    def kill_rank_1(proc):
        wait_for_step(dump, 3, timeout=LIMIT_S)
        pid = rank_pid(dump, 1)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000,
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300}),
                      timeout=LIMIT_S, log_dir=logs, signal_plan=kill_rank_1)
    elapsed = time.time() - start
    assert killed and result.returncode != 0
    codes = rank_exit_codes(result.stdout)
    assert codes.get(1) == -signal.SIGKILL, codes
    assert json.loads(RunDir(dump).status(1).read_text())["state"] == "running"  # it never got to say more
    assert_survivors_name(rank_outputs(logs), codes, dump, dead=1, survivors=[0, 2], tail=result.stdout[-4000:])
    assert elapsed < LIMIT_S
