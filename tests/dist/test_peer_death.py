"""A rank dies mid-run (2 students + 1 tiny teacher): the survivors say which one, in one sentence each, instead
of a wall of gloo tracebacks; the rank that died first keeps its own error (a bug: its traceback). See
`RankStatus` in lingua/parallel/rank_status.py for how they find out."""

import json
import os
import re
import signal
import time

import pytest

from lingua.rundir import RunDir
from tests.runs import distill_overrides, rank_exit_codes, rank_outputs, rank_pid, torchrun, wait_for_step

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
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    # The rank that failed keeps its own traceback: it is the root cause.
    assert "RuntimeError: injected failure on train rank 1 at step 3" in "\n".join(survivor_lines(outputs, 1))
    assert json.loads(RunDir(dump).status(1).read_text())["state"] == "failed"
    assert_survivors_name(outputs, codes, dump, dead=1, survivors=[0, 2], tail=result.stdout[-4000:])
    assert elapsed < LIMIT_S


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bug_in_the_trainer_is_its_traceback_and_the_others_name_its_rank(corpus, tiny_teacher, tmp_path):
    """A plain ValueError deep in the loop is no user's error: no one-sentence exit 2, but the traceback with the
    file and line of the bug on stderr, in the rank's log and in torchrun's failure summary, and exit code 1."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=50, inject_failure="bug:1@3",
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300}),
                      timeout=LIMIT_S, log_dir=logs)
    elapsed = time.time() - start
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    tail = result.stdout[-4000:]
    bug = "ValueError: too many values to unpack (expected 2)"
    frame = re.compile(r'File "[^"]*/apps/main/faults\.py", line \d+, in step_and_rank')
    stderr = outputs[1]["stderr"]
    assert "Traceback (most recent call last):" in stderr and frame.search(stderr) and bug in stderr, stderr[-3000:]
    assert not any(line.startswith("error: ") for line in survivor_lines(outputs, 1)), stderr[-3000:]
    log = RunDir(dump).rank_log(1).read_text()
    assert "Traceback (most recent call last):" in log and frame.search(log) and log.rstrip().endswith(bug), log[-3000:]
    assert codes.get(1) == 1, (codes, tail)
    status = json.loads(RunDir(dump).status(1).read_text())
    assert (status["state"], status["error"]) == ("failed", bug), status
    # torchrun's failure summary shows the rank's error file: the traceback, not "To enable traceback see ...".
    summary = result.stdout[result.stdout.index("apps.main.train FAILED"):]
    entry = [block for block in re.split(r"^\[\d+\]:$", summary, flags=re.M) if "rank      : 1 (" in block]
    assert len(entry) == 1 and frame.search(entry[0]) and bug in entry[0], summary
    assert_survivors_name(outputs, codes, dump, dead=1, survivors=[0, 2], tail=tail)
    assert elapsed < LIMIT_S
