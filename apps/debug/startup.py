"""Startup diagnostics: where do the minutes before the first training step go?

    torchrun --nproc-per-node 3 -m apps.debug.startup phase=1 config=configs/distill_exps/debug_cpu.yaml
    srun python -m apps.debug.startup phase=3 config=configs/llama_1B.yaml dump_dir=/scratch/diag

Each phase adds one layer of the real startup to the previous one. Run them in order: the first
phase that is slow names the culprit.

  1  bare torch.distributed.init_process_group, one all_reduce and one barrier on the world group
  2  our setup_torch_distributed (groups, mesh), the rank map, the first collective on every group
  3  + tokenizer, student model build + FSDP; teacher load + handshake (with distillation on)
  4  + data loader and the first batch
  5  + optimizer, checkpoint load and one training step (with the teacher), as apps.main.train does

Every rank writes its spans to <dump_dir>/startup_diag/startup.<rank>.jsonl and logs them; after a
final barrier rank 0 prints min / max / slowest rank per span. Nothing else of the run is touched:
no checkpoint is saved, no metrics or config are written. Students end by sending STOP, so the
teacher exits cleanly.
"""

import time

# Taken before torch is imported: on a shared filesystem the imports alone can take minutes.
IMPORT_START = time.time()

if __name__ == "__main__":  # before the slow imports, as in apps.main.train
    from lingua.cli.entry import hold_sigterm

    hold_sigterm()

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from apps.main.train import TrainArgs, distillation_process, init_tokenizer, optimizer_step, train_step
from apps.main.transformer import build_model
from lingua.args import parse_args, require
from lingua.cli.entry import release_sigterm, run_cli
from lingua.data import DataLoader
from lingua.distillation.build import build_distiller, launch_teachers
from lingua.distillation.micro_batches import MicroBatchFeed
from lingua.distributed import (
    Topology,
    choose_device,
    clean_up,
    init_method_for,
    log_rank_device_map,
    setup_torch_distributed,
)
from lingua.logger import init_logger
from lingua.optim import build_optimizer
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, read_launch_env
from lingua.parallel.preemption import PreemptionFlag
from lingua.run.resume_fit import restore_checkpoint
from lingua.timing import PhaseLog, StepTimer, phase_table

logger = logging.getLogger("startup")

PHASES = {
    1: "bare init_process_group + all_reduce + barrier on the world group",
    2: "setup_torch_distributed (groups, mesh) + rank map + first collective per group",
    3: "phase 2 + tokenizer, student model build, teacher load and handshake",
    4: "phase 3 + data loader and first batch",
    5: "phase 4 + optimizer, checkpoint load and one training step",
}


@dataclass
class StartupArgs(TrainArgs):
    phase: int = 5  # 1..5, see PHASES; the rest is the training config, unchanged

    def validate(self, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> None:
        require(self.phase in PHASES, "phase", self.phase, "not a startup phase; pass phase=1..5: " + "; ".join(
            f"{n} = {what}" for n, what in PHASES.items()))
        super().validate(world_size, local_world_size)


# ---------------------------------------------------------------- phase 1

def bare_init(args: DistributedArgs, launch, phases: PhaseLog) -> None:
    """torch.distributed alone, as the launcher describes the job: no groups, no mesh, no debug env."""
    device, backend = choose_device(args, launch.local_rank, launch.local_world_size)
    init_kwargs = dict(backend=backend, init_method=init_method_for(launch), rank=launch.rank,
                       world_size=launch.world_size, timeout=timedelta(seconds=args.init_timeout_s))
    if backend == "nccl":
        torch.cuda.set_device(device)
        init_kwargs["device_id"] = device
    with phases.span("init_process_group"):
        dist.init_process_group(**init_kwargs)
    world = dist.group.WORLD
    with phases.span("all_reduce.world"):
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones, group=world)
        total = ones.item()  # waits for the result, so the span covers the collective itself
    if total != launch.world_size:
        raise RuntimeError(f"all_reduce of ones over the world gave {total}, expected {launch.world_size}")
    with phases.span("barrier.world"):
        dist.barrier(group=world)


# ---------------------------------------------------------------- phase 2

def first_collectives(topo: Topology, phases: PhaseLog) -> None:
    """One all_reduce on the world, then one barrier on each of this rank's groups (its first use).

    Every rank walks its groups in the same order (world, train or teachers, bridge, mesh dims), so
    no two ranks wait on each other in opposite orders.
    """
    with phases.span("all_reduce.world"):
        ones = torch.ones(1, device=topo.device)
        dist.all_reduce(ones, group=dist.group.WORLD)
        ones.item()
    for group in topo.all_groups():
        with phases.span(f"barrier.{topo.group_name(group)}"):
            dist.barrier(group=group)


# ---------------------------------------------------------------- phases 3-5, student side

def student_startup(args: TrainArgs, topo: Topology, phases: PhaseLog, phase: int) -> None:
    """train()'s startup, in its order, up to `phase`; then STOP to the teacher."""
    with phases.span("tokenizer_init"):
        tokenizer = init_tokenizer(args)
    with phases.span("model_build"):
        model = build_model(args.model, args.distributed, topo)
    distiller, cache = build_distiller(args.enable_distillation, args.distillation, topo, tokenizer, args.data,
                                       args.model.attn_mask, phases)
    saved, step, loader = None, 0, None
    try:
        if phase >= 5:
            with phases.span("optimizer_build"):
                optimizer, scheduler = build_optimizer(model, args.optim, args.steps)
            with phases.span("checkpoint_load"):
                _, saved = restore_checkpoint(args, topo, model, optimizer)
            if saved is not None:
                step = saved["step"]
                scheduler.load_state_dict(saved["scheduler"])
        if phase >= 4:
            with phases.span("data_init"):
                loader = cache or DataLoader(args.data, tokenizer, topo.train_rank, topo.train_world_size)
                if saved is not None:
                    loader.load_state_dict(saved["data"])
            # One step's micro-batches, drawn as the trainer's feed draws them (no look-ahead beyond the step).
            feed = MicroBatchFeed(loader, distiller, args.grad_acc_steps, 0, last_step=step + 1)
            with phases.span("first_batch"):
                feed.start_step(step + 1)
        if phase >= 5:
            step += 1
            with phases.span("first_step"):
                timer = StepTimer(topo.device)
                train_step(args, model, distiller, feed, step, timer, topo.device,
                           scheduler.get_last_lr()[0] / args.optim.lr)  # the batches drawn in phase 4
                optimizer_step(model, optimizer, scheduler, args.optim.clip, timer)
            if distiller.first_round_trip is not None:
                phases.record("first_teacher_round_trip", *distiller.first_round_trip)
        distiller.stop(step)
    finally:
        if loader is not None:
            loader.close()


# ---------------------------------------------------------------- driver

def print_report(phases: PhaseLog, rank: int, world_size: int, out_dir: Path, phase: int) -> None:
    """This rank's spans in one line; rank 0 adds the table of this launch's ranks (not stale higher ranks)."""
    logger.info(f"phase {phase} timings: " + ", ".join(f"{name} {s:.2f}s" for name, s in phases.durations.items()))
    if rank != 0:
        return
    logger.info(f"startup phase {phase} ({PHASES[phase]}), all ranks; per-rank spans in "
                f"{out_dir}/startup.<rank>.jsonl\n" + phase_table(str(out_dir), world_size=world_size))


def main(argv: Optional[list[str]] = None) -> None:
    main_start = time.time()
    args = parse_args(StartupArgs, argv)
    # Rank and role before any process group, so phase 1 logs and records like the others.
    launch = read_launch_env()
    args.validate(launch.world_size, launch.local_world_size)  # the trainer's own pass
    release_sigterm()
    teachers = launch_teachers(args.enable_distillation, args.distillation)
    plan = LaunchPlan.for_launch(args.distributed, launch.world_size, launch.local_world_size, teachers)
    role = plan.role(launch.rank)
    out_dir = Path(args.dump_dir) / "startup_diag"
    init_logger(launch.rank, role, str(out_dir / "logs" / f"rank_{launch.rank}.log"))
    phases = PhaseLog(str(out_dir), launch.rank, role)
    phases.record("imports", IMPORT_START, main_start)
    logger.info(f"startup phase {args.phase}: {PHASES[args.phase]}")
    failure: Optional[BaseException] = None  # an exceptional exit aborts the process groups (clean_up)
    try:
        if args.phase == 1:
            bare_init(args.distributed, launch, phases)
        else:
            with phases.span("setup_torch_distributed"):
                topo = setup_torch_distributed(args.distributed, teachers, args.dump_dir)
            with phases.span("rank_map"):
                log_rank_device_map(topo)
            first_collectives(topo, phases)
            if args.phase >= 3:
                torch.manual_seed(args.seed)
                if topo.is_teacher:
                    # Load, handshake, serve until the students' STOP; a signal only sets the flag, as in training.
                    distillation_process(args, topo, phases, PreemptionFlag())
                else:
                    student_startup(args, topo, phases, args.phase)
        dist.barrier(group=dist.group.WORLD)  # every rank's file is complete before rank 0 reads them
        print_report(phases, launch.rank, launch.world_size, out_dir, args.phase)
    except BaseException as err:
        failure = err
        raise
    finally:
        clean_up(failure)


if __name__ == "__main__":
    run_cli(main)
