"""The fused loss's chunk math through torch.compile (`distillation.loss_compile`): inductor fuses the passes over the
chunk's [rows, V] logits into a few kernels (Triton on CUDA, C++/OpenMP on CPU). The logits come in fp32
(`chunk.head_logits`: a bf16 head's GEMM is not rounded to bf16), and the gradient is written back over them. One
compile per static configuration (format, divergence, T == 1, dtypes, chunk shape) per process: the caller pads the
last chunk with masked rows; fullgraph, so a host read would be an error, not a silent round trip.
"""

import torch

from lingua.distillation.loss.chunk import GradRecipe, chunk_loss_and_grad


def _chunk_in_head_dtype(z, work_dtype, labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
                         jsd_beta, z_coef=None):
    """`chunk_loss_and_grad` on the chunk's logits z: the math on a `work_dtype` copy, dLoss/dz written over z."""
    if teacher is None:
        return _ce_chunk(z, work_dtype, labels, row_mask, ce_scale, z_coef)
    ce, kd, student_top1, g, recipe, lse = chunk_loss_and_grad(
        z.to(work_dtype, copy=True), labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
        jsd_beta, z_coef)
    return ce, kd, student_top1, z.copy_(g), recipe, lse


def _ce_chunk(z, work_dtype, labels, row_mask, ce_scale, z_coef=None):
    """CE alone with the label's -1 by a compare, not a scatter_add: a scatter makes inductor keep its [rows, V]
    input in memory, a compare fuses into the one kernel with no [rows, V] temporary."""
    a = z.to(work_dtype)
    shift, argmax = a.max(-1, keepdim=True)
    rest_sum = (a - shift).exp().sum(-1, keepdim=True)
    lse = shift + rest_sum.log()
    ce = (lse - a.gather(-1, labels)).squeeze(-1)
    softmax_scale = ce_scale if z_coef is None else ce_scale + z_coef * lse  # the z-loss rides on CE's softmax
    ce_coef = torch.where(row_mask.unsqueeze(-1), softmax_scale / rest_sum, 0.0)
    label_grad = torch.where(row_mask, -ce_scale, 0.0).unsqueeze(-1)
    at_label = torch.arange(z.shape[-1], device=z.device) == labels
    g = (a - shift).exp() * ce_coef + torch.where(at_label, label_grad, 0.0)
    recipe = GradRecipe(shift, ce_coef, None, labels, label_grad, None, None, False)
    return ce, None, argmax.squeeze(-1), z.copy_(g), recipe, lse.squeeze(-1)


# inductor: Triton on CUDA, C++ on CPU. The fast tests trace through "aot_eager" (the same graphs, no codegen).
BACKEND = "inductor"
_compiled = {}


def compiled_chunk_loss_and_grad(z, work_dtype, *args):
    """`chunk_loss_and_grad`'s arguments and results, z the chunk's fp32 logits, compiled (one wrapper per backend)."""
    if BACKEND not in _compiled:
        # dynamic=False: the chunk's shape is fixed by the caller's padding; a static shape is inductor's best case.
        _compiled[BACKEND] = torch.compile(_chunk_in_head_dtype, backend=BACKEND, fullgraph=True, dynamic=False)
    return _compiled[BACKEND](z, work_dtype, *args)
