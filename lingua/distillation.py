"""Distillation settings, the error every bridge member reports alike, and a map of the pieces.

A distillation job splits its ranks into students and teachers (`lingua/launch.py`). The pieces:

    lingua/distiller.py       the one object the student loop asks for the KD part of a step
    lingua/teacher_client.py  student end of a bridge: handshake, submit/wait, STOP
    lingua/teacher_server.py  teacher rank: load, handshake, then receive -> handle -> reply until STOP
    lingua/bridge.py          the wire records (RequestHeader, HandshakeRecord, ResponseStatus), the handshake
    lingua/teacher.py         finding, checking and loading a transformers teacher
    lingua/kd_loss.py         the sparse teacher outputs and the KD losses
"""

from dataclasses import dataclass
from typing import Optional

import torch

from lingua.cli import UserError
from lingua.kd_loss import DIVERGENCES, FORMATS

MAX_PREFETCH = 2  # requests ahead; more only holds more response buffers without hiding more
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEACHER_DTYPES = ("auto", "bf16", "fp32", "fp16")
SOURCES = ("online", "cache")


class TeacherError(UserError, RuntimeError):
    """A teacher-side failure every bridge member reports in the same words (load, request, forward)."""


@dataclass
class DistillationArgs:
    teacher_path: Optional[str] = None  # local directory (or hub id when online) of a transformers causal LM
    n_teacher_ranks: int = 1
    output: str = "topk"  # "topk" | "sampled" | "full"
    k: int = 64  # top-k ids, or samples per position for "sampled"
    temperature: float = 1.0
    alpha: float = 0.5  # loss = (1 - alpha) * CE + alpha * T^2 * KD
    alpha_schedule: str = "constant"  # "constant" | "lr" (alpha follows the lr schedule's factor)
    divergence: str = "fkl"  # "fkl" | "rkl" | "jsd"
    jsd_beta: float = 0.5
    teacher_dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bf16" | "fp32" | "fp16"
    attn_implementation: Optional[str] = "sdpa"
    wire_dtype: str = "bf16"  # dtype of the values sent to students: "bf16" | "fp16" | "fp32"
    # The student's CE + KD computed fused with its output head (lingua/fused_kd_loss.py: no [tokens, vocab]
    # logits, KD costs about what CE does); false = logits, then CE and the chunked kd_loss on them.
    fused_loss: bool = True
    loss_chunk_size: int = 0  # positions per chunk of the student's loss; 0 = auto (fused: a memory budget; else 1024)
    logits_chunk_rows: int = 4  # teacher rows per lm_head chunk (bounds the teacher's logits memory)
    seed: int = 0  # for the "sampled" output
    # Where the teacher's outputs come from: "online" (teacher ranks, the bridge) or "cache" (an offline cache
    # written by apps.main.teacher_cache into cache_dir; every rank is a student, the cache is the dataset).
    source: str = "online"
    cache_dir: Optional[str] = None
    # Teacher requests submitted ahead of the micro-batch being computed (0 = each right before its own
    # forward), across step boundaries: with 1 the teacher's forward hides behind the student's whole step.
    prefetch: int = 1


def validate_distillation_args(args: DistillationArgs) -> None:
    """Readable errors for distillation settings, before anything distributed happens."""
    if args.output not in FORMATS:
        raise ValueError(f"distillation.output={args.output!r}; use one of {', '.join(FORMATS)}.")
    if args.wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"distillation.wire_dtype={args.wire_dtype!r}; use one of {', '.join(WIRE_DTYPES)}.")
    if args.divergence not in DIVERGENCES:
        raise ValueError(f"distillation.divergence={args.divergence!r}; use fkl, rkl or jsd.")
    if args.output == "sampled" and args.divergence != "fkl":
        raise ValueError("distillation.output=sampled estimates the forward KL only; set distillation.divergence=fkl.")
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"distillation.alpha={args.alpha} must be in [0, 1].")
    if args.temperature <= 0:
        raise ValueError(f"distillation.temperature={args.temperature} must be positive.")
    if args.output != "full" and args.k < 1:
        raise ValueError(f"distillation.k={args.k} must be >= 1.")
    if args.loss_chunk_size < 0:
        raise ValueError(f"distillation.loss_chunk_size={args.loss_chunk_size}; use 0 (auto) or a positive number of "
                         f"positions per chunk.")
    if args.divergence == "jsd" and not 0.0 < args.jsd_beta < 1.0:
        raise ValueError(f"distillation.jsd_beta={args.jsd_beta} must be strictly between 0 and 1.")
    if not 0 <= args.prefetch <= MAX_PREFETCH:
        raise ValueError(f"distillation.prefetch={args.prefetch}; use 0 (no look-ahead), 1 or {MAX_PREFETCH}.")
    if args.source not in SOURCES:
        raise ValueError(f"distillation.source={args.source!r}; use online (teacher ranks) or cache (an offline "
                         f"teacher cache in distillation.cache_dir).")
    if args.source == "cache":
        if not args.cache_dir:
            raise ValueError("distillation.source=cache needs distillation.cache_dir=<a cache written by "
                             "apps.main.teacher_cache>.")
        return  # the cache holds the teacher's outputs: no teacher_path needed
    if not args.teacher_path:
        raise ValueError("Distillation is on but distillation.teacher_path is empty; set it or enable_distillation=false.")
