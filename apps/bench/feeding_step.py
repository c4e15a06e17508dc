"""The whole-step part of `python -m apps.bench.feeding --device cuda`: CE-only against KD from a teacher cache.

For each student shape (SmolLM2-135M's, "139m"; a bigger Llama shape of 817M parameters, "810m"; "tiny" for the
CPU test of this code path), one training run on one rank with CE only and one from a top-64 cache written once
by the pipelined writer (`apps.main.teacher_cache`) from a teacher with SmolLM2-135M's shape and random weights.
From each run's metrics.jsonl (steps after the first few, medians): `speed/data_time_s` as a share of
`speed/step_time_s`, and the forward + backward seconds (`stragglers/fwd_bwd_max_s`, the one rank's), whose
KD/CE ratio is the cost of distilling from the cache.
"""

import json
import statistics
import subprocess
from dataclasses import fields
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from apps.bench.launcher import ROOT, torchrun_command
from apps.main.teacher_cache import TeacherCacheArgs
from apps.main.train import TrainArgs
from lingua.errors import RunFailed

STUDENTS = {  # model.* overrides; parameters with SmolLM2's 49,152-id vocabulary, tied embeddings
    "139m": {"dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3},  # SmolLM2-135M's shape: 134.5M
    "810m": {"dim": 1792, "n_layers": 22, "n_heads": 14, "n_kv_heads": 2},  # 817.3M
    "tiny": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},  # the CPU test of this code path
}
SKIP_STEPS = 5  # start-up, compilation and the allocator's first steps are not the steady state
TINY_TEACHER = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16}


def random_teacher(source: str, out: Path, tiny: bool = False) -> Path:
    """A teacher with `source`'s config (tiny: 2 layers of width 64) and random weights, with its tokenizer."""
    config = AutoConfig.from_pretrained(source)
    if tiny:
        for key, value in TINY_TEACHER.items():
            setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def launch(module: str, overrides: list[str], what: str, timeout_s: float = 300) -> str:
    try:
        result = subprocess.run(torchrun_command(1, module, overrides), cwd=ROOT, capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"the {what} ran past {timeout_s:.0f} s; rerun with fewer --steps.") from None
    if result.returncode != 0:
        output = result.stdout + result.stderr
        sentences = [line for line in output.splitlines() if line.startswith("error: ")]
        raise RunFailed(f"the {what} failed: " + (sentences[0] if sentences else output[-3000:]))
    return result.stdout + result.stderr


def run_summary(metrics: Path) -> dict:
    """Medians over the steady steps of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [row for row in rows if row.get("step", 0) > SKIP_STEPS and "speed/step_time_s" in row] or rows[-1:]
    return {"step_s": statistics.median(r["speed/step_time_s"] for r in rows),
            "data_s": statistics.median(r["speed/data_time_s"] for r in rows),
            "data_share": statistics.median(r["speed/data_time_s"] / r["speed/step_time_s"] for r in rows),
            "fwd_bwd_s": statistics.median(r["stragglers/fwd_bwd_max_s"] for r in rows),
            "tokens_per_s": statistics.median(r["speed/tokens_per_s"] for r in rows), "steps": len(rows)}


def step_comparison(options, args, folder: Path) -> dict:
    """{student: {"ce": summary, "kd_cache": summary, "fwd_bwd_kd_over_ce": ratio}} on options.device."""
    cache_only = {f.name for f in fields(TeacherCacheArgs)} - {f.name for f in fields(TrainArgs)}
    overrides = [item for item in options.overrides if item.split("=")[0] not in cache_only]  # the trainer's keys
    config = [f"config={options.config}", *overrides, f"steps={options.steps}", "logging.freq=1",
              "heldout.every=0", "checkpoint.dump.every=0", f"model.max_seqlen={args.data.seq_len}",
              f"distillation.teacher_path={args.distillation.teacher_path}",
              f"distillation.teacher_dtype={args.distillation.teacher_dtype}",
              *(["distributed.model_dtype=bf16"] if options.device == "cuda" else [])]
    cache = folder / "step_cache"
    try:
        launch("apps.main.teacher_cache", [*config, f"cache_dir={cache}", "streams=1",
                                           f"shard_sequences={args.data.batch_size}", "encode_workers=-1"],
               "cache writer")
    except RunFailed as error:  # the writer's and loader's rows are kept; the step rows say why they are missing
        return {student: {"failed": str(error)} for student in options.students.split(",")}
    out = {}
    for student in options.students.split(","):
        shape = [f"model.{key}={value}" for key, value in STUDENTS[student].items()]
        runs = {}
        try:
            for mode, extra in (("ce", ["enable_distillation=false"]),
                                ("kd_cache", ["distillation.source=cache", f"distillation.cache_dir={cache}"])):
                dump = folder / f"{student}_{mode}"
                launch("apps.main.train", [*config, *shape, *extra, f"dump_dir={dump}"], f"{student} {mode} run")
                runs[mode] = run_summary(dump / "metrics.jsonl")
        except RunFailed as error:  # one student's failure (out of memory, say) leaves the other's rows
            out[student] = {**runs, "failed": str(error)}
            continue
        out[student] = {**runs, "fwd_bwd_kd_over_ce": runs["kd_cache"]["fwd_bwd_s"] / runs["ce"]["fwd_bwd_s"]}
    return out


def format_step_table(results: dict, then: dict) -> str:
    """The issue's table, then (its H100 figures) and now (this run)."""
    writer, steps = results["writer"], results["steps"]
    lines = ["| path | then (issue 35, one H100) | now |", "|---|---|---|"]
    for student, row in steps.items():
        if "failed" in row:
            lines.append(f"| {student} student | - | {row['failed'][:300]} |")
            continue
        then_share = then.get(f"ce_{student}_data_share")
        lines.append(f"| {student} student, CE only: data time / step | "
                     f"{'%.0f%%' % (100 * then_share) if then_share else '-'} | "
                     f"{100 * row['ce']['data_share']:.1f}% of {1e3 * row['ce']['step_s']:.0f} ms |")
        lines.append(f"| {student} student, KD from the cache: data time / step | 0.5 ms wait | "
                     f"{100 * row['kd_cache']['data_share']:.1f}% of {1e3 * row['kd_cache']['step_s']:.0f} ms |")
        lines.append(f"| {student} student: fwd+bwd KD / CE | - | {row['fwd_bwd_kd_over_ce']:.2f}x |")
    lines.append(f"| cache writer / its teacher's forward + top-64 | {then['writer_tokens_per_s']:,} / "
                 f"{then['teacher_forward_tokens_per_s']:,} tokens/s | "
                 f"{writer['pipelined_writer_tokens_per_s']:,.0f} / "
                 f"{writer['forward_tokens_per_s']:,.0f} tokens/s "
                 f"({100 * writer['pipelined_writer_tokens_per_s'] / writer['forward_tokens_per_s']:.0f}%) |")
    lines.append(f"| v2 reader decode, one thread | {then['reader_decode_tokens_per_s']:,} tokens/s | "
                 f"{writer['reader_decode_tokens_per_s']:,.0f} tokens/s |")
    return "\n".join(lines)
