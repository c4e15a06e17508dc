"""One teacher is a list of one: through the N-teacher distiller it gives the one-teacher loss of ca89305 (the
calls its KDDistiller made, written out here) bit for bit: loss, both gradients and every metric (torch.equal). The
research path (fused_loss=false), one autograd implementation since, gives the fused numbers to float64's rounding."""

import pytest
import torch

from lingua.distillation.args import DistillationArgs, TeacherArgs
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.cross_tokenizer.targets import map_topk_rows
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from tests.unit.lingua.distillation.loss.test_uld import _vocab_map

B, S, D, V, K, TEACHER_V = 2, 5, 6, 13, 4, 20


def todays_one_teacher(hidden, weight, labels, teacher, n_valid, alpha, args):
    """(loss, CE, [KD, mass, agreement(, aligned)]) as ca89305's KDDistiller computed one teacher's micro-batch on the
    fused path (the research path is checked against it)."""
    loss, sums = fused_linear_kd_loss(hidden, weight, labels, teacher, max(n_valid, 1), alpha, args.temperature,
                                      args.divergence, args.jsd_beta, args.loss_chunk_size,
                                      kd_weight=teacher.kd_weight, weight_grad=args.loss_weight_grad,
                                      compiled=args.compiles_loss(True, hidden.device),
                                      uld_weight=args.uld_weight, uld_k=args.uld_k)
    sums = sums.double() / max(n_valid, 1)
    ce, stats = sums[0], sums[1:]
    if teacher.kd_weight is not None:
        aligned = (teacher.kd_weight * (labels != -100)).sum().double() / max(n_valid, 1)
        stats = torch.cat([stats, aligned.reshape(1)])
    return loss, ce.detach().double(), stats


def make_teacher(kind: str, g: torch.Generator) -> TeacherOutputs:
    logits = torch.randn(B, S, TEACHER_V if kind.startswith("cross") else V, generator=g, dtype=torch.float64) * 2
    if kind in ("topk", "sampled", "full"):
        out = sparsify_teacher_logits(logits, kind, K, 1.5, wire_dtype=torch.float32, generator=g) \
            if kind == "sampled" else sparsify_teacher_logits(logits, kind, K, 1.5, wire_dtype=torch.float32)
        return out
    teacher = sparsify_teacher_logits(logits, "topk", K, 1.5, wire_dtype=torch.float32)
    values, ids, rest = map_topk_rows(teacher.values.view(B * S, K), teacher.ids.view(B * S, K),
                                      teacher.extra.view(B * S), _vocab_map(3, TEACHER_V, V), kind == "cross_uld")
    kd_weight = (torch.rand(B, S, generator=g) > 0.3).float()
    return TeacherOutputs("topk", values.view(B, S, K), ids.view(B, S, K), rest.view(B, S), kd_weight=kd_weight)


CASES = [("topk", {}), ("topk", {"fused_loss": False}), ("topk", {"loss_weight_grad": "vocab_blocks"}),
         ("topk", {"divergence": "jsd", "alpha": 0.0}), ("sampled", {}), ("sampled", {"fused_loss": False}),
         ("full", {"divergence": "rkl"}), ("cross", {}), ("cross", {"fused_loss": False}),
         ("cross_uld", {"uld_weight": 0.5, "uld_k": 3}), ("cross_uld", {"uld_weight": 0.5, "fused_loss": False})]


@pytest.mark.parametrize("kind,overrides", CASES)
def test_one_teacher_through_the_n_teacher_path_is_todays_loss_bit_for_bit(kind, overrides):
    g = torch.Generator().manual_seed(0)
    cross = kind.startswith("cross")
    args = DistillationArgs(**{"temperature": 1.5, "alpha": 0.4, "loss_chunk_size": 4, **overrides},
                            teachers=[TeacherArgs(path="t", cross_tokenizer=cross)])
    distiller = CacheDistiller(args, torch.zeros(1, 1), torch.device("cpu"), [(None, None)])
    hidden = torch.randn(B, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    micro_batches = []
    for _ in range(2):  # two micro-batches: the statistics add up
        labels = torch.randint(0, V, (B, S), generator=g)
        labels[0, :2] = -100
        micro_batches.append((labels, make_teacher(kind, g)))
    n_valid = sum(int((labels != -100).sum()) for labels, _ in micro_batches)
    # the fused path: bit for bit; the research path: the same numbers to float64's rounding (fp32 statistics)
    def same(got, want, rtol=1e-10):
        if args.fused_loss:
            assert torch.equal(got, want), (got, want)
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=1e-12)
    distiller.begin_step(1, 1.0)
    want_ce = want_stats = None
    for labels, teacher in micro_batches:
        pending = distiller.submit({"teachers": [teacher]}, 1, 0)
        loss = distiller.head_loss(labels, pending, n_valid, None)(hidden, head)
        grads = torch.autograd.grad(loss, (hidden, head))
        want, ce, stats = todays_one_teacher(hidden, head, labels, teacher, n_valid, args.alpha, args)
        want_grads = torch.autograd.grad(want, (hidden, head))
        same(loss, want)
        for got, expected in zip(grads, want_grads):
            same(got, expected)
        want_ce = ce if want_ce is None else want_ce + ce
        want_stats = stats if want_stats is None else want_stats + stats
    kd, mass, agreement, *aligned = want_stats.unbind()
    expected = {"loss/ce": want_ce, "loss/kd": kd, "kd/teacher_mass": mass, "kd/top1_agreement": agreement,
                "kd/alpha": args.alpha, "loss/total": distillation_loss(want_ce, kd, args.alpha, args.temperature),
                **({"kd/aligned": aligned[0]} if aligned else {})}
    metrics = distiller.step_metrics()
    assert list(metrics) == list(expected)  # the keys of one teacher, in their order: no kd/0/...
    for key, value in expected.items():
        same(torch.as_tensor(metrics[key]), torch.as_tensor(value), rtol=1e-6)
