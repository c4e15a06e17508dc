"""The KD loss of a student's teachers, 1..N: each position's KD term mixed over the teachers that teach it.

    routing = source_routing(args.teachers, active_sources(data.sources))   # [sources, teachers] weights
    weights = mixing_weights(routing, batch["source_ids"], [o.kd_weight for o in outputs], labels.shape)
    loss, ce, per_teacher = teachers_head_loss(hidden, head_weight, labels, outputs, weights, n_valid, alpha, args, uld)

A position of source s takes KD from the teachers that list s in their `sources` (or list none), with weights
w_i / sum of theirs; a cross-tokenizer teacher with no target there (kd_weight 0) leaves the others the whole term,
and a position no teacher teaches takes CE alone. So the loss is (1 - alpha) * CE + alpha * T^2 * sum_i weight_i *
KD_i; a lone teacher's weights are its own kd_weight. The fused loss shares the head GEMMs among the teachers
(`more_teachers`); with vocab_blocks, loss_compile or ULD it runs once per teacher, the first carrying CE and the
others alpha = 1 with kd_weight = alpha * weight (exactly alpha * T^2 * weight * KD, no CE).
"""

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from lingua.args import require
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.loss.reference import kd_loss_and_stats
from lingua.transformer import cross_entropy_sum

REFERENCE_CHUNK_SIZE = 1024  # positions per chunk of kd_loss when distillation.loss_chunk_size=0 (auto)
TEACHER_STATS = ("loss", "teacher_mass", "top1_agreement", "weight", "aligned")  # kd/<i>/<stat>, per teacher


def check_teacher_sources(teachers: list, data_sources: dict) -> None:
    """Every source a teacher lists is one of data.sources."""
    for i, teacher in enumerate(teachers):
        for name in teacher.sources:
            require(name in data_sources, f"distillation.teachers[{i}].sources", teacher.sources,
                    f"{name!r} is not in data.sources ({', '.join(data_sources)}); list the sources this teacher teaches")
        if teacher.sources:  # a teacher of sources that are never read would teach nothing, silently
            require(any(data_sources[name] > 0 for name in teacher.sources), f"distillation.teachers[{i}].sources",
                    teacher.sources, "every source it lists has weight 0 in data.sources, so it would teach nothing; "
                    "list a source that is read, or remove this teacher")


def source_routing(teachers: list, source_names: list[str]) -> torch.Tensor:
    """[sources, teachers]: teacher i's weight for each source it teaches (every source when it lists none), 0
    elsewhere. Not normalised: a position's weights are normalised over the teachers with a target there."""
    table = torch.zeros(len(source_names), len(teachers), dtype=torch.float32)
    for i, teacher in enumerate(teachers):
        for s, name in enumerate(source_names):
            if not teacher.sources or name in teacher.sources:
                table[s, i] = teacher.weight
    return table


def mixing_weights(routing: torch.Tensor, source_ids: torch.Tensor, aligned: list[Optional[torch.Tensor]],
                   shape: tuple[int, int]) -> list[torch.Tensor]:
    """Each teacher's KD weight per position [B, S]: its routing weight for the row's source times its alignment
    (1 without one), normalised over the teachers so that a position's weights add to 1, or are all 0 (CE only)."""
    rows = routing[source_ids.long()]  # [B, teachers]
    raw = [rows[:, i:i + 1].expand(shape) * (1.0 if a is None else a.float()) for i, a in enumerate(aligned)]
    total = torch.stack(raw).sum(0)
    return [torch.where(total > 0, r / torch.where(total > 0, total, 1.0), 0.0) for r in raw]


def teachers_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, outputs: list,
                       weights: list[Optional[torch.Tensor]], n_valid: int, alpha: float, args,
                       uld: Optional[list[bool]] = None):
    """(loss, CE / n_valid, per-teacher stats [teachers, 5] / n_valid: KD, teacher mass, top-1 agreement, each
    weighted by the teacher's weight, then the weight itself and the alignment) of one micro-batch. `weights`: each
    teacher's KD weight per position (None: every position); `uld`: which teachers take ULD."""
    normalizer, valid = max(n_valid, 1), labels != -100
    uld_of = [args.uld_weight if u else 0.0 for u in (uld or [False] * len(outputs))]
    per_teacher, loss = [], None
    if not args.fused_loss:  # the reference: logits, then CE and each teacher's chunked kd_loss
        logits = F.linear(hidden, weight)
        share = valid.sum() / normalizer  # this micro-batch's share of the step's tokens
        ce = cross_entropy_sum(logits, labels) / normalizer
        kd = None
        for teacher, w, uld_weight in zip(outputs, weights, uld_of):
            kd_i, stats = kd_loss_and_stats(logits, teacher, valid, args.temperature, args.divergence, args.jsd_beta,
                                            args.loss_chunk_size or REFERENCE_CHUNK_SIZE, kd_weight=w,
                                            uld_weight=uld_weight, uld_k=args.uld_k)
            kd = kd_i if kd is None else kd + kd_i
            per_teacher.append(stats.double()[:3] * share)
        loss = distillation_loss(ce, kd * share, alpha, args.temperature)
    elif args.loss_weight_grad == "accumulate" and not any(uld_of) and not args.compiles_loss(True, hidden.device):
        loss, sums = fused_linear_kd_loss(hidden, weight, labels, outputs[0], normalizer, alpha, args.temperature,
                                          args.divergence, args.jsd_beta, args.loss_chunk_size, kd_weight=weights[0],
                                          more_teachers=tuple(zip(outputs[1:], weights[1:])))
        sums = sums.double() / normalizer
        ce, per_teacher = sums[0], list(sums[1:].view(-1, 3))
    else:
        for i, (teacher, w, uld_weight) in enumerate(zip(outputs, weights, uld_of)):
            # The first call carries CE; the others add alpha * T^2 * weight * KD (alpha = 1, the weight scaled). At
            # alpha = 0 they add nothing: a pass without gradients still measures their KD, as the first call does.
            measure_only = i > 0 and alpha == 0.0
            with torch.no_grad() if measure_only else contextlib.nullcontext():
                part, sums = fused_linear_kd_loss(hidden, weight, labels, teacher, normalizer,
                                                  alpha if i == 0 else 1.0, args.temperature, args.divergence,
                                                  args.jsd_beta, args.loss_chunk_size,
                                                  kd_weight=w if i == 0 or measure_only else w * alpha,
                                                  weight_grad=args.loss_weight_grad,
                                                  compiled=args.compiles_loss(True, hidden.device),
                                                  uld_weight=uld_weight, uld_k=args.uld_k)
            sums = sums.double() / normalizer
            if i == 0:
                ce = sums[0]
            per_teacher.append(sums[1:] if i == 0 or measure_only else sums[1:] / alpha)
            if not measure_only:
                loss = part if loss is None else loss + part
    extra = [torch.stack([((valid if w is None else w * valid).sum().double() / normalizer),
                          ((1.0 if t.kd_weight is None else t.kd_weight) * valid).sum().double() / normalizer])
             for t, w in zip(outputs, weights)]
    stats = torch.cat([torch.stack(per_teacher).to(hidden.device), torch.stack(extra).to(hidden.device)], dim=1)
    return loss, ce.detach().double(), stats


def teacher_metrics(stats: torch.Tensor, cross: list[bool]) -> dict:
    """kd/<i>/<stat> for each teacher (kd/<i>/aligned for cross-tokenizer teachers only)."""
    out = {}
    for i, row in enumerate(stats.unbind()):
        for name, value in zip(TEACHER_STATS, row.unbind()):
            if name != "aligned" or cross[i]:
                out[f"kd/{i}/{name}"] = value
    return out
