"""What a rank says when a collective times out, and what the post-mortem reads afterwards, without a launch:
the timeout signs of gloo and NCCL, who did not arrive (`absent_reason`, `diagnose_timeout`), the sentence, the
watch thread (hang note, stacks into the rank log, flight recorder dump, SIGUSR1) and `apps.debug.postmortem` on
status files written by hand. The launched scenarios are in tests/dist/test_peer_death.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.debug.postmortem import analyse, format_report
from apps.debug.postmortem import main as postmortem_main
from lingua.parallel.rank_status import (
    STALE_HEARTBEAT_S,
    RankStatus,
    absent_reason,
    diagnose_timeout,
    first_stopped,
    is_collective_timeout,
    is_peer_loss,
    timeout_seconds,
    timeout_sentence,
)
from lingua.run.dump_dir import RunDir

ROOT = Path(__file__).resolve().parents[4]
HOST = "here"
GLOO_RECV = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete"
NCCL_BLOCKING_WAIT = ("[Rank 0] Work WorkNCCL(SeqNum=15, OpType=SCATTER, NumelIn=0, NumelOut=5504, Timeout(ms)=20000) "
                      "timed out in blocking wait.")
NCCL_WATCHDOG = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=15, OpType=SCATTER, "
                 "NumelIn=0, NumelOut=5504, Timeout(ms)=20000) ran for 20013 milliseconds before timing out.")
GROUPS = {"world": [0, 1, 2], "train": [0, 1], "bridge_0": [0, 1, 2]}
MINE = {"world": dict(seq=4, op="gloo:all_gather", started=10.0),
        "bridge_0": dict(seq=15, op="gloo:scatter", started=50.0),
        "train": dict(seq=65, op="gloo:all_gather", started=51.0)}


def record(rank, state="running", pid=None, host=HOST, started=None, **fields) -> dict:
    pid = os.getpid() if pid is None else pid
    if started is None:
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return dict(rank=rank, role="teacher" if rank == 2 else "student", host=host, pid=pid, started=started,
                state=state, error="", time=time.time(), **fields)


@pytest.fixture
def stopped_process():
    """A live process in state T (SIGSTOP), as a hung teacher looks to a peer on its host."""
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.time() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T" and time.time() < deadline:
        time.sleep(0.05)
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_timeout_signs_of_gloo_and_nccl_are_not_peer_losses():
    for text, seconds in ((GLOO_RECV, 8), (GLOO_RECV.replace("recv", "send"), 8), (NCCL_WATCHDOG, 20),
                          (NCCL_BLOCKING_WAIT, 20)):
        assert is_collective_timeout(RuntimeError(text)) and not is_peer_loss(RuntimeError(text))
        assert timeout_seconds(RuntimeError(text)) == seconds
    # Another op on the connection that timed out (gloo closed it): a timeout too, whose figure is not in the text.
    pair_closed = RuntimeError("Application timeout caused pair closure")
    assert is_collective_timeout(pair_closed) and not is_peer_loss(pair_closed) and timeout_seconds(pair_closed) is None
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8612")
    assert is_peer_loss(closed) and not is_collective_timeout(closed)
    assert not is_collective_timeout(ValueError(GLOO_RECV))  # a user error quoting it is not one


def test_a_timeout_whose_words_give_no_figure_is_told_the_groups_configured_one(train_group):
    """gloo's pair-closure words carry no timeout: the sentence takes the one the group's backend is set to."""
    from types import SimpleNamespace

    from lingua.parallel.timeouts import group_timeouts, set_group_timeout

    before = max(v for v in group_timeouts(train_group).values() if v is not None)
    set_group_timeout(train_group, 8)
    try:
        status = SimpleNamespace(topo=SimpleNamespace(all_groups=lambda: [train_group],
                                                      group_names={id(train_group): "bridge_0"}))
        assert RankStatus._group_timeout_s(status, "bridge_0") == 8
        assert RankStatus._group_timeout_s(status, "train") is None and RankStatus._group_timeout_s(status, None) is None
    finally:
        set_group_timeout(train_group, before)


def test_a_stopped_teacher_is_named_on_the_bridge_and_a_waiting_student_is_not(stopped_process):
    records = {1: record(1, state="timed_out", collectives={"bridge_0": dict(seq=15, op="gloo:scatter", started=50.0)}),
               2: record(2, pid=stopped_process)}
    group, missing = diagnose_timeout(0, GROUPS, MINE, records, HOST, time.time())
    # Both groups that hold rank 2 have it missing; the bridge is the one entered last among them.
    assert (group, missing) == ("bridge_0", [(2, "its process is stopped")])
    sentence = timeout_sentence(6, group, "gloo:scatter #15", 8.0, missing, {0: "student", 1: "student", 2: "teacher"},
                                RunDir("/runs/r"))
    assert sentence == ("step 6: a collective on bridge_0 (gloo:scatter #15) timed out after 8s waiting for rank 2 "
                        "(teacher: its process is stopped); its log is /runs/r/logs/rank_2.log")


def test_a_stopped_teacher_among_several_is_named_by_index_and_path(stopped_process):
    """Teacher 1 of 2 (rank 3) stopped: the student that timed out on its bridge names it by index and path; teacher
    0 (rank 2), running, is not named. The launched SIGSTOP scenario is the one-teacher test in test_peer_death.py."""
    from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, TeacherLayout

    plan = LaunchPlan.for_launch(DistributedArgs(), 4, 4, (TeacherLayout(1, 1, "/t/a"), TeacherLayout(1, 1, "/t/b")))
    groups = {"world": [0, 1, 2, 3], "train": [0, 1], "bridge_0": [0, 1, 2], "bridge_1": [0, 1, 3]}
    mine = {**MINE, "bridge_1": dict(seq=15, op="gloo:gather", started=50.5)}
    records = {1: record(1), 2: record(2), 3: record(3, pid=stopped_process)}
    group, missing = diagnose_timeout(0, groups, mine, records, HOST, time.time())
    assert (group, missing) == ("bridge_1", [(3, "its process is stopped")])
    roles = {rank: plan.rank_words(rank) for rank in range(4)}
    sentence = timeout_sentence(6, group, "gloo:gather #15", 8.0, missing, roles, RunDir("/runs/r"))
    assert sentence == ("step 6: a collective on bridge_1 (gloo:gather #15) timed out after 8s waiting for rank 3 "
                        "(teacher 1 (/t/b): its process is stopped); its log is /runs/r/logs/rank_3.log")


def test_a_peer_behind_on_a_group_is_named_with_where_it_is_busy():
    busy = record(1, collectives={"train": dict(seq=60, op="gloo:all_gather", started=40.0)},
                  stuck=dict(where="apps/main/train.py:310 (train)"))
    teacher = record(2, collectives={"bridge_0": dict(seq=15, op="gloo:gather", started=49.0)})
    group, missing = diagnose_timeout(0, GROUPS, MINE, {1: busy, 2: teacher}, HOST, time.time())
    assert group == "train"
    assert missing == [(1, "its last collective on train is #60, this rank's #65; it is busy in apps/main/train.py:310 "
                           "(train)")]


def test_another_hosts_rank_is_named_only_when_its_heartbeat_stopped():
    now = time.time()
    stale = record(2, host="elsewhere", heartbeat=now - STALE_HEARTBEAT_S - 10)
    assert absent_reason(stale, "bridge_0", 15, HOST, now) == f"no heartbeat for {STALE_HEARTBEAT_S + 10:.0f}s"
    fresh = record(2, host="elsewhere", heartbeat=now - 1)
    assert absent_reason(fresh, "bridge_0", 15, HOST, now) is None
    group, missing = diagnose_timeout(0, GROUPS, MINE, {1: record(1), 2: fresh}, HOST, now)
    assert (group, missing) == ("train", [])  # nobody to name: the group entered last
    sentence = timeout_sentence(None, group, None, None, missing, {}, RunDir("/runs/r"))
    assert sentence == ("a collective on train timed out; which rank did not arrive could not be told here: `python -m "
                        "apps.debug.postmortem /runs/r` compares every rank's status, hang note and flight recorder")


def test_ranks_that_ended_or_never_wrote_are_absent_for_what_they_did():
    now = time.time()
    assert absent_reason(None, "train", 3, HOST, now) == "it has no status file"
    assert absent_reason(record(1, state="failed"), "train", 3, HOST, now) == "it failed first"
    assert absent_reason(record(1, state="done"), "train", 3, HOST, now) == "it had finished"
    behind = record(1, state="lost_peer", collectives={"train": dict(seq=2, op="gloo:all_reduce", started=1.0)})
    assert absent_reason(behind, "train", 3, HOST, now) == "its last collective on train is #2, this rank's #3"
    assert absent_reason(record(1, state="timed_out"), "train", 3, HOST, now) is None  # gave up too, elsewhere
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert absent_reason(record(1, pid=gone.pid, started="1"), "train", 3, HOST, now) == "its process is gone"
    # A rank whose record shows it entered the same collective arrived, whatever its state.
    arrived = record(1, state="timed_out", collectives={"train": dict(seq=3, op="gloo:all_reduce", started=1.0)})
    assert absent_reason(arrived, "train", 3, HOST, now) is None


def test_the_rank_others_timed_out_waiting_for_is_named_first():
    named = {r: record(r, state="timed_out", step=6, collective=dict(group="bridge_0", op="gloo:scatter #15"),
                       missing=[[2, "its process is stopped"]]) for r in (0, 1)}
    assert first_stopped({**named, 2: record(2)}, HOST) == (2, "ranks 0, 1 timed out waiting for it on bridge_0 at "
                                                               "step 6")


def write_status(run: RunDir, rec: dict) -> None:
    run.logs.mkdir(parents=True, exist_ok=True)
    run.status(rec["rank"]).write_text(json.dumps(rec))
    run.rank_log(rec["rank"]).write_text(f"[r{rec['rank']}] last words of rank {rec['rank']}\n")


def test_postmortem_of_an_nccl_style_hang_finds_the_rank_behind(tmp_path, capsys):
    """NCCL: the watchdog ends every process, no rank writes a final state. The hang notes (written at 90% of the
    timeout) still hold each rank's step and last collective per group: the teacher is behind on the bridge."""
    run = RunDir(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    now = time.time()
    note = dict(step=6, waited_s=18.0, timeout_s=20.0, where="lingua/distillation/online/client.py:102 (complete)")
    for rank in (0, 1):
        write_status(run, record(rank, pid=gone.pid, started="1", step=6, heartbeat=now, stuck=note,
                                 collectives={"bridge_0": dict(seq=15, op="nccl:scatter", started=now - 20),
                                              "train": dict(seq=65, op="nccl:all_gather", started=now - 19)}))
    write_status(run, record(2, pid=gone.pid, started="1", heartbeat=now - 1,
                             collectives={"bridge_0": dict(seq=13, op="nccl:scatter", started=now - 21)}))
    report = analyse(tmp_path)
    assert report["first"] == dict(rank=2, role="teacher", why="it is behind the others on bridge_0")
    assert [(row["rank"], row["step"], row["stuck_in"]["group"]) for row in report["ranks"]] == [
        (0, 6, "train"), (1, 6, "train"), (2, None, "bridge_0")]
    assert report["groups"]["bridge_0"] == dict(last_seq={0: 15, 1: 15, 2: 13}, behind=[2])
    text = format_report(report)
    assert "first to fail: rank 2 (teacher): it is behind the others on bridge_0" in text
    assert "bridge_0: rank 0 #15, rank 1 #15, rank 2 #13; behind: 2" in text
    assert "rank 1: step 6, 18.0s of 20s, in lingua/distillation/online/client.py:102 (complete)" in text
    assert "rank 2: [r2] last words of rank 2" in text
    postmortem_main([str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["first"]["rank"] == 2


@pytest.mark.slow
def test_postmortem_refuses_a_folder_that_is_not_a_run_in_one_sentence(tmp_path):
    result = subprocess.run([sys.executable, "-m", "apps.debug.postmortem", str(tmp_path / "nope")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: dump_dir '{tmp_path / 'nope'}' is not a folder; pass "
                                                     f"the dump_dir of a run\n")


@pytest.mark.slow
def test_the_watch_notes_a_long_step_logs_its_stacks_dumps_the_recorder_and_answers_sigusr1(tmp_path):
    """One process (world of 1, gloo): a step armed for a 2 s timeout runs 2.5 s; SIGUSR1 comes while the main
    thread sleeps. The dump must satisfy PyTorch's analyzer, which refuses gloo's own unfilled pg_config."""
    code = f"""
import os, signal, time, torch, torch.distributed as dist
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.logger import init_logger
from lingua.parallel.launch_plan import DistributedArgs
from lingua.parallel.rank_status import RankStatus
from lingua.parallel.timeouts import HangWatch
from lingua.parallel.watch import RankWatch
from lingua.run.dump_dir import RunDir
dump = {str(tmp_path)!r}
topo = setup_torch_distributed(DistributedArgs(debug="trace"), dump_dir=dump)
init_logger(0, "student", str(RunDir(dump).rank_log(0)))
with RankStatus(dump, topo, debug="trace") as status, RankWatch(topo, dump, status, traces=True):
    dist.all_reduce(torch.ones(2), group=topo.train_group)
    def step_that_runs_long():
        HangWatch(fraction=0.5).arm(2.0, step=7)
        time.sleep(2.5)
    step_that_runs_long()
    os.kill(os.getpid(), signal.SIGUSR1)
    log, deadline = RunDir(dump).rank_log(0), time.time() + 60
    while "(SIGUSR1;" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    HangWatch.cancel()
clean_up()
print("survived")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "RANK"))})
    assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-3000:]
    run = RunDir(tmp_path)
    log = run.rank_log(0).read_text()
    assert re.search(r"step 7 has run [12]s \(\d+% of the 2s collective timeout\), in <string>:\d+ "
                     r"\(step_that_runs_long\); last collective per group: .*gloo:all_reduce #1", log), log
    assert "step_that_runs_long" in log and "Thread 0x" in log, log  # the stacks, in the rank's own log
    assert "SIGUSR1: main thread in" in log and log.count("Thread 0x") >= 2, log
    # faulthandler's own dump (from C, even with the GIL held), at the same moment: in the rank's log, not the console
    assert "Timeout (0:00:01)!" in log and "Timeout (0:00:01)!" not in result.stderr
    status = json.loads(run.status(0).read_text())
    assert status["state"] == "done" and status["step"] == 7
    assert status["stuck"]["step"] == 7 and status["stuck"]["timeout_s"] == 2.0
    assert "flight recorder written to" in log and "(SIGUSR1;" in log
    for extra in ([], ["-j"]):  # the analysis (groups from our pg_config), then the raw entries
        analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                   str(tmp_path / "comm_traces"), "-p", "rank_", *extra], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
        assert analyzer.returncode == 0, analyzer.stderr
    assert "all_reduce(input_sizes=[[2]]" in analyzer.stderr, analyzer.stderr
