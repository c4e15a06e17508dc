"""CE + KD fused with the output head: one chunked pass, closed-form gradients, no [N, V] logits.

    loss, stats = fused_linear_kd_loss(hidden, model.output.weight, labels, teacher, n_valid, alpha, T)
    loss = ((1 - alpha) * sum_i CE_i + alpha * T^2 * sum_i KD_i) / normalizer   over positions with label != -100

This is the same objective as CE (`lingua.transformer.cross_entropy_sum`) + `reference_loss.kd_loss` mixed by
`divergences.distillation_loss`, computed differently (the idea of Liger-Kernel's fused linear
distillation): the rows are walked in chunks; per chunk the logits z = h W^T are formed in fp32,
the loss rows and dLoss/dz are written in closed form into the chunk's buffers, and dz is pushed
through the head at once (grad_h = dz W, grad_W += dz^T h). Backward only scales the stored grads by
grad_output. So one chunk of fp32 [rows, V] work lives at a time, nothing is recomputed, and the
extra memory is grad_W ([V, D], which autograd would allocate anyway; kept in fp32 while the chunks
add into it, then cast to the weight's dtype) from forward to backward. A chunk's math is
`fused_chunk.chunk_loss_and_grad`: at T = 1 top-k (every divergence) and sampled KD ride on CE's own
five passes over [rows, V] (max, subtract, exp, sum, multiply) with k-wide gathers and scatters;
T != 1 adds three passes and an addcmul, the full format its own log-softmax (tests/unit/lingua/distillation/loss/test_fused_passes.py).

Gradients per position, with a = z / T, s = softmax(a), and bucket log-probs log q_b of the student:
CE gives softmax(z) - onehot(y). KD enters as T^2 * dKD/dz = T * dKD/da, and dKD/da follows from
G_b = dKD/d(log q_b) (p = the teacher's buckets, `divergences.teacher_*_log_probs`; D and G come from
`divergences.divergence`, whose docstring lists them):

    fkl   KD = sum p (log p - log q)                 G = -p
    rkl   KD = sum q (log q - log p)                 G = q (log q - log p + 1)
    jsd   KD = beta sum p (log p - log m) + (1 - beta) sum q (log q - log m),  m = beta p + (1 - beta) q
                                                     G = (1 - beta) q (log q - log m)
          (d/dq of the beta and (1 - beta) parts' log m terms cancel to -(1 - beta), leaving the above)

    full     buckets = the vocabulary: dKD/da = G - q sum(G)   (fkl: q sum(p) - p)
    topk     buckets = the k ids + "rest". log q_i = a_i - lse(a), log q_rest = lse_rest(a) - lse(a), so
             on an id      dKD/da_i = G_i - q_i sum(G)
             elsewhere     dKD/da_v = s_v / q_rest * (G_rest - q_rest sum(G))
                                    = exp(a_v - lse_rest(a)) * (G_rest - q_rest sum(G))
             (fkl: q_i - p_i on the ids, s_v (1 - p_rest / q_rest) elsewhere). exp(a_v - lse_rest) is
             computed from the rest's own max (the ids are set to -inf before CE's max pass), so a rest
             bucket far below the top ids stays exact.
    sampled  KD = extra - mean_j log s(x_j);  dKD/da = s - counts / k  (counts of each id among the k)

Masked positions (label -100) contribute exactly zero, also when their hidden states or teacher
tensors are inf/nan: their hidden rows are zeroed before the head and every per-row coefficient
goes through `where`, never a multiply by the mask. No step reads a device value on the host.

Using it: call it where the head would run, inside the model's forward (under FSDP2 the head weight is
then the unsharded plain tensor; a DTensor or a vocab-sharded head is not supported), with the
tied `tok_embeddings.weight` when embeddings are tied (autograd adds the two grads). Not inside an
activation-checkpointed region (the forward already does the backward's work), and one backward per
call. bf16 hidden/weight: bf16 GEMMs, fp32 loss math and grad_W accumulation, grads returned in bf16. On CUDA
each chunk's bf16 grad_W GEMM writes into the fp32 accumulator directly (`addmm` with `out_dtype`); elsewhere
it makes a bf16 [V, D] product first, then adds it.
"""

import functools
import math
from typing import Optional, Union

import torch

from lingua.distillation.loss.compiled_chunk import compiled_chunk_loss_and_grad
from lingua.distillation.loss.divergences import DIVERGENCES, distillation_loss, teacher_support
from lingua.distillation.loss.chunk import GradRecipe, chunk_loss_and_grad, vocab_block_weight_grad
from lingua.distillation.outputs import TeacherOutputs, check_format
from lingua.distillation.loss.uld import ChunkULD, check_uld, split_unmapped

# Auto chunking: rows per chunk so the chunk's fp32 [rows, V] work tensors fit about this many bytes.
# CPU: 256 MiB is ~450 rows at V=49k. Measured (2-core CPU, V=49k, N=1k): with 1 thread any chunk of
# 96-1024 rows costs the same as CE (GEMMs are ~90% of the step); with 2 threads every op pays a
# thread-pool sync, and 113-row chunks (64 MiB) cost 1.46x CE's CPU time where 512-row ones cost 1.08x.
# 256 MiB is still a sixth of one [N, V] fp32 tensor at N=8k. CUDA: GEMMs need ~1k+ rows to fill the
# SMs, and 1 GiB is a small share of a GPU. A fixed budget, not a share of free memory, keeps chunk
# boundaries (hence rounding) the same from run to run and rank to rank.
AUTO_CHUNK_BYTES = {"cpu": 256 * 2**20, "cuda": 1024 * 2**20}
# weight_grad="vocab_blocks" keeps no fp32 [V, D]: its chunks and vocabulary blocks get a smaller budget, a peak
# close to the grads themselves (a GPU sets the final value: docs/gpu.md).
VOCAB_BLOCK_BYTES = {"cpu": 256 * 2**20, "cuda": 256 * 2**20}
WEIGHT_GRADS = ("accumulate", "vocab_blocks")
# [rows, V] tensors of the work dtype alive at once per format (the full format builds a few more).
WORK_TENSORS = {None: 3, "topk": 3, "sampled": 3, "full": 8}


def auto_chunk_rows(vocab_size: int, format: Optional[str], device: Union[str, torch.device] = "cpu",
                    dtype: torch.dtype = torch.float32, budgets: Optional[dict] = None) -> int:
    """Rows per chunk such that the chunk's [rows, V] work tensors stay within the device's budget (AUTO_CHUNK_BYTES
    unless `budgets` says otherwise); at least 1."""
    budgets = budgets or AUTO_CHUNK_BYTES
    budget = budgets.get(torch.device(device).type, budgets["cuda"])
    work_dtype = torch.promote_types(dtype, torch.float32)
    per_row = vocab_size * torch.tensor([], dtype=work_dtype).element_size() * WORK_TENSORS[format]
    return max(1, budget // per_row)


@functools.lru_cache(maxsize=None)
def accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device adds a `dtype` GEMM into an fp32 tensor in one call (`torch.addmm(acc, ..., out_dtype=
    torch.float32, out=acc)`): CUDA for fp16/bf16 where torch's kernel accepts an fp32 `acc` (older ones want it in
    the inputs' dtype); not CPU. A tiny probe, once per device."""
    if dtype == torch.float32:
        return False
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):  # no such overload, or no kernel for this device
        return False
    return True


@functools.lru_cache(maxsize=None)
def multiplies_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device multiplies two `dtype` matrices into an fp32 result in one call (`torch.mm(a, b,
    out_dtype=torch.float32)`, the GEMM's fp32 accumulator kept instead of rounded to `dtype`): CUDA for fp16/bf16
    where torch has the kernel; not CPU. A tiny probe, once per device, like `accumulates_in_fp32`."""
    if dtype == torch.float32:
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):  # no such overload, or no kernel for this device (NotImplementedError)
        return False


def _fused_pass(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta,
                chunk_size, kd_weight, vocab_block, compiled, uld, need_grad_hidden, need_grad_weight, more=()):
    """(loss, stats [4 + 3 * len(more)], grad_hidden or None, grad_weight or None) of the flattened inputs, chunk
    by chunk; vocab_block > 0: grad_W by `vocab_block_weight_grad` in blocks of that many ids, not by accumulation;
    compiled: the chunk math through torch.compile (`compiled_chunk`), the last chunk padded to the others' rows;
    uld: None or (uld_weight, uld_k) for marked cross-tokenizer top-k rows (`uld.py`); more: (flat teacher, flat
    kd_weight) of further teachers whose KD terms add to the loss on the same logits and gradient GEMMs (neither
    vocab_block, compiled nor uld)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    mask = labels != -100
    safe_labels = labels.masked_fill(~mask, 0).long().unsqueeze(-1)
    # 0-dim device tensors built with full (a kernel, not a host copy): the scales stay off the host.
    if not isinstance(normalizer, torch.Tensor):
        normalizer = torch.full((), float(normalizer), dtype=dtype, device=hidden.device)
    inv_norm = 1.0 / normalizer.to(device=hidden.device, dtype=dtype)
    if teacher is None:
        alpha = 0.0
    ce_scale, kd_scale = (1.0 - alpha) * inv_norm, alpha * temperature * inv_norm
    stats = torch.zeros(4 + 3 * len(more), dtype=dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    # The recipes rebuild dz block by block after the chunks; the full format has none (it accumulates).
    by_blocks = need_grad_weight and vocab_block > 0 and (teacher is None or teacher.format != "full")
    recipes = []
    # fp32 accumulator for a bf16 head: adding bf16 partial sums chunk after chunk would round each time.
    grad_weight = torch.zeros(V, D, dtype=dtype, device=weight.device) if need_grad_weight and not by_blocks else None
    fp32_addmm = need_grad_weight and dtype != weight.dtype and accumulates_in_fp32(weight.device, weight.dtype)
    # where, not multiply: an inf/nan hidden row at a masked position must not reach the logits or grads.
    masked_hidden = hidden.masked_fill(~mask.unsqueeze(-1), 0.0)
    chunk_rows = min(chunk_size, N)
    for start in range(0, N, chunk_size):
        rows = slice(start, min(start + chunk_size, N))
        n_rows = rows.stop - rows.start
        # Compiled: one chunk shape per step (one compile), the short last chunk filled with masked rows.
        pad = functools.partial(_pad_rows, extra_rows=chunk_rows - n_rows if compiled else 0)
        row_mask = pad(mask[rows])
        h = pad(masked_hidden[rows])
        z = h @ weight.T if compiled else (h @ weight.T).to(dtype)
        values = ids = extra = None
        z_more = z.clone() if more else None  # the chunk math overwrites z: further teachers read a copy
        if teacher is None:
            kd_rows, row_kd_scale = row_mask, torch.zeros_like(row_mask, dtype=dtype)
        else:
            values, ids, extra, row_weight, kd_rows, row_kd_scale, chunk_uld = _chunk_teacher(
                teacher, kd_weight, rows, pad, row_mask, kd_scale, dtype, uld, V)
        chunk_teacher = None if teacher is None else (teacher.format, values, extra)
        chunk_args = (pad(safe_labels[rows]), row_mask, chunk_teacher, ids, kd_rows, ce_scale, row_kd_scale,
                      temperature, divergence, jsd_beta) + ((chunk_uld,) if uld is not None else ())
        if compiled:  # z in the head's dtype; g comes back in it, written over z
            ce, kd, student_top1, g, recipe = compiled_chunk_loss_and_grad(z, dtype, *chunk_args)
        else:
            ce, kd, student_top1, g, recipe = chunk_loss_and_grad(z, *chunk_args)
        if teacher is None:
            kd = mass = agree = torch.zeros_like(ce)
        else:
            mass, teacher_top1 = teacher_support(values, ids, extra, teacher.format)
            agree = (student_top1 == teacher_top1).to(dtype)
            # The KD stats are sums weighted by the KD weight (where, not multiply: a weight-0 row may be nan).
            kd, mass, agree = (torch.where(kd_rows, t.to(dtype) * row_weight, 0.0) for t in (kd, mass, agree))
        per_row = torch.stack([ce, kd, mass, agree])
        if more:
            per_row = torch.cat([per_row, _more_teachers(z_more, more, rows, pad, safe_labels, row_mask, g,
                                                         kd_scale, temperature, divergence, jsd_beta, dtype)])
            z_more = None
        stats += torch.where(row_mask, per_row, 0.0).sum(-1)
        z = None  # g is z's buffer; only g lives on into the grad GEMMs
        if by_blocks:
            recipes.append(GradRecipe(*(None if t is None else t[:n_rows] for t in recipe[:-1]), recipe.ids_set))
        if need_grad_hidden or need_grad_weight:
            g = g.to(weight.dtype)
            if need_grad_hidden:  # padded rows of g are zero, and h's too, so grad_W may take them all
                torch.mm(g[:n_rows], weight, out=grad_hidden[rows])
            if grad_weight is None:  # no head grad, or it comes from the vocabulary blocks below
                continue
            if dtype == weight.dtype:
                grad_weight.addmm_(g.T, h)
            elif fp32_addmm:  # a bf16 GEMM summed into fp32: no [V, D] temporary
                torch.addmm(grad_weight, g.T, h, out_dtype=dtype, out=grad_weight)
            else:
                grad_weight.add_(g.T @ h)
    kd_sum = stats[1] + stats[4::3].sum() if more else stats[1]
    loss = distillation_loss(stats[0], kd_sum, alpha, temperature) * inv_norm
    if by_blocks:
        g = None
        grad_weight = vocab_block_weight_grad(masked_hidden, weight, GradRecipe.cat(recipes), temperature,
                                              vocab_block, dtype)
    elif grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, stats.float(), grad_hidden, grad_weight


def _chunk_teacher(teacher, kd_weight, rows, pad, row_mask, kd_scale, dtype, uld=None, vocab_size=0):
    """A teacher's tensors for the chunk's rows, its KD weight and KD rows (valid labels with a positive weight; a
    row outside them takes CE alone), each row's KD scale and, with `uld`, the chunk's ULD side (else None)."""
    values, ids, extra = (None if t is None else pad(t[rows]) for t in teacher)
    row_weight = torch.ones_like(row_mask, dtype=dtype) if kd_weight is None else pad(kd_weight[rows]).to(dtype)
    kd_rows = row_mask & (row_weight > 0)
    row_weight = torch.where(kd_rows, row_weight, 0.0)
    chunk_uld = None
    if uld is not None:  # the unmapped entries leave the top-k targets and become ULD's teacher side
        values, ids, teacher_sorted = split_unmapped(values, ids, extra, uld[1], dtype)
        chunk_uld = ChunkULD(torch.where(kd_rows.unsqueeze(-1), teacher_sorted, 0.0), uld[0],
                             vocab_size - ids.shape[-1])
    if ids is not None:
        # A row outside the KD rows may carry any id: 0..k-1 keep gathers in range and the ids distinct.
        ids = torch.where(kd_rows.unsqueeze(-1), ids.long(), torch.arange(ids.shape[-1], device=ids.device))
    return values, ids, extra, row_weight, kd_rows, kd_scale * row_weight, chunk_uld


def _more_teachers(z, more, rows, pad, safe_labels, row_mask, g, kd_scale, temperature, divergence, jsd_beta, dtype):
    """Further teachers' KD on the chunk's logits `z` (a copy, overwritten): each one's gradient is added into g
    (no CE: its scale is 0), and its per-row (KD, mass, agreement), weighted by its KD weight, are returned."""
    zero = torch.zeros((), dtype=dtype, device=z.device)
    per_row = []
    for i, (teacher, kd_weight) in enumerate(more):
        z_i = z.clone() if i + 1 < len(more) else z
        values, ids, extra, row_weight, kd_rows, row_kd_scale, _ = _chunk_teacher(teacher, kd_weight, rows, pad,
                                                                                  row_mask, kd_scale, dtype)
        _, kd, student_top1, g_i, _ = chunk_loss_and_grad(z_i, pad(safe_labels[rows]), row_mask,
                                                          (teacher.format, values, extra), ids, kd_rows, zero,
                                                          row_kd_scale, temperature, divergence, jsd_beta)
        g.add_(g_i)
        mass, teacher_top1 = teacher_support(values, ids, extra, teacher.format)
        agree = (student_top1 == teacher_top1).to(dtype)
        per_row += [torch.where(kd_rows, t.to(dtype) * row_weight, 0.0) for t in (kd, mass, agree)]
    return torch.stack(per_row)


def _pad_rows(t, extra_rows):
    """t with `extra_rows` rows of zeros (False, id 0) appended: masked rows for a compiled short chunk."""
    if extra_rows == 0:
        return t
    return torch.cat([t, t.new_zeros((extra_rows,) + tuple(t.shape[1:]))])


class _FlatTeacher:
    """The teacher's tensors flattened to [N, ...] rows; iterates as (values, ids, extra)."""

    def __init__(self, teacher: TeacherOutputs, N: int):
        self.format = teacher.format
        self.values = teacher.values.reshape(N, teacher.values.shape[-1])
        self.ids = None if teacher.ids is None else teacher.ids.reshape(N, teacher.ids.shape[-1])
        self.extra = None if teacher.extra is None else teacher.extra.reshape(N)

    def __iter__(self):
        return iter((self.values, self.ids, self.extra))


class _FusedLinearKDLoss(torch.autograd.Function):
    """Forward computes the loss and both grads chunk by chunk; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                kd_weight, vocab_block, compiled, uld, more):
        loss, stats, ctx.grad_hidden, ctx.grad_weight = _fused_pass(
            hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
            kd_weight, vocab_block, compiled, uld, ctx.needs_input_grad[0], ctx.needs_input_grad[1], more)
        ctx.mark_non_differentiable(stats)
        ctx.used = False
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        if ctx.used:
            raise RuntimeError("fused_linear_kd_loss supports a single backward pass; do not backward through it "
                               "twice (retain_graph).")
        ctx.used = True
        # In place: the buffers are ours and needed once, so scaling adds no [V, D] tensor.
        grads = [None if t is None else t.mul_(grad_loss) for t in (ctx.grad_hidden, ctx.grad_weight)]
        ctx.grad_hidden = ctx.grad_weight = None
        return grads[0], grads[1], None, None, None, None, None, None, None, None, None, None, None, None, None


def _check_args(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                kd_weight, weight_grad, uld_weight=0.0, uld_k=1, compiled=False):
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and the head weight {tuple(weight.shape)} must be [..., D] "
                         f"and [V, D]; pass the output head's weight (logits = hidden @ weight.T).")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and the head weight ({weight.dtype}) must share a dtype; cast "
                         f"the hidden states to the head's dtype as the head itself would.")
    N = hidden.numel() // hidden.shape[-1]
    if labels.numel() != N:
        raise ValueError(f"labels {tuple(labels.shape)} must hold one label per hidden row ({N} rows).")
    if not isinstance(normalizer, torch.Tensor) and normalizer <= 0:
        raise ValueError(f"normalizer={normalizer} must be positive; pass max(valid tokens in the step, 1).")
    if temperature <= 0:
        raise ValueError(f"Distillation temperature {temperature} must be positive.")
    if weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"weight_grad={weight_grad!r} is unknown; use one of {', '.join(WEIGHT_GRADS)}.")
    if chunk_size < 0:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1, or 0 for a size chosen from the memory budget.")
    uld_problem = check_uld(uld_weight, uld_k)
    if uld_problem is not None:
        raise ValueError(f"{uld_problem}.")
    if uld_weight > 0 and (teacher is None or teacher.format != "topk" or compiled):
        raise ValueError("uld_weight > 0 reads the unmapped entries of cross-tokenizer top-k targets in the eager "
                         "chunk math; pass top-k teacher outputs and compiled=False, or uld_weight=0.")
    if teacher is None:
        return
    check_format(teacher.format)
    if kd_weight is not None and (tuple(kd_weight.shape) != tuple(labels.shape) or not kd_weight.is_floating_point()):
        raise ValueError(f"kd_weight {tuple(kd_weight.shape)} {kd_weight.dtype} must be a float tensor shaped like "
                         f"labels {tuple(labels.shape)} (one KD weight in [0, 1] per position).")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] (the KD share of the loss).")
    if divergence not in DIVERGENCES:
        raise ValueError(f"KD divergence {divergence!r} is unknown; use one of {', '.join(DIVERGENCES)}.")
    if teacher.format == "sampled" and divergence != "fkl":
        raise ValueError(f"Sampled teacher outputs only give an unbiased estimate of the forward KL; set "
                         f"divergence=fkl (got {divergence!r}) or use topk/full outputs.")
    if divergence == "jsd" and not 0.0 < jsd_beta < 1.0:
        raise ValueError(f"jsd_beta={jsd_beta} must be strictly between 0 and 1.")
    V = weight.shape[0]
    width = teacher.values.shape[-1]
    if math.prod(teacher.values.shape[:-1]) != N or (teacher.extra is not None and teacher.extra.numel() != N):
        raise ValueError(f"Teacher outputs {tuple(teacher.values.shape)} must have one row per student position "
                         f"({N}); send the teacher the same [B, S] tokens.")
    if teacher.format == "full" and width != V:
        raise ValueError(f"Teacher vocabulary {width} differs from the student's {V}; both must use the same tokenizer.")
    if teacher.format == "topk" and width > V:
        raise ValueError(f"Top-k teacher outputs with k={width} exceed the student's vocabulary {V}; lower distillation.k.")


def fused_linear_kd_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher: Optional[TeacherOutputs],
    normalizer: Union[int, float, torch.Tensor],
    alpha: float,
    temperature: float,
    divergence: str = "fkl",
    jsd_beta: float = 0.5,
    chunk_size: int = 0,
    kd_weight: Optional[torch.Tensor] = None,
    weight_grad: str = "accumulate",
    compiled: bool = False,
    uld_weight: float = 0.0,
    uld_k: int = 16,
    more_teachers: tuple = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """((1 - alpha) * CE_sum + alpha * T^2 * KD_sum) / normalizer over labels != -100, fused with the head.

    hidden [N, D] or [B, S, D]: the student's final normed hidden states (any float dtype, same as
    weight); weight [V, D]: the output head (logits = hidden @ weight.T, never materialised beyond one
    chunk); labels [N] or [B, S], -100 = ignored; teacher: `TeacherOutputs` whose tensors lead with
    [B, S] or [N], or None for CE alone (alpha is then ignored); normalizer: the step's valid-token
    count (number or 0-dim tensor; sums are divided by it). KD is computed on z / T against the
    teacher's log-probs at T exactly as `kd_loss.kd_loss` defines it, for every divergence/format
    it accepts. chunk_size=0 picks rows per chunk from `AUTO_CHUNK_BYTES`. kd_weight (labels' shape, float
    in [0, 1], None = all ones) multiplies each position's KD term, value and gradient; at 0 the position
    takes CE alone and its teacher tensors (any value, inf/nan included) are never read into the loss.
    weight_grad: "accumulate" sums each chunk's grad_W GEMM into an fp32 [V, D] buffer; "vocab_blocks" keeps
    per-row coefficients instead and, after the chunks, writes grad_W one vocabulary block at a time from
    one GEMM over all rows (the block's logits recomputed: one more head GEMM, no fp32 [V, D] and chunks
    sized from `VOCAB_BLOCK_BYTES`); the full format always accumulates. compiled=True runs each chunk's math
    (everything between the logits GEMM and the gradient GEMMs) through torch.compile (`compiled_chunk`): the same
    results within fp32 rounding, one compile per static configuration per process. uld_weight > 0 (cross-tokenizer
    top-k whose unmapped entries are marked, `uld.py`): each KD row adds uld_weight times the ULD distance between
    the teacher's sorted unmapped probabilities and the student's uld_k largest rest probabilities.

    Returns (loss, stats): loss is a scalar in promote(dtype, fp32) with autograd to hidden and weight
    (grads in their dtypes; a single backward pass); stats is a detached fp32 [4] tensor of sums over
    the masked positions: (CE, KD, teacher mass covered by the support, student argmax == teacher
    top-1), the last three zero without a teacher and each weighted by kd_weight (divide them by the
    sum of kd_weight over valid labels for means). Nothing is read back to the host.

    more_teachers: (TeacherOutputs, kd_weight) of further teachers (several teachers, `mixture.py`), each adding
    alpha * T^2 * its weighted KD to the loss on the same logits: one set of head GEMMs for all, each teacher's
    chunk math on a copy of the chunk's logits; stats then go on with (KD, mass, agreement) of each. Not with
    weight_grad="vocab_blocks" or compiled=True (call once per teacher there).
    """
    _check_args(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                kd_weight, weight_grad, uld_weight, uld_k, compiled)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    N, V = flat_hidden.shape[0], weight.shape[0]
    flat_teacher = None if teacher is None else _FlatTeacher(teacher, N)
    format = None if teacher is None else teacher.format
    budgets = VOCAB_BLOCK_BYTES if weight_grad == "vocab_blocks" else None
    if chunk_size == 0:
        chunk_size = auto_chunk_rows(V, format, hidden.device, hidden.dtype, budgets)
    # The blocks' [N, block] work matches a chunk's [rows, V]: the same bytes.
    vocab_block = 0 if budgets is None else max(1, min(V, auto_chunk_rows(N, format, hidden.device, hidden.dtype,
                                                                          budgets)))
    flat_kd_weight = None if kd_weight is None or teacher is None else kd_weight.reshape(N)
    if more_teachers:
        assert teacher is not None and weight_grad == "accumulate" and not compiled and not uld_weight, \
            "see more_teachers"
        for other, other_weight in more_teachers:
            _check_args(hidden, weight, labels, other, normalizer, alpha, temperature, divergence, jsd_beta,
                        chunk_size, other_weight, weight_grad, uld_weight, uld_k, compiled)
    more = tuple((_FlatTeacher(other, N), None if w is None else w.reshape(N)) for other, w in more_teachers)
    args = (labels.reshape(N), flat_teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
            flat_kd_weight, vocab_block, compiled, (uld_weight, uld_k) if uld_weight > 0 else None, more)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearKDLoss.apply(flat_hidden, weight, *args)
    loss, stats, _, _ = _fused_pass(flat_hidden, weight, *args[:-1], False, False, more)
    return loss, stats


def fused_ce_head(labels: torch.Tensor, normalizer: Union[int, float, torch.Tensor] = 1):
    """A model's `head_loss` for CE alone through the fused head, for evaluation and the probe: CE summed over
    labels != -100 and divided by `normalizer`, in fp32, with autograd when grads are on; no [tokens, V] logits."""
    def ce_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_linear_kd_loss(hidden, weight, labels, None, normalizer, 0.0, 1.0)[0]
    return ce_loss
