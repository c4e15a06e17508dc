"""The no-hang matrix (2 students + 1 teacher unless noted). Every case finishes, or fails with a
readable error, in well under 60 s of its own."""

import json
import time

import pytest

from tests.dist.conftest import distill_overrides, read_metrics, train_rows
from tests.dist.launch import torchrun
from tests.dist.test_train import assert_ok, signal_ranks


@pytest.mark.timeout(150)
@pytest.mark.parametrize("delay_s", [0.5, 2.0])
def test_sigusr2_to_the_teacher_then_a_student_seconds_apart(corpus, tiny_teacher, tmp_path, delay_s):
    dump = tmp_path / "run"
    delivered: list[int] = []
    # The teacher first, then a student: after 0.5 s it usually lands while the ranks agree or save;
    # after 2 s the job may already be gone (the agreed stop fits in that), which is a clean outcome too.
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000), timeout=120,
                      signal_plan=signal_ranks(dump, [(2, 0.0), (1, delay_s)], delivered=delivered))
    assert_ok(result)
    assert delivered[0] == 2
    saved = [p for p in (dump / "checkpoints").iterdir() if not p.name.endswith(".tmp")]
    assert len(saved) == 1 and int(saved[0].name) == max(train_rows(dump))
    assert "run preempted" in result.stdout and "STOP received" in result.stdout


@pytest.mark.timeout(90)
def test_student_raising_mid_step_ends_the_job_fast(corpus, tiny_teacher, tmp_path):
    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=50, inject_failure="raise:1@3"),
                      timeout=75)
    elapsed = time.time() - start
    assert result.returncode != 0
    assert "injected failure on train rank 1 at step 3" in result.stdout
    assert elapsed < 60, f"took {elapsed:.0f}s: some rank waited out a timeout"


@pytest.mark.timeout(150)
def test_eval_with_different_batch_counts_per_rank(corpus, tiny_teacher, tmp_path):
    # One validation file read with a line stride: rank 0 gets the long documents, rank 1 the short ones.
    root = tmp_path / "corpus"
    (root / "text").mkdir(parents=True)
    for chunk in (corpus / "text").glob("*.chunk.*.jsonl"):
        (root / "text" / chunk.name).write_text(chunk.read_text())
    with open(root / "text" / "text.val.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": ("long document " * 60) if i % 2 == 0 else "short."}) + "\n")
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(root, tiny_teacher, dump, steps=2, **{"eval.every": 2,
                                                                                "eval.max_batches": 100}), timeout=120)
    assert_ok(result)
    assert "ranks hold different numbers of eval batches" in result.stdout
    evals = [r for r in read_metrics(dump) if "eval/loss" in r]
    assert len(evals) == 1 and evals[0]["step"] == 2 and evals[0]["eval/loss"] > 0


@pytest.mark.timeout(90)
def test_debug_switch_turns_a_mismatched_collective_into_an_error(tmp_path):
    start = time.time()
    result = torchrun(2, [str(tmp_path)], timeout=75, module="tests.dist.workers.mismatch")
    assert result.returncode != 0
    assert "ALLREDUCE" in result.stdout and "BROADCAST" in result.stdout, result.stdout[-3000:]
    assert time.time() - start < 60


@pytest.mark.timeout(150)
def test_debug_switch_logs_collectives_and_startup_files_are_complete(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=2, **{"distributed.debug": "true"}),
                      timeout=120)
    assert_ok(result)
    assert "collective #1 on bridge_0: all_gather handshake" in result.stdout
    assert "on train: all_reduce(max) agree_flags" in result.stdout
    student_phases = {"process_group_init", "tokenizer_init", "model_build", "teacher_handshake", "checkpoint_load",
                      "data_init", "first_step", "first_teacher_round_trip"}
    for rank, expected in ((0, student_phases), (1, student_phases), (2, {"process_group_init", "teacher_load"})):
        rows = [json.loads(l) for l in (dump / f"startup.{rank}.jsonl").read_text().splitlines()]
        assert expected <= {r["phase"] for r in rows}, (rank, rows)
        assert all(r["seconds"] >= 0 for r in rows)
    assert "startup phases (all ranks)" in result.stdout and "slowest" in result.stdout
