"""MicroBatchFeed: which micro-batches are drawn and submitted when, and what a checkpoint would save."""

import pytest

from lingua.distillation.micro_batches import MicroBatchFeed


class CountingLoader:
    """Batches numbered 0, 1, 2, ...; its state is the number handed out."""

    def __init__(self):
        self.drawn = 0

    def __next__(self):
        self.drawn += 1
        return {"n": self.drawn - 1}

    def state_dict(self):
        return {"drawn": self.drawn}


class RecordingDistiller:
    def __init__(self):
        self.submitted = []

    def submit(self, batch, step, micro_step):
        self.submitted.append((step, micro_step, batch["n"]))
        return f"request {step}.{micro_step}"


def run(grad_acc: int, prefetch: int, steps: int, last_step=None):
    loader, distiller = CountingLoader(), RecordingDistiller()
    feed = MicroBatchFeed(loader, distiller, grad_acc, prefetch, last_step)
    trace = []  # (step, micro_step, batch number, requests submitted before computing it, state after the step)
    for step in range(1, steps + 1):
        for mb in feed.start_step(step):
            feed.submit_ahead(mb)
            assert mb.pending == f"request {mb.step}.{mb.micro_step}"
            trace.append((mb.step, mb.micro_step, mb.batch["n"], len(distiller.submitted)))
        feed.finish_step(step)
        trace.append(("saved", feed.state_dict()["drawn"]))
    return trace, distiller.submitted


def test_without_prefetch_each_request_goes_right_before_its_micro_batch():
    trace, submitted = run(grad_acc=2, prefetch=0, steps=2)
    assert trace == [(1, 0, 0, 1), (1, 1, 1, 2), ("saved", 2), (2, 0, 2, 3), (2, 1, 3, 4), ("saved", 4)]
    assert submitted == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3)]


def test_prefetch_keeps_requests_ahead_across_steps_and_saves_the_consumed_position():
    trace, submitted = run(grad_acc=2, prefetch=1, steps=2)
    # Computing (1,1) the teacher already has (2,0); the checkpoint of step 1 is after batch 1, not the look-ahead.
    assert trace == [(1, 0, 0, 2), (1, 1, 1, 3), ("saved", 2), (2, 0, 2, 4), (2, 1, 3, 5), ("saved", 4)]
    assert submitted[:4] == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3)]  # same batches, same order
    trace, _ = run(grad_acc=1, prefetch=2, steps=3)
    assert [t[3] for t in trace if t[0] != "saved"] == [3, 4, 5]


def test_nothing_is_drawn_or_sent_past_the_last_step():
    trace, submitted = run(grad_acc=2, prefetch=2, steps=3, last_step=3)
    assert len(submitted) == 6 and submitted[-1] == (3, 1, 5)
    assert trace[-1] == ("saved", 6)


@pytest.mark.parametrize("grad_acc,prefetch", [(1, 0), (1, 1), (3, 1), (2, 2)])
def test_the_stream_does_not_depend_on_prefetch(grad_acc, prefetch):
    """Same batch numbers at the same (step, micro_step), and the same saved positions, whatever the look-ahead."""
    plain, _ = run(grad_acc, 0, steps=4, last_step=4)
    ahead, _ = run(grad_acc, prefetch, steps=4, last_step=4)
    strip = [t[:3] for t in plain]
    assert [t[:3] for t in ahead] == strip
