"""The switch to the training timeout really shortens the wait for a missing peer, with and without
the debug switch (under DETAIL torch wraps each backend and adds a gloo check group of its own, whose
monitored barrier is where a missing peer is noticed: both must switch).

Run: torchrun --nproc-per-node 2 -m tests.dist.workers.timeout_switch <dump_dir> <debug: true|false>
Both ranks start under a 60 s timeout and switch to TRAIN_TIMEOUT_S; then rank 1 stalls for STALL_S
while rank 0 enters an all_reduce, which must fail after about TRAIN_TIMEOUT_S, long before the stall ends.
"""

import sys
import time

import torch
import torch.distributed as dist

from lingua.distributed import clean_up, setup_torch_distributed
from lingua.parallel.launch_plan import DistributedArgs
from lingua.parallel.timeouts import enter_training_timeout
from lingua.logger import init_logger
from tests.dist.workers import run_worker, say

TRAIN_TIMEOUT_S, STALL_S = 3, 40



def main(dump_dir: str, debug: bool) -> None:
    topo = setup_torch_distributed(DistributedArgs(debug=debug, init_timeout_s=60), dump_dir=dump_dir)
    init_logger(topo.global_rank, topo.role)
    try:
        enter_training_timeout(topo, TRAIN_TIMEOUT_S)
        if topo.global_rank == 1:
            time.sleep(STALL_S)  # torchrun ends this rank once rank 0 fails
            return
        start = time.time()
        try:
            dist.all_reduce(torch.ones(1), group=topo.train_group)
        except Exception as err:
            message = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
            say(f"TIMED OUT after {time.time() - start:.1f}s: {message[:2000]}")
            sys.exit(3)
        say(f"all_reduce returned after {time.time() - start:.1f}s")
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, sys.argv[1], sys.argv[2] == "true")
