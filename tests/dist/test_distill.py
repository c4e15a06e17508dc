"""Online distillation with 2 students + 1 teacher under torchrun on CPU/gloo."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from apps.bench import distill as bench
from lingua.distillation.args import resolve_prefetch
from lingua.run.dump_dir import RunDir, read_metrics, train_rows
from tests.runs import (assert_ok, assert_stopped_to_resume, at_once, distill_overrides, rank_exit_codes, rank_outputs,
                        torchrun)

pytestmark = pytest.mark.slow  # every test here launches processes


@pytest.mark.timeout(300)
def test_kd_training_resume_gradacc_probe_and_clean_stop(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    first = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, exit_after_steps=3, probe_freq=2,
                                          grad_acc_steps=2, **{"distillation.alpha_schedule": "lr",
                                                               "heldout.every": 2, "heldout.max_batches": 2}), timeout=150)
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
    # data.batch_size is per student rank: the startup log says what a step trains on (the teacher rank: nothing).
    assert "global batch: 2 students x 2 x 32 x 2 micro-batches = 256 tokens a step" in first.stdout
    # The benchmark reads only keys the trainer logs; from these rows: bytes = the framed buffers of 2 x 32 tokens.
    ordered = [rows[step] for step in sorted(rows)]
    assert all(key in row for row in ordered for key in bench.METRIC_KEYS + bench.KD_METRIC_KEYS), ordered[-1]
    summary = bench.summarize([bench.RunRecord(rows=ordered, n_students=2, n_processes=3)], warmup=1)
    framed = bench.formula_bytes_per_token("topk", 8, None, "bf16", 2, 32)
    assert summary["bytes_up_per_token"] == pytest.approx(framed["framed_up"])
    assert summary["bytes_down_per_token"] == pytest.approx(framed["framed_down"])
    assert 0 < summary["teacher_busy"] < 1 and 0 < summary["teacher_peak_gib"] < 4
    # Resume: a fresh teacher serves step 4 (it never counted steps).
    second = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, grad_acc_steps=2), timeout=150)
    assert_ok(second)
    assert "resumed from step 3" in second.stdout
    assert "STOP received after 2 requests" in second.stdout
    assert sorted(train_rows(dump)) == [1, 2, 3, 4]


@pytest.mark.timeout(200)
def test_distillation_off_trains_on_all_three_ranks(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    # with the z-loss on the research path (fused_loss=false): CE-only training through research.py, logged as loss/z
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=3, enable_distillation="false",
                                           **{"distillation.z_loss": 1e-4, "distillation.fused_loss": "false"}),
                      timeout=150)
    assert_ok(result)
    assert "role=teacher" not in result.stdout and result.stdout.count("role=student") >= 3
    assert "global batch: 3 students x 2 x 32 = 192 tokens a step (data.batch_size is per student rank)" in result.stdout
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3] and "loss/kd" not in rows[1]
    assert all(key in rows[1] for key in bench.METRIC_KEYS) and "kd/bytes_up" not in rows[1]
    assert rows[1]["stragglers/step_slowest_rank"] in (0, 1, 2)
    for row in rows.values():  # 1e-4 * lse^2 with lse near log(vocab) at the start; in loss/total
        assert 0 < row["loss/z"] < 1e-2 and row["loss/total"] == pytest.approx(row["loss/ce"] + row["loss/z"], rel=1e-6)


@pytest.mark.timeout(90)
def test_missing_hub_style_teacher_fails_at_the_handshake_on_every_rank(corpus, tmp_path):
    """A name that could be a hub id (org/name) is the teacher's to find (offline here): its reason reaches every rank."""
    result = torchrun(3, distill_overrides(corpus, "no-such-org/no-such-teacher", tmp_path / "run", steps=3,
                                           **{"data.tokenizer.name": "bytes"}), timeout=60)
    assert result.returncode != 0
    assert result.stdout.count("Teacher rank 2 failed to load") >= 3, result.stdout[-4000:]


@pytest.mark.timeout(90)
def test_truncated_teacher_weights_fail_fast_on_every_rank_naming_the_fix(corpus, tiny_teacher, tmp_path):
    damaged = tmp_path / "data" / "teachers" / "damaged-teacher"  # under data/teachers/: the demo's commands apply
    shutil.copytree(tiny_teacher, damaged)
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    # The students' tokenizer comes from the same directory (its tokenizer files are intact), as in a real config.
    # Within the 60 s launch limit, far below the 300 s init timeout a missed handshake would wait for.
    result = torchrun(3, distill_overrides(corpus, damaged, tmp_path / "run", steps=3), timeout=60)
    assert rank_exit_codes(result.stdout) == {0: 2, 1: 2, 2: 2}, result.stdout[-4000:]  # a user's error everywhere
    sentence = (f"Teacher rank 2 failed to load: teacher directory '{damaged}' could not be loaded "
                f"(SafetensorError: Error while deserializing header: ")
    fixes = (f"`python -m setup.prepare_teacher --out {damaged}`", f"`python -m setup.make_tiny_teacher --out {damaged}`")
    lines = [line for line in result.stdout.splitlines() if sentence in line and all(fix in line for fix in fixes)]
    # The teacher's reason reaches both students through the handshake: every rank ends with it.
    assert len(lines) >= 3, result.stdout[-4000:]


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory):
    """A tiny teacher whose tokenizer has the same size as tiny_teacher's (512) but other tokens."""
    from setup.make_tiny_teacher import make_tiny_teacher

    text = "Completely different words: zebra quartz javelin, oxygen wavelength; 9876543210 ~~~ <<>> {{}}.\n" * 20
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "other-tokens", seed=1, corpus_text=text)


@pytest.mark.timeout(90)
def test_two_different_hf_tokenizers_of_the_same_size_are_refused_at_the_handshake(
        corpus, tiny_teacher, other_tokenizer_teacher, tmp_path):
    result = torchrun(3, distill_overrides(corpus, other_tokenizer_teacher, tmp_path / "run", steps=3,
                                           **{"data.tokenizer.path": str(tiny_teacher)}), timeout=60)
    assert result.returncode != 0
    sentence = (f"Student rank 0's tokenizer (vocab 512) does not match the teacher's (vocab 512, the same size but "
                f"different tokens) at {other_tokenizer_teacher}. Use the teacher's tokenizer (set data.tokenizer.name=hf "
                f"data.tokenizer.path={other_tokenizer_teacher}), or keep yours and set "
                f"distillation.cross_tokenizer=true.")
    assert result.stdout.count(sentence) >= 3, result.stdout[-4000:]  # both students and the teacher
    assert "loss/ce" not in result.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(90)
def test_vocab_mismatch_is_reported_at_the_handshake(corpus, tiny_teacher, tmp_path):
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=3,
                                           **{"data.tokenizer.name": "bytes"}), timeout=60)
    assert result.returncode != 0
    assert "does not match the teacher's" in result.stdout
    assert "data.tokenizer.name=hf" in result.stdout


ROUTING_CASES = ["topk,fp32,fp32,causal", "topk,bf16,fp32,causal", "sampled,bf16,fp32,causal", "full,fp32,fp32,causal",
                 "topk,fp32,bf16,causal", "topk,fp32,fp32,doc_causal"]  # output, wire, teacher dtype, attention mask


@pytest.fixture(scope="module")
def routing(tiny_teacher) -> str:
    """One launch serves every case in turn (tests/dist/workers/routing.py); its console."""
    result = torchrun(3, [str(tiny_teacher), *ROUTING_CASES], timeout=200, module="tests.dist.workers.routing")
    assert_ok(result)
    return result.stdout


@pytest.mark.timeout(250)
@pytest.mark.parametrize("case", ROUTING_CASES)
def test_each_student_gets_exactly_its_own_rows(routing, case):
    # One request at a time, then two micro-batches in flight (waited in order and in reverse order). With
    # doc_causal every row packs several documents: the teacher must answer as per-document forwards would.
    lines = [line for line in routing.splitlines() if line.startswith(f"{case} ")]
    assert sorted(line for line in lines if " ROUTING " in line) == [f"{case} ROUTING OK rank {r}" for r in (0, 1)], lines
    assert any(f"{case} TEACHER CLOCK OK" in line for line in lines), lines
    # distillation.teacher_dtype=bf16 on CPU: the teacher's parameters really are bf16 (compared with fp32 above).
    teacher_dtype = case.split(",")[2]
    assert f"{case} TEACHER PARAMS ['torch.{'bfloat16' if teacher_dtype == 'bf16' else 'float32'}']" in lines, lines


@pytest.mark.timeout(120)
def test_teacher_keeps_the_init_timeout_through_the_students_first_step(tiny_teacher):
    # The students spend 2 x 3 s inside their first step, after its requests were served: past the 4 s training
    # timeout. A teacher that switched after serving its first request would time out there. Later a step
    # announces a 5 s pause (a checkpoint evaluation): a one-way switch would time out there.
    result = torchrun(3, [str(tiny_teacher)], timeout=100, module="tests.dist.workers.timeout_phases")
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert sum("PHASES OK" in line for line in lines) == 3, result.stdout[-4000:]
    switches = [i for i, line in enumerate(lines) if "[r2 teacher]" in line and "collective timeout set to 4s" in line]
    first_step_done = [i for i, line in enumerate(lines) if "step 5 finished on rank" in line]
    assert len(first_step_done) == 2 and switches and switches[0] > max(first_step_done), result.stdout[-4000:]
    # Step 7 announced a pause of 5 s (past the 4 s): the teacher waited under 60 s, then went back to 4 s.
    back = [i for i, line in enumerate(lines) if "[r2 teacher]" in line and "collective timeout set to 60s" in line]
    assert len(switches) == 2 and len(back) == 1 and switches[0] < back[0] < switches[1], result.stdout[-4000:]
    assert any("announced a long pause" in line for line in lines), result.stdout[-4000:]


PROTOCOL_MODES = ("settings", "headers", "token_range", "serve_failure", "k_beyond_vocab")


@pytest.fixture(scope="module")
def protocol_errors(tiny_teacher) -> dict[str, list[str]]:
    """One launch runs every mode in turn (tests/dist/workers/protocol_errors.py); mode -> its lines."""
    result = torchrun(3, [str(tiny_teacher), *PROTOCOL_MODES], timeout=100, module="tests.dist.workers.protocol_errors")
    assert_ok(result)  # each rank catches and prints its error, so the test sees all three
    # Every mode ended on every rank (no OK line: each one is an error) before the next one started.
    assert all(f"FAILED {mode} rank {rank}: " in result.stdout for mode in PROTOCOL_MODES for rank in (0, 1, 2)), \
        result.stdout[-4000:]
    return {mode: [line for line in result.stdout.splitlines() if f"FAILED {mode} rank " in line]
            for mode in PROTOCOL_MODES}


@pytest.mark.timeout(150)
def test_teacher_and_students_disagreeing_on_settings_fail_at_the_handshake(protocol_errors):
    lines = protocol_errors["settings"]
    sentence = ("Teacher rank 2 and student rank 0 disagree: distillation.k is 5 on the teacher but 6 on the student, "
                "distillation.wire_dtype is bf16 on the teacher but fp32 on the student, distillation.temperature is "
                "1.0 on the teacher but 2.0 on the student; give every rank the same distillation settings")
    for rank in (0, 1, 2):
        assert any(f"FAILED settings rank {rank}: ConfigError: {sentence}" in line for line in lines), lines


@pytest.mark.timeout(150)
def test_top_k_beyond_the_vocabulary_is_refused_at_the_handshake_on_every_rank(protocol_errors):
    lines = protocol_errors["k_beyond_vocab"]
    sentence = ("ConfigError: distillation.k=100000 is more than the 512 token ids the top-k is taken from (the "
                "students' vocabulary; teacher rank 2 has 512); set distillation.k <= 512.")
    for rank in (0, 1, 2):  # the same words on both students and the teacher, none of them from a step
        assert any(f"FAILED k_beyond_vocab rank {rank}: {sentence}" in line for line in lines), lines


@pytest.mark.timeout(150)
def test_mismatched_request_headers_name_both_students(protocol_errors):
    lines = protocol_errors["headers"]
    sentence = "students sent mismatched requests (rank 0: op=FORWARD step=1 micro_step=0; " \
               "rank 1: op=FORWARD step=2 micro_step=0)"
    # Students that disagree are our bug: the teacher raises it, the students stop naming the teacher.
    assert any(line.startswith("FAILED headers rank 2: RuntimeError: ") for line in lines), lines
    for rank in (0, 1):  # each names the step of its own request
        assert any(line.startswith(f"FAILED headers rank {rank}: PeerStopped: Teacher rank 2 failed at step "
                                   f"{1 + rank}: ") for line in lines), lines
    assert sum(sentence in line for line in lines) == 3, lines


@pytest.mark.timeout(150)
def test_out_of_range_token_ids_are_refused_by_the_teacher_on_every_rank(protocol_errors):
    lines = protocol_errors["token_range"]
    sentence = re.compile(r"student rank 0 sent token ids outside \[0, 512\) at step 1 \(got \[\d+, 512\]\); "
                          r"its data must use the teacher's tokenizer")
    for rank in (0, 1, 2):  # the teacher refused the request: no forward ran on the bad id, every rank says why
        assert any(line.startswith(f"FAILED token_range rank {rank}: TeacherError: ") for line in lines), lines
    assert sum(bool(sentence.search(line)) for line in lines) == 3, lines


@pytest.mark.timeout(150)
def test_a_teacher_failure_outside_the_forward_still_reaches_every_student(protocol_errors):
    lines = protocol_errors["serve_failure"]
    error = "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB (injected)"
    # Not a user's error: the teacher raises the original (its traceback), the students name the teacher.
    assert any(line.startswith(f"FAILED serve_failure rank 2: {error}") for line in lines), lines
    for rank in (0, 1):  # the students got the teacher's answer: an error, not a wait for the watchdog
        assert any(line.startswith(f"FAILED serve_failure rank {rank}: PeerStopped: Teacher rank 2 failed at step 1: "
                                   f"teacher failed serving step 1: {error}") for line in lines), lines


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
    # Said by the 2 ranks that heard it (their consoles), then carried by torchrun's failure report (error files).
    consoles, _, report = result.stdout.partition("ChildFailedError")
    heard = "the handshake failed in another bridge (rank 3): Teacher rank 3 failed to load: RuntimeError: injected"
    assert consoles.count(heard) == 2, result.stdout[-4000:]
    assert heard in report, result.stdout[-4000:]
    # Not a user's error: rank 3 raises it with its traceback, every other rank stops naming it (exit 1 all).
    assert rank_exit_codes(result.stdout) == {0: 1, 1: 1, 2: 1, 3: 1}, result.stdout[-4000:]
    log = RunDir(tmp_path / "run").rank_log(3).read_text()
    assert "Traceback (most recent call last):" in log, log[-3000:]
    assert log.rstrip().endswith("RuntimeError: injected teacher load failure (inject_failure=teacher_load:...)")


KD_KEYS = ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "optim/grad_norm")


@pytest.mark.timeout(400)
def test_prefetch_gives_the_same_losses_and_resumes_exactly(corpus, tiny_teacher, tmp_path):
    """prefetch 0 and 1 train bit-identically, and with look-ahead a resumed run sends and trains on exactly the
    batches the interrupted one did not (the look-ahead batch belongs to the next step): a look-ahead run
    preempted at step 3 and resumed gives, step for step, the numbers of an uninterrupted run without it."""
    reference, split = tmp_path / "prefetch0", tmp_path / "split"
    # prefetch 1 (the default), preempted at step 3 with a look-ahead request of step 4 in flight: drained,
    # saved at 3, STOP, exit to be resumed. It and the reference are independent: launched at once.
    result, first = at_once(lambda job: torchrun(3, distill_overrides(corpus, tiny_teacher, job[0], steps=6,
                                                                      grad_acc_steps=2, **job[1]), timeout=150),
                            [(reference, {"distillation.prefetch": 0}), (split, {"inject_failure": "preempt:1@3"})])
    assert_ok(result)
    assert "STOP received after 12 requests" in result.stdout
    assert assert_stopped_to_resume(first, steps=6) == 3
    assert "on an injected preemption" in first.stdout
    assert "run preempted" in first.stdout and "STOP received after 7 requests" in first.stdout  # 3 x 2 + look-ahead
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == [f"{3:010d}"]
    second = torchrun(3, distill_overrides(corpus, tiny_teacher, split, steps=6, grad_acc_steps=2), timeout=150)
    assert_ok(second)
    # 3 steps x 2 micro-batches: nothing drawn past the last step.
    assert "resumed from step 3" in second.stdout and "STOP received after 6 requests" in second.stdout
    resumed, without = train_rows(split), train_rows(reference)
    for step in range(1, 7):
        assert [resumed[step][k] for k in KD_KEYS] == [without[step][k] for k in KD_KEYS], step


@pytest.mark.timeout(200)
def test_doc_causal_students_send_document_ids_and_train(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    # with the z-loss on (the fused path): logged as loss/z, counted in loss/total
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=3, **{"model.attn_mask": "doc_causal",
                                                                                    "distillation.prefetch": "auto",
                                                                                    "distillation.z_loss": 1e-4}),
                      timeout=150)
    assert_ok(result)
    assert "buffers [2 x 32] with document ids" in result.stdout
    # auto: from this machine's cores, for 3 ranks of 1 thread each (torchrun's OMP_NUM_THREADS=1), once.
    prefetch, why = resolve_prefetch("auto", "cpu", 3, 1, len(os.sched_getaffinity(0)))
    assert result.stdout.count(f"teacher look-ahead: prefetch={prefetch} ({why})") == 1, result.stdout[-4000:]
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3] and all(r["loss/kd"] > 0 for r in rows.values())
    for r in rows.values():
        mix = (1 - r["kd/alpha"]) * r["loss/ce"] + r["kd/alpha"] * r["loss/kd"]  # T = 1
        assert 0 < r["loss/z"] < 1e-2 and r["loss/total"] == pytest.approx(mix + r["loss/z"], rel=1e-6)
    # Tokens and document ids go up: twice the int32 grid of a causal bridge, plus the header.
    assert rows[1]["kd/bytes_up"] == pytest.approx(4 * (8 + 2 * 2 * 32))  # one answered request so far


TEACHER_FAILURE = ("teacher failed serving step 3: RuntimeError: injected teacher failure "
                   "(inject_failure=teacher_serve:...)")


def error_lines(outputs: dict, rank: int) -> list[str]:
    return [line for stream in ("stdout", "stderr") for line in outputs[rank].get(stream, "").splitlines()
            if line.startswith("error: ")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("grad_acc,prefetch,fails", [(1, 0, True), (2, 2, True), (2, 2, False)],
                         ids=["acc1-prefetch0", "acc2-prefetch2", "acc2-prefetch2-no-failure"])
def test_a_teacher_failing_mid_run_is_its_own_sentence_on_every_rank(corpus, tiny_teacher, tmp_path, grad_acc,
                                                                     prefetch, fails):
    """The teacher fails on step 3's first request. It answers that one and every later one with its error until
    its students leave; they finish step 3, agree on the error, complete what they posted ahead, send ERROR and
    raise the teacher's own sentence. Nothing is left in flight on any rank (on NCCL a pending request would
    hold the exit until the watchdog; here the students count them), and every rank logs its teardown last."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    extra = {"grad_acc_steps": grad_acc, "distillation.prefetch": prefetch,
             # Timeouts far above the launch's limit: ending in time proves no rank waited one out.
             "distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300}
    if fails:
        extra["inject_failure"] = "teacher_serve:0@3"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=8 if fails else 3, **extra),
                      timeout=150, log_dir=logs)
    run_dir, outputs = RunDir(dump), rank_outputs(logs)
    rank_logs = {rank: run_dir.rank_log(rank).read_text().splitlines() for rank in (0, 1, 2)}
    for rank in (0, 1):
        assert any(line.endswith("teacher requests left unwaited at exit: 0") for line in rank_logs[rank]), \
            rank_logs[rank][-10:]
    if not fails:
        assert_ok(result)
        assert f"STOP received after {3 * grad_acc} requests" in result.stdout  # look-ahead stops at the last step
        assert all(lines[-1].endswith("lingua.distributed: process group destroyed") for lines in rank_logs.values())
        return
    # Not a user's error: the students name the teacher and where its traceback is, the teacher raises the
    # original (its traceback on stderr and in its log); every rank exits 1.
    assert rank_exit_codes(result.stdout) == {0: 1, 1: 1, 2: 1}, result.stdout[-4000:]
    sentence = f"Teacher rank 2 failed at step 3: {TEACHER_FAILURE}; its traceback is in {run_dir.rank_log(2)}"
    for rank in (0, 1):
        assert error_lines(outputs, rank) == [f"error: {sentence}"], (rank, outputs[rank])
        assert "Traceback" not in outputs[rank].get("stderr", ""), outputs[rank]["stderr"]
    assert error_lines(outputs, 2) == [], outputs[2]
    assert 'raise RuntimeError("injected teacher failure' in outputs[2]["stderr"], outputs[2]["stderr"][-3000:]
    # The teacher's log keeps the traceback of its failure, then answered the rest of step 3, each request
    # posted ahead and the ERROR: every request the students had posted.
    teacher_log = "\n".join(rank_logs[2])
    assert re.search(r'File ".*/lingua/distillation/online/server\.py", line \d+, in _handle', teacher_log), teacher_log[-3000:]
    assert 'raise RuntimeError("injected teacher failure' in teacher_log, teacher_log[-3000:]
    answered = (grad_acc - 1) + prefetch + 1
    assert f"answered {answered} more request(s) with the error, until the students left (ERROR)" in teacher_log
    # Every rank tore down by aborting its groups: the students' last words, the teacher's before its traceback.
    assert all(rank_logs[rank][-1].endswith("lingua.distributed: process groups aborted") for rank in (0, 1)), \
        {rank: rank_logs[rank][-3:] for rank in (0, 1)}
    assert teacher_log.rstrip().endswith("RuntimeError: injected teacher failure (inject_failure=teacher_serve:...)")
    assert "lingua.distributed: process groups aborted" in teacher_log, teacher_log[-3000:]
    assert sorted(train_rows(dump)) == [1, 2]


@pytest.mark.timeout(120)
def test_teacher_metrics_come_from_the_completed_response_not_one_in_flight(tiny_teacher):
    result = torchrun(3, [str(tiny_teacher)], timeout=100, module="tests.dist.workers.slow_reply")
    assert_ok(result)
    assert result.stdout.count("SLOW REPLY OK") == 3, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["causal", "doc_causal_on_a_terminal"])
def test_no_host_read_per_micro_batch(corpus, tiny_teacher, tmp_path, mode):
    """Tensor -> Python conversions per step do not grow with the micro-batches: zero per micro-batch (on CUDA
    each would be a host sync), with look-ahead and the teacher's status words read at the agreed point; with
    document masks, and with rank 0's progress line redrawn every step as on a terminal."""
    per_step = {}
    extra, env = ({"model.attn_mask": "doc_causal"}, {"COUNT_SYNCS_TTY": "1"}) if mode != "causal" else ({}, {})

    def count(grad_acc):
        overrides = distill_overrides(corpus, tiny_teacher, tmp_path / f"run{grad_acc}", steps=6,
                                      grad_acc_steps=grad_acc, **{"logging.freq": 100, **extra})
        return torchrun(3, [str(tmp_path / f"counts_{grad_acc}.json"), *overrides], timeout=150, env=env,
                        module="tests.dist.workers.count_syncs")

    for grad_acc, result in zip((1, 3), at_once(count, (1, 3))):  # independent launches: two at a time
        out = tmp_path / f"counts_{grad_acc}.json"
        assert_ok(result)
        assert ("step 4/6 | " in result.stdout) == bool(env)  # the live line, redrawn between log steps
        for rank in (0, 1):
            counts = json.loads(Path(f"{out}.{rank}").read_text())
            # Steps 2..5: past the first step's startup work, before the last step's log row.
            per_step[grad_acc, rank] = {step: counts[str(step)] for step in range(2, 6)}
    for rank in (0, 1):
        for step in range(2, 6):
            one, three = per_step[1, rank][step], per_step[3, rank][step]
            assert one[0] == three[0], (step, one, three)
    # What remains per step: the agreed flags, the step's token count, AdamW's per-parameter step counters
    # (host tensors unless capturable) -- none of them per micro-batch.
    sites = {site.split(":")[0] for site in per_step[3, 0][3][1]}
    assert sites <= {"collectives.py", "train.py", "adamw.py", "optimizer.py", "adam.py"}, per_step[3, 0][3]


@pytest.mark.timeout(200)
def test_a_metric_on_one_student_only_ends_both_with_one_sentence(corpus, tiny_teacher, tmp_path):
    """dist_mean_dict checks the students' keys before its all_reduce: a metric logged by train rank 1 only (from
    step 2) is one sentence naming the key and the ranks on both students, at that step, not a hang."""
    dump = tmp_path / "dump"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=6), timeout=180,
                      module="tests.dist.workers.extra_metric")
    sentence = ("error: metric 'debug/only_on_rank_1' is on rank 1 only (not on rank 0): every rank must report the "
                "same metric keys to average them, so report each on every rank (e.g. 0.0 where it does not apply).")
    assert result.returncode != 0 and result.stdout.count(sentence) == 2, result.stdout[-5000:]
    assert "timed out" not in result.stdout.lower(), result.stdout[-5000:]
    assert sorted(train_rows(dump)) == [1]  # step 1 logged; step 2's row is the one refused
    for rank in (0, 1):  # each student told the teacher and left at once: no traceback, no collective timeout
        log = (dump / "logs" / f"rank_{rank}.log").read_text()
        assert "sent ERROR to teacher rank 2 at step 2" in log, log[-3000:]
        assert "Traceback" not in log and "timed out" not in log.lower(), log[-3000:]
        stamps = {what: time.mktime(time.strptime(re.search(rf"^(\S+ \S+) .*{what}", log, re.M).group(1),
                                                  "%Y-%m-%d %H:%M:%S"))
                  for what in ("startup phase first_step", "process groups aborted")}
        assert stamps["process groups aborted"] - stamps["startup phase first_step"] < 15, log[-3000:]
