"""The loss benches' shared pieces: their settings, their seeded inputs (hidden states, head, labels, teacher
outputs) and the process-memory readings (`apps.bench.loss_step`, `apps.bench.loss_against`)."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MIB = 2**20
TEACHER_ROWS = 64  # teacher outputs are drawn this many rows at a time, so setup stays far below the measured peak


@dataclass
class BenchArgs:
    vocab: int = 49152
    tokens: int = 1024
    dim: int = 576  # SmolLM2-135M's width
    k: int = 64
    format: str = "topk"
    divergence: str = "fkl"
    temperature: float = 1.0
    alpha: float = 0.5
    ignored: float = 0.0  # share of labels set to -100
    repeats: int = 5
    warmup: int = 1
    rounds: int = 1
    threads: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    chunk_size: int = 0  # fused loss rows per chunk; 0 = its memory-budget default
    against: str = ""  # "liger": every variant beside Liger-Kernel's fused linear CE and JSD, in one process
    weight_grad: str = "accumulate"  # the fused loss's head-gradient mode (fused_loss.WEIGHT_GRADS)
    # --against: our variants also run with compiled=True (torch.compile of the chunk math), by name ("ce,kd_topk_t1")
    # or "all"; "" = none. Each is compiled once before any measurement (results.json: compile_s).
    compiled: str = ""
    reference_chunk_size: int = 1024  # kd_loss chunk, the trainer's loss_chunk_size default
    seed: int = 0
    out: Optional[str] = None


def make_inputs(args: BenchArgs, with_teacher: bool = True):
    """(hidden, weight, labels, teacher) on args.device, from args.seed; teacher is None for CE alone or when not
    wanted (drawing it costs seconds at V=128k; the other tensors do not depend on it)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(args.tokens, args.dim, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, generator=generator) * args.dim**-0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    labels[torch.rand(args.tokens, generator=generator) < args.ignored] = -100
    return hidden, weight, labels.to(device), make_teacher(args, generator) if with_teacher else None


def make_teacher(args: BenchArgs, generator: torch.Generator) -> TeacherOutputs:
    """Teacher outputs [1, tokens, ...] in args.format at args.temperature on args.device, drawn from `generator`."""
    # A peaked teacher (logit scale 3) gives realistic top-k mass; drawn in slices to bound setup memory.
    parts = [sparsify_teacher_logits(torch.randn(1, min(TEACHER_ROWS, args.tokens - start), args.vocab,
                                                 generator=generator) * 3.0,
                                     args.format, args.k, args.temperature, generator=generator)
             for start in range(0, args.tokens, TEACHER_ROWS)]
    tensors = [torch.cat([p.tensors()[i] for p in parts], dim=1).to(args.device)
               for i in range(len(parts[0].tensors()))]
    return TeacherOutputs.from_tensors(args.format, tensors)


def proc_status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def ratio(a: float, b: float) -> Optional[float]:
    # Tiny runs can peak below the RSS page granularity: no ratio rather than a division by zero.
    return a / b if b > 0 else None
