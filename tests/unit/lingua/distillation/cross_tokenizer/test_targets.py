"""The teacher's top-k in student ids: masses of teacher ids that map to one student id add up, unmapped mass joins
the rest bucket, rows keep distinct ids, unaligned positions weigh 0; and the losses take the result. The sampled
format: draws from the mapped distribution, unmapped draws as id -1, and the estimator unbiased for the mapped part."""

import torch

from lingua.distillation.cross_tokenizer.targets import (
    map_topk_rows,
    sample_student_ids,
    student_sampled_targets,
    student_topk_targets,
)
from lingua.distillation.cross_tokenizer.vocab_map import VocabMap
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from lingua.distillation.loss.fused import fused_linear_kd_loss
from tests.unit.lingua.distillation.loss.logits_kd import kd_loss


def random_map(teacher_vocab: int, student_vocab: int, generator) -> VocabMap:
    """A third of the teacher ids unmapped, the rest onto a few student ids (so many collide)."""
    table = torch.randint(0, student_vocab, (teacher_vocab,), generator=generator)
    table[torch.rand(teacher_vocab, generator=generator) < 1 / 3] = -1
    return VocabMap(table, student_vocab)


def dense_student_probs(teacher_log_probs: torch.Tensor, vocab_map: VocabMap) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every teacher id's probability added onto its student id; unmapped ones summed apart."""
    probs = teacher_log_probs.double().exp()
    mapped = vocab_map.teacher_to_student >= 0
    dense = torch.zeros(probs.shape[0], vocab_map.student_vocab_size, dtype=torch.float64)
    dense.index_add_(1, vocab_map.teacher_to_student[mapped], probs[:, mapped])
    return dense, probs[:, ~mapped].sum(-1)


def test_full_support_matches_the_dense_mapping():
    """With k = the teacher's vocabulary the mapped rows are exactly the dense mapping (in float32)."""
    generator = torch.Generator().manual_seed(0)
    Vt, Vs = 40, 60
    vocab_map = random_map(Vt, Vs, generator)
    logits = torch.randn(6, Vt, generator=generator) * 3
    log_probs = torch.log_softmax(logits, -1)
    values, ids = log_probs.topk(Vt, -1)
    out_values, out_ids, rest = map_topk_rows(values, ids.int(), torch.zeros(6), vocab_map)
    dense, unmapped = dense_student_probs(log_probs, vocab_map)
    for row in range(6):
        got = torch.zeros(Vs, dtype=torch.float64)
        finite = out_values[row].isfinite()
        got[out_ids[row][finite].long()] = out_values[row][finite].double().exp()
        torch.testing.assert_close(got, dense[row], atol=1e-6, rtol=1e-5)
        assert out_ids[row].unique().numel() == Vt  # distinct ids, padding included
        assert (out_values[row][finite].diff() <= 0).all()  # most likely first
    torch.testing.assert_close(rest.double(), unmapped, atol=1e-6, rtol=1e-5)


def test_topk_mass_is_conserved_and_ids_distinct():
    """Top-k (k < V): the mapped mass plus the new rest is the teacher's mass (top-k plus its tail)."""
    generator = torch.Generator().manual_seed(1)
    vocab_map = random_map(500, 300, generator)
    outputs = sparsify_teacher_logits(torch.randn(4, 7, 500, generator=generator) * 2, "topk", k=16, temperature=1.0,
                                      wire_dtype=torch.float32)
    values, ids, tail = outputs.values.view(-1, 16), outputs.ids.view(-1, 16), outputs.extra.view(-1)
    out_values, out_ids, rest = map_topk_rows(values, ids, tail, vocab_map)
    torch.testing.assert_close(out_values.exp().sum(-1) + rest, values.exp().sum(-1) + tail)
    assert all(row.unique().numel() == 16 for row in out_ids)
    assert ((out_ids >= 0) & (out_ids < 300)).all()
    unmapped = vocab_map.teacher_to_student[ids.long()] < 0
    torch.testing.assert_close(rest, tail + torch.where(unmapped, values.exp(), 0.0).sum(-1))


def test_student_targets_weights_and_the_loss():
    """kd_weight is 1 where a source exists; the rows follow their source; the reference loss over the aligned
    positions is finite and the unaligned placeholders are finite too."""
    generator = torch.Generator().manual_seed(2)
    Vt, Vs, k = 200, 120, 8
    vocab_map = random_map(Vt, Vs, generator)
    teacher = sparsify_teacher_logits(torch.randn(1, 9, Vt, generator=generator), "topk", k=k, temperature=1.0)
    source = torch.tensor([[0, -1, 3, 4], [-1, 8, 8, 2]])
    outputs, kd_weight = student_topk_targets(teacher, source, vocab_map)
    assert outputs.format == "topk" and outputs.values.shape == (2, 4, k) and outputs.extra.shape == (2, 4)
    assert kd_weight.tolist() == [[1, 0, 1, 1], [0, 1, 1, 1]] and kd_weight.dtype == torch.float32
    torch.testing.assert_close(outputs.values[1, 1], outputs.values[1, 2])  # the same teacher row twice
    direct = map_topk_rows(teacher.values.view(-1, k)[[3]], teacher.ids.view(-1, k)[[3]], teacher.extra.view(-1)[[3]],
                           vocab_map)
    assert torch.equal(outputs.ids[0, 2], direct[1][0])
    assert outputs.values[0, 1].float().isfinite().all() and outputs.extra.isfinite().all()
    student_logits = torch.randn(2, 4, Vs, generator=generator, requires_grad=True)
    loss, stats = kd_loss(student_logits, outputs, kd_weight.bool(), temperature=1.0)
    loss.backward()
    assert torch.isfinite(loss) and student_logits.grad.isfinite().all()
    assert 0.0 < stats["teacher_mass"] <= 1.0


def test_an_empty_teacher_leaves_every_position_unaligned():
    empty = TeacherOutputs("topk", torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0))
    outputs, kd_weight = student_topk_targets(empty, torch.full((1, 3), -1), VocabMap(torch.arange(10), 10))
    assert kd_weight.sum() == 0 and outputs.values.float().isfinite().all()


def test_the_fused_loss_takes_the_targets_with_their_weights():
    """The fused loss with kd_weight equals CE everywhere plus the reference KD over the aligned positions only,
    and an unaligned position's placeholder changes nothing."""
    generator = torch.Generator().manual_seed(3)
    Vt, Vs, k, D, alpha = 150, 90, 8, 16, 0.5
    vocab_map = random_map(Vt, Vs, generator)
    teacher = sparsify_teacher_logits(torch.randn(1, 12, Vt, generator=generator) * 2, "topk", k=k, temperature=1.0,
                                      wire_dtype=torch.float32)
    source = torch.tensor([[0, 1, -1, 3, -1, 5], [6, -1, -1, 9, 10, 11]])
    outputs, kd_weight = student_topk_targets(teacher, source, vocab_map, wire_dtype=torch.float32)
    hidden = torch.randn(2, 6, D, generator=generator, dtype=torch.float64)
    head = torch.randn(Vs, D, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, Vs, (2, 6), generator=generator)
    loss, _ = fused_linear_kd_loss(hidden, head, labels, outputs, 12, alpha, 1.0, kd_weight=kd_weight)
    logits = hidden @ head.T
    ce = torch.nn.functional.cross_entropy(logits.view(-1, Vs), labels.view(-1), reduction="sum")
    kd_mean, _ = kd_loss(logits, outputs, kd_weight.bool(), temperature=1.0)
    expected = ((1 - alpha) * ce + alpha * kd_mean * kd_weight.sum()) / 12
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    garbage = TeacherOutputs("topk", torch.where(kd_weight.bool().unsqueeze(-1), outputs.values, float("nan")),
                             outputs.ids, torch.where(kd_weight.bool(), outputs.extra, float("nan")))
    loss_garbage, _ = fused_linear_kd_loss(hidden, head, labels, garbage, 12, alpha, 1.0, kd_weight=kd_weight)
    torch.testing.assert_close(loss_garbage, loss)


def test_sampled_draws_follow_the_mapped_distribution():
    """The draws' frequencies are the dense mapping's (unmapped: id -1, value -inf), each drawn id's value is its
    summed log-prob, and extra is the mapped part's sum p log(p / M), all at the temperature."""
    generator = torch.Generator().manual_seed(4)
    Vt, Vs, k, T = 30, 20, 20_000, 2.0
    vocab_map = random_map(Vt, Vs, generator)
    logits = torch.randn(3, Vt, generator=generator) * 3
    drawn = sample_student_ids(logits.view(1, 3, Vt), k, T, vocab_map, torch.float32, generator)
    assert drawn.format == "sampled" and drawn.ids.shape == (1, 3, k) and drawn.extra.shape == (1, 3)
    dense, unmapped = dense_student_probs(torch.log_softmax(logits / T, -1), vocab_map)
    ids, values = drawn.ids.view(3, k).long(), drawn.values.view(3, k)
    for row in range(3):
        counts = torch.bincount(ids[row] + 1, minlength=Vs + 1).double() / k  # column 0: the unmapped draws
        torch.testing.assert_close(counts, torch.cat([unmapped[row:row + 1], dense[row]]), atol=0.015, rtol=0)
        mapped = ids[row] >= 0
        torch.testing.assert_close(values[row][mapped].double(), dense[row][ids[row][mapped]].log())
        assert (values[row][~mapped] == float("-inf")).all()
    mass = dense.sum(-1, keepdim=True)
    expected = torch.special.xlogy(dense, dense / mass).sum(-1)
    torch.testing.assert_close(drawn.extra.view(3).double(), expected, rtol=1e-5, atol=1e-6)


def test_student_sampled_targets_follow_their_source():
    generator = torch.Generator().manual_seed(5)
    vocab_map = random_map(50, 40, generator)
    drawn = sample_student_ids(torch.randn(1, 9, 50, generator=generator), 6, 1.0, vocab_map, torch.float32,
                               generator)
    source = torch.tensor([[0, -1, 3], [8, 8, -1]])
    outputs, kd_weight = student_sampled_targets(drawn, source, torch.float32)
    assert kd_weight.tolist() == [[1, 0, 1], [1, 1, 0]]
    assert torch.equal(outputs.ids[1, 0], drawn.ids[0, 8]) and torch.equal(outputs.ids[1, 1], drawn.ids[0, 8])
    assert torch.equal(outputs.values[0, 2], drawn.values[0, 3]) and outputs.extra[0, 2] == drawn.extra[0, 3]
    # An unaligned position: k unmapped draws, extra 0 (a KD of exactly 0); an empty teacher: all unaligned.
    assert (outputs.ids[0, 1] == -1).all() and (outputs.values[0, 1] == float("-inf")).all()
    assert outputs.extra[0, 1] == 0
    empty = TeacherOutputs("sampled", torch.zeros(0, 6), torch.zeros(0, 6, dtype=torch.int32), torch.zeros(0))
    outputs, kd_weight = student_sampled_targets(empty, torch.full((1, 3), -1))
    assert kd_weight.sum() == 0 and (outputs.ids == -1).all()


def sampled_case(seed: int, k: int, T: float):
    """Cross-tokenizer sampled targets for 2 x 6 student positions (two unaligned) of a random teacher and map."""
    generator = torch.Generator().manual_seed(seed)
    Vt, Vs = 60, 40
    vocab_map = random_map(Vt, Vs, generator)
    teacher_logits = torch.randn(1, 12, Vt, generator=generator) * 2
    drawn = sample_student_ids(teacher_logits, k, T, vocab_map, torch.float32, generator)
    source = torch.tensor([[0, 1, -1, 3, 4, 5], [6, -1, 8, 9, 10, 11]])
    outputs, kd_weight = student_sampled_targets(drawn, source, torch.float32)
    return outputs, kd_weight, teacher_logits, source, vocab_map, generator


def test_the_fused_loss_on_mapped_sampled_targets_equals_the_reference():
    """Value and gradients (float64, T = 1 and T = 2) of the fused loss on mapped draws (unmapped ones included)
    equal CE plus the reference loss's KD over the aligned positions."""
    for T in (1.0, 2.0):
        outputs, kd_weight, _, _, _, generator = sampled_case(6, k=16, T=T)
        assert (outputs.ids[kd_weight.bool()] == -1).any()  # the case has unmapped draws
        D, Vs, alpha = 8, 40, 0.5
        hidden = torch.randn(2, 6, D, generator=generator, dtype=torch.float64, requires_grad=True)
        head = torch.randn(Vs, D, generator=generator, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, Vs, (2, 6), generator=generator)
        loss, _ = fused_linear_kd_loss(hidden, head, labels, outputs, 12, alpha, T, kd_weight=kd_weight)
        grads = torch.autograd.grad(loss, (hidden, head))
        logits = hidden @ head.T
        ce = torch.nn.functional.cross_entropy(logits.view(-1, Vs), labels.view(-1), reduction="sum")
        kd_mean, _ = kd_loss(logits, outputs, kd_weight.bool(), temperature=T)
        expected = ((1 - alpha) * ce + alpha * T**2 * kd_mean * kd_weight.sum()) / 12
        torch.testing.assert_close(loss, expected, rtol=1e-7, atol=1e-9)
        for got, want in zip(grads, torch.autograd.grad(expected, (hidden, head))):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_the_sampled_estimate_is_unbiased_for_the_mapped_part():
    """With many draws the reference loss approaches M * KL(p / M || q) of the exact mapped distribution p (mass M)
    per aligned position, and its gradient the exact one: M q - p."""
    outputs, kd_weight, teacher_logits, source, vocab_map, generator = sampled_case(7, k=50_000, T=1.0)
    student_logits = torch.randn(2, 6, 40, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = kd_weight.bool()
    estimate, _ = kd_loss(student_logits, outputs, mask, temperature=1.0)
    (estimate_grad,) = torch.autograd.grad(estimate, student_logits)
    dense, _ = dense_student_probs(torch.log_softmax(teacher_logits.view(12, -1), -1), vocab_map)
    p = dense[source.clamp_min(0)][mask]  # [aligned, Vs]
    M = p.sum(-1, keepdim=True)
    log_q = torch.log_softmax(student_logits.detach()[mask], -1)
    exact = (torch.special.xlogy(p, p / M) - p * log_q).sum(-1).mean()
    torch.testing.assert_close(estimate.detach(), exact, atol=0.02, rtol=0)
    exact_grad = (M * log_q.exp() - p) / mask.sum()
    torch.testing.assert_close(estimate_grad[mask], exact_grad, atol=2e-3, rtol=0)
