"""The objective's math, one home for the fused loss and the reference (a new divergence is one edit here: a value
and its gradient G = dD/d(log q), checked against autograd by tests/unit/lingua/distillation/loss/test_divergences.py).

    p = teacher, q = student, over buckets b (the vocabulary, or the top-k ids plus "rest")
    fkl   D = sum p (log p - log q)                 G = -p
    rkl   D = sum q (log q - log p)                 G = q (log q - log p + 1)
    jsd   D = beta sum p (log p - log m) + (1 - beta) sum q (log q - log m),  m = beta p + (1 - beta) q
                                                    G = (1 - beta) q (log q - log m)
"""

import math
from typing import Optional

import torch

DIVERGENCES = ("fkl", "rkl", "jsd")
TINY = torch.finfo(torch.float32).tiny
# Teacher log-probs are floored here so a zero-probability bucket gives a large finite reverse KL, not inf/nan.
LOG_TINY = math.log(TINY)


def divergence(log_p: torch.Tensor, log_q: torch.Tensor, kind: str, jsd_beta: float = 0.5,
               with_grad: bool = False):
    """D(p || q) over the last dim from log-probs; with `with_grad` returns (D, G = dD/d(log q), q)."""
    q = log_q.exp()
    if kind == "fkl":
        p = log_p.exp()
        value, grad = (p * (log_p - log_q)).sum(-1), -p if with_grad else None
    elif kind == "rkl":
        ratio = log_q - log_p
        value, grad = (q * ratio).sum(-1), q * (ratio + 1.0) if with_grad else None
    else:
        # Generalised JSD; d/dq of the two log m terms cancel to -(1 - beta), leaving G above.
        log_m = torch.logaddexp(log_p + math.log(jsd_beta), log_q + math.log1p(-jsd_beta))
        q_term = q * (log_q - log_m)
        value = jsd_beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - jsd_beta) * q_term.sum(-1)
        grad = (1 - jsd_beta) * q_term if with_grad else None
    return (value, grad, q) if with_grad else value


def teacher_topk_log_probs(values: torch.Tensor, tail: torch.Tensor, dtype: torch.dtype,
                           with_rest: bool) -> torch.Tensor:
    """[..., k(+1)] log-probs of the teacher's top-k buckets (+ "rest"), renormalised in `dtype` (bf16 values sum
    to 1 only roughly) and floored at LOG_TINY."""
    log_t = values.to(dtype)
    tail = tail.to(dtype).clamp(0.0, 1.0)
    log_total = torch.log(log_t.exp().sum(-1) + tail).unsqueeze(-1)
    if with_rest:
        log_t = torch.cat([log_t, tail.clamp_min(TINY).log().unsqueeze(-1)], dim=-1)
    return (log_t - log_total).clamp_min(LOG_TINY)


def teacher_full_log_probs(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The teacher's log-probs over the vocabulary, renormalised in `dtype` and floored at LOG_TINY."""
    log_t = values.to(dtype)
    return (log_t - log_t.logsumexp(-1, keepdim=True)).clamp_min_(LOG_TINY)


def sampled_forward_kl(neg_entropy: torch.Tensor, student_log_probs_of_samples: torch.Tensor,
                       mapped: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Monte-Carlo forward KL from k samples x_j ~ p_T: sum p log p - (1/k) sum_j log q(x_j) (unbiased).
    `mapped` [..., k] (cross-tokenizer): draws with a student id; with neg_entropy = sum_s p(s) log(p(s) / M) over
    the student ids (M their mass) the estimate is unbiased for M * KL(p / M || q)."""
    log_q = student_log_probs_of_samples
    # mean either way: on one tokenizer (every draw mapped) the same arithmetic, to the last bit on every device
    log_q = log_q if mapped is None else torch.where(mapped, log_q, 0.0)
    return neg_entropy.to(log_q.dtype) - log_q.mean(-1)


def teacher_support(values: torch.Tensor, ids: Optional[torch.Tensor], extra: Optional[torch.Tensor],
                    format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (teacher probability covered by the support, the teacher's top-1 id). For `sampled` the
    top-1 is the most likely sampled id and a repeated id's mass counts once."""
    if format == "full":
        return torch.ones(values.shape[:-1], dtype=torch.float32, device=values.device), values.argmax(-1)
    top1 = ids.long().gather(-1, values.argmax(-1, keepdim=True)).squeeze(-1)
    if format == "topk":
        return 1.0 - extra.float().clamp(0.0, 1.0), top1
    sorted_ids, order = ids.sort(-1)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[..., 1:] = sorted_ids[..., 1:] != sorted_ids[..., :-1]
    return (values.float().gather(-1, order).exp() * first).sum(-1), top1


def kd_rows_and_weights(mask: torch.Tensor, kd_weight: Optional[torch.Tensor], dtype: torch.dtype):
    """(KD rows: masked-in positions with a positive weight, their weights in `dtype`, 0 elsewhere)."""
    weight = torch.ones_like(mask, dtype=dtype) if kd_weight is None else kd_weight.to(dtype)
    kd_rows = mask & (weight > 0)
    return kd_rows, torch.where(kd_rows, weight, 0.0)


def distillation_loss(ce, kd, alpha: float, temperature: float):
    """(1 - alpha) * CE + alpha * T^2 * KD (tensors or floats); T^2 keeps the KD gradient scale independent of T."""
    return (1.0 - alpha) * ce + alpha * temperature**2 * kd
