"""The fused path against the research path, in float64: loss, both gradients and every statistic by name, for CE
alone, every format and divergence, several teachers with their weights, cross-tokenizer weights and ULD. A term
promoted to the fused path with a wrong gradient fails here (docs/research_loss.md)."""

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.cross_tokenizer.targets import map_topk_rows
from lingua.distillation.loss.fused import fused_head_loss
from lingua.distillation.loss.research import research_head_loss
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from tests.unit.lingua.distillation.loss.test_uld import _vocab_map

B, S, D, V, K, TEACHER_V = 2, 7, 6, 17, 5, 24
FORMATS = [("topk", "fkl"), ("topk", "rkl"), ("topk", "jsd"), ("sampled", "fkl"), ("full", "fkl"), ("full", "rkl"),
           ("full", "jsd")]



def problem(seed: int):
    """(hidden, head, labels with some ignored) in float64; the generator for the teachers."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    head = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.8
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 1::3] = -100
    return hidden, head, labels, g


def teacher(kind: str, hidden, head, g, temperature: float) -> TeacherOutputs:
    """A teacher correlated with the student (so top-1s agree now and then); "cross"/"cross_uld": a top-k teacher
    of another tokenizer mapped onto the student's ids, with a per-position KD weight."""
    if not kind.startswith("cross"):
        logits = hidden @ head.T + torch.randn(B, S, V, generator=g, dtype=torch.float64)
        return sparsify_teacher_logits(logits, kind, K, temperature, wire_dtype=torch.float32, generator=g)
    logits = torch.randn(B, S, TEACHER_V, generator=g, dtype=torch.float64) * 2
    out = sparsify_teacher_logits(logits, "topk", K, temperature, wire_dtype=torch.float32)
    values, ids, rest = map_topk_rows(out.values.view(B * S, K), out.ids.view(B * S, K), out.extra.view(B * S),
                                      _vocab_map(3, TEACHER_V, V), kind == "cross_uld")
    kd_weight = (torch.rand(B, S, generator=g) > 0.3).float()
    return TeacherOutputs("topk", values.view(B, S, K), ids.view(B, S, K), rest.view(B, S), kd_weight=kd_weight)


def both_paths(hidden, head, labels, teachers, alpha, args):
    """[(loss, (grad hidden, grad head), stats)] of the fused path, then of the research path."""
    out = []
    for path in (fused_head_loss, research_head_loss):
        h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        loss, stats = path(h, w, labels, teachers, max(int((labels != -100).sum()), 1), alpha, args)
        out.append((loss.detach(), torch.autograd.grad(loss, (h, w)), stats))
    return out


def assert_same(fused, research, stats_rtol=1e-6):
    """Equal to float64's rounding of two implementations (the fused statistics come back in fp32)."""
    (loss_f, grads_f, stats_f), (loss_r, grads_r, stats_r) = fused, research
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads_f, grads_r):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert list(stats_f) == list(stats_r)  # the same names, in the same order
    for name in stats_f:
        torch.testing.assert_close(stats_f[name].double(), stats_r[name], rtol=stats_rtol, atol=1e-7, msg=name)


@pytest.mark.parametrize("weight_grad", ["accumulate", "vocab_blocks"])
def test_ce_alone(weight_grad):
    hidden, head, labels, _ = problem(0)
    fused, research = both_paths(hidden, head, labels, [], 0.0,
                                 DistillationArgs(loss_chunk_size=4, loss_weight_grad=weight_grad))
    assert_same(fused, research)
    assert list(research[2]) == ["ce"]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("format,divergence", FORMATS)
def test_every_format_and_divergence(format, divergence, temperature):
    hidden, head, labels, g = problem(1)
    args = DistillationArgs(temperature=temperature, divergence=divergence, loss_chunk_size=4)
    outputs = teacher(format, hidden, head, g, temperature)
    fused, research = both_paths(hidden, head, labels, [(outputs, None, False)], 0.4, args)
    assert_same(fused, research)
    assert list(research[2]) == ["ce", "kd", "teacher_mass", "top1_agreement"]
    assert research[2]["kd"].shape == (1,) and research[2]["kd"].item() > 0


@pytest.mark.parametrize("weight_grad", ["accumulate", "vocab_blocks"])
def test_several_teachers_with_their_weights(weight_grad):
    """Three teachers mixed per position (weights in [0, 1], one of them 0 on some rows): each one's KD by name."""
    hidden, head, labels, g = problem(2)
    args = DistillationArgs(temperature=1.5, loss_chunk_size=3, loss_weight_grad=weight_grad)
    teachers = [(teacher(kind, hidden, head, g, 1.5), torch.rand(B, S, generator=g, dtype=torch.float64), False)
                for kind in ("topk", "sampled", "topk")]
    teachers[2][1][1] = 0.0
    fused, research = both_paths(hidden, head, labels, teachers, 0.3, args)
    assert_same(fused, research)
    assert research[2]["kd"].shape == (3,)


@pytest.mark.parametrize("kind,uld_weight", [("cross", 0.0), ("cross_uld", 0.5)])
def test_cross_tokenizer_weights_and_uld(kind, uld_weight):
    hidden, head, labels, g = problem(3)
    args = DistillationArgs(temperature=1.5, loss_chunk_size=4, uld_weight=uld_weight, uld_k=3)
    outputs = teacher(kind, hidden, head, g, 1.5)
    fused, research = both_paths(hidden, head, labels, [(outputs, outputs.kd_weight, uld_weight > 0)], 0.4, args)
    assert_same(fused, research)


def test_a_masked_row_holding_inf_or_nan_reaches_nothing():
    """Hidden states and teacher tensors at ignored positions may hold anything: the research path's loss, grads
    and statistics are those of clean inputs there."""
    hidden, head, labels, g = problem(4)
    outputs = teacher("topk", hidden, head, g, 1.0)
    args = DistillationArgs(loss_chunk_size=4)
    clean = research_head_loss(hidden, head, labels, [(outputs, None, False)], 9, 0.5, args)
    dirty_hidden = hidden.clone()
    dirty_hidden[labels == -100] = float("nan")
    dirty = TeacherOutputs("topk", outputs.values.clone(), outputs.ids.clone(), outputs.extra.clone())
    dirty.values[labels == -100] = float("inf")
    dirty.ids[labels == -100] = -7
    results = []
    for h, t in ((hidden, outputs), (dirty_hidden, dirty)):
        h = h.clone().requires_grad_()
        w = head.clone().requires_grad_()
        loss, stats = research_head_loss(h, w, labels, [(t, None, False)], 9, 0.5, args)
        results.append((loss, torch.autograd.grad(loss, (h, w)), stats))
    assert torch.equal(results[0][0], results[1][0]) and torch.isfinite(results[1][0])
    for got, want in zip(results[1][1], results[0][1]):
        assert torch.equal(got, want)
    for name in clean[1]:
        assert torch.equal(results[1][2][name], clean[1][name])


def test_one_backward_pass_only():
    hidden, head, labels, _ = problem(5)
    h = hidden.clone().requires_grad_()
    loss, _ = research_head_loss(h, head, labels, [], 9, 0.0, DistillationArgs())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="single backward pass"):
        loss.backward()


Z_CASES = [(None, "accumulate", 1.0, 0.0), (None, "vocab_blocks", 1.0, 0.0), ("topk", "accumulate", 1.0, 0.4),
           ("topk", "vocab_blocks", 2.0, 0.4), ("topk", "accumulate", 1.0, 1.0), ("sampled", "accumulate", 1.0, 0.4),
           ("sampled", "vocab_blocks", 2.0, 0.4), ("full", "accumulate", 2.0, 0.4)]


@pytest.mark.parametrize("format,weight_grad,temperature,alpha", Z_CASES)
def test_the_z_loss_matches_the_research_path(format, weight_grad, temperature, alpha):
    """The fused z-loss (its gradient 2 w lse softmax(z), closed-form in the chunk) against autograd's: CE alone,
    top-k, sampled and full KD, both head-gradient modes, T = 1 and 2, and alpha = 1 (no CE, the z-loss still on)."""
    hidden, head, labels, g = problem(6)
    hidden = hidden * 3  # logits of a few units: lse far from 0, so the z-loss's gradient is not small
    args = DistillationArgs(temperature=temperature, loss_chunk_size=4, loss_weight_grad=weight_grad, z_loss=0.05)
    teachers = [] if format is None else [(teacher(format, hidden, head, g, temperature), None, False)]
    fused, research = both_paths(hidden, head, labels, teachers, alpha, args)
    assert_same(fused, research)
    valid = labels != -100
    lse = (hidden @ head.T).logsumexp(-1)[valid]
    expected_z = 0.05 * (lse**2).sum() / valid.sum()
    for _, _, stats in (fused, research):
        assert list(stats)[:2] == ["ce", "z"]
        torch.testing.assert_close(stats["z"].double(), expected_z, rtol=1e-6, atol=0)
    # the term is in the loss: off, the loss drops by exactly the statistic
    off = research_head_loss(hidden, head, labels, teachers, int(valid.sum()), alpha,
                             DistillationArgs(temperature=temperature, loss_chunk_size=4))[0]
    torch.testing.assert_close(research[0] - off, research[2]["z"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weight_grad", ["accumulate", "vocab_blocks"])
def test_the_z_loss_with_several_teachers_counts_once(weight_grad):
    """With several teachers the z-loss rides on the call that carries CE only (one term, not one per teacher)."""
    hidden, head, labels, g = problem(7)
    args = DistillationArgs(temperature=1.5, loss_chunk_size=3, loss_weight_grad=weight_grad, z_loss=0.05)
    teachers = [(teacher(kind, hidden, head, g, 1.5), torch.rand(B, S, generator=g, dtype=torch.float64), False)
                for kind in ("topk", "sampled")]
    fused, research = both_paths(hidden, head, labels, teachers, 0.3, args)
    assert_same(fused, research)
