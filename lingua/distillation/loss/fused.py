"""CE + KD fused with the output head: one chunked pass, closed-form gradients, no [N, V] logits.

    loss, stats = fused_linear_kd_loss(hidden, model.output.weight, labels, teacher, n_valid, alpha, T)
    loss = ((1 - alpha) * sum_i CE_i + alpha * T^2 * sum_i KD_i) / normalizer   over positions with label != -100

CE + KD (`research.py`'s numbers) computed as Liger-Kernel's fused linear distillation does: per chunk of rows the
logits z = h W^T are formed in fp32 (a bf16 head's GEMM never rounded to bf16: `chunk.head_logits`), the loss rows and
dLoss/dz written in closed form (`chunk.py`) and dz pushed through the head at once (grad_h = dz W, grad_W += dz^T h,
in fp32). Backward only scales the stored grads: one chunk of fp32 [rows, V] lives at a time and nothing is
recomputed. Masked positions contribute exactly zero, also when their hidden states or teacher tensors are inf/nan
(`where`, never a multiply by the mask); no step reads the device.

Call it where the head would run, inside the model's forward (under FSDP2 the unsharded plain head weight; not a
DTensor or a vocab-sharded head), with `tok_embeddings.weight` when tied; not inside an activation-checkpointed
region. bf16 hidden/weight: bf16 GEMMs into fp32 logits (on CUDA the GEMM's fp32 accumulator, `torch.mm(...,
out_dtype)`; elsewhere the head upcast once per call, an fp32 [V, D]), fp32 loss math and grad_W accumulation,
grads returned in bf16.
"""

import contextlib
import functools
import math
from typing import Optional, Union

import torch

from lingua.distillation.loss.compiled_chunk import compiled_chunk_loss_and_grad
from lingua.distillation.loss.divergences import DIVERGENCES, distillation_loss, kd_rows_and_weights, teacher_support
from lingua.distillation.loss.chunk import GradRecipe, chunk_loss_and_grad, head_logits, vocab_block_weight_grad
from lingua.distillation.outputs import TeacherOutputs, check_format
from lingua.distillation.loss.uld import ChunkULD, split_unmapped

# Auto chunking: rows per chunk so the chunk's fp32 [rows, V] work fits this many bytes. CPU (2 cores, V=49k):
# 113-row chunks cost 1.46x CE's time, 512-row ones 1.08x (every op pays a thread-pool sync); CUDA GEMMs need ~1k+
# rows. A fixed budget, not a share of free memory, keeps chunk boundaries (hence rounding) equal on every rank.
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
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` adds a `dtype` GEMM into fp32 here."""
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
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` keeps a `dtype` GEMM's fp32 accumulator here (CUDA)."""
    if dtype == torch.float32:
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):  # no such overload, or no kernel for this device (NotImplementedError)
        return False


def _fused_pass(hidden, weight, labels, teachers, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                vocab_block, compiled, uld, z_loss, need_grad_hidden, need_grad_weight):
    """(loss, stats, grad_hidden or None, grad_weight or None) of the flattened inputs. teachers: (flat outputs,
    flat kd_weight) each, none for CE alone; the first carries CE (and the z-loss), the others read a copy of the
    chunk's logits. vocab_block > 0: grad_W by `vocab_block_weight_grad`; uld: None or (uld_weight, uld_k), the
    first teacher's; z_loss > 0: z_loss * lse^2 per row joins the loss, its sum the last statistic."""
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    mask = labels != -100
    safe_labels = labels.masked_fill(~mask, 0).long().unsqueeze(-1)
    # 0-dim device tensors built with full (a kernel, not a host copy): the scales stay off the host.
    if not isinstance(normalizer, torch.Tensor):
        normalizer = torch.full((), float(normalizer), dtype=dtype, device=hidden.device)
    inv_norm = 1.0 / normalizer.to(device=hidden.device, dtype=dtype)
    if not teachers:
        alpha = 0.0
    ce_scale, kd_scale = (1.0 - alpha) * inv_norm, alpha * temperature * inv_norm
    no_ce = torch.zeros((), dtype=dtype, device=hidden.device)
    z_coef = 2.0 * z_loss * inv_norm if z_loss > 0 else None  # d/dz of z_loss * lse^2 / normalizer, per softmax
    calls = teachers or [(None, None)]
    stats = torch.zeros(1 + 3 * len(calls) + (z_coef is not None), dtype=dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    # The recipes rebuild dz block by block after the chunks; the full format has none (it accumulates).
    by_blocks = need_grad_weight and vocab_block > 0 and (not teachers or teachers[0][0].format != "full")
    recipes = []
    # fp32 accumulator for a bf16 head: adding bf16 partial sums chunk after chunk would round each time.
    grad_weight = torch.zeros(V, D, dtype=dtype, device=weight.device) if need_grad_weight and not by_blocks else None
    fp32_addmm = need_grad_weight and dtype != weight.dtype and accumulates_in_fp32(weight.device, weight.dtype)
    # fp32 logits from a bf16 head: the GEMM's accumulator where the device writes it out, else the head upcast once.
    fp32_mm = dtype != weight.dtype and multiplies_into_fp32(weight.device, weight.dtype)
    weight_up = weight.to(dtype) if dtype != weight.dtype and not fp32_mm else None
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
        z = head_logits(h, weight, dtype, fp32_mm, weight_up)
        spare = z.clone() if len(calls) > 1 else None  # the chunk math overwrites z: further teachers read a copy
        per_row = []
        for i, (teacher, kd_weight) in enumerate(calls):
            if i > 0:
                z = spare.clone() if i + 1 < len(calls) else spare
            values, ids, extra, row_weight, kd_rows, row_kd_scale, chunk_uld = _chunk_teacher(
                teacher, kd_weight, rows, pad, row_mask, kd_scale, dtype, uld if i == 0 else None, V)
            chunk_teacher = None if teacher is None else (teacher.format, values, extra)
            chunk_args = (pad(safe_labels[rows]), row_mask, chunk_teacher, ids, kd_rows, ce_scale if i == 0 else no_ce,
                          row_kd_scale, temperature, divergence, jsd_beta, z_coef if i == 0 else None)
            if compiled:  # g comes back written over z
                ce, kd, student_top1, g_i, recipe_i, lse = compiled_chunk_loss_and_grad(z, dtype, *chunk_args)
            else:
                ce, kd, student_top1, g_i, recipe_i, lse = chunk_loss_and_grad(z, *chunk_args, uld=chunk_uld)
            if i == 0:
                g, recipe, z_rows = g_i, recipe_i, None if z_coef is None else z_loss * lse**2
                per_row.append(ce)
            else:
                g.add_(g_i)
            if teacher is None:
                per_row += [torch.zeros_like(ce)] * 3
            else:
                mass, teacher_top1 = teacher_support(values, ids, extra, teacher.format)
                agree = (student_top1 == teacher_top1).to(dtype)
                # Sums weighted by the KD weight (where, not multiply: a weight-0 row may be nan).
                per_row += [torch.where(kd_rows, t.to(dtype) * row_weight, 0.0) for t in (kd, mass, agree)]
        if z_coef is not None:
            per_row.append(z_rows)
        stats += torch.where(row_mask, torch.stack(per_row), 0.0).sum(-1)
        z = spare = g_i = None  # g is z's buffer; only g lives on into the grad GEMMs
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
    kd_sum = stats[1] + stats[4:1 + 3 * len(calls):3].sum() if len(calls) > 1 else stats[1]
    loss = distillation_loss(stats[0], kd_sum, alpha, temperature) * inv_norm
    if z_coef is not None:
        loss = loss + stats[-1] * inv_norm
    if by_blocks:
        g = None
        grad_weight = vocab_block_weight_grad(masked_hidden, weight, GradRecipe.cat(recipes), temperature,
                                              vocab_block, dtype, fp32_mm)
    elif grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, stats.float(), grad_hidden, grad_weight


def _chunk_teacher(teacher, kd_weight, rows, pad, row_mask, kd_scale, dtype, uld, vocab_size):
    """A teacher's (values, ids, extra) for the chunk's rows, KD weights and rows, each row's KD scale and ULD side."""
    if teacher is None:
        return None, None, None, None, row_mask, torch.zeros_like(row_mask, dtype=dtype), None
    values, ids, extra = (None if t is None else pad(t[rows]) for t in (teacher.values, teacher.ids, teacher.extra))
    kd_rows, row_weight = kd_rows_and_weights(row_mask, None if kd_weight is None else pad(kd_weight[rows]), dtype)
    chunk_uld = None
    if uld is not None:  # the unmapped entries leave the top-k targets and become ULD's teacher side
        values, ids, teacher_sorted = split_unmapped(values, ids, extra, uld[1], dtype)
        chunk_uld = ChunkULD(torch.where(kd_rows.unsqueeze(-1), teacher_sorted, 0.0), uld[0],
                             vocab_size - ids.shape[-1])
    if ids is not None:
        # A row outside the KD rows may carry any id: 0..k-1 keep gathers in range and the ids distinct.
        ids = torch.where(kd_rows.unsqueeze(-1), ids.long(), torch.arange(ids.shape[-1], device=ids.device))
    return values, ids, extra, row_weight, kd_rows, kd_scale * row_weight, chunk_uld


def _pad_rows(t, extra_rows):
    """t with `extra_rows` rows of zeros (False, id 0) appended: masked rows for a compiled short chunk."""
    if extra_rows == 0:
        return t
    return torch.cat([t, t.new_zeros((extra_rows,) + tuple(t.shape[1:]))])


def flat_teacher(teacher: TeacherOutputs, N: int) -> TeacherOutputs:
    """The teacher's tensors as [N, ...] rows (kd_weight apart)."""
    return TeacherOutputs(teacher.format, teacher.values.reshape(N, teacher.values.shape[-1]),
                          None if teacher.ids is None else teacher.ids.reshape(N, teacher.ids.shape[-1]),
                          None if teacher.extra is None else teacher.extra.reshape(N))


class _FusedLinearKDLoss(torch.autograd.Function):
    """Forward computes the loss and both grads chunk by chunk; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, *args):
        loss, stats, ctx.grad_hidden, ctx.grad_weight = _fused_pass(hidden, weight, *args, ctx.needs_input_grad[0],
                                                                    ctx.needs_input_grad[1])
        ctx.mark_non_differentiable(stats)
        ctx.used, ctx.n_args = False, len(args)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _):
        if ctx.used:
            raise RuntimeError("fused_linear_kd_loss supports a single backward pass; do not backward through it "
                               "twice (retain_graph).")
        ctx.used = True
        # In place: the buffers are ours and needed once, so scaling adds no [V, D] tensor.
        grads = [None if t is None else t.mul_(grad_loss) for t in (ctx.grad_hidden, ctx.grad_weight)]
        ctx.grad_hidden = ctx.grad_weight = None
        return (*grads, *[None] * ctx.n_args)


def _check_args(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                kd_weight, weight_grad, uld_weight, uld_k, compiled, z_loss):
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
    if not (uld_weight >= 0.0 and uld_weight < float("inf")):
        raise ValueError(f"uld_weight={uld_weight} must be a finite weight >= 0 (0 = off).")
    if not (z_loss >= 0.0 and z_loss < float("inf")):
        raise ValueError(f"z_loss={z_loss} must be a finite weight >= 0 (0 = off).")
    if uld_weight > 0 and uld_k < 1:
        raise ValueError(f"uld_k={uld_k} must be at least 1 (the sorted probabilities compared).")
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


def fused_linear_kd_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         teacher: Optional[TeacherOutputs], normalizer: Union[int, float, torch.Tensor], alpha: float,
                         temperature: float, divergence: str = "fkl", jsd_beta: float = 0.5, chunk_size: int = 0,
                         kd_weight: Optional[torch.Tensor] = None, weight_grad: str = "accumulate",
                         compiled: bool = False, uld_weight: float = 0.0, uld_k: int = 16,
                         more_teachers: tuple = (), z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """((1 - alpha) * CE_sum + alpha * T^2 * KD_sum) / normalizer over labels != -100, fused with the head.

    hidden [N, D] or [B, S, D] in weight's dtype; weight [V, D] the output head; labels [N] or [B, S]; teacher:
    `TeacherOutputs` leading with [B, S] or [N], or None for CE alone; normalizer: the step's valid-token count
    (number or 0-dim tensor). chunk_size=0 picks rows per chunk from `AUTO_CHUNK_BYTES`. kd_weight (labels' shape,
    float in [0, 1], None = ones) scales each position's KD; at 0 its teacher tensors are never read.
    weight_grad: "accumulate" sums grad_W in an fp32 [V, D] buffer; "vocab_blocks" writes it one vocabulary block
    at a time after the chunks (one more head GEMM, `VOCAB_BLOCK_BYTES`; the full format accumulates). compiled:
    the chunk math through torch.compile. uld_weight > 0: ULD over uld_k ranks joins each KD row (`uld.py`).
    more_teachers: (TeacherOutputs, kd_weight) of further teachers sharing the head GEMMs (accumulate only).
    z_loss > 0: PaLM's z-loss, z_loss * logsumexp(logits)^2 per position with a label, joins the loss (/ normalizer).

    Returns (loss, stats): loss a scalar in promote(dtype, fp32) with autograd to hidden and weight (one backward);
    stats a detached fp32 tensor of sums over the masked positions: CE, then per teacher (KD, teacher mass covered
    by the support, student argmax == teacher top-1), each weighted by kd_weight (zeros without a teacher), then
    with z_loss > 0 the z-loss's sum.
    """
    _check_args(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
                kd_weight, weight_grad, uld_weight, uld_k, compiled, z_loss)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    N, V = flat_hidden.shape[0], weight.shape[0]
    format = None if teacher is None else teacher.format
    budgets = VOCAB_BLOCK_BYTES if weight_grad == "vocab_blocks" else None
    if chunk_size == 0:
        chunk_size = auto_chunk_rows(V, format, hidden.device, hidden.dtype, budgets)
    # The blocks' [N, block] work matches a chunk's [rows, V]: the same bytes.
    vocab_block = 0 if budgets is None else max(1, min(V, auto_chunk_rows(N, format, hidden.device, hidden.dtype,
                                                                          budgets)))
    if more_teachers:
        assert teacher is not None and weight_grad == "accumulate" and not compiled and not uld_weight, \
            "see more_teachers"
        for other, other_weight in more_teachers:
            _check_args(hidden, weight, labels, other, normalizer, alpha, temperature, divergence, jsd_beta,
                        chunk_size, other_weight, weight_grad, uld_weight, uld_k, compiled, z_loss)
    teachers = [] if teacher is None else [(teacher, kd_weight), *more_teachers]
    teachers = [(flat_teacher(t, N), None if w is None else w.reshape(N)) for t, w in teachers]
    args = (labels.reshape(N), teachers, normalizer, alpha, temperature, divergence, jsd_beta, chunk_size,
            vocab_block, compiled, (uld_weight, uld_k) if uld_weight > 0 else None, z_loss)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearKDLoss.apply(flat_hidden, weight, *args)
    loss, stats, _, _ = _fused_pass(flat_hidden, weight, *args, False, False)
    return loss, stats


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teachers: list,
                    normalizer: int, alpha: float, args) -> tuple[torch.Tensor, dict]:
    """`research.research_head_loss`'s loss and statistics by name (its arguments too), computed fused: one call
    with the teachers sharing the head GEMMs, or with vocab_blocks, loss_compile or ULD one call per teacher, the
    first carrying CE and the others alpha = 1 with kd_weight = alpha * weight (exactly alpha * T^2 * weight * KD)."""
    compiled = args.compiles_loss(bool(teachers), hidden.device)
    if not teachers:
        loss, sums = fused_linear_kd_loss(hidden, weight, labels, None, normalizer, 0.0, 1.0,
                                          chunk_size=args.loss_chunk_size, weight_grad=args.loss_weight_grad,
                                          compiled=compiled, z_loss=args.z_loss)
        # fp32 / n: what a CE-only run has always logged
        return loss, {"ce": sums[0] / normalizer, **_z_stat(sums.double() / normalizer, args)}
    outputs, weights, with_uld = (list(column) for column in zip(*teachers))
    per_teacher, loss = [], None
    if args.loss_weight_grad == "accumulate" and not any(with_uld) and not compiled:
        loss, sums = fused_linear_kd_loss(hidden, weight, labels, outputs[0], normalizer, alpha, args.temperature,
                                          args.divergence, args.jsd_beta, args.loss_chunk_size, kd_weight=weights[0],
                                          more_teachers=tuple(zip(outputs[1:], weights[1:])), z_loss=args.z_loss)
        sums = sums.double() / normalizer
        ce, z, per_teacher = sums[0], _z_stat(sums, args), list(sums[1:1 + 3 * len(teachers)].view(-1, 3))
    else:
        for i, (teacher, w, uld) in enumerate(teachers):
            # At alpha = 0 the further teachers add nothing: a pass without gradients still measures their KD.
            measure_only = i > 0 and alpha == 0.0
            with torch.no_grad() if measure_only else contextlib.nullcontext():
                part, sums = fused_linear_kd_loss(hidden, weight, labels, teacher, normalizer,
                                                  alpha if i == 0 else 1.0, args.temperature, args.divergence,
                                                  args.jsd_beta, args.loss_chunk_size,
                                                  kd_weight=w if i == 0 or measure_only else w * alpha,
                                                  weight_grad=args.loss_weight_grad, compiled=compiled,
                                                  uld_weight=args.uld_weight if uld else 0.0, uld_k=args.uld_k,
                                                  z_loss=args.z_loss if i == 0 else 0.0)
            sums = sums.double() / normalizer
            if i == 0:
                ce, z = sums[0], _z_stat(sums, args)
            per_teacher.append(sums[1:4] if i == 0 or measure_only else sums[1:4] / alpha)
            if not measure_only:
                loss = part if loss is None else loss + part
    columns = torch.stack(per_teacher).unbind(-1)
    return loss, {"ce": ce, **z, **dict(zip(("kd", "teacher_mass", "top1_agreement"), columns))}


def _z_stat(sums: torch.Tensor, args) -> dict:
    """{"z": the z-loss's sum (the statistics' last)} when it is on, else nothing."""
    return {"z": sums[-1]} if args.z_loss > 0 else {}


def fused_ce_head(labels: torch.Tensor, normalizer: Union[int, float, torch.Tensor] = 1):
    """A model's `head_loss` for CE alone through the fused head (evaluation, the probe): CE summed over labels
    != -100 and divided by `normalizer`, in fp32, with autograd when grads are on; no [tokens, V] logits."""
    def ce_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_linear_kd_loss(hidden, weight, labels, None, normalizer, 0.0, 1.0)[0]
    return ce_loss
