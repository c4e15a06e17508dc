"""In-job restarts (DESIGN.md §16): ranks SIGKILLed during a run under `torchrun --max-restarts`; every restarted
generation rendezvous on its own keys, resumes from the newest checkpoint and trains the unbroken run's losses.

Cost on 2 cores: the chaos run and its unbroken twin run side by side, ~3 min together (4 ranks each, 3 restarts of
~35 s startup each); the two-agent run and its twin ~3 min. Both are the slow tier.
"""

import json
import os
import random
import signal
import time

import pytest

from lingua.run.dump_dir import RunDir, read_jsonl, read_metrics
from tests.runs import assert_ok, at_once, distill_overrides, running, torchrun, torchrun_nodes

LOSSES = ("loss/total", "loss/ce", "loss/kd", "kd/top1_agreement")
TP = {"distillation.n_teacher_ranks": 2, "distillation.teacher_tp": 2}  # ranks 2-3: one tensor-parallel replica


def loss_rows(dump) -> list[dict]:
    return [row for row in read_metrics(dump) if "loss/total" in row]


def generation_pid(dump, rank: int, timeout: float = 60) -> int:
    """The pid of `rank` in the generation now running (its status file is rewritten by each one)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            record = json.loads(RunDir(dump).status(rank).read_text())
        except (OSError, ValueError):
            record = None
        if record and record["state"] == "running":
            return record["pid"]
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} has no running status")


def kill_plan(dump, kills: list[tuple[int, int]], pids: list[int], world: int, timeout: float = 200):
    """A signal_plan: for each (rank, step), once a generation that started after the previous kill has logged
    `step`, SIGKILL that rank; every pid seen goes to `pids` (for the orphan check)."""
    def plan(*_):
        seen = 0
        for done, (rank, step) in enumerate(kills):
            deadline = time.time() + timeout
            # The generation to kill has trained (its recovery row filled in), so no kill lands in its start-up.
            while not (any(row["step"] >= step for row in loss_rows(dump)[seen:])
                       and recovered(read_jsonl(RunDir(dump).recovery), done)):
                assert time.time() < deadline, f"step {step} never logged after the last kill"
                time.sleep(0.1)
            pid = generation_pid(dump, rank)
            pids.extend(generation_pid(dump, r) for r in range(world) if RunDir(dump).status(r).exists())
            os.kill(pid, signal.SIGKILL)
            seen = len(loss_rows(dump))  # a later kill waits for the next generation's rows
    return plan


def recovered(rows: list[dict], crashes: int) -> bool:
    """Whether the generation after the `crashes`-th crash has done its first step (its row names where it resumed)."""
    return crashes == 0 or (len(rows) >= crashes and rows[crashes - 1].get("resumed_from") is not None)


def assert_same_losses(broken, unbroken) -> None:
    """Every row of the broken run, redone steps included, has the unbroken run's losses at that step, bit for bit."""
    reference = {row["step"]: row for row in loss_rows(unbroken)}
    rows = loss_rows(broken)
    assert sorted({row["step"] for row in rows}) == sorted(reference)
    for row in rows:
        for key in LOSSES:
            assert row[key] == reference[row["step"]][key], (row["step"], key, row[key], reference[row["step"]][key])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_sigkills_of_a_student_a_teacher_and_a_tp_follower_recover_with_the_same_losses(
        corpus, tiny_teacher, tmp_path):
    rng = random.Random(45)  # random steps, the same on every run
    kills = [(rng.choice([0, 1]), rng.randint(2, 3)), (2, rng.randint(5, 6)), (3, rng.randint(8, 9))]
    settings = dict(steps=14, **{"checkpoint.dump.every": 3, **TP})  # the last kill 5+ steps before the end
    broken, unbroken, pids = tmp_path / "chaos", tmp_path / "unbroken", []
    launches = [(broken, kill_plan(broken, kills, pids, world=4)), (unbroken, None)]
    started = time.time()
    results = at_once(lambda job: torchrun(4, distill_overrides(corpus, tiny_teacher, job[0], **settings),
                                           timeout=540, signal_plan=job[1], max_restarts=len(kills)), launches)
    for result in results:
        assert_ok(result)
    assert_same_losses(broken, unbroken)
    recoveries = read_jsonl(RunDir(broken).recovery)
    assert [row["first_rank"] for row in recoveries] == [rank for rank, _ in kills], recoveries
    for row, (rank, step) in zip(recoveries, kills):
        assert row["how"] == "its process is gone" and row["step"] > step and row["resumed_from"] % 3 == 0, row
        assert row["steps_redone"] == row["step"] - 1 - row["resumed_from"] and 0 < row["recovery_s"] < 300, row
    last = loss_rows(broken)[-1]
    assert last["recovery/restarts"] == 3 and last["recovery/steps_redone"] == sum(r["steps_redone"] for r in recoveries)
    assert "recovered from 3 crash(es)" in results[0].stdout
    assert "recovery/restarts" not in loss_rows(unbroken)[-1]
    assert all(not running(pid) for pid in pids), [pid for pid in pids if running(pid)]  # no orphan rank
    print(f"chaos: {len(kills)} SIGKILLs {kills}, {len(recoveries)} restarts, "
          f"{sum(r['steps_redone'] for r in recoveries)} steps redone, recovery "
          f"{[round(r['recovery_s'], 1) for r in recoveries]} s, {time.time() - started:.0f}s for both runs")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_agents_survive_a_sigkill_on_the_second_and_finish_with_the_unbroken_losses(
        corpus, tiny_teacher, tmp_path):
    """2 torchrun agents x (2 students + 1 teacher), the README's multi-node command (c10d, a store per round)."""
    settings = dict(steps=8, **{"checkpoint.dump.every": 3, "distributed.teacher_placement": "per_node",
                                "distillation.n_teacher_ranks": 2})
    broken, unbroken, pids = tmp_path / "two_agents", tmp_path / "unbroken", []

    def launch(job):
        dump, plan = job
        return torchrun_nodes(2, 3, distill_overrides(corpus, tiny_teacher, dump, **settings), timeout=540,
                              max_restarts=2, signal_plan=plan)

    results = at_once(launch, [(broken, kill_plan(broken, [(4, 4)], pids, world=6)), (unbroken, None)])
    for result in results[0] + results[1]:
        assert_ok(result)
    assert_same_losses(broken, unbroken)
    (recovery,) = read_jsonl(RunDir(broken).recovery)
    assert recovery["first_rank"] == 4 and recovery["role"] == "student", recovery
    assert all(not running(pid) for pid in pids)
    out = "".join(result.stdout for result in results[0])
    assert "PyTorch #135712" not in out  # this command is the safe one: no warning
