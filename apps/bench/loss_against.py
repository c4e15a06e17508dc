"""`python -m apps.bench.loss_step --against liger`: our fused CE and CE + KD variants beside Liger-Kernel's fused
linear cross-entropy and JSD, all in one process on the same hidden states and head.

    python -m apps.bench.loss_step --device cuda --dtype bfloat16 --vocab 128256 --dim 2048 --tokens 8192 --k 64 \
        --against liger --out DIR

Variants (each one forward + backward from the hidden states [tokens, dim] and the head [vocab, dim]):
    logits_ce          torch: logits = hidden @ weight.T, `cross_entropy_sum`, backward ([tokens, vocab] logits)
    ce                 `fused_linear_kd_loss` without a teacher: every ratio's first baseline
    kd_topk_t1/_t2     CE + KD against top-k teacher outputs, forward KL, T = 1 and T = 2 (alpha 0.5)
    kd_sampled         CE + KD against k samples of the teacher (T = 1)
    kd_rkl / kd_jsd    top-k at T = 1 with the reverse KL / the JSD (beta 0.5)
    liger_ce           Liger's LigerFusedLinearCrossEntropyLoss (Triton: CUDA only): the second baseline
    <ours>_compiled    --compiled NAMES: the same with the chunk math compiled (`compiled=True`), compiled once
                       before any measurement (compile_s in results.json)
    liger_jsd          Liger's LigerFusedLinearJSDLoss (it runs the teacher's head too: teacher hidden = a copy of
                       the student's, teacher head = a second [vocab, dim] weight)
--weight-grad vocab_blocks runs our variants in that mode. Liger is optional (a bench dependency, never the
product's): without it its rows say "not installed", and where it cannot run here they say why.

Time: the median wall clock of --repeats steps after --warmup, in --rounds rounds that rotate the variants'
order (a busy machine slows all alike). Peak: on CUDA max_memory_allocated minus memory_allocated right before
one step; on CPU VmHWM minus VmRSS (glibc set to map and unmap every block, so RSS follows live tensors).
"""

import ctypes
import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from apps.bench.loss_inputs import MIB, BenchArgs, make_inputs, make_teacher, proc_status_kib, ratio, reset_peak_rss
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.errors import ConfigError
from lingua.transformer import cross_entropy_sum

# name: (teacher format, divergence, temperature) of our variants; None = no teacher.
OURS = {"ce": None, "kd_topk_t1": ("topk", "fkl", 1.0), "kd_topk_t2": ("topk", "fkl", 2.0),
        "kd_sampled": ("sampled", "fkl", 1.0), "kd_rkl": ("topk", "rkl", 1.0), "kd_jsd": ("topk", "jsd", 1.0)}
LIGER = ("liger_ce", "liger_jsd")
VARIANTS = ("logits_ce", *OURS, *LIGER)
NOT_INSTALLED = "not installed"
COMPILED = "_compiled"
COLUMNS = ("variant", "fwd+bwd ms", "peak MiB", "time / our CE", "peak / our CE", "time / Liger CE", "peak / Liger CE")


def compiled_names(value: str) -> list[str]:
    """Our variants named by --compiled ("all" or a comma-separated list); one sentence on an unknown name."""
    names = list(OURS) if value == "all" else [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in OURS]
    if unknown:
        raise ConfigError(f"--compiled {value!r} names {', '.join(unknown)}; use all or some of {', '.join(OURS)}.")
    return names


def load_liger(device: str) -> dict:
    """{"liger_ce": module or a reason string, "liger_jsd": ...}: Liger's losses where they can run here."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except ImportError:
        return {name: NOT_INSTALLED for name in LIGER}
    found = {"liger_jsd": LigerFusedLinearJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
                                                  compiled=device == "cuda")}
    try:  # its CE is a Triton kernel: importable (and runnable) only with triton and a GPU
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        found["liger_ce"] = LigerFusedLinearCrossEntropyLoss() if device == "cuda" else "needs CUDA (Triton kernel)"
    except ImportError as error:
        found["liger_ce"] = f"cannot import: {error}"
    return found


def step_functions(args: BenchArgs, liger: dict) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """(one closure per runnable variant: forward + backward on shared inputs, a closure that frees the grads)."""
    hidden, weight, labels, _ = make_inputs(replace(args, format="topk"), with_teacher=False)
    generator = torch.Generator().manual_seed(args.seed + 1)
    teachers = {spec[0::2]: make_teacher(replace(args, format=spec[0], temperature=spec[2]), generator)
                for spec in OURS.values() if spec is not None}
    n_valid = max(int((labels != -100).sum()), 1)
    teacher_hidden = hidden.detach().clone()
    teacher_weight = torch.randn(weight.shape, generator=generator).mul_(args.dim**-0.5).to(weight.device, weight.dtype)

    def ours(spec, compiled=False):
        teacher = None if spec is None else teachers[spec[0::2]]
        alpha, divergence, temperature = (0.0, "fkl", 1.0) if spec is None else (args.alpha, spec[1], spec[2])
        return lambda: fused_linear_kd_loss(hidden, weight, labels, teacher, n_valid, alpha, temperature, divergence,
                                            chunk_size=args.chunk_size, weight_grad=args.weight_grad,
                                            compiled=compiled)[0]

    losses = {"logits_ce": lambda: cross_entropy_sum((hidden @ weight.T).unsqueeze(0), labels.unsqueeze(0)) / n_valid}
    for name, spec in OURS.items():
        losses[name] = ours(spec)
        if name in compiled_names(args.compiled):  # beside its eager twin, in the same rounds
            losses[name + COMPILED] = ours(spec, compiled=True)
    if not isinstance(liger.get("liger_ce"), str):
        losses["liger_ce"] = lambda: liger["liger_ce"](weight, hidden, labels)
    if not isinstance(liger.get("liger_jsd"), str):
        losses["liger_jsd"] = lambda: liger["liger_jsd"](hidden, weight, teacher_hidden, teacher_weight, labels)

    def reset():
        hidden.grad = weight.grad = None

    def step_of(loss_fn):
        def step():
            reset()
            loss_fn().backward()
        return step

    return {name: step_of(loss_fn) for name, loss_fn in losses.items()}, reset


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_peak(step: Callable[[], None], reset: Callable[[], None], device: str) -> float:
    """MiB above the memory allocated right before one step (the last step's grads freed), at the step's peak."""
    reset()
    gc.collect()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        return (torch.cuda.max_memory_allocated() - base) / MIB
    reset_peak_rss()
    base = proc_status_kib("VmRSS")
    step()
    return (proc_status_kib("VmHWM") - base) / 1024


def measure_all(steps: dict[str, Callable[[], None]], reset: Callable[[], None], args: BenchArgs) -> dict[str, dict]:
    """{variant: {"ms", "all_ms", "peak_mib"}}: peaks first (one step each), then --rounds rotated timing rounds."""
    if args.device == "cpu" and platform.system() == "Linux":  # mmap every block >= 64 KiB: RSS follows live tensors
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 65536)  # M_TRIM_THRESHOLD
    names, failed = list(steps), {}
    compile_s = {}
    for name in names:  # a first step each: compiling is a one-off per process, neither a peak nor a timed step
        _sync(args.device)
        start = time.perf_counter()
        if _tried(steps[name], reset, args.device, name, failed) and name.endswith(COMPILED):
            compile_s[name] = time.perf_counter() - start
    names = [name for name in names if name not in failed]
    reset()
    results = {name: {"all_ms": [], "peak_mib": measure_peak(steps[name], reset, args.device)} for name in names}
    for name, seconds in compile_s.items():
        results[name]["compile_s"] = seconds
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            for _ in range(args.warmup):
                steps[name]()
            for _ in range(args.repeats):
                _sync(args.device)
                start = time.perf_counter()
                steps[name]()
                _sync(args.device)
                results[name]["all_ms"].append(1e3 * (time.perf_counter() - start))
    for name in names:
        results[name]["ms"] = statistics.median(results[name]["all_ms"])
    return {**results, **{name: {"failed": reason} for name, reason in failed.items()}}


def _tried(step: Callable[[], None], reset: Callable[[], None], device: str, name: str, failed: dict) -> bool:
    """One step of `name`; a variant that raises (out of memory, a compile error) becomes its row's reason, so one
    failure costs its row, not the whole shape's table (a lent GPU's minutes are few)."""
    try:
        step()
        _sync(device)
        return True
    except Exception as error:  # noqa: BLE001 - any failure of a variant is reported in its row
        failed[name] = f"failed: {type(error).__name__}: {' '.join(str(error).split())[:160]}"
        reset()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return False


def summarize(args: BenchArgs, measured: dict[str, dict], liger: dict, liger_version: Optional[str]) -> dict:
    """results.json: every variant's time and peak (or why it did not run) and its ratios to our CE and Liger's."""
    rows = {}
    for name in [*VARIANTS[:-len(LIGER)], *(n for n in measured if n.endswith(COMPILED)), *LIGER]:
        if name not in measured or "failed" in measured[name]:
            rows[name] = {"status": measured[name]["failed"] if name in measured else liger.get(name, NOT_INSTALLED)}
            continue
        row = {"status": "ok", "ms": measured[name]["ms"], "peak_mib": measured[name]["peak_mib"],
               "all_ms": measured[name]["all_ms"]}
        if "compile_s" in measured[name]:
            row["compile_s"] = measured[name]["compile_s"]
        for base in ("ce", "liger_ce"):
            ok = "ms" in measured.get(base, {})
            row[f"ms_over_{base}"] = ratio(row["ms"], measured[base]["ms"]) if ok else None
            row[f"peak_over_{base}"] = ratio(row["peak_mib"], measured[base]["peak_mib"]) if ok else None
        rows[name] = row
    return {"variants": rows, "liger": liger_version or NOT_INSTALLED, "settings": asdict(args),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} "
                                                                                 f"thread(s))"}


def format_markdown(results: dict) -> str:
    """The ratio table: time and peak of each variant, each over our fused CE and over Liger's fused CE."""
    s = results["settings"]
    title = (f"V={s['vocab']} D={s['dim']} N={s['tokens']} k={s['k']} {s['dtype']} on {results['device']}, torch "
             f"{results['torch']}, Liger {results['liger']}, weight_grad={s['weight_grad']}, median of "
             f"{s['repeats']} x {s['rounds']} round(s)")
    lines = [title, "", "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]

    def shown(value):
        return "n/a" if value is None else f"{value:.2f}"

    for name, row in results["variants"].items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']} | | | | | |")
            continue
        lines.append(f"| {name} | {row['ms']:.1f} | {row['peak_mib']:.0f} | {shown(row['ms_over_ce'])} | "
                     f"{shown(row['peak_over_ce'])} | {shown(row['ms_over_liger_ce'])} | "
                     f"{shown(row['peak_over_liger_ce'])} |")
    return "\n".join(lines)


def liger_version() -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("liger-kernel")
    except PackageNotFoundError:
        return None


def run_against(args: BenchArgs, liger: Optional[dict] = None) -> dict:
    """Measure every variant in this process, write DIR/results.json and print the ratio table."""
    torch.set_num_threads(args.threads)
    liger = load_liger(args.device) if liger is None else liger
    version = liger_version() if any(not isinstance(v, str) for v in liger.values()) else None
    results = summarize(args, measure_all(*step_functions(args, liger), args), liger, version)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "table.md").write_text(format_markdown(results) + "\n")
    print(format_markdown(results))
    return results
