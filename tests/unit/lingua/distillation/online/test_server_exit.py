"""How a failing teacher leaves (issue 27 items 7 and 9), without processes: after its last reply it waits for
the device before raising (the abort that follows would cancel replies NCCL only queued), and a sticky CUDA
error leaves at once, with no reply (the context can run nothing more)."""

from types import SimpleNamespace

import pytest
import torch

import lingua.distillation.online.server as server_module
from lingua.distillation.online.bridge import Op, RequestHeader, ResponseStatus
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.online.serving_clock import ServingClock, TimeoutSwitch
from lingua.errors import is_sticky_device_error
from lingua.parallel.preemption import PreemptionFlag

CPU = torch.device("cpu")


def bare_server(events: list) -> TeacherServer:
    """A replica-less teacher's first rank with its collectives replaced by entries in `events`."""
    server = object.__new__(TeacherServer)
    server.topo = SimpleNamespace(device=CPU)
    server.link, server.replica_flags = None, None
    server.clock, server.preemption = ServingClock(CPU), PreemptionFlag()
    server._receive = lambda: events.append("receive")
    server._students = lambda: [(0, None), (1, None)]
    server._reply = lambda status: events.append(("reply", status.ok))
    return server


def test_the_errored_teacher_waits_for_its_last_replies_before_it_raises(monkeypatch):
    events = []
    monkeypatch.setattr(server_module, "synchronize", lambda device: events.append(("synchronize", device.type)))
    server = bare_server(events)
    # One more request answered with the error: the students' ERROR, after which they leave.
    server._headers = lambda students: {r: RequestHeader(Op.ERROR, 3, 0, 0, 0, r) for r, _ in students}
    status = ResponseStatus(ok=False, message="teacher failed serving step 3: boom")
    failure = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        try:
            server._serve_errored(status, {Op.FORWARD}, TimeoutSwitch(server.topo, None), failure)
        finally:
            events.append("clean_up aborts the process groups")
    assert events == ["receive", ("reply", False), ("synchronize", "cpu"), "clean_up aborts the process groups"]


@pytest.mark.parametrize("words, sticky", [
    ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported", True),
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA error: unspecified launch failure", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("CUDA error: out of memory", False),
    ("device-side assert triggered", False),  # not a CUDA error's words
])
def test_a_sticky_cuda_error_leaves_at_once_without_a_reply(words, sticky):
    err = torch.AcceleratorError(words) if words.startswith("CUDA error") else RuntimeError(words)
    assert is_sticky_device_error(err) == sticky
    events = []
    server = bare_server(events)

    def headers(students):
        raise err

    server._headers = headers
    switch = TimeoutSwitch(server.topo, None)
    if sticky:
        with pytest.raises(RuntimeError) as raised:
            server._handle(switch)
        assert raised.value is err and events == []
    else:  # answered: the students get the sentence in a failed status
        status, ops, failure = server._handle(switch)
        assert failure is err and not status.ok and words.split("\n")[0] in status.message
