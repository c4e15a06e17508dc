"""The study's command: plan the runs, write the caches, run phase one, decide on 4x CE, report."""

import argparse
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import apps.studies.kd
from apps.studies.kd.arms import (ARMS, CACHES, CLOZE_TASK, CONDITIONAL_ARM, CONFIG, WALL_ARMS, Run,
                                      ce_arm_wanted, check_inputs, parse_multiples, study_args)
from apps.studies.kd.disk import (build_record_path, cache_bytes_per_token, cache_dir_of, cache_is_complete,
                                      now_iso, run_finished, teacher_heldout_ce)
from apps.studies.kd.launch import build_cache, pending, run_all
from apps.studies.kd.render import plot, table
from apps.studies.kd.results import (add_flops, collect, conditional_arm_needed, student_flops_per_token,
                                         teacher_flops_per_token, token_multipliers)
from apps.studies.kd.wall import main as wall_study
from apps.studies.kd.wall_inprocess import GPU_CONFIG
from apps.main.train import TrainArgs
from lingua.distillation.cache.store import CacheManifest
from lingua.errors import ConfigError, RunFailed

logger = logging.getLogger("kd_study")


def plan_runs(names: list[str], seeds: list[int], out: Path, cache_root: Path, base: list[str], steps: int,
              timeout_s: float) -> list[Run]:
    runs = []
    for name in names:
        spec = ARMS[name]
        arm_steps = steps * spec.multiple
        overrides = list(base) + list(spec.overrides) + list(CACHES.get(spec.cache, ())) + (
            [f"steps={arm_steps}"] if spec.multiple != 1 else [])
        for seed in seeds:
            runs.append(Run(name, seed, out / "runs" / f"{name}_seed{seed}", overrides, steps=arm_steps,
                            cache_dir=cache_dir_of(cache_root, spec.cache) if spec.cache else None,
                            timeout_s=timeout_s * spec.multiple))
    return runs


def run_phase(runs: list[Run], config: str, parallel: int, cloze: bool) -> list[str]:
    todo = pending(runs, cloze)
    # Longest first: the two slots finish close together.
    todo.sort(key=lambda r: (r.stage != "train", -ARMS[r.arm].multiple))
    logger.info(f"{len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} with work left, {parallel} at a time")
    return run_all(todo, config, parallel, cloze)


def report(options, args: TrainArgs, runs: list[Run], cache_root: Path, cache_names: list[str], extra_setup: dict,
           out: Path, started: float) -> dict:
    """results.json, table.md and kd_study.png from the finished runs on disk."""
    tokens_per_step = args.grad_acc_steps * args.data.batch_size * args.data.seq_len
    finished = [run for run in runs if run_finished(run.dump_dir, run.steps)]
    missing = [f"{run.arm} seed {run.seed}" for run in runs if run not in finished]
    arms = collect(finished, tokens_per_step)
    token_multipliers(arms)
    caches = {}
    for name in cache_names:
        cache_dir = cache_dir_of(cache_root, name)
        if not cache_is_complete(cache_dir):
            continue
        manifest = CacheManifest.read(cache_dir)
        record = build_record_path(cache_dir)
        cached_tokens = manifest.streams * manifest.sequences_per_stream * manifest.data["seq_len"]
        caches[name] = {"dir": str(cache_dir), "output": manifest.output, "k": manifest.k,
                        "wire_dtype": manifest.wire_dtype, "tokens": cached_tokens,
                        "bytes_per_token": cache_bytes_per_token(manifest.output, manifest.k, manifest.wire_dtype,
                                                                 manifest.vocab_size, manifest.version,
                                                                 manifest.data["seq_len"]),
                        "disk_bytes": sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file()),
                        "build_s": json.loads(record.read_text())["wall_s"] if record.is_file() else None,
                        "runs_reading": sum(len(arm["seeds"]) for n, arm in arms.items()
                                            if n in ARMS and ARMS[n].cache == name)}
    student = student_flops_per_token(args)
    teacher = teacher_flops_per_token(args.distillation.teacher_path, args.data.seq_len)
    for cache in caches.values():
        cache["teacher_flops"] = teacher["forward_per_token"] * cache["tokens"]
    add_flops(arms, student["train_per_token"], teacher["forward_per_token"], caches)
    teacher_ce = next((teacher_heldout_ce(Path(c["dir"])) for c in caches.values()
                       if teacher_heldout_ce(Path(c["dir"])) is not None), None)
    walls = [s["wall_s"] for arm in arms.values() for s in arm["seeds"].values() if s.get("wall_s")]
    stamps = [json.loads((r.dump_dir / "study_run.json").read_text()) for r in finished
              if (r.dump_dir / "study_run.json").is_file()]
    results = {
        "setup": {"config": options.config, "overrides": list(options.overrides), "steps": args.steps,
                  "seeds": sorted({int(s) for arm in arms.values() for s in arm["seeds"]}),
                  "tokens_per_run": args.steps * tokens_per_step, "eval_every": args.heldout.every,
                  "student": {k: getattr(args.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
                  "teacher": args.distillation.teacher_path, "k": args.distillation.k, "temperature": args.distillation.temperature,
                  "parallel": options.parallel, **extra_setup},
        "teacher_heldout_ce": teacher_ce,
        "arms": arms,
        "caches": caches,
        "compute": {"student": student, "teacher": teacher,
                    "counted": "training FLOPs: student 6N+12LDS per trained token (the trainer's MFU formula), "
                               "teacher one forward 2N+4LDS per trained token (online) or per cached token (the "
                               "cache's build, shared by the runs reading it); the teacher's held-out reference "
                               "and every held-out/cloze eval are not counted"},
        "cache_build_s": {name: c["build_s"] for name, c in caches.items()},
        "runs_wall_s": sum(walls),
        "runs_span": {"first_started": min((s["started"] for s in stamps), default=None),
                      "last_finished": max((s["finished"] for s in stamps), default=None)},
        "study_wall_s": time.perf_counter() - started,
        "finished": now_iso(),
    }
    if missing:
        results["missing_runs"] = missing
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    png = plot(results, out)
    print(table(results))
    print(f"results: {out / 'results.json'}, plot: {png}, table: {out / 'table.md'}")
    return results


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m apps.studies.kd",
                                     description=apps.studies.kd.__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help=f"default {CONFIG} ({GPU_CONFIG} with --wall --device)")
    parser.add_argument("--out", default="dumps/kd_study", help="runs, results.json, kd_study.png, table.md")
    parser.add_argument("--cache-root", default=None, help="where cache_topk64/, cache_sampled64/ live (default: --out)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--ce-multiples", default="auto", help="auto (1x, 2x, and 4x only when the 2x CE arm does not "
                        "reach some KD arm's final held-out CE) or the CE budgets to run, e.g. 1,2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="training steps of a 1x run (default: the config's)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time, one CPU thread each")
    parser.add_argument("--cache-ranks", type=int, default=None, help="teacher ranks writing a cache (default 2; "
                        "with --device it is written by this process)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per 1x run (a 2x run gets twice ...)")
    parser.add_argument("--cache-timeout", type=float, default=3 * 3600, help="seconds per cache build")
    parser.add_argument("--no-cloze", action="store_true", help=f"skip the {CLOZE_TASK} eval of each final checkpoint")
    parser.add_argument("--report-only", action="store_true", help="re-render results.json, table.md and the plot "
                        "from the runs already in --out, without training")
    wall = parser.add_argument_group("the data wall (--wall): U unique tokens read for E epochs (apps/studies/kd/"
                                     "wall.py)")
    wall.add_argument("--wall", action="store_true", help="run the data-wall study instead of the one-pass one")
    wall.add_argument("--unique-tokens", type=int, default=None, help="U: whole steps of the config's tokens "
                      "(default 16384; 2097152 with --device, 256 with --tiny)")
    wall.add_argument("--epochs", default=None, help="the budgets E, in reads of the U tokens (default 1,2,4,8,16; "
                      "1,4,8 with --device, 1,2 with --tiny)")
    wall.add_argument("--wall-arms", default=None, help=f"comma list of {', '.join(WALL_ARMS)} (default all; "
                      f"ce,ce_wd10x,kd_sampled64 with --device)")
    wall.add_argument("--wall-seeds", default=None, help="seeds at every E (default 0,1; 0 with --tiny)")
    wall.add_argument("--wall-end-seeds", default=None, help="more seeds at the smallest and the largest E "
                      "(default 2; none with --device)")
    wall.add_argument("--device", default=None, help="cuda or cpu: every run in this one process, the caches "
                      "written once (apps/studies/kd/wall_inprocess.py); without it each run is a launch")
    wall.add_argument("--tiny", action="store_true", help="with --device: the same study at a size a CPU finishes "
                      "in seconds (the test suite's version)")
    parser.add_argument("overrides", nargs="*", help="training overrides shared by every run (key=value)")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kd_study: %(message)s")
    if options.wall:
        return wall_study(options)
    if options.device or options.tiny:
        raise ConfigError("--device and --tiny belong to the data-wall study; add --wall.")
    options.config = options.config or CONFIG
    options.cache_ranks = options.cache_ranks or 2

    names = [a for a in options.arms.split(",") if a]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arm(s) {', '.join(unknown)}; use some of {', '.join(ARMS)}.")
    multiples = parse_multiples(options.ce_multiples)
    seeds = [int(s) for s in options.seeds.split(",")]
    overrides = list(options.overrides) + ([f"steps={options.steps}"] if options.steps else [])
    args = study_args(options.config, overrides)
    if options.steps and args.steps % args.heldout.every:
        overrides.append(f"heldout.every={math.gcd(args.steps, args.heldout.every)}")
        args = study_args(options.config, overrides)
    check_inputs(args)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_root = Path(options.cache_root or out)
    cache_names = sorted({ARMS[n].cache for n in names if ARMS[n].cache}, key=list(CACHES).index)
    # A SIGTERM (kill PID) ends the study like Ctrl-C: run_all's finally stops the trainings it started.
    def on_sigterm(*_):
        logger.error("SIGTERM: stopping the runs in progress (rerun the same command to resume the study)")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.perf_counter()

    phase_one = [n for n in names if not ARMS[n].is_ce or ce_arm_wanted(n, multiples)]
    all_runs = plan_runs(names, seeds, out, cache_root, overrides, args.steps, options.timeout)
    if options.report_only:
        on_disk = [r for r in all_runs if r.arm in phase_one or run_finished(r.dump_dir, r.steps)]
        arms = collect([r for r in on_disk if run_finished(r.dump_dir, r.steps)],
                       args.grad_acc_steps * args.data.batch_size * args.data.seq_len)
        needed, reason = conditional_arm_needed(arms)
        ran = CONDITIONAL_ARM in arms
        extra = {"ce_multiples": options.ce_multiples,
                 "ce_4x": {"needed": needed, "ran": ran, "reason": reason}}
        return report(options, args, on_disk, cache_root, cache_names, extra, out, started)

    for name in cache_names:
        build_cache(options.config, overrides + list(CACHES[name]), cache_dir_of(cache_root, name),
                    options.cache_ranks, options.cache_timeout)
    cloze = not options.no_cloze
    runs = [r for r in all_runs if r.arm in phase_one]
    failures = run_phase(runs, options.config, options.parallel, cloze)
    decision = {"ce_multiples": options.ce_multiples}
    if CONDITIONAL_ARM in names and CONDITIONAL_ARM not in phase_one:
        arms = collect([r for r in runs if run_finished(r.dump_dir, r.steps)],
                       args.grad_acc_steps * args.data.batch_size * args.data.seq_len)
        needed, reason = conditional_arm_needed(arms)
        decision["ce_4x"] = {"needed": needed, "ran": needed, "reason": reason}
        logger.info(f"{CONDITIONAL_ARM}: {'running it' if needed else 'not needed'}: {reason}")
        if needed:
            extra_runs = [r for r in all_runs if r.arm == CONDITIONAL_ARM]
            failures += run_phase(extra_runs, options.config, options.parallel, cloze)
            runs += extra_runs
    elif CONDITIONAL_ARM in phase_one:
        decision["ce_4x"] = {"needed": None, "ran": True, "reason": f"forced by --ce-multiples {options.ce_multiples}"}
    results = report(options, args, runs, cache_root, cache_names, decision, out, started)
    if failures:
        raise RunFailed(f"{len(failures)} job(s) failed (rerun the same command to retry them; finished runs are "
                           f"kept): " + " | ".join(failures))
    return results
