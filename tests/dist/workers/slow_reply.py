"""The teacher's clocks in a student's metrics come from the last completed response, never from a request
posted ahead whose reply is still on its way (on CUDA its buffer holds stale or uninitialised bytes until
the stream waits; on gloo the scatter has not written it yet).

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.slow_reply <teacher_dir>
The teacher holds its second reply back SLOW_S seconds. Each student posts two requests, waits for the first
and reads its metrics while the second is in flight: they must be the first response's status. Each rank
prints "SLOW REPLY OK" (and each student its count of requests left unwaited at exit, 0).
"""

import sys
import time

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import RECORD_BYTES, ResponseStatus
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.model import load_teacher
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.logger import init_logger
from lingua.parallel.launch_plan import DistributedArgs, TeacherLayout
from tests.dist.workers import handshaken_client, run_worker, say

SLOW_S = 3.0  # the second reply held back: far longer than a student takes from its first wait to its check
TEACHER_KEYS = ("kd/teacher_busy", "kd/teacher_busy_s", "kd/teacher_idle_s", "kd/teacher_peak_gib")


def serve_with_a_slow_second_reply(server: TeacherServer) -> None:
    reply = server._reply

    def reply_late_the_second_time(status):
        if server.requests == 1:  # the second request: handled, its answer held back
            time.sleep(SLOW_S)
        reply(status)

    server._reply = reply_late_the_second_time
    server.serve()


def teacher_metrics(status: ResponseStatus) -> dict:
    return {"kd/teacher_busy": status.busy_s / max(status.busy_s + status.idle_s, 1e-9),
            "kd/teacher_busy_s": status.busy_s, "kd/teacher_idle_s": status.idle_s,
            "kd/teacher_peak_gib": status.peak_bytes / 2**30}


def student(args: DistillationArgs, topo) -> None:
    _, tokenizer = load_teacher(args, topo.device)
    client = handshaken_client(args, topo, tokenizer.get_vocab(), len(tokenizer), max_bsz=2, max_seqlen=8)
    tokens = torch.randint(0, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(topo.train_rank))
    first = client.submit(tokens, step=1, micro_step=0)
    second = client.submit(tokens, step=2, micro_step=0)  # posted ahead, as look-ahead does
    first.wait()
    metrics = {key: client.metrics()[key] for key in TEACHER_KEYS}
    assert not second.works[1].is_completed(), "the second reply arrived early: the check below proves nothing"
    completed = ResponseStatus.unpack(first.response[:RECORD_BYTES])
    assert completed.ok and completed.busy_s > 0 and completed.idle_s > 0, completed
    assert metrics == teacher_metrics(completed), (metrics, completed)
    second.wait()
    later = ResponseStatus.unpack(second.response[:RECORD_BYTES])
    assert {key: client.metrics()[key] for key in TEACHER_KEYS} == teacher_metrics(later)
    assert later.busy_s > completed.busy_s, (later, completed)  # the teacher's clock moved between the two
    client.stop(step=3)
    assert client.report_exit() == 0


def main(teacher_dir: str) -> None:
    args = DistillationArgs(teacher_path=teacher_dir, k=5, teacher_dtype="fp32")
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=60), (TeacherLayout(1),))
    init_logger(topo.global_rank, topo.role)
    try:
        if topo.is_teacher:
            serve_with_a_slow_second_reply(TeacherServer(args, topo))
        else:
            student(args, topo)
        say(f"SLOW REPLY OK rank {topo.global_rank}")
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
