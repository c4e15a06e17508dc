"""The loss's research path: the student's whole loss in plain autograd, one chunk of rows at a time. Edit it here.

    loss, stats = research_head_loss(hidden, head_weight, labels, teachers, normalizer, alpha, args)
    loss = ((1 - alpha) * sum CE + alpha * T^2 * sum_i sum w_i KD_i) / normalizer   over positions with label != -100

`chunk_loss` writes every term of one chunk's logits as an expression and autograd differentiates it. `fused.py`
computes the same numbers with closed-form gradients (the default; distillation.fused_loss=false picks this path)
and tests/unit/lingua/distillation/loss/test_research.py checks the two against each other in float64 for every
format and divergence, so a term promoted there with a wrong gradient fails (docs/research_loss.md). Memory stays
bounded: each chunk's graph is differentiated at once (`torch.autograd.grad`) into the grad buffers and freed, one
chunk of [rows, V] at a time; backward only scales those grads (one backward pass).
"""

from typing import NamedTuple, Optional, Union

import torch

from lingua.distillation.loss.divergences import (divergence, kd_rows_and_weights, sampled_forward_kl,
                                                  teacher_full_log_probs, teacher_support, teacher_topk_log_probs)
from lingua.distillation.loss.fused import auto_chunk_rows, flat_teacher
from lingua.distillation.loss.uld import split_unmapped, uld_reference

PER_TEACHER = ("kd", "teacher_mass", "top1_agreement")  # statistics with one value per teacher, each KD-weighted


class ChunkTeacher(NamedTuple):
    """One teacher's targets for a chunk's rows; tensors of rows outside kd_rows are harmless (zeros, ids 0..k-1)."""
    format: str  # "topk" | "sampled" | "full"
    values: torch.Tensor  # log-probs [rows, k] (full: [rows, V])
    ids: Optional[torch.Tensor]  # student ids [rows, k] (sampled: -1 for an unmapped cross-tokenizer draw)
    extra: Optional[torch.Tensor]  # top-k: the tail's mass; sampled: sum p log p [rows]
    kd_rows: torch.Tensor  # rows whose KD counts (valid, KD weight > 0)
    row_weight: torch.Tensor  # their KD weights, 0 elsewhere
    uld_sorted: Optional[torch.Tensor]  # ULD: the teacher's unmapped probabilities, sorted [rows, uld_k]


def chunk_loss(z: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, teachers: list[ChunkTeacher],
               alpha: float, args) -> tuple[torch.Tensor, dict]:
    """(this chunk's loss summed over its rows, its statistics summed by name) from its logits z [rows, V] in the
    work dtype; labels [rows] (0 where not valid), valid [rows]."""
    lse = torch.logsumexp(z, -1)
    ce = torch.where(valid, lse - z.gather(-1, labels.unsqueeze(-1)).squeeze(-1), 0.0)
    loss, stats = (1.0 - alpha) * ce.sum(), {"ce": ce.detach().sum()}
    if args.z_loss > 0:  # PaLM's z-loss: keeps the softmax's normaliser near 1, whatever the teachers
        z_term = torch.where(valid, args.z_loss * lse**2, 0.0).sum()
        loss, stats["z"] = loss + z_term, z_term.detach()
    a = z / args.temperature  # the KD's temperature on the student's side
    log_q_all = a.log_softmax(-1)
    per_teacher = []
    for t in teachers:
        if t.format == "full":
            kd = divergence(teacher_full_log_probs(t.values, z.dtype), log_q_all, args.divergence, args.jsd_beta)
        elif t.format == "sampled":  # an unmapped cross-tokenizer draw (-1) has no student term
            kd = sampled_forward_kl(t.extra, log_q_all.gather(-1, t.ids.clamp_min(0)), t.ids >= 0)
        else:  # top-k: k + 1 buckets, the ids plus the rest of the vocabulary (when k < V)
            log_q = log_q_all.gather(-1, t.ids)
            with_rest = t.ids.shape[-1] < z.shape[-1]
            if with_rest:  # the rest as a log-sum-exp over the other ids: exact when it is tiny
                rest = a.scatter(-1, t.ids, float("-inf")).logsumexp(-1, keepdim=True) - a.logsumexp(-1, keepdim=True)
                log_q = torch.cat([log_q, rest], dim=-1)
            kd = divergence(teacher_topk_log_probs(t.values, t.extra, z.dtype, with_rest), log_q, args.divergence,
                            args.jsd_beta)
            if t.uld_sorted is not None:  # ULD: the teacher's unmapped mass against the student's rest, sorted
                kd = kd + args.uld_weight * uld_reference(a, t.ids, t.uld_sorted)
        kd = torch.where(t.kd_rows, kd * t.row_weight, 0.0)  # where, not multiply: keeps a 0 * inf out
        loss = loss + alpha * args.temperature**2 * kd.sum()
        mass, teacher_top1 = teacher_support(t.values, t.ids, t.extra, t.format)
        agree = (z.detach().argmax(-1) == teacher_top1).to(z.dtype)
        row_sums = (kd.detach(), mass.to(z.dtype) * t.row_weight, agree * t.row_weight)
        per_teacher.append([torch.where(t.kd_rows, s, 0.0).sum() for s in row_sums])
    if teachers:
        stats.update({name: torch.stack(column) for name, column in zip(PER_TEACHER, zip(*per_teacher))})
    return loss, stats


def chunk_teachers(teachers: list, rows: slice, valid: torch.Tensor, dtype: torch.dtype, vocab_size: int,
                   uld_k: int) -> list:
    """`chunk_loss`'s teachers for the chunk's rows, from (TeacherOutputs as [N, ...] rows, KD weight [N] or None,
    takes ULD) each: tensors of rows outside a teacher's KD rows (which may hold anything, inf/nan too) replaced,
    and with ULD the unmapped entries split off the top-k targets."""
    out = []
    for outputs, kd_weight, with_uld in teachers:
        values, ids, extra = (None if t is None else t[rows] for t in (outputs.values, outputs.ids, outputs.extra))
        kd_rows, row_weight = kd_rows_and_weights(valid, None if kd_weight is None else kd_weight[rows], dtype)
        # Outside the KD rows: log-probs 0, a tail of 1 and ids 0..k-1 (finite, in range, mapped; distinct for top-k).
        values = torch.where(kd_rows.unsqueeze(-1), values.to(dtype), 0.0)
        extra = None if extra is None else torch.where(kd_rows, extra.to(dtype), 1.0)
        if ids is not None:
            harmless = torch.arange(ids.shape[-1], device=ids.device) % vocab_size
            ids = torch.where(kd_rows.unsqueeze(-1), ids.long(), harmless)
        uld_sorted = None
        if with_uld:  # the unmapped entries leave the top-k targets and become ULD's teacher side
            values, ids, uld_sorted = split_unmapped(values, ids, extra, uld_k, dtype)
        out.append(ChunkTeacher(outputs.format, values, ids, extra, kd_rows, row_weight, uld_sorted))
    return out


def _research_pass(hidden, weight, labels, teachers, normalizer, alpha, args, need_grad_hidden, need_grad_weight):
    """(loss, stats, grad_hidden or None, grad_weight or None) of the flattened inputs, chunk by chunk."""
    N, V = hidden.shape[0], weight.shape[0]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    valid = labels != -100
    safe_labels = labels.masked_fill(~valid, 0).long()
    # fp32 operands for a bf16 head: their products are exact in fp32, so the logits are the fp32 GEMM's.
    head = weight.detach().to(dtype).requires_grad_(need_grad_weight)
    masked_hidden = hidden.detach().masked_fill(~valid.unsqueeze(-1), 0.0)  # a masked inf/nan row reaches nothing
    grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_grad_hidden else None
    grad_weight = torch.zeros_like(head) if need_grad_weight else None
    chunk_rows = args.loss_chunk_size or auto_chunk_rows(V, "full", hidden.device, hidden.dtype)
    loss_sum = stats = None
    for start in range(0, N, chunk_rows):
        rows = slice(start, min(start + chunk_rows, N))
        with torch.enable_grad():
            h = masked_hidden[rows].to(dtype).requires_grad_(need_grad_hidden)
            targets = chunk_teachers(teachers, rows, valid[rows], dtype, V, args.uld_k)
            loss, chunk_stats = chunk_loss(h @ head.T, safe_labels[rows], valid[rows], targets, alpha, args)
            wanted = [t for t, need in ((h, need_grad_hidden), (head, need_grad_weight)) if need]
            grads = list(torch.autograd.grad(loss, wanted)) if wanted else []
        if need_grad_hidden:
            grad_hidden[rows] = grads.pop(0)
        if need_grad_weight:
            grad_weight += grads.pop(0)
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        stats = chunk_stats if stats is None else add_stats(stats, chunk_stats)
    if not isinstance(normalizer, torch.Tensor):
        normalizer = torch.tensor(float(normalizer), dtype=torch.float64, device=hidden.device)
    stats = {name: value.double() / normalizer for name, value in stats.items()}
    grads = [None if g is None else (g / normalizer.to(dtype)).to(t.dtype)
             for g, t in ((grad_hidden, hidden), (grad_weight, weight))]
    return loss_sum / normalizer.to(dtype), stats, *grads


def add_stats(a: dict, b: dict) -> dict:
    """Statistics by name, added (a micro-batch's to the step's, a chunk's to the micro-batch's)."""
    return {name: a[name] + b[name] for name in a}


class _ResearchLoss(torch.autograd.Function):
    """Forward computes the loss and both grads chunk by chunk (autograd inside); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, stats_out, *args):
        loss, stats, ctx.grad_hidden, ctx.grad_weight = _research_pass(
            hidden, weight, *args, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        stats_out.append(stats)  # by name, beside the graph: the loss is the Function's one output
        ctx.n_args, ctx.used = 1 + len(args), False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("research_head_loss supports a single backward pass; do not backward through it "
                               "twice (retain_graph).")
        ctx.used = True
        grads = [None if t is None else t.mul_(grad_loss.to(t.dtype)) for t in (ctx.grad_hidden, ctx.grad_weight)]
        ctx.grad_hidden = ctx.grad_weight = None
        return (*grads, *[None] * ctx.n_args)


def research_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teachers: list,
                       normalizer: Union[int, float, torch.Tensor], alpha: float, args) -> tuple[torch.Tensor, dict]:
    """The student's loss from its final hidden states [..., D] and head weight [V, D] (logits = hidden @ weight.T).

    teachers: (TeacherOutputs, KD weight per position shaped like labels or None, takes ULD) each, none for CE
    alone; normalizer: the step's valid-token count; args: the loss settings (`DistillationArgs`: temperature,
    divergence, jsd_beta, loss_chunk_size, uld_weight, uld_k). Returns (the loss, with autograd to hidden and
    weight; its statistics by name, float64, divided by the normalizer): "ce", "z" (the z-loss term, when
    args.z_loss > 0), and with teachers "kd",
    "teacher_mass", "top1_agreement", one value per teacher each, weighted by that teacher's KD weight."""
    N = hidden.numel() // hidden.shape[-1]
    flat = [(flat_teacher(outputs, N), None if w is None else w.reshape(N), with_uld)
            for outputs, w, with_uld in teachers]
    inputs = (hidden.reshape(N, hidden.shape[-1]), weight, labels.reshape(N), flat, normalizer, alpha, args)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        stats_out = []
        loss = _ResearchLoss.apply(inputs[0], inputs[1], stats_out, *inputs[2:])
        return loss, stats_out[0]
    loss, stats, _, _ = _research_pass(*inputs, False, False)
    return loss, stats
