"""Online distillation with 2 students + 1 teacher under torchrun on CPU/gloo."""

import time

import pytest

from tests.dist.conftest import distill_overrides, read_metrics, train_rows
from tests.dist.launch import torchrun
from tests.dist.test_train import assert_ok, signal_ranks


@pytest.mark.timeout(300)
def test_kd_training_resume_gradacc_probe_and_clean_stop(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    first = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, exit_after_steps=3, probe_freq=2,
                                          grad_acc_steps=2, **{"distillation.alpha_schedule": "lr",
                                                               "eval.every": 2, "eval.max_batches": 2}), timeout=150)
    assert_ok(first)
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        for key in ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "speed/teacher_wait_s"):
            assert key in row, key
        assert 0.0 <= row["kd/top1_agreement"] <= 1.0
        assert 0.0 < row["kd/teacher_mass"] <= 1.0 + 1e-6
        assert row["loss/kd"] > 0
        alpha = row["kd/alpha"]
        assert row["loss/total"] == pytest.approx((1 - alpha) * row["loss/ce"] + alpha * row["loss/kd"], rel=1e-4)
    # alpha follows the lr schedule: it warms up with the lr (warmup 2), never above distillation.alpha.
    assert 0 < rows[1]["kd/alpha"] < rows[2]["kd/alpha"] <= 0.5
    assert (dump / "probe" / "probe.0.jsonl").exists() and (dump / "probe" / "probe.1.jsonl").exists()
    assert not (dump / "probe" / "probe.2.jsonl").exists()  # the teacher runs no probe
    assert any("eval/loss" in r for r in read_metrics(dump))
    # One request per micro-batch (3 steps x 2); the probe at step 2 and the eval did not call the teacher.
    assert "sent STOP to teacher" in first.stdout and "STOP received after 6 requests" in first.stdout
    # Resume: a fresh teacher serves step 4 (it never counted steps).
    second = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, grad_acc_steps=2), timeout=150)
    assert_ok(second)
    assert "resumed from step 3" in second.stdout
    assert "STOP received after 2 requests" in second.stdout
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
@pytest.mark.parametrize("output,wire", [("topk", "fp32"), ("topk", "bf16"), ("sampled", "bf16"), ("full", "fp32")])
def test_each_student_gets_exactly_its_own_rows(tiny_teacher, tmp_path, output, wire):
    result = torchrun(3, [str(tiny_teacher), output, wire], timeout=150, module="tests.dist.workers.routing")
    assert_ok(result)
    assert result.stdout.count("ROUTING OK") == 2, result.stdout[-4000:]


def protocol_error_run(tiny_teacher, mode: str):
    result = torchrun(3, [str(tiny_teacher), mode], timeout=60, module="tests.dist.workers.protocol_errors")
    assert_ok(result)  # each rank catches and prints its error, so the test sees all three
    return result.stdout


@pytest.mark.timeout(90)
def test_teacher_and_students_disagreeing_on_the_output_format_fail_at_the_handshake(tiny_teacher):
    out = protocol_error_run(tiny_teacher, "format")
    assert out.count("serves distillation.output=topk k=5 but rank") == 3, out[-4000:]
    assert "give every rank the same distillation.output and distillation.k" in out


@pytest.mark.timeout(90)
def test_mismatched_request_headers_name_both_students(tiny_teacher):
    out = protocol_error_run(tiny_teacher, "headers")
    sentence = "students sent mismatched requests (rank 0: op=FORWARD step=1 micro_step=0; " \
               "rank 1: op=FORWARD step=2 micro_step=0)"
    for rank in (0, 1, 2):  # both students and the teacher say it
        assert f"FAILED rank {rank}: TeacherError: " in out, out[-4000:]
    assert out.count(sentence) == 3, out[-4000:]


@pytest.mark.timeout(90)
def test_out_of_range_token_ids_are_refused_before_they_are_sent(tiny_teacher):
    out = protocol_error_run(tiny_teacher, "token_range")
    assert "REFUSED: Token ids must be in [0, " in out and "for the teacher's vocabulary" in out, out[-4000:]
    assert out.count("TOKEN_RANGE OK") == 3 and "FAILED" not in out


@pytest.mark.timeout(150)
def test_two_teachers_each_serve_their_own_student(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, dump, steps=2,
                                           **{"distillation.n_teacher_ranks": 2}), timeout=120)
    assert_ok(result)
    assert sorted(train_rows(dump)) == [1, 2]
    assert result.stdout.count("STOP received after 2 requests") == 2, result.stdout[-4000:]
    assert "teacher rank 2 ready" in result.stdout and "teacher rank 3 ready" in result.stdout


@pytest.mark.timeout(90)
def test_one_teacher_failing_to_load_stops_every_bridge(corpus, tiny_teacher, tmp_path):
    start = time.time()
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=2,
                                           inject_failure="teacher_load:1", **{"distillation.n_teacher_ranks": 2}),
                      timeout=60)
    assert result.returncode != 0
    assert time.time() - start < 45
    # Rank 3 (teacher 1) failed; rank 2's bridge (teacher 0 + student 0) hears it through the world verdicts.
    assert result.stdout.count("injected teacher load failure") >= 4, result.stdout[-4000:]
    assert result.stdout.count("the handshake failed in another bridge (rank 3): TeacherError: Teacher rank 3 "
                               "failed to load") == 2, result.stdout[-4000:]


@pytest.mark.timeout(90)
def test_non_finite_loss_is_agreed_and_stops_the_teacher_with_an_error(corpus, tiny_teacher, tmp_path):
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=6, inject_failure="nan:1@2"),
                      timeout=60)
    assert result.returncode != 0
    assert result.stdout.count("loss is not finite at step 2") >= 2, result.stdout[-4000:]
    assert "student rank(s) [0, 1] stopped on an error at step 2" in result.stdout
    assert sorted(train_rows(tmp_path / "run")) == [1]


@pytest.mark.timeout(200)
def test_preemption_with_a_teacher_saves_stops_and_exits_zero(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000), timeout=180,
                      signal_plan=signal_ranks(dump, [(0, 0.0)]))
    assert_ok(result)
    saved = [p for p in (dump / "checkpoints").iterdir() if not p.name.endswith(".tmp")]
    assert len(saved) == 1 and int(saved[0].name) == max(train_rows(dump))
    assert "STOP received" in result.stdout
