"""Tensor-parallel teacher replicas (distillation.teacher_tp=2) under torchrun on CPU/gloo: the same outputs and
losses as one teacher rank, 2 replicas on two torchrun "nodes", and every rank of a replica in the protocol
(a rank that fails to load, is killed or gets SIGUSR2; the replica failing while serving)."""

import json
import os
import signal
import time

import pytest

from lingua.run.dump_dir import RunDir, train_rows
from setup.make_tiny_teacher import make_tiny_teacher
from tests.runs import (
    assert_ok,
    assert_stopped_to_resume,
    distill_overrides,
    rank_exit_codes,
    rank_outputs,
    rank_pid,
    signal_ranks,
    torchrun,
    torchrun_nodes,
    wait_for_step,
)

TP = {"distillation.n_teacher_ranks": 2, "distillation.teacher_tp": 2}  # one replica: the last 2 ranks
KD_KEYS = ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement")
LIMIT_S = 120  # a failure scenario of 3 ranks, startup included (35-45 s on 2 busy cores)


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
    # Cross-tokenizer: the replica (its first rank aligns, the follower gets the teacher's tokens) gives one
    # whole teacher's targets for a byte-tokenizer student's windows.
    cross = results["cross_tokenizer"]
    assert cross["ids_equal"] and cross["values"] < 1e-5 and cross["extra"] < 1e-5, cross
    assert cross["same_finite"] and cross["kd_weight_equal"] and 0 < cross["aligned"] <= 1, cross
    ce, reference = results["cross_entropy"]
    assert ce == pytest.approx(reference, rel=1e-5)
    # Load, forwards, outputs and cross-entropy: every collective on the replica's group, none on the world.
    assert results["collectives"] > 40 and results["collective_groups"] == [results["tp_group_name"]], results


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_each_tp_rank_reads_only_its_shards_and_gets_what_host_slicing_gives(tmp_path):
    # One file, untied, 515 ids (uneven slices: 258 + 257) and biased attention (sharded and replicated biases);
    # several files and an index, tied.
    uneven = make_tiny_teacher(tmp_path / "uneven", vocab_size=515, seed=2, attention_bias=True)
    tied = make_tiny_teacher(tmp_path / "tied", seed=1, tie_embeddings=True, max_shard_size="40KB")
    assert_ok(torchrun(2, [str(tmp_path), str(uneven), str(tied)], timeout=200, module="tests.dist.workers.tp_load"))
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 4, results  # two checkpoints x fp32, bf16
        for name, got in results.items():
            assert got["tp_rank"] == rank and got["names_equal"] and got["meta_left"] == [], (name, got)
            assert got["shard"] == ([[0, 258], [258, 515]] if str(uneven) in name else [[0, 256], [256, 512]])[rank]
            assert got["unequal_parameters"] == [] and got["unequal_buffers"] == [] and got["hidden_equal"], (name, got)
            assert got["dtensors"] >= 15 and got["tied"] == got["config_tied"] == (str(tied) in name), (name, got)
            assert got["dtypes"] == ["torch.float32" if name.endswith("fp32") else "torch.bfloat16"], (name, got)
            assert (got["outputs"] == [2, 16, 8]) == (rank == 0), (name, got)  # outputs on the first rank only
            # Each rank reads its half of the sharded tensors (and the small replicated norms): half the file.
            assert 0.45 < got["read_bytes"] / got["total_bytes"] < 0.55, (name, got)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp2_replica_trains_like_one_teacher_rank_survives_sigusr2_on_a_follower_and_resumes_exactly(
        corpus, tiny_teacher, tmp_path, online_kd_run):
    one = online_kd_run  # one teacher rank, the same settings (tests/dist/conftest.py)
    extra = {"grad_acc_steps": 2, "heldout.every": 3, "heldout.max_batches": 2}
    # SIGUSR2 to the replica's second rank (rank 3, never on the bridge): the students agree to save and stop.
    split, delivered = tmp_path / "tp2", []
    first = torchrun(4, distill_overrides(corpus, tiny_teacher, split, steps=6, **extra, **TP), timeout=200,
                     signal_plan=signal_ranks(split, [(3, 0.0)], after_step=2, delivered=delivered))
    assert assert_stopped_to_resume(first, steps=6) == max(train_rows(split))
    assert delivered == [3] and "run preempted" in first.stdout, first.stdout[-4000:]
    stopped_at = max(train_rows(split))
    assert 2 <= stopped_at < 6
    assert "[r3 teacher] INFO  lingua.distillation.online.server: leaving with the replica's first rank" in first.stdout
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
    assert evals["tp"][0]["eval/teacher_bpb"] == pytest.approx(evals["one"][0]["eval/teacher_bpb"], rel=1e-5)
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
            assert f"[r{rank} teacher] INFO  lingua.distillation.online.server: teacher " in out
            assert (f"tensor-parallel over ranks [{teacher}, {teacher + 1}]: vocabulary rows {rows} and 0.1M params "
                    f"here") in out  # of 0.2M: each rank holds half the teacher
        for student in students:
            assert f"[r{student} student] INFO  lingua.distillation.online.client: teacher rank {teacher} ready" in out
    assert out.count("STOP received after 2 requests") == 2, out[-4000:]
    assert out.count("leaving with the replica's first rank after 2 requests") == 2, out[-4000:]
    assert sorted(train_rows(dump)) == [1, 2]


def error_lines(outputs: dict, rank: int) -> list[str]:
    return [line for stream in ("stdout", "stderr") for line in outputs[rank].get(stream, "").splitlines()
            if line.startswith("error: ")]


# The failure scenarios: one student (rank 0) and the replica on ranks 1-2, the fewest processes that show them.
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tp_rank_failing_to_load_is_named_by_every_rank(corpus, tiny_teacher, tmp_path):
    """The replica's second rank (2) fails to load, on a bug: it raises it with its traceback; its replica's first
    rank refuses the handshake in its name, and the student stops with the same sentence (exit 1 all)."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=2, inject_failure="teacher_load:1", **TP),
                      timeout=LIMIT_S, log_dir=logs)
    assert result.returncode != 0 and time.time() - start < LIMIT_S
    outputs, log = rank_outputs(logs), RunDir(dump).rank_log(2)
    sentence = (f"error: Teacher rank 1 failed to load: tensor-parallel rank 2 of its replica: RuntimeError: injected "
                f"teacher load failure (inject_failure=teacher_load:...); its traceback is in {log}")
    for rank in (0, 1):
        assert error_lines(outputs, rank) == [sentence], (rank, outputs[rank])
    assert error_lines(outputs, 2) == [] and 'raise RuntimeError("injected teacher load failure' in outputs[2]["stderr"]
    assert rank_exit_codes(result.stdout) == {0: 1, 1: 1, 2: 1}, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replica_failing_while_serving_answers_until_its_student_leaves_then_every_rank_names_it(
        corpus, tiny_teacher, tmp_path):
    """The replica's first rank fails on step 3's request (a bug, before the forward): it answers with its error
    until the student leaves with ERROR, then releases its follower and raises the original; the student and the
    follower stop naming it and its log (exit 1 all)."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    start = time.time()
    # Timeouts far above the limit: ending in time proves nobody waited one out.
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=8, inject_failure="teacher_serve:0@3",
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300},
                                           **TP), timeout=LIMIT_S, log_dir=logs)
    assert result.returncode != 0 and time.time() - start < LIMIT_S
    outputs, leader_log = rank_outputs(logs), RunDir(dump).rank_log(1)
    failure = (f"teacher failed serving step 3: RuntimeError: injected teacher failure "
               f"(inject_failure=teacher_serve:...); its traceback is in {leader_log}")
    assert error_lines(outputs, 0) == [f"error: Teacher rank 1 failed at step 3: {failure}"], outputs[0]
    assert error_lines(outputs, 2) == [f"error: Teacher rank 1 (this replica's first rank) failed: {failure}"], \
        outputs[2]
    assert error_lines(outputs, 1) == [] and 'raise RuntimeError("injected teacher failure' in outputs[1]["stderr"]
    # The rest of step 3: the request posted ahead (distillation.prefetch=1), then the ERROR.
    assert "answered 2 more request(s) with the error, until the students left (ERROR)" in leader_log.read_text()
    assert rank_exit_codes(result.stdout) == {0: 1, 1: 1, 2: 1}, result.stdout[-4000:]
    assert sorted(train_rows(dump)) == [1, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_tp_rank_is_named_by_every_rank(corpus, tiny_teacher, tmp_path):
    """SIGKILL to the replica's second rank mid-run: the first rank loses it inside the sharded forward and the
    student loses the first rank; both end within seconds with the sentence naming rank 2 (exit 1)."""
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    killed = []

    def kill_rank_2(proc):
        wait_for_step(dump, 2, timeout=LIMIT_S)
        pid = rank_pid(dump, 2)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    start = time.time()
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000,
                                           **{"distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300},
                                           **TP), timeout=LIMIT_S, log_dir=logs, signal_plan=kill_rank_2)
    assert killed and result.returncode != 0 and time.time() - start < LIMIT_S
    outputs, codes = rank_outputs(logs), rank_exit_codes(result.stdout)
    assert codes.get(2) == -signal.SIGKILL
    sentence = f"error: rank 2 (teacher) stopped; its log is {RunDir(dump).rank_log(2)}"
    for rank in (0, 1):
        lines = (outputs[rank].get("stdout", "") + outputs[rank].get("stderr", "")).splitlines()
        assert [line for line in lines if line.startswith("error: ")] == [sentence], (rank, lines[-20:])
        assert not any("Traceback" in line for line in lines) and codes.get(rank) == 1, (rank, codes)
