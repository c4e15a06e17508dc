"""The fused loss's chunk math (`fused_chunk.chunk_loss_and_grad`) through torch.compile, for
`fused_linear_kd_loss(..., compiled=True)` and `distillation.loss_compile=true`.

Eagerly each pass over the chunk's [rows, V] logits is its own kernel reading and writing memory (CE's max,
subtract, exp, sum, multiply; more at T != 1 and for the full format). Compiled, inductor fuses them into a few
kernels (Triton on CUDA, C++/OpenMP on CPU) that keep the per-element math in registers. The logits come in in
the head's dtype (bf16 on a GPU), are widened to fp32 inside the compiled region only, and the gradient is written
back over them in the head's dtype: no fp32 [rows, V] buffer needs to be kept between the kernels.

Compiles: one per static configuration (teacher format, divergence, T == 1 or not, dtypes, chunk shape) per
process. The caller pads the step's last, shorter chunk with masked rows to the chunk's size (masked rows
contribute exactly zero), so a step's chunks share one shape; nothing in the region reads a device value on the
host (fullgraph: a graph break would be an error, not a silent host round trip).
"""

import torch

from lingua.distillation.fused_chunk import chunk_loss_and_grad


def _chunk_in_head_dtype(z, work_dtype, labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
                         jsd_beta):
    """`chunk_loss_and_grad` on z [rows, V] in the head's dtype: the math in `work_dtype` (a copy, never z
    itself), then dLoss/dz written over z in z's dtype and returned as g (so g is z's buffer, as eagerly)."""
    ce, kd, student_top1, g, recipe = chunk_loss_and_grad(
        z.to(work_dtype, copy=True), labels, row_mask, teacher, ids, kd_rows, ce_scale, kd_scale, temperature, kind,
        jsd_beta)
    return ce, kd, student_top1, z.copy_(g), recipe


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
