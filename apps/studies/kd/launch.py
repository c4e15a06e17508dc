"""Launching: the teacher caches, the training runs and their cloze evals, `parallel` at a time, stopped cleanly."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from apps.studies.kd.arms import CLOZE_TASK, EVAL_TIMEOUT_S, POLL_S, Run
from apps.studies.kd.disk import (build_record_path, cache_is_complete, cloze_done, now_iso, read_cloze,
                                      run_finished)
from apps.bench.launcher import ROOT, torchrun_command
from lingua.errors import RunFailed
from lingua.run.dump_dir import eval_rows

logger = logging.getLogger("kd_study")


def build_cache(config: str, overrides: list[str], cache_dir: Path, ranks: int, timeout_s: float,
                in_process: bool = False) -> Optional[float]:
    """Writes the teacher cache on `ranks` launched ranks, or (`in_process`) as one rank in this process; returns
    its wall seconds (None when it was already complete)."""
    if cache_is_complete(cache_dir):
        logger.info(f"teacher cache {cache_dir} is complete: reusing it")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_args = [f"config={config}", *overrides, f"cache_dir={cache_dir}", "streams=1"]
    start = time.perf_counter()
    if in_process:
        logger.info(f"writing the teacher cache in this process into {cache_dir}")
        write_cache_here(cache_args)
        code = 0
    else:
        logger.info(f"writing the teacher cache on {ranks} rank(s) into {cache_dir} (log: {cache_dir}.log)")
        process = popen_logged(torchrun_command(ranks, "apps.main.teacher_cache", cache_args), Path(f"{cache_dir}.log"))
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = f"killed after {timeout_s:.0f}s, raise --cache-timeout"
        finally:  # a timeout, SIGTERM or Ctrl-C: the teacher ranks stop with it (a rerun resumes the cache)
            stop_tree(process)
    wall_s = time.perf_counter() - start
    if code != 0:
        raise RunFailed(f"writing the teacher cache failed ({code}); its log: {cache_dir}.log")
    build_record_path(cache_dir).write_text(json.dumps({"wall_s": wall_s, "ranks": ranks, "finished": now_iso()}) + "\n")
    logger.info(f"teacher cache {cache_dir} written in {wall_s / 60:.1f} min")
    return wall_s

def write_cache_here(cache_args: list[str]) -> None:
    """`apps.main.teacher_cache` as one rank of this process (its process group is destroyed when it returns);
    the study's own log handlers are put back after it installs its rank-prefixed ones."""
    from apps.main.teacher_cache import main as write_cache

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        write_cache(cache_args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def child_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def popen_logged(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child holds its own descriptor
        return subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def train_command(run: Run, config: str) -> list[str]:
    source = ([] if run.cache_dir is None else
              ["distillation.source=cache", f"distillation.cache_dir={run.cache_dir}"])
    return torchrun_command(1, "apps.main.train", [
        f"config={config}", *run.overrides, *source, f"model.seed={run.seed}", f"dump_dir={run.dump_dir}"])


def cloze_command(run: Run) -> list[str]:
    return [sys.executable, "-m", "apps.main.eval", f"ckpt={run.dump_dir / 'checkpoints'}", f"tasks={CLOZE_TASK}",
            "perplexity=false", "device=cpu"]


def start_stage(run: Run, config: str) -> None:
    if run.stage == "train":
        if run.dump_dir.exists():  # an unfinished run starts again from scratch: one clean, deterministic curve
            shutil.rmtree(run.dump_dir)
        run.dump_dir.mkdir(parents=True)
        run.process = popen_logged(train_command(run, config), run.dump_dir / "study_run.log")
    else:
        run.process = popen_logged(cloze_command(run), run.dump_dir / "cloze_eval.log")
    run.started_at, run.started_unix = time.perf_counter(), time.time()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's ranks run in sessions of their own, so its group is not enough)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def stop_tree(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a launched stage and its ranks: SIGTERM to torchrun (it passes it on; a trainer stops at the end of
    its step), then after `grace_s` SIGKILL to whatever of that tree is left. Only processes we started."""
    if process.poll() is not None:
        return
    tree = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [process.pid, *tree]:
        try:  # still one of ours (a pid is not reused within seconds, but check the command anyway)
            if b"apps." in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    process.wait()


def run_all(runs: list[Run], config: str, parallel: int, cloze: bool = True) -> list[str]:
    """Runs `parallel` jobs at a time (one CPU thread each): a run trains, then (in the same slot) its final
    checkpoint is scored on pydocs_cloze. A failure is logged and the others go on; returns the failures."""
    waiting, active, failures = list(runs), [], []
    try:
        while waiting or active:
            while waiting and len(active) < parallel:
                run = waiting.pop(0)
                logger.info(f"start {run.arm} seed {run.seed} ({run.stage}, {run.steps} steps) -> {run.dump_dir}")
                start_stage(run, config)
                active.append(run)
            time.sleep(POLL_S)
            for run in list(active):
                elapsed = time.perf_counter() - run.started_at
                code = run.process.poll()
                limit = run.timeout_s if run.stage == "train" else EVAL_TIMEOUT_S
                if code is None and elapsed < limit:
                    continue
                if code is None:
                    stop_tree(run.process)
                    code = f"killed after {limit:.0f}s (raise --timeout)"
                log = run.dump_dir / ("study_run.log" if run.stage == "train" else "cloze_eval.log")
                if code != 0:
                    failures.append(f"{run.arm} seed {run.seed} {run.stage} failed ({code}); its log: {log}")
                    logger.error(failures[-1])
                    active.remove(run)
                    continue
                if run.stage == "train":
                    run.wall_s = elapsed
                    (run.dump_dir / "study_run.json").write_text(json.dumps({
                        "wall_s": elapsed, "started": now_iso(run.started_unix), "finished": now_iso(),
                        "command": train_command(run, config)}) + "\n")
                    rows = eval_rows(run.dump_dir)
                    logger.info(f"done {run.arm} seed {run.seed} in {elapsed / 60:.1f} min: final held-out CE "
                                f"{rows[max(rows)]['eval/loss']:.4f}")
                    if cloze and not cloze_done(run.dump_dir, run.steps):
                        run.stage = "cloze"
                        start_stage(run, config)
                        continue
                else:
                    logger.info(f"{CLOZE_TASK} of {run.arm} seed {run.seed} in {elapsed:.0f}s: acc "
                                f"{read_cloze(run.dump_dir, run.steps)['acc']:.4f}")
                active.remove(run)
    finally:  # stopped (SIGTERM, Ctrl-C, a bug): no orphan trainings left behind
        for run in active:
            if run.process is not None:
                stop_tree(run.process)
    return failures


def pending(runs: list[Run], cloze: bool) -> list[Run]:
    """The runs with work left, each at its first unfinished stage."""
    todo = []
    for run in runs:
        if not run_finished(run.dump_dir, run.steps):
            todo.append(run)
        elif cloze and not cloze_done(run.dump_dir, run.steps):
            run.stage = "cloze"
            todo.append(run)
    return todo
