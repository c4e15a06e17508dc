"""The GPU paths in one process on one GPU: CUDA-event step timing, flex attention for document masks, the fused loss's
fp32 logits and fp32 accumulation of a bf16 head, the teacher loaded straight onto its GPU (whole, or its tensor-
parallel shards streamed). Marked `cuda`: skipped without a GPU, written to pass on one (`bash setup/gpu_check.sh`)."""

import time

import pytest
import torch

from lingua.distillation.loss import fused as fused_module
from lingua.distillation.args import DistillationArgs
from lingua.distillation.loss.chunk import head_logits
from lingua.distillation.loss.fused import accumulates_in_fp32, fused_linear_kd_loss, multiplies_into_fp32
from lingua.distillation.outputs import sparsify_teacher_logits
from lingua.timing import StepTimer
from lingua.transformer import attention, doc_causal_block_mask, doc_causal_bool_mask, resolve_attn_impl
from tests.gpu.gpus import needs_gpus

CUDA = torch.device("cuda", 0)


def gpu_busy_seconds(cycles: int) -> float:
    """Host seconds the GPU takes to spin `cycles` (measured once, synchronised)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@needs_gpus(1)
def test_step_parts_are_timed_on_the_gpu_not_at_launch():
    """A part that only queues GPU work takes the GPU's time, nested parts apart; the host returns at once."""
    torch.cuda.set_device(CUDA)
    cycles = 200_000_000
    busy = gpu_busy_seconds(cycles)
    assert busy > 0.02, busy  # the calibration itself measured something
    timer = StepTimer(CUDA)
    host_start = time.perf_counter()
    with timer.part("fwd_bwd"):
        torch.cuda._sleep(cycles)
        with timer.part("teacher_wait"):
            torch.cuda._sleep(2 * cycles)
    host_s = time.perf_counter() - host_start
    seconds = timer.read()  # waits for the last event
    assert seconds["teacher_wait"] == pytest.approx(2 * busy, rel=0.5)
    assert seconds["fwd_bwd"] == pytest.approx(busy, rel=0.5)  # its own time, the nested wait excluded
    assert host_s < busy / 2  # the host only queued the work: its clock would have said ~0


@needs_gpus(1)
def test_document_masks_run_on_flex_attention_and_match_sdpa():
    """model.attn_impl=auto picks compiled flex_attention on CUDA; it equals SDPA with the dense mask, grads too."""
    assert resolve_attn_impl("auto", CUDA) == "flex"
    generator = torch.Generator(device=CUDA).manual_seed(0)
    B, S, H, KV, Dh = 2, 256, 4, 2, 32
    q, k, v = (torch.randn(B, S, h, Dh, device=CUDA, dtype=torch.bfloat16, generator=generator).requires_grad_()
               for h in (H, KV, KV))
    doc_ids = torch.cat([torch.zeros(B, 100), torch.ones(B, 60), torch.full((B, 96), 2.0)], dim=1).to(CUDA).long()
    outputs, grads = [], []
    for mask in (doc_causal_block_mask(doc_ids), doc_causal_bool_mask(doc_ids)):
        out = attention(q, k, v, mask)
        out.float().square().sum().backward()
        outputs.append(out.float())
        grads.append([t.grad.float().clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-2)  # bf16 kernels
    for flex_grad, sdpa_grad in zip(*grads):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=5e-2, atol=5e-2)


def head_problem(N, D, V, k, seed):
    """(hidden, weight, labels, top-k teacher correlated with the student) on the GPU, in fp32."""
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    hidden = torch.randn(N, D, device=CUDA, generator=generator)
    weight = torch.randn(V, D, device=CUDA, generator=generator) * 0.05
    labels = torch.randint(0, V, (N,), device=CUDA, generator=generator)
    teacher = sparsify_teacher_logits(hidden @ weight.T + torch.randn(N, V, device=CUDA, generator=generator),
                                      "topk", k, 1.0)
    return hidden, weight, labels, teacher


def head_grads(dtype, teacher, hidden, weight, labels):
    h = hidden.detach().to(dtype).requires_grad_()  # detached: .to(float32) of fp32 would return `weight` itself
    w = weight.detach().to(dtype).requires_grad_()
    loss, _ = fused_linear_kd_loss(h, w, labels, teacher, int((labels != -100).sum()), 0.5, 1.0, chunk_size=128)
    loss.backward()
    return w.grad.double()


@needs_gpus(1)
def test_a_bf16_head_gradient_is_summed_in_fp32_without_a_bf16_temporary(monkeypatch):
    """On CUDA each chunk's bf16 grad_W GEMM adds into the fp32 accumulator (addmm with out_dtype): no [V, D] bf16
    product per chunk, and no rounding of it either, so the result is at least as close to fp32's."""
    if not accumulates_in_fp32(CUDA, torch.bfloat16):  # older kernels want the added tensor in the inputs' dtype
        pytest.skip(f"torch {torch.__version__}'s CUDA addmm(out_dtype=float32) refuses an fp32 accumulator: the "
                    f"fused loss keeps its bf16 [V, D] product per chunk here")
    hidden, weight, labels, teacher = head_problem(1024, 256, 8192, 16, seed=0)
    exact = head_grads(torch.float32, teacher, hidden, weight, labels)
    fused = head_grads(torch.bfloat16, teacher, hidden, weight, labels)
    monkeypatch.setattr(fused_module, "accumulates_in_fp32", lambda device, dtype: False)
    with_temporary = head_grads(torch.bfloat16, teacher, hidden, weight, labels)
    error, temporary_error = ((g - exact).norm() / exact.norm() for g in (fused, with_temporary))
    assert error < 2e-2, error
    assert error <= temporary_error * 1.05, (error, temporary_error)


@needs_gpus(1)
def test_a_bf16_head_forms_its_logits_through_the_fp32_accumulator():
    """On CUDA the fused loss's chunk logits of a bf16 head come out of the GEMM's fp32 accumulator (torch.mm with
    out_dtype, `multiplies_into_fp32`): as close to float64's as the upcast operands' fp32 GEMM, far closer than the
    bf16-rounded logits it once formed; then issue 50's synthetic check (N = 256, V = 32,768, logits up to ~15.5, a
    perturbed-student teacher, top-64) on the GPU: bf16's top-1 agreement equals fp32's and its KD is within 1e-4."""
    if not multiplies_into_fp32(CUDA, torch.bfloat16):
        pytest.skip(f"torch {torch.__version__}'s CUDA mm has no out_dtype=float32 for bf16: the upcast runs instead")
    generator = torch.Generator(device=CUDA).manual_seed(0)
    N, V, D, K = 256, 32768, 64, 64
    hidden = torch.randn(N, D, device=CUDA, generator=generator).bfloat16()
    head = (torch.randn(V, D, device=CUDA, generator=generator) * 0.33).bfloat16()
    exact = hidden.double() @ head.double().T
    accumulator = head_logits(hidden, head, torch.float32, fp32_mm=True)
    upcast = head_logits(hidden, head, torch.float32, fp32_mm=False)
    rounded = (hidden @ head.T).float()
    errors = [(logits.double() - exact).abs().max().item() for logits in (accumulator, upcast, rounded)]
    assert errors[0] < 1e-4 and errors[1] < 1e-4 and errors[2] > 100 * errors[0], errors
    labels = torch.randint(0, V, (N,), device=CUDA, generator=generator)
    teacher = sparsify_teacher_logits(exact.float() + 0.3 * torch.randn(N, V, device=CUDA, generator=generator),
                                      "topk", K, 1.0, wire_dtype=torch.float32)
    stats = [fused_linear_kd_loss(hidden.to(dtype), head.to(dtype), labels, teacher, N, 0.5, 1.0)[1].cpu()
             for dtype in (torch.bfloat16, torch.float32)]
    assert stats[0][3] == stats[1][3], stats  # top-1 agreement
    assert abs(stats[0][1] - stats[1][1]) <= 1e-4 * stats[1][1], stats  # KD


@needs_gpus(1)
def test_vocab_blocks_round_a_bf16_head_gradient_once_and_peak_lower():
    """weight_grad="vocab_blocks" on CUDA: each block's bf16 grad_W GEMM over all rows rounds once, so it is as close to
    fp32's as the fp32 accumulation, and without the fp32 [V, D] accumulator its peak is lower (issue 34)."""
    N = 2048
    hidden, weight, labels, teacher = head_problem(N, 256, 32768, 64, seed=1)
    exact = head_grads(torch.float32, teacher, hidden, weight, labels)
    grads, peaks = {}, {}
    for weight_grad in ("accumulate", "vocab_blocks"):
        h = hidden.to(torch.bfloat16).requires_grad_()
        w = weight.to(torch.bfloat16).requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, _ = fused_linear_kd_loss(h, w, labels, teacher, N, 0.5, 1.0, weight_grad=weight_grad)
        loss.backward()
        torch.cuda.synchronize()
        peaks[weight_grad] = torch.cuda.max_memory_allocated() - base
        grads[weight_grad] = w.grad.double()
    error = {name: ((g - exact).norm() / exact.norm()).item() for name, g in grads.items()}
    assert error["vocab_blocks"] < 2e-2 and error["vocab_blocks"] <= error["accumulate"] * 1.05, error
    assert peaks["vocab_blocks"] < peaks["accumulate"], peaks


@needs_gpus(1)
def test_the_teacher_loads_straight_onto_its_gpu_and_sizes_its_logits_chunks(tiny_teacher):
    """transformers loads the teacher onto its GPU (device_map), in bf16; logits chunks come from its free memory."""
    from lingua.distillation.teacher.model import TeacherModel

    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher)), CUDA)
    assert {p.device for p in teacher.model.parameters()} == {CUDA}
    assert {p.dtype for p in teacher.model.parameters()} == {torch.bfloat16}  # teacher_dtype=auto on GPU
    assert teacher.free_bytes > 0
    rows = teacher.logits_chunk_rows(64)
    assert rows >= 1 and rows & (rows - 1) == 0  # a power of two
    hidden = torch.randn(8, 64, teacher.model.config.hidden_size, device=CUDA, dtype=torch.bfloat16)
    outputs = teacher.sparse_outputs(hidden, "topk", 8, torch.bfloat16, teacher.vocab_size)
    assert outputs.values.shape == (8, 64, 8) and outputs.values.device == CUDA


@needs_gpus(1)
def test_a_tensor_parallel_teacher_streams_its_shards_onto_its_gpu(tiny_teacher):
    """teacher_tp on CUDA: the skeleton's meta shards are read from the safetensors file straight onto the GPU (a
    1-rank NCCL group: every shard is the whole tensor), and the forward is the unsharded teacher's."""
    import socket

    import torch.distributed as dist

    from lingua.distillation.teacher.model import TeacherModel

    owns_world = not dist.is_initialized()
    if owns_world:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.cuda.set_device(CUDA)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=CUDA)
    try:
        group = dist.new_group([0], backend="nccl")
        args = DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="bf16")
        streamed, whole = TeacherModel(args, CUDA, tp_group=group), TeacherModel(args, CUDA)
        assert streamed.checkpoint is not None and streamed.checkpoint.read_bytes > 0
        local = [getattr(p, "to_local", lambda p=p: p)() for p in streamed.model.parameters()]
        assert {t.device for t in local} == {CUDA} and {t.dtype for t in local} == {torch.bfloat16}
        assert {b.device for b in streamed.model.buffers()} == {CUDA}
        tokens = torch.randint(3, 512, (2, 32), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
        torch.testing.assert_close(streamed.hidden_states(tokens), whole.hidden_states(tokens))
        hidden = whole.hidden_states(tokens)
        got = streamed.sparse_outputs(hidden, "topk", 8, torch.float32, 512)
        want = whole.sparse_outputs(hidden, "topk", 8, torch.float32, 512)
        torch.testing.assert_close(got.values, want.values)
    finally:
        if owns_world:
            dist.destroy_process_group()


@needs_gpus(1)
def test_the_compiled_chunk_math_runs_as_triton_and_matches_eager_in_bf16():
    """fused_linear_kd_loss(compiled=True) on CUDA (inductor's Triton kernels, the fp32 logits buffer written in
    place): the loss and both bf16 grads agree with the eager path's to bf16 rounding, for CE and top-k KD at T = 1
    and 2, over two steps of a step whose last chunk is short, with one compile per configuration."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    N = 1000  # chunks of 384 rows: the last one (232) is padded
    hidden, weight, labels, teacher = head_problem(N, 256, 32768, 64, seed=2)
    configs = [(None, 1.0), (teacher, 1.0), (teacher, 2.0)]
    for config_teacher, temperature in configs:
        results = {}
        for compiled in (False, True, True):
            h = hidden.to(torch.bfloat16).requires_grad_()
            w = weight.to(torch.bfloat16).requires_grad_()
            loss, stats = fused_linear_kd_loss(h, w, labels, config_teacher, N, 0.5, temperature, chunk_size=384,
                                               compiled=compiled)
            loss.backward()
            results[compiled] = (loss.double(), stats.double(), h.grad.double(), w.grad.double())
        for compiled_value, eager_value in zip(results[True], results[False]):
            error = ((compiled_value - eager_value).norm() / eager_value.norm().clamp_min(1e-12)).item()
            assert error < 2e-2, (temperature, config_teacher is None, error)
    assert counters["stats"]["unique_graphs"] == len(configs), dict(counters["stats"])
    torch._dynamo.reset()


@needs_gpus(1)
def test_several_teachers_on_shared_head_gemms_match_the_cpu_in_bf16():
    """distillation.teachers: the fused loss with more_teachers on a bf16 head (the fp32 accumulation path) gives the
    CPU's fp32 loss and gradients within bf16 rounding."""
    from lingua.distillation.loss.mixture import mixing_weights, source_routing
    from lingua.distillation.loss.mixture import head_loss_path, teachers_head_loss
    from lingua.distillation.args import TeacherArgs

    generator = torch.Generator().manual_seed(0)
    B, S, D, V, k = 2, 64, 64, 1000, 8
    hidden = torch.randn(B, S, D, generator=generator)
    head = torch.randn(V, D, generator=generator) * 0.1
    labels = torch.randint(0, V, (B, S), generator=generator)
    outputs = [sparsify_teacher_logits(torch.randn(B, S, V, generator=generator), "topk", k, 1.0) for _ in range(2)]
    weights = mixing_weights(source_routing([TeacherArgs(weight=2.0), TeacherArgs(sources=["b"])], ["a", "b"]),
                             torch.tensor([0, 1]), [None, None], (B, S))
    args = DistillationArgs(alpha=0.5)
    results = []
    for device, dtype in (("cpu", torch.float32), (CUDA, torch.bfloat16)):
        h = hidden.to(device, dtype).clone().requires_grad_()
        w = head.to(device, dtype).clone().requires_grad_()
        loss, stats = teachers_head_loss(head_loss_path(args), h, w, labels.to(device), [o.to(device) for o in outputs],
                                         [x.to(device) for x in weights], B * S, 0.5, args)
        loss.backward()
        stats = torch.cat([stats[name].reshape(-1) for name in stats])  # by name, in the paths' order
        results.append((loss.float().cpu(), stats.cpu(), h.grad.float().cpu(), w.grad.float().cpu()))
    (cpu_loss, cpu_stats, *cpu_grads), (gpu_loss, gpu_stats, *gpu_grads) = results
    assert gpu_loss.item() == pytest.approx(cpu_loss.item(), rel=2e-2)
    torch.testing.assert_close(gpu_stats, cpu_stats, rtol=5e-2, atol=1e-3)
    for gpu_grad, cpu_grad in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(gpu_grad, cpu_grad, rtol=5e-2, atol=5e-3)


@needs_gpus(1)
def test_adamw_is_fused_on_the_gpu_and_steps_as_the_loop_does():
    """optim.implementation=auto is fused AdamW on a GPU (the per-parameter loop, which an explicit fused=False
    with foreach=None meant, took 159 ms a step of a 139M student on an H100), with the loop's numbers."""
    from apps.main.transformer import LMTransformer
    from lingua.optim import OptimArgs, build_optimizer
    from tests.unit.apps.main.test_export_hf import tiny_args

    weights = {}
    for implementation in ("auto", "for_loop"):
        torch.manual_seed(0)
        model = LMTransformer(tiny_args()).to(CUDA)
        model.init_weights()
        optimizer, _ = build_optimizer(model, OptimArgs(lr=1e-2, warmup=2, implementation=implementation), 6)
        assert optimizer.defaults["fused"] is (implementation == "auto")
        tokens = torch.randint(0, 200, (2, 16), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
        for _ in range(3):
            model(tokens).float().logsumexp(-1).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        weights[implementation] = [p.detach().clone() for p in model.parameters()]
    for got, want in zip(weights["auto"], weights["for_loop"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
