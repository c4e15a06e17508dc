"""The math of distillation: what the teacher sends (sparse outputs) and the student's KD loss.

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

(w = bytes of the wire dtype, 2 for bf16). The student-side loss is

    topk     exact divergence between k+1 buckets (the ids, plus "rest" = everything else). The
             teacher buckets are renormalised in fp32 so bf16 rounding cannot make them sum != 1.
    sampled  RS-KD style Monte-Carlo estimate of the forward KL: with x_1..x_k ~ p_T,
             KL(p_T || s_T) ~= extra - (1/k) sum_j log s_T(x_j). Its expectation is the exact KL
             and its gradient wrt the student logits, (s_T - counts/k) / T, has expectation
             (s_T - p_T) / T, the exact gradient. Because the proposal is p_T itself the importance
             weights p/q are exactly 1, so neither the estimate nor its gradient depends on the
             wire dtype of `values` (those only feed the teacher_mass / top-1 statistics). A
             sharper proposal q ~ p_T^beta is deliberately not offered: unbiased weights p/q need
             both beta and the normaliser sum p_T^beta on the student, and the self-normalised
             weights that avoid that are biased at finite k. Reverse KL and JSD have no unbiased
             estimator from samples of p_T, so they are rejected for this format.
    full     exact divergence over the vocabulary.

Memory: `kd_loss` walks the flattened positions in chunks. With gradients enabled it runs a
custom autograd function that, for each chunk, builds the fp32 graph, takes its gradient at once
and writes it into one buffer shaped and typed like the student logits, then frees the chunk's
graph. So at most one chunk of fp32 [chunk_size, V] activations lives at a time, nothing is
recomputed in backward, and the only full-size extra tensor is that gradient buffer (which a plain
autograd backward would allocate anyway; here it exists from the forward until the backward).
Double backward through `kd_loss` is not supported.
"""

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FORMATS = ("topk", "sampled", "full")
DIVERGENCES = ("fkl", "rkl", "jsd")
ALPHA_SCHEDULES = ("constant", "lr")
# Teacher log-probs are floored here so a zero-probability bucket gives a large finite reverse KL, not inf/nan.
LOG_TINY = math.log(torch.finfo(torch.float32).tiny)


def _check_format(format: str) -> None:
    assert format in FORMATS, f"teacher output format {format!r}; DistillationArgs.validate() names the choices"


@dataclass
class TeacherOutputs:
    """What the teacher sends for one micro-batch; see the module docstring for each tensor."""

    format: str
    values: torch.Tensor
    ids: Optional[torch.Tensor] = None
    extra: Optional[torch.Tensor] = None

    def tensors(self) -> list[torch.Tensor]:
        """The wire tensors, in the order of `wire_spec`."""
        if self.format == "full":
            return [self.values]
        return [self.values, self.ids, self.extra]

    @staticmethod
    def wire_spec(format: str, B: int, S: int, k: int, V: int, wire_dtype: torch.dtype = torch.bfloat16) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each wire tensor for a [B, S] micro-batch, so a receiver can preallocate."""
        _check_format(format)
        if format == "full":
            return [((B, S, V), wire_dtype)]
        return [((B, S, k), wire_dtype), ((B, S, k), torch.int32), ((B, S), torch.float32)]

    @classmethod
    def from_tensors(cls, format: str, tensors: list[torch.Tensor]) -> "TeacherOutputs":
        """Inverse of `tensors()`."""
        _check_format(format)
        expected = 1 if format == "full" else 3
        assert len(tensors) == expected, f"{format} outputs have {expected} wire tensors, got {len(tensors)}"
        if format == "full":
            return cls(format, tensors[0])
        return cls(format, tensors[0], tensors[1], tensors[2])

    def to(self, device, non_blocking: bool = False) -> "TeacherOutputs":
        """A copy with every tensor on `device`."""
        return TeacherOutputs.from_tensors(self.format, [t.to(device, non_blocking=non_blocking) for t in self.tensors()])

    @staticmethod
    def bytes_per_token(format: str, k: int, V: int, wire_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes on the wire per token position (teacher -> student)."""
        _check_format(format)
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
    _check_format(format)
    assert temperature > 0 and (format == "full" or k >= 1), (temperature, k)  # DistillationArgs.validate()
    V = logits.shape[-1]
    if format == "topk" and k > V:
        raise ValueError(f"Top-k distillation with k={k} exceeds the vocabulary size {V}; lower distillation.k.")
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


def _divergence(log_p: torch.Tensor, log_q: torch.Tensor, divergence: str, jsd_beta: float) -> torch.Tensor:
    """D(p || q) over the last dim, from log-probs (p = teacher, q = student)."""
    if divergence == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if divergence == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    # Generalised JSD: beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q.
    log_m = torch.logaddexp(log_p + math.log(jsd_beta), log_q + math.log1p(-jsd_beta))
    return jsd_beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - jsd_beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


def _chunk_divergence(logits, values, ids, extra, format, temperature, divergence, jsd_beta, dtype) -> torch.Tensor:
    """Per-position divergence [C] for one chunk of flattened positions (logits [C, V])."""
    z = logits.to(dtype) / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    if format == "full":
        log_t = values.to(dtype)
        log_t = (log_t - torch.logsumexp(log_t, dim=-1, keepdim=True)).clamp_min(LOG_TINY)
        return _divergence(log_t, z - lse, divergence, jsd_beta)
    ids = ids.long()
    log_s = z.gather(-1, ids) - lse
    if format == "sampled":
        return extra.to(dtype) - log_s.mean(-1)
    log_t = values.to(dtype)
    tail = extra.to(dtype).clamp(0.0, 1.0)
    if ids.shape[-1] < z.shape[-1]:
        # Student rest bucket as a log-sum-exp over the other ids: exact even when the rest is tiny.
        log_s_rest = torch.logsumexp(z.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True) - lse
        log_s = torch.cat([log_s, log_s_rest], dim=-1)
        log_t = torch.cat([log_t, tail.clamp_min(torch.finfo(torch.float32).tiny).log().unsqueeze(-1)], dim=-1)
    # Renormalise the teacher buckets in fp32: bf16 values make them sum to 1 only approximately.
    log_total = torch.log(log_t[..., : ids.shape[-1]].exp().sum(-1, keepdim=True) + tail.unsqueeze(-1))
    return _divergence((log_t - log_total).clamp_min(LOG_TINY), log_s, divergence, jsd_beta)


def _chunk_stats(logits, values, ids, extra, format) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position (teacher mass covered by the support, student argmax == teacher top-1)."""
    student_top1 = logits.argmax(-1)
    if format == "full":
        return torch.ones_like(student_top1, dtype=torch.float32), (student_top1 == values.argmax(-1)).float()
    best = values.argmax(-1, keepdim=True)
    teacher_top1 = ids.long().gather(-1, best).squeeze(-1)
    agree = (student_top1 == teacher_top1).float()
    if format == "topk":
        return 1.0 - extra.float().clamp(0.0, 1.0), agree
    # Sampled ids repeat: count each distinct id's mass once. Teacher top-1 = most likely sampled id.
    sorted_ids, order = ids.sort(-1)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[..., 1:] = sorted_ids[..., 1:] != sorted_ids[..., :-1]
    mass = (values.float().gather(-1, order).exp() * first).sum(-1)
    return mass, agree


def _run_chunks(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size, want_grad):
    """(loss, stats [3] = kd, teacher_mass, top1_agreement, grad buffer or None)."""
    V = student_logits.shape[-1]
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    flat_logits = student_logits.reshape(-1, V)
    flat_mask = mask.reshape(-1)
    flat_teacher = [t.reshape(flat_mask.shape[0], *t.shape[2:]) for t in teacher.tensors()]
    if teacher.format == "full":
        flat_teacher += [None, None]
    count = flat_mask.sum().clamp_min(1).to(dtype)
    totals = torch.zeros(3, dtype=dtype, device=student_logits.device)
    grad = torch.empty_like(flat_logits) if want_grad else None
    for start in range(0, flat_logits.shape[0], chunk_size):
        end = min(start + chunk_size, flat_logits.shape[0])
        chunk_mask = flat_mask[start:end]
        values, ids, extra = (None if t is None else t[start:end] for t in flat_teacher)
        logits = flat_logits[start:end].detach()
        with torch.enable_grad():
            logits.requires_grad_(want_grad)
            per_position = _chunk_divergence(logits, values, ids, extra, teacher.format, temperature, divergence, jsd_beta, dtype)
            # where, not multiply: a masked position's value must not leak in, even if it is inf/nan.
            chunk_loss = torch.where(chunk_mask, per_position, 0.0).sum() / count
            if want_grad:
                (chunk_grad,) = torch.autograd.grad(chunk_loss, logits)
                # Explicit zero: 0 * inf inside the graph would still turn a masked inf/nan logit into a nan gradient.
                grad[start:end] = chunk_grad.masked_fill_(~chunk_mask.unsqueeze(-1), 0.0)
        with torch.no_grad():
            mass, agree = (t.to(dtype) for t in _chunk_stats(logits.detach(), values, ids, extra, teacher.format))
            totals += torch.stack([
                chunk_loss.detach(),
                torch.where(chunk_mask, mass, 0.0).sum() / count,
                torch.where(chunk_mask, agree, 0.0).sum() / count,
            ]).to(dtype)
    return totals[0].clone(), totals, grad


class _ChunkedKDLoss(torch.autograd.Function):
    """Computes the loss and its gradient chunk by chunk in forward; backward only scales the gradient."""

    @staticmethod
    def forward(ctx, student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size):
        loss, stats, grad = _run_chunks(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size, True)
        ctx.grad = grad.view(student_logits.shape)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        if ctx.grad is None:
            raise RuntimeError("kd_loss supports a single backward pass; do not backward through it twice (retain_graph).")
        # In place: the buffer is ours and is needed once, so scaling it adds no full-size tensor.
        grad, ctx.grad = ctx.grad.mul_(grad_loss.to(ctx.grad.dtype)), None
        return grad, None, None, None, None, None, None


def kd_loss(
    student_logits: torch.Tensor,
    teacher: TeacherOutputs,
    mask: torch.Tensor,
    temperature: float,
    divergence: str = "fkl",
    jsd_beta: float = 0.5,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over masked positions of D(teacher || student) on the teacher's support (see module doc).

    student_logits [B, S, V] (any float dtype; math in fp32), mask [B, S] bool (pass
    `labels != -100` so KD counts the same positions as CE), temperature as used on the teacher.
    Returns (loss scalar with grad, stats) where stats are floats: "kd" (the divergence),
    "teacher_mass" (teacher probability covered by the support), "top1_agreement" (fraction of
    masked positions where the student's argmax is the teacher's top-1 id; for "sampled" the
    teacher's top-1 is the most likely sampled id).
    """
    # The settings come from a validated DistillationArgs (which explains each rule); a bad one here is our bug.
    _check_format(teacher.format)
    assert divergence in DIVERGENCES, divergence
    assert teacher.format != "sampled" or divergence == "fkl", "sampled outputs only estimate the forward KL"
    assert divergence != "jsd" or 0.0 < jsd_beta < 1.0, jsd_beta
    assert temperature > 0 and chunk_size >= 1, (temperature, chunk_size)
    B, S, V = student_logits.shape
    if tuple(teacher.values.shape[:2]) != (B, S) or tuple(mask.shape) != (B, S):
        raise ValueError(f"Teacher outputs {tuple(teacher.values.shape)} and mask {tuple(mask.shape)} must match the student's [B, S] = [{B}, {S}].")
    if teacher.format == "full" and teacher.values.shape[-1] != V:
        raise ValueError(f"Teacher vocabulary {teacher.values.shape[-1]} differs from the student's {V}; both must use the same tokenizer.")
    loss, stats = kd_loss_and_stats(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size)
    kd, teacher_mass, top1 = stats.tolist()  # a host sync: the trainer uses kd_loss_and_stats
    return loss, {"kd": kd, "teacher_mass": teacher_mass, "top1_agreement": top1}


def kd_loss_and_stats(student_logits: torch.Tensor, teacher: TeacherOutputs, mask: torch.Tensor, temperature: float,
                      divergence: str = "fkl", jsd_beta: float = 0.5,
                      chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """`kd_loss` with its stats as a detached device tensor [kd, teacher_mass, top1_agreement]: no host sync."""
    mask = mask.bool()
    if torch.is_grad_enabled() and student_logits.requires_grad:
        return _ChunkedKDLoss.apply(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size)
    loss, stats, _ = _run_chunks(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size, False)
    return loss, stats


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE summed (not averaged) over positions whose label is not -100, in fp32, so micro-batches add up
    exactly to one large batch; the caller divides by the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def distillation_loss(ce: torch.Tensor, kd: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """(1 - alpha) * CE + alpha * T^2 * KD (tensors or floats); T^2 keeps the KD gradient scale independent of T."""
    return (1.0 - alpha) * ce + alpha * temperature**2 * kd


def alpha_at(step: int, alpha: float, schedule: str, lr_factor: float) -> float:
    """KD weight at `step`: constant, or "lr" = alpha times the lr schedule's current factor."""
    assert schedule in ALPHA_SCHEDULES, schedule  # DistillationArgs.validate() names the choices
    return alpha * lr_factor if schedule == "lr" else alpha
