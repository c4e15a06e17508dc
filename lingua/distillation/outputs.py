"""What the teacher sends: its outputs in one of three sparse-or-full formats, and how logits become them.

Wire formats (all tensors lead with [B, S] so the transport can pad and slice them the same way;
every value is at the distillation temperature T, computed in fp32 on the teacher before any cast):

    format    tensors() in order                               bytes per token
    topk      values  [B,S,k] wire dtype  log p_T of the k ids    k * (w + 4) + 4
              ids     [B,S,k] int32       the k most likely ids, most likely first
              extra   [B,S]   float32     1 - sum of p_T over the ids (mass of the "rest" bucket)
    sampled   values  [B,S,k] wire dtype  log p_T of the sampled ids  k * (w + 4) + 4
              ids     [B,S,k] int32       k ids drawn i.i.d. with replacement from p_T
              extra   [B,S]   float32     sum_v p_T(v) log p_T(v) (the teacher's negative entropy)
    full      values  [B,S,V] wire dtype  log p_T of every id                V * w

A cross-tokenizer teacher (`cross_tokenizer/targets.py`) sends topk or sampled in the student's ids plus kd_weight
[B,S] float32 (1 aligned, 0 CE only); its sampled draws are from the teacher's probabilities added up per student id,
a draw of an unmapped teacher id is id -1 with value -inf, and extra is then the mapped part's
sum_s p(s) log(p(s) / M), M = the mapped mass (`divergences.sampled_forward_kl`).

(w = bytes of the wire dtype, 2 for bf16). The teacher computes them with `sparsify_teacher_logits`
(or, vocab-parallel, from its shards); the losses read them (`divergences.py` explains each format's
KD). `full` is for small vocabularies and checking.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from lingua.distillation.loss.divergences import LOG_TINY
from lingua.errors import ConfigError

FORMATS = ("topk", "sampled", "full")

def check_format(format: str) -> None:
    assert format in FORMATS, f"teacher output format {format!r}; DistillationArgs.validate() names the choices"


@dataclass
class TeacherOutputs:
    """What the teacher sends for one micro-batch; see the module docstring for each tensor."""

    format: str
    values: torch.Tensor
    ids: Optional[torch.Tensor] = None
    extra: Optional[torch.Tensor] = None
    # [B, S] float32 in [0, 1], cross-tokenizer only: each position's KD weight (0 = no aligned target)
    kd_weight: Optional[torch.Tensor] = None

    def tensors(self) -> list[torch.Tensor]:
        """The wire tensors, in the order of `wire_spec`."""
        if self.format == "full":
            return [self.values]
        return [self.values, self.ids, self.extra] + ([] if self.kd_weight is None else [self.kd_weight])

    def nan_flag(self) -> torch.Tensor:
        """1 when any value is NaN (a broken teacher: NaN or inf weights, an overflow), as a device int64 scalar: no
        host sync; it travels in the reply's status. (A tail or a log-prob may be -inf legitimately, never NaN.)"""
        return torch.stack([t.isnan().any() for t in self.tensors() if t is not None and t.is_floating_point()]
                           ).any().to(torch.int64)

    @staticmethod
    def wire_spec(format: str, B: int, S: int, k: int, V: int, wire_dtype: torch.dtype = torch.bfloat16,
                  kd_weight: bool = False) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each wire tensor for a [B, S] micro-batch, so a receiver can preallocate."""
        check_format(format)
        if format == "full":
            return [((B, S, V), wire_dtype)]
        weight = [((B, S), torch.float32)] if kd_weight else []
        return [((B, S, k), wire_dtype), ((B, S, k), torch.int32), ((B, S), torch.float32)] + weight

    @classmethod
    def from_tensors(cls, format: str, tensors: list[torch.Tensor]) -> "TeacherOutputs":
        """Inverse of `tensors()`."""
        check_format(format)
        expected = (1,) if format == "full" else (3, 4)
        assert len(tensors) in expected, f"{format} outputs have {expected} wire tensors, got {len(tensors)}"
        if format == "full":
            return cls(format, tensors[0])
        return cls(format, *tensors)

    def to(self, device, non_blocking: bool = False) -> "TeacherOutputs":
        """A copy with every tensor on `device`."""
        return TeacherOutputs.from_tensors(self.format, [t.to(device, non_blocking=non_blocking) for t in self.tensors()])

    @staticmethod
    def bytes_per_token(format: str, k: int, V: int, wire_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes on the wire per token position (teacher -> student)."""
        check_format(format)
        width = torch.tensor([], dtype=wire_dtype).element_size()
        if format == "full":
            return V * width
        return k * (width + 4) + 4


@torch.no_grad()
def sparsify_teacher_logits(
    logits: torch.Tensor,
    format: str,
    k: int,
    temperature: float,
    wire_dtype: torch.dtype = torch.bfloat16,
    generator: Optional[torch.Generator] = None,
) -> TeacherOutputs:
    """Teacher logits [N, S, V] -> TeacherOutputs at `temperature` (fp32 math, then cast to wire_dtype).

    topk: the k largest log-probs with their ids and the exact tail mass; sampled: k ids drawn
    with replacement from p_T (uses `generator`), their log-probs and the teacher's negative
    entropy; full: all log-probs.
    """
    check_format(format)
    assert temperature > 0 and (format == "full" or k >= 1), (temperature, k)  # DistillationArgs.validate()
    V = logits.shape[-1]
    if format == "topk" and k > V:
        raise ConfigError(f"Top-k distillation with k={k} exceeds the vocabulary size {V}; lower distillation.k.")
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if format == "full":
        return TeacherOutputs("full", log_probs.to(wire_dtype))
    if format == "topk":
        values, ids = log_probs.topk(k, dim=-1)
        # The tail from the log-sum-exp of what is left is accurate even when it is tiny (1 - sum would cancel).
        log_probs.scatter_(-1, ids, float("-inf"))
        tail = torch.logsumexp(log_probs, dim=-1).exp()
        return TeacherOutputs("topk", values.to(wire_dtype), ids.to(torch.int32), tail.float())
    probs = log_probs.exp()
    ids = torch.multinomial(probs.view(-1, V), k, replacement=True, generator=generator).view(*logits.shape[:-1], k)
    values = log_probs.gather(-1, ids)
    neg_entropy = (probs * log_probs.clamp_min_(LOG_TINY)).sum(-1)
    return TeacherOutputs("sampled", values.to(wire_dtype), ids.to(torch.int32), neg_entropy.float())
