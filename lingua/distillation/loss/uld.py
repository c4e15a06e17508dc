"""Universal Logit Distillation (Boizard et al. 2024) for the mass a cross-tokenizer teacher cannot map.

A cross-tokenizer teacher's top-k ids whose bytes are student tokens become student targets; the probability of
the others (unmapped: several student tokens, part of one, a special token) joins the "rest" bucket, whose total
the KD matches. With `distillation.uld_weight` > 0 each aligned position's KD also matches the rest's *shape*:

    KD += uld_weight * sum_{r < K} | p_u[r] - s_r[r] |        K = distillation.uld_k

    p_u  the teacher's probabilities of its unmapped top-k entries, sorted descending, zero-padded to K
         (normalised like the KD's buckets: by the mapped values plus the tail)
    s_r  the student's K largest probabilities softmax(z / T) among the ids outside the row's k target slots
         (its rest bucket), sorted descending, zero-padded to K

This is ULD's optimal-transport distance between sorted distributions (the 1-D Wasserstein-1 distance with unit
costs between ranks), restricted to the two rest buckets: the mapped mass is matched id by id, the unmapped by
rank. Its subgradient in the student's ranked probabilities is sign(s_r - p_u) (0 at equality), which reaches the
logits through the softmax: d/da_v = sum_r c_r s_r (1[v = j_r] - s_v), c_r = sign(s_r[r] - p_u[r]).

Wire marker (top-k format, cross-tokenizer with ULD): an entry whose id is negative is an unmapped teacher entry.
Its value is the teacher's log-prob; ~id (= -id - 1) is a placeholder student id, distinct from the row's others,
that has no target of its own; its probability is also in the tail, as without ULD. Rows stay sorted most likely
first (the cache's codec relies on it). `split_unmapped` turns such a row back into the plain top-k row and
the sorted p_u.
"""

from typing import Optional

import torch


def split_unmapped(values: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, uld_k: int, dtype: torch.dtype):
    """A marked top-k row [N, k] -> (values with unmapped entries at -inf, student ids [N, k] int64, p_u [N, uld_k]
    in `dtype`): the plain top-k targets the KD reads and the teacher side of ULD (module docstring)."""
    unmapped = ids < 0
    values = values.to(dtype)
    kd_values = torch.where(unmapped, float("-inf"), values)
    student_ids = torch.where(unmapped, ~ids, ids).long()
    # The KD's normaliser (teacher_topk_log_probs): the mapped values plus the tail, which holds the unmapped mass.
    log_total = torch.log(kd_values.exp().sum(-1, keepdim=True) + tail.to(dtype).clamp(0.0, 1.0).unsqueeze(-1))
    probs = torch.where(unmapped, (values - log_total).exp(), 0.0)
    return kd_values, student_ids, sorted_to_width(probs, uld_k)


def sorted_to_width(probs: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` largest of each row, descending, zero-padded when a row has fewer."""
    top = probs.topk(min(width, probs.shape[-1]), dim=-1).values
    return torch.nn.functional.pad(top, (0, width - top.shape[-1]))


def uld_distance(teacher_sorted: torch.Tensor, student_sorted: torch.Tensor, with_sign: bool = False):
    """sum_r |p_u[r] - s_r[r]| per row; with `with_sign` also sign(s_r - p_u), its subgradient in s_r."""
    diff = student_sorted - teacher_sorted
    distance = diff.abs().sum(-1)
    return (distance, diff.sign()) if with_sign else distance


def uld_reference(a: torch.Tensor, ids: torch.Tensor, teacher_sorted: torch.Tensor) -> torch.Tensor:
    """ULD per row from the student's scaled logits a = z / T [N, V] (autograd through the topk's gather) and the
    row's k target ids: the readable version `fused_chunk` computes in closed form."""
    student = torch.softmax(a, dim=-1).scatter(-1, ids, 0.0)  # the rest bucket: ids outside the k target slots
    return uld_distance(teacher_sorted, sorted_to_width(student, teacher_sorted.shape[-1]))


class ChunkULD:
    """ULD inside one fused chunk: the student's side from the rest's top-K logits (the topk that also gives the
    rest's max, so no pass is added to CE's), the value and the three pieces of its gradient in a (module doc)."""

    def __init__(self, teacher_sorted: torch.Tensor, weight: float, rest_width: int):
        self.teacher_sorted, self.weight = teacher_sorted, weight
        self.width = min(teacher_sorted.shape[-1], rest_width)  # the rest may hold fewer than K ids

    def rest_top(self, z: torch.Tensor):
        """(the rest's max [rows, 1], its argmax [rows, 1]) from a topk of z, whose ids are -inf already; keeps the
        top-K logits and their ids."""
        self.top_z, self.top_ids = z.topk(self.width, dim=-1)
        return self.top_z[:, :1], self.top_ids[:, :1]

    def value_and_grads(self, temperature: float, a_lse: torch.Tensor, q_ids: torch.Tensor, a_shift: torch.Tensor,
                        kd_rows: torch.Tensor, kd_scale: torch.Tensor):
        """(weight * ULD per row, its gradient on the k ids [rows, k], its coefficient on exp(a - a_shift) over the
        rest [rows, 1], its gradient at the top-K ids [rows, K']), scaled by kd_scale [rows, 1] as KD is."""
        s_top = (self.top_z / temperature - a_lse).exp()
        student_sorted = torch.nn.functional.pad(s_top, (0, self.teacher_sorted.shape[-1] - self.width))
        distance, sign = uld_distance(self.teacher_sorted, student_sorted, with_sign=True)
        scale = torch.where(kd_rows.unsqueeze(-1), kd_scale * self.weight, 0.0)
        pulled = sign[:, :self.width] * s_top  # c_r s_r
        # Every id's share of the softmax Jacobian: -s_v sum_r c_r s_r (s_v = q on the ids, exp(a - a_lse) elsewhere).
        spread = torch.where(kd_rows.unsqueeze(-1), -scale * pulled.sum(-1, keepdim=True), 0.0)
        return (self.weight * distance, spread * q_ids, spread * (a_shift - a_lse).exp(),
                torch.where(kd_rows.unsqueeze(-1), scale * pulled, 0.0))


def check_uld(uld_weight: float, uld_k: int) -> Optional[str]:
    """None when (uld_weight, uld_k) are usable by the losses, else what is wrong (the configs say it first)."""
    if not (uld_weight >= 0.0 and uld_weight < float("inf")):
        return f"uld_weight={uld_weight} must be a finite weight >= 0 (0 = off)"
    if uld_weight > 0 and uld_k < 1:
        return f"uld_k={uld_k} must be at least 1 (the sorted probabilities compared)"
    return None

