"""The bridge's traffic on NCCL, off the compute stream (docs/distillation_internals.md#what-nccl-orders): a request
posted while the student's GPU is busy leaves at once, the teacher wait at prefetch 0, 1 and 2 (measured, printed in
the self-check's log), and a save after drain() that finds every reply although the host never waited for them.
Marked `cuda` (two GPUs: a student and its teacher) and `slow` (they launch torchrun); the worker is
tests/gpu/workers/bridge_streams.py."""

import re

import pytest

from tests.gpu.gpus import needs_gpus
from tests.runs import assert_ok, torchrun

MODULE = "tests.gpu.workers.bridge_streams"


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(300)
def test_a_request_posted_ahead_leaves_before_the_queued_compute_and_look_ahead_hides_the_teacher(tiny_teacher):
    """A request posted behind a 3 s kernel on the compute stream is answered before it ends; then the teacher wait
    over 12 micro-batches (teacher 40 ms, compute 80 ms each) at prefetch 0, 1 and 2: a look-ahead that hides less
    than half of prefetch 0's wait is not pipelining at all."""
    result = torchrun(2, [str(tiny_teacher), "ahead"], timeout=240, module=MODULE)
    assert_ok(result)
    assert result.stdout.count("BRIDGE STREAMS OK ahead") == 2, result.stdout[-4000:]
    assert "AHEAD answered in" in result.stdout
    waits = {int(p): float(s) for p, s in re.findall(r"WAIT prefetch=(\d) teacher_wait_s=([\d.]+)", result.stdout)}
    print("teacher wait (s) by prefetch:", waits)  # the measurement, in the self-check's log of this check
    assert sorted(waits) == [0, 1, 2], result.stdout[-4000:]
    assert waits[0] > 0.2, waits  # 12 waits for a 40 ms forward: the measurement itself works
    assert waits[1] < waits[0] / 2 and waits[2] < waits[0] / 2, waits


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(300)
def test_a_save_after_drain_finds_every_reply(tiny_teacher, tmp_path):
    """Four requests the teacher answers 300 ms apart, drain() (which returns before the last reply arrived), then
    torch.save of their buffers: every reply is in the file, each its own (the teacher's busy clock grows)."""
    result = torchrun(2, [str(tiny_teacher), "drain", str(tmp_path)], timeout=240, module=MODULE)
    assert_ok(result)
    assert result.stdout.count("BRIDGE STREAMS OK drain") == 2, result.stdout[-4000:]
    assert "DRAIN saved 4 replies" in result.stdout
    assert (tmp_path / "replies.pt").is_file()
