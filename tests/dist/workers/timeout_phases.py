"""Two-phase timeouts on the bridge: the teacher keeps the generous timeout through the students' whole
first step (a slow first forward/backward, compile, optimizer, save), and switches to the short one
only when a request sent after it arrives (marked in_training: with look-ahead, a request of the next
step can arrive while the first step is still running).

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.timeout_phases <teacher_dir>
The students resume at step 5, send step 6's first request as look-ahead right away (as prefetch=1
does), spend SLOW_S between the micro-batches of that first step and again before the rest of step 6
-- the teacher, which has answered all three requests, waits through both: 2 x SLOW_S, longer than the
TRAIN_TIMEOUT_S it switches to -- then send step 6 promptly; step 7's request announces a pause (an
in-process checkpoint evaluation) of PAUSE_S, longer than TRAIN_TIMEOUT_S on its own, step 8's does not,
then STOP.
"""

import sys
import time

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.parallel.launch_plan import DistributedArgs, TeacherLayout
from lingua.distillation.teacher.model import load_teacher
from lingua.distillation.online.server import TeacherServer
from lingua.logger import init_logger
from tests.dist.workers import handshaken_client, run_worker, say

INIT_TIMEOUT_S, TRAIN_TIMEOUT_S, SLOW_S, PAUSE_S = 60, 4, 3, 5
FIRST_STEP = 5



def main(teacher_dir: str) -> None:
    args = DistillationArgs(teacher_path=teacher_dir, k=4, teacher_dtype="fp32")
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=INIT_TIMEOUT_S), (TeacherLayout(1),))
    init_logger(topo.global_rank, topo.role)
    try:
        if topo.is_teacher:
            TeacherServer(args, topo).serve(timeouts=(INIT_TIMEOUT_S, TRAIN_TIMEOUT_S))
            say(f"PHASES OK rank {topo.global_rank}")
            return
        _, tokenizer = load_teacher(args, topo.device)
        client = handshaken_client(args, topo, tokenizer.get_vocab(), len(tokenizer), max_bsz=2, max_seqlen=8)
        tokens = torch.randint(0, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(topo.train_rank))
        # The first step of this launch: two micro-batches with slow work after each (first-step compile, save),
        # and the next step's first request already in flight (look-ahead).
        first = [client.submit(tokens, step=FIRST_STEP, micro_step=m) for m in range(2)]
        look_ahead = client.submit(tokens, step=FIRST_STEP + 1, micro_step=0)
        for micro_step, handle in enumerate(first):
            handle.wait()
            say(f"step {FIRST_STEP}.{micro_step} served on rank {topo.global_rank}; working {SLOW_S}s")
            time.sleep(SLOW_S)
        say(f"step {FIRST_STEP} finished on rank {topo.global_rank}")
        client.mark_first_step_done()
        look_ahead.wait()
        client.submit(tokens, step=FIRST_STEP + 1, micro_step=1).wait()
        # A step followed by an in-process checkpoint evaluation: its request announces the pause, the teacher
        # waits across it under the generous timeout, and goes back to the short one with the next request.
        client.announce_pause(True)
        client.submit(tokens, step=FIRST_STEP + 2, micro_step=0).wait()
        say(f"step {FIRST_STEP + 2} evaluating on rank {topo.global_rank}; {PAUSE_S}s")
        time.sleep(PAUSE_S)
        client.announce_pause(False)
        client.submit(tokens, step=FIRST_STEP + 3, micro_step=0).wait()
        client.stop(step=FIRST_STEP + 4)
        say(f"PHASES OK rank {topo.global_rank}")
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
