"""The trainer under torchrun on GPUs, its hot paths under `torch.cuda.set_sync_debug_mode("error")`: a host sync
raises with its line. Students: every step's micro-batches (`train_step`: data, teacher requests and waits,
forward, backward) and the optimizer step (clip, AdamW, schedule). Teacher ranks: what runs after its forward is
queued, per request (the head and its sparse outputs, a cross-tokenizer teacher's mapping to the students' ids,
the reply); the decoder itself runs under "warn" (transformers' causal-mask code reads position ids on the host,
tests/unit/test_host_sync.py's ALLOWED), so its warnings show in the rank's log without failing the check.

Run: torchrun --nproc-per-node <n> -m tests.gpu.workers.sync_debug <trainer overrides...>
Steps before FIRST_CHECKED_STEP (requests before FIRST_CHECKED_REQUEST) are let through: the first initialises
FSDP, compiles and meets each shape once, the second may recompile.
"""

import contextlib
import functools
import sys

import torch

from apps.main import train
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.model import TeacherModel

FIRST_CHECKED_STEP = 3
FIRST_CHECKED_REQUEST = 4
served = {"requests": 0}  # this teacher rank's requests so far (every rank of a replica forwards each)


@contextlib.contextmanager
def sync_debug(mode: str, on: bool = True):
    """`mode` inside when `on`; the mode before it after (the checks nest)."""
    if not on:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def checked_from_step(function):
    """A student's per-step function, checked from FIRST_CHECKED_STEP (the step train_step last saw)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with sync_debug("error", checked_steps["now"] >= FIRST_CHECKED_STEP):
            return function(*args, **kwargs)
    return wrapper


checked_steps = {"now": 0}


def checked_per_request(function, mode: str = "error"):
    """A teacher's per-request function, checked from FIRST_CHECKED_REQUEST."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with sync_debug(mode, served["requests"] >= FIRST_CHECKED_REQUEST):
            return function(*args, **kwargs)
    return wrapper


def counting_requests(function):
    """The teacher's `_forward`, counting the requests it served."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        served["requests"] += 1
        return function(*args, **kwargs)
    return wrapper


def main(overrides: list[str]) -> None:
    train_step = train.train_step

    def train_step_checked(args, model, distiller, feed, step, *rest):
        checked_steps["now"] = step
        with sync_debug("error", step >= FIRST_CHECKED_STEP):
            return train_step(args, model, distiller, feed, step, *rest)
    train.train_step = train_step_checked
    train.optimizer_step = checked_from_step(train.optimizer_step)
    # Teacher ranks: the request count moves with each forward; what follows the decoder must not sync.
    TeacherServer._forward = counting_requests(TeacherServer._forward)
    TeacherModel.hidden_states = checked_per_request(TeacherModel.hidden_states, mode="warn")
    TeacherModel.sparse_outputs = checked_per_request(TeacherModel.sparse_outputs)
    TeacherServer._reply = checked_per_request(TeacherServer._reply)
    from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher
    CrossTokenizerTeacher.student_targets = checked_per_request(CrossTokenizerTeacher.student_targets)
    train.main(overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
