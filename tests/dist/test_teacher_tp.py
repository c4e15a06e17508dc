"""Tensor-parallel teacher replicas (distillation.teacher_tp=2) under torchrun on CPU/gloo: the same outputs and
losses as one teacher rank, 2 replicas on two torchrun "nodes", and every rank of a replica in the protocol
(a rank that fails to load, raises, is killed or gets SIGUSR2)."""

import json
import os
import signal
import time

import pytest

from lingua.rundir import RunDir, train_rows
from tests.runs import (
    assert_ok,
    distill_overrides,
    rank_exit_codes,
    rank_outputs,
    rank_pid,
    signal_ranks,
    torchrun,
    torchrun_nodes,
    wait_for_step,
)

TP = {"distillation.n_teacher_ranks": 2, "distillation.teacher_tp": 2}  # 2 students + one replica on ranks 2-3
KD_KEYS = ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement")
LIMIT_S = 120  # a failure scenario of 4 ranks, startup included (60-80 s on 2 busy cores)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_outputs_equal_one_rank_and_no_collective_runs_on_the_world(tiny_teacher, tmp_path):
    out = tmp_path / "tp_outputs.json"
    assert_ok(torchrun(3, [str(tiny_teacher), str(out)], timeout=240, module="tests.dist.workers.tp_outputs"))
    results = json.loads(out.read_text())
    assert results["shard"] == [0, 256]
    assert results["hidden"] < 1e-5 and results["hidden_doc_causal"] < 1e-5, results
    for vocab in (512, 300, 200):  # the students' vocabulary cut inside the second slice, then the first
        for name in (f"topk_float32_{vocab}", f"topk_bfloat16_{vocab}"):
            assert results[name]["ids_equal"] and results[name]["extra"] < 1e-5, (name, results[name])
        assert results[f"topk_float32_{vocab}"]["values"] < 1e-5 and results[f"full_float32_{vocab}"]["values"] < 1e-5
        assert results[f"topk_bfloat16_{vocab}"]["values"] <= 2 ** -6  # one bf16 step of log-probs below 4 in size
        # Through the sharded model the logits differ by ~1e-6, so a draw landing that close to a CDF step
        # may flip (none did in the runs measured); equal draws have equal log-probs.
        sampled = results[f"sampled_model_{vocab}"]
        assert sampled["ids_agree"] >= 0.99 and sampled["values"] < 1e-5 and sampled["extra"] < 1e-5, sampled
    for vocab in (501, 400):  # uneven slices (251 + 250 rows); the sampler on identical logits: identical draws
        sampler, topk = results[f"sampler_uneven_{vocab}"], results[f"topk_uneven_{vocab}"]
        assert sampler["ids_equal"] and sampler["values"] < 1e-5 and sampler["extra"] < 1e-5, sampler
        assert topk["ids_equal"] and topk["values"] < 1e-5 and topk["extra"] < 1e-5, topk
    ce, reference = results["cross_entropy"]
    assert ce == pytest.approx(reference, rel=1e-5)
    # Load, forwards, outputs and cross-entropy: every collective on the replica's group, none on the world.
    assert results["collectives"] > 40 and results["collective_groups"] == [results["tp_group_name"]], results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp2_replica_trains_like_one_teacher_rank_survives_sigusr2_on_a_follower_and_resumes_exactly(
        corpus, tiny_teacher, tmp_path):
    one = tmp_path / "tp1"
    extra = {"grad_acc_steps": 2, "eval.every": 3, "eval.max_batches": 2}
    assert_ok(torchrun(3, distill_overrides(corpus, tiny_teacher, one, steps=6, **extra), timeout=200))
    # SIGUSR2 to the replica's second rank (rank 3, never on the bridge): the students agree to save and stop.
    split, delivered = tmp_path / "tp2", []
    first = torchrun(4, distill_overrides(corpus, tiny_teacher, split, steps=6, **extra, **TP), timeout=200,
                     signal_plan=signal_ranks(split, [(3, 0.0)], after_step=2, delivered=delivered))
    assert_ok(first)
    assert delivered == [3] and "run preempted" in first.stdout, first.stdout[-4000:]
    stopped_at = max(train_rows(split))
    assert 2 <= stopped_at < 6
    assert "[r3 teacher] INFO  lingua.distillation.server: leaving with the replica's first rank" in first.stdout
    second = torchrun(4, distill_overrides(corpus, tiny_teacher, split, steps=6, **extra, **TP), timeout=200)
    assert_ok(second)
    assert f"resumed from step {stopped_at}" in second.stdout
    a, b = train_rows(one), train_rows(split)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        for key in KD_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4), (step, key)
    # Vocabulary-parallel cross-entropy: the teacher's held-out reference is the same number.
    evals = {tag: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                   if "eval/teacher_loss" in line] for tag, run in (("one", one), ("tp", split))}
    assert evals["tp"][0]["eval/teacher_loss"] == pytest.approx(evals["one"][0]["eval/teacher_loss"], rel=1e-5)
    # Each rank logs its own serving numbers; the status carries the replica's largest peak memory.
    for rank in (2, 3):
        assert f"[r{rank} teacher]" in second.stdout and "tokens/s of busy time" in second.stdout
    assert 0 < b[6]["kd/teacher_peak_gib"] < 4 and 0 < b[6]["kd/teacher_forward_s"] <= b[6]["kd/teacher_busy_s"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_students_and_two_tp2_replicas_one_per_torchrun_node(corpus, tiny_teacher, tmp_path):
    """teacher_placement=per_node on two torchrun "nodes" of 4 ranks: ranks 2-3 and 6-7 are the replicas, each
    serving the two students of its node."""
    dump = tmp_path / "run"
    results = torchrun_nodes(2, 4, distill_overrides(
        corpus, tiny_teacher, dump, steps=2, **{"distributed.teacher_placement": "per_node",
                                                "distillation.n_teacher_ranks": 4, "distillation.teacher_tp": 2}),
        timeout=500)
    for result in results:
        assert_ok(result)
    out = "\n".join(result.stdout for result in results)
    for teacher, students in ((2, (0, 1)), (6, (4, 5))):
        for rank, rows in ((teacher, "0-255"), (teacher + 1, "256-511")):
            assert f"[r{rank} teacher] INFO  lingua.distillation.server: teacher " in out
            assert (f"tensor-parallel over ranks [{teacher}, {teacher + 1}]: vocabulary rows {rows} and 0.1M params "
                    f"here") in out  # of 0.2M: each rank holds half the teacher
        for student in students:
            assert f"[r{student} student] INFO  lingua.distillation.client: teacher rank {teacher} ready" in out
    assert out.count("STOP received after 2 requests") == 2, out[-4000:]
    assert out.count("leaving with the replica's first rank after 2 requests") == 2, out[-4000:]
    assert sorted(train_rows(dump)) == [1, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tp_rank_failing_to_load_is_one_sentence_on_every_rank(corpus, tiny_teacher, tmp_path):
    start = time.time()
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, tmp_path / "run", steps=2,
                                           inject_failure="teacher_load:1", **TP), timeout=LIMIT_S)
    assert result.returncode != 0 and time.time() - start < LIMIT_S
    cause = "RuntimeError: injected teacher load failure (inject_failure=teacher_load:...)"
    sentence = f"Teacher rank 2 failed to load: tensor-parallel rank 3 of its replica: {cause}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(lines) == 4 and all(sentence in line for line in lines), result.stdout[-4000:]


def assert_everyone_names(logs, dump, result, dead: int) -> None:
    """Every other rank ends with the one sentence naming `dead`, no traceback, exit code 1."""
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    sentence = f"error: rank {dead} (teacher) stopped; its log is {RunDir(dump).rank_log(dead)}"
    for rank in (0, 1, 2):
        lines = (outputs[rank].get("stdout", "") + outputs[rank].get("stderr", "")).splitlines()
        assert [line for line in lines if line.startswith("error: ")] == [sentence], (rank, lines[-20:])
        assert not any("Traceback" in line for line in lines) and codes.get(rank) == 1, (rank, codes)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tp_rank_raising_while_serving_is_named_by_every_rank(corpus, tiny_teacher, tmp_path):
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    start = time.time()
    # Timeouts far above the limit: ending in time proves nobody waited one out.
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, dump, steps=8, inject_failure="teacher_serve:1@3",
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300},
                                           **TP), timeout=LIMIT_S, log_dir=logs)
    assert result.returncode != 0 and time.time() - start < LIMIT_S
    assert "RuntimeError: injected teacher failure" in rank_outputs(logs)[3]["stderr"]
    assert json.loads(RunDir(dump).status(3).read_text())["state"] == "failed"
    assert_everyone_names(logs, dump, result, dead=3)
    assert sorted(train_rows(dump)) == [1, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_tp_rank_is_named_by_every_rank(corpus, tiny_teacher, tmp_path):
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    killed = []

    def kill_rank_3(proc):
        wait_for_step(dump, 2, timeout=LIMIT_S)
        pid = rank_pid(dump, 3)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    start = time.time()
    result = torchrun(4, distill_overrides(corpus, tiny_teacher, dump, steps=100000,
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300},
                                           **TP), timeout=LIMIT_S, log_dir=logs, signal_plan=kill_rank_3)
    assert killed and result.returncode != 0 and time.time() - start < LIMIT_S
    assert rank_exit_codes(result.stdout).get(3) == -signal.SIGKILL
    assert_everyone_names(logs, dump, result, dead=3)
