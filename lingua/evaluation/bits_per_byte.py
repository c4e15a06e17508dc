"""Held-out loss in bits per byte: CE that compares across tokenizers.

    lengths = token_byte_lengths(tokenizer)               # once: the UTF-8 bytes each id stands for
    n_bytes = target_bytes(batch["labels"], lengths)      # per batch: the bytes of the scored target tokens
    bpb = bits_per_byte(ce_sum_nats, n_bytes)             # summed CE in nats / ln 2 / those bytes

The bytes are counted from the target ids that were scored (labels != -100), so the number is exact for what was
scored. Special ids (bos, eos, pad, chat markers, and the few ids a tokenizer cannot spell alone) count 0 bytes:
their CE stays in the sum, the text they stand for is none.
"""

import math
from typing import Optional

import torch

from lingua.data import IGNORE_INDEX
from lingua.distillation.cross_tokenizer.token_bytes import student_token_bytes
from lingua.tokenizer import Tokenizer

LN2 = math.log(2)


def byte_lengths(table: list[Optional[bytes]]) -> torch.Tensor:
    """A token-bytes table (None for a special id) as the bytes per id, an int64 tensor indexed by id."""
    return torch.tensor([len(piece) if piece else 0 for piece in table], dtype=torch.int64)


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id below `tokenizer.n_words` stands for (0 for bos, eos and the other special ids)."""
    return byte_lengths(student_token_bytes(tokenizer))


def target_bytes(labels: torch.Tensor, byte_lengths: torch.Tensor) -> int:
    """UTF-8 bytes the scored targets of `labels` stand for (positions labelled -100 are not scored)."""
    scored = labels[labels != IGNORE_INDEX].to(device="cpu", dtype=torch.int64)
    assert scored.numel() == 0 or int(scored.max()) < len(byte_lengths), (int(scored.max()), len(byte_lengths))
    return int(byte_lengths[scored].sum())


def batches_target_bytes(batches, byte_lengths: torch.Tensor) -> int:
    """`target_bytes` summed over held-out batches (dicts with "labels")."""
    return sum(target_bytes(batch["labels"], byte_lengths) for batch in batches)


def bits_per_byte(ce_sum_nats: float, n_bytes: float) -> float:
    """Summed CE in nats over the scored targets -> bits per byte of the text they stand for (0 when nothing was
    scored, as the eval's mean CE is)."""
    return ce_sum_nats / LN2 / max(n_bytes, 1)
