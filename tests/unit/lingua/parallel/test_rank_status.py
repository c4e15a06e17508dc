"""lingua.parallel.rank_status on one process: how a rank that lost its peer ends, and what it leaves on disk."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lingua.errors import PeerStopped
from lingua.parallel import flight_recorder
from lingua.parallel.rank_status import RankStatus
from lingua.run.dump_dir import RunDir

pytestmark = pytest.mark.timeout(60)
CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32644.")


def teacher_topo(group) -> SimpleNamespace:
    """Rank 2 (the teacher) of 2 students + 1 teacher, its one group standing in for bridge_0."""
    return SimpleNamespace(global_rank=2, role="teacher", hostname="here", world_size=3, backend="gloo",
                           all_groups=lambda: [group], group_name=lambda g: "bridge_0",
                           group_members=lambda: {"bridge_0": [0, 1, 2]},
                           plan=SimpleNamespace(rank_words=lambda r: "teacher" if r == 2 else "student"))


def students_timed_out_waiting_for_rank_2(dump) -> None:
    for rank in (0, 1):
        record = dict(rank=rank, role="student", host="here", pid=1, started="1", state="timed_out", error="",
                      time=time.time(), step=9, missing=[[2, "its process is stopped"]],
                      collective=dict(group="bridge_0", op="gloo:scatter #19"))
        RunDir(dump).status(rank).parent.mkdir(parents=True, exist_ok=True)
        RunDir(dump).status(rank).write_text(json.dumps(record))


@pytest.mark.parametrize("debug", ["trace", "false"])
def test_a_stopped_rank_woken_into_a_closed_connection_leaves_its_flight_recorder_under_trace(train_group, tmp_path,
                                                                                              debug):
    """SIGCONT after the students timed out and left: the teacher's collective finds the connection closed (no
    timeout of its own). Under trace it writes its dump then, whatever its hang watch did (its deadline can be
    re-armed by the time it runs again), so the analyzer always has every rank's dump."""
    dist.all_reduce(torch.ones(1), group=train_group)  # something in the recorder
    students_timed_out_waiting_for_rank_2(tmp_path)
    with pytest.raises(PeerStopped, match=r"^this rank \(teacher\) had stopped answering: ranks 0, 1 timed out "
                                          r"waiting for it on bridge_0 at step 9$"):
        with RankStatus(str(tmp_path), teacher_topo(train_group), debug=debug):
            raise CLOSED
    trace = flight_recorder.read_trace(tmp_path / "comm_traces" / "rank_2")
    if debug == "false":
        assert not (tmp_path / "comm_traces").exists()
    else:
        assert trace is not None and any(e["profiling_name"] == "gloo:all_reduce" for e in trace["entries"]), trace
        assert sorted(p.name for p in (tmp_path / "comm_traces").iterdir()) == ["rank_2"]


def test_a_dump_that_cannot_be_written_still_leaves_the_sentence(train_group, tmp_path):
    """A full disk (here: comm_traces is a file, so its folder cannot be made) costs the dump, never the sentence."""
    dist.all_reduce(torch.ones(1), group=train_group)
    students_timed_out_waiting_for_rank_2(tmp_path)
    (tmp_path / "comm_traces").write_text("in the way")
    with pytest.raises(PeerStopped, match=r"^this rank \(teacher\) had stopped answering"):
        with RankStatus(str(tmp_path), teacher_topo(train_group), debug="trace"):
            raise CLOSED
    assert (tmp_path / "comm_traces").read_text() == "in the way"
