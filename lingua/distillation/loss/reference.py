"""The reference KD loss on student logits: `kd_loss`, the float64 check of `fused.fused_linear_kd_loss` and what
`distillation.fused_loss=false` trains with. Both compute through `divergences.py`. Per format:

    topk     exact divergence between k+1 buckets (the ids, plus "rest"), the teacher's renormalised in fp32.
    sampled  RS-KD's Monte-Carlo forward KL: with x_1..x_k ~ p_T, KL(p_T || s_T) ~= extra - (1/k) sum_j log s_T(x_j),
             unbiased in value and gradient; the proposal is p_T itself, so the importance weights are exactly 1
             (a sharper p_T^beta would need its normaliser on the student). Reverse KL and JSD have no unbiased
             estimator from samples of p_T: refused. Unmapped cross-tokenizer draws (-1) add nothing.
    full     exact divergence over the vocabulary.
    uld      (cross-tokenizer top-k, uld_weight > 0) plus uld_weight times `uld.uld_reference`.

Each chunk's fp32 graph is built, differentiated at once into one buffer shaped like the logits and freed: one chunk
of fp32 [chunk_size, V] lives at a time and nothing is recomputed in backward (one backward pass only).
"""
from typing import Optional

import torch

from lingua.distillation.loss.divergences import (DIVERGENCES, divergence, kd_rows_and_weights, sampled_forward_kl,
                                                  teacher_full_log_probs, teacher_support, teacher_topk_log_probs)
from lingua.distillation.outputs import TeacherOutputs, check_format
from lingua.distillation.loss.uld import split_unmapped, uld_reference


def _chunk_divergence(logits, values, ids, extra, format, temperature, kind, jsd_beta, dtype,
                      uld=None) -> torch.Tensor:
    """Per-position divergence [C] for one chunk of flattened positions (logits [C, V]); uld: None or (uld_weight,
    the teacher's sorted unmapped probabilities [C, K]) for targets `split_unmapped` cleaned."""
    z = logits.to(dtype) / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    if format == "full":
        return divergence(teacher_full_log_probs(values, dtype), z - lse, kind, jsd_beta)
    ids = ids.long()
    if format == "sampled":  # a cross-tokenizer draw of an unmapped teacher id (-1) has no student term
        return sampled_forward_kl(extra, z.gather(-1, ids.clamp_min(0)) - lse, ids >= 0)
    log_s = z.gather(-1, ids) - lse
    with_rest = ids.shape[-1] < z.shape[-1]
    if with_rest:
        # Student rest bucket as a log-sum-exp over the other ids: exact even when the rest is tiny.
        log_s_rest = torch.logsumexp(z.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True) - lse
        log_s = torch.cat([log_s, log_s_rest], dim=-1)
    value = divergence(teacher_topk_log_probs(values, extra, dtype, with_rest), log_s, kind, jsd_beta)
    return value if uld is None else value + uld[0] * uld_reference(z, ids, uld[1])


def _run_chunks(student_logits, teacher, mask, temperature, divergence, jsd_beta, chunk_size, kd_weight, uld,
                want_grad):
    """(loss, stats [3] = kd, teacher_mass, top1_agreement, grad buffer or None); uld: None or (weight, k)."""
    V = student_logits.shape[-1]
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    flat_logits = student_logits.reshape(-1, V)
    flat_mask = mask.reshape(-1)
    # values, ids, extra (not tensors(): a cross-tokenizer teacher's kd_weight comes in as kd_weight)
    flat_teacher = [None if t is None else t.reshape(flat_mask.shape[0], *t.shape[2:])
                    for t in (teacher.values, teacher.ids, teacher.extra)]
    count = flat_mask.sum().clamp_min(1).to(dtype)
    flat_mask, flat_weight = kd_rows_and_weights(flat_mask, None if kd_weight is None else kd_weight.reshape(-1), dtype)
    totals = torch.zeros(3, dtype=dtype, device=student_logits.device)
    grad = torch.empty_like(flat_logits) if want_grad else None
    for start in range(0, flat_logits.shape[0], chunk_size):
        end = min(start + chunk_size, flat_logits.shape[0])
        chunk_mask, chunk_weight = flat_mask[start:end], flat_weight[start:end]
        values, ids, extra = (None if t is None else t[start:end] for t in flat_teacher)
        chunk_uld = None
        if uld is not None:  # unmapped entries: out of the top-k targets, into ULD's teacher side
            values, ids, teacher_sorted = split_unmapped(values, ids, extra, uld[1], dtype)
            chunk_uld = (uld[0], torch.where(chunk_mask.unsqueeze(-1), teacher_sorted, 0.0))
        if ids is not None:  # a position outside the KD rows may carry any id: keep gathers in range
            ids = ids.long().masked_fill(~chunk_mask.unsqueeze(-1), 0)
        logits = flat_logits[start:end].detach()
        with torch.enable_grad():
            logits.requires_grad_(want_grad)
            per_position = _chunk_divergence(logits, values, ids, extra, teacher.format, temperature, divergence,
                                             jsd_beta, dtype, chunk_uld)
            # where, not multiply: a masked position's value must not leak in, even if it is inf/nan.
            chunk_loss = torch.where(chunk_mask, per_position * chunk_weight, 0.0).sum() / count
            if want_grad:
                (chunk_grad,) = torch.autograd.grad(chunk_loss, logits)
                # Explicit zero: 0 * inf inside the graph would still turn a masked inf/nan logit into a nan gradient.
                grad[start:end] = chunk_grad.masked_fill_(~chunk_mask.unsqueeze(-1), 0.0)
        with torch.no_grad():
            mass, teacher_top1 = teacher_support(values, ids, extra, teacher.format)
            mass, agree = mass.to(dtype), (logits.detach().argmax(-1) == teacher_top1).float().to(dtype)
            totals += torch.stack([
                chunk_loss.detach(),
                torch.where(chunk_mask, mass * chunk_weight, 0.0).sum() / count,
                torch.where(chunk_mask, agree * chunk_weight, 0.0).sum() / count,
            ]).to(dtype)
    return totals[0].clone(), totals, grad


class _ChunkedKDLoss(torch.autograd.Function):
    """Computes the loss and its gradient chunk by chunk in forward; backward only scales the gradient."""

    @staticmethod
    def forward(ctx, student_logits, *args):
        loss, stats, grad = _run_chunks(student_logits, *args, want_grad=True)
        ctx.grad = grad.view(student_logits.shape)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _):
        if ctx.grad is None:
            raise RuntimeError("kd_loss supports a single backward pass; do not backward through it twice (retain_graph).")
        # In place: the buffer is ours and is needed once, so scaling it adds no full-size tensor.
        grad, ctx.grad = ctx.grad.mul_(grad_loss.to(ctx.grad.dtype)), None
        return grad, None, None, None, None, None, None, None, None


def kd_loss_and_stats(student_logits: torch.Tensor, teacher: TeacherOutputs, mask: torch.Tensor, temperature: float,
                      divergence: str = "fkl", jsd_beta: float = 0.5, chunk_size: int = 1024,
                      kd_weight: Optional[torch.Tensor] = None, uld_weight: float = 0.0,
                      uld_k: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over masked positions of D(teacher || student) on the teacher's support (see module doc), and its stats.

    student_logits [B, S, V] (any float dtype; math in fp32), mask [B, S] (pass `labels != -100` so KD counts the
    same positions as CE), temperature as used on the teacher. Returns (loss scalar with grad, stats): a detached
    device tensor [kd, teacher_mass (teacher probability covered by the support), top1_agreement (the student's
    argmax is the teacher's top-1 id; for "sampled" the most likely sampled id)]. kd_weight [B, S] (float in [0, 1],
    None = all ones) multiplies each position's divergence, mass and agreement; the mean still divides by the
    masked count, and a weight-0 position's teacher tensors may hold anything (inf/nan too). uld_weight > 0:
    cross-tokenizer top-k with marked unmapped entries (`uld.py`); uld_k sorted ranks compared.
    """
    # The settings come from a validated DistillationArgs (which explains each rule); a bad one here is our bug.
    check_format(teacher.format)
    assert divergence in DIVERGENCES, divergence
    assert teacher.format != "sampled" or divergence == "fkl", "sampled outputs only estimate the forward KL"
    assert divergence != "jsd" or 0.0 < jsd_beta < 1.0, jsd_beta
    assert temperature > 0 and chunk_size >= 1, (temperature, chunk_size)
    assert uld_weight == 0 or (teacher.format == "topk" and uld_k >= 1), (uld_weight, uld_k)
    B, S, V = student_logits.shape
    if tuple(teacher.values.shape[:2]) != (B, S) or tuple(mask.shape) != (B, S):
        raise ValueError(f"Teacher outputs {tuple(teacher.values.shape)} and mask {tuple(mask.shape)} must match the student's [B, S] = [{B}, {S}].")
    if kd_weight is not None and tuple(kd_weight.shape) != (B, S):
        raise ValueError(f"kd_weight {tuple(kd_weight.shape)} must match the student's [B, S] = [{B}, {S}].")
    if teacher.format == "full" and teacher.values.shape[-1] != V:
        raise ValueError(f"Teacher vocabulary {teacher.values.shape[-1]} differs from the student's {V}; both must use the same tokenizer.")
    args = (teacher, mask.bool(), temperature, divergence, jsd_beta, chunk_size, kd_weight,
            (uld_weight, uld_k) if uld_weight > 0 else None)
    if torch.is_grad_enabled() and student_logits.requires_grad:
        return _ChunkedKDLoss.apply(student_logits, *args)
    loss, stats, _ = _run_chunks(student_logits, *args, want_grad=False)
    return loss, stats


def kd_loss(*args, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """`kd_loss_and_stats` with its stats read to the host (a sync: the trainer uses the former) as a dict of floats:
    kd, teacher_mass, top1_agreement."""
    loss, stats = kd_loss_and_stats(*args, **kwargs)
    return loss, dict(zip(("kd", "teacher_mass", "top1_agreement"), stats.tolist()))
