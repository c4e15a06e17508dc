"""One watch thread per rank: what a rank can still say while its main thread is stuck in a collective.

    with RankStatus(dump_dir, topo, debug) as status, RankWatch(topo, dump_dir, status, traces):
        ...                           # HangWatch.arm(timeout_s, step) before each step / wait

The main thread cannot run Python while it waits in a collective (nor can a Python signal handler), so a thread
of ours does, every POLL_S:
  - the heartbeat: the rank's step and a fresh time in its status file (`RankStatus.heartbeat`), and on rank 0
    in the dump dir's owner record (`DumpDirOwner.heartbeat`);
  - the hang watch: once a step or wait runs past 90% of the collective timeout, a log line saying where the
    main thread is and the last collective on each group, every thread's stack appended to the rank's own log
    (`logs/rank_<r>.log`; faulthandler's own timer writes them there too at the same moment, even if the GIL is
    held: the console keeps sentences), the same note in the status file, and with `distributed.debug=trace` the flight recorder dump;
  - SIGUSR1: the stacks into the rank log and, with trace, the flight recorder dump (faulthandler prints the
    stacks on stderr first). The signal reaches this thread through `signal.set_wakeup_fd`: Python's C-level
    handler writes the signal's number to our pipe at once, where a Python handler would wait for the main thread.
"""

import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from lingua.parallel import flight_recorder

logger = logging.getLogger(__name__)
POLL_S = 0.5
JOIN_S = 10.0  # how long the way out waits for a dump in progress (before the process group goes)
_active: Optional["RankWatch"] = None  # the running watch, for HangWatch.arm / cancel


def arm(delay_s: float, timeout_s: float, step: Optional[int]) -> None:
    """Fire the running watch after `delay_s` unless re-armed or cancelled (no watch running: nothing)."""
    if _active is not None:
        _active.arm(delay_s, timeout_s, step)


def cancel() -> None:
    """Disarm the running watch's hang timer (the heartbeat goes on)."""
    if _active is not None:
        _active.deadline = None


def _short(frame) -> str:
    """`path:line (function)`, the path relative to the working directory or to site-packages."""
    path = Path(frame.f_code.co_filename)
    if "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1:])
    elif Path.cwd() in path.parents:
        path = path.relative_to(Path.cwd())
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def describe_frame(frame) -> str:
    """Where a thread is: its innermost frame of ours (under the working directory), then torch's or the
    library's innermost frame if that is deeper, as `path:line (function) > path:line (function)`."""
    if frame is None:
        return "?"
    innermost, ours = frame, None
    while frame is not None and ours is None:
        path = Path(frame.f_code.co_filename)
        if path.is_absolute() and Path.cwd() in path.parents and "site-packages" not in path.parts:
            ours = frame
        frame = frame.f_back
    if ours is None or ours is innermost:
        return _short(innermost)
    return f"{_short(ours)} > {_short(innermost)}"


def main_thread_at() -> str:
    """Where the main thread is now (see `describe_frame`)."""
    return describe_frame(sys._current_frames().get(threading.main_thread().ident))


def describe_collectives(collectives: dict[str, dict]) -> str:
    """`group op #seq, ...` for a log line."""
    return ", ".join(f"{name} {c['op']} #{c['seq']}" for name, c in collectives.items()) or "none recorded"


class RankWatch:
    """The watch thread of one rank (see the module docstring). A context manager, entered on the main thread."""

    def __init__(self, topo, dump_dir, status, traces: bool = False, owner=None):
        self.topo, self.dump_dir, self.status, self.traces = topo, dump_dir, status, traces
        self.owner = owner  # the dump dir's owner record (lingua/run/owner.py): its heartbeat is ours too
        self.rank_log = Path(status.run_dir.rank_log(topo.global_rank))
        self.deadline: Optional[float] = None  # monotonic time the hang watch fires at
        self.armed_at, self.timeout_s, self.step = 0.0, 0.0, None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lingua-rank-watch", daemon=True)
        self.wake_read = self.wake_write = -1
        self.previous_wakeup_fd = -1

    def arm(self, delay_s: float, timeout_s: float, step: Optional[int]) -> None:
        self.armed_at, self.timeout_s = time.monotonic(), timeout_s
        if step is not None:
            self.step = self.status.current_step = step
        self.deadline = self.armed_at + delay_s

    def __enter__(self) -> "RankWatch":
        global _active
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.previous_wakeup_fd = signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        _active = self
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active
        _active = None
        self.stopping.set()
        os.write(self.wake_write, b"\0")  # wakes the thread's select now, not at its next poll
        self.thread.join(timeout=JOIN_S)
        signal.set_wakeup_fd(self.previous_wakeup_fd)
        os.close(self.wake_read)
        os.close(self.wake_write)
        # A deadline that passed while the process could not run (SIGSTOP) and the thread had no turn since.
        if exc is not None and self.deadline is not None and time.monotonic() >= self.deadline:
            innermost = tb
            while innermost is not None and innermost.tb_next is not None:
                innermost = innermost.tb_next
            self._fire(describe_frame(innermost.tb_frame if innermost is not None else None))

    def _run(self) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([self.wake_read], [], [], POLL_S)
            try:
                if ready and signal.SIGUSR1 in os.read(self.wake_read, 512):
                    self._on_sigusr1()
                if self.deadline is not None and time.monotonic() >= self.deadline and not self.stopping.is_set():
                    self._fire(main_thread_at())
                self.status.heartbeat()
                if self.owner is not None:
                    self.owner.heartbeat()
            except Exception as err:  # the watch must outlive whatever it watches
                logger.warning(f"rank watch: {type(err).__name__}: {err}")

    def _append_stacks(self) -> None:
        """Every thread's stack, appended to this rank's log (faulthandler writes straight to the file)."""
        with open(self.rank_log, "a") as log:
            faulthandler.dump_traceback(file=log, all_threads=True)

    def _fire(self, where: str) -> None:
        """The hang watch: a step or wait has run past 90% of the collective timeout; `where` the main thread is."""
        self.deadline = None
        waited = time.monotonic() - self.armed_at
        collectives = flight_recorder.last_collectives(flight_recorder.snapshot(self.topo.backend), self.topo)
        what = f"step {self.step}" if self.step is not None else "this wait"
        logger.warning(f"{what} has run {waited:.0f}s ({100 * waited / max(self.timeout_s, 1e-9):.0f}% of the "
                       f"{self.timeout_s:.0f}s collective timeout), in {where}; last collective per group: "
                       f"{describe_collectives(collectives)}; every thread's stack follows")
        self._append_stacks()
        self.status.note_stuck(dict(at=time.time(), step=self.step, waited_s=round(waited, 1),
                                    timeout_s=self.timeout_s, where=where), collectives)
        if self.traces:
            flight_recorder.write_trace(self.topo, self.dump_dir, "hang watch")

    def _on_sigusr1(self) -> None:
        logger.warning(f"SIGUSR1: main thread in {main_thread_at()}; every thread's stack follows")
        self._append_stacks()
        if self.traces:
            flight_recorder.write_trace(self.topo, self.dump_dir, "SIGUSR1")
