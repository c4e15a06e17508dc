"""The data-wall mode (`--wall`): U unique tokens read for E epochs; when does the teacher beat CE-only?

    python -m apps.studies.kd --wall --unique-tokens 16384 --out dumps/kd_wall            # the study
    python -m apps.studies.kd --wall --unique-tokens 2048 --epochs 1,2 --wall-seeds 0 --wall-end-seeds '' \\
        --out /tmp/kd_wall_pilot heldout.max_batches=4                                            # the pipeline
    python -m apps.studies.kd --wall --unique-tokens 16384 --out dumps/kd_wall --report-only

The U tokens are the first U / seq_len windows of the config's data, written once per output format into a
teacher cache (`cache_topk64`, `cache_sampled64`: the teacher paid once, over U). Every arm trains from a cache, so
every arm reads the very same windows in the same order, epoch after epoch (the cache loader loops over its
shards):

    ce            alpha = 0: the cache's tokens, its teacher outputs ignored (the loss is exactly CE), weight decay
                  as the config has it (the trainer's default, 0.1)
    ce_wd10x      the same with 10x the weight decay, so that a KD win is not only regularisation (Kim et al. 2025,
                  arXiv 2509.14786, move the data-constrained frontier with weight decay far above the usual)
    kd_topk64     alpha = 0.5 against the top-64 cache
    kd_sampled64  alpha = 0.5 against the sampled-64 cache

The schedule: one separate run per (arm, E, seed), each with the config's full warmup + cosine schedule over its
own E x U tokens (warmup a tenth of its steps). Every arm and every budget gets the schedule it would get as a run
of that length; nothing is branched from a run tuned for another budget, which is what makes it fair to each arm,
at the price of 31 U tokens per arm and seed over the five budgets instead of 16 U and the cooldowns. Each run is
evaluated once, at its end, on the whole held-out split (data no run trains on), then its final checkpoint is
scored on pydocs_cloze. Seeds: `--wall-seeds` at every E, `--wall-end-seeds` also at the smallest and largest E.
"""

import logging
import math
from pathlib import Path

from apps.studies.kd import wall_inprocess
from apps.studies.kd.arms import CACHES, CONFIG, WALL_ARMS, WallRun, check_inputs, study_args
from apps.studies.kd.disk import cache_dir_of, run_finished
from apps.studies.kd.launch import build_cache, pending, run_all
from apps.studies.kd.wall_report import report
from lingua.errors import ConfigError, RunFailed

logger = logging.getLogger("kd_study")


def ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def windows_of(unique_tokens: int, args) -> int:
    """U as whole training steps' windows; one sentence when it is not."""
    per_step = args.grad_acc_steps * args.data.batch_size * args.data.seq_len
    if unique_tokens < per_step or unique_tokens % per_step:
        raise ConfigError(f"--unique-tokens {unique_tokens} must be a positive multiple of one step's tokens "
                          f"({args.grad_acc_steps} x {args.data.batch_size} x {args.data.seq_len} = {per_step}), "
                          f"e.g. {max(1, unique_tokens // per_step) * per_step}.")
    return unique_tokens // args.data.seq_len


def plan_wall_runs(options, base: list[str], steps_per_epoch: int, out: Path, cache_root: Path) -> list[WallRun]:
    """Every (arm, E, seed) of the study, longest first."""
    epochs, seeds, end_seeds = ints(options.epochs), ints(options.wall_seeds), ints(options.wall_end_seeds)
    runs = []
    for name in [a for a in options.wall_arms.split(",") if a]:
        arm = WALL_ARMS[name]
        for e in epochs:
            steps = e * steps_per_epoch
            overrides = [*base, *arm.overrides, *CACHES[arm.cache], f"steps={steps}", f"heldout.every={steps}",
                         f"optim.warmup={max(1, steps // 10)}"]
            for seed in seeds + [s for s in end_seeds if e in (epochs[0], epochs[-1]) and s not in seeds]:
                runs.append(WallRun(name, seed, out / "runs" / f"{name}_e{e}_seed{seed}", overrides, steps=steps,
                                    cache_dir=cache_dir_of(cache_root, arm.cache),
                                    timeout_s=options.timeout * e, epochs=e))
    return sorted(runs, key=lambda r: -r.steps)


def check_options(options):
    """The wall options in one sentence each when they name nothing runnable; returns them."""
    if options.device:  # the in-process mode fills its own defaults first
        wall_inprocess.resolve_defaults(options)
    unknown = [a for a in options.wall_arms.split(",") if a and a not in WALL_ARMS]
    if unknown:
        raise ConfigError(f"unknown wall arm(s) {', '.join(unknown)}; use some of {', '.join(WALL_ARMS)}.")
    if not ints(options.epochs) or not ints(options.wall_seeds) or min(ints(options.epochs)) < 1:
        raise ConfigError(f"--epochs {options.epochs!r} --wall-seeds {options.wall_seeds!r}: name at least one "
                          f"epoch count (>= 1) and one seed.")
    return options


LAUNCHED_DEFAULTS = {"config": CONFIG, "unique_tokens": 16384, "epochs": "1,2,4,8,16", "wall_seeds": "0,1",
                     "wall_end_seeds": "2", "wall_arms": ",".join(WALL_ARMS), "cache_ranks": 2}


def main(options) -> dict:
    """The data-wall study: caches over U, every run, the report (or only the report); with --device, every run
    in this process (wall_inprocess.py)."""
    if options.device:
        return wall_inprocess.main(check_options(options), plan_wall_runs, windows_of)
    if options.tiny:
        raise ConfigError("--tiny sizes the in-process study; add --device cpu (or cuda).")
    for key, value in LAUNCHED_DEFAULTS.items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    check_options(options)
    args = study_args(options.config, list(options.overrides))
    args.heldout.every = args.steps  # a wall run evaluates once, at its end
    check_inputs(args)
    windows = windows_of(options.unique_tokens, args)
    steps_per_epoch = windows // (args.grad_acc_steps * args.data.batch_size)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_root = Path(options.cache_root or out)
    runs = plan_wall_runs(options, list(options.overrides), steps_per_epoch, out, cache_root)
    cache_names = sorted({WALL_ARMS[r.arm].cache for r in runs}, key=list(CACHES).index)
    failures = []
    if not options.report_only:
        shard = math.gcd(windows, 64)
        for name in cache_names:
            build_cache(options.config, [*options.overrides, *CACHES[name], f"sequences_per_stream={windows}",
                                         f"shard_sequences={shard}"],
                        cache_dir_of(cache_root, name), options.cache_ranks, options.cache_timeout)
        todo = pending(runs, not options.no_cloze)
        logger.info(f"data wall: U = {options.unique_tokens} tokens ({steps_per_epoch} steps an epoch), {len(runs)} "
                    f"runs, {len(runs) - len(todo)} done, {len(todo)} with work left, {options.parallel} at a time")
        failures = run_all(todo, options.config, options.parallel, not options.no_cloze)
    finished = [r for r in runs if run_finished(r.dump_dir, r.steps)]
    results = report(options, args, runs, finished, cache_root, cache_names, out)
    if failures:
        raise RunFailed(f"{len(failures)} job(s) failed (rerun the same command to retry them; finished runs are "
                        f"kept): " + " | ".join(failures))
    return results
