"""The KD loss of a student's teachers, 1..N: each position's KD term mixed over the teachers that teach it.

    routing = source_routing(args.teachers, active_sources(data.sources))   # [sources, teachers] weights
    weights = mixing_weights(routing, batch["source_ids"], [o.kd_weight for o in outputs], labels.shape)
    path = head_loss_path(args)                      # chosen once: fused (default) or research (fused_loss=false)
    loss, stats = teachers_head_loss(path, hidden, head_weight, labels, outputs, weights, n_valid, alpha, args, uld)

A position of source s takes KD from the teachers that list s in their `sources` (or list none), with weights
w_i / sum of theirs; a cross-tokenizer teacher with no target there (kd_weight 0) leaves the others the whole term,
and a position no teacher teaches takes CE alone. So the loss is (1 - alpha) * CE + alpha * T^2 * sum_i weight_i *
KD_i; a lone teacher's weights are its own kd_weight. Both paths (`research.py`, `fused.py`) take the teachers as
a list and give statistics by name, one value per teacher where a statistic is a teacher's.
"""

from typing import Callable, Optional

import torch

from lingua.args import require
from lingua.distillation.loss.fused import fused_head_loss
from lingua.distillation.loss.research import research_head_loss

# kd/<i>/<metric> of each teacher's statistic (one value per teacher in the head loss's statistics)
TEACHER_METRICS = {"kd": "loss", "teacher_mass": "teacher_mass", "top1_agreement": "top1_agreement",
                   "weight": "weight", "aligned": "aligned"}


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


def head_loss_path(args) -> Callable:
    """The loss's path, chosen once: the fused one (closed-form gradients, the default) or the research one (autograd,
    distillation.fused_loss=false). Both take (hidden, weight, labels, teachers, normalizer, alpha, args) and give
    (loss, statistics by name)."""
    return fused_head_loss if args.fused_loss else research_head_loss


def teachers_head_loss(path: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       outputs: list, weights: list[Optional[torch.Tensor]], n_valid: int, alpha: float, args,
                       uld: Optional[list[bool]] = None) -> tuple[torch.Tensor, dict]:
    """(loss, statistics by name / n_valid) of one micro-batch on `path` (`head_loss_path`): "ce", and one value per
    teacher of "kd", "teacher_mass", "top1_agreement" (each weighted by the teacher's weight), "weight" (the
    weight itself) and "aligned" (its alignment). `weights`: each teacher's KD weight per position (None: every
    position); `uld`: which teachers take ULD."""
    normalizer, valid = max(n_valid, 1), labels != -100
    teachers = list(zip(outputs, weights, uld or [False] * len(outputs)))
    loss, stats = path(hidden, weight, labels, teachers, normalizer, alpha, args)
    stats["weight"] = torch.stack([(valid if w is None else w * valid).sum().double() / normalizer for w in weights])
    stats["aligned"] = torch.stack([((1.0 if t.kd_weight is None else t.kd_weight) * valid).sum().double() / normalizer
                                    for t in outputs])
    return loss, {name: value.detach().to(hidden.device) for name, value in stats.items()}


def teacher_metrics(stats: dict, cross: list[bool]) -> dict:
    """kd/<i>/<metric> for each teacher (kd/<i>/aligned for cross-tokenizer teachers only)."""
    out = {}
    for i in range(len(cross)):
        for name, metric in TEACHER_METRICS.items():
            if name != "aligned" or cross[i]:
                out[f"kd/{i}/{metric}"] = stats[name][i]
    return out
