"""One live run per dump dir: the owner record `<dump_dir>/owner.json`, taken before any process group.

    owner = DumpDirOwner(dump_dir, launch, startup_s).take()   # every rank, before setup_torch_distributed
    ...                                                        # the watch thread calls owner.heartbeat()
    owner.release()                                            # rank 0 removes it on the way out

Only global rank 0 writes the record; it is created whole by `os.link` of a finished temporary file (atomic and
exclusive on NFS and Lustre, where `flock` may be a no-op), so a reader sees all of it or nothing. Only rank 0
decides, without a collective: a record of its own launch (same SLURM job and restart, same rendezvous address;
under torchrun, rank 0's restarted generation takes over a record its own agent's earlier one wrote at once)
lets every rank in; a live record of another launch is refused in one sentence naming the holder (host, pid, job,
since when), before any process group exists. Another rank says that sentence itself only where it sees what
rank 0 sees (the whole launch and the holder on one host: a pid check gives both the same answer, a heartbeat's
age on two clocks may not); elsewhere it waits for its launch's record, or for torchrun to stop it once rank 0
refused (one sentence too). A holder that is gone --
its pid dead on this host, its heartbeat older than the bound it wrote itself (a holder on another host; one on
this host whose process lives, even stopped, keeps the dir), or an earlier run of this same SLURM job (a
requeue) -- is taken over with a warning naming it. A clean exit, or a failure our code saw,
removes the record; a killed run leaves it, and the next launch takes it over.
"""

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from lingua.cli.entry import check_no_sigterm_held
from lingua.errors import LaunchError
from lingua.parallel.rank_status import HEARTBEAT_S, process_start, process_state

logger = logging.getLogger(__name__)

OWNER = "owner.json"
STALE_S = 6 * HEARTBEAT_S  # a running holder's heartbeat is never older than this (its watch thread writes it)
POLL_S = 0.2


def launch_key(launch, env=None) -> str:
    """What every rank of one launch shares and no other live launch does: the SLURM job and its restart count,
    the rendezvous address (torchrun, srun) and torchrun's run id; a single process is its own launch."""
    env = os.environ if env is None else env
    if launch.launcher == "single":
        return f"single:{socket.gethostname()}:{os.getpid()}"
    job = f"{env.get('SLURM_JOB_ID', '-')}.{env.get('SLURM_RESTART_COUNT', '0')}"
    # torchrun's c10d rendezvous without the shared store gives each restarted generation a new port: not part of it.
    port = "-" if env.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else launch.master_port
    return f"{launch.launcher}:{launch.master_addr}:{port}:job={job}:{env.get('TORCHELASTIC_RUN_ID', '-')}"


def launcher_agent(env) -> Optional[list]:
    """[host, pid] of the torchrun agent that started this process (its parent), which outlives its restarts."""
    return [socket.gethostname(), os.getppid()] if "TORCHELASTIC_RUN_ID" in env else None


def describe_holder(record: dict, now: Optional[float] = None) -> str:
    """`host H, pid P, SLURM job J, since 18:02:57 UTC (heartbeat 3s ago)` for a sentence."""
    now = time.time() if now is None else now
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("since", 0)))
    job = f", SLURM job {record['job']}" if record.get("job") else ""
    beat = f" (heartbeat {max(now - record.get('heartbeat', 0), 0):.0f}s ago)" if record.get("heartbeat") else ""
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}{job}, since {since}{beat}"


def holder_gone(record: dict, host: str, now: float, env=None) -> Optional[str]:
    """Why the run behind `record` no longer holds the dump dir, or None while it may still be running."""
    env = os.environ if env is None else env
    process = process_state(record, host)  # None on another host: only its heartbeat can tell
    if process == "gone":
        return "its process is gone"
    job, restart = env.get("SLURM_JOB_ID"), int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if job and record.get("job") == job and int(record.get("restart", 0)) < restart:
        return f"it is this SLURM job's run before requeue {restart}"  # it saved and requeued itself: past its writes
    if process is not None:  # alive, or stopped (it would write again once continued): it still holds the dir
        return None
    age = now - record.get("heartbeat", 0)
    if age > record.get("stale_after_s", STALE_S):
        return f"its heartbeat is {age:.0f}s old"
    return None


class DumpDirOwner:
    """The dump dir's owner record, as one rank of one launch sees it (see the module docstring)."""

    def __init__(self, dump_dir, launch, startup_s: float, env=None):
        self.root = Path(dump_dir)
        self.path = self.root / OWNER
        self.env = os.environ if env is None else env
        self.rank, self.key = launch.rank, launch_key(launch, self.env)
        self.one_host = launch.local_world_size == launch.world_size  # rank 0 runs on this host too
        self.host = socket.gethostname()
        # Until the watch thread's first heartbeat the holder is starting up: it may take the process group's
        # init timeout to get there.
        self.startup_s = startup_s
        self.held = False
        self.record: dict = {}
        self.last_beat = 0.0

    def read(self, path: Optional[Path] = None) -> Optional[dict]:
        try:
            return json.loads((path or self.path).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # written by hand, or by another tool: as good as no holder
            return {}

    def refusal(self, record: dict) -> LaunchError:
        return LaunchError(
            f"dump_dir {self.root} is in use by another run ({describe_holder(record)}); wait for it to end, or "
            f"give this run another dump_dir (a holder that is gone is taken over once its process is dead or "
            f"its heartbeat is {record.get('stale_after_s', STALE_S):.0f}s old)")

    def sees_what_rank_0_sees(self, record: dict) -> bool:
        """Whether this rank's verdict on a holder is rank 0's: every rank of the launch is on this host and so is
        the holder, so its pid is checked here as on rank 0 (a holder on this host is judged by its pid and the
        SLURM job only, never by the clock). Anywhere else only rank 0 decides and the others follow. (Only a holder
        that exits between rank 0's read and this one's can part them: this rank's refusal was true when said, and
        torchrun stops the whole launch, rank 0 within its 30 s grace, as for any rank that exits.)"""
        return self.one_host and record.get("host") == self.host

    def take(self) -> "DumpDirOwner":
        """Take the dump dir (rank 0) or check that rank 0 of this launch took it (the other ranks); raise
        `LaunchError` naming the holder when another live run has it."""
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.startup_s
        while True:
            record = self.read()
            ours = bool(record) and record.get("launch") == self.key and self.same_agent(record)
            gone = holder_gone(record, self.host, time.time(), self.env) if record and not ours else None
            if record and not ours and gone is None and (self.rank == 0 or self.sees_what_rank_0_sees(record)):
                # This rank's own verdict (the others' is rank 0's, by the same rules), said also when the launcher
                # is already stopping this rank because another one refused first: it is why.
                raise self.refusal(record)
            check_no_sigterm_held()  # another rank failed first and the launcher stops this one: take nothing
            if ours:
                if self.rank == 0 and record.get("pid") != os.getpid():  # this launch's restarted rank 0
                    self._write(self._replace)
                    continue
                self.held = self.rank == 0
                return self
            if self.rank == 0 and self._take_from(record, gone):
                self.held = True
                return self
            if time.monotonic() > deadline:
                raise LaunchError(f"rank 0 of this launch did not take dump_dir {self.root} within "
                                  f"{self.startup_s:.0f}s (no {self.path} of this launch appeared); its log says why")
            time.sleep(POLL_S)

    def same_agent(self, record: dict) -> bool:
        """Rank 0 under torchrun: a record of another process is this launch's only if our agent wrote it (two
        launches may share a run id); the record's pid decides that elsewhere."""
        agent = launcher_agent(self.env)
        return self.rank != 0 or agent is None or record.get("pid") == os.getpid() or record.get("agent") in (None, agent)

    def _new_record(self) -> dict:
        now = time.time()
        return dict(launch=self.key, host=self.host, pid=os.getpid(), started=process_start(os.getpid()),
                    job=self.env.get("SLURM_JOB_ID"), restart=int(self.env.get("SLURM_RESTART_COUNT", "0") or 0),
                    since=now, heartbeat=now, stale_after_s=self.startup_s + STALE_S, agent=launcher_agent(self.env))

    def _write(self, place, record: Optional[dict] = None) -> bool:
        """Write the record to a temporary file of this process, then `place(tmp)` puts it at the owner's path."""
        record = self.record = record or self._new_record()
        tmp = self.root / f".{OWNER}.{self.host}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            return place(tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _link(self, tmp: Path) -> bool:
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this filesystem: an exclusive create (whole on local and NFSv3+ disks)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
        return True

    def _replace(self, tmp: Path) -> bool:
        os.replace(tmp, self.path)
        return True

    def _take_from(self, record: Optional[dict], gone: Optional[str]) -> bool:
        """Rank 0: create the record, after moving a gone holder's aside (only if it is still that one)."""
        if record is not None:
            aside = self.root / f".{OWNER}.taken.{os.getpid()}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return False
            moved = self.read(aside)
            if moved != record:  # another launch took it meanwhile: put its record back, decide again
                try:
                    os.link(aside, self.path)
                except OSError:
                    pass
                aside.unlink(missing_ok=True)
                return False
            aside.unlink(missing_ok=True)
            what = describe_holder(record) if record else f"an unreadable {OWNER}"
            logger.warning(f"taking over dump_dir {self.root} from a run that is gone ({what}: {gone or 'unreadable'})")
        return self._write(self._link)

    def heartbeat(self) -> None:
        """From the watch thread: a fresh time in the record, every HEARTBEAT_S (rank 0; a no-op elsewhere)."""
        if not self.held or time.monotonic() - self.last_beat < HEARTBEAT_S:
            return
        self.last_beat = time.monotonic()
        if (self.read() or {}).get("pid") != os.getpid():  # taken over (this process froze past the bound)
            self.held = False
            logger.warning(f"another run took over dump_dir {self.root}: {describe_holder(self.read() or {})}")
            return
        self._write(self._replace, dict(self.record, heartbeat=time.time(), stale_after_s=STALE_S))

    def release(self) -> None:
        """Remove the record if this process still holds it (rank 0, on the way out)."""
        if self.held and (self.read() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False
