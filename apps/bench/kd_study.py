"""The KD-vs-CE study: does the teacher lower the student's held-out loss at equal tokens?

    python -m apps.bench.kd_study                               # cache once, 3 arms x 3 seeds, results + plot + table
    python -m apps.bench.kd_study --seeds 0 --steps 40 --out /tmp/kd_quick    # a quick look (minutes)

Setup (configs/distill_exps/kd_study.yaml): SmolLM2-135M-Instruct teaches a small student that uses its
tokenizer, on the embedded Python-docs corpus. The teacher's top-64 outputs are written once by
`apps.main.teacher_cache` (skipped when the cache is already complete), so every arm and seed reads the
same windows in the same order and the teacher is paid once. Arms differ only in the loss:

    ce            alpha = 0: the student's CE alone (the teacher's targets are read and ignored)
    kd_topk64     alpha = 0.5, T = 1, forward KL against the top-64 outputs
    kd_topk64_lr  the same with alpha following the lr schedule (KD early, CE as the lr decays)

A seed is the student's init (`model.seed`); seed s of every arm starts from the same weights, so
arms compare paired. Each run evaluates the whole held-out split (`*.val.jsonl`, never trained on)
every `eval.every` steps. Runs that already finished in --out are kept (rerunning resumes a study).
Writes into --out: results.json (per arm and seed: held-out CE at each eval and at the end, tokens),
kd_study.png (mean and min-max band per arm, the teacher's held-out CE as a line) and table.md.
"""

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from apps.bench.runs import ROOT, launch, torchrun_command
from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.cli import run_cli
from lingua.distillation.cache import INDEX, CacheManifest
from lingua.distillation.teacher import check_teacher_dir
from lingua.documents import list_val_files
from lingua.errors import ConfigError, DataError, RunFailed
from lingua.rundir import eval_rows

logger = logging.getLogger("kd_study")

CONFIG = "configs/distill_exps/kd_study.yaml"
ARMS = {
    "ce": ["distillation.alpha=0.0"],
    "kd_topk64": ["distillation.alpha=0.5"],
    "kd_topk64_lr": ["distillation.alpha=0.5", "distillation.alpha_schedule=lr"],
}


@dataclass
class Run:
    arm: str
    seed: int
    dump_dir: Path
    overrides: list[str]
    wall_s: Optional[float] = None  # seconds the run took, once finished
    started_at: float = 0.0  # perf_counter() when it was launched
    process: Optional[subprocess.Popen] = field(default=None, repr=False)


def study_args(config: str, overrides: list[str]) -> TrainArgs:
    """The training config every run shares (readable errors for a bad override come from here)."""
    return parse_args(TrainArgs, [f"config={config}", *overrides])


def check_inputs(args: TrainArgs) -> None:
    if args.eval.every < 1 or args.steps % args.eval.every:
        raise ConfigError(f"eval.every={args.eval.every} must divide steps={args.steps} so every run ends on an "
                          f"evaluation.")
    if not any(list_val_files(args.data.root_dir, source) for source in args.data.sources):
        raise DataError(f"no held-out *.val.jsonl under {args.data.root_dir}; run `python -m "
                        f"setup.prepare_corpus` (or `bash setup/demo.sh`, which also prepares the teacher).")
    check_teacher_dir(args.distillation.teacher_path)


def cache_is_complete(cache_dir: Path) -> bool:
    return (cache_dir / INDEX).exists()


def build_cache(config: str, overrides: list[str], cache_dir: Path, ranks: int, timeout_s: float) -> Optional[float]:
    """Writes the teacher cache on `ranks` ranks; returns its wall seconds (None when it was already complete)."""
    if cache_is_complete(cache_dir):
        logger.info(f"teacher cache {cache_dir} is complete: reusing it")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info(f"writing the teacher cache on {ranks} rank(s) into {cache_dir} (log: {cache_dir}.log)")
    command = torchrun_command(ranks, "apps.main.teacher_cache", [
        f"config={config}", *overrides, f"cache_dir={cache_dir}", "streams=1"])
    code, wall_s, _, _ = launch(command, Path(f"{cache_dir}.log"), timeout_s, omp_threads=1)
    if code != 0:
        raise RunFailed(f"writing the teacher cache failed (exit code {code}); its log: {cache_dir}.log")
    return wall_s


def run_finished(dump_dir: Path, steps: int) -> bool:
    return steps in eval_rows(dump_dir) if (dump_dir / "metrics.jsonl").exists() else False


def start_run(run: Run, config: str, cache_dir: Path) -> None:
    command = torchrun_command(1, "apps.main.train", [
        f"config={config}", *run.overrides, "distillation.source=cache", f"distillation.cache_dir={cache_dir}",
        f"model.seed={run.seed}", f"dump_dir={run.dump_dir}"])
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    run.dump_dir.mkdir(parents=True, exist_ok=True)
    log = open(run.dump_dir / "study_run.log", "w")
    run.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    run.started_at = time.perf_counter()
    log.close()  # the child holds its own descriptor


def run_all(runs: list[Run], config: str, cache_dir: Path, parallel: int, timeout_s: float) -> None:
    """Runs `parallel` trainings at a time (one thread each); the first failure stops the study with its log."""
    waiting, active = list(runs), []
    while waiting or active:
        while waiting and len(active) < parallel:
            run = waiting.pop(0)
            logger.info(f"start {run.arm} seed {run.seed} -> {run.dump_dir}")
            start_run(run, config, cache_dir)
            active.append(run)
        time.sleep(1.0)
        for run in list(active):
            elapsed = time.perf_counter() - run.started_at
            code = run.process.poll()
            if code is None and elapsed < timeout_s:
                continue
            if code is None:
                run.process.kill()
                code = f"killed after {timeout_s:.0f}s"
            if code != 0:
                for other in active:
                    if other.process.poll() is None:
                        other.process.kill()
                raise RunFailed(f"{run.arm} seed {run.seed} failed ({code}); its log: "
                                f"{run.dump_dir / 'study_run.log'}")
            run.wall_s = elapsed
            active.remove(run)
            logger.info(f"done {run.arm} seed {run.seed} in {elapsed:.0f}s: final held-out CE "
                        f"{eval_rows(run.dump_dir)[max(eval_rows(run.dump_dir))]['eval/loss']:.4f}")


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def collect(runs: list[Run], args: TrainArgs, tokens_per_step: int) -> dict:
    """results.json's `arms`: per arm its overrides, per seed the held-out curve and final CE, and the spread."""
    arms: dict = {}
    for run in runs:
        rows = eval_rows(run.dump_dir)
        curve = [{"step": step, "tokens": step * tokens_per_step, "heldout_ce": rows[step]["eval/loss"]}
                 for step in sorted(rows)]
        arm = arms.setdefault(run.arm, {"overrides": ARMS[run.arm], "seeds": {}})
        arm["seeds"][str(run.seed)] = {"final_heldout_ce": curve[-1]["heldout_ce"], "heldout": curve,
                                       "tokens": args.steps * tokens_per_step, "wall_s": run.wall_s}
    for name, arm in arms.items():
        finals = [seed["final_heldout_ce"] for seed in arm["seeds"].values()]
        arm["final_heldout_ce"] = spread(finals)
        if "ce" in arms and name != "ce":
            # Paired by seed: same init and data order, only the loss differs.
            diffs = [seed["final_heldout_ce"] - arms["ce"]["seeds"][s]["final_heldout_ce"]
                     for s, seed in arm["seeds"].items() if s in arms["ce"]["seeds"]]
            arm["minus_ce_paired"] = spread(diffs)
    return arms


def teacher_heldout_ce(cache_dir: Path) -> Optional[float]:
    return CacheManifest.read(cache_dir).teacher_heldout_ce


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, final_ax) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    names = list(results["arms"])
    for name, arm in results["arms"].items():
        curves = [seed["heldout"] for seed in arm["seeds"].values()]
        tokens = [point["tokens"] for point in curves[0]]
        losses = [[curve[i]["heldout_ce"] for curve in curves] for i in range(len(tokens))]
        mean = [statistics.fmean(values) for values in losses]
        ax.plot(tokens, mean, marker="o", markersize=3, label=f"{name} (mean of {len(curves)} seeds)")
        ax.fill_between(tokens, [min(v) for v in losses], [max(v) for v in losses], alpha=0.25)
    teacher = results.get("teacher_heldout_ce")
    if teacher is not None:
        ax.axhline(teacher, color="black", linestyle="--", linewidth=1, label=f"teacher ({Path(results['setup']['teacher']).name}) {teacher:.2f}")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out CE (nats/token)")
    ax.set_title("held-out CE (band: min-max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    # Right: each seed's final held-out CE per arm, a seed's arms joined (they share init and data order).
    seeds = sorted({s for arm in results["arms"].values() for s in arm["seeds"]})
    for seed in seeds:
        points = [(i, arm["seeds"][seed]["final_heldout_ce"]) for i, arm in enumerate(results["arms"].values())
                  if seed in arm["seeds"]]
        final_ax.plot(*zip(*points), marker="o", color="gray", alpha=0.6, linewidth=0.8)
    final_ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    final_ax.set_xlim(-0.5, len(names) - 0.5)
    final_ax.set_title(f"final held-out CE per seed ({results['setup']['tokens_per_run']:,} tokens)", fontsize=10)
    final_ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "kd_study.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(results: dict) -> str:
    lines = ["| arm | settings | final held-out CE, mean ± std | per seed | minus CE-only, paired by seed |",
             "|---|---|---|---|---|"]
    for name, arm in results["arms"].items():
        final = arm["final_heldout_ce"]
        seeds = ", ".join(f"{seed['final_heldout_ce']:.4f}" for seed in arm["seeds"].values())
        paired = arm.get("minus_ce_paired")
        diff = (f"{paired['mean']:+.4f} (range {paired['min']:+.4f} to {paired['max']:+.4f})" if paired else "—")
        settings = " ".join(o.replace("distillation.", "") for o in arm["overrides"])
        lines.append(f"| {name} | {settings} | {final['mean']:.4f} ± {final['std']:.4f} | {seeds} | {diff} |")
    if results.get("teacher_heldout_ce") is not None:
        lines.append(f"| teacher | {Path(results['setup']['teacher']).name} | {results['teacher_heldout_ce']:.4f} | | |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--out", default="dumps/kd_study", help="runs, results.json, kd_study.png, table.md")
    parser.add_argument("--cache-dir", default=None, help="the teacher cache (default: <out>/cache)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time, one CPU thread each")
    parser.add_argument("--cache-ranks", type=int, default=2, help="teacher ranks writing the cache")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run and for the cache")
    parser.add_argument("overrides", nargs="*", help="training overrides shared by every run (key=value)")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kd_study: %(message)s")

    unknown = [a for a in options.arms.split(",") if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arm(s) {', '.join(unknown)}; use some of {', '.join(ARMS)}.")
    seeds = [int(s) for s in options.seeds.split(",")]
    overrides = list(options.overrides) + ([f"steps={options.steps}"] if options.steps else [])
    args = study_args(options.config, overrides)
    if options.steps and args.steps % args.eval.every:
        overrides.append(f"eval.every={math.gcd(args.steps, args.eval.every)}")
        args = study_args(options.config, overrides)
    check_inputs(args)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(options.cache_dir or out / "cache")

    started = time.perf_counter()
    cache_s = build_cache(options.config, overrides, cache_dir, options.cache_ranks, options.timeout)
    runs = [Run(arm, seed, out / "runs" / f"{arm}_seed{seed}", overrides + ARMS[arm])
            for arm in options.arms.split(",") for seed in seeds]
    todo = [run for run in runs if not run_finished(run.dump_dir, args.steps)]
    logger.info(f"{len(runs)} runs, {len(runs) - len(todo)} already finished, {options.parallel} at a time")
    run_all(todo, options.config, cache_dir, options.parallel, options.timeout)
    tokens_per_step = args.grad_acc_steps * args.data.batch_size * args.data.seq_len
    results = {
        "setup": {"config": options.config, "overrides": overrides, "steps": args.steps, "seeds": seeds,
                  "tokens_per_run": args.steps * tokens_per_step, "eval_every": args.eval.every,
                  "student": {k: getattr(args.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
                  "teacher": args.distillation.teacher_path, "output": args.distillation.output,
                  "k": args.distillation.k, "temperature": args.distillation.temperature},
        "teacher_heldout_ce": teacher_heldout_ce(cache_dir),
        "arms": collect(runs, args, tokens_per_step),
        "cache_build_s": cache_s,
        "study_wall_s": time.perf_counter() - started,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    png = plot(results, out)
    print(table(results))
    print(f"results: {out / 'results.json'}, plot: {png}, table: {out / 'table.md'}")
    return results


if __name__ == "__main__":
    run_cli(main)
