"""Training launches on GPUs (NCCL): no host sync per micro-batch, the NCCL run equal to the gloo run, a teacher
failure that ends every rank within seconds, a flight-recorder dump on a hang. Marked `cuda` (skipped without the
GPUs each needs, written to pass with them: `bash setup/gpu_check.sh`) and `slow` (they launch torchrun)."""

import time

import pytest

from lingua.run.dump_dir import train_rows
from tests.gpu.gpus import needs_gpus
from tests.runs import assert_ok, base_overrides, distill_overrides, torchrun, wait_for_step

# bf16, longer windows, and heads of 16 dimensions: flex_attention's GPU kernels take no smaller ones.
GPU_RUN = {"distributed.model_dtype": "bf16", "data.seq_len": 128, "model.max_seqlen": 128, "model.dim": 64,
           "model.n_heads": 4, "model.n_kv_heads": 2}
FLEX_CHOSEN = "document-causal attention on cuda: flex (model.attn_impl=auto)"


def assert_sync_free_run(nproc: int, overrides: list[str], dump) -> None:
    """Six steps under the sync-debug worker ("error" on any host sync after warm-up), with flex attention."""
    result = torchrun(nproc, overrides, timeout=240, module="tests.gpu.workers.sync_debug")
    assert_ok(result)
    assert FLEX_CHOSEN in result.stdout, result.stdout[-4000:]
    assert sorted(train_rows(dump)) == [6]


@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.timeout(300)
def test_no_host_sync_per_micro_batch_with_document_masks(corpus, tmp_path):
    """One GPU, CE: steps 3-6 of 2 micro-batches with document masks (flex attention) under sync-debug "error"."""
    overrides = base_overrides(corpus, tmp_path / "run", steps=6, grad_acc_steps=2,
                               **{**GPU_RUN, "model.attn_mask": "doc_causal", "logging.freq": 100})
    assert_sync_free_run(1, overrides, tmp_path / "run")


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(300)
def test_no_host_sync_per_micro_batch_with_a_teacher(corpus, tiny_teacher, tmp_path):
    """Two GPUs, a student and its teacher: requests, look-ahead and the waits for responses never sync the host."""
    overrides = distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=6, grad_acc_steps=2,
                                  **{**GPU_RUN, "model.attn_mask": "doc_causal", "logging.freq": 100,
                                     "distillation.teacher_dtype": "bf16"})
    assert_sync_free_run(2, overrides, tmp_path / "run")


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(500)
def test_the_nccl_kd_run_starts_where_the_gloo_run_does(corpus, tiny_teacher, tmp_path):
    """A student and its teacher on two GPUs (NCCL), then on CPU (gloo), fp32 without TF32, from the same weights
    (a one-step CPU run's checkpoint: the CUDA and CPU generators draw different inits): the first losses agree
    within bf16 tolerance (the wire carries bf16 log-probs either way)."""
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    init = tmp_path / "init"
    assert_ok(torchrun(1, distill_overrides(corpus, tiny_teacher, init, steps=1, **{
        "enable_distillation": "false", "checkpoint.dump.every": 1}), timeout=120, env=cpu_only))
    rows = {}
    for backend, env in (("nccl", {}), ("gloo", cpu_only)):
        dump = tmp_path / backend
        overrides = distill_overrides(corpus, tiny_teacher, dump, steps=3, **{
            "distributed.backend": backend, "distributed.matmul_allow_tf32": "false",
            "checkpoint.init_ckpt_path": str(init / "checkpoints")})
        result = torchrun(2, overrides, timeout=180, env=env)
        assert_ok(result)
        assert "initialised model weights from" in result.stdout
        rows[backend] = train_rows(dump)
    for step in (1, 2, 3):
        for key in ("loss/total", "loss/ce", "loss/kd"):
            assert rows["nccl"][step][key] == pytest.approx(rows["gloo"][step][key], rel=1e-2), (step, key)
        # Top-1 agreement is a share of 64 positions: a near tie decided differently moves it by 1/64.
        assert abs(rows["nccl"][step]["kd/top1_agreement"] - rows["gloo"][step]["kd/top1_agreement"]) <= 2 / 64


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(240)
def test_a_teacher_failure_ends_every_rank_within_seconds(corpus, tiny_teacher, tmp_path):
    """The teacher fails serving step 3: the student raises its sentence at step 3's agreed point and both ranks
    exit long before any collective timeout (train_timeout_s=120) could have ended them."""
    dump = tmp_path / "run"
    seen = {}

    def note_step_2(proc):
        wait_for_step(dump, 2, timeout=150)
        seen["step_2"] = time.time()

    result = torchrun(2, distill_overrides(corpus, tiny_teacher, dump, steps=8, inject_failure="teacher_serve:0@3",
                                           **{**GPU_RUN, "distributed.train_timeout_s": 120}),
                      timeout=200, signal_plan=note_step_2)
    ended = time.time() - seen["step_2"]
    assert result.returncode != 0
    assert "error: Teacher rank 1 failed at step 3" in result.stdout, result.stdout[-4000:]
    assert ended < 30, ended
    assert sorted(train_rows(dump)) == [1, 2]


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(240)
def test_a_hang_leaves_a_flight_recorder_dump(corpus, tmp_path):
    """distributed.debug=trace, two students, one 4 s late to step 3 with a 2 s collective timeout: NCCL's watchdog
    times the other out and the flight recorder writes its trace under comm_traces/."""
    dump = tmp_path / "run"
    result = torchrun(2, base_overrides(corpus, dump, steps=6, inject_failure="stall:1@3", **{
        **GPU_RUN, "distributed.debug": "trace", "distributed.train_timeout_s": 2}), timeout=200)
    assert result.returncode != 0
    traces = sorted(p.name for p in (dump / "comm_traces").glob("rank_*"))
    assert "rank_0" in traces, (traces, result.stdout[-4000:])
