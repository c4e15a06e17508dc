"""The side stream on the CPU: no side stream, posting is the caller's context, and consuming a request
waits for each of its collectives once (on gloo `wait()` is where the host blocks). What the side stream orders on
CUDA is checked on two GPUs (tests/gpu/test_gpu_bridge.py)."""

import torch

from lingua.parallel.side_stream import SideStream


class Work:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True


def test_on_the_cpu_the_bridge_posts_on_the_callers_stream_and_consume_waits_each_work_once():
    side = SideStream(torch.device("cpu"))
    assert side.stream is None
    with side.posting():
        buffer = torch.empty(8, dtype=torch.uint8)
    works = [Work(), Work()]
    side.consume(works, [buffer])
    assert [w.waits for w in works] == [1, 1]
