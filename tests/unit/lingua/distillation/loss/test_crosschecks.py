"""The KD loss on full logits against two other libraries' distillation losses: TRL's GKD and torchtune's KD losses.

Both the reference `kd_loss` (student logits) and the fused `fused_linear_kd_loss` (hidden states and head) are
checked, value and gradient, on random logits on CPU. Neither library is a dependency of the product:
setup/create_env.sh installs trl==1.16.0 and torchtune==0.6.1 with `--no-deps` for these checks, and without them
the tests skip. TRL's loss is a static method, imported the normal way (its imports, transformers, accelerate and
datasets, are in the venv). `import torchtune` needs torchao, which is not installed, so torchtune's
`modules/loss/kd_losses.py` (whose only imports are torch) is loaded from its file without the package's __init__.

Ours: kd_loss = sum over masked positions of D(p_T || q_T) / their count, p_T, q_T = softmax(logits / T), no T^2
(`divergences.distillation_loss` multiplies KD by alpha T^2 when it mixes it with CE; the fused loss includes it).
"""

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs
from tests.unit.lingua.distillation.loss.logits_kd import kd_loss

B, S, D, V = 2, 6, 5, 17
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
# TRL's beta -> (our divergence, our jsd_beta). Its beta = 0 and 1 are special cases (not the limits of its JSD,
# which tend to 0 there): F.kl_div(log q, log p) = KL(p || q) = our fkl and KL(q || p) = our rkl.
TRL_BETAS = [(0.0, "fkl", 0.5), (1.0, "rkl", 0.5), (0.1, "jsd", 0.1), (0.5, "jsd", 0.5), (0.9, "jsd", 0.9)]
# torchtune's losses -> (their constructor arguments, weight of our fkl, weight of our rkl).
TORCHTUNE_LOSSES = {
    "ForwardKLLoss": ({}, 1.0, 0.0),
    "ForwardKLWithChunkedOutputLoss": ({"num_output_chunks": 3}, 1.0, 0.0),
    "ReverseKLLoss": ({}, 0.0, 1.0),
    "ReverseKLWithChunkedOutputLoss": ({"num_output_chunks": 3}, 0.0, 1.0),
    "SymmetricKLLoss": ({"sym_kd_ratio": 0.3}, 0.3, 0.7),
    "SymmetricKLWithChunkedOutputLoss": ({"num_output_chunks": 3, "sym_kd_ratio": 0.3}, 0.3, 0.7),
}


@pytest.fixture(scope="module")
def trl_gkd():
    """TRL's GKDTrainer (it lives in trl.experimental, which warns on import that its API may change)."""
    pytest.importorskip("trl")
    # Not importorskip: with trl installed, an import error of the trainer's module (a missing dep) must fail.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer


@pytest.fixture(scope="module")
def torchtune_kd():
    """torchtune.modules.loss.kd_losses, loaded from its file: the package's __init__ imports torchao."""
    spec = importlib.util.find_spec("torchtune")  # finds the top-level package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed (setup/create_env.sh installs it --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / "modules" / "loss" / "kd_losses.py"
    file_spec = importlib.util.spec_from_file_location("torchtune_kd_losses", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def _randn(*shape, seed, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _labels(seed):
    """[B, S] labels with -100 at a few positions of each row, as TRL and torchtune both take them."""
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    labels[0, 1::3] = -100
    labels[1, 4:] = -100
    return labels


def _value_and_grads(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss = fn(*leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _full_teacher(teacher_logits, temperature):
    return TeacherOutputs("full", torch.log_softmax(teacher_logits / temperature, -1))


def _teacher_entropy(teacher_logits, labels, temperature):
    """Masked mean of H(p_T): torchtune's "forward KL" is the cross-entropy -sum p log q = KL(p || q) + H(p)."""
    log_p = torch.log_softmax(teacher_logits.double() / temperature, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return entropy[labels != -100].mean()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta,divergence,jsd_beta", TRL_BETAS)
def test_kd_loss_matches_trl_generalized_jsd(trl_gkd, beta, divergence, jsd_beta, temperature, dtype):
    """TRL's GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta, temperature) = kd_loss.

    Mapping: beta = 0 is our fkl, beta = 1 our rkl, 0 < beta < 1 our jsd with jsd_beta = beta (both mix
    m = beta p + (1 - beta) q and weight beta KL(p || m) + (1 - beta) KL(q || m)). Temperature: both divide the
    student's and the teacher's logits by T and neither multiplies by T^2. Normalisation: reduction="batchmean"
    with labels sums over positions with label != -100 and divides by their count, as kd_loss does with
    mask = labels != -100. It computes in the logits' dtype, so fp64 matches to rounding.
    """
    student = _randn(B, S, V, seed=1, dtype=dtype, scale=2.0)
    teacher_logits = _randn(B, S, V, seed=2, dtype=dtype, scale=2.0)
    labels = _labels(3)
    ref, (ref_grad,) = _value_and_grads(
        lambda z: trl_gkd.generalized_jsd_loss(z, teacher_logits, labels, beta=beta, temperature=temperature), student)
    teacher = _full_teacher(teacher_logits, temperature)
    ours, (grad,) = _value_and_grads(
        lambda z: kd_loss(z, teacher, labels != -100, temperature, divergence, jsd_beta, chunk_size=5)[0], student)
    torch.testing.assert_close(ours, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(grad, ref_grad, **TOLERANCE[dtype])


@pytest.mark.timeout(60)
def test_trl_reductions_are_kd_loss_times_a_count(trl_gkd):
    """TRL's other reductions, from our per-token mean (no labels: every position counts): "sum" is the sum over
    the B x S positions, "batchmean" without labels divides that sum by B (a per-sequence sum, not a per-token
    mean), "mean" by B x S x V (every vocabulary entry), and num_items_in_batch=n divides the masked sum by n."""
    student, teacher_logits = _randn(B, S, V, seed=4, scale=2.0), _randn(B, S, V, seed=5, scale=2.0)
    labels = _labels(6)
    every = torch.ones(B, S, dtype=torch.bool)
    mean = kd_loss(student, _full_teacher(teacher_logits, 1.5), every, 1.5, "jsd", 0.3)[0]
    masked_mean = kd_loss(student, _full_teacher(teacher_logits, 1.5), labels != -100, 1.5, "jsd", 0.3)[0]
    count = int((labels != -100).sum())
    expected = {"sum": mean * B * S, "batchmean": mean * S, "mean": mean / V}
    for reduction, value in expected.items():
        theirs = trl_gkd.generalized_jsd_loss(student, teacher_logits, beta=0.3, temperature=1.5, reduction=reduction)
        torch.testing.assert_close(theirs, value, **TOLERANCE[torch.float64])
    theirs = trl_gkd.generalized_jsd_loss(student, teacher_logits, labels, beta=0.3, temperature=1.5,
                                          num_items_in_batch=3 * count)
    torch.testing.assert_close(theirs, masked_mean / 3, **TOLERANCE[torch.float64])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta,divergence,jsd_beta", TRL_BETAS)
def test_fused_loss_matches_trl_generalized_jsd(trl_gkd, beta, divergence, jsd_beta, temperature):
    """fused_linear_kd_loss(h, W, labels, teacher, n, alpha, T) = ((1 - alpha) CE_sum / n + alpha T^2 GKD) on the
    logits h W^T, in fp64, where GKD is TRL's loss with num_items_in_batch = n (our normalizer: here twice the
    masked count, as under gradient accumulation over two micro-batches). Same beta mapping as above."""
    hidden, weight = _randn(B, S, D, seed=7), _randn(V, D, seed=8, scale=0.8)
    teacher_logits = _randn(B, S, V, seed=9, scale=2.0)
    labels = _labels(10)
    normalizer, alpha = 2 * int((labels != -100).sum()), 0.5

    def reference(h, w):
        logits = h @ w.T
        ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum")
        kd = trl_gkd.generalized_jsd_loss(logits, teacher_logits, labels, beta=beta, temperature=temperature,
                                          num_items_in_batch=normalizer)
        return (1 - alpha) * ce / normalizer + alpha * temperature**2 * kd

    ref, ref_grads = _value_and_grads(reference, hidden, weight)
    teacher = _full_teacher(teacher_logits, temperature)
    ours, grads = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, normalizer, alpha, temperature, divergence, jsd_beta,
                                          chunk_size=5)[0], hidden, weight)
    torch.testing.assert_close(ours, ref, **TOLERANCE[torch.float64])
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOLERANCE[torch.float64])


def _torchtune_loss(module, name, student_logits, teacher_logits, labels):
    """Their call convention: the chunked losses take lists of [B, S / chunks, V] logits and [B, S] labels."""
    kwargs, _, _ = TORCHTUNE_LOSSES[name]
    loss_fn = getattr(module, name)(**kwargs)
    if "num_output_chunks" in kwargs:
        chunks = kwargs["num_output_chunks"]
        return loss_fn(list(student_logits.chunk(chunks, dim=1)), list(teacher_logits.chunk(chunks, dim=1)), labels)
    return loss_fn(student_logits.reshape(-1, V), teacher_logits.reshape(-1, V), labels.reshape(-1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", TORCHTUNE_LOSSES)
def test_kd_loss_matches_torchtune(torchtune_kd, name, temperature):
    """torchtune.modules.loss's KD losses = our fkl/rkl mixes, in fp32 (they upcast to fp32 only).

    Mapping: ReverseKLLoss is our rkl. ForwardKLLoss is the cross-entropy -sum p log q: our fkl plus the teacher's
    entropy H(p), a constant for the student, so the same gradient and a value H(p) higher. SymmetricKLLoss(r) is
    r times the former plus (1 - r) times the latter (not one of our divergences; checked as that mix). The
    *WithChunkedOutputLoss versions take the logits in chunks along the sequence and give the same numbers.
    Temperature: they have none; dividing both logits by T before the call gives ours at T (no T^2).
    Normalisation: the sum over positions with label != -100 divided by their count, as kd_loss with that mask.
    """
    _, fkl_weight, rkl_weight = TORCHTUNE_LOSSES[name]
    student = _randn(B, S, V, seed=11, dtype=torch.float32, scale=2.0)
    teacher_logits = _randn(B, S, V, seed=12, dtype=torch.float32, scale=2.0)
    labels = _labels(13)
    ref, (ref_grad,) = _value_and_grads(
        lambda z: _torchtune_loss(torchtune_kd, name, z / temperature, teacher_logits / temperature, labels), student)
    teacher, mask = _full_teacher(teacher_logits, temperature), labels != -100

    def ours_fn(z):
        fkl = kd_loss(z, teacher, mask, temperature, "fkl")[0]
        rkl = kd_loss(z, teacher, mask, temperature, "rkl")[0]
        return fkl_weight * fkl + rkl_weight * rkl

    ours, (grad,) = _value_and_grads(ours_fn, student)
    entropy = fkl_weight * _teacher_entropy(teacher_logits, labels, temperature).float()
    torch.testing.assert_close(ours + entropy, ref, **TOLERANCE[torch.float32])
    torch.testing.assert_close(grad, ref_grad, **TOLERANCE[torch.float32])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", ["ForwardKLWithChunkedOutputLoss", "ReverseKLWithChunkedOutputLoss"])
def test_fused_loss_matches_torchtune(torchtune_kd, name, temperature):
    """fused_linear_kd_loss at alpha = 1 (KD alone, normalizer = the masked count) = T^2 times torchtune's chunked
    forward KL (less the teacher's entropy, see above) or reverse KL on (h W^T) / T, in fp32."""
    _, fkl_weight, _ = TORCHTUNE_LOSSES[name]
    divergence = "fkl" if fkl_weight else "rkl"
    hidden = _randn(B, S, D, seed=14, dtype=torch.float32)
    weight = _randn(V, D, seed=15, dtype=torch.float32, scale=0.8)
    teacher_logits = _randn(B, S, V, seed=16, dtype=torch.float32, scale=2.0)
    labels = _labels(17)
    count = int((labels != -100).sum())
    ref, ref_grads = _value_and_grads(
        lambda h, w: temperature**2 * _torchtune_loss(torchtune_kd, name, h @ w.T / temperature,
                                                      teacher_logits / temperature, labels), hidden, weight)
    teacher = _full_teacher(teacher_logits, temperature)
    ours, grads = _value_and_grads(
        lambda h, w: fused_linear_kd_loss(h, w, labels, teacher, count, 1.0, temperature, divergence,
                                          chunk_size=5)[0], hidden, weight)
    entropy = temperature**2 * fkl_weight * _teacher_entropy(teacher_logits, labels, temperature).float()
    torch.testing.assert_close(ours + entropy, ref, **TOLERANCE[torch.float32])
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOLERANCE[torch.float32])
