"""The fused loss's chunk math (`fused_chunk.chunk_loss_and_grad`) through torch.compile, for
`fused_linear_kd_loss(..., compiled=True)` and `distillation.loss_compile=true`.

Eagerly each pass over the chunk's [rows, V] logits is its own kernel reading and writing memory (CE's max,
subtract, exp, sum, multiply; more at T != 1 and for the full format). Compiled, inductor fuses them into a few
kernels (Triton on CUDA, C++/OpenMP on CPU) that keep the per-element math in registers. The logits come in in
the head's dtype (bf16 on a GPU), are widened to fp32 inside the compiled region only, and the gradient is written
back over them in the head's dtype. CE alone compiles to one kernel with no [rows, V] temporary (its label term is
a compare, `_ce_chunk`); with a teacher the k-wide scatters (the ids set to -inf, their gradients written) make
inductor keep two or three fp32 [rows, V] buffers (inductor's output code, read on CPU at 2026-11-27).

Compiles: one per static configuration (teacher format, divergence, T == 1 or not, dtypes, chunk shape) per
process. The caller pads the step's last, shorter chunk with masked rows to the chunk's size (masked rows
contribute exactly zero), so a step's chunks share one shape; nothing in the region reads a device value on the
host (fullgraph: a graph break would be an error, not a silent host round trip).
"""

import torch

from lingua.distillation.loss.chunk import GradRecipe, chunk_loss_and_grad


def _chunk_in_head_dtype(z, work_dtype, labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
                         jsd_beta):
    """`chunk_loss_and_grad` on z [rows, V] in the head's dtype: the math in `work_dtype` (a copy, never z
    itself), then dLoss/dz written over z in z's dtype and returned as g (so g is z's buffer, as eagerly)."""
    if teacher is None:
        return _ce_chunk(z, work_dtype, labels, row_mask, ce_scale)
    ce, kd, student_top1, g, recipe = chunk_loss_and_grad(
        z.to(work_dtype, copy=True), labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
        jsd_beta)
    return ce, kd, student_top1, z.copy_(g), recipe


def _ce_chunk(z, work_dtype, labels, row_mask, ce_scale):
    """CE alone, as `chunk_loss_and_grad` computes it, with the label's -1 written by a compare instead of a
    scatter_add: a scatter makes inductor keep its [rows, V] input in memory, a compare fuses into the one write."""
    a = z.to(work_dtype)
    shift, argmax = a.max(-1, keepdim=True)
    rest_sum = (a - shift).exp().sum(-1, keepdim=True)
    lse = shift + rest_sum.log()
    ce = (lse - a.gather(-1, labels)).squeeze(-1)
    ce_coef = torch.where(row_mask.unsqueeze(-1), ce_scale / rest_sum, 0.0)
    label_grad = torch.where(row_mask, -ce_scale, 0.0).unsqueeze(-1)
    at_label = torch.arange(z.shape[-1], device=z.device) == labels
    g = (a - shift).exp() * ce_coef + torch.where(at_label, label_grad, 0.0)
    recipe = GradRecipe(shift, ce_coef, None, labels, label_grad, None, None, False)
    return ce, None, argmax.squeeze(-1), z.copy_(g), recipe


# inductor: Triton on CUDA, C++ on CPU. The fast tests trace through "aot_eager" (the same graphs, no codegen).
BACKEND = "inductor"
_compiled = {}


def compiled_chunk_loss_and_grad(z, work_dtype, *args):
    """`_chunk_in_head_dtype` compiled (one wrapper per backend; dynamo keeps one graph per static configuration).
    Same arguments and results as `chunk_loss_and_grad`, except that z stays in the head's dtype."""
    if BACKEND not in _compiled:
        # dynamic=False: the chunk's shape is fixed by the caller's padding; a static shape is inductor's best case.
        _compiled[BACKEND] = torch.compile(_chunk_in_head_dtype, backend=BACKEND, fullgraph=True, dynamic=False)
    return _compiled[BACKEND](z, work_dtype, *args)
