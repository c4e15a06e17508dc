"""The micro-batches of each step, with their teacher requests submitted ahead of the compute.

    feed = MicroBatchFeed(loader, distiller, grad_acc_steps, last_step=last_step)  # look-ahead: distiller.prefetch
    micro_batches = feed.start_step(step)      # this step's micro-batches, all drawn (the loss needs their count)
    for mb in micro_batches:
        feed.submit_ahead(mb)                  # mb's request, and `prefetch` more (into the next step if needed)
        ... compute mb ...
    feed.finish_step(step)

With `prefetch=p` the teacher always holds the next p requests while the student computes the current micro-batch,
across step boundaries: its forward hides behind the student's whole step, not only the forward. A look-ahead batch
belongs to the next step: a checkpoint saves the loader's position after the last micro-batch of the finished step,
so a resume draws (and sends) exactly the batches that were not trained on. Nothing is drawn beyond `last_step`.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from lingua.parallel.host_copies import pin_tree


@dataclass(eq=False)  # identity: a batch holds tensors
class MicroBatch:
    step: int
    micro_step: int
    batch: dict  # host tensors, as the loader made them
    loader_state: dict  # the loader's state right after this batch
    pending: Any = None  # the distiller's request for this batch, once submitted
    submitted: bool = False


@dataclass
class MicroBatchFeed:
    loader: Any
    distiller: Any
    grad_acc_steps: int
    prefetch: Optional[int] = None  # None: the distiller's agreed look-ahead
    last_step: Optional[int] = None  # draw nothing for steps after this one
    pin_memory: bool = False  # page-locked batches: their copies to the GPU do not block the host
    next_step: int = 1  # the step start_step was last called for
    queue: deque = field(default_factory=deque)  # drawn, not yet trained on, in order
    consumed_state: Optional[dict] = None  # the loader state after the last micro-batch trained on

    def __post_init__(self):
        if self.prefetch is None:
            self.prefetch = self.distiller.prefetch

    def _draw(self) -> bool:
        """Draw the micro-batch after the queue's last (or after the consumed ones); False past last_step."""
        if self.queue:
            last = self.queue[-1]
            step, micro_step = (last.step, last.micro_step + 1) if last.micro_step + 1 < self.grad_acc_steps \
                else (last.step + 1, 0)
        else:
            step, micro_step = self.next_step, 0
        if self.last_step is not None and step > self.last_step:
            return False
        batch = next(self.loader)
        if self.pin_memory:  # every tensor in it, the teachers' targets of a cache too (TeacherOutputs, lists)
            batch = pin_tree(batch)
        self.queue.append(MicroBatch(step, micro_step, batch, self.loader.state_dict()))
        return True

    def start_step(self, step: int) -> list[MicroBatch]:
        """Every micro-batch of `step`, drawn (look-ahead may have drawn and submitted some already)."""
        self.next_step = step
        assert not self.queue or self.queue[0].step == step, "the feed's queue must start with this step"
        while sum(mb.step == step for mb in self.queue) < self.grad_acc_steps:
            self._draw()
        return [mb for mb in self.queue if mb.step == step]

    def submit_ahead(self, current: MicroBatch) -> None:
        """Submit `current` and the `prefetch` micro-batches after it (drawing them if needed)."""
        index = next(i for i, mb in enumerate(self.queue) if mb is current)
        while len(self.queue) < index + 1 + self.prefetch and self._draw():
            pass
        for mb in list(self.queue)[index: index + 1 + self.prefetch]:
            if not mb.submitted:
                mb.pending = self.distiller.submit(mb.batch, mb.step, mb.micro_step)
                mb.submitted = True

    def finish_step(self, step: int) -> None:
        """The step's micro-batches are trained on: forget them, remember the loader position after them."""
        while self.queue and self.queue[0].step == step:
            self.consumed_state = self.queue.popleft().loader_state

    def last_request_step(self) -> Optional[int]:
        """The step during which the launch's last request goes out (look-ahead sends it early: with `prefetch=p`
        request i goes out while micro-batch i - p is computed), or None without a last step."""
        if self.last_step is None:
            return None
        return self.last_step + 1 - -(-(self.prefetch + 1) // self.grad_acc_steps)

    def state_dict(self) -> dict:
        """The loader's position after the last micro-batch trained on (look-ahead batches excluded)."""
        return self.consumed_state if self.consumed_state is not None else self.loader.state_dict()
