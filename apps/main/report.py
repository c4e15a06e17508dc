"""What each training step leaves behind: the metrics row of log steps (means over the students plus
min/max/slowest rank per step part), the live progress line, one-time warnings, the end-of-run summary."""

import logging
import time
from pathlib import Path

from lingua.args import to_dict
from lingua.collectives import dist_gather_floats, dist_mean_dict
from lingua.metrics import MemoryMonitor, MetricLogger, ProgressLine, estimate_mfu
from lingua.rundir import RunDir, read_metrics

logger = logging.getLogger("train")

STEP_PARTS = ("data", "fwd_bwd", "teacher_wait", "optimizer", "checkpoint")


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

    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over all students."""
        data = self.args.data
        return data.batch_size * data.seq_len * self.args.grad_acc_steps * self.topo.train_world_size

    def should_log(self, step: int, stop_now: bool) -> bool:
        return step % self.args.logging.freq == 0 or step == self.args.steps or stop_now

    def step_done(self, state, metrics: dict, timer, step_time: float, grad_norm, lr: float, stop_now: bool) -> None:
        """After the step's checkpoint: the grace warning, then a log row (collective on log steps) or the live line."""
        if timer.seconds["checkpoint"] > 0 and self.topo.is_train_master:
            self.check_preemption_grace(state.step, step_time, timer.seconds["checkpoint"])
        if self.should_log(state.step, stop_now):
            self.log_step(state, metrics, timer, step_time, float(grad_norm), lr)
        elif self.progress is not None and self.progress.is_tty:  # live between log steps, from rank 0's own numbers
            row = {"loss/total": float(metrics["loss/total"]), "speed/tokens_per_s": self.tokens_per_step() / step_time,
                   "speed/step_time_s": step_time}
            if "teacher_wait" in timer.seconds:
                row["speed/teacher_wait_s"] = timer.seconds["teacher_wait"]
            self.progress.update(state.step, row)

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
        means = dist_mean_dict(dict(metrics), group, device)
        means["data/bad_lines"] = round(means["data/bad_lines"] * topo.train_world_size)  # a count: the sum
        per_rank = dist_gather_floats([timer.seconds.get(p, 0.0) for p in STEP_PARTS] + [step_time], group, device)
        tokens_per_s = self.tokens_per_step() / step_time
        row = {"step": state.step, "tokens": state.tokens, **means, "optim/lr": lr, "optim/grad_norm": grad_norm,
               "speed/tokens_per_s": tokens_per_s, "speed/step_time_s": step_time,
               "speed/data_time_s": timer.seconds.get("data", 0.0), "time": time.time(),
               **self.memory.get_peak_stats(), **self.distiller.log_metrics(timer)}
        mfu = estimate_mfu(self.flops_per_token, tokens_per_s / topo.train_world_size, device)
        if mfu is not None:
            row["speed/mfu"] = mfu
        for i, part in enumerate(STEP_PARTS + ("step",)):
            values = [r[i] for r in per_rank]
            slowest = max(range(len(values)), key=values.__getitem__)
            row[f"stragglers/{part}_max_s"] = values[slowest]
            row[f"stragglers/{part}_min_s"] = min(values)
            row[f"stragglers/{part}_slowest_rank"] = topo.student_ranks[slowest]
        if not topo.is_train_master:
            return
        kd_words, wait_words = self.distiller.log_words(row)
        message = (f"step {state.step}/{self.args.steps} loss {row['loss/total']:.4f} ce {row['loss/ce']:.4f}{kd_words}"
                   f" lr {lr:.2e} gnorm {grad_norm:.3f} {tokens_per_s:,.0f} tok/s{wait_words}"
                   f" slowest r{row['stragglers/step_slowest_rank']} {row['stragglers/step_max_s']:.2f}s")
        eta = self.progress.eta(state.step)
        self.progress.clear()  # a log line must not land inside the live line
        logger.info(message + (f" eta {eta}" if eta else ""))
        self.distiller.check_bottleneck(row)
        self.metric_logger.log(row)
        if self.progress.is_tty:
            self.progress.update(state.step, row)

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
        kd_words, extra = self.distiller.summary(last)
        lines = [f"run {ended}: {state.step} steps, {state.tokens:,} tokens",
                 f"final CE {last.get('loss/ce', float('nan')):.4f}{kd_words}", *extra,
                 f"outputs: {Path(self.args.dump_dir)} (metrics.jsonl, checkpoints/, config.yaml, logs/)"]
        if last.get("data/bad_lines"):  # summed over the students
            lines.insert(-1, f"skipped {last['data/bad_lines']:,} malformed data lines (warnings in logs/rank_<r>.log)")
        logger.info("summary\n  " + "\n  ".join(lines))
