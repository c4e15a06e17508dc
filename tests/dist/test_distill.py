"""Online distillation with 2 students + 1 teacher under torchrun on CPU/gloo."""

import time

import pytest

from tests.dist.conftest import distill_overrides, train_rows
from tests.dist.launch import torchrun
from tests.dist.test_train import assert_ok, signal_ranks


@pytest.mark.timeout(300)
def test_kd_training_resume_gradacc_probe_and_clean_stop(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    first = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, exit_after_steps=3, probe_freq=2,
                                          grad_acc_steps=2), timeout=150)
    assert_ok(first)
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        for key in ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "speed/teacher_wait_s"):
            assert key in row, key
        assert 0.0 <= row["kd/top1_agreement"] <= 1.0
        assert 0.0 < row["kd/teacher_mass"] <= 1.0 + 1e-6
        assert row["loss/kd"] > 0
        assert row["loss/total"] == pytest.approx(0.5 * row["loss/ce"] + 0.5 * row["loss/kd"], rel=1e-4)
    assert (dump / "probe" / "probe.0.jsonl").exists() and (dump / "probe" / "probe.1.jsonl").exists()
    assert not (dump / "probe" / "probe.2.jsonl").exists()  # the teacher runs no probe
    assert "sent STOP to teacher" in first.stdout and "STOP received" in first.stdout
    # Resume: a fresh teacher serves step 4 (it never counted steps).
    second = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, grad_acc_steps=2), timeout=150)
    assert_ok(second)
    assert "resumed from step 3" in second.stdout
    assert sorted(train_rows(dump)) == [1, 2, 3, 4]


@pytest.mark.timeout(200)
def test_distillation_off_trains_on_all_three_ranks(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=3, enable_distillation="false"), timeout=150)
    assert_ok(result)
    assert "role=teacher" not in result.stdout and result.stdout.count("role=student") >= 3
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3] and "loss/kd" not in rows[1]
    assert rows[1]["stragglers/step_slowest_rank"] in (0, 1, 2)


@pytest.mark.timeout(60)
def test_missing_teacher_path_fails_fast_on_every_rank(corpus, tmp_path):
    start = time.time()
    missing = tmp_path / "no-such-teacher"
    result = torchrun(3, distill_overrides(corpus, missing, tmp_path / "run", steps=3,
                                           **{"data.tokenizer.name": "bytes"}), timeout=45)
    assert result.returncode != 0
    assert time.time() - start < 30
    # The teacher's reason reaches the students: every rank prints it.
    assert result.stdout.count(f"teacher path '{missing}' does not exist") >= 3, result.stdout[-4000:]


@pytest.mark.timeout(90)
def test_vocab_mismatch_is_reported_at_the_handshake(corpus, tiny_teacher, tmp_path):
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=3,
                                           **{"data.tokenizer.name": "bytes"}), timeout=60)
    assert result.returncode != 0
    assert "does not match the teacher's" in result.stdout
    assert "data.tokenizer.name=hf" in result.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("output", ["topk", "full"])
def test_each_student_gets_exactly_its_own_rows(tiny_teacher, tmp_path, output):
    result = torchrun(3, [str(tiny_teacher), output], timeout=150, module="tests.dist.workers.routing")
    assert_ok(result)
    assert result.stdout.count("ROUTING OK") == 2, result.stdout[-4000:]


@pytest.mark.timeout(200)
def test_preemption_with_a_teacher_saves_stops_and_exits_zero(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000), timeout=180,
                      signal_plan=signal_ranks(dump, [(0, 0.0)]))
    assert_ok(result)
    saved = [p for p in (dump / "checkpoints").iterdir() if not p.name.endswith(".tmp")]
    assert len(saved) == 1 and int(saved[0].name) == max(train_rows(dump))
    assert "STOP received" in result.stdout
