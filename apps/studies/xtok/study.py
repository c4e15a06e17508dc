"""The cross-tokenizer study: does SmolLM2 teach a student that keeps its own tokenizer? (issue 36, item 5)

    python -m apps.studies.xtok.study --out dumps/xtok_study                       # ~45 min on 2 CPU cores
    python -m apps.studies.xtok.study --out dumps/xtok_study --report-only         # re-render from the runs on disk
    python -m apps.studies.xtok.study --tiny --out /tmp/xtok data.root_dir=... distillation.teacher_path=... \\
        data.tokenizer.path=...                                                  # the pipeline in seconds (the test)

The student's "own" tokenizer stands for a Lingua user's: a byte-level BPE of `--vocab` ids trained with the
`tokenizers` library on the training split (deterministic, cached as a Hugging Face folder under `--out`). The
teacher is the config's (SmolLM2-135M-Instruct, real weights, CPU). Behind a data wall (U unique tokens read
for E epochs, where the KD study measured the teacher paying), every arm trains one process-local run per seed
from a teacher cache written once (per tokenizer, and once more for ULD: `apps.main.teacher_cache`, in this
process), at equal steps and equal student shape apart from the embedding and head its vocabulary dictates:

    ce_own        CE only, own tokenizer (the cross arms' baseline)
    kd_cross      cross-tokenizer KD (distillation.cross_tokenizer=true): the teacher's top-64 at aligned
                  positions through the exact vocabulary map, unmapped mass in the rest bucket
    kd_cross_uld  the same plus ULD on the unmapped mass (distillation.uld_weight=1.0, uld_k=16), from a cache
                  of its own (the same targets, with the unmapped entries ULD reads)
    ce_same       CE only on the teacher's tokenizer (kd_same's baseline)
    kd_same       same-tokenizer KD, the reference

Each run ends with its held-out CE on both splits (pydocs: CPython's docs; repodocs: written after the
teacher's cutoff) in bits per byte (lingua/evaluation/bits_per_byte.py), so the tokenizers compare. A seed is the
student's init; arms of one tokenizer read the same windows in the same order, so they compare paired by seed.
Finished runs are kept (`runs/<arm>_seed<s>/metrics.jsonl`): rerunning resumes the study.
"""

import argparse
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from apps.studies.kd.arms import WallRun, study_args
from apps.studies.kd.disk import cache_dir_of, now_iso, run_finished
from apps.studies.kd.launch import build_cache
from apps.studies.kd.wall import windows_of
from apps.studies.kd.wall_inprocess import (TINY_OVERRIDES, Study, cached_batches, finish_run, held_out_splits,
                                                teacher_references, train_run)
from apps.studies.xtok.report import report
from lingua.evaluation.bits_per_byte import LN2, batches_target_bytes, token_byte_lengths
from lingua.cli.entry import run_cli
from lingua.data import IGNORE_INDEX
from lingua.distillation.teacher.model import check_teacher_dir
from lingua.loading.documents import list_chunk_files
from lingua.errors import ConfigError, DataError
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger("xtok_study")

CONFIG = "configs/distill_exps/kd_study.yaml"
CACHE = ("distillation.output=topk", "distillation.k=64")
SPECIALS = ("<|bos|>", "<|eos|>")


# The teacher caches, each written once: the student tokenizer it is for ("own": the student's BPE, the teacher
# aligning to it; "teacher": SmolLM2's own) and the settings it is written with.
CACHES = {
    "cross": ("own", ()),
    "cross_uld": ("own", ("distillation.uld_weight=1.0",)),  # the same targets plus the unmapped entries ULD reads
    "same": ("teacher", ()),
}


@dataclass(frozen=True)
class XtokArm:
    cache: str  # the CACHES entry it trains from (a CE arm reads only its windows)
    overrides: tuple[str, ...]
    is_ce: bool
    baseline: Optional[str] = None  # the CE-only arm of the same tokenizer it is compared with

    @property
    def tokenizer(self) -> str:
        return CACHES[self.cache][0]

    @property
    def settings(self) -> tuple[str, ...]:
        """Its own overrides and its cache's (the ULD weight), as the table shows them."""
        return (*self.overrides, *CACHES[self.cache][1])


ARMS = {
    "ce_own": XtokArm("cross", ("distillation.alpha=0.0",), True),
    "kd_cross": XtokArm("cross", ("distillation.alpha=0.5",), False, "ce_own"),
    "kd_cross_uld": XtokArm("cross_uld", ("distillation.alpha=0.5",), False, "ce_own"),
    "ce_same": XtokArm("same", ("distillation.alpha=0.0",), True),
    "kd_same": XtokArm("same", ("distillation.alpha=0.5",), False, "ce_same"),
}
TINY_DEFAULTS = {"unique_tokens": 256, "steps": 4, "vocab": 320, "seeds": "1"}
DEFAULTS = {"unique_tokens": 8192, "steps": 64, "vocab": 8192, "seeds": "3"}


def training_texts(root_dir: str, sources: dict) -> list[str]:
    """The documents of the training split (chunk files, never *.val.jsonl), in file order."""
    texts = []
    for source in sorted(s for s, weight in sources.items() if weight > 0):
        for path in list_chunk_files(root_dir, source):
            texts += [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise DataError(f"no training documents under {root_dir} for {', '.join(sources)}; run `python -m "
                        f"setup.prepare_corpus --out {root_dir}`.")
    return texts


def train_student_tokenizer(folder: Path, texts: list[str], vocab: int) -> dict:
    """A byte-level BPE of `vocab` ids trained on `texts`, saved as a Hugging Face tokenizer folder (kept when
    `stamp.json` says it was trained from these texts at this size). Training is deterministic for given texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus_hash = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
    stamp = {"vocab": vocab, "corpus_sha256_16": corpus_hash, "documents": len(texts)}
    stamp_path = folder / "stamp.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()).get("corpus_sha256_16") == corpus_hash and \
            json.loads(stamp_path.read_text()).get("vocab") == vocab:
        return json.loads(stamp_path.read_text())
    if vocab < 256 + len(SPECIALS):
        raise ConfigError(f"--vocab {vocab} is below a byte-level BPE's 256 bytes and {len(SPECIALS)} specials; use "
                          f"at least {256 + len(SPECIALS)}.")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    start = time.perf_counter()
    bpe.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=SPECIALS[0], eos_token=SPECIALS[1]).save_pretrained(folder)
    stamp.update(trained_vocab=bpe.get_vocab_size(), train_s=round(time.perf_counter() - start, 2),
                 tokenizer_sha256_16=hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()[:16])
    tmp = stamp_path.with_suffix(".tmp")  # the stamp last, atomically: a folder without it is retrained
    tmp.write_text(json.dumps(stamp) + "\n")
    tmp.replace(stamp_path)
    logger.info(f"student tokenizer: byte-level BPE of {stamp['trained_vocab']} ids trained on {len(texts)} documents "
                f"in {stamp['train_s']}s -> {folder}")
    return stamp


@dataclass
class Side:
    """One cache's part of the study: its overrides, held-out splits and cached training batches."""

    name: str
    overrides: list[str]
    cache_dir: Path
    study: Optional[Study] = None
    splits: Optional[dict] = None
    batches: Optional[list] = None
    split_stats: Optional[dict] = None  # split -> {tokens, bytes} of its scored targets
    aligned: Optional[float] = None  # share of the cache's training targets with a KD target (cross only)


def cache_overrides(cache: str, own_folder: Path) -> list[str]:
    tokenizer, settings = CACHES[cache]
    if tokenizer == "own":
        settings = ("data.tokenizer.name=hf", f"data.tokenizer.path={own_folder}", "distillation.cross_tokenizer=true",
                    *settings)
    return list(settings)


def prepare_side(side: Side, config: str, windows: int, steps_per_epoch: int, out: Path, timeout_s: float) -> None:
    """Write the side's cache (once), read its training batches, held-out splits and their byte counts."""
    cache_overrides = [*side.overrides, *CACHE]
    # The serial writer (same bytes as the pipelined one): no encoder process to start on two shared cores. The
    # writer's own held-out reference is cut to one batch: the teacher's forward is the study's expensive part, and
    # --teacher-bpb scores the whole splits.
    layout = [f"sequences_per_stream={windows}", f"shard_sequences={math.gcd(windows, 64)}", f"dump_dir={out}"]
    build_cache(config, [*cache_overrides, *layout, "encode_workers=0", "heldout.max_batches=1"], side.cache_dir, 1,
                timeout_s, in_process=True)
    args = study_args(config, side.overrides)
    tokenizer = build_tokenizer(args.data.tokenizer)
    side.study = Study(config, side.overrides, tokenizer.n_words, torch.device("cpu"), bf16=False)
    side.splits = held_out_splits(args, tokenizer, side.study.device)
    lengths = token_byte_lengths(tokenizer)
    side.split_stats = {name: {"tokens": sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches),
                               "bytes": batches_target_bytes(batches, lengths)}
                        for name, batches in side.splits.items()}
    side.batches = cached_batches(side.study.args_of(list(CACHE)), tokenizer, side.cache_dir, steps_per_epoch,
                                  side.study.device)
    weight = [b["teacher"].kd_weight for b in side.batches]
    if weight[0] is not None:
        valid = [(b["labels"] != IGNORE_INDEX).float() for b in side.batches]
        side.aligned = float(sum((w * v).sum() for w, v in zip(weight, valid)) / sum(v.sum() for v in valid))


def bpb_row(row: dict, split_stats: dict) -> dict:
    """The run's held-out CE per split (nats per token, as train_run reports it) in bits per byte."""
    for i, (name, stats) in enumerate(split_stats.items()):
        ce = row["eval/loss" if i == 0 else f"eval/loss_{name}"]
        row[f"eval/bpb_{name}"] = ce * stats["tokens"] / LN2 / max(stats["bytes"], 1)
    return row


def plan_runs(names: list[str], seeds: list[int], sides: dict, steps: int, out: Path) -> list[WallRun]:
    runs = []
    for name in names:
        arm, side = ARMS[name], sides[ARMS[name].cache]
        overrides = [*side.overrides, *CACHE, *arm.overrides, f"steps={steps}", f"heldout.every={steps}",
                     f"optim.warmup={max(1, steps // 10)}"]
        runs += [WallRun(name, seed, out / "runs" / f"{name}_seed{seed}", overrides, steps=steps,
                         cache_dir=side.cache_dir) for seed in seeds]
    # Seed by seed: a study cut short holds whole seeds, every arm paired.
    return sorted(runs, key=lambda r: (r.seed, names.index(r.arm)))


def teacher_bpb(side: Side, config: str, out: Path) -> dict:
    """The teacher's own held-out bits per byte on each split (its tokenizer's windows of the same text)."""
    args = study_args(config, side.overrides)
    args.model.vocab_size = side.study.vocab_size
    refs = teacher_references(args, side.splits, side.study.device, out)
    return {name: refs[name] * stats["tokens"] / LN2 / max(stats["bytes"], 1)
            for name, stats in side.split_stats.items()}


def parse_options(argv):
    parser = argparse.ArgumentParser(prog="python -m apps.studies.xtok.study", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="dumps/xtok_study", help="tokenizer, caches, runs, results.json, table.md")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default=None, help="a count (3: seeds 0,1,2, the default) or a comma list of "
                        "seeds (\"4,\" is seed 4 alone)")
    parser.add_argument("--unique-tokens", type=int, default=None, help="U, the cached training tokens per "
                        f"tokenizer (default {DEFAULTS['unique_tokens']})")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps of every run (default "
                        f"{DEFAULTS['steps']}: 8 epochs over U at the config's 8 x 128 tokens a step)")
    parser.add_argument("--vocab", type=int, default=None, help=f"the student's own BPE size (default "
                        f"{DEFAULTS['vocab']})")
    parser.add_argument("--teacher-bpb", action="store_true", help="also score the teacher on both held-out splits "
                        "(its forward over ~80k tokens: minutes on a CPU)")
    parser.add_argument("--cache-timeout", type=float, default=3600)
    parser.add_argument("--tiny", action="store_true", help="the pipeline at a size a CPU runs in seconds (the test)")
    parser.add_argument("--report-only", action="store_true", help="re-render from the runs on disk")
    parser.add_argument("overrides", nargs="*", help="training overrides shared by every run (key=value)")
    options = parser.parse_args(argv)
    for key, value in (TINY_DEFAULTS if options.tiny else DEFAULTS).items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    seeds = str(options.seeds)
    options.seed_list = list(range(int(seeds))) if seeds.isdigit() and "," not in seeds else \
        sorted({int(s) for s in seeds.split(",") if s.strip()})
    options.arm_list = [a for a in options.arms.split(",") if a]
    unknown = [a for a in options.arm_list if a not in ARMS]
    if unknown or not options.arm_list or not options.seed_list:
        raise ConfigError(f"--arms {options.arms!r} --seeds {options.seeds!r}: name some of {', '.join(ARMS)} and at "
                          f"least one seed.")
    if options.steps < 1:
        raise ConfigError(f"--steps {options.steps}: use a positive number of training steps.")
    return options


def main(argv: Optional[list[str]] = None) -> dict:
    options = parse_options(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s xtok_study: %(message)s")
    started = time.perf_counter()
    shared = [*(TINY_OVERRIDES if options.tiny else []), *options.overrides]
    args = study_args(options.config, shared)
    if args.grad_acc_steps != 1:
        raise ConfigError(f"grad_acc_steps={args.grad_acc_steps}: the study takes one batch a step; set "
                          f"data.batch_size instead.")
    check_teacher_dir(args.distillation.teacher_path)
    windows = windows_of(options.unique_tokens, args)
    steps_per_epoch = windows // args.data.batch_size
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    own_folder = out / f"tokenizer_bpe{options.vocab}"
    stamp = train_student_tokenizer(own_folder, training_texts(args.data.root_dir, args.data.sources), options.vocab)
    sides = {name: Side(name, [*shared, *cache_overrides(name, own_folder)], cache_dir_of(out, f"{name}_topk64"))
             for name in CACHES if any(ARMS[a].cache == name for a in options.arm_list)}
    runs = plan_runs(options.arm_list, options.seed_list, sides, options.steps, out)
    todo = [r for r in runs if not run_finished(r.dump_dir, r.steps)]
    sides_path, teacher_path = out / "sides.json", out / "teacher_bpb.json"
    teacher_wanted = options.teacher_bpb and "same" in sides and not teacher_path.is_file()
    if not options.report_only and (todo or teacher_wanted or not sides_path.is_file()):
        for side in sides.values():
            prepare_side(side, options.config, windows, steps_per_epoch, out, options.cache_timeout)
        # What each cache's side holds, written before the runs: a study stopped early still reports.
        known = json.loads(sides_path.read_text()) if sides_path.is_file() else {}
        known.update({name: {"tokenizer": CACHES[name][0], "n_words": side.study.vocab_size, "aligned": side.aligned,
                             "splits": side.split_stats, "cache_dir": str(side.cache_dir)}
                      for name, side in sides.items()})
        tmp = sides_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(sides_path)
        if teacher_wanted:
            teacher_path.write_text(json.dumps(teacher_bpb(sides["same"], options.config, out)) + "\n")
        logger.info(f"{len(runs)} runs of {options.steps} steps ({options.steps / steps_per_epoch:g} epochs over U = "
                    f"{options.unique_tokens} tokens), {len(runs) - len(todo)} done")
        for run in todo:
            side, start = sides[ARMS[run.arm].cache], time.time()
            row = bpb_row(train_run(side.study, run, side.batches, side.splits, ARMS[run.arm].is_ce), side.split_stats)
            row.update({"kd/aligned": side.aligned} if side.aligned is not None and not ARMS[run.arm].is_ce else {})
            finish_run(run, row, start)
            logger.info(f"done {run.arm} seed {run.seed} in {row['wall_s']:.1f}s: "
                        + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith("eval/bpb")))
    setup = {"config": options.config, "overrides": shared, "unique_tokens": options.unique_tokens,
             "steps": options.steps, "epochs": options.steps / steps_per_epoch, "steps_per_epoch": steps_per_epoch,
             "tokens_per_step": args.data.batch_size * args.data.seq_len, "seeds": options.seed_list,
             "student": {k: getattr(args.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
             "teacher": args.distillation.teacher_path, "own_tokenizer": {"folder": str(own_folder), **stamp},
             "sides": json.loads(sides_path.read_text()) if sides_path.is_file() else {},
             "teacher_bpb": json.loads(teacher_path.read_text()) if teacher_path.is_file() else None,
             "machine": "cpu, torch threads " + str(torch.get_num_threads()), "torch": torch.__version__}
    finished = [r for r in runs if run_finished(r.dump_dir, r.steps)]
    return report(setup, ARMS, runs, finished, out, time.perf_counter() - started, now_iso())


if __name__ == "__main__":
    run_cli(main)
