"""The teacher's clocks: its busy and idle seconds (`ServingClock`) and the collective timeout in force while it
waits for its students (`TimeoutSwitch`).

The timeout follows the students' requests, both ways. Generous (`distributed.init_timeout_s`) through the
students' first step (checkpoint load, compile, the first backward, a save) and across every long pause the
students announce (an in-process checkpoint evaluation: the requests they post during the step before it carry
`RequestHeader.in_training=0` again); short (`distributed.train_timeout_s`) as soon as a request of normal
training (`in_training=1`) or a STOP arrives. Each wait arms the hang watch with the timeout in force.
"""

import contextlib
import logging
import time
from typing import Iterable, Optional

import torch

from lingua.parallel.timeouts import HangWatch, set_collective_timeout

logger = logging.getLogger(__name__)


class ServingClock:
    """The teacher's busy and idle seconds since the handshake; together they cover the whole loop.

    CPU: the host clock (the forward runs on the host). CUDA: busy = the stream's time from a request's
    arrival to the end of its forward, from events read when the next request arrives (reading its
    headers waits for the stream anyway), idle = the rest; so a status reports the busy time of the
    requests before it, and the forward needs no host sync of its own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.mark = time.perf_counter()  # mark: where the last counted interval ended (CPU)
        self.busy_total = self.idle_total = 0.0
        self.forward_total = 0.0  # the part of busy spent in the forward and the outputs (the rest is protocol)
        self.pending: list = []  # CUDA: (arrival, forward done) event pairs not read yet
        self.forward_pending: list = []  # CUDA: (forward start, forward end) event pairs not read yet

    def request_arrived(self) -> None:
        if self.cuda:
            for begin, end in self.pending:
                self.busy_total += begin.elapsed_time(end) / 1e3
            for begin, end in self.forward_pending:
                self.forward_total += begin.elapsed_time(end) / 1e3
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
        self.busy_total += now - self.mark
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
        self.forward_total += time.perf_counter() - start

    @property
    def busy_s(self) -> float:
        return self.busy_total

    @property
    def forward_s(self) -> float:
        return self.forward_total

    @property
    def idle_s(self) -> float:
        if self.cuda:
            return max(time.perf_counter() - self.start - self.busy_total, 0.0)
        return self.idle_total

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(self.busy_s + self.idle_s, 1e-9)


class TimeoutSwitch:
    """The teacher's collective timeout, switched on every group of this rank as requests arrive: generous until a
    request of normal training, short until a request announcing a pause (see the module docstring). A request
    is observed before the teacher waits for the next one, so the announcement governs exactly the wait that
    spans the pause; with look-ahead the last request posted before the pause is one of the next step's, which
    is why the students mark every request they post during the step before it. Each wait arms a stack dump
    shortly before the timeout in force, so a teacher stuck waiting says where."""

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
        """The request just received (every student's header): short after a STOP or a request of normal training
        (every student `in_training`), generous otherwise (the first step, or a pause announced)."""
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
