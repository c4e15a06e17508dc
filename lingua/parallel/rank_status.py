"""When a peer rank dies or stops answering: each rank's status file, and the one sentence that names the rank.

A rank that dies is seen by the others only as a collective failing with a peer's address; a rank that stops
answering (stopped, stuck, frozen) only as a collective timing out. `RankStatus` keeps
`<dump_dir>/logs/rank_<r>.status.json` per rank -- its state, its step and a heartbeat while it runs, the hang
watch's note when a step runs long, then how it ended -- and turns a lost peer into `PeerStopped` and a timed-out
collective into `CollectiveTimeout`, each one sentence naming the group, the rank(s) and the step.
`apps/debug/postmortem.py` reads the same files after the fact, with the same rules (`absent_reason`).
"""

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Optional

from lingua.args import one_line
from lingua.errors import CollectiveTimeout, PeerStopped
from lingua.logger import FILE_ONLY
from lingua.run.dump_dir import RunDir

logger = logging.getLogger(__name__)

# What gloo, NCCL and the TCP store say when the other end of a connection went away (the last one: a
# rank missing from DETAIL's monitored barrier, dead or stuck).
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
                   "NCCL communicator was aborted", "failed to pass monitoredBarrier")
# What they say when a collective's timeout ran out: gloo's send/recv, NCCL's watchdog and blocking wait, and
# gloo's word for another op posted on the same connection when that op's timeout closed it (look-ahead: a
# scatter and the next gather in flight at once, either may be the one that timed out).
TIMEOUT_SIGNS = re.compile(r"Timed out waiting \d+ms|caught collective operation timeout|before timing out"
                           r"|timed out in blocking wait|Application timeout caused pair closure")
TIMEOUT_MS = re.compile(r"Timed out waiting (\d+)ms|Timeout\(ms\)=(\d+)")  # the timeout each of them reports
FIND_PEER_S = 2.0  # how long a rank that lost a peer looks for its status file (shared filesystems lag)
HEARTBEAT_S = 10.0  # a running rank rewrites its status at least this often (its watch thread does)
STEP_NOTE_MIN_S = 2.0  # ... and when its step changed, at most this often
STALE_HEARTBEAT_S = 3 * HEARTBEAT_S  # no heartbeat for this long: the whole process froze (or its host went away)


def _in_chain(err: Optional[BaseException], matches) -> bool:
    """Whether `err`, or an exception it was raised from or during, is a backend error that `matches`."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (RuntimeError, ConnectionError)) and matches(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


def is_peer_loss(err: Optional[BaseException]) -> bool:
    """Whether `err`, or an exception it was raised from or during, is a collective that lost a peer rank."""
    return _in_chain(err, lambda text: any(sign in text for sign in PEER_LOSS_SIGNS))


def is_collective_timeout(err: Optional[BaseException]) -> bool:
    """Whether `err` (or its chain) is a collective whose timeout ran out: nobody closed a connection, someone
    just did not come."""
    return _in_chain(err, lambda text: TIMEOUT_SIGNS.search(text) is not None)


def timeout_seconds(err: BaseException) -> Optional[float]:
    """The timeout the backend reports in its message, in seconds (None when it does not say)."""
    match = TIMEOUT_MS.search(str(err))
    value = match and (match.group(1) or match.group(2))
    return int(value) / 1000 if value else None


def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state letter, start time) of a process from /proc; None when it is gone; ("?", "?") without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc on this system
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?", "?"
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return fields[0], fields[19]


def process_start(pid: int) -> Optional[str]:
    """The start time of a live process (to tell it from a later one with the same pid); None when it is gone
    or a zombie. Without /proc, any process with that pid counts."""
    stat = _proc_stat(pid)
    return None if stat is None or stat[0] in ("Z", "X") else stat[1]


def process_state(record: dict, host: str) -> Optional[str]:
    """What became of the process a status record names, seen from `host`: "gone" (exited, killed), "stopped"
    (SIGSTOP or a debugger), "alive", or None when it cannot be told (another host)."""
    if record.get("host") != host:
        return None
    stat = _proc_stat(record["pid"])
    if stat is None or stat[0] in ("Z", "X") or (stat[1] != "?" and stat[1] != record.get("started")):
        return "gone"
    return "stopped" if stat[0] in ("T", "t") else "alive"


def absent_reason(record: Optional[dict], group: str, my_seq: Optional[int], host: str, now: float) -> Optional[str]:
    """Why the rank behind `record` did not enter the collective that this rank waits in on `group` (its
    sequence number `my_seq` there, from the flight recorder), or None when it did or nothing says otherwise.

    Its last collective on `group` comes from its hang note or its final record (both written from its own
    flight recorder): at or past `my_seq`, it arrived. Otherwise: it failed or finished, its process is gone or
    stopped (on this host), it is behind on `group`, or its heartbeat stopped (any host). A rank that gave up
    waiting itself (lost_peer, timed_out) is absent only if its record shows it behind."""
    if record is None:
        return "it has no status file"
    seen = (record.get("collectives") or {}).get(group)
    if seen is not None and my_seq is not None and seen["seq"] >= my_seq:
        return None
    state = record.get("state")
    if state == "failed":
        return "it failed first"
    if state == "done":
        return "it had finished"
    process = process_state(record, host) if state == "running" else None
    if process in ("gone", "stopped"):
        return f"its process is {process}"
    if seen is not None and my_seq is not None:
        where = (record.get("stuck") or {}).get("where") if state == "running" else None
        return f"its last collective on {group} is #{seen['seq']}, this rank's #{my_seq}" + (
            f"; it is busy in {where}" if where else "")
    heartbeat = record.get("heartbeat")
    if state == "running" and process is None and heartbeat is not None and now - heartbeat > STALE_HEARTBEAT_S:
        return f"no heartbeat for {now - heartbeat:.0f}s"
    return None


def diagnose_timeout(me: int, groups: dict[str, list[int]], mine: dict[str, dict], records: dict[int, Optional[dict]],
                     host: str, now: float) -> tuple[Optional[str], list[tuple[int, str]]]:
    """(the group this rank most likely timed out in, [(rank, why it did not arrive)]).

    `groups`: this rank's groups (name -> global ranks); `mine`: this rank's last collective per group (flight
    recorder: seq, op, started); `records`: every other rank's status record. The group is the one with ranks
    that did not arrive, the one entered last when several (a rank waits in the last collective it entered);
    with none named, the group entered last."""
    missing = {}
    for name, ranks in groups.items():
        seq = mine.get(name, {}).get("seq")
        found = [(r, why) for r in ranks if r != me
                 for why in [absent_reason(records.get(r), name, seq, host, now)] if why is not None]
        if found:
            missing[name] = found
    pool = list(missing) or list(groups)
    if not pool:
        return None, []
    group = max(pool, key=lambda name: mine.get(name, {}).get("started", -1.0))
    return group, missing.get(group, [])


def timeout_sentence(step: Optional[int], group: Optional[str], op: Optional[str], seconds: Optional[float],
                     missing: list[tuple[int, str]], roles: dict[int, str], run_dir: RunDir) -> str:
    """One sentence for a collective timeout: where (step, group, op), how long, and who did not arrive."""
    where = (f"step {step}: " if step is not None else "") + "a collective" + (f" on {group}" if group else "")
    where += f" ({op})" if op else ""
    waited = f" timed out after {seconds:.0f}s" if seconds is not None else " timed out"
    if not missing:
        return (f"{where}{waited}; which rank did not arrive could not be told here: `python -m apps.debug.postmortem "
                f"{run_dir.root}` compares every rank's status, hang note and flight recorder")
    who = ", ".join(f"{rank} ({roles.get(rank, '?')}: {why})" for rank, why in missing)
    logs = (f"its log is {run_dir.rank_log(missing[0][0])}" if len(missing) == 1 else
            f"their logs are {run_dir.logs}/rank_<r>.log")
    return f"{where}{waited} waiting for rank{'s' if len(missing) > 1 else ''} {who}; {logs}"


def named_by_timeouts(records: dict[int, Optional[dict]]) -> Optional[tuple[int, str]]:
    """(rank, how) of the rank that ranks timed out waiting for (the earliest such record), or None."""
    named = sorted((rec["time"], missing[0], rec) for rec in records.values()
                   if rec and rec["state"] == "timed_out" for missing in rec.get("missing") or [])
    if not named:
        return None
    _, rank, rec = named[0]
    waiting = sorted(r for r, other in records.items() if other and other["state"] == "timed_out"
                     and any(m[0] == rank for m in other.get("missing") or []))
    at = f" at step {rec['step']}" if rec.get("step") is not None else ""
    return rank, (f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} timed out waiting for it "
                  f"on {(rec.get('collective') or {}).get('group', '?')}{at}")


def first_failed(records: dict[int, Optional[dict]]) -> Optional[tuple[int, str]]:
    """(rank, how) of the earliest rank that recorded a failure of its own, or None."""
    failed = sorted((rec["time"], r) for r, rec in records.items() if rec and rec["state"] == "failed")
    return (failed[0][1], "it failed") if failed else None


def gone_while_running(records: dict[int, Optional[dict]], host: str) -> list[int]:
    """Ranks whose record still says running while their process on `host` is gone (SIGKILL, out of memory, a
    watchdog abort), the earliest heartbeat first."""
    gone = [(rec.get("heartbeat") or rec["time"], r) for r, rec in records.items()
            if rec and rec["state"] == "running" and process_state(rec, host) == "gone"]
    return [r for _, r in sorted(gone)]


def first_stopped(records: dict[int, Optional[dict]], host: str) -> Optional[tuple[int, str]]:
    """(rank, how the others saw it) of the rank that stopped first, from status records: one that ranks timed
    out waiting for, else the earliest that recorded a failure, else one on `host` whose process is gone while its
    record still says running; None if none."""
    found = named_by_timeouts(records) or first_failed(records)
    if found is None and gone_while_running(records, host):
        found = gone_while_running(records, host)[0], "its process is gone"
    return found


class RankStatus:
    """This rank's `<dump_dir>/logs/rank_<r>.status.json`: host and pid, state, step and heartbeat while it runs,
    then how it ended.

        with RankStatus(dump_dir, topo, debug):   # around everything after setup_torch_distributed
            ...

    A rank that fails records it before its process group goes down, so before any peer can notice. A rank
    whose collective loses a peer (`is_peer_loss`) reads the others' files and raises `PeerStopped` naming
    the rank that stopped first: one that others timed out waiting for, else the earliest one that recorded a
    failure, else one on this host whose process is gone (SIGKILL, out of memory), else "a peer rank". A rank
    whose collective times out raises `CollectiveTimeout` naming the group, the rank(s) that did not arrive
    (`diagnose_timeout`) and the step. The backend's words go to this rank's log and its status file
    (`backend_error`); its traceback, which only shows where it was waiting, goes to the rank's log alone (the
    console shows the sentence).
    A rank that raises `PeerStopped` itself (its teacher hit a bug) records `lost_peer` as well: it is never
    the one named.
    """

    def __init__(self, dump_dir: str, topo, debug="false"):
        self.run_dir, self.topo = RunDir(dump_dir), topo
        mode = str(debug).strip().lower()
        self.debug, self.traces = mode != "false", mode in ("trace", "true")
        self.pid = os.getpid()
        self.started = process_start(self.pid)
        self.fields: dict = {}  # step, heartbeat, stuck, collectives: kept across rewrites
        self.current_step: Optional[int] = None  # set by the watch as the loop arms it (students; None on teachers)
        self.state = "running"
        self.last_write = 0.0
        self.lock = threading.Lock()  # the watch thread writes heartbeats and notes too
        self.write("running")

    def write(self, state: str, error: str = "", **fields) -> None:
        """Atomically replace this rank's status file: running | failed | lost_peer | timed_out | done. Once it
        ended, a late heartbeat or note from the watch thread leaves the file alone."""
        with self.lock:
            if self.state != "running" and state == "running":
                return
            self.state = state
            self.fields.update(fields)
            if self.current_step is not None:  # every write carries the freshest step
                self.fields["step"] = self.current_step
            rank = self.topo.global_rank
            record = dict(rank=rank, role=self.topo.role, host=self.topo.hostname, pid=self.pid,
                          started=self.started, state=state, error=error, time=time.time(), **self.fields)
            path = self.run_dir.status(rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
            self.last_write = time.monotonic()

    def heartbeat(self) -> None:
        """From the watch thread: the step and a fresh time, every HEARTBEAT_S, or STEP_NOTE_MIN_S after a new step."""
        since, step = time.monotonic() - self.last_write, self.current_step
        if since >= HEARTBEAT_S or (step != self.fields.get("step") and since >= STEP_NOTE_MIN_S):
            self.write("running", heartbeat=time.time())

    def note_stuck(self, note: dict, collectives: dict) -> None:
        """From the watch thread, when a step runs long: where this rank is and its last collective per group."""
        self.write("running", stuck=note, collectives=collectives, heartbeat=time.time())

    def read(self, rank: int) -> Optional[dict]:
        try:
            return json.loads(self.run_dir.status(rank).read_text())
        except (OSError, ValueError):
            return None

    def others(self) -> dict[int, Optional[dict]]:
        """Every other rank's status record (None where it has none yet)."""
        return {r: self.read(r) for r in range(self.topo.world_size) if r != self.topo.global_rank}

    def stopped_peer(self, wait_s: float = FIND_PEER_S) -> Optional[int]:
        """The rank that stopped first, from the status files (None if none can be told)."""
        found = self.first_stopped(wait_s)
        return None if found is None else found[0]

    def first_stopped(self, wait_s: float = FIND_PEER_S) -> Optional[tuple[int, str]]:
        """(rank, how the others saw it) of the rank that stopped first, from the status files, or None; waits
        up to `wait_s` for a record to say so (shared filesystems lag)."""
        deadline = time.time() + wait_s
        while True:
            found = first_stopped(self.others(), self.topo.hostname)
            if found is not None or time.time() >= deadline:
                return found
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
        if is_collective_timeout(exc):
            self._timed_out(exc)
        if not is_peer_loss(exc):
            self.write("failed", one_line(f"{type(exc).__name__}: {exc}"))
            return
        logger.error("the collective that lost its peer", exc_info=exc, extra=FILE_ONLY)  # the backend's traceback
        backend = one_line(str(exc))
        if self.traces:  # as on a timeout: a rank that was stopped (SIGSTOP) ends here, its hang watch re-armed
            from lingua.parallel import flight_recorder  # torch-side; status files are read without it too

            flight_recorder.write_trace(self.topo, self.run_dir.root, "lost a peer")
        self.write("lost_peer", "lost a peer in a collective", backend_error=backend[:2000])
        found = self.first_stopped()
        me = self.topo.global_rank
        if found is None:
            sentence = (f"a peer rank stopped (or stopped answering) and this one lost it in a collective; the first "
                        f"error is in one of {self.run_dir.logs}/rank_*.log")
        elif found[0] == me:
            sentence = f"this rank ({self.topo.role}) had stopped answering: {found[1]}"
        else:
            peer, how = found
            seen = f" ({how})" if how.startswith("rank") else ""  # "ranks 0, 1 timed out waiting for it on ..."
            log = self.run_dir.rank_log(peer)
            sentence = f"rank {peer} ({self.topo.plan.rank_words(peer)}) stopped{seen}; its log is {log}"
        logger.error(f"{sentence} (here: {backend[:300]})")  # the backend's words, for this rank's log
        mine = self._last_collectives()
        # Where this rank lost it: its last collective on a group that holds the stopped rank (any group if unknown).
        holding = [name for name, ranks in self.topo.group_members().items()
                   if name in mine and (found is None or found[0] in ranks)]
        group = max(holding, key=lambda name: mine[name]["started"], default=None)
        collective = dict(group=group, op=f"{mine[group]['op']} #{mine[group]['seq']}") if group else None
        self.write("lost_peer", sentence, backend_error=backend[:2000], collectives=mine,
                   collective=collective, peer=None if found is None else found[0])
        raise PeerStopped(sentence) from None

    def _group_timeout_s(self, name: Optional[str]) -> Optional[float]:
        """The timeout the backends of group `name` are set to (read back from them), or None."""
        from lingua.parallel.timeouts import group_timeouts

        for group in self.topo.all_groups():
            if name is not None and self.topo.group_names.get(id(group)) == name:
                values = [value for value in group_timeouts(group).values() if value is not None]
                return max(values) if values else None
        return None

    def _last_collectives(self) -> dict[str, dict]:
        """This rank's last collective per group, from its flight recorder ({} without one)."""
        from lingua.parallel import flight_recorder  # torch-side; status files are read without it too

        return flight_recorder.last_collectives(flight_recorder.snapshot(self.topo.backend), self.topo)

    def _timed_out(self, exc: BaseException) -> None:
        """A collective timed out: the sentence naming group, absent ranks and step; raises CollectiveTimeout."""
        from lingua.parallel import flight_recorder  # torch-side; status files are read without it too
        from lingua.parallel.collectives import last_logged_collective

        logger.error("the collective that timed out", exc_info=exc, extra=FILE_ONLY)  # the backend's traceback
        backend = one_line(str(exc))
        if self.traces:
            flight_recorder.write_trace(self.topo, self.run_dir.root, "collective timeout")
        mine = self._last_collectives()
        group, missing = diagnose_timeout(self.topo.global_rank, self.topo.group_members(), mine, self.others(),
                                          self.topo.hostname, time.time())
        named = None if missing else self.first_stopped(wait_s=0)
        if named is not None and named[0] == self.topo.global_rank:  # the others timed out waiting for this rank
            sentence = f"this rank ({self.topo.role}) had stopped answering: {named[1]}"
            logger.error(f"{sentence} (here: {backend[:300]})")
            self.write("timed_out", sentence, backend_error=backend[:2000], collectives=mine)
            raise CollectiveTimeout(sentence) from None
        last = mine.get(group)
        ours = last_logged_collective(group) if group and not last else None  # no flight recorder on this torch
        op = f"{last['op']} #{last['seq']}" if last else (f"the last of ours there: {ours}" if ours else None)
        step = self.current_step
        roles = {r: self.topo.plan.rank_words(r) for r in range(self.topo.world_size)}
        seconds = timeout_seconds(exc) or self._group_timeout_s(group)  # the pair-closure words give no figure
        sentence = timeout_sentence(step, group, op, seconds, missing, roles, self.run_dir)
        logger.error(f"{sentence} (here: {backend[:300]})")
        self.write("timed_out", sentence, backend_error=backend[:2000], collectives=mine,
                   collective=dict(group=group, op=op), missing=[[rank, why] for rank, why in missing])
        raise CollectiveTimeout(sentence) from None
