"""The fused loss's passes over a chunk (KD at T = 1 adds none to CE's), the rest bucket far below the ids, and
the per-position KD weight, each against the float64 reference."""

import pytest
import torch

from lingua.distillation.loss import fused as fused_module
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs
from tests.unit.lingua.distillation.loss.test_fused import CASES, N, V, _problem, _reference, _value_and_grads


@pytest.mark.timeout(30)
@pytest.mark.parametrize("format,divergence", CASES)
def test_kd_weight_matches_the_reference_and_hides_weight_zero_teachers(format, divergence):
    hidden, weight, labels, teacher = _problem(format, 2.0, seed=45)
    mask = labels != -100
    kd_weight = torch.rand(N, generator=torch.Generator().manual_seed(46), dtype=torch.float64)
    kd_weight[0] = kd_weight[5] = 0.0  # valid labels (0 and 5 are not ignored): CE alone there
    kd_weight[2] = 1.0
    assert mask[0] and mask[5]
    ref_loss, ref_grads, ref_stats = _value_and_grads(
        lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, 2.0, divergence, kd_weight=kd_weight), hidden, weight,
        torch.float64)
    # Garbage where the weight is 0 (and at ignored labels): it must not reach the loss, the grads or the stats.
    dirty = [t.clone() for t in teacher.tensors()]
    hidden_rows = ~mask | (kd_weight == 0)
    dirty[0][hidden_rows] = float("nan")
    if format != "full":
        dirty[1][hidden_rows] = V + 1000
        dirty[2][hidden_rows] = float("inf")
    dirty_teacher = TeacherOutputs.from_tensors(format, dirty)
    for chunk_size in (1, 3, 32):
        loss, grads, stats = _value_and_grads(
            lambda h, w: fused_linear_kd_loss(h, w, labels, dirty_teacher, 7, 0.5, 2.0, divergence,
                                              chunk_size=chunk_size, kd_weight=kd_weight.float()),
            hidden, weight, torch.float32)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
        count = int(mask.sum())
        expected = torch.tensor([ref_stats["kd"], ref_stats["teacher_mass"], ref_stats["top1_agreement"]]) * count
        torch.testing.assert_close(stats[1:], expected.float(), rtol=1e-5, atol=1e-5)
    # The CE sum is unweighted; all-ones weights are exactly no weights.
    plain_loss, plain_grads, plain_stats = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, 2.0, divergence, chunk_size=3),
        hidden, weight, torch.float32)
    torch.testing.assert_close(stats[0], plain_stats[0])
    ones_loss, ones_grads, ones_stats = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, 2.0, divergence, chunk_size=3,
                                          kd_weight=torch.ones(N)),
        hidden, weight, torch.float32)
    assert torch.equal(ones_loss, plain_loss) and torch.equal(ones_stats, plain_stats)
    assert all(torch.equal(a, b) for a, b in zip(ones_grads, plain_grads))
    with pytest.raises(ValueError, match="kd_weight"):
        fused_linear_kd_loss(hidden, weight, labels, teacher, 7, 0.5, 2.0, divergence, kd_weight=torch.ones(N - 1))


class _FullWidthOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that pass over a [rows, V] tensor (reading or writing it whole); views and the k-wide
    gathers/scatters into it are not passes."""

    NOT_PASSES = ("t", "transpose", "permute", "view", "expand", "slice", "select", "unsqueeze", "squeeze",
                  "as_strided", "alias", "detach", "_reshape_alias", "gather", "scatter_", "scatter_add_")
    # (out-of-place scatter and scatter_add copy the whole tensor: they are passes, and counted)

    def __init__(self, shape):
        super().__init__()
        self.shapes, self.ops = {tuple(shape), tuple(reversed(shape))}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name not in self.NOT_PASSES and any(tuple(t.shape) in self.shapes for t in tensors):
            self.ops.append(name)
        return out


def _full_width_ops(format, divergence, temperature, rows=8, v=50):
    hidden, weight, labels, teacher = _problem(format or "topk", temperature, n=rows, v=v, seed=100)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with _FullWidthOps((rows, v)) as counter:
        loss, _ = fused_linear_kd_loss(h, w, labels, teacher if format else None, 7, 0.5, temperature, divergence,
                                       chunk_size=rows)
    loss.backward()
    return counter.ops


@pytest.mark.timeout(30)
def test_kd_at_temperature_one_adds_no_pass_over_the_chunk_to_ce():
    """CE's passes (3 GEMMs, max, subtract, exp, sum, multiply) are all that top-k (fkl/rkl/jsd) and sampled KD take
    at T = 1; T = 2 and the full format take more (printed on failure, and listed in docs/distillation_internals.md)."""
    ce = _full_width_ops(None, "fkl", 1.0)
    assert sorted(ce) == sorted(["mm", "mm", "addmm_", "max", "sub_", "exp_", "sum", "mul_"]), ce
    counts = {(format, divergence, t): _full_width_ops(format, divergence, t)
              for format, divergence in CASES for t in (1.0, 2.0)}
    summary = {key: len(ops) for key, ops in counts.items()}
    for (format, divergence, t), ops in counts.items():
        if format != "full" and t == 1.0:
            assert sorted(ops) == sorted(ce), (format, divergence, ops, f"CE {len(ce)}; all: {summary}")
        else:
            assert len(ops) > len(ce), summary
    assert all(summary[(format, divergence, 2.0)] == len(ce) + 4 for format, divergence in CASES if format != "full"), \
        summary


@pytest.mark.timeout(30)
@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_rest_bucket_far_below_the_ids_stays_exact(divergence, temperature):
    """The student puts ~e^-100 on everything but the teacher's k ids; the teacher leaves 1e-3 there. log q_rest is
    taken from the rest's own max and sum, so its value and gradient stay exact in fp32 (a normaliser shared with
    the ids, or 1 - sum(q_ids), would lose it to rounding)."""
    n, v, k = 6, 40, 4
    hidden, weight, labels, _ = _problem("topk", temperature, n=n, v=v, seed=110)
    hidden[:, 0] = 1.0
    weight[:, 0] = 0.0
    weight[:k, 0] = 100.0 * temperature  # ids 0..k-1 sit ~100 (at z / T) above the rest: e^-100 is below fp32
    values = torch.log(torch.full((n, k), (1 - 1e-3) / k, dtype=torch.float64))
    ids = torch.arange(k).expand(n, k).flip(-1).contiguous()  # the ids in another order than the vocabulary's
    teacher = TeacherOutputs("topk", values.float(), ids, torch.full((n,), 1e-3))
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, temperature, divergence), hidden, weight,
        torch.float64)
    loss, grads, _ = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, temperature, divergence, chunk_size=4),
        hidden, weight, torch.float32)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert ref_loss.item() > 1e-2  # the rest bucket's KD (~1e-3 * 100 for fkl) is what the loss is made of


@pytest.mark.timeout(60)
@pytest.mark.parametrize("format,divergence", [(None, "fkl")] + CASES)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_vocab_blocks_give_the_reference_grads(format, divergence, temperature, monkeypatch):
    """weight_grad="vocab_blocks" (grad_W from recomputed logits, one block of ids at a time, no fp32 [V, D]) equals
    the float64 reference for blocks of 1, 5 and 13 ids (the ids and labels then fall in and out of blocks)."""
    hidden, weight, labels, teacher = _problem(format or "topk", temperature, seed=120)
    teacher = teacher if format else None
    ref_loss, ref_grads, _ = _value_and_grads(
        lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, temperature, divergence), hidden, weight,
        torch.float64)
    blocks = []
    original = fused_module.vocab_block_weight_grad
    monkeypatch.setattr(fused_module, "vocab_block_weight_grad",
                        lambda *args: blocks.append(args[4]) or original(*args))
    for block in (1, 5, V):
        for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            # A budget of `block` ids per block at N rows (and of some rows per chunk).
            budget = block * N * (torch.finfo(dtype).bits // 8) * fused_module.WORK_TENSORS[format]
            monkeypatch.setattr(fused_module, "VOCAB_BLOCK_BYTES", {"cpu": budget, "cuda": budget})
            loss, grads, _ = _value_and_grads(
                lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, temperature, divergence,
                                                  weight_grad="vocab_blocks"), hidden, weight, dtype)
            torch.testing.assert_close(loss.double(), ref_loss, rtol=tolerance, atol=tolerance / 100)
            for grad, ref_grad in zip(grads, ref_grads):
                torch.testing.assert_close(grad.double(), ref_grad, rtol=tolerance, atol=tolerance / 100)
    assert blocks == ([] if format == "full" else [1, 1, 5, 5, V, V])  # the full format accumulates


@pytest.mark.timeout(60)
def test_vocab_blocks_round_a_bf16_head_grad_once():
    """A bf16 head: each block's grad_W comes from one GEMM over all rows (fp32 inside, one rounding), so it is at
    least as close to the exact gradient as the fp32 accumulation of per-chunk bf16 products."""
    n, v = 96, 40
    hidden, weight, labels, teacher = _problem("topk", 1.0, n=n, v=v, seed=130)
    exact = _value_and_grads(lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, n, 0.5, 1.0, chunk_size=8),
                             hidden, weight, torch.float64)[1][1]
    errors = {}
    for weight_grad in ("accumulate", "vocab_blocks"):
        grad_w = _value_and_grads(
            lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, n, 0.5, 1.0, chunk_size=8,
                                              weight_grad=weight_grad), hidden, weight, torch.bfloat16)[1][1]
        assert grad_w.dtype == torch.bfloat16
        errors[weight_grad] = ((grad_w.double() - exact).norm() / exact.norm()).item()
    assert errors["vocab_blocks"] < 2e-2, errors
    assert errors["vocab_blocks"] <= errors["accumulate"] * 1.05, errors
    with pytest.raises(ValueError, match="weight_grad"):
        fused_linear_kd_loss(hidden, weight, labels, teacher, n, 0.5, 1.0, weight_grad="blocks")
