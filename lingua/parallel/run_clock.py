"""The students' clock around each training step: the step's timer, the timeout in force, the hang watch.

    clock = RunClock(args.distributed, topo, phases, args.dump_dir, first_step=state.step + 1)
    with clock:                               # the hang watch is cancelled on the way out
        clock.start(micro_batches_per_step=args.grad_acc_steps)
        while ...:
            with clock.step(step):            # timer reset, hang watch armed, the first step's span
                ...forward, backward, optimizer...
            flags = distiller.agree(...)      # the step's one agreed control point
            clock.after_agreement(step)       # the first step's spans, then the training timeout

The launch's first step runs under the generous `distributed.init_timeout_s` (loading, compiling and the first
teacher exchange happen in it); once every student has agreed on it, every group switches to
`distributed.train_timeout_s` (`timeouts.enter_training_timeout`) and rank 0 prints the startup table.
"""

import contextlib
import logging
import time

from lingua.logger import STARTUP_DETAIL
from lingua.parallel.collectives import agree_count
from lingua.parallel.timeouts import HangWatch, enter_training_timeout
from lingua.timing import PhaseLog, StepTimer, phase_table

logger = logging.getLogger(__name__)


class RunClock:
    """Owns the step timer, the hang watch and the two-phase timeout; the loop calls `step` and `after_agreement`."""

    def __init__(self, distributed, topo, phases: PhaseLog, dump_dir: str, first_step: int):
        self.init_timeout_s, self.train_timeout_s = distributed.init_timeout_s, distributed.train_timeout_s
        self.compile = distributed.compile
        self.topo, self.phases, self.dump_dir = topo, phases, dump_dir
        self.first_step = first_step
        self.timer = StepTimer(topo.device)
        self.hang_watch = HangWatch()
        self.step_start = time.perf_counter()

    @property
    def collective_timeout_s(self) -> float:
        """The timeout in force on this rank's groups now: generous until the first step was agreed."""
        return self.init_timeout_s if self.first_step is not None else self.train_timeout_s

    def step_seconds(self) -> float:
        """Seconds since this step began (a save after it is not part of the step's time and tokens/s)."""
        return time.perf_counter() - self.step_start

    @contextlib.contextmanager
    def step(self, step: int):
        """Around a step's forward, backward and optimizer step: the timer restarts, the hang watch is armed for the
        timeout in force, and the launch's first step is recorded as a startup span."""
        self.timer.reset()
        self.step_start = time.perf_counter()
        self.hang_watch.arm(self.collective_timeout_s, step=step)
        with self.phases.span("first_step") if step == self.first_step else contextlib.nullcontext():
            yield

    def after_agreement(self, step: int) -> None:
        """After the step's agreed control point (where the distiller recorded the first teacher round trip and
        told the teachers): every student is past it; after the first step, record its spans, shorten the
        timeouts and print the startup table."""
        self.timer.common_point()
        if step != self.first_step:
            return
        if self.compile:  # torch.compile runs inside the first forward/backward
            self.phases.record("compile_warmup", time.time() - self.timer.read()["fwd_bwd"], time.time())
        enter_training_timeout(self.topo, self.train_timeout_s)
        self.first_step = None
        if self.topo.is_train_master:  # every rank's spans are on disk by now (teacher's too)
            table = phase_table(self.dump_dir, world_size=self.topo.world_size)
            logger.info("startup phases (all ranks)\n" + table, extra=STARTUP_DETAIL)

    def start(self, micro_batches_per_step: int) -> None:
        """The loop's start, where every student meets the others: they agree on the loop's length (micro-batches per
        step is also each teacher's request count), and the first step's waits are measured from here."""
        agree_count(micro_batches_per_step, self.topo.train_group, self.topo.device,
                    "micro-batches per step (grad_acc_steps)", mode="equal")
        self.timer.common_point()

    def __enter__(self) -> "RunClock":
        return self

    def __exit__(self, *exc) -> None:
        self.hang_watch.__exit__(*exc)
