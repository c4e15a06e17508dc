"""The objective's shared math (lingua/distillation/loss/divergences.py) against independent definitions and autograd."""

import math

import pytest
import torch
import torch.nn.functional as F

from lingua.distillation.loss.divergences import (
    DIVERGENCES, LOG_TINY, distillation_loss, divergence, sampled_forward_kl, teacher_full_log_probs,
    teacher_support, teacher_topk_log_probs,
)


def _log_probs(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=generator, dtype=torch.float64) * 2, dim=-1)


def test_values_match_torch_kl_div_and_the_jsd_definition():
    log_p, log_q = _log_probs(5, 7, seed=0), _log_probs(5, 7, seed=1)
    torch.testing.assert_close(divergence(log_p, log_q, "fkl"),
                               F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1))
    torch.testing.assert_close(divergence(log_p, log_q, "rkl"),
                               F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1))
    beta = 0.3
    p, q = log_p.exp(), log_q.exp()
    m = beta * p + (1 - beta) * q
    jsd = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(divergence(log_p, log_q, "jsd", beta), jsd)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_the_closed_form_gradient_is_the_autograd_gradient(kind):
    """G = dD/d(log q) with p fixed, as both losses use it."""
    log_p = _log_probs(4, 9, seed=2)
    log_q = _log_probs(4, 9, seed=3).requires_grad_(True)
    value, grad, q = divergence(log_p, log_q, kind, 0.4, with_grad=True)
    (expected,) = torch.autograd.grad(divergence(log_p, log_q, kind, 0.4).sum(), log_q)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(q, log_q.detach().exp())
    torch.testing.assert_close(value, divergence(log_p, log_q, kind, 0.4))


def test_jsd_tends_to_scaled_kls_at_the_ends_of_beta():
    log_p, log_q = _log_probs(3, 6, seed=4), _log_probs(3, 6, seed=5)
    beta = 1e-6
    torch.testing.assert_close(divergence(log_p, log_q, "jsd", beta) / beta, divergence(log_p, log_q, "fkl"),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(divergence(log_p, log_q, "jsd", 1 - beta) / beta, divergence(log_p, log_q, "rkl"),
                               rtol=1e-4, atol=1e-6)


def test_teacher_buckets_are_renormalised_and_floored():
    values = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.bfloat16)  # bf16-rounded log-probs
    tail = torch.tensor([0.25])
    with_rest = teacher_topk_log_probs(values, tail, torch.float64, with_rest=True)
    assert with_rest.shape == (1, 3)
    torch.testing.assert_close(with_rest.logsumexp(-1), torch.zeros(1, dtype=torch.float64))
    without = teacher_topk_log_probs(values, torch.tensor([0.0]), torch.float64, with_rest=False)
    torch.testing.assert_close(without.logsumexp(-1), torch.zeros(1, dtype=torch.float64))
    # A zero tail is floored, never -inf: a reverse KL against it stays finite.
    assert teacher_topk_log_probs(values, torch.tensor([0.0]), torch.float32, with_rest=True)[0, -1] >= LOG_TINY
    full = teacher_full_log_probs(torch.tensor([[0.0, -1.0, -200.0]]), torch.float32)
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(1))


def test_support_counts_each_sampled_id_once_and_names_the_teacher_top1():
    values = torch.tensor([[math.log(0.4), math.log(0.1), math.log(0.4)]])
    ids = torch.tensor([[7, 3, 7]])
    mass, top1 = teacher_support(values, ids, None, "sampled")
    torch.testing.assert_close(mass, torch.tensor([0.5]))
    assert top1.tolist() == [7]
    mass, top1 = teacher_support(values, ids, torch.tensor([0.1]), "topk")
    torch.testing.assert_close(mass, torch.tensor([0.9]))
    mass, top1 = teacher_support(torch.tensor([[-3.0, -0.1, -2.0]]), None, None, "full")
    assert mass.tolist() == [1.0] and top1.tolist() == [1]


def test_sampled_estimate_and_the_mix():
    log_q = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    torch.testing.assert_close(sampled_forward_kl(torch.tensor([-0.5]), log_q), torch.tensor([1.5], dtype=torch.float64))
    assert distillation_loss(2.0, 1.0, 0.25, 2.0) == pytest.approx(0.75 * 2.0 + 0.25 * 4.0 * 1.0)
