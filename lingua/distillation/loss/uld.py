"""Universal Logit Distillation (Boizard et al. 2024) for the mass a cross-tokenizer teacher cannot map.

A teacher's top-k ids that are student tokens become student targets; the others' probability (unmapped) joins the
"rest" bucket, whose total the KD matches. With `distillation.uld_weight` > 0 each KD row also matches its shape:

    KD += uld_weight * sum_{r < K} | p_u[r] - s_r[r] |        K = distillation.uld_k

p_u: the teacher's unmapped probabilities, sorted descending, zero-padded to K (normalised like the KD's buckets);
s_r: the student's K largest probabilities softmax(z / T) outside the row's k target slots, sorted likewise. This
is ULD's optimal-transport distance between sorted distributions restricted to the rest buckets; its subgradient
reaches the logits through the softmax: d/da_v = sum_r c_r s_r (1[v = j_r] - s_v), c_r = sign(s_r[r] - p_u[r]).

Wire marker (top-k): an entry with a negative id is unmapped; its value is the teacher's log-prob and ~id a
placeholder student id distinct from the row's others. Rows stay sorted most likely first (the cache's codec
relies on it); their mass is in the tail too, as without ULD.
"""

import torch


def split_unmapped(values: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, uld_k: int, dtype: torch.dtype):
    """Marked top-k rows [N, k] -> (values, unmapped ones at -inf; student ids int64; p_u [N, uld_k] in `dtype`)."""
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


def uld_reference(a: torch.Tensor, ids: torch.Tensor, teacher_sorted: torch.Tensor) -> torch.Tensor:
    """ULD per row from the scaled logits a = z / T [N, V] (autograd) and the k target ids: what `ChunkULD` computes
    in closed form."""
    student = torch.softmax(a, dim=-1).scatter(-1, ids, 0.0)  # the rest bucket: ids outside the k target slots
    return (sorted_to_width(student, teacher_sorted.shape[-1]) - teacher_sorted).abs().sum(-1)


class ChunkULD:
    """ULD inside one fused chunk: the student's side from the rest's top-K logits (the topk that also gives the
    rest's max, so CE's passes stay five) and the pieces of its gradient."""

    def __init__(self, teacher_sorted: torch.Tensor, weight: float, rest_width: int):
        self.teacher_sorted, self.weight = teacher_sorted, weight
        self.width = min(teacher_sorted.shape[-1], rest_width)  # the rest may hold fewer than K ids

    def rest_top(self, z: torch.Tensor):
        """(the rest's max, its argmax) [rows, 1] from a topk of z (ids at -inf already), whose top-K it keeps."""
        self.top_z, self.top_ids = z.topk(self.width, dim=-1)
        return self.top_z[:, :1], self.top_ids[:, :1]

    def value_and_grads(self, temperature: float, a_lse: torch.Tensor, q_ids: torch.Tensor, a_shift: torch.Tensor,
                        kd_rows: torch.Tensor, kd_scale: torch.Tensor):
        """(weight * ULD per row, its gradient on the k ids [rows, k], its coefficient on exp(a - a_shift) over the
        rest [rows, 1], its gradient at the top-K ids [rows, K']), scaled by kd_scale [rows, 1] as KD is."""
        s_top = (self.top_z / temperature - a_lse).exp()
        student_sorted = torch.nn.functional.pad(s_top, (0, self.teacher_sorted.shape[-1] - self.width))
        diff = student_sorted - self.teacher_sorted
        distance, sign = diff.abs().sum(-1), diff.sign()  # sign(s_r - p_u): the subgradient in s_r
        scale = torch.where(kd_rows.unsqueeze(-1), kd_scale * self.weight, 0.0)
        pulled = sign[:, :self.width] * s_top  # c_r s_r
        # Every id's share of the softmax Jacobian: -s_v sum_r c_r s_r (s_v = q on the ids, exp(a - a_lse) elsewhere).
        spread = torch.where(kd_rows.unsqueeze(-1), -scale * pulled.sum(-1, keepdim=True), 0.0)
        return (self.weight * distance, spread * q_ids, spread * (a_shift - a_lse).exp(),
                torch.where(kd_rows.unsqueeze(-1), scale * pulled, 0.0))
