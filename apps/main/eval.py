"""Evaluation: in-loop held-out CE on the training group (`EvalArgs`, `Evaluator`, used by train.py), and
the evaluation of any finished checkpoint (`CheckpointEvalArgs`, `evaluate_checkpoint`):

    python -m apps.main.eval ckpt=dumps/run/checkpoints tasks=pydocs_cloze limit=100     # offline
    python -m apps.main.eval ckpt=dumps/run/checkpoints tasks=hellaswag,arc_easy          # needs the hub

A checkpoint is scored twice: held-out perplexity (mean CE per token over the corpus's `*.val.jsonl`
documents, with the run's own tokenizer, windows and BOS/EOS framing: the number the in-loop eval logs),
and lm-eval-harness tasks through its Hugging Face backend on the checkpoint exported with
apps.main.export_hf (any tokenizer: the export carries its Hugging Face form). Our tasks live in
apps/main/eval_tasks (offline); any other name is lm-eval's own.
Results go to `eval.json` in the checkpoint's step directory (or in `dump_dir`); with `metric_log_dir`, one line
each is appended to its `metrics.eval.jsonl` (tasks) and `metrics.validation.jsonl` (held-out), as Meta Lingua
does. The trainer runs this same function on each `checkpoint.eval` save (apps/main/checkpoint_eval.py).
"""

import json
import logging
from datetime import datetime, timezone
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from apps.main.transformer import batch_documents
from lingua.args import require
from lingua.evaluation.bits_per_byte import batches_target_bytes, bits_per_byte, target_bytes, token_byte_lengths
from lingua.cli.entry import run_cli
from lingua.distillation.loss.fused import fused_ce_head
from lingua.errors import ConfigError, MissingPathError
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.parallel.collectives import agree_count, dist_mean_dict

logger = logging.getLogger(__name__)

EVAL_UNEVEN = ("min", "error")
EVAL_DTYPES = ("float32", "bfloat16", "float16")
EVAL_TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"  # our lm-eval task YAMLs, one task per file
EVAL_JSON = "eval.json"
METRICS_EVAL, METRICS_VALIDATION = "metrics.eval.jsonl", "metrics.validation.jsonl"  # Meta Lingua's names
# Our tasks read only committed files; these keep lm-eval, datasets and transformers off the network.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass
class EvalArgs:
    every: int = 0  # steps between in-loop evaluations (0 = never); the trainer's `heldout:` section
    max_batches: int = 16  # held-out batches each rank scores per evaluation (data.batch_size rows each)
    # Ranks holding different numbers of eval batches (agreed before the loop either way):
    # "min" = every rank runs the smallest count, with a warning naming them; "error" = stop, naming them.
    uneven: str = "min"

    def validate(self) -> None:
        require(self.every >= 0, "heldout.every", self.every, "use a number of steps, or 0 to turn in-loop evaluation "
                "off")
        require(self.max_batches >= 1, "heldout.max_batches", self.max_batches, "use a positive number of batches "
                "per rank")
        require(self.uneven in EVAL_UNEVEN, "heldout.uneven", self.uneven, f"use one of {', '.join(EVAL_UNEVEN)}")


def batch_ce_sum(model, batch: dict, device) -> tuple[float, int]:
    """(CE summed over the predicted positions, their count) for one held-out batch, through the fused head as in
    training: no [tokens, vocab] logits."""
    ce_sum = batch_ce(model, batch, device)
    return ce_sum.item(), int((batch["labels"] != -100).sum())


def batch_ce(model, batch: dict, device, normalizer: int = 1) -> torch.Tensor:
    """The student's CE over one batch's predicted positions through the fused head (no [tokens, vocab] logits),
    summed and divided by `normalizer`: the held-out CE's and the activation probe's forward."""
    return model(batch["input_ids"].to(device), **batch_documents(model, batch, device),
                 head_loss=fused_ce_head(batch["labels"].to(device), normalizer))


class Evaluator:
    """Owns its cadence (`should_run`) and runs the eval over this rank's share of the held-out files."""

    def __init__(self, args: EvalArgs, data_args, tokenizer, topo, teacher=None):
        """`teacher`: the run's Distiller, whose `teacher_heldout_row` (the teachers' own CE and bits per byte on these
        windows, as eval keys) is logged once, with the first eval, as a reference."""
        self.args, self.data_args = args, data_args
        self.tokenizer, self.topo = tokenizer, topo
        self.teacher_reference = teacher.teacher_heldout_row() if teacher is not None else {}
        self.byte_lengths: Optional[torch.Tensor] = None  # bytes per token id, read on the first eval

    def should_run(self, step: int) -> bool:
        return bool(self.args.every) and step % self.args.every == 0

    @torch.no_grad()
    def run(self, model, step: int) -> dict:
        """The eval row of `step`; ranks first agree on how many batches to run (a CountMismatch otherwise)."""
        topo = self.topo
        batches = list(iterate_eval_batches(self.data_args, self.tokenizer, topo.train_rank, topo.train_world_size,
                                            self.args.max_batches))
        n_batches = agree_count(len(batches), topo.train_group, topo.device, "eval batches",
                                mode="min" if self.args.uneven == "min" else "equal")
        if self.byte_lengths is None:
            self.byte_lengths = token_byte_lengths(self.tokenizer)
        loss_sum = tokens = n_bytes = 0.0
        model.eval()
        for batch in batches[:n_batches]:
            batch_loss, batch_tokens = batch_ce_sum(model, batch, topo.device)
            loss_sum += batch_loss
            tokens += batch_tokens
            n_bytes += target_bytes(batch["labels"], self.byte_lengths)
        model.train()
        # Means over the group: their ratios are the ratios of the sums.
        totals = dist_mean_dict(dict(loss_sum=loss_sum, tokens=tokens, bytes=n_bytes), topo.train_group, topo.device)
        eval_loss = totals["loss_sum"] / max(totals["tokens"], 1)
        eval_bpb = bits_per_byte(totals["loss_sum"], totals["bytes"])
        teachers = [f"{value:.4f}" for key, value in self.teacher_reference.items() if key.endswith("teacher_loss")]
        logger.info(f"eval step {step}: loss {eval_loss:.4f}, {eval_bpb:.4f} bits per byte over {n_batches} batches "
                    f"per rank" + (f" (the teacher's: {', '.join(teachers)})" if teachers else ""))
        row = {"step": step, "eval/loss": eval_loss, "eval/bpb": eval_bpb, "eval/ppl": math.exp(min(eval_loss, 50))}
        row.update(self.teacher_reference)  # once: the teachers' numbers do not change
        self.teacher_reference = {}
        return row


def teacher_heldout(args: EvalArgs, data_args, n_students: int):
    """(held-out batches of every student, the students' vocab, the bytes of their targets) for the teacher's
    reference CE and bits per byte, or None."""
    from lingua.tokenizer import build_tokenizer

    if not args.every:
        return None
    tokenizer = build_tokenizer(data_args.tokenizer)
    try:
        batches = [batch for rank in range(n_students)
                   for batch in iterate_eval_batches(data_args, tokenizer, rank, n_students, args.max_batches)]
    except FileNotFoundError:  # no held-out files: the students' eval says so in its own words
        return None
    return batches, tokenizer.n_words, batches_target_bytes(batches, token_byte_lengths(tokenizer))


# ---- evaluating a finished checkpoint: python -m apps.main.eval ckpt=... tasks=...


@dataclass
class CheckpointEvalArgs:
    ckpt: str = ""  # a checkpoint step directory, or a checkpoints root (its latest step)
    # lm-eval tasks: a comma list, or a list of names and lm-eval task dicts ({task: nq_open, num_fewshot: 5});
    # empty (`tasks=`): held-out perplexity only
    tasks: Any = "pydocs_cloze"
    out: Optional[str] = None  # where to write the results; None: <dump_dir or step dir>/eval.json
    dump_dir: Optional[str] = None  # this evaluation's folder (eval.json; stool's files for a SLURM eval job)
    metric_log_dir: Optional[str] = None  # append metrics.eval.jsonl / metrics.validation.jsonl rows here
    global_step: Optional[int] = None  # the training step those rows name; None: the checkpoint's
    limit: Optional[int] = None  # examples per task (None: all); small values are for smoke tests
    num_fewshot: Optional[int] = None  # None: each task's default (0 for pydocs_cloze)
    batch_size: int = 8  # lm-eval's batch size (held-out batches keep the run's data.batch_size)
    device: str = "auto"  # "auto" (cuda if available) | "cpu" | "cuda" | "cuda:1" ...
    dtype: str = "float32"  # the exported model's dtype under lm-eval: float32 | bfloat16 | float16
    max_length: Optional[int] = None  # tokens through the model per request (lm-eval's max_length); None: its own
    gen_kwargs: Optional[str] = None  # generation tasks' settings, lm-eval's "temperature=0.8,top_p=0.95" form
    # A task whose dataset cannot be fetched (offline hub task) or that lm-eval does not know: false = one error
    # sentence; true = a warning naming it, the other tasks still run (the trainer's checkpoint evaluations).
    skip_unavailable_tasks: bool = False
    perplexity: bool = True  # also score the held-out *.val.jsonl documents
    perplexity_max_batches: Optional[int] = None  # held-out batches to score; None: all
    data_dir: Optional[str] = None  # corpus root holding <source>/*.val.jsonl; None: the run's data.root_dir
    eval_sources: Optional[list[str]] = None  # sources whose held-out files to score; None: the run's
    hf_dir: Optional[str] = None  # keep the exported model here; None: a temporary directory, removed after

    def validate(self) -> None:
        """What the settings alone can show, before the checkpoint is read (the rest needs its params.json)."""
        require(bool(self.ckpt), "ckpt", self.ckpt, "pass ckpt=<a checkpoint step directory or the run's "
                "checkpoints/ directory>")
        require(bool(parse_tasks(self.tasks)) or self.perplexity, "perplexity", self.perplexity,
                "with no tasks there is nothing to evaluate: pass tasks=<comma list> or leave perplexity=true")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "use a positive lm-eval batch size")
        require(self.limit is None or self.limit >= 1, "limit", self.limit, "use a positive number of examples "
                "per task, or null for all")
        require(self.num_fewshot is None or self.num_fewshot >= 0, "num_fewshot", self.num_fewshot,
                "use 0 or more examples, or null for each task's default")
        require(self.dtype in EVAL_DTYPES, "dtype", self.dtype, f"use one of {', '.join(EVAL_DTYPES)}")
        for key in ("max_length", "perplexity_max_batches"):
            require(getattr(self, key) is None or getattr(self, key) >= 1, key, getattr(self, key),
                    "use a positive number, or null")


def local_task_names() -> list[str]:
    """The tasks shipped in apps/main/eval_tasks (a YAML file per task, named like its task)."""
    return sorted(p.stem for p in EVAL_TASKS_DIR.glob("*.yaml"))


def parse_tasks(tasks: Any) -> list:
    """The tasks in order, without repeats: names from a comma list, or a list of names and lm-eval task dicts."""
    if isinstance(tasks, (list, tuple)):
        items = [item.strip() if isinstance(item, str) else item for item in tasks]
        items = [item for item in items if item]
    else:
        items = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    unique = []
    for item in items:
        if item not in unique:
            unique.append(item)
    return unique


def task_name(task) -> str:
    """A task's name: itself, or the `task` of an lm-eval task dict."""
    return task if isinstance(task, str) else str(task.get("task"))


def build_task_manager(tasks: list, skip_unknown: bool = False):
    """lm-eval's TaskManager over our tasks, plus lm-eval's own (13 s to index) only when a name needs them, and
    the tasks it knows (with skip_unknown, the others are a warning each instead of an error)."""
    from lm_eval.tasks import TaskManager

    names = [task_name(task) for task in tasks]
    include_defaults = not set(names) <= set(local_task_names())
    manager = TaskManager(include_path=str(EVAL_TASKS_DIR), include_defaults=include_defaults)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown and skip_unknown:
        for name in unknown:
            logger.warning(f"lm-eval task {name!r} is not known to lm-eval {versions(True)['lm-eval']}; skipped "
                           f"(ours: {', '.join(local_task_names())}).")
        return manager, [task for task in tasks if task_name(task) not in unknown]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(map(repr, unknown))}; use one of ours "
                          f"({', '.join(local_task_names())}) or a name that `lm-eval ls tasks` lists.")
    return manager, tasks


def held_out_data_args(params: dict, data_dir: Optional[str], eval_sources: Optional[list[str]] = None):
    """The run's DataArgs, reading held-out files from `data_dir` when given; errors name what to pass."""
    from lingua.args import dataclass_from_dict
    from lingua.data import DataArgs
    from lingua.loading.documents import list_val_files

    data_args = dataclass_from_dict(DataArgs, params.get("data", {}))
    if data_dir is not None:
        data_args.root_dir = data_dir
    if eval_sources is not None:
        data_args.eval_sources = list(eval_sources)
    names = data_args.eval_sources or [name for name, weight in data_args.sources.items() if weight > 0]
    if not data_args.root_dir or not names:
        raise ConfigError("the checkpoint's params.json names no data root or sources to find held-out files in; "
                          "pass data_dir=<corpus root> or perplexity=false.")
    if not any(list_val_files(data_args.root_dir, name) for name in names):
        where = ", ".join(str(Path(data_args.root_dir) / name) for name in names)
        raise MissingPathError(f"no held-out files (*.val.jsonl) in {where}; pass data_dir=<the corpus root> "
                               f"(python -m setup.prepare_corpus writes data/corpus/pydocs/pydocs.val.jsonl) "
                               f"or perplexity=false.")
    return data_args


@torch.no_grad()
def held_out_perplexity(model, data_args, tokenizer, device, max_batches: Optional[int] = None) -> dict:
    """Mean CE per predicted token over the held-out windows (one rank, all batches or the first `max_batches`),
    its exp, and the summed CE in bits per byte of the text the targets stand for (`bytes`)."""
    byte_lengths = token_byte_lengths(tokenizer)
    loss_sum, tokens, n_bytes, n_batches = 0.0, 0, 0, 0
    for batch in iterate_eval_batches(data_args, tokenizer, dp_rank=0, dp_degree=1, max_batches=max_batches):
        batch_loss, batch_tokens = batch_ce_sum(model, batch, device)
        loss_sum, tokens, n_batches = loss_sum + batch_loss, tokens + batch_tokens, n_batches + 1
        n_bytes += target_bytes(batch["labels"], byte_lengths)
    ce = loss_sum / max(tokens, 1)
    return {"tokens": tokens, "ce": ce, "ppl": math.exp(min(ce, 50)), "bytes": n_bytes,
            "bpb": bits_per_byte(loss_sum, n_bytes), "batches": n_batches, "seq_len": data_args.seq_len,
            "root_dir": str(data_args.root_dir)}


def task_results(results: dict) -> dict:
    """{task: {metric: value, ..., "n_samples": n, "n_shot": k}} from simple_evaluate's output.

    lm-eval keys metrics as "<metric>,<filter>"; the default filter ("none") is dropped from the name.
    """
    tasks = {}
    for task, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            name, _, filter_name = key.partition(",")
            if filter_name and isinstance(value, (int, float)):
                metrics[name if filter_name == "none" else key] = float(value)
        if task in results.get("n-samples", {}):
            metrics["n_samples"] = results["n-samples"][task]["effective"]
        if task in results.get("n-shot", {}):
            metrics["n_shot"] = results["n-shot"][task]
        tasks[task] = metrics
    return tasks


def hf_model_args(hf_dir: Path, add_bos: bool, dtype: str = "float32", max_length: Optional[int] = None) -> dict:
    """lm-eval's HFLM arguments for an exported directory: fp32 as exported unless asked, BOS exactly when training
    added it (transformers 5 honours add_bos_token for any fast tokenizer; SmolLM2's adds no BOS by default)."""
    model_args = {"pretrained": str(hf_dir), "dtype": dtype, "add_bos_token": add_bos}
    if max_length is not None:
        model_args["max_length"] = max_length
    return model_args


def run_lm_eval(hf_dir: Path, tasks: list, manager, args: CheckpointEvalArgs, add_bos: bool,
                device: torch.device) -> dict:
    """lm-eval's Hugging Face backend on the exported directory; framing text with BOS as training did. With
    skip_unavailable_tasks, each task not shipped here runs alone and one that fails (its dataset cannot be
    downloaded, most often) is a warning naming it."""
    import lm_eval

    def evaluate(some: list) -> dict:
        results = lm_eval.simple_evaluate(
            model="hf", model_args=hf_model_args(hf_dir, add_bos, args.dtype, args.max_length), tasks=some,
            task_manager=manager, num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
            device=str(device), log_samples=False, gen_kwargs=args.gen_kwargs)
        return task_results(results)

    if not args.skip_unavailable_tasks:
        try:
            return evaluate(tasks)
        except ConnectionError as err:  # a standard task's dataset on a machine without the hub
            raise ConfigError(f"lm-eval could not download a task's dataset ({type(err).__name__}); standard tasks "
                              f"need the Hugging Face hub, offline use tasks={','.join(local_task_names())}.") from None
    ours = [task for task in tasks if task_name(task) in local_task_names()]
    found = evaluate(ours) if ours else {}
    for task in tasks:
        if task_name(task) in local_task_names():
            continue
        try:
            found.update(evaluate([task]))
        except Exception as err:  # noqa: BLE001 -- a hub task must not end a training run; the warning names it
            logger.warning(f"lm-eval task {task_name(task)!r} was skipped: {type(err).__name__}: "
                           f"{' '.join(str(err).split())[:300]} (tasks that download their dataset need the "
                           f"Hugging Face hub or a filled datasets cache; offline, use ours: "
                           f"{', '.join(local_task_names())}).")
    return found


def evaluate_checkpoint(args: CheckpointEvalArgs) -> dict:
    """Score a checkpoint (held-out perplexity + lm-eval tasks), write eval.json, return what it holds."""
    from apps.main.export_hf import (
        ExportArgs,
        export_checkpoint,
        load_params,
        resolve_checkpoint_dir,
    )
    from apps.main.generate import load_checkpoint_model, pick_device, trained_with_bos
    from lingua.args import dataclass_from_dict
    from lingua.tokenizer import TokenizerArgs, build_tokenizer, hf_form_problem

    args.validate()
    start = time.perf_counter()
    step_dir = resolve_checkpoint_dir(args.ckpt)
    params = load_params(step_dir)
    tasks = parse_tasks(args.tasks)
    names = [task_name(task) for task in tasks]
    tokenizer_args = dataclass_from_dict(TokenizerArgs, params.get("data", {}).get("tokenizer", {}))
    problem = hf_form_problem(tokenizer_args) if names else None
    if problem:
        raise ConfigError(f"lm-eval tasks read the checkpoint's Hugging Face export, but {problem}; pass tasks= for "
                          f"held-out perplexity only.")
    # Everything a user can get wrong is checked before the slow parts (export, model, lm-eval).
    data_args = held_out_data_args(params, args.data_dir, args.eval_sources) if args.perplexity else None
    if names and set(names) <= set(local_task_names()):
        for name in OFFLINE_ENV:
            os.environ.setdefault(name, "1")
    manager, tasks = build_task_manager(tasks, args.skip_unavailable_tasks) if tasks else (None, tasks)
    device = pick_device(args.device)
    add_bos = trained_with_bos(params)
    report = {"checkpoint": str(step_dir), "step": int(step_dir.name) if step_dir.name.isdigit() else None}

    if data_args is not None:
        model = load_checkpoint_model(step_dir, params, device)
        tokenizer = build_tokenizer(tokenizer_args)
        report["heldout"] = held_out_perplexity(model, data_args, tokenizer, device, args.perplexity_max_batches)
        del model
        logger.info(f"held-out: CE {report['heldout']['ce']:.4f}, ppl {report['heldout']['ppl']:.2f}, "
                    f"{report['heldout']['bpb']:.4f} bits per byte over {report['heldout']['tokens']:,} tokens")
    if tasks:
        with tempfile.TemporaryDirectory(prefix="lingua_eval_") as tmp:
            hf_dir = export_checkpoint(ExportArgs(ckpt=str(step_dir), out=args.hf_dir or tmp))
            report["tasks"] = run_lm_eval(hf_dir, tasks, manager, args, add_bos, device)
    report["settings"] = {"tasks": names, "limit": args.limit, "num_fewshot": args.num_fewshot,
                          "batch_size": args.batch_size, "device": str(device), "add_bos": add_bos,
                          "dtype": args.dtype, "max_length": args.max_length, "gen_kwargs": args.gen_kwargs}
    report["versions"] = versions(bool(names))
    report["wall_s"] = round(time.perf_counter() - start, 2)
    out = eval_json_path(args, step_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(report, indent=2) + "\n")
    tmp_out.replace(out)  # a reader never sees half a file
    logger.info(f"wrote {out}")
    if args.metric_log_dir:
        append_metric_rows(Path(args.metric_log_dir), report, args.global_step)
    return report


def append_metric_rows(metric_log_dir: Path, report: dict, global_step: Optional[int]) -> None:
    """One line each in metrics.eval.jsonl ({task: metrics}) and metrics.validation.jsonl ({"heldout": ...}), both
    stamped with created_at and global_step, as Meta Lingua writes them."""
    stamp = {"created_at": datetime.now(timezone.utc).isoformat(),
             "global_step": report["step"] if global_step is None else global_step}
    rows = [(METRICS_EVAL, report.get("tasks")), (METRICS_VALIDATION, report.get("heldout") and
                                                  {"heldout": report["heldout"]})]
    metric_log_dir.mkdir(parents=True, exist_ok=True)
    for name, values in rows:
        if values is not None:
            with open(metric_log_dir / name, "a") as f:
                f.write(json.dumps(stamp | values) + "\n")
                f.flush()


def eval_json_path(args: CheckpointEvalArgs, step_dir: Path) -> Path:
    if args.out:
        return Path(args.out)
    return Path(args.dump_dir) / EVAL_JSON if args.dump_dir else Path(step_dir) / EVAL_JSON


def versions(with_lm_eval: bool) -> dict:
    """Library versions behind the numbers (lm-eval scores move between its releases)."""
    import importlib.metadata

    packages = ["torch", "transformers"] + (["lm-eval"] if with_lm_eval else [])
    return {name: importlib.metadata.version(name) for name in packages}


def main(argv: Optional[list[str]] = None) -> None:
    from lingua.args import parse_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(CheckpointEvalArgs, argv)
    report = evaluate_checkpoint(args)
    for task, metrics in report.get("tasks", {}).items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k in ("acc", "acc_norm")))
    if "heldout" in report:
        heldout = report["heldout"]
        print(f"held-out: CE {heldout['ce']:.4f} nats/token, ppl {heldout['ppl']:.2f}, {heldout['bpb']:.4f} bits/byte, "
              f"{heldout['tokens']:,} tokens")
    print(f"wrote {eval_json_path(args, Path(report['checkpoint']))}")


if __name__ == "__main__":
    run_cli(main)
