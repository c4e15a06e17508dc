"""ULD for the unmapped mass of cross-tokenizer targets: the teacher's marked entries, the reference against
finite differences, the fused loss's hand-written gradient against the reference, and the passes it adds."""

import pytest
import torch

from lingua.distillation.cross_tokenizer.targets import map_topk_rows
from lingua.distillation.cross_tokenizer.vocab_map import VocabMap
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from tests.unit.lingua.distillation.loss.logits_kd import kd_loss
from lingua.distillation.loss.uld import split_unmapped, uld_reference
from tests.gpu.gpus import needs_gpus
from tests.unit.lingua.distillation.loss.test_fused import _FreshGraph, _value_and_grads
from tests.unit.lingua.distillation.loss.test_fused_passes import _FullWidthOps

N, D, V, K, TEACHER_V = 10, 6, 13, 4, 20


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _vocab_map(seed, teacher_v=TEACHER_V, student_v=V):
    """A random map: about 40% of the teacher's ids unmapped, some student ids reached by two teacher ids."""
    table = torch.randint(0, student_v, (teacher_v,), generator=_generator(seed))
    table[torch.rand(teacher_v, generator=_generator(seed + 1)) < 0.4] = -1
    return VocabMap(table, student_v)


def _problem(temperature, seed=0, wire_dtype=torch.float32):
    """(hidden, weight, labels, marked targets, plain targets): student float64, a teacher over its own vocabulary
    whose top-k went through a random vocabulary map, with and without the unmapped entries."""
    g = _generator(seed)
    hidden, weight = torch.randn(N, D, generator=g, dtype=torch.float64), torch.randn(V, D, generator=g,
                                                                                      dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1::4] = -100
    teacher = sparsify_teacher_logits(torch.randn(N, TEACHER_V, generator=g, dtype=torch.float64) * 2, "topk", K,
                                      temperature, wire_dtype=torch.float32)
    vocab_map = _vocab_map(seed + 7)
    targets = []
    for marked in (True, False):
        values, ids, rest = map_topk_rows(teacher.values, teacher.ids, teacher.extra, vocab_map, marked)
        targets.append(TeacherOutputs("topk", values.to(wire_dtype), ids, rest))
    return hidden, weight, labels, targets[0], targets[1]


def _reference(hidden, weight, labels, teacher, temperature, divergence, uld_weight, uld_k, kd_weight=None):
    """The unfused path: logits, CE sum, kd_loss with ULD (autograd), mixed as the trainer mixes them."""
    logits = (hidden @ weight.T).unsqueeze(0)
    ce = torch.nn.functional.cross_entropy(logits[0], labels, ignore_index=-100, reduction="sum") / 7
    batched = TeacherOutputs.from_tensors("topk", [t.unsqueeze(0) for t in teacher.tensors()])
    mask = (labels != -100).unsqueeze(0)
    kd, stats = kd_loss(logits, batched, mask, temperature, divergence, chunk_size=3, uld_weight=uld_weight,
                        uld_k=uld_k, kd_weight=None if kd_weight is None else kd_weight.unsqueeze(0))
    return distillation_loss(ce, kd * int(mask.sum()) / 7, 0.5, temperature), stats


def test_marked_rows_carry_the_unmapped_entries_and_split_back_to_todays_targets():
    _, _, _, marked, plain = _problem(1.0, seed=3)
    assert (marked.ids < 0).any() and bool((plain.ids >= 0).all())
    assert torch.equal(marked.extra, plain.extra)  # the unmapped mass stays in the rest bucket
    assert bool((marked.values[:, 1:] <= marked.values[:, :-1]).all())  # most likely first (the codec needs it)
    values, ids, teacher_sorted = split_unmapped(marked.values, marked.ids, marked.extra, K, torch.float64)
    for row in range(N):  # the same (id, value) pairs as today's targets, in another order
        assert sorted(zip(ids[row].tolist(), values[row].tolist())) == \
            sorted(zip(plain.ids[row].long().tolist(), plain.values[row].double().tolist()))
        unmapped = marked.values[row][marked.ids[row] < 0].double().exp()
        total = plain.values[row].double().exp().sum() + plain.extra[row].double()
        expected = torch.cat([unmapped, torch.zeros(K - unmapped.numel(), dtype=torch.float64)]) / total
        torch.testing.assert_close(teacher_sorted[row], expected)
    # Each row's unmapped probabilities add up to what the rest holds beyond the teacher's own tail.
    assert float(teacher_sorted.sum()) > 0.1


def test_uld_reference_is_the_sorted_l1_and_passes_gradcheck():
    a = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    teacher_sorted = torch.tensor([[0.3, 0.05, 0.0]], dtype=torch.float64)
    s = torch.softmax(a, -1)[0]
    # ids 0 is a target slot: the rest is ids 1, 2, 3 (descending already).
    expected = (s[1] - 0.3).abs() + (s[2] - 0.05).abs() + s[3]
    torch.testing.assert_close(uld_reference(a, torch.tensor([[0]]), teacher_sorted)[0], expected)
    logits = torch.randn(5, 9, generator=_generator(1), dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(9, generator=_generator(r))[:3] for r in range(5)])
    teacher_sorted = torch.rand(5, 7, generator=_generator(2), dtype=torch.float64).sort(-1, descending=True).values
    teacher_sorted = teacher_sorted * 0.2
    assert torch.autograd.gradcheck(lambda a: uld_reference(a, ids, teacher_sorted), (logits,))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("uld_k", [3, 6, 12])  # fewer than k, more than k, more than the rest holds (V - k = 9)
def test_fused_uld_matches_the_reference_in_float64(divergence, temperature, uld_k):
    hidden, weight, labels, marked, plain = _problem(temperature, seed=11 + uld_k)
    kd_weight = torch.ones(N, dtype=torch.float64)
    kd_weight[2] = 0.0
    kd_weight[5] = 0.5
    ref_loss, ref_grads, ref_stats = _value_and_grads(
        lambda h, w: _reference(h, w, labels, marked, temperature, divergence, 0.7, uld_k, kd_weight), hidden,
        weight, torch.float64)
    for chunk_size, weight_grad in ((1, "accumulate"), (4, "accumulate"), (32, "vocab_blocks")):
        loss, grads, stats = _value_and_grads(
            lambda h, w: fused_linear_kd_loss(h, w, labels, marked, 7, 0.5, temperature, divergence,
                                              chunk_size=chunk_size, kd_weight=kd_weight, weight_grad=weight_grad,
                                              uld_weight=0.7, uld_k=uld_k), hidden, weight, torch.float64)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        count = int((labels != -100).sum())
        expected = torch.tensor([ref_stats["kd"], ref_stats["teacher_mass"], ref_stats["top1_agreement"]]) * count
        torch.testing.assert_close(stats[1:].double(), expected.double(), rtol=1e-5, atol=1e-6)
    # ULD is a term of its own: the same targets without it give another loss.
    plain_loss, _, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, plain, temperature, divergence, 0.0, uld_k, kd_weight), hidden, weight,
        torch.float64)
    assert abs(float(plain_loss - ref_loss)) > 1e-3


@pytest.mark.timeout(30)
def test_weight_zero_and_ignored_rows_may_hold_anything():
    """Garbage teacher rows (nan values, inf tails, marked ids out of range) where kd_weight is 0 or the label is
    ignored reach neither the loss nor the grads, ULD included, in the fused loss and the reference."""
    hidden, weight, labels, marked, _ = _problem(1.0, seed=61)
    kd_weight = torch.ones(N, dtype=torch.float64)
    kd_weight[3] = 0.0
    hidden_rows = (labels == -100) | (kd_weight == 0)
    values, ids, extra = (t.clone() for t in marked.tensors())
    values[hidden_rows], extra[hidden_rows] = float("nan"), float("inf")
    ids[hidden_rows] = torch.tensor([-V - 5, V + 5, -1, 0], dtype=ids.dtype)
    dirty = TeacherOutputs("topk", values, ids, extra)
    for loss_fn in (
            lambda h, w, t: fused_linear_kd_loss(h, w, labels, t, 7, 0.5, 1.0, chunk_size=3, kd_weight=kd_weight,
                                                 uld_weight=0.5, uld_k=5),
            lambda h, w, t: _reference(h, w, labels, t, 1.0, "fkl", 0.5, 5, kd_weight)):
        clean_loss, clean_grads, _ = _value_and_grads(lambda h, w: loss_fn(h, w, marked), hidden, weight,
                                                      torch.float64)
        loss, grads, _ = _value_and_grads(lambda h, w: loss_fn(h, w, dirty), hidden, weight, torch.float64)
        assert torch.isfinite(loss) and torch.equal(loss, clean_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, clean_grads))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_fused_uld_gradient_passes_gradcheck(temperature):
    hidden, weight, labels, marked, _ = _problem(temperature, seed=21)
    rows = 6  # fewer rows: gradcheck perturbs every input once
    teacher = TeacherOutputs("topk", *(t[:rows] for t in marked.tensors()))
    assert (teacher.ids[labels[:rows] != -100] < 0).any()  # ULD has unmapped entries to match

    def loss_fn(h, w):
        return fused_linear_kd_loss(h, w, labels[:rows], teacher, 7, 0.5, temperature, "fkl", chunk_size=3,
                                    uld_weight=1.0, uld_k=5)[0]

    inputs = (hidden[:rows].clone().requires_grad_(), weight.clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: _FreshGraph.apply(h, w, loss_fn), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_fused_uld_in_bf16_is_within_rounding_of_float64(temperature):
    hidden, weight, labels, _, _ = _problem(temperature, seed=31)
    marked = _problem(temperature, seed=31, wire_dtype=torch.bfloat16)[3]
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, marked, temperature, "fkl", 0.5, 6), hidden, weight, torch.float64)
    loss, grads, _ = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, marked, 7, 0.5, temperature, "fkl", chunk_size=4,
                                          uld_weight=0.5, uld_k=6), hidden, weight, torch.bfloat16)
    assert loss.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-2, atol=2e-2)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=5e-2, atol=2e-2)


def _ops(marked, temperature, rows=8, uld_weight=0.0):
    hidden = torch.randn(rows, D, generator=_generator(5))
    weight = torch.randn(V, D, generator=_generator(6))
    labels = torch.randint(0, V, (rows,), generator=_generator(7))
    teacher = TeacherOutputs("topk", *(t[:rows] for t in marked.tensors()))
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with _FullWidthOps((rows, V)) as counter:
        loss, stats = fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, temperature, "fkl", chunk_size=rows,
                                           uld_weight=uld_weight, uld_k=3)
    loss.backward()
    return counter.ops, loss.detach(), stats, h.grad, w.grad


@pytest.mark.timeout(30)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_uld_takes_the_max_pass_topk_and_off_is_todays_loss(temperature):
    """ULD's topk over the rest replaces CE's max pass (the rest's max is its first value): the same count of passes
    over the chunk, one of them a topk. Off, marked targets are never read as marks: today's ops, bit for bit."""
    _, _, _, marked, plain = _problem(temperature, seed=41)
    assert (marked.ids[:8] < 0).any()  # the ULD run has unmapped entries in its 8 rows
    off = _ops(plain, temperature)
    on = _ops(marked, temperature, uld_weight=0.5)
    assert len(on[0]) == len(off[0]) and sorted(on[0]) == sorted(["topk" if op == "max" else op for op in off[0]]), \
        (on[0], off[0])
    again = _ops(plain, temperature)
    assert off[0] == again[0] and all(torch.equal(a, b) for a, b in zip(off[1:], again[1:]))


def test_uld_refusals_are_one_sentence():
    hidden, weight, labels, marked, _ = _problem(1.0)
    with pytest.raises(ValueError, match="uld_weight"):
        fused_linear_kd_loss(hidden, weight, labels, marked, 7, 0.5, 1.0, uld_weight=-1.0)
    with pytest.raises(ValueError, match="uld_k"):
        fused_linear_kd_loss(hidden, weight, labels, marked, 7, 0.5, 1.0, uld_weight=1.0, uld_k=0)
    with pytest.raises(ValueError, match="compiled=False"):
        fused_linear_kd_loss(hidden, weight, labels, marked, 7, 0.5, 1.0, uld_weight=1.0, compiled=True)


def test_the_bench_prints_on_off_ratios(monkeypatch, capsys):
    from apps.bench import uld_loss

    monkeypatch.setattr("sys.argv", ["uld_loss", "--vocab", "300", "--tokens", "16", "--dim", "8", "--k", "8",
                                     "--uld-k", "4", "--rounds", "2"])
    uld_loss.main()
    line = capsys.readouterr().out.strip()
    assert line.startswith("V=300 N=16 D=8 k=8 uld_k=4 threads=1 rounds=2: ULD off ") and " CPU" in line
    ratios = [float(part.split()[0]) for part in line.split("on / off = ")[1].split(", ")]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


@needs_gpus(1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_fused_uld_on_a_gpu_matches_the_float64_reference(dtype, tolerance):
    """ULD's topk and closed-form gradient on CUDA (fp32 and bf16) against the CPU float64 reference."""
    hidden, weight, labels, marked, _ = _problem(2.0, seed=51)
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, marked, 2.0, "fkl", 0.5, 6), hidden, weight, torch.float64)
    cuda = torch.device("cuda", 0)
    h = hidden.to(cuda, dtype).requires_grad_()
    w = weight.to(cuda, dtype).requires_grad_()
    loss, _ = fused_linear_kd_loss(h, w, labels.to(cuda), marked.to(cuda), 7, 0.5, 2.0, "fkl", chunk_size=4,
                                   uld_weight=0.5, uld_k=6)
    loss.backward()
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=tolerance, atol=tolerance)
    for grad, ref_grad in zip((h.grad, w.grad), ref_grads):
        torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=tolerance, atol=tolerance)
