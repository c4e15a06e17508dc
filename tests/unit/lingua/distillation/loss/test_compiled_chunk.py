"""fused_linear_kd_loss(compiled=True): the chunk math through torch.compile equals the eager path (value, grads,
stats) and the float64 reference, with KD weights, masked rows and inf/nan teachers where they must not count,
with one compile per static configuration (the short last chunk is padded) and no host reads. The fast test
traces through "aot_eager" (dynamo + functionalization, no codegen); the slow one through inductor's C++ backend,
the CPU side of the route that emits Triton on CUDA (a cold inductor cache spends ~1 min on its first compile)."""

import pytest
import torch
from torch._dynamo.utils import counters

from lingua.distillation.loss import compiled_chunk
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs
from tests.unit.lingua.distillation.loss.test_fused import N, V, _problem, _reference, _value_and_grads

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """A clean compile cache and counters, room for every configuration of a test, and the backend to use."""
    def use(backend):
        monkeypatch.setattr(compiled_chunk, "BACKEND", backend)
        monkeypatch.setattr(compiled_chunk, "_compiled", {})
        monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)
        torch._dynamo.reset()
        counters.clear()
    yield use
    torch._dynamo.reset()


def _kd_problem(format, temperature, seed):
    """(hidden, weight, labels, teacher, dirty teacher, kd_weight): some labels ignored, some KD weights 0, and
    the dirty teacher nan/inf/out-of-range wherever the label is ignored or the weight is 0."""
    hidden, weight, labels, teacher = _problem(format or "topk", temperature, seed=seed)
    kd_weight = torch.rand(N, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)
    kd_weight[0] = kd_weight[5] = 0.0
    if format is None:
        return hidden, weight, labels, None, None, None
    dirty = [t.clone() for t in teacher.tensors()]
    hidden_rows = (labels == -100) | (kd_weight == 0)
    dirty[0][hidden_rows] = float("nan")
    if format != "full":
        dirty[1][hidden_rows] = V + 1000
        dirty[2][hidden_rows] = float("inf")
    return hidden, weight, labels, teacher, TeacherOutputs.from_tensors(format, dirty), kd_weight


def _check_configs(configs, dtype=torch.float32, compiled_rtol=1e-6, weight_grads=("accumulate",)):
    """Every (format, divergence, T): compiled == eager and both == the float64 reference, two steps of chunks of
    3 rows (N = 10: the last chunk has 1 row), host reads trapped on the second (warm) step, which alternates the
    head-gradient mode."""
    for format, divergence, temperature in configs:
        hidden, weight, labels, teacher, dirty, kd_weight = _kd_problem(format, temperature, seed=200)
        ref_loss, ref_grads, _ = _value_and_grads(
            lambda h, w: _reference(h, w, labels, teacher, 7, 0.5, temperature, divergence, kd_weight=kd_weight),
            hidden, weight, torch.float64)
        kd_weight = None if kd_weight is None else kd_weight.to(dtype)
        for step, weight_grad in enumerate(weight_grads * 2):
            results = {}
            for compiled in (False, True):
                # (float64 is a test dtype: dynamo's guards read its 0-dim CPU scale tensors' values on the host)
                trap = step > 0 and compiled and dtype != torch.float64
                calls = []
                with pytest.MonkeyPatch.context() as patch:
                    for name in HOST_READS if trap else ():
                        original = getattr(torch.Tensor, name)
                        patch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=original, **kw:
                                      calls.append(_n) or _o(self, *a, **kw))
                    results[compiled] = _value_and_grads(
                        lambda h, w: fused_linear_kd_loss(h, w, labels, dirty, 7, 0.5, temperature, divergence,
                                                          chunk_size=3, kd_weight=kd_weight, weight_grad=weight_grad,
                                                          compiled=compiled), hidden, weight, dtype)
                assert calls == [], (format, divergence, temperature, calls)
            (loss, grads, stats), (eager_loss, eager_grads, eager_stats) = results[True], results[False]
            where = (format, divergence, temperature, weight_grad)
            assert loss.dtype == eager_loss.dtype and all(g.dtype == dtype for g in grads), where
            torch.testing.assert_close(loss, eager_loss, rtol=compiled_rtol, atol=compiled_rtol / 10, msg=str(where))
            torch.testing.assert_close(stats, eager_stats, rtol=compiled_rtol, atol=compiled_rtol, msg=str(where))
            for grad, eager_grad, ref_grad in zip(grads, eager_grads, ref_grads):
                torch.testing.assert_close(grad, eager_grad, rtol=compiled_rtol, atol=compiled_rtol / 10,
                                           msg=str(where))
                if dtype != torch.bfloat16:
                    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6, msg=str(where))
            if dtype != torch.bfloat16:
                torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6, msg=str(where))


@pytest.mark.timeout(120)
def test_compiled_chunks_trace_once_per_configuration_and_equal_eager(fresh_dynamo):
    """CE, top-k (T = 1 and 2), sampled and full through dynamo's trace (aot_eager): the same results as eager, the
    vocabulary-blocked head grad included, and one graph per configuration over two steps of uneven chunks."""
    fresh_dynamo("aot_eager")
    configs = [(None, "fkl", 1.0), ("topk", "jsd", 1.0), ("topk", "fkl", 2.0), ("sampled", "fkl", 1.0),
               ("full", "rkl", 2.0)]
    _check_configs(configs, weight_grads=("accumulate", "vocab_blocks"))
    assert counters["stats"]["unique_graphs"] == len(configs), dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_cpp_chunks_equal_eager_for_every_format_and_divergence(fresh_dynamo):
    """Inductor's C++ code for every format and divergence (and CE), at T = 1 and 2: tight fp32 agreement with
    eager, the float64 reference's tolerances, one compile each; a bf16 head (its logits in fp32, the same graphs)
    and float64. (Every format/divergence/T pairing is traced by the fast test; each compile costs seconds here.)"""
    fresh_dynamo("inductor")
    configs = [(None, "fkl", 1.0), ("topk", "fkl", 1.0), ("topk", "rkl", 1.0), ("topk", "jsd", 2.0),
               ("sampled", "fkl", 1.0), ("full", "rkl", 2.0), ("full", "jsd", 1.0)]
    _check_configs(configs, weight_grads=("accumulate", "vocab_blocks"))
    assert counters["stats"]["unique_graphs"] == len(configs), dict(counters["stats"])
    _check_configs([(None, "fkl", 1.0), ("topk", "fkl", 1.0)], dtype=torch.bfloat16, compiled_rtol=2e-2)
    _check_configs([("topk", "rkl", 2.0)], dtype=torch.float64, compiled_rtol=1e-12)
    # A bf16 head's logits reach the compiled chunk in fp32 (`chunk.head_logits`): its chunks run the fp32 graphs
    # already compiled above; float64 compiles one more.
    assert counters["stats"]["unique_graphs"] == len(configs) + 1, dict(counters["stats"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("format", [None, "topk"])
def test_the_z_loss_compiled_equals_eager(fresh_dynamo, format):
    """The z-loss through the compiled chunk (CE alone: its own kernel, the GPU's default; and with a teacher)
    gives the eager chunk's loss, grads and statistics."""
    fresh_dynamo("aot_eager")
    hidden, weight, labels, teacher, _, kd_weight = _kd_problem(format, 1.0, seed=210)
    results = []
    for compiled in (False, True):
        results.append(_value_and_grads(
            lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, 7, 0.5, 1.0, chunk_size=3, kd_weight=kd_weight,
                                              compiled=compiled, z_loss=0.05), hidden, weight, torch.float64))
    (eager_loss, eager_grads, eager_stats), (loss, grads, stats) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=0)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(stats, eager_stats, rtol=1e-6, atol=0)
    assert stats[-1] > 0  # the z-loss's sum, last
