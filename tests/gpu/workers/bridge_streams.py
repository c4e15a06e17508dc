"""The bridge on NCCL (two GPUs: a student and its teacher): what the side stream orders, measured.

Run: torchrun --nproc-per-node 2 -m tests.gpu.workers.bridge_streams <teacher_dir> <mode> [<out_dir>]
  ahead   a request posted while the student's compute stream holds a long kernel is answered before that kernel
          ends; then the teacher wait over the same micro-batches at prefetch 0, 1 and 2 (the teacher's forward
          TEACHER_MS, the student's compute COMPUTE_MS per micro-batch), one "WAIT prefetch=p ..." line each
  drain   requests the teacher answers slowly, drain() (the host does not wait), then a save of their buffers
          (torch.save, reading the device): every reply is there, each its own (the teacher's clock grows)
Each rank prints "BRIDGE STREAMS OK <mode> rank <r>".
"""

import sys
import time
from pathlib import Path

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import RECORD_BYTES, ResponseStatus
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.model import load_teacher
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.logger import init_logger
from lingua.parallel.launch_plan import DistributedArgs
from tests.dist.workers import run_worker, say

HOLD_MS = 3000  # the compute kernel a request is posted behind: far longer than a round trip
TEACHER_MS, COMPUTE_MS, MICRO_BATCHES = 40, 80, 12  # look-ahead hides the teacher behind the student's compute
SLOW_REPLY_MS = 300  # drain mode: each reply held this long on the teacher's GPU


def cycles_per_ms() -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def gpu_busy(ms: float, rate: float) -> None:
    torch.cuda._sleep(int(ms * rate))


def teacher(args: DistillationArgs, topo, mode: str) -> None:
    server = TeacherServer(args, topo)
    rate = cycles_per_ms()
    forward = server._forward

    def slow_forward(students, headers):  # queued on the teacher's GPU before its outputs: the reply waits for it
        gpu_busy(SLOW_REPLY_MS if mode == "drain" else TEACHER_MS, rate)
        forward(students, headers)

    server._forward = slow_forward
    server.serve()


def tokens_for(n_words: int, seed: int) -> torch.Tensor:
    return torch.randint(0, n_words, (2, 16), generator=torch.Generator().manual_seed(seed))


def posted_ahead(client: TeacherClient, n_words: int, rate: float) -> None:
    hold_end = torch.cuda.Event()
    gpu_busy(HOLD_MS, rate)
    hold_end.record()
    posted = time.perf_counter()
    handle = client.submit(tokens_for(n_words, 0), step=1, micro_step=0)
    while not handle.works[1].is_completed() and not hold_end.query():
        time.sleep(0.001)
    answered_in = time.perf_counter() - posted
    assert handle.works[1].is_completed() and not hold_end.query(), (
        f"the reply came only after the compute stream's {HOLD_MS} ms kernel ended ({answered_in:.3f} s): the request "
        "waited for the queued compute")
    say(f"AHEAD answered in {answered_in * 1e3:.0f} ms while a {HOLD_MS} ms kernel held the compute stream")
    handle.wait()
    torch.cuda.synchronize()


def teacher_wait(client: TeacherClient, n_words: int, rate: float, prefetch: int, first_step: int) -> float:
    """MICRO_BATCHES micro-batches as the loop runs them (post `prefetch` ahead, wait, compute): the wait clock's
    seconds."""
    client.wait_clock.new_step()
    handles, checksum = [], torch.zeros((), device=client.device)
    for n in range(MICRO_BATCHES):
        while len(handles) < min(MICRO_BATCHES, n + 1 + prefetch):
            handles.append(client.submit(tokens_for(n_words, len(handles)), step=first_step + len(handles),
                                         micro_step=0))
        outputs = handles[n].wait()
        gpu_busy(COMPUTE_MS, rate)
        checksum += outputs.values.float().sum()  # the compute stream reads each reply
    waited = client.wait_clock.read_step()
    assert torch.isfinite(checksum)
    return waited


def student(args: DistillationArgs, topo, mode: str, out_dir: str) -> None:
    _, tokenizer = load_teacher(args, topo.device)
    n_words = len(tokenizer)
    client = TeacherClient(args, topo, tokenizer.get_vocab(), n_words, max_bsz=2, max_seqlen=16)
    rate = cycles_per_ms()
    step = 1
    if mode == "ahead":
        posted_ahead(client, n_words, rate)
        step = 2
        for prefetch in (0, 1, 2):
            waited = teacher_wait(client, n_words, rate, prefetch, step)
            step += MICRO_BATCHES
            say(f"WAIT prefetch={prefetch} teacher_wait_s={waited:.3f} over {MICRO_BATCHES} micro-batches "
                f"(teacher {TEACHER_MS} ms, compute {COMPUTE_MS} ms each)")
    else:
        handles = [client.submit(tokens_for(n_words, 7), step=step + i, micro_step=0) for i in range(4)]
        client.drain()  # orders the compute stream after every reply; the host goes on at once
        assert not handles[-1].works[1].is_completed(), "the last reply arrived before drain() returned: proves nothing"
        path = Path(out_dir) / "replies.pt"
        torch.save([h.response for h in handles], path)  # reads the device on the compute stream
        saved = torch.load(path)
        statuses = [ResponseStatus.unpack(buf[:RECORD_BYTES]) for buf in saved]
        assert all(s.ok for s in statuses), statuses
        busy = [s.busy_s for s in statuses]
        assert busy == sorted(busy) and len(set(busy)) == len(busy) and busy[0] > 0, busy  # each its own reply
        assert all(torch.equal(buf[RECORD_BYTES:], saved[0][RECORD_BYTES:]) for buf in saved), "payloads differ"
        say(f"DRAIN saved {len(saved)} replies, teacher busy {busy}")
        step += 4
    client.stop(step)
    assert client.report_exit() == 0


def main(teacher_dir: str, mode: str, out_dir: str = ".") -> None:
    args = DistillationArgs(teacher_path=teacher_dir, k=5, teacher_dtype="fp32")
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=120, backend="nccl"), n_teachers=1)
    init_logger(topo.global_rank, topo.role)
    try:
        if topo.is_teacher:
            teacher(args, topo, mode)
        else:
            student(args, topo, mode, out_dir)
        say(f"BRIDGE STREAMS OK {mode} rank {topo.global_rank}")
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, *sys.argv[1:])
