"""A rank dies or stops answering mid-run (2 students + 1 tiny teacher): the job ends within seconds, whatever
the collective timeouts, and the others say which rank stopped, in one sentence each, instead of a wall of gloo
tracebacks; `apps.debug.postmortem` tells the story afterwards, and the rank that died first keeps its own error
(a bug: its traceback). See `RankStatus` in lingua/parallel/rank_status.py for how they find out."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lingua.run.dump_dir import RunDir
from tests.runs import (FAULTY_TRAINER, ROOT, assert_no_orphan_producers, distill_overrides, rank_exit_codes,
                        rank_outputs, rank_pid, torchrun, wait_for_step)

pytestmark = pytest.mark.slow  # every test here launches processes

LIMIT_S = 60  # each scenario takes 15-30 s on 2 busy cores, startup included
STOPPED_LIMIT_S = 120  # the stopped-teacher launch: startup, the wait out of a timeout, the teacher's way out


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


def postmortem(dump) -> tuple[dict, str]:
    """`python -m apps.debug.postmortem <dump>`: its JSON and its report."""
    runs = [subprocess.run([sys.executable, "-m", "apps.debug.postmortem", str(dump), *extra], cwd=ROOT,
                           capture_output=True, text=True, timeout=120) for extra in (["--json"], [])]
    for run in runs:
        assert run.returncode == 0, run.stderr
    return json.loads(runs[0].stdout), runs[1].stdout


def analyzer(traces) -> str:
    """PyTorch's flight recorder analyzer on a folder of dumps, as the runbook runs it (it reports on stderr)."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces), "-p",
                          "rank_", "--allow-incomplete-ranks"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr


@pytest.mark.slow
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
    # The rank that failed keeps its own traceback: it is the root cause. It still cleans up: it left its
    # look-ahead request (of step 3) unwaited, without talking to the teacher, so its groups are aborted, which
    # cancels it (NCCL's destroy would wait for it).
    failed = "\n".join(survivor_lines(outputs, 1))
    assert "RuntimeError: injected failure on train rank 1 at step 3" in failed
    assert "lingua.distillation.online.client: teacher requests left unwaited at exit: 1" in failed, failed[-4000:]
    assert "lingua.distributed: process groups aborted" in failed, failed[-4000:]
    assert json.loads(RunDir(dump).status(1).read_text())["state"] == "failed"
    assert_survivors_name(outputs, codes, dump, dead=1, survivors=[0, 2], tail=result.stdout[-4000:])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigkilled_student_is_named_by_the_others_on_its_host(corpus, tiny_teacher, tmp_path):
    """SIGKILL leaves no note: the survivors see that rank 1's process (same host) is gone. On another host
    they would say "a peer rank stopped" and point at the logs folder. The students' data producer processes
    end with them: the killed one's and the survivor's."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    killed = []

    def kill_rank_1(proc):
        wait_for_step(dump, 3, timeout=LIMIT_S)
        # Its watch thread notes a new step at most every STEP_NOTE_MIN_S: kill it once one is on disk, as a
        # rank killed minutes into a real run would have.
        deadline = time.time() + 30
        while json.loads(RunDir(dump).status(1).read_text()).get("step") is None and time.time() < deadline:
            time.sleep(0.2)
        pid = rank_pid(dump, 1)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000,
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300,
                                              "data.load_async": "true"}),
                      timeout=LIMIT_S, log_dir=logs, signal_plan=kill_rank_1)
    elapsed = time.time() - start
    assert killed and result.returncode != 0
    codes = rank_exit_codes(result.stdout)
    assert codes.get(1) == -signal.SIGKILL, codes
    assert json.loads(RunDir(dump).status(1).read_text())["state"] == "running"  # it never got to say more
    assert_survivors_name(rank_outputs(logs), codes, dump, dead=1, survivors=[0, 2], tail=result.stdout[-4000:])
    assert elapsed < LIMIT_S
    assert_no_orphan_producers(dump, ranks=(0, 1))
    # Afterwards: the rank that was killed first, the step it had reached (its heartbeat), the survivors' steps.
    report, text = postmortem(dump)
    assert report["first"] == dict(rank=1, role="student", why="ranks 0, 2 lost it"), report
    rows = {row["rank"]: row for row in report["ranks"]}
    assert (rows[1]["state"], rows[1]["process"]) == ("running", "gone")
    assert [rows[r]["state"] for r in (0, 2)] == ["lost_peer", "lost_peer"]
    assert 1 <= rows[1]["step"] <= rows[0]["step"] and rows[2]["step"] is None, rows  # teachers count no steps
    # Where each survivor lost it: a collective of a group that holds rank 1 (the teacher's only one is the bridge).
    assert rows[0]["stuck_in"]["group"] in ("train", "bridge_0") and rows[2]["stuck_in"]["group"] == "bridge_0", rows
    assert "first to fail: rank 1 (student): ranks 0, 2 lost it" in text
    assert f"rank 0: rank 1 (student) stopped; its log is {RunDir(dump).rank_log(1)}" in text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_teacher_is_named_by_every_rank_and_by_the_flight_recorder(corpus, tiny_teacher, tmp_path):
    """SIGSTOP the teacher mid-run under distributed.debug=trace and an 8 s training timeout. The students' gloo
    waits time out: each says, in one sentence, which group, which rank and which step; their flight recorders are
    on disk. Once both have ended, SIGCONT: the teacher learns it was the one missing. PyTorch's analyzer names the
    bridge and the teacher (from the students' dumps alone: the teacher's is missing; with all three: the
    collective it never joined), and the post-mortem puts it first."""
    dump, logs, live = tmp_path / "run", tmp_path / "torchrun", tmp_path / "live_traces"
    timeout_s = 8
    run_dir = RunDir(dump)
    stopped_at = []

    def state(rank):
        try:
            return json.loads(run_dir.status(rank).read_text())["state"]
        except (OSError, ValueError):
            return None

    def stop_then_continue_the_teacher(proc):
        wait_for_step(dump, 3, timeout=STOPPED_LIMIT_S)
        teacher = rank_pid(dump, 2)
        os.kill(teacher, signal.SIGSTOP)
        stopped_at.append(time.time())
        deadline = time.time() + STOPPED_LIMIT_S
        while any(state(r) in (None, "running") for r in (0, 1)) and time.time() < deadline:
            time.sleep(0.2)
        stopped_at.append(time.time())
        shutil.copytree(dump / "comm_traces", live)  # what the live ranks wrote, before the teacher can write
        os.kill(teacher, signal.SIGCONT)

    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000, **{
        "distributed.debug": "trace", "distributed.train_timeout_s": timeout_s}),
        timeout=STOPPED_LIMIT_S, log_dir=logs, signal_plan=stop_then_continue_the_teacher)
    ended = time.time()
    tail = result.stdout[-6000:]
    assert len(stopped_at) == 2 and result.returncode != 0, tail
    # Nobody waits past its timeout by more than the way out: no hang, no watchdog of ours to wait for.
    assert stopped_at[1] - stopped_at[0] < timeout_s + 20, (stopped_at, tail)
    assert ended - stopped_at[1] < 30, tail
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    sentences = {r: [line for line in survivor_lines(outputs, r) if line.startswith("error: ")] for r in (0, 1, 2)}
    step = json.loads(run_dir.status(0).read_text())["step"]
    expected = (rf"error: step {step}: a collective on bridge_0 \(gloo:(scatter|gather) #\d+\) timed out after "
                rf"{timeout_s}s waiting for rank 2 \(teacher: its process is stopped\); its log is "
                rf"{re.escape(str(run_dir.rank_log(2)))}")
    for rank in (0, 1):
        assert len(sentences[rank]) == 1 and re.fullmatch(expected, sentences[rank][0]), (rank, sentences[rank], tail)
        status = json.loads(run_dir.status(rank).read_text())
        assert status["state"] == "timed_out" and status["missing"] == [[2, "its process is stopped"]], status
        # The backend's words, kept apart: the op that timed out, or another on the connection its timeout closed.
        assert re.search(rf"Timed out waiting {timeout_s * 1000}ms|Application timeout caused pair closure",
                         status["backend_error"]), status
        log = run_dir.rank_log(rank).read_text()
        assert f"step {step} has run" in log and "every thread's stack follows" in log and "Thread 0x" in log
        # The console has the sentence; the backend's traceback (gloo's wait) and the stacks are in the log alone.
        console = "\n".join(survivor_lines(outputs, rank))
        assert "Traceback" not in console and "Thread 0x" not in console and 'File "' not in console, console[-4000:]
        assert re.search(r"the collective that timed out\nTraceback \(most recent call last\):\n(.*\n)*.*wait", log)
    assert sentences[2] == [f"error: this rank (teacher) had stopped answering: ranks 0, 1 timed out waiting for it "
                            f"on bridge_0 at step {step}"], (sentences[2], tail)
    assert [codes.get(r) for r in (0, 1, 2)] == [1, 1, 1], codes
    # The flight recorder, as the runbook reads it: first only the live ranks' dumps, then all three.
    assert sorted(p.name for p in live.iterdir()) == ["rank_0", "rank_1"]
    alone = analyzer(live)
    assert "we missed FR dumps from ranks ({2})" in alone, alone
    assert sorted(p.name for p in (dump / "comm_traces").iterdir()) == ["rank_0", "rank_1", "rank_2"]
    full = analyzer(dump / "comm_traces")
    assert re.search(r"Not all ranks joining collective, sequence number: \d+\n.*\ngroup info: \d+:bridge_0\n"
                     r"collective: gloo:(gather|scatter)\nmissing ranks: \{2\}", full), full
    # Afterwards, from the files alone.
    report, text = postmortem(dump)
    why = f"ranks 0, 1 timed out waiting for it on bridge_0 at step {step}"
    assert report["first"] == dict(rank=2, role="teacher", why=why), report
    rows = {row["rank"]: row for row in report["ranks"]}
    assert [rows[r]["step"] for r in (0, 1)] == [step, step]
    assert [rows[r]["stuck_in"]["group"] for r in (0, 1, 2)] == ["bridge_0"] * 3, rows
    assert report["groups"]["bridge_0"]["behind"] == [2], report["groups"]
    assert f"first to fail: rank 2 (teacher): {why}" in text


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
    frame = re.compile(r'File "[^"]*/tests/fault_injection\.py", line \d+, in step_and_rank')
    stderr = outputs[1]["stderr"]
    assert "Traceback (most recent call last):" in stderr and frame.search(stderr) and bug in stderr, stderr[-3000:]
    assert not any(line.startswith("error: ") for line in survivor_lines(outputs, 1)), stderr[-3000:]
    log = RunDir(dump).rank_log(1).read_text()
    assert "Traceback (most recent call last):" in log and frame.search(log) and log.rstrip().endswith(bug), log[-3000:]
    assert codes.get(1) == 1, (codes, tail)
    status = json.loads(RunDir(dump).status(1).read_text())
    assert (status["state"], status["error"]) == ("failed", bug), status
    # torchrun's failure summary shows the rank's error file: the traceback, not "To enable traceback see ...".
    summary = result.stdout[result.stdout.index(f"{FAULTY_TRAINER} FAILED"):]
    entry = [block for block in re.split(r"^\[\d+\]:$", summary, flags=re.M) if "rank      : 1 (" in block]
    assert len(entry) == 1 and frame.search(entry[0]) and bug in entry[0], summary
    assert_survivors_name(outputs, codes, dump, dead=1, survivors=[0, 2], tail=tail)
    assert elapsed < LIMIT_S
