"""The teacher's clocks: its busy and idle seconds (`ServingClock`) and the collective timeout in force while it
waits for its students (`TimeoutSwitch`): generous (`distributed.init_timeout_s`) through the students' first step
and across every long pause they announce (requests with `RequestHeader.in_training=0` again), short
(`distributed.train_timeout_s`) from a request of normal training or a STOP on.
"""

import contextlib
import logging
import time
from typing import Iterable, Optional

import torch

from lingua.parallel.timeouts import HangWatch, set_collective_timeout

logger = logging.getLogger(__name__)


class ServingClock:
    """The teacher's busy and idle seconds since the handshake. CPU: the host clock. CUDA: busy is the stream's time
    from a request's arrival to the end of its forward, from events read when the next request arrives (its headers
    wait for the stream anyway), idle the rest: a status reports the busy time of the requests before it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.mark = time.perf_counter()  # mark: where the last counted interval ended (CPU)
        self.busy_s = self.idle_total = 0.0
        self.forward_s = 0.0  # the part of busy spent in the forward and the outputs (the rest is protocol)
        self.pending: list = []  # CUDA: (arrival, forward done) event pairs not read yet
        self.forward_pending: list = []  # CUDA: (forward start, forward end) event pairs not read yet

    def request_arrived(self) -> None:
        if self.cuda:
            for begin, end in self.pending:
                self.busy_s += begin.elapsed_time(end) / 1e3
            for begin, end in self.forward_pending:
                self.forward_s += begin.elapsed_time(end) / 1e3
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self.pending, self.forward_pending = [(begin, None)], []
            return
        now = time.perf_counter()
        self.idle_total += now - self.mark
        self.mark = now

    def worked(self) -> None:
        if self.cuda:
            if self.pending and self.pending[-1][1] is None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pending[-1] = (self.pending[-1][0], end)
            return
        now = time.perf_counter()
        self.busy_s += now - self.mark
        self.mark = now

    @contextlib.contextmanager
    def forward(self):
        """Around the forward and the outputs of a request (events on CUDA, read with the next request)."""
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.forward_pending.append((begin, end))
            return
        start = time.perf_counter()
        yield
        self.forward_s += time.perf_counter() - start

    @property
    def idle_s(self) -> float:
        if self.cuda:
            return max(time.perf_counter() - self.start - self.busy_s, 0.0)
        return self.idle_total

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(self.busy_s + self.idle_s, 1e-9)


class TimeoutSwitch:
    """The teacher's collective timeout on every group of this rank, switched as requests arrive (the module's rule).
    A request is observed before the teacher waits for the next, so an announcement governs exactly the wait that
    spans the pause (with look-ahead the last request before it is the next step's: the students mark every request
    of the step before it). Each wait arms a stack dump shortly before the timeout in force."""

    def __init__(self, topo, timeouts: Optional[tuple[float, float]]):
        self.topo, self.timeouts = topo, timeouts
        self.timeout_s = timeouts[0] if timeouts is not None else None
        self.hang_watch = HangWatch() if timeouts is not None else None
        self.in_training = False  # whether the short (training) timeout is in force

    def arm(self) -> None:
        if self.hang_watch is not None:
            self.hang_watch.arm(self.timeout_s)

    def cancel(self) -> None:
        if self.hang_watch is not None:
            self.hang_watch.cancel()

    def observe(self, headers: Iterable, stop: bool = False) -> None:
        if self.timeouts is None:
            return
        headers = list(headers)
        short = stop or all(h.in_training for h in headers)
        if short == self.in_training:
            return
        if not short:  # back from the short one: only a pause announced does that
            logger.info(f"the students announced a long pause after this request (step {headers[0].step}: a "
                        f"checkpoint evaluation follows); waiting under the generous timeout until their next one")
        self.in_training, self.timeout_s = short, self.timeouts[1] if short else self.timeouts[0]
        set_collective_timeout(self.topo, self.timeout_s)
