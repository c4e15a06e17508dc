"""The KD term alone on student logits, for the tests: `kd_loss`, the research path (`research.py`) with the logits as its hidden
states and the identity as its head, for checks against published formulas (TRL, the sampled estimator's
expectation). Per format (`research.chunk_loss` computes it through `divergences.py`):

    topk     exact divergence between k+1 buckets (the ids, plus "rest"), the teacher's renormalised in fp32.
    sampled  RS-KD's Monte-Carlo forward KL: with x_1..x_k ~ p_T, KL(p_T || s_T) ~= extra - (1/k) sum_j log s_T(x_j),
             unbiased in value and gradient; the proposal is p_T itself, so the importance weights are exactly 1
             (a sharper p_T^beta would need its normaliser on the student). Reverse KL and JSD have no unbiased
             estimator from samples of p_T: refused. Unmapped cross-tokenizer draws (-1) add nothing.
    full     exact divergence over the vocabulary.
    uld      (cross-tokenizer top-k, uld_weight > 0) plus uld_weight times `uld.uld_reference`.
"""
from types import SimpleNamespace
from typing import Optional

import torch

from lingua.distillation.loss.divergences import DIVERGENCES
from lingua.distillation.loss.research import research_head_loss
from lingua.distillation.outputs import TeacherOutputs, check_format


def kd_loss_and_stats(student_logits: torch.Tensor, teacher: TeacherOutputs, mask: torch.Tensor, temperature: float,
                      divergence: str = "fkl", jsd_beta: float = 0.5, chunk_size: int = 1024,
                      kd_weight: Optional[torch.Tensor] = None, uld_weight: float = 0.0,
                      uld_k: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over masked positions of D(teacher || student) on the teacher's support (see module doc), and its stats.

    student_logits [B, S, V] (any float dtype; math in fp32), mask [B, S] (pass `labels != -100` so KD counts the
    same positions as CE), temperature as used on the teacher. Returns (loss scalar with grad, stats): a detached
    device tensor [kd, teacher_mass (teacher probability covered by the support), top1_agreement (the student's
    argmax is the teacher's top-1 id; for "sampled" the most likely sampled id)]. kd_weight [B, S] (float in [0, 1],
    None = all ones) multiplies each position's divergence, mass and agreement; the mean still divides by the
    masked count, and a weight-0 position's teacher tensors may hold anything (inf/nan too). uld_weight > 0:
    cross-tokenizer top-k with marked unmapped entries (`uld.py`); uld_k sorted ranks compared.
    """
    # The settings come from a validated DistillationArgs (which explains each rule); a bad one here is our bug.
    check_format(teacher.format)
    assert divergence in DIVERGENCES, divergence
    assert teacher.format != "sampled" or divergence == "fkl", "sampled outputs only estimate the forward KL"
    assert divergence != "jsd" or 0.0 < jsd_beta < 1.0, jsd_beta
    assert temperature > 0 and chunk_size >= 1, (temperature, chunk_size)
    assert uld_weight == 0 or (teacher.format == "topk" and uld_k >= 1), (uld_weight, uld_k)
    B, S, V = student_logits.shape
    if tuple(teacher.values.shape[:2]) != (B, S) or tuple(mask.shape) != (B, S):
        raise ValueError(f"Teacher outputs {tuple(teacher.values.shape)} and mask {tuple(mask.shape)} must match the student's [B, S] = [{B}, {S}].")
    if kd_weight is not None and tuple(kd_weight.shape) != (B, S):
        raise ValueError(f"kd_weight {tuple(kd_weight.shape)} must match the student's [B, S] = [{B}, {S}].")
    if teacher.format == "full" and teacher.values.shape[-1] != V:
        raise ValueError(f"Teacher vocabulary {teacher.values.shape[-1]} differs from the student's {V}; both must use the same tokenizer.")
    settings = SimpleNamespace(temperature=temperature, divergence=divergence, jsd_beta=jsd_beta,
                               loss_chunk_size=chunk_size, uld_weight=uld_weight, uld_k=uld_k, z_loss=0.0)
    # KD alone (alpha = 1, no T^2), its mean over the masked positions: labels only mark them.
    labels = torch.where(mask.bool(), 0, -100)
    identity = torch.eye(V, dtype=student_logits.dtype, device=student_logits.device)
    count = mask.sum().clamp_min(1)
    loss, stats = research_head_loss(student_logits, identity, labels, [(teacher, kd_weight, uld_weight > 0)], count,
                                     1.0, settings)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    return loss / temperature**2, torch.cat([stats[name] for name in ("kd", "teacher_mass", "top1_agreement")]).to(dtype)


def kd_loss(*args, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """`kd_loss_and_stats` with its stats read to the host (a sync: the trainer uses the former) as a dict of floats:
    kd, teacher_mass, top1_agreement."""
    loss, stats = kd_loss_and_stats(*args, **kwargs)
    return loss, dict(zip(("kd", "teacher_mass", "top1_agreement"), stats.tolist()))
