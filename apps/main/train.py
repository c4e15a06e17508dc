"""Pretraining with optional online distillation.

    torchrun --nproc-per-node 2 -m apps.main.train config=configs/debug_cpu.yaml
    torchrun --nproc-per-node 8 -m apps.main.train config=configs/distill_exps/debug.yaml

Students run `train()`; teacher ranks run `distillation_process()`, each with what `launched_rank` gives the rank:
`topo` (its `lingua.distributed.Topology`), `phases` (the startup `PhaseLog`) and `preemption` (the
`PreemptionFlag` that signals set). Everything distributed goes through `topo`, and every collective names its group:
the training group for anything the students do together, a bridge group for teacher traffic.
The loop asks one Distiller (lingua.distillation.distiller) for the KD part of each step, whatever its kind.
`TrainArgs.validate()` checks the whole config before any process group exists.
"""

if __name__ == "__main__":  # first, before the slow imports: see hold_sigterm
    from lingua.cli.entry import hold_sigterm

    hold_sigterm()

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

import torch

from apps.main.checkpoint_eval import (CheckpointEvaluation, EvalAtCheckpointArgs, fold_deprecated_eval,
                                       validate_eval_sections)
from apps.main.eval import EvalArgs, Evaluator, batch_ce, teacher_heldout
from apps.main.report import NonFiniteLoss, StepReporter, nonfinite_sentence
from apps.main.transformer import LMTransformerArgs, batch_documents, build_model, get_num_flop_per_token
from lingua.args import fill_training_defaults, parse_args, require, to_dict
from lingua.checkpoint import CheckpointArgs
from lingua.cli.entry import run_cli
from lingua.data import DataArgs, training_loader
from lingua.distillation.args import DistillationArgs
from lingua.distillation.build import build_distiller, launch_teachers, serve_teacher
from lingua.distillation.micro_batches import MicroBatchFeed
from lingua.metrics import LoggingArgs
from lingua.optim import OptimArgs, build_optimizer, clip_grad_norm_
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, read_launch_env
from lingua.parallel.run_clock import RunClock
from lingua.probe import ActivationProbe
from lingua.profiling import ProfilerArgs, maybe_run_profiler
from lingua.run.launch import launched_rank
from lingua.run.resume_fit import refuse_another_model, restore_run, schedule_notice
from lingua.tokenizer import build_tokenizer, model_vocab_size

logger = logging.getLogger("train")


@dataclass
class TrainArgs:
    name: str = "lingua"  # the run's name (logs, wandb, stool's job name)
    dump_dir: str = "dumps/lingua"  # the run's folder: config, logs, metrics, checkpoints
    seed: int = 42  # data order and the other random draws of the run (model.seed sets the init)
    steps: int = 1000  # optimizer steps of the whole run
    grad_acc_steps: int = 1  # micro-batches per optimizer step
    probe_freq: Optional[int] = None  # steps between activation/gradient probes; null = none
    enable_distillation: bool = False  # learn from a teacher (the distillation section) as well as the labels
    exit_after_steps: Optional[int] = None  # stop (with a checkpoint) after this many steps of this launch
    # Keys an older run's config.yaml may hold: dropped when null, one sentence when set.
    RETIRED_KEYS: ClassVar[dict[str, str]] = {"inject_failure": "the tests inject faults through their harness "
                                              "(python -m tests.fault_injection inject_failure=...)"}
    # Seconds between SLURM's USR2 and the kill (stool writes its signal_grace_s here); the trainer
    # warns when one step plus a checkpoint take longer than that. 0 = unknown, no check.
    preemption_grace_s: float = 0.0

    data: DataArgs = field(default_factory=DataArgs)
    # max_seqlen -1 (the default here): data.seq_len, as in Meta Lingua; a value below data.seq_len is an error.
    model: LMTransformerArgs = field(default_factory=lambda: LMTransformerArgs(max_seqlen=-1))
    optim: OptimArgs = field(default_factory=OptimArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    distillation: DistillationArgs = field(default_factory=DistillationArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiling: ProfilerArgs = field(default_factory=ProfilerArgs)
    heldout: EvalArgs = field(default_factory=EvalArgs)  # the in-loop held-out CE (every, max_batches, uneven)
    eval: EvalAtCheckpointArgs = field(default_factory=EvalAtCheckpointArgs)  # Lingua's, at each checkpoint.eval
    async_eval_gpus: Optional[int] = None  # null: checkpoint evals in-process; N: a SLURM job each (stool)

    def __post_init__(self):  # the old in-loop eval keys (eval.every, ...) move to heldout:, with a warning
        fold_deprecated_eval(self.eval, self.heldout)

    def validate(self, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> None:
        """Every error the config alone can show (values, files it names, the launch size when given), in
        one pass before any process group exists: each section's own `validate()`, then the rules that
        span sections. Raises a `UserError` (lingua/errors.py) naming the key, the value and the fix."""
        require(self.steps >= 1, "steps", self.steps, "train for at least one step")
        require(self.grad_acc_steps >= 1, "grad_acc_steps", self.grad_acc_steps, "use 1 (no accumulation) or more")
        require(bool(self.dump_dir), "dump_dir", self.dump_dir, "name the folder for logs, metrics and checkpoints")
        blocking = next((p for p in (Path(self.dump_dir), *Path(self.dump_dir).parents) if p.exists()), None)
        require(blocking is None or blocking.is_dir(), "dump_dir", self.dump_dir,
                f"{blocking} is a file, not a folder; point dump_dir at a folder (it is created when missing)")
        for key in ("probe_freq", "exit_after_steps"):
            value = getattr(self, key)
            require(value is None or value >= 1, key, value, "use a positive number of steps, or null")
        require(math.isfinite(self.preemption_grace_s) and self.preemption_grace_s >= 0, "preemption_grace_s",
                self.preemption_grace_s, "use the seconds between SLURM's USR2 and the kill, or 0 for unknown")
        self.data.validate()
        fill_training_defaults(self)  # model.max_seqlen=-1 -> data.seq_len (apps.plan fills the same)
        self.model.validate()
        self.optim.validate()
        self.distributed.validate()
        self.distillation.validate(enabled=self.enable_distillation)
        self.checkpoint.validate()
        self.logging.validate()
        self.profiling.validate()
        validate_eval_sections(self)  # heldout: (its files too), eval:, async_eval_gpus
        require(self.model.max_seqlen >= self.data.seq_len, "model.max_seqlen", self.model.max_seqlen,
                f"the model must fit data.seq_len={self.data.seq_len}; set model.max_seqlen >= {self.data.seq_len}")
        teachers = launch_teachers(self.enable_distillation, self.distillation, self.data)  # each fits the data
        if world_size is not None:  # roles, bridges, teacher replicas and the students' mesh for this many ranks
            LaunchPlan.for_launch(self.distributed, world_size, local_world_size or world_size, teachers)


# ---------------------------------------------------------------- teacher ranks

def distillation_process(args: TrainArgs, topo, phases, preemption) -> None:
    """Teacher rank: load the HF model, handshake with its students, serve until STOP."""
    # The generous timeout holds through the students' first step; a request sent after it (or STOP)
    # switches the teacher to the short one (on every group).
    timeouts = (args.distributed.init_timeout_s, args.distributed.train_timeout_s) if topo.distributed else None
    serve_teacher(args.distillation, topo, preemption, timeouts, phases=phases, attn_mask=args.model.attn_mask,
                  student_tokenizer=args.data.tokenizer,
                  heldout=teacher_heldout(args.heldout, args.data, len(topo.student_ranks)))


# ---------------------------------------------------------------- student ranks

@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0  # tokens trained on, summed over students

    def state_dict(self) -> dict:
        return dict(step=self.step, tokens=self.tokens)


def init_tokenizer(args: TrainArgs):
    """The data tokenizer; the model's vocab size is taken from it."""
    tokenizer = build_tokenizer(args.data.tokenizer)
    args.model.vocab_size = model_vocab_size(tokenizer, args.model.vocab_size)
    return tokenizer


def log_student(args: TrainArgs, topo, model) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"student model: {n_params / 1e6:.2f}M parameters, vocab {args.model.vocab_size}")
    if topo.is_train_master and (mesh := topo.mesh) is not None:
        logger.info(f"student mesh: {dict(zip(mesh.mesh_dim_names, mesh.shape))} over ranks {mesh.mesh.tolist()}")


def train(args: TrainArgs, topo, phases, preemption) -> None:
    with phases.span("tokenizer_init"):
        tokenizer = init_tokenizer(args)
    with phases.span("model_build"):
        model = build_model(args.model, args.distributed, topo)
    log_student(args, topo, model)
    # The teachers' handshakes, or their caches as the dataset (one written with other settings is refused here).
    distiller, cache = build_distiller(args.enable_distillation, args.distillation, topo, tokenizer, args.data,
                                       args.model.attn_mask, phases)
    optimizer, scheduler = build_optimizer(model, args.optim, args.steps)
    state = TrainState()
    with phases.span("checkpoint_load"):  # then config.yaml: after the checks, so a refused launch keeps the old one
        checkpoint, saved = restore_run(args, topo, model, optimizer)
    with phases.span("data_init"):  # with data.load_async, a producer process builds (or decodes) the batches
        loader = training_loader(args.data, tokenizer, topo.train_rank, topo.train_world_size, cache)
    if saved is not None:
        state.step, state.tokens = saved["step"], saved["tokens"]
        scheduler.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["data"])
        logger.info(f"resumed from step {state.step}")
        if topo.is_train_master and (notice := schedule_notice(args, state.step)):
            logger.warning(notice)

    probe = ActivationProbe(model, args.dump_dir, topo.global_rank, topo.is_train_master, topo.train_group,
                            every=args.probe_freq) if args.probe_freq else None
    evaluator = Evaluator(args.heldout, args.data, tokenizer, topo, teacher=distiller)
    checkpoint_eval = CheckpointEvaluation(args, topo, checkpoint)  # Lingua's eval: section, after checkpoint.eval saves
    reporter = StepReporter(args, topo, distiller, flops_per_token(args, model))
    # The step's timer, the hang watch and the collective timeout: generous until the launch's first step is agreed.
    clock = RunClock(args.distributed, topo, phases, args.dump_dir, first_step=state.step + 1)
    feed = MicroBatchFeed(loader, distiller, args.grad_acc_steps, pin_memory=topo.device.type == "cuda",
                          last_step=args.steps if args.exit_after_steps is None else
                          min(args.steps, state.step + args.exit_after_steps))
    ended = "completed"

    def save(stop_now: bool, save_due) -> float:
        """The checkpoints due at this step (`checkpoint.should_save` decides, and in-process evaluation after them);
        returns their seconds, logged apart from the step's (checkpoint/save_s)."""
        kinds = checkpoint.should_save(state.step, stop_now, state.step == args.steps, save_due)
        start = time.perf_counter()
        with clock.timer.part("checkpoint"):
            for kind in kinds:
                train_state = dict(state.state_dict(), scheduler=scheduler.state_dict(), data=feed.state_dict())
                checkpoint.save(model, optimizer, train_state, state.step, to_dict(args), kind=kind)
        save_s = time.perf_counter() - start if kinds else 0.0
        checkpoint_eval.after_save(kinds, state.step, checkpoint.final_dir(state.step), clock.hang_watch,
                                   clock.collective_timeout_s)
        return save_s

    with (maybe_run_profiler(args.dump_dir, model, args.profiling, topo.global_rank, topo.is_train_master,
                             topo.train_group) as profiler, contextlib.closing(loader), reporter, clock,
          distiller.session(lambda: state.step)):  # STOP to the teachers at the end, ERROR on an agreed error
        clock.start(micro_batches_per_step=args.grad_acc_steps)  # the same on every student, or one sentence
        while state.step < args.steps:
            state.step += 1
            with clock.step(state.step):
                metrics, micro_batches = train_step(args, model, distiller, feed, state.step, clock.timer, topo.device,
                                                    scheduler.get_last_lr()[0] / args.optim.lr,
                                                    checkpoint_eval.announces_pause(state.step, feed))
                grad_norm = optimizer_step(model, optimizer, scheduler, args.optim.clip, clock.timer)
            state.tokens += metrics.pop("tokens") * topo.train_world_size
            metrics["data/bad_lines"] = feed.state_dict()["bad_lines"]  # this rank's, look-ahead excluded; logs sum them
            if profiler is not None:
                profiler.step()
            if probe is not None and probe.should_run(state.step):
                run_probe(args, model, probe, micro_batches[0], state.step)
            # The one agreed control point of the step: stop, save and fail are decided together, with the teachers'
            # error and preemption flags; every branch below reads the agreed flags only.
            flags = distiller.agree(dict(**preemption.flags(), nonfinite=~torch.isfinite(metrics["loss/total"]),
                                         save_due=checkpoint.minutes_due()), topo.train_group, topo.device)
            clock.after_agreement(state.step)
            if flags["nonfinite"]:
                raise NonFiniteLoss(nonfinite_sentence(state.step, metrics, topo.train_group, topo.device))
            if evaluator.should_run(state.step):
                reporter.log_eval(evaluator.run(model, state.step))
            preempted = flags["preempt"] or flags.get("teacher_preempt", False)
            stop_now = preempted or (args.exit_after_steps is not None and state.step == feed.last_step)
            if stop_now:
                distiller.drain()  # look-ahead requests answered before the save and the STOP
            step_time = clock.step_seconds()  # a save is not part of the step's time and tokens/s
            save_s = save(stop_now, flags["save_due"])
            reporter.step_done(state, metrics, clock.timer, step_time, save_s, grad_norm, scheduler.get_last_lr()[0],
                               stop_now)
            if stop_now:
                ended = "preempted" if preempted else "exit_after_steps"
                break
    if ended == "preempted":  # SLURM requeues the job; elsewhere the run ends non-zero (preemption.end)
        preemption.stopped(state.step, args.steps, flags, topo.is_train_master, args.dump_dir)
    if topo.is_train_master:
        reporter.summary(state, ended)


def flops_per_token(args: TrainArgs, model) -> float:
    """The student's training FLOPs per token (for MFU). The embedding lookup is no matmul; the output head is (and
    with tied weights it is the only copy counted)."""
    n_params = sum(p.numel() for p in model.parameters())
    matmul_params = n_params - (0 if args.model.tie_embeddings else args.model.vocab_size * args.model.dim)
    return get_num_flop_per_token(matmul_params, args.model.n_layers, args.model.dim, args.data.seq_len)


def train_step(args: TrainArgs, model, distiller, feed: MicroBatchFeed, step: int, timer, device,
               lr_factor: float, pause_follows: bool = False) -> tuple[dict, list[dict]]:
    """Forward/backward over the step's micro-batches; returns this rank's metrics (device tensors: read them on
    log steps only) and the batches. No host sync per micro-batch: batches and requests go to the device
    without blocking, the losses' statistics stay there. `pause_follows`: a long pause of the students follows."""
    with timer.part("data"):
        micro_batches = feed.start_step(step)
    # Counted on the host (loader batches are host tensors): the step's trained-on tokens normalise every loss.
    n_valid = int(sum((mb.batch["labels"] != -100).sum() for mb in micro_batches))
    distiller.begin_step(step, lr_factor, pause_follows)
    defer_reduce = not args.distributed.reduce_every_micro_batch and hasattr(model, "set_requires_gradient_sync")
    for i, mb in enumerate(micro_batches):
        with timer.part("data"):
            feed.submit_ahead(mb)  # this micro-batch's teacher request and the look-ahead ones
        input_ids, labels = (mb.batch[key].to(device, non_blocking=True) for key in ("input_ids", "labels"))
        if defer_reduce:  # FSDP: accumulate unsharded gradients, reduce-scatter once, after the last micro-batch
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        if i == 0:
            timer.arrive()  # the forward's first all-gather is the step's first collective
        with timer.part("fwd_bwd"):
            head_loss = distiller.head_loss(labels, mb.pending, n_valid, timer)
            model(input_ids, **batch_documents(model, mb.batch, device), head_loss=head_loss).backward()
    feed.finish_step(step)
    metrics = {"tokens": sum(mb.batch["input_ids"].numel() for mb in micro_batches), **distiller.step_metrics()}
    return metrics, [mb.batch for mb in micro_batches]


def optimizer_step(model, optimizer, scheduler, clip: float, timer):
    """Clip, step, advance the schedule, clear the gradients; returns the norm before clipping."""
    with timer.part("optimizer"):
        grad_norm = clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def run_probe(args: TrainArgs, model, probe: ActivationProbe, batch, step: int) -> None:
    """An extra forward/backward under the probe's hooks; the teacher is not involved."""
    device = next(model.parameters()).device
    with probe.capture(step):  # through the fused head: no [tokens, vocab] logits
        batch_ce(model, batch, device, normalizer=max(int((batch["labels"] != -100).sum()), 1)).backward()
    model.zero_grad(set_to_none=True)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(TrainArgs, argv)
    launch = read_launch_env()
    args.validate(launch.world_size, launch.local_world_size)  # every config error, before any process group
    refuse_another_model(args)  # a dump dir holding another model's run: before this launch writes anything there
    teachers = launch_teachers(args.enable_distillation, args.distillation)
    # This rank's topology (process groups, roles), its startup log and the preemption flag (lingua/run/launch.py).
    with launched_rank(args.dump_dir, args.distributed, launch, teachers, args.logging.console) as (topo, phases,
                                                                                                  preemption):
        torch.manual_seed(args.seed)
        if topo.is_teacher:
            distillation_process(args, topo, phases, preemption)
        else:
            train(args, topo, phases, preemption)


if __name__ == "__main__":
    run_cli(main)
