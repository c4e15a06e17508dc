"""One rank's life in a launch, from the dump dir's ownership to the process groups' teardown.

    launch = read_launch_env()
    args.validate(launch.world_size, launch.local_world_size)   # every config error, before any process group
    with launched_rank(args.dump_dir, args.distributed, launch, teachers) as (topo, phases, preemption):
        ...the rank's work (apps/main/train.py: train() or distillation_process())...

In order: signals only set the preemption flag; the dump dir is taken (or refused); the process groups and the
`Topology`; the rank's log; its status file and watch thread (a rank that fails leaves a note, one that loses a
peer names the rank that stopped); the previous generation's crash agreed on (or the crash loop's sentence); the
setup's startup spans; the rank/device table. On the way out every rank meets the others in a last barrier, and
any exit (an error too) leaves torch.distributed and releases the dump dir; a run stopped early that nothing
requeues then ends non-zero with one sentence.
"""

import contextlib
from typing import Iterator, Optional

import torch

from lingua.distributed import Topology, clean_up, log_rank_device_map, setup_torch_distributed
from lingua.logger import init_logger
from lingua.parallel.launch_plan import DistributedArgs, LaunchEnv
from lingua.parallel.preemption import PreemptionFlag
from lingua.parallel.rank_status import RankStatus
from lingua.parallel.recovery import agree_on_recovery
from lingua.parallel.watch import RankWatch
from lingua.run.dump_dir import RunDir
from lingua.run.owner import DumpDirOwner
from lingua.timing import PhaseLog


@contextlib.contextmanager
def launched_rank(dump_dir: str, distributed: DistributedArgs, launch: LaunchEnv, teachers,
                  console: str = "brief") -> Iterator[tuple[Topology, PhaseLog, PreemptionFlag]]:
    """This rank's topology, startup log and preemption flag, for the launch's teachers (one `TeacherLayout` each);
    `console`: logging.console (what the terminal shows; the rank's log file gets every line)."""
    preemption = PreemptionFlag()  # from here on: handlers only set a flag, students agree on it each step
    # Or refuse (the dump dir is in use), then check for a SIGTERM held while we checked: another rank failed.
    owner = DumpDirOwner(dump_dir, launch, distributed.init_timeout_s).take()
    failure: Optional[BaseException] = None  # an exceptional exit aborts the process groups (clean_up)
    try:
        topo = setup_torch_distributed(distributed, teachers, dump_dir)
        init_logger(topo.global_rank, topo.role, str(RunDir(dump_dir).rank_log(topo.global_rank)), console=console)
        # From here a rank that fails leaves a note, and one that loses a peer names the rank that stopped.
        with (RankStatus(dump_dir, topo, debug=distributed.debug_mode) as status,
              RankWatch(topo, dump_dir, status, traces=distributed.traces, owner=owner)):
            topo.recovered = agree_on_recovery(topo, dump_dir)  # or stop: the same step crashed again and again
            phases = PhaseLog(dump_dir, topo.global_rank, topo.role)
            for phase, (phase_start, phase_end) in topo.setup_spans.items():  # process_group_init, mesh
                phases.record(phase, phase_start, phase_end)
            log_rank_device_map(topo)
            yield topo, phases, preemption
            preemption.ignore_further()
            if topo.distributed:
                torch.distributed.barrier(group=torch.distributed.group.WORLD)  # everyone ends together
    except BaseException as err:
        failure = err
        raise
    finally:
        preemption.ignore_further()  # a launcher's SIGTERM while we leave would only cut the exit short
        clean_up(failure)
        owner.release()
    preemption.end()  # stopped early with nothing to requeue it: one sentence, a non-zero exit (a restart resumes)
