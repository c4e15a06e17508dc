"""The KD-vs-CE study: what is the teacher worth to a small student, in CE tokens, in FLOPs, downstream?

    python -m apps.bench.kd_study --out dumps/kd_study          # caches, 5-6 arms x 3 seeds, cloze evals, report
    python -m apps.bench.kd_study --seeds 0 --steps 8 --out /tmp/kd_quick heldout.max_batches=4   # the pipeline, minutes
    python -m apps.bench.kd_study --out dumps/kd_study --report-only   # re-render from the runs on disk

Setup (configs/distill_exps/kd_study.yaml): SmolLM2-135M-Instruct teaches a 7M student that uses its
tokenizer, on the embedded Python-docs corpus. The teacher's outputs are written once per output format by
`apps.main.teacher_cache` (`<cache-root>/cache_topk64`, `cache_sampled64`; skipped when complete), laid
out for one student (`streams=1`), so a run from a cache reads exactly the windows a plain one-rank
DataLoader yields, in the same order. The arms:

    ce            CE only (enable_distillation=false) on the raw corpus, the KD arms' tokens (1x)
    ce_2x         the same with 2x the steps (its own full lr schedule); its windows after the 1x budget
                  follow on from the cached ones (the loader loops over the training split, epoch by epoch)
    ce_4x         4x: with `--ce-multiples auto` only when some KD arm's final held-out CE is below its
                  seed's ce_2x final (else the 2x curve already brackets every KD result)
    kd_topk64     alpha = 0.5, T = 1, forward KL against the cached top-64 outputs (+ the tail bucket)
    kd_topk64_lr  the same with alpha following the lr schedule (KD early, CE as the lr decays)
    kd_sampled64  alpha = 0.5 against 64 ids sampled from the teacher per position (an unbiased
                  Monte-Carlo forward KL), from its own cache: the same 388 bytes per token as top-64

A seed is the student's init (`model.seed`): seed s of every arm starts from the same weights and reads
the same windows, so arms compare paired. Each run evaluates the whole held-out split every `heldout.every`
steps; after it ends its final checkpoint is scored on `pydocs_cloze` (`apps.main.eval`).

Reported (results.json, table.md, kd_study.png): per arm and seed the held-out curve and final CE,
`token_multiplier` of each KD arm (the CE tokens at which CE-only reaches the KD arm's final held-out
CE, interpolated between the CE budgets' finals in log-tokens, per seed), `cloze_acc`, and `flops`
(student, teacher online, teacher cache amortized over the runs that read it). Finished runs and evals
are kept: rerunning resumes a study; an unfinished run restarts from scratch.
"""

import argparse
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from apps.bench.runs import ROOT, torchrun_command
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
CLOZE_TASK = "pydocs_cloze"
EVAL_TIMEOUT_S = 1800.0
POLL_S = 2.0


@dataclass(frozen=True)
class Arm:
    overrides: tuple[str, ...]  # the arm's own training settings (on top of the config and shared overrides)
    cache: Optional[str] = None  # the teacher cache it trains from (a CACHES key); None: raw corpus, no teacher
    multiple: int = 1  # its tokens, in multiples of the KD arms' (steps x multiple)

    @property
    def is_ce(self) -> bool:
        return self.cache is None


CE_ONLY = ("enable_distillation=false",)
ARMS = {
    "ce": Arm(CE_ONLY),
    "ce_2x": Arm(CE_ONLY, multiple=2),
    "ce_4x": Arm(CE_ONLY, multiple=4),
    "kd_topk64": Arm(("distillation.alpha=0.5",), cache="topk64"),
    "kd_topk64_lr": Arm(("distillation.alpha=0.5", "distillation.alpha_schedule=lr"), cache="topk64"),
    "kd_sampled64": Arm(("distillation.alpha=0.5",), cache="sampled64"),
}
CACHES = {
    "topk64": ("distillation.output=topk", "distillation.k=64"),
    "sampled64": ("distillation.output=sampled", "distillation.k=64"),
}
CONDITIONAL_ARM = "ce_4x"  # run by `--ce-multiples auto` only when the 2x budget does not reach a KD result


@dataclass
class Run:
    arm: str
    seed: int
    dump_dir: Path
    overrides: list[str]  # everything after config=: shared, the arm's, its cache's, steps
    steps: int = 0
    cache_dir: Optional[Path] = None
    timeout_s: float = 3600.0
    stage: str = "train"  # "train", then "cloze" (the downstream eval of its final checkpoint)
    wall_s: Optional[float] = None  # seconds the training took, once finished
    started_at: float = 0.0  # perf_counter() when the current stage was launched
    started_unix: float = 0.0
    process: Optional[subprocess.Popen] = field(default=None, repr=False)


# ---- inputs


def study_args(config: str, overrides: list[str]) -> TrainArgs:
    """The training config every run shares (readable errors for a bad override come from here)."""
    return parse_args(TrainArgs, [f"config={config}", *overrides])


def check_inputs(args: TrainArgs) -> None:
    if args.heldout.every < 1 or args.steps % args.heldout.every:
        raise ConfigError(f"heldout.every={args.heldout.every} must divide steps={args.steps} so every run ends on an "
                          f"evaluation.")
    if not any(list_val_files(args.data.root_dir, source) for source in args.data.sources):
        raise DataError(f"no held-out *.val.jsonl under {args.data.root_dir}; run `python -m "
                        f"setup.prepare_corpus` (or `bash setup/demo.sh`, which also prepares the teacher).")
    check_teacher_dir(args.distillation.teacher_path)


def parse_multiples(text: str) -> Optional[list[int]]:
    """`auto` -> None (1x and 2x, 4x when needed); else the CE multiples to run, e.g. "1,2,4"."""
    if text.strip() == "auto":
        return None
    multiples = sorted({int(m) for m in text.split(",") if m.strip()})
    known = {arm.multiple for arm in ARMS.values() if arm.is_ce}
    if not multiples or set(multiples) - known:
        raise ConfigError(f"--ce-multiples {text!r}: use auto or a comma list of {', '.join(map(str, sorted(known)))}.")
    return multiples


def ce_arm_wanted(name: str, multiples: Optional[list[int]]) -> bool:
    """Phase one's CE arms: the forced multiples, or (auto) every CE arm but the conditional one."""
    arm = ARMS[name]
    return arm.multiple in multiples if multiples is not None else name != CONDITIONAL_ARM


# ---- caches


def cache_is_complete(cache_dir: Path) -> bool:
    return (cache_dir / INDEX).exists()


def cache_dir_of(root: Path, cache: str) -> Path:
    return root / f"cache_{cache}"


def build_record_path(cache_dir: Path) -> Path:
    return cache_dir.with_name(cache_dir.name + ".build.json")


def build_cache(config: str, overrides: list[str], cache_dir: Path, ranks: int, timeout_s: float) -> Optional[float]:
    """Writes the teacher cache on `ranks` ranks; returns its wall seconds (None when it was already complete)."""
    if cache_is_complete(cache_dir):
        logger.info(f"teacher cache {cache_dir} is complete: reusing it")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info(f"writing the teacher cache on {ranks} rank(s) into {cache_dir} (log: {cache_dir}.log)")
    command = torchrun_command(ranks, "apps.main.teacher_cache", [
        f"config={config}", *overrides, f"cache_dir={cache_dir}", "streams=1"])
    start = time.perf_counter()
    process = popen_logged(command, Path(f"{cache_dir}.log"))
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


def cache_bytes_per_token(output: str, k: int, wire_dtype: str, vocab_size: Optional[int] = None) -> dict:
    """What the teacher sends per token on the bridge (lingua/kd_loss.py: k * (w + 4) + 4 for topk and sampled,
    int32 ids) and what a cache shard stores (ids in uint16 when the vocab fits, plus the token and doc id)."""
    import torch

    from lingua.distillation.args import WIRE_DTYPES

    w = WIRE_DTYPES[wire_dtype].itemsize
    ids = 2 if vocab_size is not None and vocab_size <= 2**16 else 4
    bridge = k * (w + 4) + 4
    return {"bridge": bridge, "cache_shard": k * (w + ids) + 4 + torch.int32.itemsize + torch.int16.itemsize}


def teacher_heldout_ce(cache_dir: Path) -> Optional[float]:
    return CacheManifest.read(cache_dir).teacher_heldout_ce


# ---- runs


def run_finished(dump_dir: Path, steps: int) -> bool:
    return steps in eval_rows(dump_dir) if (dump_dir / "metrics.jsonl").exists() else False


def final_step_dir(dump_dir: Path) -> Optional[Path]:
    """The newest finished checkpoint step directory of a run, or None."""
    root = Path(dump_dir) / "checkpoints"
    steps = sorted(p for p in root.glob("[0-9]" * 10) if (p / "params.json").is_file()) if root.is_dir() else []
    return steps[-1] if steps else None


def cloze_json(dump_dir: Path, steps: int) -> Optional[Path]:
    """The eval.json of the run's final checkpoint (step `steps`), if that checkpoint is on disk."""
    step_dir = final_step_dir(dump_dir)
    if step_dir is None or int(step_dir.name) != steps:
        return None
    return step_dir / "eval.json"


def cloze_done(dump_dir: Path, steps: int) -> bool:
    path = cloze_json(dump_dir, steps)
    return path is not None and path.is_file()


def now_iso(unix: Optional[float] = None) -> str:
    return datetime.fromtimestamp(unix if unix is not None else time.time(), timezone.utc).isoformat(timespec="seconds")


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


# ---- results


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def read_cloze(dump_dir: Path, steps: int) -> Optional[dict]:
    """{acc, acc_norm, n} of the final checkpoint's pydocs_cloze, or None when it was not scored."""
    path = cloze_json(dump_dir, steps)
    if path is None or not path.is_file():
        return None
    task = json.loads(path.read_text()).get("tasks", {}).get(CLOZE_TASK)
    if task is None:
        return None
    return {"acc": task["acc"], "acc_norm": task.get("acc_norm"), "n": task.get("n_samples")}


def read_wall_s(dump_dir: Path) -> Optional[float]:
    path = Path(dump_dir) / "study_run.json"
    return json.loads(path.read_text())["wall_s"] if path.is_file() else None


def collect(runs: list[Run], tokens_per_step: int) -> dict:
    """results.json's `arms`: per arm its settings, per seed the held-out curve, final CE, tokens, cloze, and
    the spreads; `minus_ce_paired` = the arm minus the 1x CE arm, seed by seed (same init, same windows)."""
    arms: dict = {}
    for run in runs:
        rows = eval_rows(run.dump_dir)
        curve = [{"step": step, "tokens": step * tokens_per_step, "heldout_ce": rows[step]["eval/loss"]}
                 for step in sorted(rows)]
        spec = ARMS[run.arm]
        arm = arms.setdefault(run.arm, {"overrides": list(spec.overrides) + list(CACHES.get(spec.cache, ())),
                                        "source": f"cache_{spec.cache}" if spec.cache else "corpus",
                                        "multiple": spec.multiple, "steps": run.steps, "seeds": {}})
        seed = {"final_heldout_ce": curve[-1]["heldout_ce"], "heldout": curve, "tokens": run.steps * tokens_per_step,
                "wall_s": run.wall_s if run.wall_s is not None else read_wall_s(run.dump_dir)}
        cloze = read_cloze(run.dump_dir, run.steps)
        if cloze is not None:
            seed.update(cloze_acc=cloze["acc"], cloze_acc_norm=cloze["acc_norm"], cloze_n=cloze["n"])
        arm["seeds"][str(run.seed)] = seed
    order = list(ARMS)  # the arms in ARMS's order (CE budgets, then KD), whichever phase ran them
    arms = dict(sorted(arms.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    for name, arm in arms.items():
        arm["seeds"] = dict(sorted(arm["seeds"].items(), key=lambda kv: int(kv[0])))
        arm["tokens"] = next(iter(arm["seeds"].values()))["tokens"]
        finals = [seed["final_heldout_ce"] for seed in arm["seeds"].values()]
        arm["final_heldout_ce"] = spread(finals)
        accs = [seed["cloze_acc"] for seed in arm["seeds"].values() if "cloze_acc" in seed]
        if accs:
            arm["cloze_acc"] = spread(accs)
        if "ce" in arms and name != "ce":
            arm["minus_ce_paired"] = paired_difference(arm, arms["ce"])
    return arms


def paired_difference(arm: dict, base: dict) -> Optional[dict]:
    diffs = [seed["final_heldout_ce"] - base["seeds"][s]["final_heldout_ce"]
             for s, seed in arm["seeds"].items() if s in base["seeds"]]
    return spread(diffs) if diffs else None


def interpolate_multiplier(ce_finals: dict[float, float], kd_final: float) -> dict:
    """The CE tokens (a multiple of the KD arm's) at which CE-only reaches `kd_final`.

    `ce_finals`: CE budget multiple -> that budget's final held-out CE (each a complete lr schedule).
    Linear in log(tokens) between the two budgets that bracket `kd_final` (the first such pair, smallest
    budgets first). KD worse than the 1x CE gives {"value": None, "at_most": 1.0} (no extrapolation
    below 1x); KD below every budget gives {"value": None, "at_least": the largest multiple}.
    """
    points = sorted(ce_finals.items())
    if not points:
        return {"value": None}
    first_m, first_ce = points[0]
    if kd_final > first_ce:
        return {"value": None, "at_most": float(first_m)}
    for i, (m0, c0) in enumerate(points):
        if c0 == kd_final:  # an exact hit on a budget
            return {"value": float(m0), "between": [m0, m0]}
        if i + 1 < len(points) and c0 > kd_final > points[i + 1][1]:
            m1, c1 = points[i + 1]
            frac = (c0 - kd_final) / (c0 - c1)
            return {"value": math.exp(math.log(m0) + frac * (math.log(m1) - math.log(m0))), "between": [m0, m1]}
    return {"value": None, "at_least": float(max(m for m, _ in points))}


def ce_curves(arms: dict) -> dict[str, dict[float, float]]:
    """seed -> {CE multiple: that CE arm's final held-out CE}."""
    curves: dict[str, dict[float, float]] = {}
    for name, arm in arms.items():
        if name in ARMS and ARMS[name].is_ce:
            for seed, values in arm["seeds"].items():
                curves.setdefault(seed, {})[float(ARMS[name].multiple)] = values["final_heldout_ce"]
    return curves


def token_multipliers(arms: dict) -> None:
    """Adds `token_multiplier {mean, min, max, per_seed}` to every KD arm (mean/min/max over the seeds where
    it is a value; bounds stay per seed) and `ce_tokens_equivalent` (the mean multiplier x the arm's tokens)."""
    curves = ce_curves(arms)
    for name, arm in arms.items():
        if name not in ARMS or ARMS[name].is_ce:
            continue
        per_seed = {seed: interpolate_multiplier(curves.get(seed, {}), values["final_heldout_ce"])
                    for seed, values in arm["seeds"].items()}
        values = [v["value"] for v in per_seed.values() if v["value"] is not None]
        arm["token_multiplier"] = {"mean": statistics.fmean(values) if values else None,
                                   "min": min(values) if values else None, "max": max(values) if values else None,
                                   "per_seed": per_seed}
        arm["ce_tokens_equivalent"] = arm["token_multiplier"]["mean"] * arm["tokens"] if values else None


def conditional_arm_needed(arms: dict) -> tuple[bool, str]:
    """Whether ce_4x must run: some (KD arm, seed) final below that seed's ce_2x final (the 2x curve does not
    reach it). Returns (needed, the reason in a sentence)."""
    if "ce_2x" not in arms:
        return False, "ce_2x was not run, so there is no 2x curve to decide on"
    below = [f"{name} seed {seed} ({values['final_heldout_ce']:.4f} < {arms['ce_2x']['seeds'][seed]['final_heldout_ce']:.4f})"
             for name, arm in arms.items() if name in ARMS and not ARMS[name].is_ce
             for seed, values in arm["seeds"].items()
             if seed in arms["ce_2x"]["seeds"]
             and values["final_heldout_ce"] < arms["ce_2x"]["seeds"][seed]["final_heldout_ce"]]
    if below:
        return True, "below its seed's ce_2x final: " + ", ".join(below)
    return False, "every KD arm's final held-out CE is above its seed's ce_2x final (the 2x budget reaches it)"


# ---- compute


def count_safetensors_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def teacher_flops_per_token(teacher_dir: str, seq_len: int) -> dict:
    """One teacher forward per token: the forward third of the trainer's formula (6N + 12*L*D*S)/3 = 2N + 4*L*D*S,
    N = the matmul parameters (every parameter when the head is tied to the embedding, else all but the
    embedding lookup)."""
    from apps.main.transformer import get_num_flop_per_token

    config = json.loads((Path(teacher_dir) / "config.json").read_text())
    n_params = count_safetensors_params(Path(teacher_dir))
    embedding = config["vocab_size"] * config["hidden_size"]
    matmul = n_params if config.get("tie_word_embeddings", False) else n_params - embedding
    per_token = get_num_flop_per_token(matmul, config["num_hidden_layers"], config["hidden_size"], seq_len) / 3
    return {"params": n_params, "matmul_params": matmul, "forward_per_token": per_token}


def student_flops_per_token(args: TrainArgs) -> dict:
    """The trainer's own count (apps/main/train.py, its MFU): 6N + 12*L*D*S per trained token, N the
    parameters less the embedding lookup (tied: the head is the only copy, counted once)."""
    import torch

    from apps.main.transformer import LMTransformer, get_num_flop_per_token
    from lingua.tokenizer import build_tokenizer

    vocab = build_tokenizer(args.data.tokenizer).n_words
    with torch.device("meta"):
        model = LMTransformer(replace(args.model, vocab_size=vocab))
    n_params = sum(p.numel() for p in model.parameters())
    matmul = n_params - (0 if args.model.tie_embeddings else vocab * args.model.dim)
    return {"params": n_params, "matmul_params": matmul, "train_per_token": get_num_flop_per_token(
        matmul, args.model.n_layers, args.model.dim, args.data.seq_len)}


def add_flops(arms: dict, student_per_token: float, teacher_per_token: float, caches: dict) -> None:
    """Per arm and seed (`flops`, and the arm's mean): training FLOPs only (held-out evals left out).

    student              student_per_token x tokens trained
    teacher_online       teacher_per_token x tokens trained (online KD: the teacher runs with every run)
    teacher_cache_amortized  the cache's build (teacher_per_token x its cached tokens) / the runs reading it
    total_online / total_cache  student + the teacher's share either way (CE-only: the student alone)
    """
    for name, arm in arms.items():
        is_kd = name in ARMS and ARMS[name].cache is not None
        cache = caches.get(ARMS[name].cache) if is_kd else None
        for seed in arm["seeds"].values():
            student = student_per_token * seed["tokens"]
            online = teacher_per_token * seed["tokens"] if is_kd else 0.0
            amortized = cache["teacher_flops"] / max(cache["runs_reading"], 1) if cache is not None else 0.0
            seed["flops"] = {"student": student, "teacher_online": online, "teacher_cache_amortized": amortized,
                             "total_online": student + online, "total_cache": student + amortized}
        keys = next(iter(arm["seeds"].values()))["flops"]
        arm["flops"] = {key: statistics.fmean(s["flops"][key] for s in arm["seeds"].values()) for key in keys}


def curve_flops(arm_name: str, tokens: float, results: dict, mode: str) -> float:
    """Total training FLOPs at `tokens` into a run: online pays the teacher per token, the cache its share up front."""
    compute = results["compute"]
    student = compute["student"]["train_per_token"] * tokens
    spec = ARMS.get(arm_name)
    if spec is None or spec.cache is None:
        return student
    if mode == "online":
        return student + compute["teacher"]["forward_per_token"] * tokens
    cache = results["caches"].get(spec.cache)
    return student + (cache["teacher_flops"] / max(cache["runs_reading"], 1) if cache else 0.0)


# ---- report


COLORS = {"ce": "#6baed6", "ce_2x": "#2171b5", "ce_4x": "#08306b", "kd_topk64": "tab:orange",
          "kd_topk64_lr": "tab:red", "kd_sampled64": "tab:green"}


def mean_curve(arm: dict) -> tuple[list[float], list[float], list[float], list[float]]:
    curves = [seed["heldout"] for seed in arm["seeds"].values()]
    n = min(len(c) for c in curves)
    tokens = [curves[0][i]["tokens"] for i in range(n)]
    losses = [[curve[i]["heldout_ce"] for curve in curves] for i in range(n)]
    return tokens, [statistics.fmean(v) for v in losses], [min(v) for v in losses], [max(v) for v in losses]


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, flop_ax, final_ax) = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    arms = results["arms"]
    names = list(arms)
    teacher = results.get("teacher_heldout_ce")
    for name, arm in arms.items():
        tokens, mean, low, high = mean_curve(arm)
        color = COLORS.get(name)
        is_ce = name in ARMS and ARMS[name].is_ce
        # CE budgets share their early tokens' region: the smaller budget is drawn on top.
        style = dict(linestyle="-" if is_ce else "--", zorder=3 - math.log2(ARMS[name].multiple) / 4 if is_ce else 3)
        line, = ax.plot(tokens, mean, marker="o", markersize=3, color=color, label=f"{name} ({len(arm['seeds'])} seeds)",
                        **style)
        ax.fill_between(tokens, low, high, alpha=0.2, color=line.get_color())
        if results.get("compute"):
            modes = ["cache", "online"] if name in ARMS and ARMS[name].cache else ["cache"]
            for mode in modes:
                x = [curve_flops(name, t, results, mode) for t in tokens]
                label = name if mode == "cache" else f"{name}, online teacher"
                flop_ax.plot(x, mean, marker="o" if mode == "cache" else "x", markersize=3, color=line.get_color(),
                             linestyle="-" if mode == "cache" else ":", label=label, zorder=style["zorder"])
    # The CE-only budgets' finals (the curve the token multiplier interpolates on) and where each KD arm lands.
    ce_points = sorted((arm["tokens"], arm["final_heldout_ce"]["mean"]) for name, arm in arms.items()
                       if name in ARMS and ARMS[name].is_ce)
    if len(ce_points) > 1:
        ax.plot(*zip(*ce_points), color="black", linewidth=1, marker="D", markersize=4, alpha=0.7,
                label="CE-only finals per budget")
    for name, arm in arms.items():
        multiplier = arm.get("token_multiplier", {}).get("mean")
        if multiplier is not None:
            ax.plot([arm["tokens"], multiplier * arm["tokens"]], [arm["final_heldout_ce"]["mean"]] * 2,
                    color=COLORS.get(name, "gray"), linewidth=0.8, linestyle=":")
            ax.plot(multiplier * arm["tokens"], arm["final_heldout_ce"]["mean"], marker="*", markersize=10,
                    color=COLORS.get(name, "gray"))
    if teacher is not None:  # on the tokens panel only: the FLOPs panel keeps its y-axis on the students
        ax.axhline(teacher, color="black", linestyle="--", linewidth=1,
                   label=f"teacher ({Path(results['setup']['teacher']).name}) {teacher:.2f}")
    for axis in (ax, flop_ax):
        axis.set_xscale("log")
        axis.set_ylabel("held-out CE (nats/token)")
        axis.grid(alpha=0.3, which="both")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    ax.set_xlabel("training tokens (log)")
    ax.set_title("held-out CE vs tokens (band: min-max over seeds; *: KD = CE-only at N tokens)", fontsize=9)
    flop_ax.set_xlabel("total training FLOPs, student + teacher (log)")
    flop_ax.set_title("held-out CE vs training FLOPs (solid: teacher cache, its cost shared by the runs reading "
                      "it; dotted: online teacher)", fontsize=8)
    # Right: each seed's final held-out CE per arm, a seed's arms joined (they share init and data order).
    seeds = sorted({s for arm in arms.values() for s in arm["seeds"]}, key=int)
    for seed in seeds:
        points = [(i, arm["seeds"][seed]["final_heldout_ce"]) for i, arm in enumerate(arms.values())
                  if seed in arm["seeds"]]
        final_ax.plot(*zip(*points), marker="o", color="gray", alpha=0.6, linewidth=0.8)
    final_ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8, ha="right")
    final_ax.set_xlim(-0.5, len(names) - 0.5)
    final_ax.set_title("final held-out CE per seed", fontsize=9)
    final_ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "kd_study.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_tokens(tokens: float) -> str:
    if tokens >= 1e6:
        return f"{tokens / 1e6:.2f}M"
    if tokens >= 1e5:
        return f"{tokens / 1e3:.0f}k"
    return f"{tokens / 1e3:.1f}k" if tokens >= 1e3 else f"{tokens:.0f}"


def format_multiplier(tm: dict) -> str:
    """'1.83x (1.71-1.95)'; bounds as '>4x' / '<=1x' (with the count of seeds when they are mixed)."""
    per_seed = list(tm["per_seed"].values())
    n = len(per_seed)
    parts = []
    if tm["mean"] is not None:
        count = sum(v["value"] is not None for v in per_seed)
        parts.append(f"{tm['mean']:.2f}x ({tm['min']:.2f}-{tm['max']:.2f})" + (f" on {count}/{n} seeds" if count < n else ""))
    for key, sign in (("at_least", ">"), ("at_most", "<")):
        bounds = [v[key] for v in per_seed if key in v]
        if bounds:
            parts.append(f"{sign}{max(bounds) if key == 'at_least' else min(bounds):g}x" + (f" on {len(bounds)}/{n} seeds" if len(bounds) < n else ""))
    return "; ".join(parts)


def format_flops(value: float) -> str:
    return f"{value:.2e}" if value else "0"


def table(results: dict) -> str:
    arms = results["arms"]
    lines = ["| arm | settings | tokens | final held-out CE, mean ± std | per seed | minus CE-only (1x), paired by seed "
             "| = CE-only tokens (x of its own) | pydocs_cloze acc, mean (per seed) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        final = arm["final_heldout_ce"]
        seeds = ", ".join(f"{seed['final_heldout_ce']:.4f}" for seed in arm["seeds"].values())
        paired = arm.get("minus_ce_paired")
        diff = (f"{paired['mean']:+.4f} ({paired['min']:+.4f} to {paired['max']:+.4f})" if paired else "—")
        settings = " ".join(o.replace("distillation.", "") for o in arm["overrides"])
        if arm.get("steps") and arm.get("multiple", 1) != 1:
            settings += f" steps={arm['steps']}"
        tm = arm.get("token_multiplier")
        worth = "—"
        if tm is not None:
            worth = format_multiplier(tm)
            if arm.get("ce_tokens_equivalent"):
                worth = f"{format_tokens(arm['ce_tokens_equivalent'])}: {worth}"
        accs = [seed.get("cloze_acc") for seed in arm["seeds"].values()]
        cloze = (f"{arm['cloze_acc']['mean']:.3f} ({', '.join(f'{a:.3f}' for a in accs if a is not None)})"
                 if "cloze_acc" in arm else "—")
        lines.append(f"| {name} | {settings} | {format_tokens(arm['tokens'])} | {final['mean']:.4f} ± {final['std']:.4f} "
                     f"| {seeds} | {diff} | {worth} | {cloze} |")
    teacher = results.get("teacher_heldout_ce")
    if teacher is not None:
        lines.append(f"| teacher | {Path(results['setup']['teacher']).name} | | {teacher:.4f} | | | | |")
    if any("flops" in arm for arm in arms.values()):
        lines += ["", "Compute (training FLOPs per run; held-out evals not counted):", "",
                  "| arm | student | teacher, online | teacher, cache (amortized) | total, online KD | total, from the cache "
                  "| final held-out CE |", "|---|---|---|---|---|---|---|"]
        for name, arm in arms.items():
            f = arm["flops"]
            cache = results.get("caches", {}).get(ARMS[name].cache) if name in ARMS and ARMS[name].cache else None
            share = (f"{format_flops(f['teacher_cache_amortized'])} (1/{cache['runs_reading']} of "
                     f"{format_flops(cache['teacher_flops'])})" if cache else "0")
            lines.append(f"| {name} | {format_flops(f['student'])} | {format_flops(f['teacher_online'])} | {share} "
                         f"| {format_flops(f['total_online'])} | {format_flops(f['total_cache'])} "
                         f"| {arm['final_heldout_ce']['mean']:.4f} |")
    summary = summary_lines(results)
    if summary:
        lines += [""] + [f"- {line}" for line in summary]
    return "\n".join(lines) + "\n"


def summary_lines(results: dict) -> list[str]:
    arms, lines = results["arms"], []
    for name, arm in arms.items():
        tm = arm.get("token_multiplier")
        if tm is None:
            continue
        if tm["mean"] is not None and all(v["value"] is not None for v in tm["per_seed"].values()):
            per_seed = ", ".join(f"{v['value']:.2f}" for v in tm["per_seed"].values())
            lines.append(f"{name} at {format_tokens(arm['tokens'])} tokens = CE-only at "
                         f"{format_tokens(arm['ce_tokens_equivalent'])} tokens ({tm['mean']:.2f}x, per seed {per_seed}).")
        else:
            lines.append(f"{name} at {format_tokens(arm['tokens'])} tokens = CE-only at {format_multiplier(tm)} its tokens.")
    if "kd_sampled64" in arms and "kd_topk64" in arms:
        d = paired_difference(arms["kd_sampled64"], arms["kd_topk64"])
        if d is not None:
            lines.append(f"kd_sampled64 minus kd_topk64, paired by seed: {d['mean']:+.4f} ({d['min']:+.4f} to "
                         f"{d['max']:+.4f}) nats.")
    decision = results.get("setup", {}).get("ce_4x")
    if decision is not None and not decision.get("ran"):
        lines.append(f"ce_4x not run: {decision['reason']}.")
    return lines


# ---- the study


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
                                                                 manifest.vocab_size),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--out", default="dumps/kd_study", help="runs, results.json, kd_study.png, table.md")
    parser.add_argument("--cache-root", default=None, help="where cache_topk64/, cache_sampled64/ live (default: --out)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--ce-multiples", default="auto", help="auto (1x, 2x, and 4x only when the 2x CE arm does not "
                        "reach some KD arm's final held-out CE) or the CE budgets to run, e.g. 1,2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="training steps of a 1x run (default: the config's)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time, one CPU thread each")
    parser.add_argument("--cache-ranks", type=int, default=2, help="teacher ranks writing a cache")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per 1x run (a 2x run gets twice ...)")
    parser.add_argument("--cache-timeout", type=float, default=3 * 3600, help="seconds per cache build")
    parser.add_argument("--no-cloze", action="store_true", help=f"skip the {CLOZE_TASK} eval of each final checkpoint")
    parser.add_argument("--report-only", action="store_true", help="re-render results.json, table.md and the plot "
                        "from the runs already in --out, without training")
    parser.add_argument("overrides", nargs="*", help="training overrides shared by every run (key=value)")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kd_study: %(message)s")

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


if __name__ == "__main__":
    run_cli(main)
