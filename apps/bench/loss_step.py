"""Benchmark of the output head + loss step: CE alone (fused and on logits), CE + kd_loss, and the fused CE + KD loss.

    python -m apps.bench.loss_step --vocab 49152 --tokens 1024 --k 64 --out DIR
    python -m apps.bench.loss_step --vocab 49152 --tokens 1024 --k 64 --threads 2 --rounds 3 --out DIR

Each variant runs forward + backward from the final hidden states [tokens, dim] and the head weight
[vocab, dim] (both requiring grad, grads set to None before every repeat as a training step would):

    ce            `fused_linear_kd_loss` without a teacher (alpha 0), backward: the trainer's CE-only step
                  (enable_distillation=false, alpha 0), the baseline every ratio is taken against
    logits_ce     logits = hidden @ weight.T, `cross_entropy_sum` / n_valid, backward (CE on the full
                  [tokens, vocab] logits: distillation.fused_loss=false, and the CE step before it was fused)
    reference_kd  the research path (`research_head_loss`, distillation.fused_loss=false): CE + KD in autograd
                  over chunks of --reference-chunk-size rows of the logits, backward
    fused_kd      `fused_linear_kd_loss` on the hidden states and the head weight, backward
    fused_kd_2_teachers  the same with two teachers mixed half and half (`more_teachers`, distillation.teachers:
                  one set of head GEMMs, the second teacher's chunk math on a copy of the logits; with
                  --weight-grad vocab_blocks two passes of the fused head); the teacher's outputs stand for both

`--against liger` instead runs our variants (CE, top-k T=1/T=2, sampled, rkl, jsd) beside Liger-Kernel's
fused linear CE and JSD in one process (`apps.bench.loss_against`):

    python -m apps.bench.loss_step --device cuda --dtype bfloat16 --vocab 128256 --dim 2048 --tokens 8192 \
        --k 64 --against liger --out DIR

and `--compiled ce,kd_topk_t1` (or `all`) adds those variants with the chunk math compiled (`fused_linear_kd_loss(...,
compiled=True)`) beside the eager ones, in the same process and rounds: the comparison that sets
`distillation.loss_compile`'s default.

Every variant is measured in fresh processes (`--rounds` times, interleaved, so a busy machine slows
all of them alike), one for time and one for memory, so neither peaks nor allocator states mix.
Time: the median wall clock of --repeats fwd+bwd after --warmup (CPU time too: on a shared machine
it is the steadier number). Memory on CPU: VmHWM after the steps minus VmRSS right before them
(VmHWM is reset there through /proc/self/clear_refs when the kernel allows it), with glibc's mmap
threshold fixed (`MEMORY_PHASE_ENV`); on CUDA: max_memory_allocated minus memory_allocated at the
same point. Writes DIR/results.json and prints a markdown table.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from apps.bench.loss_inputs import (
    DTYPES,
    MIB,
    BenchArgs,
    make_inputs,
    proc_status_kib,
    ratio,
    reset_peak_rss,
)
from lingua.cli.entry import run_cli
from lingua.distillation.loss.divergences import DIVERGENCES
from lingua.distillation.loss.fused import WEIGHT_GRADS, auto_chunk_rows, fused_linear_kd_loss
from lingua.distillation.outputs import FORMATS
from lingua.distillation.loss.research import research_head_loss
from lingua.errors import ConfigError, RunFailed
from lingua.transformer import cross_entropy_sum

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("ce", "logits_ce", "reference_kd", "fused_kd", "fused_kd_2_teachers")
# glibc raises its mmap threshold (up to 32 MiB) as big blocks are freed and then keeps freed heap blocks
# resident, so RSS would count setup garbage and miss reuse; a fixed 64 KiB threshold maps and unmaps
# every tensor block, and VmHWM then follows live tensor memory (checked: a sampling thread agrees).
MEMORY_PHASE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def check_args(args: BenchArgs) -> None:
    """Raise ConfigError with a sentence on what to change for settings the benchmark cannot run."""
    for name in ("vocab", "tokens", "dim", "repeats", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1.")
    if args.warmup < 0 or args.chunk_size < 0 or args.reference_chunk_size < 1:
        raise ConfigError("--warmup and --chunk-size must be >= 0 and --reference-chunk-size >= 1.")
    if args.format not in FORMATS:
        raise ConfigError(f"--format {args.format!r} is unknown; use one of {', '.join(FORMATS)}.")
    if args.divergence not in DIVERGENCES:
        raise ConfigError(f"--divergence {args.divergence!r} is unknown; use one of {', '.join(DIVERGENCES)}.")
    if args.format == "sampled" and args.divergence != "fkl":
        raise ConfigError("--format sampled supports only --divergence fkl.")
    if args.format != "full" and not 1 <= args.k <= args.vocab:
        raise ConfigError(f"--k {args.k} must be between 1 and --vocab {args.vocab}.")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device {args.device!r} is not available here; use cpu (or cuda on a GPU machine).")
    if args.against not in ("", "liger"):
        raise ConfigError(f"--against {args.against!r} is unknown; use --against liger (or leave it out).")
    if args.weight_grad not in WEIGHT_GRADS:
        raise ConfigError(f"--weight-grad {args.weight_grad!r} is unknown; use one of {', '.join(WEIGHT_GRADS)}.")
    if args.compiled and not args.against:
        raise ConfigError("--compiled runs beside the eager variants in one process: add --against liger.")
    if args.compiled:
        from apps.bench.loss_against import compiled_names
        compiled_names(args.compiled)  # raises on an unknown name
    if not 0.0 <= args.ignored < 1.0 or not 0.0 <= args.alpha <= 1.0 or args.temperature <= 0:
        raise ConfigError("--ignored must be in [0, 1), --alpha in [0, 1] and --temperature positive.")


def parse_args(argv: Optional[list[str]] = None) -> tuple[BenchArgs, Optional[tuple[str, str]]]:
    """(settings, (worker variant, phase) or None) from the command line; settings are checked."""
    parser = argparse.ArgumentParser(prog="python -m apps.bench.loss_step", description=__doc__.split("\n")[0])
    for name, default in asdict(BenchArgs()).items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(default) if default is not None else str, default=default)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: measure one variant
    parser.add_argument("--phase", choices=("time", "memory"), default="time", help=argparse.SUPPRESS)
    namespace = vars(parser.parse_args(argv))
    worker = namespace.pop("worker")
    phase = namespace.pop("phase")
    args = BenchArgs(**namespace)
    check_args(args)
    if worker is None and args.out is None:
        raise ConfigError("--out DIR is required: the results are written to DIR/results.json.")
    return args, None if worker is None else (worker, phase)


def step_function(variant: str, args: BenchArgs, hidden, weight, labels, teacher) -> Callable[[], None]:
    """A closure running one forward + backward of `variant` (grads of hidden and weight reset first)."""
    n_valid = max(int((labels != -100).sum()), 1)
    batch_labels = labels.unsqueeze(0)

    def step():
        hidden.grad = weight.grad = None
        if variant == "fused_kd":
            loss, _ = fused_linear_kd_loss(hidden, weight, labels, teacher, n_valid, args.alpha, args.temperature,
                                           args.divergence, chunk_size=args.chunk_size, weight_grad=args.weight_grad)
        elif variant == "fused_kd_2_teachers":  # as lingua/distillation/loss/mixture.py calls it for each weight_grad
            half = torch.full(labels.shape, 0.5, device=labels.device)
            shared = args.weight_grad == "accumulate"
            loss, _ = fused_linear_kd_loss(hidden, weight, labels, teacher, n_valid, args.alpha, args.temperature,
                                           args.divergence, chunk_size=args.chunk_size, kd_weight=half,
                                           weight_grad=args.weight_grad, more_teachers=((teacher, half),) if shared
                                           else ())
            if not shared:  # one more pass of the fused head: alpha * T^2 * half * KD, no CE
                loss = loss + fused_linear_kd_loss(hidden, weight, labels, teacher, n_valid, 1.0, args.temperature,
                                                   args.divergence, chunk_size=args.chunk_size,
                                                   kd_weight=half * args.alpha, weight_grad=args.weight_grad)[0]
        elif variant == "reference_kd":
            settings = SimpleNamespace(temperature=args.temperature, divergence=args.divergence, jsd_beta=0.5,
                                       loss_chunk_size=args.reference_chunk_size, uld_weight=0.0, uld_k=1,
                                       z_loss=0.0)
            loss, _ = research_head_loss(hidden, weight, labels, [(teacher, None, False)], n_valid, args.alpha,
                                         settings)
        elif variant == "ce":
            loss, _ = fused_linear_kd_loss(hidden, weight, labels, None, n_valid, 0.0, 1.0, chunk_size=args.chunk_size,
                                           weight_grad=args.weight_grad)
        else:
            logits = (hidden @ weight.T).unsqueeze(0)
            loss = cross_entropy_sum(logits, batch_labels) / n_valid
        loss.backward()

    return step


def measure(variant: str, args: BenchArgs, phase: str) -> dict:
    """One variant in this process (call it in a fresh one): phase "time" gives the median fwd+bwd wall and
    CPU ms over --repeats after --warmup; phase "memory" the peak above the memory right before the steps."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    step = step_function(variant, args, *make_inputs(args))
    cuda = args.device == "cuda"
    gc.collect()
    if phase == "memory":
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base, peak_reset = torch.cuda.memory_allocated(), True
        else:
            peak_reset = reset_peak_rss()
            base = proc_status_kib("VmRSS") * 1024
        for _ in range(args.warmup + 1):
            step()
        if cuda:
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = proc_status_kib("VmHWM") * 1024 - base
        return {"peak_mib": peak / MIB, "peak_reset": peak_reset}
    for _ in range(args.warmup):
        step()
    wall, cpu = [], []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall.append(1e3 * (time.perf_counter() - wall0))
        cpu.append(1e3 * (time.process_time() - cpu0))
    return {"ms": statistics.median(wall), "cpu_ms": statistics.median(cpu), "all_ms": wall}


def run_variant_subprocess(variant: str, args: BenchArgs) -> dict:
    """`measure(variant)` for time, then for memory, each in a fresh Python process; the merged results."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(args).items() if v is not None and k != "out"]
    results = {}
    for phase in ("time", "memory"):
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the caller's kept
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=python_path)
        if phase == "memory":
            env.update(MEMORY_PHASE_ENV)
        result = subprocess.run([sys.executable, "-m", "apps.bench.loss_step", "--worker", variant, "--phase", phase,
                                 *flags], cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RunFailed(f"bench variant {variant} ({phase}) failed (exit {result.returncode}):\n"
                            f"{result.stderr[-4000:]}")
        results.update(json.loads(result.stdout.strip().splitlines()[-1]))
    return results


def summarize(args: BenchArgs, rounds: dict[str, list[dict]]) -> dict:
    """results.json: the medians over rounds per variant, their spread, the ratios and the settings."""

    def median(variant, key):
        return statistics.median(r[key] for r in rounds[variant])

    def spread(variant, key):
        return [min(r[key] for r in rounds[variant]), max(r[key] for r in rounds[variant])]

    names = {"ce": "ce", "logits_ce": "logits_ce", "reference_kd": "reference_kd", "fused_kd": "kd",
             "fused_kd_2_teachers": "kd_2_teachers"}
    results = {}
    for variant, name in names.items():
        results[f"{name}_ms"] = median(variant, "ms")
        results[f"{name}_cpu_ms"] = median(variant, "cpu_ms")
        results[f"{name}_peak_mib"] = median(variant, "peak_mib")
        results[f"{name}_ms_range"] = spread(variant, "ms")
        results[f"{name}_cpu_ms_range"] = spread(variant, "cpu_ms")
    results.update({
        "kd_over_ce_ms": ratio(results["kd_ms"], results["ce_ms"]),
        "kd_over_ce_cpu_ms": ratio(results["kd_cpu_ms"], results["ce_cpu_ms"]),
        "kd_over_ce_peak": ratio(results["kd_peak_mib"], results["ce_peak_mib"]),
        "logits_ce_over_ce_ms": ratio(results["logits_ce_ms"], results["ce_ms"]),
        "logits_ce_over_ce_peak": ratio(results["logits_ce_peak_mib"], results["ce_peak_mib"]),
        "reference_kd_over_ce_ms": ratio(results["reference_kd_ms"], results["ce_ms"]),
        "reference_kd_over_ce_peak": ratio(results["reference_kd_peak_mib"], results["ce_peak_mib"]),
        "reference_kd_over_kd_ms": ratio(results["reference_kd_ms"], results["kd_ms"]),
        "kd_2_teachers_over_kd_ms": ratio(results["kd_2_teachers_ms"], results["kd_ms"]),
        "kd_2_teachers_over_kd_cpu_ms": ratio(results["kd_2_teachers_cpu_ms"], results["kd_cpu_ms"]),
        "fused_chunk_rows": args.chunk_size or auto_chunk_rows(args.vocab, args.format, args.device, DTYPES[args.dtype]),
        "peak_reset": all(r["peak_reset"] for variant in VARIANTS for r in rounds[variant]),
        "settings": asdict(args),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores visible)",
        "threads": args.threads,
        "rounds": {variant: rounds[variant] for variant in VARIANTS},
    })
    return results


def format_markdown(results: dict) -> str:
    """A small table of the variants with their ratios to the fused CE step."""
    s = results["settings"]
    lines = [f"V={s['vocab']} N={s['tokens']} D={s['dim']} k={s['k']} {s['format']}/{s['divergence']} "
             f"T={s['temperature']} {s['dtype']} on {results['device']}, {results['threads']} thread(s), "
             f"median of {s['repeats']} repeats x {s['rounds']} round(s)", "",
             "| variant | fwd+bwd ms | CPU ms | peak MiB | time / CE | peak / CE |",
             "|---|---:|---:|---:|---:|---:|"]
    def shown(a, b):
        value = ratio(a, b)
        return "n/a" if value is None else f"{value:.2f}"

    for label, name in (("CE only (fused)", "ce"), ("CE only on logits", "logits_ce"),
                        ("reference KD (kd_loss)", "reference_kd"), ("fused KD", "kd"),
                        ("fused KD, 2 teachers", "kd_2_teachers")):
        lines.append(f"| {label} | {results[f'{name}_ms']:.0f} | {results[f'{name}_cpu_ms']:.0f} | "
                     f"{results[f'{name}_peak_mib']:.0f} | {shown(results[f'{name}_ms'], results['ce_ms'])} | "
                     f"{shown(results[f'{name}_peak_mib'], results['ce_peak_mib'])} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None, run_variant: Callable[[str, BenchArgs], dict] = run_variant_subprocess):
    """Parse, run every variant --rounds times (each in a fresh process), write results.json, print the table."""
    args, worker = parse_args(argv)
    if args.against:
        from apps.bench.loss_against import run_against
        return run_against(args)
    if worker is not None:
        print(json.dumps(measure(worker[0], args, worker[1])))
        return None
    rounds = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            rounds[variant].append(run_variant(variant, args))
    results = summarize(args, rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_markdown(results))
    return results


if __name__ == "__main__":
    run_cli(main)
