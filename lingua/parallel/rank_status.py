"""When a peer rank dies: each rank's status file, and the one sentence that names the rank that stopped first.

A rank that dies is seen by the others only as a collective failing with a peer's address. `RankStatus`
keeps `<dump_dir>/logs/rank_<r>.status.json` per rank and turns a lost peer into `PeerStopped` naming the
rank that stopped first and its log.
"""

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from lingua.args import one_line
from lingua.errors import PeerStopped
from lingua.rundir import RunDir

logger = logging.getLogger(__name__)

# What gloo, NCCL and the TCP store say when the other end of a connection went away (the last one: a
# rank missing from DETAIL's monitored barrier, dead or stuck).
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
                   "NCCL communicator was aborted", "failed to pass monitoredBarrier")
FIND_PEER_S = 2.0  # how long a rank that lost a peer looks for its status file (shared filesystems lag)


def is_peer_loss(err: Optional[BaseException]) -> bool:
    """Whether `err`, or an exception it was raised from or during, is a collective that lost a peer rank."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (RuntimeError, ConnectionError)) and any(sign in str(err) for sign in PEER_LOSS_SIGNS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _process_start(pid: int) -> Optional[str]:
    """The start time of a live process (to tell it from a later one with the same pid); None when it is gone
    or a zombie. Without /proc, any process with that pid counts."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc on this system
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else fields[19]


class RankStatus:
    """This rank's `<dump_dir>/logs/rank_<r>.status.json`: its host and pid while it runs, then how it ended.

        with RankStatus(dump_dir, topo, debug):   # around everything after setup_torch_distributed
            ...

    A rank that fails records it before its process group goes down, so before any peer can notice. A rank
    whose collective loses a peer (`is_peer_loss`) reads the others' files and raises `PeerStopped` naming
    the rank that stopped first: the earliest one that recorded a failure, else one on this host whose
    process is gone (SIGKILL, out of memory), else "a peer rank". Its own traceback, which only shows where
    it was waiting, is logged with `distributed.debug=true`. A rank that raises `PeerStopped` itself (its
    teacher hit a bug) records `lost_peer` as well: it is never the one named.
    """

    def __init__(self, dump_dir: str, topo, debug: bool = False):
        self.run_dir, self.topo, self.debug = RunDir(dump_dir), topo, debug
        self.pid = os.getpid()
        self.started = _process_start(self.pid)
        self.write("running")

    def write(self, state: str, error: str = "") -> None:
        """Atomically replace this rank's status file: running | failed | lost_peer | done."""
        rank = self.topo.global_rank
        record = dict(rank=rank, role=self.topo.role, host=self.topo.hostname, pid=self.pid, started=self.started,
                      state=state, error=error, time=time.time())
        path = self.run_dir.status(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)

    def read(self, rank: int) -> Optional[dict]:
        try:
            return json.loads(self.run_dir.status(rank).read_text())
        except (OSError, ValueError):
            return None

    def stopped_peer(self, wait_s: float = FIND_PEER_S) -> Optional[int]:
        """The rank that stopped first, from the status files (None if none can be told)."""
        deadline = time.time() + wait_s
        while True:
            records = {r: self.read(r) for r in range(self.topo.world_size) if r != self.topo.global_rank}
            failed = sorted((rec["time"], r) for r, rec in records.items() if rec and rec["state"] == "failed")
            if failed:
                return failed[0][1]
            gone = [r for r, rec in records.items() if rec and rec["state"] == "running"
                    and rec["host"] == self.topo.hostname and _process_start(rec["pid"]) != rec["started"]]
            if gone:
                return gone[0]
            if time.time() >= deadline:
                return None
            time.sleep(0.1)

    def __enter__(self) -> "RankStatus":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.write("done")
            return
        if isinstance(exc, PeerStopped):  # another rank failed first and this one already says which
            self.write("lost_peer", one_line(str(exc)))
            return
        if not is_peer_loss(exc):
            self.write("failed", one_line(f"{type(exc).__name__}: {exc}"))
            return
        if self.debug:
            logger.error("the collective that lost its peer", exc_info=exc)
        self.write("lost_peer", one_line(str(exc)))
        peer = self.stopped_peer()
        if peer is None:
            sentence = (f"a peer rank stopped (or stopped answering) and this one lost it in a collective; the first "
                        f"error is in one of {self.run_dir.logs}/rank_*.log")
        else:
            sentence = f"rank {peer} ({self.topo.plan.role(peer)}) stopped; its log is {self.run_dir.rank_log(peer)}"
        logger.error(f"{sentence} (here: {one_line(exc)[:300]})")  # the backend's words, for this rank's log
        raise PeerStopped(sentence) from None
