"""The data wall in one process (`--wall --device cuda|cpu`): every arm and seed trains here, from caches written once.

    python -m apps.studies.kd --wall --device cuda --out dumps/kd_wall_gpu        # one H100, under 10 min
    python -m apps.studies.kd --wall --device cpu --tiny --out /tmp/kd_wall_tiny \\
        data.root_dir=... distillation.teacher_path=... data.tokenizer.path=...        # the pipeline in seconds

The arms, budgets and report are the launched wall study's (wall.py, wall_report.py); what changes is where the
runs happen: nothing is launched. Each output format's teacher cache is written once over the U tokens
(`apps.main.teacher_cache` as one rank of this process), then read once into memory (on the device): every run
steps through those same batches, epoch after epoch, in the same order, as a cache-reading trainer would. A run
builds its model from its seed, takes the config's optimizer and warmup + cosine schedule over its own E x U
tokens, and is scored at its end on both held-out splits (`pydocs`, CPython's docs, which the teacher may have
seen; `repodocs`, this repository's docs, written after its cutoff); the teacher's own CE on both is measured
once, beside them. CE arms train on the cache's tokens with the fused CE head (`NoDistiller`: exactly the
alpha = 0 loss, without the KD work). On CUDA the student trains under bf16 autocast when
`distributed.model_dtype=bf16` (fp32 weights), with no compile.

A finished run is kept (`runs/<arm>_e<E>_seed<s>/metrics.jsonl`, written at its end): rerunning the command
resumes the study, so a run cut short by a time limit loses only the run in progress.
"""

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from apps.studies.kd.arms import CACHES, WALL_ARMS, WallRun, study_args
from apps.studies.kd.disk import cache_dir_of, now_iso, run_finished
from apps.studies.kd.launch import build_cache
from apps.studies.kd.wall_report import report
from apps.main.eval import batch_ce_sum
from apps.main.transformer import LMTransformer, batch_documents, get_num_flop_per_token
from lingua.distillation.cache.reader import open_cache
from lingua.distillation.cache.store import settings_manifest
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.distiller import NoDistiller
from lingua.errors import ConfigError, DataError, NonFiniteError
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.optim import build_optimizer, clip_grad_norm_
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger("kd_study")

GPU_CONFIG = "configs/distill_exps/kd_wall_gpu.yaml"
# Held-out splits: the config's own (CPython's docs) and the one written after the teacher's cutoff.
POST_CUTOFF_SPLIT = "repodocs"
# `--tiny`: the same command at a size a CPU finishes in seconds (the test suite's version of the GPU study).
TINY_OVERRIDES = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=32",
                  "model.max_seqlen=32", "data.batch_size=4", "heldout.max_batches=2", "optim.warmup=1"]
# The command's defaults per mode (an explicit option wins): the GPU study and its tiny CPU version.
DEVICE_DEFAULTS = {"unique_tokens": 2_097_152, "epochs": "1,4,8", "wall_seeds": "0,1", "wall_end_seeds": "",
                   "wall_arms": "ce,ce_wd10x,kd_sampled64"}
TINY_DEFAULTS = {**DEVICE_DEFAULTS, "unique_tokens": 256, "epochs": "1,2", "wall_seeds": "0"}


def held_out_splits(args, tokenizer, device: torch.device) -> dict[str, list[dict]]:
    """split name -> its held-out batches on `device` (read once, scored after every run)."""
    own = [name for name, weight in args.data.sources.items() if weight > 0]
    splits = {}
    for name in [*own, POST_CUTOFF_SPLIT]:
        data = replace(args.data, eval_sources=[name])
        try:
            batches = list(iterate_eval_batches(data, tokenizer, 0, 1, args.heldout.max_batches))
        except FileNotFoundError:
            raise DataError(f"no held-out split {name!r} under {args.data.root_dir}; run `python -m "
                            f"setup.prepare_corpus --out {args.data.root_dir}` (it writes both splits).") from None
        splits[name] = [{k: v.to(device) for k, v in b.items()} for b in batches]
    return splits


def cached_batches(args, tokenizer, cache_dir: Path, steps_per_epoch: int, device: torch.device) -> list[dict]:
    """One epoch of the cache (U tokens) as training batches on `device`, in the order a cache-reading run reads."""
    wanted = settings_manifest(args.distillation, args.data, args.model.attn_mask, tokenizer)
    loader = open_cache(str(cache_dir), wanted, args.data.batch_size, 0, 1)
    batches = []
    for _ in range(steps_per_epoch):
        batch = next(loader)
        batches.append({"input_ids": batch["input_ids"].to(device), "labels": batch["labels"].to(device),
                        "doc_ids": batch["doc_ids"].to(device), "teacher": batch["teachers"][0].to(device),
                        "n_valid": int((batch["labels"] != -100).sum())})
    return batches


@dataclass
class Study:
    """What every run of the study shares: the config and overrides, the vocabulary, the device."""

    config: str
    overrides: list[str]
    vocab_size: int
    device: torch.device
    bf16: bool  # bf16 autocast (CUDA with distributed.model_dtype=bf16), else fp32

    def args_of(self, extra: list[str], shared: bool = True):
        args = study_args(self.config, [*(self.overrides if shared else []), *extra])
        args.model.vocab_size = self.vocab_size
        return args

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()


@torch.no_grad()
def heldout_ce(model, study: Study, batches: list[dict]) -> float:
    loss_sum = tokens = 0
    device = study.device
    model.eval()
    with study.autocast():
        for batch in batches:
            batch_loss, batch_tokens = batch_ce_sum(model, batch, device)
            loss_sum, tokens = loss_sum + batch_loss, tokens + batch_tokens
    model.train()
    return loss_sum / max(tokens, 1)


def train_run(study: Study, run: WallRun, batches: list[dict], splits: dict, is_ce: bool) -> dict:
    """One (arm, E, seed): a fresh model from the seed, E x U tokens, then each split's held-out CE (`is_ce`: the
    CE-only loss, the batches' teacher outputs unread)."""
    device = study.device
    run_args = study.args_of(run.overrides, shared=False)  # shared, the arm's, its steps and warmup (wall.py)
    torch.manual_seed(run.seed)
    with torch.device(device):
        model = LMTransformer(replace(run_args.model, seed=run.seed))
        model.init_weights()
    optimizer, scheduler = build_optimizer(model, run_args.optim, run.steps)
    distiller = NoDistiller(run_args.distillation) if is_ce else CacheDistiller(run_args.distillation)
    start = time.perf_counter()
    for step in range(1, run.steps + 1):
        batch = batches[(step - 1) % len(batches)]
        distiller.begin_step(step, scheduler.get_last_lr()[0] / run_args.optim.lr)
        head_loss = distiller.head_loss(batch["labels"], (None, [batch["teacher"]]), batch["n_valid"], None)
        with study.autocast():
            loss = model(batch["input_ids"], **batch_documents(model, batch, device), head_loss=head_loss)
        loss.backward()
        clip_grad_norm_(model.parameters(), run_args.optim.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    train_loss = float(distiller.step_metrics()["loss/total"])  # the one host sync of the run's steps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - start
    if not math.isfinite(train_loss):
        raise NonFiniteError(f"{run.arm} E={run.epochs} seed {run.seed}: the training loss is {train_loss} at its "
                             f"last step; lower optim.lr or check the cache.")
    row = {"step": run.steps, "loss/total": train_loss, "wall_s": wall_s}
    for i, (name, split) in enumerate(splits.items()):  # the config's split first: eval/loss, as the trainer logs
        row["eval/loss" if i == 0 else f"eval/loss_{name}"] = heldout_ce(model, study, split)
    return row


def finish_run(run: WallRun, row: dict, started_unix: float) -> None:
    """The run's metrics.jsonl and study_run.json, written whole at its end (a rerun skips it)."""
    run.dump_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("study_run.json", json.dumps({"wall_s": row["wall_s"], "started": now_iso(started_unix),
                                                      "finished": now_iso(), "in_process": True})),
                       ("metrics.jsonl", json.dumps(row))):
        tmp = run.dump_dir / f"{name}.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(run.dump_dir / name)
    run.wall_s = row["wall_s"]


def teacher_references(args, splits: dict, device: torch.device, out: Path) -> dict:
    """The teacher's own CE on each held-out split (measured once; kept in `teacher_heldout.json`)."""
    path = out / "teacher_heldout.json"
    if path.is_file() and set(json.loads(path.read_text())) == set(splits):
        return json.loads(path.read_text())
    from lingua.distillation.teacher.model import TeacherModel

    teacher = TeacherModel(args.distillation, device)
    doc_causal = args.model.attn_mask == "doc_causal"
    refs = {}
    for name, batches in splits.items():
        loss_sum, tokens = teacher.heldout_ce(batches, args.model.vocab_size, doc_causal)
        refs[name] = loss_sum / max(tokens, 1)
    del teacher
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(refs) + "\n")
    tmp.replace(path)
    return refs


def resolve_defaults(options) -> None:
    """Fill the options left unset with this mode's defaults (DEVICE_DEFAULTS, or TINY_DEFAULTS with --tiny)."""
    defaults = TINY_DEFAULTS if options.tiny else DEVICE_DEFAULTS
    for key, value in defaults.items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    if options.config is None:
        options.config = GPU_CONFIG
    options.parallel = 1


def main(options, plan_wall_runs, windows_of) -> dict:
    """The study in this process: the caches (written once each), every run, the report."""
    resolve_defaults(options)
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no GPU here; run it on a GPU machine, or use --device cpu "
                          "--tiny for the pipeline.")
    shared = [*(TINY_OVERRIDES if options.tiny else []), *options.overrides]
    options.overrides = shared
    args = study_args(options.config, shared)
    if args.grad_acc_steps != 1:
        raise ConfigError(f"grad_acc_steps={args.grad_acc_steps}: the in-process wall study takes one batch a step; "
                          f"set data.batch_size instead.")
    tokenizer = build_tokenizer(args.data.tokenizer)
    args.model.vocab_size = tokenizer.n_words
    study = Study(options.config, shared, tokenizer.n_words, device,
                  bf16=device.type == "cuda" and args.distributed.model_dtype == "bf16")
    windows = windows_of(options.unique_tokens, args)
    steps_per_epoch = windows // args.data.batch_size
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_root = Path(options.cache_root or out)
    runs = plan_wall_runs(options, shared, steps_per_epoch, out, cache_root)
    kd_caches = [c for c in CACHES if any(WALL_ARMS[r.arm].cache == c and not WALL_ARMS[r.arm].is_ce for r in runs)]
    cache_names = kd_caches or [WALL_ARMS[runs[0].arm].cache]  # CE arms read the tokens of any cache: one suffices
    todo = [r for r in runs if not run_finished(r.dump_dir, r.steps)]
    if not options.report_only and todo:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        for name in cache_names:
            build_cache(options.config, [*shared, *CACHES[name], f"sequences_per_stream={windows}",
                                         f"shard_sequences={math.gcd(windows, 64)}", f"dump_dir={out}"],
                        cache_dir_of(cache_root, name), 1, options.cache_timeout, in_process=True)
        splits = held_out_splits(args, tokenizer, device)
        refs = teacher_references(args, splits, device, out)
        logger.info("the teacher's held-out CE: " + ", ".join(f"{k} {v:.4f}" for k, v in refs.items()))
        batches = {name: cached_batches(study.args_of(list(CACHES[name])), tokenizer, cache_dir_of(cache_root, name),
                                        steps_per_epoch, device) for name in cache_names}
        with torch.device("meta"):
            n_params = sum(p.numel() for p in LMTransformer(args.model).parameters())
        flops = get_num_flop_per_token(n_params, args.model.n_layers, args.model.dim, args.data.seq_len)
        logger.info(f"data wall in one process on {device}: U = {options.unique_tokens} tokens ({steps_per_epoch} "
                    f"steps an epoch), {len(runs)} runs, {len(runs) - len(todo)} done")
        for run in todo:
            started = time.time()
            arm = WALL_ARMS[run.arm]
            source = cache_names[0] if arm.is_ce else arm.cache
            row = train_run(study, run, batches[source], splits, arm.is_ce)
            finish_run(run, row, started)
            tokens_per_s = run.steps * args.data.batch_size * args.data.seq_len / row["wall_s"]
            logger.info(f"done {run.arm} E={run.epochs} seed {run.seed} in {row['wall_s']:.1f}s "
                        f"({tokens_per_s:,.0f} tokens/s, {tokens_per_s * flops / 1e12:.1f} TFLOP/s): held-out CE "
                        + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith("eval/")))
    refs_path = out / "teacher_heldout.json"
    extra = {"device": device_name(device), "torch": torch.__version__, "in_process": True,
             "teacher_heldout_ce_by_split": json.loads(refs_path.read_text()) if refs_path.is_file() else None}
    finished = [r for r in runs if run_finished(r.dump_dir, r.steps)]
    return report(options, args, runs, finished, cache_root, cache_names, out, extra=extra)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
