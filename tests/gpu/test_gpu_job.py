"""What an 8-GPU job runs, sized for the GPUs present (issue 27 item 12): several students with a teacher in bf16,
compiled, with look-ahead; a tensor-parallel teacher on NCCL against one rank; NCCL's own watchdog dump on a hang;
a failing teacher whose last large replies must arrive before it aborts. Marked `cuda` and `slow` (they launch
torchrun; each skips, saying why, with fewer GPUs than it needs: `bash setup/gpu_check.sh`)."""

import time

import pytest

from lingua.run.dump_dir import train_rows
from tests.gpu.gpus import needs_gpus
from tests.gpu.test_gpu_runs import GPU_RUN
from tests.runs import assert_ok, base_overrides, distill_overrides, torchrun, wait_for_step

BF16_KD = {**GPU_RUN, "distillation.teacher_dtype": "bf16", "model.attn_mask": "doc_causal"}


@pytest.mark.slow
@needs_gpus(4)
@pytest.mark.timeout(480)
def test_three_students_and_a_teacher_in_bf16_compiled_with_look_ahead(corpus, tiny_teacher, tmp_path):
    """3 students + 1 teacher, bf16, distributed.compile=true, one request ahead, document masks: every step
    logged with finite losses, the teacher's look-ahead in flight, a clean exit (what configs/distill_exps/debug.yaml
    runs on 8 GPUs)."""
    dump = tmp_path / "run"
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, dump, steps=8, grad_acc_steps=2, **{
        **BF16_KD, "distributed.compile": "true", "distillation.prefetch": 1, "distributed.init_timeout_s": 300}),
        timeout=420)
    assert_ok(result)
    rows = train_rows(dump)
    assert sorted(rows) == list(range(1, 9)), sorted(rows)
    for step, row in rows.items():
        assert all(row[key] == row[key] and abs(row[key]) < 1e4 for key in ("loss/ce", "loss/kd", "loss/total")), row
    assert rows[8]["loss/ce"] < rows[1]["loss/ce"]


@pytest.mark.slow
@needs_gpus(3)
@pytest.mark.timeout(480)
def test_a_tensor_parallel_teacher_on_nccl_gives_what_one_rank_gives(corpus, tiny_teacher, tmp_path):
    """One student, its teacher on one GPU then sharded over two (teacher_tp=2, vocabulary-parallel outputs over
    NCCL), from the same student weights: the KD losses of every step agree within bf16 tolerance."""
    rows = {}
    for tp in (1, 2):
        dump = tmp_path / f"tp{tp}"
        result = torchrun(1 + tp, distill_overrides(corpus, tiny_teacher, dump, steps=4, **{
            **BF16_KD, "distillation.teacher_tp": tp, "distillation.n_teacher_ranks": tp,
            "distributed.matmul_allow_tf32": "false"}), timeout=220)
        assert_ok(result)
        rows[tp] = train_rows(dump)
    for step in (1, 2, 3, 4):
        for key in ("loss/total", "loss/ce", "loss/kd", "kd/teacher_mass"):
            assert rows[2][step][key] == pytest.approx(rows[1][step][key], rel=2e-2), (step, key)


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(300)
def test_the_nccl_watchdog_itself_dumps_the_flight_recorder_on_a_hang(corpus, tmp_path):
    """distributed.debug=trace, one of two students 4 s late with a 2 s timeout: NCCL's watchdog itself (not our
    watch thread, whose dumps go to comm_traces/) writes its trace where TORCH_FR_DUMP_TEMP_FILE says."""
    dump, own = tmp_path / "run", tmp_path / "watchdog"
    own.mkdir()
    result = torchrun(2, base_overrides(corpus, dump, steps=6, inject_failure="stall:1@3", **{
        **GPU_RUN, "distributed.debug": "trace", "distributed.train_timeout_s": 2}), timeout=240,
        env={"TORCH_FR_DUMP_TEMP_FILE": str(own / "rank_"), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert result.returncode != 0
    written = sorted(p.name for p in own.glob("rank_*"))
    assert written, (sorted(p.name for p in tmp_path.rglob("*")), result.stdout[-4000:])


@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.timeout(300)
def test_a_failing_teacher_delivers_its_large_last_replies_before_it_aborts(corpus, tiny_teacher, tmp_path):
    """output=full (8 x 128 x 512 fp32 logits per reply), the teacher fails serving step 3: it answers until the
    student leaves, synchronises, then aborts; the student raises the teacher's sentence within seconds, long
    before the 120 s collective timeout (an abort that cancelled the queued replies would leave it waiting)."""
    dump = tmp_path / "run"
    seen = {}

    def note_step_2(proc):
        wait_for_step(dump, 2, timeout=200)
        seen["step_2"] = time.time()

    result = torchrun(2, distill_overrides(corpus, tiny_teacher, dump, steps=8, inject_failure="teacher_serve:0@3", **{
        **BF16_KD, "distillation.output": "full", "distillation.wire_dtype": "fp32", "data.batch_size": 8,
        "distributed.train_timeout_s": 120}), timeout=260, signal_plan=note_step_2)
    assert result.returncode != 0
    assert "error: Teacher rank 1 failed at step 3" in result.stdout, result.stdout[-4000:]
    assert time.time() - seen["step_2"] < 40
    assert "answered" in result.stdout and "until the students left" in result.stdout, result.stdout[-4000:]
