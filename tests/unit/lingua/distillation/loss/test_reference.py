"""KD loss math against float64 references: sparse formats, chunking, masking, the sampled estimator."""

import math

import pytest
import torch

from lingua.distillation.args import alpha_at
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from tests.unit.lingua.distillation.loss.logits_kd import kd_loss

V = 11
DIVERGENCES = ["fkl", "rkl", "jsd"]



def _logits(*shape, seed, scale=2.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale


def _divergence64(log_p, log_q, divergence, beta=0.5):
    p, q = log_p.exp(), log_q.exp()
    if divergence == "fkl":
        return (p * (log_p - log_q)).sum(-1)
    if divergence == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (log_p - m.log())).sum(-1) + (1 - beta) * (q * (log_q - m.log())).sum(-1)


def _dense_reference(teacher_logits, student_logits, mask, temperature, divergence, beta=0.5):
    """Mean over masked positions of the exact divergence over the whole vocabulary, in float64."""
    log_p = torch.log_softmax(teacher_logits / temperature, -1)
    log_q = torch.log_softmax(student_logits / temperature, -1)
    per_position = _divergence64(log_p, log_q, divergence, beta)
    return per_position[mask].sum() / mask.sum()


def _bucket_reference(outputs, student_logits, mask, temperature, divergence):
    """The same k-ids + rest objective written the obvious way in float64 (rest = 1 - sum)."""
    p_ids = outputs.values.double().exp()
    p = torch.cat([p_ids, outputs.extra.double().unsqueeze(-1)], -1)
    p = p / p.sum(-1, keepdim=True)
    s = torch.softmax(student_logits / temperature, -1)
    s_ids = s.gather(-1, outputs.ids.long())
    q = torch.cat([s_ids, 1 - s_ids.sum(-1, keepdim=True)], -1)
    per_position = _divergence64(p.log(), q.log(), divergence)
    return per_position[mask].sum() / mask.sum()


def _value_and_grad(student_logits, outputs, mask, temperature, divergence, **kwargs):
    student = student_logits.detach().clone().requires_grad_()
    loss, stats = kd_loss(student, outputs, mask, temperature, divergence, **kwargs)
    (grad,) = torch.autograd.grad(loss, student)
    return loss.detach(), grad, stats


def _reference_value_and_grad(fn, student_logits, *args):
    student = student_logits.detach().clone().requires_grad_()
    value = fn(student, *args)
    (grad,) = torch.autograd.grad(value, student)
    return value.detach(), grad


@pytest.mark.timeout(20)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("k", [V - 1, V])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_topk_covering_vocab_equals_dense(divergence, k, temperature):
    teacher, student = _logits(2, 5, V, seed=0), _logits(2, 5, V, seed=1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    # fp32 wire: the teacher computes in fp32, so agreement with float64 is ~1e-6.
    outputs = sparsify_teacher_logits(teacher, "topk", k, temperature, wire_dtype=torch.float32)
    value, grad, _ = _value_and_grad(student, outputs, mask, temperature, divergence)

    def reference(s):
        return _dense_reference(teacher, s, mask, temperature, divergence)

    ref_value, ref_grad = _reference_value_and_grad(reference, student)
    assert value.item() > 1e-2  # a real divergence, not a trivially matching zero
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_topk_small_k_matches_bucketed_reference(divergence):
    teacher, student = _logits(3, 4, V, seed=2), _logits(3, 4, V, seed=3)
    mask = torch.ones(3, 4, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "topk", 4, 1.5, wire_dtype=torch.float64)
    value, grad, stats = _value_and_grad(student, outputs, mask, 1.5, divergence)
    ref_value, ref_grad = _reference_value_and_grad(
        lambda s: _bucket_reference(outputs, s, mask, 1.5, divergence), student
    )
    torch.testing.assert_close(value, ref_value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)
    # The bucketed objective is a different function from the dense one at k=4.
    dense = _dense_reference(teacher, student, mask, 1.5, divergence)
    assert abs(dense.item() - value.item()) > 1e-3
    assert stats["kd"] == pytest.approx(value.item())


@pytest.mark.timeout(20)
def test_sparsify_topk_values_ids_and_tail():
    teacher = _logits(2, 3, V, seed=4)
    outputs = sparsify_teacher_logits(teacher, "topk", 3, 2.0, wire_dtype=torch.float32)
    log_p = torch.log_softmax(teacher / 2.0, -1)
    ref_values, ref_ids = log_p.topk(3, -1)
    assert outputs.ids.dtype == torch.int32 and outputs.extra.dtype == torch.float32
    assert torch.equal(outputs.ids.long(), ref_ids)
    torch.testing.assert_close(outputs.values.double(), ref_values, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs.extra.double(), 1 - ref_values.exp().sum(-1), rtol=1e-5, atol=1e-7)
    # A tail of 1e-12 would vanish in 1 - sum(top-k) in fp32; the log-sum-exp keeps it.
    peaked = torch.tensor([[[30.0, 30.0, 0.0, 0.0]]], dtype=torch.float64)
    tail = sparsify_teacher_logits(peaked, "topk", 2, 1.0).extra
    expected = 2 * math.exp(-30) / (2 + 2 * math.exp(-30))
    assert tail.item() == pytest.approx(expected, rel=1e-4)
    assert sparsify_teacher_logits(teacher, "topk", V, 1.0).extra.abs().max().item() == 0.0


@pytest.mark.timeout(20)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_full_equals_dense(divergence):
    teacher, student = _logits(2, 3, V, seed=5), _logits(2, 3, V, seed=6)
    mask = torch.ones(2, 3, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "full", 0, 2.0, wire_dtype=torch.float32)
    assert outputs.ids is None and outputs.extra is None
    value, grad, stats = _value_and_grad(student, outputs, mask, 2.0, divergence)
    ref_value, ref_grad = _reference_value_and_grad(
        lambda s: _dense_reference(teacher, s, mask, 2.0, divergence), student
    )
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert stats["teacher_mass"] == 1.0


@pytest.mark.timeout(20)
def test_bf16_wire_is_close_to_exact():
    teacher, student = _logits(2, 5, V, seed=7), _logits(2, 5, V, seed=8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "topk", V - 1, 1.0)
    assert outputs.values.dtype == torch.bfloat16
    value, _, _ = _value_and_grad(student, outputs, mask, 1.0, "fkl")
    ref_value = _dense_reference(teacher, student, mask, 1.0, "fkl")
    # bf16 keeps 8 significant bits of each log-prob: about 0.5% on a KL of this size.
    assert value.item() == pytest.approx(ref_value.item(), rel=2e-2)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("format,divergence", [("topk", "jsd"), ("topk", "rkl"), ("full", "fkl"), ("sampled", "fkl")])
def test_chunked_equals_unchunked(format, divergence):
    teacher, student = _logits(2, 7, V, seed=9), _logits(2, 7, V, seed=10)
    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    outputs = sparsify_teacher_logits(teacher, format, 5, 1.0, generator=torch.Generator().manual_seed(1))
    whole = _value_and_grad(student, outputs, mask, 1.0, divergence, chunk_size=1024)
    chunked = _value_and_grad(student, outputs, mask, 1.0, divergence, chunk_size=3)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-12, atol=1e-14)
    assert chunked[2] == pytest.approx(whole[2], rel=1e-12)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("format", ["topk", "full", "sampled"])
def test_masked_positions_do_not_count(format):
    teacher, student = _logits(2, 6, V, seed=11), _logits(2, 6, V, seed=12)
    labels = torch.arange(12).view(2, 6)
    labels[0, :2] = -100
    labels[1, 4:] = -100
    mask = labels != -100
    outputs = sparsify_teacher_logits(teacher, format, 4, 1.0, wire_dtype=torch.float32,
                                      generator=torch.Generator().manual_seed(2))
    value, grad, stats = _value_and_grad(student, outputs, mask, 1.0, "fkl", chunk_size=5)
    # Garbage at masked positions, even inf, changes nothing.
    perturbed = student.clone()
    perturbed[~mask] = _logits(int((~mask).sum()), V, seed=13) * 100
    perturbed[0, 0, 0] = float("inf")
    value2, grad2, stats2 = _value_and_grad(perturbed, outputs, mask, 1.0, "fkl", chunk_size=5)
    assert torch.equal(value, value2) and torch.equal(grad[mask], grad2[mask])
    assert grad2[~mask].abs().max().item() == 0.0 and grad[mask].abs().max().item() > 0.0
    assert stats == stats2
    # Same as computing on the unmasked positions alone.
    kept = TeacherOutputs.from_tensors(format, [t[mask].unsqueeze(0) for t in outputs.tensors()])
    alone, _, _ = _value_and_grad(student[mask].unsqueeze(0), kept, torch.ones(1, int(mask.sum()), dtype=torch.bool), 1.0, "fkl")
    torch.testing.assert_close(value, alone, rtol=1e-12, atol=1e-14)


@pytest.mark.timeout(20)
def test_sampled_estimator_is_unbiased_for_value_and_gradient():
    draws, S, k, T = 2000, 3, 4, 1.5
    teacher, student = _logits(1, S, V, seed=14, scale=1.0), _logits(1, S, V, seed=15, scale=1.0)
    # Each row of the batch is an independent draw for the same S positions (default bf16 wire).
    outputs = sparsify_teacher_logits(teacher.expand(draws, S, V), "sampled", k, T,
                                      generator=torch.Generator().manual_seed(3))
    mask = torch.ones(draws, S, dtype=torch.bool)
    value, grad, stats = _value_and_grad(student.expand(draws, S, V), outputs, mask, T, "fkl")
    per_draw_grad = grad * draws  # gradient of each draw's own mean over S
    mean_grad, se_grad = per_draw_grad.mean(0), per_draw_grad.std(0) / math.sqrt(draws)

    # Standard error of the value by batch means: 40 groups of 50 draws.
    groups = 40
    group_values = []
    with torch.no_grad():
        for g in range(groups):
            group_mask = torch.zeros(draws, S, dtype=torch.bool)
            group_mask[g * (draws // groups):(g + 1) * (draws // groups)] = True
            group_values.append(kd_loss(student.expand(draws, S, V), outputs, group_mask, T)[0])
    group_values = torch.stack(group_values)
    assert group_values.mean().item() == pytest.approx(value.item(), rel=1e-9)
    se_value = group_values.std() / math.sqrt(groups)

    ref_value, ref_grad = _reference_value_and_grad(
        lambda s: _dense_reference(teacher, s, torch.ones(1, S, dtype=torch.bool), T, "fkl"), student
    )
    # The mean of 2000 i.i.d. draws is normal to a good approximation (CLT); 4.5 standard errors
    # bounds each of the 1 + 33 comparisons with two-sided p < 7e-6, so a true bias-free estimator
    # passes for essentially any seed, while the errors are small enough to catch a real bias.
    assert abs(value - ref_value).item() < 4.5 * se_value.item()
    assert se_value.item() < 0.03 * ref_value.item()
    z_scores = (mean_grad - ref_grad[0]).abs() / se_grad
    assert z_scores.max().item() < 4.5
    assert se_grad.max().item() < 0.05 * ref_grad.abs().max().item()
    # The self-normalised-free design: a temperature mismatch (a genuine bias) is many SEs away.
    wrong = _dense_reference(teacher, student, torch.ones(1, S, dtype=torch.bool), 1.0, "fkl")
    assert abs(wrong - ref_value).item() > 20 * se_value.item()
    assert 0.0 < stats["teacher_mass"] <= 1.0


@pytest.mark.timeout(20)
def test_sampled_outputs_and_stats():
    teacher = _logits(2, 3, V, seed=16)
    outputs = sparsify_teacher_logits(teacher, "sampled", 6, 1.0, wire_dtype=torch.float32,
                                      generator=torch.Generator().manual_seed(4))
    log_p = torch.log_softmax(teacher, -1)
    torch.testing.assert_close(outputs.values.double(), log_p.gather(-1, outputs.ids.long()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs.extra.double(), (log_p.exp() * log_p).sum(-1), rtol=1e-6, atol=1e-6)
    mask = torch.ones(2, 3, dtype=torch.bool)
    _, stats = kd_loss(teacher.clone(), outputs, mask, 1.0)
    unique_mass = [log_p[b, s, outputs.ids[b, s].long().unique()].exp().sum().item() for b in range(2) for s in range(3)]
    assert stats["teacher_mass"] == pytest.approx(sum(unique_mass) / 6, rel=1e-5)
    with pytest.raises(AssertionError, match="forward KL"):  # DistillationArgs.validate() tells the user
        kd_loss(teacher, outputs, mask, 1.0, divergence="rkl")


@pytest.mark.timeout(20)
def test_stats_top1_and_mass():
    teacher = _logits(2, 4, V, seed=17)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    outputs = sparsify_teacher_logits(teacher, "topk", 3, 1.0)
    _, stats = kd_loss(teacher.clone(), outputs, mask, 1.0)
    assert stats["top1_agreement"] == 1.0
    assert stats["teacher_mass"] == pytest.approx((1 - outputs.extra[mask]).mean().item(), rel=1e-6)
    # A student whose argmax is the teacher's least likely id never agrees.
    student = torch.zeros_like(teacher).scatter(-1, teacher.argmin(-1, keepdim=True), 10.0)
    _, stats = kd_loss(student, outputs, mask, 1.0)
    assert stats["top1_agreement"] == 0.0


@pytest.mark.timeout(20)
def test_bf16_student_logits_and_no_grad_path():
    teacher, student = _logits(2, 5, V, seed=18), _logits(2, 5, V, seed=19)
    mask = torch.ones(2, 5, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "topk", 4, 1.0)
    student16 = student.to(torch.bfloat16).requires_grad_()
    loss, _ = kd_loss(student16, outputs, mask, 1.0)
    loss.backward()
    assert loss.dtype == torch.float32 and student16.grad.dtype == torch.bfloat16
    value32, grad32, _ = _value_and_grad(student16.detach().double(), outputs, mask, 1.0, "fkl")
    assert loss.item() == pytest.approx(value32.item(), rel=1e-4)
    torch.testing.assert_close(student16.grad.double(), grad32, rtol=2e-2, atol=1e-4)
    with torch.no_grad():
        no_grad_loss, _ = kd_loss(student16, outputs, mask, 1.0)
    assert no_grad_loss.grad_fn is None and no_grad_loss.item() == loss.item()


@pytest.mark.timeout(20)
def test_backward_scales_with_upstream_and_refuses_second_backward():
    teacher, student = _logits(1, 3, V, seed=20), _logits(1, 3, V, seed=21).requires_grad_()
    mask = torch.ones(1, 3, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "topk", 4, 2.0)
    loss, _ = kd_loss(student, outputs, mask, 2.0)
    total = distillation_loss(torch.tensor(0.0, dtype=torch.float64), loss, alpha=0.25, temperature=2.0)
    (grad,) = torch.autograd.grad(total, student, retain_graph=True)
    _, plain, _ = _value_and_grad(student, outputs, mask, 2.0, "fkl")
    torch.testing.assert_close(grad, 0.25 * 4.0 * plain)
    with pytest.raises(RuntimeError, match="single backward"):
        torch.autograd.grad(total, student)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("format,divergence", [("topk", "fkl"), ("topk", "jsd"), ("sampled", "fkl"), ("full", "rkl")])
def test_kd_weight_scales_each_position(format, divergence):
    """Weighted = sum of w_i * (the loss with position i alone) / count, value, gradient and stats."""
    teacher, student = _logits(1, 6, V, seed=40), _logits(1, 6, V, seed=41)
    outputs = sparsify_teacher_logits(teacher, format, 4, 1.5, wire_dtype=torch.float32,
                                      generator=torch.Generator().manual_seed(42))
    mask = torch.tensor([[True, True, False, True, True, True]])
    kd_weight = torch.tensor([[0.5, 0.0, 0.7, 1.0, 0.25, 0.0]], dtype=torch.float64)
    expected_value, expected_grad, expected_stats = 0.0, torch.zeros_like(student), torch.zeros(3, dtype=torch.float64)
    for i in range(6):
        alone = torch.zeros_like(mask)
        alone[0, i] = True
        value, grad, stats = _value_and_grad(student, outputs, alone, 1.5, divergence)
        w = float(kd_weight[0, i]) * bool(mask[0, i]) / int(mask.sum())
        expected_value, expected_grad = expected_value + w * value, expected_grad + w * grad
        expected_stats += w * torch.tensor([stats["kd"], stats["teacher_mass"], stats["top1_agreement"]])
    dirty = [t.clone() for t in outputs.tensors()]
    dirty[0][kd_weight == 0] = float("nan")  # a weight-0 position's teacher is never read into the loss
    if format != "full":
        dirty[1][kd_weight == 0] = V + 7
    value, grad, stats = _value_and_grad(student, TeacherOutputs.from_tensors(format, dirty), mask, 1.5, divergence,
                                         kd_weight=kd_weight, chunk_size=4)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(torch.tensor([stats["kd"], stats["teacher_mass"], stats["top1_agreement"]],
                                            dtype=torch.float64), expected_stats, rtol=1e-6, atol=1e-7)  # mass: fp32


@pytest.mark.timeout(20)
def test_distillation_loss_and_alpha():
    ce, kd = torch.tensor(2.0), torch.tensor(0.5)
    assert distillation_loss(ce, kd, alpha=0.3, temperature=2.0).item() == pytest.approx(0.7 * 2.0 + 0.3 * 4 * 0.5)
    assert alpha_at(10, 0.5, "constant", 0.2) == 0.5
    assert alpha_at(10, 0.5, "lr", 0.2) == pytest.approx(0.1)
    with pytest.raises(AssertionError, match="cosine"):  # DistillationArgs.validate() names the choices
        alpha_at(10, 0.5, "cosine", 0.2)


@pytest.mark.timeout(20)
def test_bytes_per_token():
    assert TeacherOutputs.bytes_per_token("topk", 64, 49152, torch.bfloat16) == 64 * (2 + 4) + 4 == 388
    assert TeacherOutputs.bytes_per_token("sampled", 64, 49152, torch.bfloat16) == 388
    assert TeacherOutputs.bytes_per_token("topk", 8, 49152, torch.float32) == 8 * 8 + 4
    assert TeacherOutputs.bytes_per_token("full", 64, 49152, torch.bfloat16) == 2 * 49152


@pytest.mark.timeout(20)
@pytest.mark.parametrize("format", ["topk", "sampled", "full"])
@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wire_spec_round_trip(format, wire_dtype):
    B, S, k = 2, 3, 4
    outputs = sparsify_teacher_logits(_logits(B, S, V, seed=22), format, k, 1.0, wire_dtype)
    spec = TeacherOutputs.wire_spec(format, B, S, k, V, wire_dtype)
    assert [(tuple(t.shape), t.dtype) for t in outputs.tensors()] == spec
    per_token = sum(math.prod(shape) * torch.tensor([], dtype=dtype).element_size() for shape, dtype in spec) / (B * S)
    assert per_token == TeacherOutputs.bytes_per_token(format, k, V, wire_dtype)
    # What a receiver does: preallocate from the spec, copy the bytes in, rebuild.
    received = [torch.empty(shape, dtype=dtype) for shape, dtype in spec]
    for buffer, t in zip(received, outputs.tensors()):
        buffer.copy_(t)
    rebuilt = TeacherOutputs.from_tensors(format, received).to("cpu")
    assert rebuilt.format == format
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.tensors(), outputs.tensors()))


@pytest.mark.timeout(20)
def test_readable_errors():
    teacher = _logits(1, 2, V, seed=23)
    mask = torch.ones(1, 2, dtype=torch.bool)
    outputs = sparsify_teacher_logits(teacher, "topk", 3, 1.0)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        sparsify_teacher_logits(teacher, "topk", V + 1, 1.0)
    # Settings a validated config cannot hold are our bugs here (DistillationArgs.validate() tells the user).
    with pytest.raises(AssertionError, match="dense"):
        sparsify_teacher_logits(teacher, "dense", 3, 1.0)
    with pytest.raises(AssertionError, match="kl"):
        kd_loss(teacher, outputs, mask, 1.0, divergence="kl")
    with pytest.raises(AssertionError, match="1.0"):
        kd_loss(teacher, outputs, mask, 1.0, divergence="jsd", jsd_beta=1.0)
    with pytest.raises(ValueError, match="must match"):
        kd_loss(teacher[:, :1], outputs, mask[:, :1], 1.0)
    full = sparsify_teacher_logits(teacher, "full", 0, 1.0)
    with pytest.raises(ValueError, match="same tokenizer"):
        kd_loss(teacher[..., :-1], full, mask, 1.0)
