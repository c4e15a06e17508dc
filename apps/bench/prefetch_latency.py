"""How much of the teacher's time the students' look-ahead hides: prefetch 0 vs 1 under a simulated latency.

    python -m apps.bench.distill --config tiny --teacher-latency-ms 100 --out DIR
    python -m apps.bench.distill --config tiny --teacher-latency-ms 0,50,100,200 --out DIR

For each latency L and distillation.prefetch in (0, 1), the KD-on run is launched through
`apps.bench.latency_teacher` (each request takes L on the teacher, which sleeps instead of using the
students' cores). From rank 0's metrics rows after the warm-up (medians):

    wait_ms_per_micro_batch     speed/teacher_wait_s / grad_acc_steps
    compute_ms_per_micro_batch  (step - wait - data) / grad_acc_steps: the student's own work (C)
    step_s                      speed/step_time_s

Expected (DESIGN.md §4): prefetch 0 waits about max(0, L - forward) per micro-batch, prefetch 1 about
max(0, L - C). Writes DIR/results.json: {"settings": ..., "rows": [one per (prefetch, latency)]}.
"""

import json
import os
import shutil
import statistics
from pathlib import Path

from apps.bench.latency_teacher import LATENCY_ENV
from apps.bench.launcher import launch, torchrun_command
from lingua.errors import ConfigError, RunFailed

# The student computes ~150 ms per micro-batch (its forward ~50 ms) on 1 thread with these: forward < L < C
# at L = 100 ms, so the sweep shows prefetch 0 waiting L - forward and prefetch 1 hiding L behind C.
LATENCY_PRESET_OVERRIDES = ["model.dim=256", "model.n_layers=2", "data.batch_size=4"]


def latency_row(rows: list[dict], warmup: int, grad_acc_steps: int, prefetch: int, latency_ms: float) -> dict:
    """One results row from a run's metrics rows (medians over the steps after the warm-up)."""
    window = [r for r in rows if r["step"] > warmup]
    if not window:
        raise ConfigError(f"No step after the warm-up of {warmup} steps was logged; use more --steps than --warmup.")
    step = statistics.median(r["speed/step_time_s"] for r in window)
    wait = statistics.median(r["speed/teacher_wait_s"] for r in window)
    compute = statistics.median(r["speed/step_time_s"] - r["speed/teacher_wait_s"] - r["speed/data_time_s"]
                                for r in window)
    return {"prefetch": prefetch, "teacher_latency_ms": latency_ms,
            "wait_ms_per_micro_batch": 1e3 * wait / grad_acc_steps,
            "compute_ms_per_micro_batch": 1e3 * compute / grad_acc_steps, "step_s": step,
            "steps_measured": len(window)}


def run_latency_sweep(config: str, overrides: list[str], latencies_ms: list[float], nproc: int, steps: int,
                      warmup: int, grad_acc_steps: int, out_dir: Path, timeout_s: float, omp_threads: int,
                      read_rows) -> dict:
    """Launch prefetch 0 and 1 at every latency; returns (and writes) the results."""
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    results = {"settings": {"config": config, "overrides": overrides, "nproc": nproc, "steps": steps,
                            "warmup": warmup, "grad_acc_steps": grad_acc_steps, "omp_threads": omp_threads,
                            "cpu_count": os.cpu_count(), "load_start": list(os.getloadavg())},
               "rows": [], "commands": {}}
    for latency_ms in latencies_ms:
        for prefetch in (0, 1):
            name = f"latency{latency_ms:g}_prefetch{prefetch}"
            dump_dir = runs_dir / name
            shutil.rmtree(dump_dir, ignore_errors=True)
            command = torchrun_command(nproc, "apps.bench.latency_teacher", [
                f"config={config}", *overrides, f"dump_dir={dump_dir}", f"steps={steps}", "logging.freq=1",
                f"grad_acc_steps={grad_acc_steps}", "checkpoint.dump.every=0", "checkpoint.eval.every=0",
                "heldout.every=0", "enable_distillation=true", f"distillation.prefetch={prefetch}"])
            log_path = runs_dir / f"{name}.log"
            rc, *_ = launch(command, log_path, timeout_s, omp_threads, extra_env={LATENCY_ENV: str(latency_ms)})
            if rc != 0:
                tail = "\n".join(log_path.read_text().splitlines()[-30:])
                raise RunFailed(f"benchmark run {name} failed with exit code {rc}; its log is {log_path}:\n{tail}")
            shutil.rmtree(dump_dir / "checkpoints", ignore_errors=True)
            results["rows"].append(latency_row(read_rows(dump_dir), warmup, grad_acc_steps, prefetch, latency_ms))
            results["commands"][name] = f"{LATENCY_ENV}={latency_ms:g} " + " ".join(command)
    results["settings"]["load_end"] = list(os.getloadavg())
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


def format_latency_table(results: dict) -> str:
    lines = ["| teacher latency L (ms) | prefetch | wait per micro-batch (ms) | student compute C per micro-batch (ms) "
             "| step (s) |", "|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['teacher_latency_ms']:g} | {row['prefetch']} | {row['wait_ms_per_micro_batch']:.1f} | "
                     f"{row['compute_ms_per_micro_batch']:.1f} | {row['step_s']:.3f} |")
    return "\n".join(lines) + "\n"
