"""A bf16 head's logits are formed in fp32 (`chunk.head_logits`), never rounded to bf16 before the softmax: issue
50's synthetic check (N = 256 rows, V = 32,768, logits up to ~15.5, a teacher that is the student perturbed, top-64).
With the GEMM's output rounded to bf16 first, 6 of its 256 rows' top-1 agreement differed from fp32's and the KD by
1.5e-3 relative (up to 12% on one row); now they are equal (on the CPU the head is upcast, exact)."""

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.loss.chunk import head_logits
from lingua.distillation.loss.fused import fused_head_loss, fused_linear_kd_loss
from lingua.distillation.loss.research import research_head_loss
from lingua.distillation.outputs import sparsify_teacher_logits

N, V, D, K = 256, 32768, 64, 64


@pytest.fixture(scope="module")
def bf16_problem():
    """(hidden, head) in bf16 with logits up to ~15.5, labels, and a top-64 teacher: the student's fp32 logits
    plus noise, so the top-1 sits among near ties as in a trained pair."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g).bfloat16()
    head = (torch.randn(V, D, generator=g) * 0.33).bfloat16()
    exact = hidden.float() @ head.float().T
    assert 14.0 < exact.abs().max() < 17.0
    teacher = sparsify_teacher_logits(exact + 0.3 * torch.randn(N, V, generator=g), "topk", K, 1.0,
                                      wire_dtype=torch.float32)
    return hidden, head, torch.randint(0, V, (N,), generator=g), teacher


def test_bf16_logits_are_formed_in_fp32(bf16_problem):
    hidden, head, _, _ = bf16_problem
    logits = head_logits(hidden[:8], head, torch.float32, fp32_mm=False)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, hidden[:8].float() @ head.float().T)  # exact: the products fit fp32
    rounded = (hidden[:8] @ head.T).float()  # what the fused loss formed before
    assert not torch.equal(rounded, logits)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("weight_grad", ["accumulate", "vocab_blocks"])
def test_the_fused_loss_on_bf16_inputs_gives_the_fp32_statistics(bf16_problem, weight_grad):
    """bf16 hidden states and head against the same values upcast to fp32: top-1 agreement equal, KD within 1e-4
    relative, and the head's gradient as fp32's rounded once to bf16 (never a bf16 logit)."""
    hidden, head, labels, teacher = bf16_problem
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        h, w = hidden.to(dtype).requires_grad_(), head.to(dtype).requires_grad_()
        loss, stats = fused_linear_kd_loss(h, w, labels, teacher, N, 0.5, 1.0, weight_grad=weight_grad)
        results.append((loss, stats, torch.autograd.grad(loss, (h, w))))
    (loss16, stats16, grads16), (loss32, stats32, grads32) = results
    assert stats16[3] == stats32[3]  # top-1 agreement: the same rows
    assert abs(stats16[1] - stats32[1]) <= 1e-4 * stats32[1]  # KD
    assert abs(stats16[0] - stats32[0]) <= 1e-6 * stats32[0]  # CE
    torch.testing.assert_close(loss16, loss32, rtol=1e-6, atol=0)
    for got, want in zip(grads16, grads32):  # bf16 grads: fp32's to bf16's rounding, as a whole
        assert (got.float() - want).norm() <= 1e-2 * want.norm()


@pytest.mark.timeout(180)
def test_the_research_path_on_bf16_inputs_gives_the_fp32_statistics(bf16_problem):
    """The research path upcasts the head likewise (CE alone and with the teacher, the head loss's API)."""
    hidden, head, labels, teacher = bf16_problem
    rows = 64  # the research path keeps autograd's tensors per chunk: a quarter of the rows keeps the test short
    hidden, labels = hidden[:rows], labels[:rows]
    teacher = type(teacher)("topk", teacher.values[:rows], teacher.ids[:rows], teacher.extra[:rows])
    args = DistillationArgs(loss_chunk_size=32)
    for teachers in ([], [(teacher, None, False)]):
        stats = [research_head_loss(hidden.to(dtype), head.to(dtype), labels, teachers, rows, 0.5, args)[1]
                 for dtype in (torch.bfloat16, torch.float32)]
        fused = fused_head_loss(hidden, head, labels, teachers, rows, 0.5, DistillationArgs())[1]
        for name in stats[1]:
            torch.testing.assert_close(stats[0][name], stats[1][name], rtol=1e-6, atol=0, msg=name)
            torch.testing.assert_close(fused[name].double(), stats[1][name], rtol=1e-5, atol=0, msg=name)
