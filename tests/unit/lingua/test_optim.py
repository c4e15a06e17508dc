"""Learning-rate schedules, parameter groups and gradient clipping (single process, plain tensors)."""

import math

import pytest
import torch
from torch import nn

from lingua.optim import OptimArgs, build_optimizer, clip_grad_norm_, lr_factor, param_groups

N = 1000


def factors(args: OptimArgs, n_steps: int = N) -> list[float]:
    return [lr_factor(s, args, n_steps) for s in range(n_steps + 1)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine", "inv_sqrt", "wsd"])
def test_warmup_is_a_linear_ramp_to_one(scheduler):
    args = OptimArgs(scheduler=scheduler, warmup=10)
    f = factors(args)
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[0] > 0  # the first update already moves the weights
    assert f[10] == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_constant():
    assert set(factors(OptimArgs(scheduler="constant", warmup=0))) == {1.0}


@pytest.mark.timeout(30)
def test_linear_reaches_min_ratio_at_the_end():
    args = OptimArgs(scheduler="linear", warmup=100, lr_min_ratio=0.1)
    f = factors(args)
    assert f[100] == pytest.approx(1.0)
    assert f[550] == pytest.approx(0.55)
    assert f[N] == pytest.approx(0.1)
    assert lr_factor(5 * N, args, N) == pytest.approx(0.1)


@pytest.mark.timeout(30)
def test_cosine_shape():
    args = OptimArgs(scheduler="cosine", warmup=100, lr_min_ratio=0.1)
    f = factors(args)
    assert f[100] == pytest.approx(1.0)
    assert f[550] == pytest.approx(0.55)  # halfway down
    assert f[N] == pytest.approx(0.1)
    decay = f[100:]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    # theta > 1 keeps the lr high for longer; still ends at the minimum.
    slow = factors(OptimArgs(scheduler="cosine", warmup=100, lr_min_ratio=0.1, cosine_theta=2.0))
    assert slow[550] > f[550] and slow[N] == pytest.approx(0.1)


@pytest.mark.timeout(30)
def test_cosine_cycles_come_back_up():
    f = factors(OptimArgs(scheduler="cosine", warmup=0, lr_min_ratio=0.0, cycle_length=0.5))
    assert f[500] == pytest.approx(0.0, abs=1e-12)
    assert f[N] == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_inv_sqrt():
    args = OptimArgs(scheduler="inv_sqrt", warmup=100, lr_min_ratio=0.1)
    assert lr_factor(100, args, N) == pytest.approx(1.0)
    assert lr_factor(400, args, N) == pytest.approx(0.5)
    assert lr_factor(10_000, args, N) == pytest.approx(0.1)
    assert lr_factor(1_000_000, args, N) == pytest.approx(0.1)  # floored at lr_min_ratio


@pytest.mark.timeout(30)
def test_wsd_flat_then_decays():
    args = OptimArgs(scheduler="wsd", warmup=100, lr_min_ratio=0.1, decay_fraction=0.2)
    f = factors(args)
    assert set(f[100:801]) == {1.0}
    decay = f[800:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert f[900] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))  # 1-sqrt cooldown
    assert f[N] == pytest.approx(0.1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [dict(scheduler="cosinus"), dict(warmup=-1), dict(lr_min_ratio=2.0),
                                 dict(decay_fraction=1.5), dict(cycle_length=0.0)])
def test_invalid_args_raise_readable_errors(bad):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as err:
        build_optimizer(model, OptimArgs(**bad), 10)
    if "scheduler" in bad:
        assert all(name in str(err.value) for name in ("constant", "linear", "cosine", "inv_sqrt", "wsd"))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 16, bias=False)
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


@pytest.mark.timeout(30)
def test_param_groups_split_matrices_from_vectors():
    model = Tiny()
    groups = param_groups(model, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    no_decay = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decay == {id(model.tok_embeddings.weight), id(model.proj.weight), id(model.output.weight)}
    assert no_decay == {id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}


@pytest.mark.timeout(30)
def test_build_optimizer_applies_the_schedule():
    model = Tiny()
    args = OptimArgs(lr=1e-2, warmup=4, scheduler="cosine", lr_min_ratio=0.0)
    optimizer, scheduler = build_optimizer(model, args, 8)
    unused_row = model.tok_embeddings.weight[5].detach().clone()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    lrs = []
    for _ in range(8):
        lrs.append(scheduler.get_last_lr()[0])
        model.output(model.tok_embeddings(torch.tensor([1, 2]))).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert lrs == pytest.approx([1e-2 * lr_factor(s, args, 8) for s in range(8)])
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    # An embedding row that never got a gradient still shrinks: weight decay applies to embeddings.
    shrunk = model.tok_embeddings.weight[5].detach()
    assert torch.allclose(shrunk, unused_row * math.prod(1 - 1e-2 * lr_factor(s, args, 8) * 0.1 for s in range(8)))


@pytest.mark.timeout(30)
def test_clip_grad_norm_plain_tensors():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(4))
    unused = nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    b.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm_([a, b, unused], max_norm=1.0)
    # A 0-d tensor on the gradients' device: reading it is left to the caller (a host sync on CUDA).
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and float(norm) == pytest.approx(5.0)
    assert torch.linalg.vector_norm(torch.cat([a.grad, b.grad])).item() == pytest.approx(1.0, rel=1e-5)
    # max_norm <= 0 only measures.
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    assert float(clip_grad_norm_([a], max_norm=0.0)) == pytest.approx(3.0)
    assert a.grad[0].item() == 3.0
    assert float(clip_grad_norm_([unused], max_norm=1.0)) == 0.0


@pytest.mark.timeout(60)
def test_every_implementation_steps_fsdp2_dtensor_parameters_as_the_loop_does(train_group):
    """torch's foreach=None takes the per-parameter loop for DTensor parameters (slow on a GPU host); "fused" and
    "foreach", which "auto" picks on a GPU, must give the loop's numbers on FSDP2's DTensors (here on the CPU)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from apps.main.transformer import LMTransformer
    from lingua.parallel.launch_plan import DistributedArgs
    from lingua.parallel.parallelize import parallelize_model
    from tests.unit.apps.main.test_export_hf import tiny_args

    results = {}
    for implementation in ("for_loop", "fused", "foreach"):
        torch.manual_seed(0)
        model = LMTransformer(tiny_args())
        model.init_weights()
        parallelize_model(model, DeviceMesh.from_group(train_group, "cpu"), DistributedArgs())
        optimizer, scheduler = build_optimizer(model, OptimArgs(lr=1e-2, warmup=2, implementation=implementation), 6)
        assert optimizer.defaults["fused"] is (implementation == "fused")
        assert optimizer.defaults["foreach"] is (implementation == "foreach")
        assert all(isinstance(p, DTensor) for p in model.parameters())
        tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(4):
            model(tokens).float().logsumexp(-1).sum().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        results[implementation] = [p.full_tensor().detach().clone() for p in model.parameters()]
    for implementation in ("fused", "foreach"):
        for got, want in zip(results[implementation], results["for_loop"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(30)
def test_auto_is_the_loop_on_the_cpu_and_an_unknown_implementation_is_a_sentence():
    optimizer, _ = build_optimizer(Tiny(), OptimArgs(), 4)
    assert optimizer.defaults["fused"] is False and optimizer.defaults["foreach"] is False  # CPU runs unchanged
    with pytest.raises(ValueError, match="optim.implementation.*auto, fused, foreach, for_loop"):
        build_optimizer(Tiny(), OptimArgs(implementation="apex"), 4)
