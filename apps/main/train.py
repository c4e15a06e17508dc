"""Pretraining with optional online distillation.

    torchrun --nproc-per-node 2 -m apps.main.train config=configs/debug_cpu.yaml
    torchrun --nproc-per-node 8 -m apps.main.train config=configs/distill_exps/debug.yaml

Students run `train()`; teacher ranks run `distillation_process()`. Everything distributed goes
through the Topology returned by `setup_torch_distributed`, and every collective names its group:
the training group for anything the students do together, a bridge group for teacher traffic.
"""

import contextlib
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from apps.main.transformer import LMTransformer, LMTransformerArgs, get_no_recompute_ops, get_num_flop_per_token
from lingua.args import dump_config, parse_args, to_dict
from lingua.checkpoint import CheckpointArgs, CheckpointManager
from lingua.data import DataArgs, DataLoader, iterate_eval_batches
from lingua.distillation import (
    DistillationArgs, TeacherClient, TeacherError, TeacherServer, validate_distillation_args,
)
from lingua.distributed import (
    CountMismatch, DistributedArgs, HangWatch, PreemptionFlag, Topology, agree_count, agree_flags, clean_up,
    dist_gather_floats,
    dist_mean_dict, enter_training_timeout, log_rank_device_map, parallelize_model, setup_torch_distributed,
)
from lingua.kd_loss import alpha_at, distillation_loss, kd_loss
from lingua.logger import init_logger
from lingua.metrics import LoggingArgs, MemoryMonitor, MetricLogger, ProgressLine, estimate_mfu
from lingua.optim import OptimArgs, build_optimizer, clip_grad_norm_
from lingua.probe import ActivationProbe
from lingua.profiling import ProfilerArgs, maybe_run_profiler
from lingua.timing import PhaseLog, StepTimer, format_phase_table, read_phase_files
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger("train")


@dataclass
class EvalArgs:
    every: int = 0  # steps between in-loop evaluations (0 = never)
    max_batches: int = 16  # per rank
    # Ranks holding different numbers of eval batches (agreed before the loop either way):
    # "min" = every rank runs the smallest count, with a warning naming them; "error" = stop, naming them.
    uneven: str = "min"


@dataclass
class TrainArgs:
    name: str = "lingua"
    dump_dir: str = "dumps/lingua"
    seed: int = 42
    steps: int = 1000
    grad_acc_steps: int = 1
    probe_freq: Optional[int] = None
    enable_distillation: bool = False
    exit_after_steps: Optional[int] = None  # stop (with a checkpoint) after this many steps of this launch
    # Seconds between SLURM's USR2 and the kill (stool writes its signal_grace_s here); the trainer
    # warns when one step plus a checkpoint take longer than that. 0 = unknown, no check.
    preemption_grace_s: float = 0.0
    # Exercises failure paths in tests: "raise:<train_rank>@<step>" (that student raises during that step),
    # "nan:<train_rank>@<step>" (its loss is not finite), "stall:<train_rank>@<step>" (it is 4 s late to
    # that step: a straggler), "teacher_load:<teacher_index>" (that teacher fails to load).
    inject_failure: Optional[str] = None

    data: DataArgs = field(default_factory=DataArgs)
    model: LMTransformerArgs = field(default_factory=LMTransformerArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    distillation: DistillationArgs = field(default_factory=DistillationArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiling: ProfilerArgs = field(default_factory=ProfilerArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)


STALL_S = 4.0  # how late inject_failure=stall:... makes a student


@dataclass(frozen=True)
class InjectedFailure:
    kind: str  # "raise" | "nan" | "stall" | "teacher_load"
    rank: int  # train rank, or the teacher's index among teachers for teacher_load
    step: int  # 0 for teacher_load


def parse_injected_failure(spec: Optional[str]) -> Optional[InjectedFailure]:
    if not spec:
        return None
    kind, _, where = spec.rpartition(":") if ":" in spec else ("raise", "", spec)
    rank, _, step = where.partition("@")
    valid = kind in ("raise", "nan", "stall") and rank.isdigit() and step.isdigit() or \
        kind == "teacher_load" and rank.isdigit() and not step
    if not valid:
        raise ValueError(f"inject_failure={spec!r}; use raise:<train_rank>@<step>, nan:<train_rank>@<step>, "
                         f"stall:<train_rank>@<step> or teacher_load:<teacher_index>.")
    return InjectedFailure(kind, int(rank), int(step or 0))


def validate_args(args: TrainArgs) -> None:
    """Config errors a user can make, raised before any process group exists."""
    parse_injected_failure(args.inject_failure)
    if args.steps < 1 or args.grad_acc_steps < 1:
        raise ValueError(f"steps={args.steps} and grad_acc_steps={args.grad_acc_steps} must be >= 1.")
    if not args.dump_dir:
        raise ValueError("dump_dir is empty; set dump_dir=<folder for logs, metrics and checkpoints>.")
    for kind in ("dump", "eval"):
        if getattr(args.checkpoint, kind).keep < 0:
            raise ValueError(f"checkpoint.{kind}.keep={getattr(args.checkpoint, kind).keep}; use 0 (keep all) or N > 0.")
    if args.eval.uneven not in ("min", "error"):
        raise ValueError(f"eval.uneven={args.eval.uneven!r}; use min or error.")
    if args.enable_distillation:
        validate_distillation_args(args.distillation)


def n_teacher_ranks(args: TrainArgs) -> int:
    return args.distillation.n_teacher_ranks if args.enable_distillation else 0


# ---------------------------------------------------------------- teacher ranks

def distillation_process(args: TrainArgs, topo: Topology, phases: PhaseLog, preemption: PreemptionFlag) -> None:
    """Teacher rank: load the HF model, handshake with its students, serve until STOP."""
    injected = parse_injected_failure(args.inject_failure)
    fail_load = injected is not None and injected.kind == "teacher_load" and \
        topo.teacher_ranks.index(topo.global_rank) == injected.rank
    server = TeacherServer(args.distillation, topo, preemption, inject_load_failure=fail_load, phases=phases)
    # The generous timeout holds through the students' first step; a request of a later step (or STOP)
    # switches the teacher to the short one (on every group).
    server.serve(timeouts=(args.distributed.init_timeout_s, args.distributed.train_timeout_s)
                 if topo.distributed else None)


# ---------------------------------------------------------------- student ranks

@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0  # tokens trained on, summed over students
    warned_teacher_bound: bool = False  # this launch only (not in state_dict)
    warned_grace: bool = False  # this launch only

    def state_dict(self) -> dict:
        return dict(step=self.step, tokens=self.tokens)


def build_model(args: TrainArgs, topo: Topology) -> torch.nn.Module:
    """Same seed on every rank -> same full weights, then FSDP shards them: init is topology-free."""
    torch.manual_seed(args.model.seed)
    with torch.device(topo.device):
        model = LMTransformer(args.model)
        model.init_weights()
    return parallelize_model(model, topo, args.distributed, get_no_recompute_ops())


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) so micro-batches add up exactly to one large batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def tokenizer_vocab(tokenizer) -> dict:
    """The token -> id map used to check that students and teacher share a tokenizer."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "get_vocab"):
        return hf.get_vocab()
    return {f"<{type(tokenizer).__name__}:{tokenizer.n_words}>": 0}


def init_tokenizer(args: TrainArgs):
    """The data tokenizer; the model's vocab size is taken from it."""
    tokenizer = build_tokenizer(args.data.tokenizer)
    if args.model.vocab_size not in (-1, tokenizer.n_words):
        raise ValueError(f"model.vocab_size={args.model.vocab_size} but the tokenizer has {tokenizer.n_words} "
                         f"tokens; leave model.vocab_size=-1 to take it from the tokenizer.")
    args.model.vocab_size = tokenizer.n_words
    return tokenizer


def restore_checkpoint(args: TrainArgs, topo: Topology, model, optimizer) -> tuple[CheckpointManager, Optional[dict]]:
    """The checkpoint manager (training group) and the train state to resume from, if any."""
    root = args.checkpoint.path or str(Path(args.dump_dir) / "checkpoints")
    checkpoint = CheckpointManager(args.checkpoint, root, topo.train_group, topo.train_rank, topo.train_world_size)
    saved = checkpoint.load(model, optimizer)
    if saved is None:  # a fresh run may start from init_ckpt_path (weights, or all with continue_training_from_init)
        saved = checkpoint.load_init(model, optimizer)
    return checkpoint, saved


def train(args: TrainArgs, topo: Topology, phases: PhaseLog, preemption: PreemptionFlag) -> None:
    dump_dir = Path(args.dump_dir)
    group, device = topo.train_group, topo.device
    with phases.span("tokenizer_init"):
        tokenizer = init_tokenizer(args)
    if topo.is_train_master:  # resolved: defaults filled, vocab from the tokenizer (mesh -1s stay: a relaunch may resize)
        dump_config(args, dump_dir / "config.yaml")

    with phases.span("model_build"):
        model = build_model(args, topo)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"student model: {n_params / 1e6:.2f}M parameters, vocab {args.model.vocab_size}")
    if topo.is_train_master and topo.mesh is not None:
        mesh = topo.mesh
        logger.info(f"student mesh: {dict(zip(mesh.mesh_dim_names, mesh.shape))} over ranks {mesh.mesh.tolist()}")

    teacher = None
    if args.enable_distillation:
        with phases.span("teacher_handshake"):
            teacher = TeacherClient(args.distillation, topo, tokenizer_vocab(tokenizer), tokenizer.n_words,
                                    args.data.batch_size, args.data.seq_len)

    optimizer, scheduler = build_optimizer(model, args.optim, args.steps)
    state = TrainState()
    with phases.span("checkpoint_load"):
        checkpoint, saved = restore_checkpoint(args, topo, model, optimizer)
    with phases.span("data_init"):
        loader = DataLoader(args.data, tokenizer, topo.dp_rank, topo.dp_degree)
    if saved is not None:
        state.step, state.tokens = saved["step"], saved["tokens"]
        scheduler.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["data"])
        logger.info(f"resumed from step {state.step}")

    probe = ActivationProbe(model, str(dump_dir), topo.global_rank, topo.is_train_master, group) if args.probe_freq else None
    metric_logger = MetricLogger(str(dump_dir / "metrics.jsonl"), args.logging.wandb, to_dict(args), str(dump_dir)) \
        if topo.is_train_master else None
    # Rank 0's progress: a live line on a terminal; otherwise its ETA joins the per-step log lines.
    progress = ProgressLine(args.steps) if topo.is_train_master else None
    memory = MemoryMonitor(device)
    timer = StepTimer()
    hang_watch = HangWatch()
    injected = parse_injected_failure(args.inject_failure)
    # Micro-batches per step is a loop length (and the teacher's request count): the same on every student.
    try:
        agree_count(args.grad_acc_steps, group, device, "micro-batches per step (grad_acc_steps)", mode="equal")
    except CountMismatch:
        if teacher is not None:  # every student raises this together: tell the teacher too
            teacher.stop(state.step, error=True)
        raise
    # The embedding lookup is no matmul; the output head is (and with tied weights it is the only copy counted).
    matmul_params = n_params - (0 if args.model.tie_embeddings else args.model.vocab_size * args.model.dim)
    flops_per_token = get_num_flop_per_token(matmul_params, args.model.n_layers, args.model.dim, args.data.seq_len)
    first_step_of_launch = state.step
    last_saved_step = state.step if saved is not None else -1
    ended = "completed"

    def save(kind: str = "dump") -> None:
        nonlocal last_saved_step
        train_state = dict(state.state_dict(), scheduler=scheduler.state_dict(), data=loader.state_dict())
        checkpoint.save(model, optimizer, train_state, state.step, to_dict(args), kind=kind)
        last_saved_step = state.step

    try:
        with maybe_run_profiler(str(dump_dir), model, args.profiling, topo.global_rank, topo.is_train_master, group) as profiler:
            while state.step < args.steps:
                timer.reset()
                step_start = time.perf_counter()
                state.step += 1
                first_step = state.step == first_step_of_launch + 1
                hang_watch.arm(args.distributed.init_timeout_s if first_step else args.distributed.train_timeout_s)
                injected_now = injected is not None and (injected.rank, injected.step) == (topo.train_rank, state.step)
                if injected_now and injected.kind == "raise":
                    raise RuntimeError(f"injected failure on train rank {injected.rank} at step {injected.step}")
                if injected_now and injected.kind == "stall":
                    time.sleep(STALL_S)
                span = phases.span("first_step") if first_step else contextlib.nullcontext()
                with span:
                    with timer.part("data"):
                        micro_batches = [next(loader) for _ in range(args.grad_acc_steps)]
                    metrics = train_step(args, model, teacher, micro_batches, state.step, timer, device, scheduler)
                    with timer.part("optimizer"):
                        grad_norm = clip_grad_norm_(model.parameters(), args.optim.clip)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                if first_step and teacher is not None:
                    phases.record("first_teacher_round_trip", *teacher.first_round_trip)
                if first_step and args.distributed.compile:  # torch.compile runs inside the first forward/backward
                    phases.record("compile_warmup", time.time() - timer.seconds["fwd_bwd"], time.time())
                state.tokens += metrics.pop("tokens") * topo.train_world_size
                if profiler is not None:
                    profiler.step()

                if probe is not None and state.step % args.probe_freq == 0:
                    run_probe(args, model, probe, micro_batches[0], state.step)

                # The one agreed control point of the step: stop, save and fail are decided together.
                preempt = preemption.requested or (teacher is not None and teacher.teacher_preempt)
                if injected_now and injected.kind == "nan":
                    metrics["loss/total"] = float("nan")
                flags = agree_flags(dict(preempt=preempt, nonfinite=not math.isfinite(metrics["loss/total"])), group, device)
                if first_step:
                    enter_training_timeout(topo, args.distributed.train_timeout_s)
                    if topo.is_train_master:  # every rank's spans are on disk by now (teacher's too)
                        logger.info("startup phases (all ranks)\n" + format_phase_table(read_phase_files(args.dump_dir, world_size=topo.world_size)))
                if flags["nonfinite"]:
                    if teacher is not None:
                        teacher.stop(state.step, error=True)  # all students agree: the teacher hears it too
                    raise FloatingPointError(f"loss is not finite at step {state.step} on at least one training rank")

                if args.eval.every and state.step % args.eval.every == 0:
                    try:
                        run_eval(args, model, tokenizer, topo, state.step, metric_logger)
                    except CountMismatch:
                        if teacher is not None:  # raised on every student at once: the teacher can hear it
                            teacher.stop(state.step, error=True)
                        raise

                stop_now = flags["preempt"] or (
                    args.exit_after_steps is not None and state.step - first_step_of_launch >= args.exit_after_steps)
                with timer.part("checkpoint"):
                    if (args.checkpoint.dump.every and state.step % args.checkpoint.dump.every == 0) or stop_now:
                        save()
                    if args.checkpoint.eval.every and state.step % args.checkpoint.eval.every == 0:
                        save(kind="eval")

                if timer.seconds["checkpoint"] > 0 and topo.is_train_master:
                    check_preemption_grace(args, state, time.perf_counter() - step_start, timer.seconds["checkpoint"])
                if state.step % args.logging.freq == 0 or state.step == args.steps or stop_now:
                    log_step(args, topo, state, metrics, timer, time.perf_counter() - step_start, float(grad_norm),
                             scheduler, memory, flops_per_token, metric_logger, progress, teacher)
                elif progress is not None and progress.is_tty:  # live between log steps, from rank 0's own numbers
                    progress.update(state.step, local_progress_row(args, metrics, timer, time.perf_counter() - step_start,
                                                                   topo.train_world_size))
                if stop_now:
                    ended = "preempted" if flags["preempt"] else "exit_after_steps"
                    break
            if ended == "completed" and last_saved_step != state.step:
                save()
        if teacher is not None:
            teacher.stop(state.step)
        if ended == "preempted":
            requeue_if_slurm(topo)
    finally:
        hang_watch.cancel()
        loader.close()
        if progress is not None:
            progress.close()
        if metric_logger is not None:
            metric_logger.close()
    if topo.is_train_master:
        print_summary(args, state, ended, dump_dir, teacher)


def check_preemption_grace(args: TrainArgs, state: TrainState, step_s: float, save_s: float) -> None:
    """A signal can land at the start of a step: the job needs a whole step plus a save before the kill."""
    if args.preemption_grace_s <= 0 or state.warned_grace or step_s <= args.preemption_grace_s:
        return
    state.warned_grace = True
    logger.warning(
        f"step {state.step} with its checkpoint took {step_s:.1f}s ({save_s:.1f}s saving), more than the "
        f"{args.preemption_grace_s:.0f}s between SLURM's USR2 and the kill (preemption_grace_s): a preempted job "
        f"could be killed before its save completes. Resubmit with a larger stool signal_grace_s.")


def train_step(args: TrainArgs, model, teacher: Optional[TeacherClient], micro_batches, step: int,
               timer: StepTimer, device, scheduler) -> dict:
    """Forward/backward over the micro-batches; returns this rank's loss metrics for the step."""
    n_valid = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    totals = dict(ce=0.0, kd=0.0, teacher_mass=0.0, top1_agreement=0.0)
    kd_args = args.distillation
    alpha = alpha_at(step, kd_args.alpha, kd_args.alpha_schedule, scheduler.get_last_lr()[0] / args.optim.lr) \
        if teacher is not None else 0.0
    for micro_step, batch in enumerate(micro_batches):
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        # Submit first: the teacher's forward overlaps ours.
        handle = teacher.submit(input_ids, step, micro_step) if teacher is not None else None
        with timer.part("fwd_bwd"):
            logits = model(input_ids, doc_ids=doc_ids_for(args, batch, device))
            mask = labels != -100
            weight = int(mask.sum()) / max(n_valid, 1)  # this micro-batch's share of the step's tokens
            ce = cross_entropy_sum(logits, labels) / max(n_valid, 1)
            loss = ce
            if handle is not None:
                with timer.part("teacher_wait"):
                    teacher_outputs = handle.wait().to(device)
                kd, stats = kd_loss(logits, teacher_outputs, mask, kd_args.temperature, kd_args.divergence,
                                    kd_args.jsd_beta, kd_args.loss_chunk_size)
                loss = distillation_loss(ce, kd * weight, alpha, kd_args.temperature)
                totals["kd"] += stats["kd"] * weight
                totals["teacher_mass"] += stats["teacher_mass"] * weight
                totals["top1_agreement"] += stats["top1_agreement"] * weight
            loss.backward()
        totals["ce"] += ce.item()
    # teacher_wait is nested inside fwd_bwd; report compute without it.
    timer.seconds["fwd_bwd"] -= timer.seconds.get("teacher_wait", 0.0)
    metrics = {"loss/ce": totals["ce"], "tokens": sum(b["input_ids"].numel() for b in micro_batches)}
    if teacher is not None:
        metrics.update({"loss/kd": totals["kd"], "kd/teacher_mass": totals["teacher_mass"],
                        "kd/top1_agreement": totals["top1_agreement"], "kd/alpha": alpha})
        metrics["loss/total"] = (1 - alpha) * totals["ce"] + alpha * kd_args.temperature ** 2 * totals["kd"]
    else:
        metrics["loss/total"] = totals["ce"]
    return metrics


def doc_ids_for(args: TrainArgs, batch: dict, device) -> Optional[torch.Tensor]:
    """The batch's document ids when the model masks attention per document (train, probe and eval alike)."""
    if args.model.attn_mask != "doc_causal" or batch.get("doc_ids") is None:
        return None
    return batch["doc_ids"].to(device)


def run_probe(args: TrainArgs, model, probe: ActivationProbe, batch, step: int) -> None:
    """An extra forward/backward under the probe's hooks; the teacher is not involved."""
    device = next(model.parameters()).device
    with probe.capture(step):
        logits = model(batch["input_ids"].to(device), doc_ids=doc_ids_for(args, batch, device))
        labels = batch["labels"].to(logits.device)
        (cross_entropy_sum(logits, labels) / max(int((labels != -100).sum()), 1)).backward()
    model.zero_grad(set_to_none=True)


@torch.no_grad()
def run_eval(args: TrainArgs, model, tokenizer, topo: Topology, step: int, metric_logger) -> None:
    """In-loop eval on the training group only; ranks first agree on how many batches to run."""
    batches = list(iterate_eval_batches(args.data, tokenizer, topo.dp_rank, topo.dp_degree, args.eval.max_batches))
    n_batches = agree_count(len(batches), topo.train_group, topo.device, "eval batches",
                            mode="min" if args.eval.uneven == "min" else "equal")
    loss_sum = tokens = 0.0
    model.eval()
    for batch in batches[:n_batches]:
        labels = batch["labels"].to(topo.device)
        logits = model(batch["input_ids"].to(topo.device), doc_ids=doc_ids_for(args, batch, topo.device))
        loss_sum += cross_entropy_sum(logits, labels).item()
        tokens += int((labels != -100).sum())
    model.train()
    totals = dist_mean_dict(dict(loss_sum=loss_sum, tokens=tokens), topo.train_group, topo.device)
    eval_loss = totals["loss_sum"] / max(totals["tokens"], 1)
    logger.info(f"eval step {step}: loss {eval_loss:.4f} over {n_batches} batches per rank")
    if metric_logger is not None:
        metric_logger.log({"step": step, "eval/loss": eval_loss, "eval/ppl": math.exp(min(eval_loss, 50))})


def log_step(args, topo, state, metrics, timer, step_time, grad_norm, scheduler, memory, flops_per_token,
             metric_logger, progress, teacher) -> None:
    """Means over the students, plus min/max/slowest rank per step part (one gather, log steps only)."""
    group, device = topo.train_group, topo.device
    means = dist_mean_dict({k: v for k, v in metrics.items()}, group, device)
    parts = ("data", "fwd_bwd", "teacher_wait", "optimizer", "checkpoint")
    per_rank = dist_gather_floats([timer.seconds.get(p, 0.0) for p in parts] + [step_time], group, device)
    tokens_per_s = tokens_per_step(args, topo.train_world_size) / step_time
    row = {"step": state.step, "tokens": state.tokens, **means, "optim/lr": scheduler.get_last_lr()[0],
           "optim/grad_norm": grad_norm, "speed/tokens_per_s": tokens_per_s, "speed/step_time_s": step_time,
           "speed/data_time_s": timer.seconds.get("data", 0.0), "time": time.time(), **memory.get_peak_stats()}
    if teacher is not None:
        row["speed/teacher_wait_s"] = timer.seconds.get("teacher_wait", 0.0)
        # Teacher busy/idle seconds, its peak memory and this rank's bridge bytes, cumulative since launch
        # (a benchmark differences two rows).
        row.update(teacher.metrics())
    mfu = estimate_mfu(flops_per_token, tokens_per_s / topo.train_world_size, device)
    if mfu is not None:
        row["speed/mfu"] = mfu
    for i, part in enumerate(parts + ("step",)):
        values = [r[i] for r in per_rank]
        slowest = max(range(len(values)), key=values.__getitem__)
        row[f"stragglers/{part}_max_s"] = values[slowest]
        row[f"stragglers/{part}_min_s"] = min(values)
        row[f"stragglers/{part}_slowest_rank"] = topo.student_ranks[slowest]
    if not topo.is_train_master:
        return
    wait_share = row.get("speed/teacher_wait_s", 0.0) / step_time
    message = (f"step {state.step}/{args.steps} loss {row['loss/total']:.4f} ce {row['loss/ce']:.4f}"
               + (f" kd {row['loss/kd']:.4f} agree {row['kd/top1_agreement']:.3f}" if teacher is not None else "")
               + f" lr {row['optim/lr']:.2e} gnorm {grad_norm:.3f} {tokens_per_s:,.0f} tok/s"
               + (f" teacher wait {100 * wait_share:.0f}%" if teacher is not None else "")
               + f" slowest r{row['stragglers/step_slowest_rank']} {row['stragglers/step_max_s']:.2f}s")
    eta = progress.eta(state.step) if progress is not None else None
    progress.clear() if progress is not None else None  # a log line must not land inside the live line
    logger.info(message + (f" eta {eta}" if eta else ""))
    if teacher is not None and wait_share > 0.3 and not state.warned_teacher_bound:
        state.warned_teacher_bound = True  # once per launch: the progress line keeps showing the share
        logger.warning(f"students spend {100 * wait_share:.0f}% of the step waiting on the teacher: the teacher is "
                       f"the bottleneck (add teacher ranks or use a smaller teacher)")
    metric_logger.log(row)
    if progress is not None and progress.is_tty:
        progress.update(state.step, row)


def tokens_per_step(args: TrainArgs, n_students: int) -> int:
    """Tokens one optimizer step consumes over all students."""
    return args.data.batch_size * args.data.seq_len * args.grad_acc_steps * n_students


def local_progress_row(args: TrainArgs, metrics: dict, timer: StepTimer, step_time: float, n_students: int) -> dict:
    """The progress line's keys from this rank's step alone: no collective off the log steps."""
    row = {"loss/total": metrics["loss/total"], "speed/tokens_per_s": tokens_per_step(args, n_students) / step_time,
           "speed/step_time_s": step_time}
    if "teacher_wait" in timer.seconds:
        row["speed/teacher_wait_s"] = timer.seconds["teacher_wait"]
    return row


def requeue_if_slurm(topo: Topology) -> None:
    """After a preemption save, one rank asks SLURM to requeue the job (submitit requeues by itself)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not topo.is_train_master or job_id is None or os.environ.get("SUBMITIT_EXECUTOR"):
        return
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode == 0:
        logger.info(f"requeued SLURM job {job_id}")
    else:
        logger.error(f"scontrol requeue {job_id} failed: {result.stderr.strip()}")


def print_summary(args: TrainArgs, state: TrainState, ended: str, dump_dir: Path, teacher) -> None:
    import json

    lines = [l for l in (dump_dir / "metrics.jsonl").read_text().splitlines() if l.strip()] \
        if (dump_dir / "metrics.jsonl").exists() else []
    rows = [json.loads(l) for l in lines]
    last = next((r for r in reversed(rows) if "loss/ce" in r), {})
    summary = [f"run {ended}: {state.step} steps, {state.tokens:,} tokens",
               f"final CE {last.get('loss/ce', float('nan')):.4f}"]
    if teacher is not None:
        summary[-1] += (f", KD {last.get('loss/kd', float('nan')):.4f}, teacher-student top-1 agreement "
                        f"{last.get('kd/top1_agreement', float('nan')):.3f}")
        summary.append(f"time waiting on the teacher: {teacher.total_wait_s:.1f}s on this rank "
                       f"(teacher busy {100 * teacher.teacher_busy:.0f}%)")
    summary.append(f"outputs: {dump_dir} (metrics.jsonl, checkpoints/, config.yaml, logs/)")
    logger.info("summary\n  " + "\n  ".join(summary))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(TrainArgs, argv)
    validate_args(args)
    preemption = PreemptionFlag()  # from the start: handlers only set a flag, students agree on it each step
    # Mesh dims are checked against the launch size inside setup, before any collective.
    try:
        topo = setup_torch_distributed(args.distributed, n_teacher_ranks(args), args.dump_dir)
        init_logger(topo.global_rank, topo.role, str(Path(args.dump_dir) / "logs" / f"rank_{topo.global_rank}.log"))
        phases = PhaseLog(args.dump_dir, topo.global_rank, topo.role)
        for phase, (phase_start, phase_end) in topo.setup_spans.items():  # process_group_init, mesh
            phases.record(phase, phase_start, phase_end)
        log_rank_device_map(topo)
        torch.manual_seed(args.seed)
        if topo.is_teacher:
            distillation_process(args, topo, phases, preemption)
        else:
            train(args, topo, phases, preemption)
        preemption.ignore_further()
        if topo.distributed:
            torch.distributed.barrier(group=torch.distributed.group.WORLD)  # everyone ends together
    finally:
        clean_up()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, TeacherError) as err:
        # A user-facing error: one sentence, no traceback (kept at DEBUG level for developers).
        logger.debug("traceback of the error below", exc_info=True)
        sys.stderr.write(f"error: {err}\n")  # one write: ranks sharing the terminal do not interleave
        sys.exit(2)
