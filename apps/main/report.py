"""What each training step leaves behind: the metrics row of log steps (means over the students plus
min/max/slowest rank per step part), the live progress line, one-time warnings, the end-of-run summary.
Nothing here reads a device value on a step that does not log."""

import logging
import re
import time
from pathlib import Path

import torch

from apps.main.teacher_wait import TeacherWait, oversubscribed_cores, teacher_wait_advice
from lingua.args import to_dict
from lingua.errors import NonFiniteError
from lingua.metrics import MemoryMonitor, MetricLogger, ProgressLine, estimate_mfu
from lingua.parallel.collectives import AgreedError, dist_gather_floats, dist_mean_dict
from lingua.parallel.recovery import RecoveryLog
from lingua.run.dump_dir import RunDir, read_metrics

logger = logging.getLogger("train")

STEP_PARTS = ("data", "fwd_bwd", "teacher_wait", "optimizer", "checkpoint")
# A teacher's clocks reach each student from its own bridge: averaged over the students, they describe every replica
TEACHER_CLOCKS = re.compile(r"kd/(\d+/)?teacher_(busy|busy_s|idle_s|forward_s)")


def straggler_metrics(per_rank: list[list[float]], ranks: list[int]) -> dict:
    """min / max / slowest rank of each step part, from every rank's [STEP_PARTS seconds..., step seconds,
    arrival seconds] (`StepTimer`).

    A rank that reaches the step's first collective late makes the others wait inside it (their fwd_bwd grows),
    while its own lateness falls outside every part. So each rank's `step` is its step time less that wait (the
    latest arrival minus its own): the slowest step is the rank the others waited for, not one of the waiters.
    """
    columns = [list(column) for column in zip(*per_rank)]
    arrivals = columns[-1]
    latest = max(arrivals)
    columns[-2] = [step - (latest - arrival) for step, arrival in zip(columns[-2], arrivals)]
    row = {}
    for part, values in zip(STEP_PARTS + ("step", "arrival"), columns):
        slowest = max(range(len(values)), key=values.__getitem__)
        row[f"stragglers/{part}_max_s"] = values[slowest]
        row[f"stragglers/{part}_min_s"] = min(values)
        row[f"stragglers/{part}_slowest_rank"] = ranks[slowest]
    return row


def busy_shares(before: dict, after: dict) -> dict[str, float]:
    """Each teacher's share of time computing between two log rows' cumulative clocks ("" for a lone teacher, "<i>"
    for teacher i of several); {} on the first row, or where no time passed."""
    shares = {}
    for key in after:
        if key.endswith("teacher_busy_s") and key in before:
            prefix = key[:-len("teacher_busy_s")]
            busy = after[key] - before[key]
            idle = after[prefix + "teacher_idle_s"] - before[prefix + "teacher_idle_s"]
            if busy + idle > 0:
                shares[prefix[len("kd/"):].rstrip("/")] = busy / (busy + idle)
    return shares


def kd_words(row: dict) -> str:
    """The KD part of a log line (empty without KD)."""
    return f" kd {row['loss/kd']:.4f} agree {row['kd/top1_agreement']:.3f}" if "loss/kd" in row else ""


def teacher_wait_words(row: dict) -> str:
    """The teacher-wait part of a log line (online teachers only)."""
    if "speed/teacher_wait_s" not in row:
        return ""
    return f" teacher wait {100 * row['speed/teacher_wait_s'] / row['speed/step_time_s']:.0f}%"


def global_batch_words(args, students: int) -> str:
    """"global batch: S students x B x L = N tokens a step": data.batch_size rows of data.seq_len tokens per student
    rank and micro-batch (teacher ranks train nothing, so distilling on the same GPUs trains fewer tokens a step)."""
    data, micro = args.data, args.grad_acc_steps
    tokens = students * data.batch_size * data.seq_len * micro
    return (f"global batch: {students} students x {data.batch_size} x {data.seq_len}"
            + (f" x {micro} micro-batches" if micro > 1 else "")
            + f" = {tokens:,} tokens a step (data.batch_size is per student rank)")


class StepReporter:
    """Owns the logging cadence (`should_log`); the metrics file, wandb and the progress line are rank 0's."""

    def __init__(self, args, topo, distiller, flops_per_token: float):
        self.args, self.topo, self.distiller = args, topo, distiller
        self.flops_per_token = flops_per_token
        self.run_dir = RunDir(args.dump_dir)
        master = topo.is_train_master
        self.metric_logger = MetricLogger(str(self.run_dir.metrics), args.logging.wandb, to_dict(args),
                                          str(self.run_dir.root)) if master else None
        # Rank 0's progress: a live line on a terminal; otherwise its ETA joins the per-step log lines.
        self.progress = ProgressLine(args.steps) if master else None
        self.memory = MemoryMonitor(topo.device)
        self.warned_grace = False  # this launch only
        self.warned_teacher_bound = False  # once per launch: the progress line keeps showing the share
        self.teacher_clocks: dict = {}  # the last log row's cumulative teacher busy/idle seconds (the window's start)
        self.last_logged: dict = {}  # the last log row's loss and teacher share, for the live line in between
        self.unlogged_save_s = 0.0  # checkpoint seconds since the last log row (a save on a step that does not log)
        self.recovery = RecoveryLog(args.dump_dir, topo.recovered, active=master)  # restarts, steps redone, seconds
        if master:  # data.batch_size is per student rank: what one step trains on, said once at startup
            logger.info(global_batch_words(args, topo.train_world_size))

    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over all students."""
        data = self.args.data
        return data.batch_size * data.seq_len * self.args.grad_acc_steps * self.topo.train_world_size

    def should_log(self, step: int, stop_now: bool) -> bool:
        return step % self.args.logging.freq == 0 or step == self.args.steps or stop_now

    def step_done(self, state, metrics: dict, timer, step_time: float, save_s: float, grad_norm, lr: float,
                  stop_now: bool) -> None:
        """After the step's checkpoint (`save_s` seconds, not in `step_time`): the grace warning, then a log row
        (collective on log steps) or the live line."""
        self.unlogged_save_s += save_s
        self.recovery.first_step_done(state.step)
        if "checkpoint" in timer.entered and self.topo.is_train_master:
            self.check_preemption_grace(state.step, step_time + save_s, save_s)
        if self.should_log(state.step, stop_now):
            self.log_step(state, metrics, timer, step_time, float(grad_norm), lr)
        elif self.progress is not None and self.progress.is_tty:
            # Live between log steps from host numbers (the step's wall time is real: the agreed point synced);
            # the loss and the teacher's share are the last log row's, as reading them would sync every step.
            self.progress.update(state.step, {**self.last_logged,
                                              "speed/tokens_per_s": self.tokens_per_step() / step_time})

    def check_preemption_grace(self, step: int, step_s: float, save_s: float) -> None:
        """A signal can land at the start of a step: the job needs a whole step plus a save before the kill."""
        grace = self.args.preemption_grace_s
        if grace <= 0 or self.warned_grace or step_s <= grace:
            return
        self.warned_grace = True
        logger.warning(
            f"step {step} with its checkpoint took {step_s:.1f}s ({save_s:.1f}s saving), more than the "
            f"{grace:.0f}s between SLURM's USR2 and the kill (preemption_grace_s): a preempted job "
            f"could be killed before its save completes. Resubmit with a larger stool signal_grace_s.")

    def log_step(self, state, metrics: dict, timer, step_time: float, grad_norm: float, lr: float) -> None:
        """Means over the students, plus min/max/slowest rank per step part (one gather, log steps only)."""
        topo = self.topo
        group, device = topo.train_group, topo.device
        bridges = self.distiller.log_metrics(timer)  # this rank's wait and its bridges' teacher clocks
        teacher_clocks = {key: bridges.pop(key) for key in list(bridges) if TEACHER_CLOCKS.fullmatch(key)}
        means = dist_mean_dict({**metrics, **teacher_clocks}, group, device)
        means["data/bad_lines"] = round(means["data/bad_lines"] * topo.train_world_size)  # a count: the sum
        seconds = timer.read()
        per_rank = dist_gather_floats([seconds.get(p, 0.0) for p in STEP_PARTS] + [step_time, timer.arrival_s],
                                      group, device)
        tokens_per_s = self.tokens_per_step() / step_time
        row = {"step": state.step, "tokens": state.tokens, **means, "optim/lr": lr, "optim/grad_norm": grad_norm,
               "speed/tokens_per_s": tokens_per_s, "speed/step_time_s": step_time,
               "speed/data_time_s": seconds.get("data", 0.0), "time": time.time(),
               **self.memory.get_peak_stats(), **bridges,
               **straggler_metrics(per_rank, topo.student_ranks)}
        row.update(self.recovery.fields)  # only in a run that recovered from a crash
        if self.unlogged_save_s:  # this rank's saves since the last row, timed apart from the steps
            row["checkpoint/save_s"], self.unlogged_save_s = self.unlogged_save_s, 0.0
        mfu = estimate_mfu(self.flops_per_token, tokens_per_s / topo.train_world_size, device)
        if mfu is not None:
            row["speed/mfu"] = mfu
        if not topo.is_train_master:
            return
        self.last_logged = {key: row[key] for key in ("loss/total", "speed/teacher_wait_s", "speed/step_time_s")
                            if key in row}
        message = (f"step {state.step}/{self.args.steps} loss {row['loss/total']:.4f} ce {row['loss/ce']:.4f}"
                   f"{kd_words(row)} lr {lr:.2e} gnorm {grad_norm:.3f} {tokens_per_s:,.0f} tok/s{teacher_wait_words(row)}"
                   f" slowest r{row['stragglers/step_slowest_rank']} {row['stragglers/step_max_s']:.2f}s")
        eta = self.progress.eta(state.step)
        self.progress.clear()  # a log line must not land inside the live line
        logger.info(message + (f" eta {eta}" if eta else ""))
        self.check_bottleneck(row)
        self.metric_logger.log(row)
        if self.progress.is_tty:
            self.progress.update(state.step, row)

    def check_bottleneck(self, row: dict) -> None:
        """Once per launch, from the second log row on (the teacher's busy share over the window between two rows:
        since the handshake it would count the startup's idle time): students waiting on the teacher for more than
        TEACHER_BOUND_SHARE of a step, with what would change it (`apps/main/teacher_wait.py`)."""
        clocks = {key: value for key, value in row.items() if re.fullmatch(r"kd/(\d+/)?teacher_(busy|idle)_s", key)}
        window, self.teacher_clocks = busy_shares(self.teacher_clocks, clocks), clocks
        if self.warned_teacher_bound or not window:
            return
        busiest = max(window, key=window.get)
        topo = self.topo
        measured = TeacherWait(
            step_s=row["speed/step_time_s"], wait_s=row.get("speed/teacher_wait_s", 0.0), busy_share=window[busiest],
            teacher_ranks=len(topo.teacher_ranks), tp=topo.teacher_tp, students=len(topo.student_ranks),
            prefetch=self.distiller.prefetch,
            shared_cores=oversubscribed_cores(topo.device.type, topo.local_world_size, torch.get_num_threads()),
            rank_key="distillation.n_teacher_ranks" if busiest == "" else
            f"teacher {busiest}'s n_teacher_ranks in distillation.teachers")
        advice = teacher_wait_advice(measured)
        if advice is not None:
            self.warned_teacher_bound = True
            logger.warning(advice)

    def log_eval(self, row: dict) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log(row)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.metric_logger is not None:
            self.metric_logger.close()

    def __enter__(self) -> "StepReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self, state, ended: str) -> None:
        """Rank 0's last lines: how the run ended, its final losses, where its outputs are."""
        last = next((r for r in reversed(read_metrics(self.run_dir.root)) if "loss/ce" in r), {})
        final = f"final CE {last.get('loss/ce', float('nan')):.4f}"
        if "loss/kd" in last:
            final += f", KD {last['loss/kd']:.4f}, teacher-student top-1 agreement {last['kd/top1_agreement']:.3f}"
        lines = [f"run {ended}: {state.step} steps, {state.tokens:,} tokens", final]
        if "speed/teacher_wait_total_s" in last:
            lines.append(f"time waiting on the teacher: {last['speed/teacher_wait_total_s']:.1f}s on this rank "
                         f"(teacher busy {100 * last['kd/teacher_busy']:.0f}%)")
        lines.append(f"outputs: {Path(self.args.dump_dir)} (metrics.jsonl, checkpoints/, config.yaml, logs/)")
        self.recovery.first_step_done(state.step + 1)  # a generation that resumed at the last step trained none
        if recovered := self.recovery.summary_line():
            lines.insert(-1, recovered)
        if last.get("data/bad_lines"):  # summed over the students
            lines.insert(-1, f"skipped {last['data/bad_lines']:,} malformed data lines (warnings in logs/rank_<r>.log)")
        logger.info("summary\n  " + "\n  ".join(lines))


class NonFiniteLoss(AgreedError, NonFiniteError):
    """The loss was not finite on some student; agreed, so raised on every student at once."""


def nonfinite_sentence(step: int, metrics: dict, group, device) -> str:
    """Which training rank(s) and which part of the loss (CE, KD) were not finite at `step`: one gather on the
    training group, on the error path only (every student is here: the flag was agreed)."""
    parts = [(name, metrics.get(key)) for name, key in (("CE", "loss/ce"), ("KD", "loss/kd"))]
    bits = [float(value is not None and not bool(torch.isfinite(torch.as_tensor(value)).all())) for _, value in parts]
    rows = dist_gather_floats(bits, group, device)
    where = [f"{rank} ({' and '.join(name for (name, _), bad in zip(parts, row) if bad)})"
             for rank, row in enumerate(rows) if any(row)]
    ranks = f"train rank{'s' if len(where) > 1 else ''} {', '.join(where)}" if where else "a train rank (injected)"
    return (f"the loss is not finite at step {step} on {ranks}: the student diverged; lower optim.lr, lengthen "
            f"optim.warmup or set optim.clip, and resume from the last checkpoint")
