"""The fused head + CE + KD loss against today's unfused path (float64), gradcheck, stats, masks, host syncs."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lingua.distillation.loss import fused as fused_module
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.fused import auto_chunk_rows, fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from tests.unit.lingua.distillation.loss.logits_kd import kd_loss
from lingua.transformer import cross_entropy_sum

N, D, V, K = 10, 6, 13, 4
CASES = [("topk", "fkl"), ("topk", "rkl"), ("topk", "jsd"), ("sampled", "fkl"), ("full", "fkl"), ("full", "rkl"),
         ("full", "jsd")]
MASKS = ["all_valid", "some_ignored", "chunk_ignored", "all_ignored"]



def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _problem(format, temperature, mask_pattern="some_ignored", seed=0, n=N, v=V, k=K, wire_dtype=torch.float32):
    """(hidden, weight, labels, teacher) in float64; the teacher is correlated with the student so top-1s agree."""
    hidden, weight = _randn(n, D, seed=seed), _randn(v, D, seed=seed + 1, scale=0.8)
    teacher_logits = hidden @ weight.T + _randn(n, v, seed=seed + 2)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 3))
    if mask_pattern == "some_ignored":
        labels[1::3] = -100
    elif mask_pattern == "chunk_ignored":
        labels[3:6] = -100  # exactly the second chunk at chunk_size 3
    elif mask_pattern == "all_ignored":
        labels[:] = -100
    teacher = sparsify_teacher_logits(teacher_logits, format, k, temperature, wire_dtype=wire_dtype,
                                      generator=torch.Generator().manual_seed(seed + 4))
    return hidden, weight, labels, teacher


def _reference(hidden, weight, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta=0.5,
               kd_weight=None):
    """Today's unfused trainer path in float64: logits, CE sum / n_valid, kd_loss weighted by the token share."""
    logits = (hidden @ weight.T).unsqueeze(0)
    # cross_entropy_sum in float64 (it casts to fp32, which would cap this reference at fp32 precision).
    ce = F.cross_entropy(logits[0], labels, ignore_index=-100, reduction="sum") / normalizer
    if teacher is None:
        return ce, None
    batched = TeacherOutputs.from_tensors(teacher.format, [t.unsqueeze(0) for t in teacher.tensors()])
    mask = (labels != -100).unsqueeze(0)
    kd, stats = kd_loss(logits, batched, mask, temperature, divergence, jsd_beta, chunk_size=4,
                        kd_weight=None if kd_weight is None else kd_weight.unsqueeze(0))
    weight_share = int(mask.sum()) / normalizer
    return distillation_loss(ce, kd * weight_share, alpha, temperature), stats


def _value_and_grads(fn, hidden, weight, dtype):
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss, extra = fn(h, w)
    grads = torch.autograd.grad(loss, (h, w))
    return loss.detach(), grads, extra


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mask_pattern", MASKS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("format,divergence", CASES)
def test_matches_unfused_reference(format, divergence, temperature, mask_pattern):
    hidden, weight, labels, teacher = _problem(format, temperature, mask_pattern)
    normalizer = 7  # the step's valid tokens: other micro-batches count too (and one may be all ignored)
    # Every chunk size at alpha 0.5; the other alphas at one odd chunk size (the chunking is alpha-blind).
    for alpha, chunk_sizes in ((0.5, (1, 3, 32, 0)), (0.0, (3,)), (1.0, (3,))):
        ref_loss, ref_grads, _ = _value_and_grads(
            lambda h, w: _reference(h, w, labels, teacher, normalizer, alpha, temperature, divergence),
            hidden, weight, torch.float64)
        for chunk_size in chunk_sizes:
            loss, grads, stats = _value_and_grads(
                lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, normalizer, alpha, temperature, divergence,
                                                  chunk_size=chunk_size),
                hidden, weight, torch.float32)
            assert loss.dtype == torch.float32 and stats.dtype == torch.float32 and stats.shape == (4,)
            torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
            for grad, ref_grad in zip(grads, ref_grads):
                assert grad.dtype == torch.float32
                torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    if mask_pattern == "all_ignored":
        assert ref_loss.item() == 0.0 and loss.item() == 0.0 and torch.count_nonzero(stats).item() == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("format,divergence", CASES)
def test_float64_is_exact_and_auto_chunking_splits(format, divergence, monkeypatch):
    hidden, weight, labels, teacher = _problem(format, 1.5, seed=10)
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, 1.5, divergence, jsd_beta=0.3), hidden, weight,
        torch.float64)
    # A budget of about 2.5 rows of work: auto chunking must then walk several chunks.
    budget = int(2.5 * V * 8 * fused_module.WORK_TENSORS[format])
    monkeypatch.setattr(fused_module, "AUTO_CHUNK_BYTES", {"cpu": budget, "cuda": budget})
    assert auto_chunk_rows(V, format, "cpu", torch.float64) == 2
    loss, grads, _ = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, 1.5, divergence, jsd_beta=0.3),
        hidden, weight, torch.float64)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("mask_pattern", ["all_valid", "some_ignored"])
def test_ce_only_matches_cross_entropy_sum(mask_pattern):
    hidden, weight, labels, _ = _problem("topk", 1.0, mask_pattern)
    loss, grads, stats = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, None, 7, alpha=0.9, temperature=3.0, chunk_size=3),
        hidden, weight, torch.float32)
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: (cross_entropy_sum((h @ w.T).unsqueeze(0), labels.unsqueeze(0)) / 7, None),
        hidden, weight, torch.float32)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats[0], ref_loss * 7, rtol=1e-5, atol=1e-5)
    assert stats[1:].abs().max().item() == 0.0


class _FreshGraph(torch.autograd.Function):
    """gradcheck runs backward twice on one graph; the loss allows one, so each backward rebuilds it."""

    @staticmethod
    def forward(ctx, hidden, weight, loss_fn):
        ctx.save_for_backward(hidden, weight)
        ctx.loss_fn = loss_fn
        return loss_fn(hidden, weight)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            loss = ctx.loss_fn(hidden, weight)
        return (*torch.autograd.grad(loss, (hidden, weight), grad_loss), None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("format,divergence", CASES + [(None, "fkl")])
def test_gradcheck(format, divergence):
    hidden, weight, labels, teacher = _problem(format or "topk", 2.0, n=5, v=7, k=3, seed=20,
                                               wire_dtype=torch.float64)
    teacher = teacher if format else None

    def loss_fn(h, w):
        return fused_linear_kd_loss(h, w, labels, teacher, 4, 0.5, 2.0, divergence, jsd_beta=0.4, chunk_size=2)[0]

    inputs = (hidden.clone().requires_grad_(), weight.clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: _FreshGraph.apply(h, w, loss_fn), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("format", ["topk", "sampled", "full"])
def test_stats_equal_reference(format):
    hidden, weight, labels, teacher = _problem(format, 2.0, seed=30, n=24, wire_dtype=torch.bfloat16)
    mask = labels != -100
    count = int(mask.sum())
    _, stats = fused_linear_kd_loss(hidden.float(), weight.float(), labels, teacher, count, 0.5, 2.0, chunk_size=5)
    _, ref = _reference(hidden.float(), weight.float(), labels, teacher, count, 0.5, 2.0, "fkl")
    ce_sum = cross_entropy_sum((hidden.float() @ weight.float().T).unsqueeze(0), labels.unsqueeze(0))
    expected = torch.tensor([ce_sum.item(), ref["kd"] * count, ref["teacher_mass"] * count,
                             ref["top1_agreement"] * count])
    torch.testing.assert_close(stats, expected, rtol=1e-5, atol=1e-5)
    assert 0 < stats[3].item() < count  # agreement actually varies, so its definition is exercised


@pytest.mark.timeout(30)
@pytest.mark.parametrize("format", ["topk", "sampled", "full"])
def test_masked_garbage_changes_nothing(format):
    hidden, weight, labels, teacher = _problem(format, 1.0, seed=40)
    mask = labels != -100
    args = (teacher, 7, 0.5, 1.0, "fkl", 0.5, 3)
    clean_loss, clean_grads, clean_stats = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, *args), hidden, weight, torch.float32)
    dirty_hidden = hidden.clone()
    dirty_hidden[~mask] = float("nan")
    dirty_hidden[1, 0] = float("inf")  # row 1 is ignored
    dirty = [t.clone() for t in teacher.tensors()]
    dirty[0][~mask] = float("nan")
    if format != "full":
        dirty[1][~mask] = V + 1000  # an id out of range at a padded position
        dirty[2][~mask] = float("inf")
    dirty_teacher = TeacherOutputs.from_tensors(format, dirty)
    loss, grads, stats = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, dirty_teacher, *args[1:]), dirty_hidden, weight,
        torch.float32)
    assert torch.equal(loss, clean_loss) and torch.equal(stats, clean_stats)
    assert torch.equal(grads[0], clean_grads[0]) and torch.equal(grads[1], clean_grads[1])
    assert grads[0][~mask].abs().max().item() == 0.0 and grads[0][mask].abs().max().item() > 0.0


@pytest.mark.timeout(30)
def test_no_host_sync_in_forward_and_backward(monkeypatch):
    cases = [_problem(format, 2.0, seed=50) for format in ("topk", "sampled", "full")]
    cases.append(_problem("topk", 1.0, seed=51)[:3] + (None,))
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            calls.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # T = 2 and T = 1 (KD in CE's passes), accumulated and vocabulary-blocked head grads, with KD weights.
    for (hidden, weight, labels, teacher), temperature, weight_grad in itertools.product(
            cases, (2.0, 1.0), ("accumulate", "vocab_blocks")):
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        normalizer = (labels != -100).sum()  # a device tensor works as the normalizer too
        loss, stats = fused_linear_kd_loss(h, w, labels, teacher, normalizer, 0.5, temperature, chunk_size=4,
                                           kd_weight=torch.rand(labels.shape), weight_grad=weight_grad)
        loss.backward()
    monkeypatch.undo()
    assert calls == []
    assert h.grad is not None and w.grad is not None


@pytest.mark.timeout(20)
def test_bf16_inputs_and_no_grad_path():
    hidden, weight, labels, teacher = _problem("topk", 1.0, seed=60)
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss, stats = fused_linear_kd_loss(h16, w16, labels, teacher, 7, 0.5, 1.0, chunk_size=3)
    loss.backward()
    assert loss.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, 1.0, "fkl"), h16.double(), w16.double(),
        torch.float64)
    # bf16 logits and bf16 grads of the head keep ~3 significant digits.
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2)
    torch.testing.assert_close(h16.grad.double(), ref_grads[0], rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(w16.grad.double(), ref_grads[1], rtol=5e-2, atol=2e-3)
    with torch.no_grad():
        no_grad_loss, no_grad_stats = fused_linear_kd_loss(h16, w16, labels, teacher, 7, 0.5, 1.0, chunk_size=3)
    assert no_grad_loss.grad_fn is None and torch.equal(no_grad_loss, loss.detach())
    assert torch.equal(no_grad_stats, stats)


@pytest.mark.timeout(20)
def test_backward_scales_with_upstream_and_refuses_second_backward():
    hidden, weight, labels, teacher = _problem("topk", 2.0, seed=70)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, 2.0)
    grads = torch.autograd.grad(3.0 * loss, (h, w), retain_graph=True)
    _, plain, _ = _value_and_grads(lambda a, b: fused_linear_kd_loss(a, b, labels, teacher, 7, 0.5, 2.0), hidden,
                                   weight, torch.float64)
    for grad, one in zip(grads, plain):
        torch.testing.assert_close(grad, 3.0 * one)
    with pytest.raises(RuntimeError, match="single backward"):
        torch.autograd.grad(loss, (h, w))
    # A frozen head (or frozen hidden states) gets no gradient buffer at all.
    frozen, _ = fused_linear_kd_loss(hidden.clone().requires_grad_(), weight, labels, teacher, 7, 0.5, 2.0)
    assert frozen.grad_fn is not None and frozen.grad_fn.grad_weight is None


@pytest.mark.timeout(20)
def test_batched_shapes_and_auto_chunk_rows():
    hidden, weight, labels, teacher = _problem("topk", 1.0, seed=80)
    flat, _ = fused_linear_kd_loss(hidden, weight, labels, teacher, 7, 0.5, 1.0)
    batched_teacher = TeacherOutputs.from_tensors("topk", [t.view(2, 5, *t.shape[1:]) for t in teacher.tensors()])
    batched, _ = fused_linear_kd_loss(hidden.view(2, 5, D), weight, labels.view(2, 5), batched_teacher, 7, 0.5, 1.0)
    assert torch.equal(flat, batched)
    assert auto_chunk_rows(49152, "topk") == fused_module.AUTO_CHUNK_BYTES["cpu"] // (49152 * 4 * 3)
    assert auto_chunk_rows(49152, "full") < auto_chunk_rows(49152, None)
    assert auto_chunk_rows(10**9, "full") == 1
    assert auto_chunk_rows(49152, "topk", "cuda", torch.bfloat16) > auto_chunk_rows(49152, "topk", "cpu")


@pytest.mark.timeout(20)
def test_readable_errors():
    hidden, weight, labels, teacher = _problem("topk", 1.0)
    sampled = _problem("sampled", 1.0)[3]
    full = _problem("full", 1.0)[3]
    cases = [
        (dict(weight=weight[:, :-1]), "head weight"),
        (dict(weight=weight.float()), "share a dtype"),
        (dict(labels=labels[:-1]), "one label per hidden row"),
        (dict(normalizer=0), "normalizer"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=-1), "chunk_size"),
        (dict(alpha=1.5), "alpha"),
        (dict(divergence="kl"), "divergence"),
        (dict(teacher=sampled, divergence="rkl"), "forward KL"),
        (dict(divergence="jsd", jsd_beta=1.0), "jsd_beta"),
        (dict(teacher=TeacherOutputs.from_tensors("topk", [t[:-1] for t in teacher.tensors()])), "one row per"),
        (dict(weight=weight[:-1]), "same tokenizer"),
        (dict(weight=weight[:2]), "exceed"),
    ]
    for overrides, message in cases:
        kwargs = dict(hidden=hidden, weight=weight, labels=labels, teacher=teacher, normalizer=7, alpha=0.5,
                      temperature=1.0)
        if message in ("same tokenizer",):
            kwargs["teacher"] = full
        kwargs.update(overrides)
        with pytest.raises(ValueError, match=message):
            fused_linear_kd_loss(**kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("beta,divergence", [(0.0, "fkl"), (1.0, "rkl"), (0.3, "jsd")])
def test_matches_liger_fused_linear_jsd(beta, divergence):
    """Liger-Kernel's pure-torch chunked JSD (not a dependency: runs only where it is installed).

    Its beta=0 is KL(teacher || student) and beta=1 KL(student || teacher); it takes the teacher's
    hidden states and head, and weights CE and the divergence sum as given (so alpha T^2 here).
    """
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    alpha, T = 0.5, 2.0
    hidden, weight, labels, _ = _problem("full", T, seed=90)
    teacher_hidden, teacher_weight = _randn(N, 5, seed=91), _randn(V, 5, seed=92)
    teacher = TeacherOutputs("full", torch.log_softmax(teacher_hidden @ teacher_weight.T / T, -1))
    count = int((labels != -100).sum())
    loss_fn = liger.LigerFusedLinearJSDLoss(weight_hard_loss=1 - alpha, weight_soft_loss=alpha * T**2, beta=beta,
                                            temperature=T, compiled=False, chunk_size=3)
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: (loss_fn(h, w, teacher_hidden, teacher_weight, labels), None), hidden, weight, torch.float64)
    loss, grads, _ = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, count, alpha, T, divergence,
                                          jsd_beta=beta if divergence == "jsd" else 0.5, chunk_size=4),
        hidden, weight, torch.float64)
    # Liger takes CE in fp32 and accumulates the loss in fp32.
    torch.testing.assert_close(loss, ref_loss.double(), rtol=1e-6, atol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert math.isfinite(loss.item())

