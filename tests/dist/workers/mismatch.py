"""With distributed.debug on, two ranks issuing different collectives get an error naming both ops."""

import sys

import torch
import torch.distributed as dist

from lingua.distributed import clean_up, setup_torch_distributed
from lingua.parallel.launch_plan import DistributedArgs
from lingua.logger import init_logger


def main(dump_dir: str) -> None:
    topo = setup_torch_distributed(DistributedArgs(debug=True, init_timeout_s=30), dump_dir=dump_dir)
    init_logger(topo.global_rank, topo.role)
    try:
        tensor = torch.ones(4)
        if topo.train_rank == 0:
            dist.all_reduce(tensor, group=topo.train_group)
        else:
            dist.broadcast(tensor, src=0, group=topo.train_group)
    finally:
        clean_up()


if __name__ == "__main__":
    from tests.dist.workers import run_worker

    run_worker(main, sys.argv[1])
