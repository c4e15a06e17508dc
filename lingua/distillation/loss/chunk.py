"""One chunk of the fused loss: from the chunk's logits z [rows, V] to its loss rows and dLoss/dz, KD folded into
CE's own five passes over [rows, V] (max, subtract, exp, sum, multiply; then a 1-wide scatter_add at the label).

    topk     gather z at the k ids, scatter -inf there; CE's max pass then gives the rest's max m_r and the global
             max is max(m_r, max z_ids). g = exp(z - m_r) is CE's exp pass (0 on the ids), Z_r = sum g its sum pass,
             and lse = log(exp(m_r - max) Z_r + sum_ids exp(z_i - max)) + max has no cancellation, so log q_rest =
             m_r + log Z_r - lse stays exact when the rest lies far below the ids. With a = z / T, s = softmax(a)
             and G_b = dKD/d(log q_b) (`divergences.divergence`): on an id dKD/da_i = G_i - q_i sum(G); elsewhere
             dKD/da_v = exp(a_v - lse_rest) (G_rest - q_rest sum(G)), one coefficient per row riding on CE's
             multiply pass. The ids get their CE + KD gradient by a k-wide scatter.
    sampled  dKD/da = s - counts / k: CE's softmax with a larger coefficient plus a k-wide scatter_add; a
             cross-tokenizer draw of an unmapped id (-1) adds nothing: (mapped / k) s - counts / k.
    T != 1   KD needs exp((z - m_r) / T) besides CE's exp(z - m_r): three more passes and an addcmul.
    full     its own log-softmax over the vocabulary (about eight more passes): dKD/da = G - q sum(G).

KD enters the logits' gradient as T^2 dKD/dz = T dKD/da. Masked rows come in with z = 0 and in-range ids; every
per-row coefficient goes through `where`. tests/unit/lingua/distillation/loss/test_fused_passes.py counts the passes.
"""

from typing import NamedTuple, Optional

import torch

from lingua.distillation.loss.divergences import (divergence, sampled_forward_kl, teacher_full_log_probs,
                                                  teacher_topk_log_probs)


def head_logits(h, weight, dtype, fp32_mm: bool, weight_up=None):
    """h @ weight.T in `dtype` (fp32 for a bf16/fp16 head), never rounded to the head's dtype first: the GEMM's fp32
    accumulator written out (`torch.mm(..., out_dtype)`) where the device has it (fp32_mm: CUDA), else the operands
    upcast (exact: a product of two bf16 or fp16 values fits fp32); weight_up: the head already upcast."""
    if weight.dtype == dtype:
        return h @ weight.T
    if fp32_mm:
        return torch.mm(h, weight.T, out_dtype=dtype)
    return h.to(dtype) @ (weight.to(dtype) if weight_up is None else weight_up).T


def _student_top1(z_ids, ids, rest_max, rest_argmax, z_max, vocab_size):
    """The row's argmax (the smallest id among ties, as z.max(-1) gives it) from the ids' and the rest's maxima."""
    id_top1 = torch.where(z_ids == z_max, ids, vocab_size).amin(-1)
    rest_top1 = torch.where(rest_max.squeeze(-1) == z_max.squeeze(-1), rest_argmax, vocab_size)
    return torch.minimum(id_top1, rest_top1)


def chunk_loss_and_grad(z, labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind, jsd_beta,
                        z_coef=None, uld=None):
    """(CE per row, KD per row or None, student argmax per row, g = dLoss/dz, `GradRecipe` or None, logsumexp(z)
    per row) of one chunk; overwrites z [rows, V] (work dtype). teacher: None or (format, values, extra); ids
    [rows, k] in range, distinct per row (sampled: repeats, -1 unmapped); kd_rows [rows]: rows whose KD counts;
    ce_scale 0-dim, kd_scale [rows]; z_coef: None or 2 * z_loss / normalizer (0-dim), the z-loss's gradient
    z_coef * lse * softmax(z) riding on CE's; uld: None or a `uld.ChunkULD` (top-k only), whose topk over the rest
    replaces the max pass."""
    V = z.shape[-1]
    format = None if teacher is None else teacher[0]
    mapped = None
    if format == "sampled":  # a cross-tokenizer draw of an unmapped teacher id (-1) has no student term
        mapped, ids = ids >= 0, ids.clamp_min(0)
    z_label = z.gather(-1, labels)
    z_ids = None if ids is None else z.gather(-1, ids)
    # The top-k ids leave the row (-inf) so that the one max / exp / sum pass sees the rest bucket alone.
    excluded = format == "topk" and ids.shape[-1] < V
    if excluded:
        z.scatter_(-1, ids, float("-inf"))
    with_uld = uld is not None and excluded
    shift, argmax = uld.rest_top(z) if with_uld else z.max(-1, keepdim=True)
    if excluded:
        z_max = torch.maximum(shift, z_ids.amax(-1, keepdim=True))
        student_top1 = _student_top1(z_ids, ids, shift, argmax.squeeze(-1), z_max, V)
    else:
        z_max, student_top1 = shift, argmax.squeeze(-1)
    full_a = None
    if format == "full":  # z becomes a = z / T for the full format's own log-softmax; g gets its own buffer
        g = z.sub(shift)
        full_a = z.div_(temperature) if temperature != 1.0 else z
    else:
        g = z.sub_(shift)
    soft = soft_sum = None
    if format in ("topk", "sampled") and temperature != 1.0:  # KD's rest at T != 1, in a buffer of its own
        soft = g.div(temperature).exp_()
        soft_sum = soft.sum(-1, keepdim=True)
    g = g.exp_()  # exp(z - shift), 0 on excluded ids
    rest_sum = g.sum(-1, keepdim=True)
    if excluded:
        ids_exp = (z_ids - z_max).exp()
        lse = z_max + torch.log(torch.exp(shift - z_max) * rest_sum + ids_exp.sum(-1, keepdim=True))
    else:
        lse = shift + rest_sum.log()
    # What multiplies softmax(z): CE's scale, plus d/dz of z_loss * lse^2 = 2 z_loss lse softmax(z) (PaLM's z-loss).
    softmax_scale = ce_scale if z_coef is None else ce_scale + z_coef * lse
    # softmax(z)_v = g_v * exp(shift - lse)
    ce_coef = torch.exp(shift - lse) * softmax_scale if excluded else softmax_scale / rest_sum
    ce = (lse - z_label).squeeze(-1)
    ce_coef = torch.where(row_mask.unsqueeze(-1), ce_coef, 0.0)
    label_grad = torch.where(row_mask, -ce_scale, 0.0).unsqueeze(-1)
    if format is None:
        g.mul_(ce_coef).scatter_add_(-1, labels, label_grad)
        return ce, None, student_top1, g, GradRecipe(shift, ce_coef, None, labels, label_grad, None, None, False), \
            lse.squeeze(-1)
    if soft is None:  # T = 1: KD's softmax at a = z is CE's
        soft, soft_sum, a_shift, a_lse, a_ids = g, rest_sum, shift, lse, z_ids
    else:
        a_shift, a_ids = shift / temperature, None if z_ids is None else z_ids / temperature
        a_lse = a_shift + soft_sum.log()
        if excluded:
            a_max = z_max / temperature
            ids_sum = (a_ids - a_max).exp().sum(-1, keepdim=True)
            a_lse = a_max + torch.log(torch.exp(a_shift - a_max) * soft_sum + ids_sum)
    kd_scale = kd_scale.unsqueeze(-1)
    if format == "sampled":
        kd = sampled_forward_kl(teacher[2], (a_ids - a_lse), mapped)
        # s_T times the mapped share of the draws everywhere (1 on one tokenizer); the samples' -counts / k by
        # scatter_add (an id drawn twice counts twice).
        share = mapped.sum(-1, keepdim=True).to(soft_sum.dtype) / ids.shape[-1]
        rest_coef = torch.where(kd_rows.unsqueeze(-1), kd_scale * share / soft_sum, 0.0)
        id_grad = torch.where(kd_rows.unsqueeze(-1) & mapped, -kd_scale / ids.shape[-1], 0.0)
        coef, soft_coef = _combine(g, ce_coef, soft, rest_coef)
        g.scatter_add_(-1, ids, id_grad).scatter_add_(-1, labels, label_grad)
        return ce, kd, student_top1, g, GradRecipe(shift, coef, soft_coef, labels, label_grad, ids, id_grad, False), \
            lse.squeeze(-1)
    if format == "full":
        g.mul_(ce_coef).scatter_add_(-1, labels, label_grad)
        kd = _full_kd(full_a, g, teacher[1], kd_rows, kind, jsd_beta, kd_scale)
        return ce, kd, student_top1, g, None, lse.squeeze(-1)
    log_q = a_ids - a_lse
    if excluded:
        log_q = torch.cat([log_q, a_shift + soft_sum.log() - a_lse], dim=-1)
    log_p = teacher_topk_log_probs(teacher[1], teacher[2], z.dtype, with_rest=excluded)
    kd, G, q = divergence(log_p, log_q, kind, jsd_beta, with_grad=True)
    bucket_grad = torch.where(kd_rows.unsqueeze(-1), (G - q * G.sum(-1, keepdim=True)) * kd_scale, 0.0)
    k = ids.shape[-1]
    # On the ids: CE's softmax plus KD's bucket gradient, written over whatever g holds there.
    id_grad = torch.where(row_mask.unsqueeze(-1), (z_ids - lse).exp() * softmax_scale, 0.0) + bucket_grad[:, :k]
    rest_coef = bucket_grad[:, k:] / soft_sum if excluded else None
    added_ids, added_grad = labels, label_grad  # added after the ids' values are written
    if with_uld:
        uld_kd, uld_id_grad, uld_rest_coef, uld_top_grad = uld.value_and_grads(
            temperature, a_lse, q[:, :k], a_shift, kd_rows, kd_scale)
        kd, id_grad, rest_coef = kd + uld_kd, id_grad + uld_id_grad, rest_coef + uld_rest_coef
        added_ids, added_grad = torch.cat([labels, uld.top_ids], -1), torch.cat([label_grad, uld_top_grad], -1)
    elif uld is not None:  # no rest (k = V): the student's side is all zeros, a constant
        kd = kd + uld.weight * uld.teacher_sorted.sum(-1)
    coef, soft_coef = _combine(g, ce_coef, soft, rest_coef)
    g.scatter_(-1, ids, id_grad).scatter_add_(-1, added_ids, added_grad)
    return ce, kd, student_top1, g, GradRecipe(shift, coef, soft_coef, added_ids, added_grad, ids, id_grad, True), \
        lse.squeeze(-1)


def _combine(g, ce_coef, soft, rest_coef):
    """g <- ce_coef * g + rest_coef * soft (one multiply pass when soft is g, at T = 1); returns the coefficients."""
    if rest_coef is None:
        g.mul_(ce_coef)
        return ce_coef, None
    if soft is g:
        coef = ce_coef + rest_coef
        g.mul_(coef)
        return coef, None
    g.mul_(ce_coef).addcmul_(soft, rest_coef)
    return ce_coef, rest_coef


class GradRecipe(NamedTuple):
    """dLoss/dz of a chunk's rows without z: coef * exp(z - shift) [+ soft_coef * exp((z - shift) / T)], then the
    ids' values written (ids_set) or added at ids, then label_grad added at labels (with ULD, also at the rest's
    top-K ids). All [rows, 1], [rows, k] or [rows, 1 + K]."""
    shift: torch.Tensor
    coef: torch.Tensor
    soft_coef: Optional[torch.Tensor]
    labels: torch.Tensor
    label_grad: torch.Tensor
    ids: Optional[torch.Tensor]
    id_grad: Optional[torch.Tensor]
    ids_set: bool

    @staticmethod
    def cat(recipes: list) -> "GradRecipe":
        fields = [[getattr(r, name) for r in recipes] for name in GradRecipe._fields[:-1]]
        return GradRecipe(*(None if parts[0] is None else torch.cat(parts) for parts in fields), recipes[0].ids_set)


def vocab_block_weight_grad(hidden, weight, recipe: GradRecipe, temperature: float, block: int, work_dtype,
                            fp32_mm: bool = False):
    """grad_W = dz^T hidden one block of `block` vocabulary ids at a time: the block's logits recomputed for all rows
    (hidden's masked rows zeroed) in fp32 as the chunks formed them (`head_logits`), dz rebuilt from the recipe, one
    GEMM writes the block; no fp32 [V, D]."""
    V, N = weight.shape[0], hidden.shape[0]
    grad_weight = torch.empty_like(weight)
    buffer = torch.empty(N, block + 1, dtype=work_dtype, device=hidden.device)  # a spare column for others' ids
    hidden_up = None if weight.dtype == work_dtype or fp32_mm else hidden.to(work_dtype)  # once, not per block
    for start in range(0, V, block):
        width = min(block, V - start)
        dz = buffer[:, :width + 1]
        logits = dz[:, :width]
        if weight.dtype == work_dtype:
            torch.mm(hidden, weight[start:start + width].T, out=logits)
        elif fp32_mm:
            logits.copy_(head_logits(hidden, weight[start:start + width], work_dtype, True))
        else:
            torch.mm(hidden_up, weight[start:start + width].to(work_dtype).T, out=logits)
        logits.sub_(recipe.shift)
        soft = logits.div(temperature).exp_() if recipe.soft_coef is not None else None
        logits.exp_().mul_(recipe.coef)
        if soft is not None:
            logits.addcmul_(soft, recipe.soft_coef)
        if recipe.ids is not None:
            local = _local_ids(recipe.ids, start, width)
            (dz.scatter_ if recipe.ids_set else dz.scatter_add_)(-1, local, recipe.id_grad)
        dz.scatter_add_(-1, _local_ids(recipe.labels, start, width), recipe.label_grad)
        torch.mm(logits.to(weight.dtype).T, hidden, out=grad_weight[start:start + width])
    return grad_weight


def _local_ids(ids, start, width):
    """ids relative to the block [start, start + width); ids outside it go to the spare column `width`."""
    local = ids - start
    return torch.where((local >= 0) & (local < width), local, width)


def _full_kd(a, g, values, mask, kind, jsd_beta, kd_scale):
    """Exact divergence over the vocabulary; adds kd_scale * dKD/da into g. Overwrites a."""
    log_q = a.sub_(a.logsumexp(-1, keepdim=True))
    kd, G, q = divergence(teacher_full_log_probs(values, a.dtype), log_q, kind, jsd_beta, with_grad=True)
    G.sub_(q.mul_(G.sum(-1, keepdim=True)))
    g.add_(torch.where(mask.unsqueeze(-1), G.mul_(kd_scale), 0.0))
    return kd
