"""2 students + 2 teachers under torchrun on CPU/gloo, in three launches: an unbroken run with a different teacher
per data source, whose teacher 1 is then SIGKILLed; a run preempted by a signal to teacher 1, and its resumed half,
which trains step for step as the unbroken run did until teacher 1 fails while serving. Every failure is named on
every rank, by teacher, and nothing waits out a timeout. A fourth launch (2 students, no teacher ranks) trains
from each teacher's cache as the unbroken run did, and a fifth (2 students + 1 teacher rank) from teacher 0's cache
beside teacher 1 online, the same again."""

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from apps.debug.postmortem import analyse
from lingua.data import DataArgs, DataLoader
from lingua.run.dump_dir import RunDir, eval_rows, train_rows
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.runs import (assert_ok, assert_stopped_to_resume, distill_overrides, rank_exit_codes, rank_outputs,
                        rank_pid, signal_ranks, torchrun, wait_for_step, write_corpus)

pytestmark = pytest.mark.slow  # every test here launches processes

# Every launch here is ended by a signal or a failure, never by its step count; with a constant lr (after its
# warmup) the step count changes nothing else, so the three launches train alike.
UNBOUNDED = 1000
COMPARED = 20  # the unbroken run's steps that the preempted and resumed one must reproduce (preempted at 4-7 here)
LIMIT_S = 120  # each launch takes 20-30 s on 2 busy cores, startup included
KD_KEYS = ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "optim/grad_norm",
           "kd/0/loss", "kd/1/loss", "kd/0/weight", "kd/1/weight")
EVAL_KEYS = ("eval/loss", "eval/bpb", *(f"eval/{i}/teacher_{name}" for i in (0, 1) for name in ("loss", "bpb")))


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """The test corpus's "text" source and a "code" source (the same generator, another seed)."""
    root = write_corpus(tmp_path_factory.mktemp("two_sources"))
    (write_corpus(tmp_path_factory.mktemp("code"), seed=1) / "text").rename(root / "code")
    for path in (root / "code").iterdir():
        path.rename(path.with_name(path.name.replace("text.", "code.")))
    return root


@pytest.fixture(scope="module")
def second_teacher(tmp_path_factory):
    from setup.make_tiny_teacher import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("teacher_1") / "tiny-llama-1", seed=1)


def two_teacher_overrides(corpus, teacher_0, teacher_1, dump, **extra) -> list[str]:
    # Teacher 1 in bf16 (its own teacher_dtype) beside teacher 0 in the shared fp32.
    teachers = (f"[{{path: {teacher_0}, sources: [text]}}, {{path: {teacher_1}, sources: [code], weight: 2.0, "
                f"teacher_dtype: bf16}}]")
    # Timeouts far above the limit: a launch that ends in time waited none out.
    overrides = distill_overrides(corpus, teacher_0, dump, steps=UNBOUNDED, **{
        "data.sources": "{text: 1.0, code: 1.0}", "distillation.teachers": teachers, "optim.scheduler": "constant",
        "distributed.init_timeout_s": 300, "distributed.train_timeout_s": 300, "heldout.every": COMPARED,
        "heldout.max_batches": 1, **extra})
    return [o for o in overrides if not o.startswith("distillation.teacher_path=")]


def text_share_per_step(corpus, tokenizer_path, steps: int) -> list[float]:
    """Each step's share of rows from "text", over both students: their loaders, rebuilt here, say."""
    args = DataArgs(root_dir=str(corpus), sources={"text": 1.0, "code": 1.0}, batch_size=2, seq_len=32,
                    load_async=False, tokenizer=TokenizerArgs("hf", str(tokenizer_path)))
    tokenizer = build_tokenizer(args.tokenizer)
    loaders = [DataLoader(args, tokenizer, rank, 2) for rank in (0, 1)]
    return [sum(float((next(loader)["source_ids"] == 0).float().mean()) for loader in loaders) / 2
            for _ in range(steps)]


@dataclass
class Launch:
    dump: Path
    logs: Path
    result: object
    seconds: float
    after_kill_s: float = 0.0  # from the SIGKILL to the launch's end


@pytest.fixture(scope="module")
def unbroken_then_killed(two_sources, tiny_teacher, second_teacher, tmp_path_factory) -> Launch:
    """Trains past COMPARED steps, then teacher 1 (rank 3) is SIGKILLed, as a dead node would take it."""
    root = tmp_path_factory.mktemp("unbroken")
    dump, logs, killed = root / "run", root / "torchrun", []

    def kill_teacher_1(proc):
        wait_for_step(dump, COMPARED + 1, timeout=LIMIT_S)
        os.kill(rank_pid(dump, 3), signal.SIGKILL)
        killed.append(time.time())

    start = time.time()
    result = torchrun(4, two_teacher_overrides(two_sources, tiny_teacher, second_teacher, dump), timeout=LIMIT_S,
                      log_dir=logs, signal_plan=kill_teacher_1)
    assert killed, result.stdout[-4000:]
    return Launch(dump, logs, result, time.time() - start, time.time() - killed[0])


@pytest.mark.timeout(300)
def test_each_source_learns_from_its_own_teacher_and_a_killed_teacher_is_named(two_sources, tiny_teacher,
                                                                                second_teacher, unbroken_then_killed):
    run = unbroken_then_killed
    dump, stdout = run.dump, run.result.stdout
    print(f"launch: {run.seconds:.1f}s, {run.after_kill_s:.1f}s of it after the kill")
    assert f"teacher 1 ({second_teacher}) on rank 3 ready" in stdout
    for rank, teacher, dtype in ((2, tiny_teacher, "float32"), (3, second_teacher, "bfloat16")):
        assert re.search(rf"\[r{rank} teacher\] INFO  lingua\.distillation\.online\.server: teacher {re.escape(str(teacher))} "
                         rf"loaded in .* params in {dtype}\)", stdout), stdout[-4000:]
    rows = train_rows(dump)
    assert set(range(1, COMPARED + 2)) <= set(rows), sorted(rows)
    shares = text_share_per_step(two_sources, tiny_teacher, COMPARED)
    assert 0 < sum(shares) < len(shares), shares  # both sources show up
    for step, share in zip(range(1, COMPARED + 1), shares):
        row = rows[step]
        # Every position of a text row is teacher 0's alone, every code position teacher 1's: the weights say so,
        # whatever teacher 1's larger weight (a position's weights are normalised over its teachers).
        assert row["kd/0/weight"] == pytest.approx(share, abs=1e-6)
        assert row["kd/1/weight"] == pytest.approx(1 - share, abs=1e-6)
        assert row["loss/kd"] == pytest.approx(row["kd/0/loss"] + row["kd/1/loss"], rel=1e-5)
        assert (row["kd/0/loss"] > 0) == (share > 0) and (row["kd/1/loss"] > 0) == (share < 1)
        assert row["loss/total"] == pytest.approx(0.5 * row["loss/ce"] + 0.5 * row["loss/kd"], rel=1e-5)
        assert row["kd/bytes_up"] == row["kd/0/bytes_up"] + row["kd/1/bytes_up"] > 0
    config = (dump / "config.yaml").read_text()
    assert str(second_teacher) in config and "sources:" in config
    # Each teacher's own held-out CE and bits per byte, beside the students' first eval, under its index.
    evaluation = eval_rows(dump)[COMPARED]
    assert "eval/teacher_loss" not in evaluation, evaluation
    references = [[evaluation[f"eval/{i}/teacher_{name}"] for name in ("loss", "bpb")] for i in (0, 1)]
    assert all(0 < value < 20 for pair in references for value in pair) and references[0] != references[1], references
    # The kill: every other rank ends within seconds with the one sentence naming teacher 1 and its log.
    assert run.after_kill_s < 60, "a rank waited out a timeout after the kill"
    codes, outputs, run_dir = rank_exit_codes(stdout), rank_outputs(run.logs), RunDir(dump)
    assert codes == {0: 1, 1: 1, 2: 1, 3: -signal.SIGKILL}, stdout[-4000:]
    sentence = f"error: rank 3 (teacher 1 ({second_teacher})) stopped; its log is {run_dir.rank_log(3)}"
    for rank in (0, 1, 2):
        lines = console(outputs, rank)
        assert [line for line in lines if line.startswith("error: ")] == [sentence], (rank, lines[-30:])
        assert not any("Traceback" in line for line in lines), (rank, lines)
        assert json.loads(run_dir.status(rank).read_text())["state"] == "lost_peer"
        # Teacher 0 leaves as the students do: its process groups aborted, nothing left in flight.
        assert run_dir.rank_log(rank).read_text().rstrip().endswith("lingua.distributed: process groups aborted")
    # The post-mortem names the first failure: teacher 1's rank, which every other rank lost.
    report = analyse(dump)
    assert report["first"] == dict(rank=3, role="teacher", why="ranks 0, 1, 2 lost it"), report["first"]


@pytest.mark.timeout(400)
def test_a_preempted_run_resumes_exactly_until_a_failing_teacher_is_named(two_sources, tiny_teacher, second_teacher,
                                                                          unbroken_then_killed, tmp_path):
    """SIGUSR2 to teacher 1 (rank 3): the students agree to save and stop, STOP both teachers, exit to be resumed.
    Relaunched,
    it resumes and trains step for step as the unbroken run did, until teacher 1 fails serving a request: every rank
    ends with the sentence naming it, teacher 0 with the students' ERROR, which names it too."""
    split, logs, delivered = tmp_path / "run", tmp_path / "torchrun", []
    overrides = two_teacher_overrides(two_sources, tiny_teacher, second_teacher, split)
    start = time.time()
    first = torchrun(4, overrides, timeout=LIMIT_S, signal_plan=signal_ranks(split, [(3, 0.0)], after_step=1,
                                                                              delivered=delivered))
    print(f"preempted launch: {time.time() - start:.1f}s")
    assert "on a teacher rank's preemption signal" in first.stdout, first.stdout[-4000:]
    assert assert_stopped_to_resume(first, steps=UNBOUNDED) >= 1
    assert delivered == [3] and "run preempted" in first.stdout, first.stdout[-4000:]
    assert first.stdout.count("STOP received after") == 2, first.stdout[-4000:]
    stopped_at = max(train_rows(split))
    print(f"preempted at step {stopped_at}")
    assert 1 <= stopped_at < COMPARED, stopped_at
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == [f"{stopped_at:010d}"]
    fails_at = COMPARED + 1
    start = time.time()
    second = torchrun(4, overrides + [f"inject_failure=teacher_serve:1@{fails_at}"], timeout=LIMIT_S, log_dir=logs)
    print(f"resumed launch: {time.time() - start:.1f}s")
    assert f"resumed from step {stopped_at}" in second.stdout, second.stdout[-4000:]
    resumed, unbroken = train_rows(split), train_rows(unbroken_then_killed.dump)
    assert sorted(resumed) == list(range(1, COMPARED + 1))
    for step in range(1, COMPARED + 1):
        assert [resumed[step][k] for k in KD_KEYS] == [unbroken[step][k] for k in KD_KEYS], step
    # The resumed launch's eval, the teachers' reference included: the unbroken run's numbers.
    evaluation, unbroken_evaluation = eval_rows(split)[COMPARED], eval_rows(unbroken_then_killed.dump)[COMPARED]
    assert {key: evaluation[key] for key in EVAL_KEYS} == {key: unbroken_evaluation[key] for key in EVAL_KEYS}
    # Teacher 1 fails serving step COMPARED + 1: named on every rank, by index and path.
    assert rank_exit_codes(second.stdout) == {0: 1, 1: 1, 2: 1, 3: 1}, second.stdout[-4000:]
    run_dir, outputs = RunDir(split), rank_outputs(logs)
    failure = (f"Teacher 1 ({second_teacher}) on rank 3 failed at step {fails_at}: teacher failed serving step "
               f"{fails_at}: RuntimeError: injected teacher failure (inject_failure=teacher_serve:...); its traceback "
               f"is in {run_dir.rank_log(3)}")
    for rank in (0, 1):
        assert errors(outputs, rank) == [f"error: {failure}"], outputs[rank]
    # Teacher 0 stops with the students' ERROR, which names teacher 1; teacher 1 raises its own failure.
    assert errors(outputs, 2) == [f"error: student rank(s) [0, 1] stopped on an error at step {fails_at}: teacher 1 "
                                  f"({second_teacher}) failed"], outputs[2]
    assert run_dir.rank_log(3).read_text().rstrip().endswith(
        "RuntimeError: injected teacher failure (inject_failure=teacher_serve:...)")
    assert "answered 0 more request(s) with the error, until the students left (ERROR)" in \
        run_dir.rank_log(2).read_text()
    for rank in (0, 1):
        assert run_dir.rank_log(rank).read_text().rstrip().endswith("lingua.distributed: process groups aborted")
    report = analyse(split)
    assert report["first"]["rank"] == 3 and report["first"]["role"] == "teacher", report["first"]


def write_cache_here(corpus, teacher, cache_dir, **extra) -> None:
    """A teacher's cache of the unbroken run's first COMPARED steps, for its 2 students, written in this process by
    the cache writer's own pieces (the serial writer): no launch, so the test pays for one torchrun only."""
    import torch

    from apps.main.teacher_cache import TeacherCacheArgs
    from lingua.distillation.cache.write_job import StreamReader, planned_manifest, write_shards
    from lingua.args import parse_args
    from lingua.distillation.cache.store import INDEX, write_json_atomic
    from lingua.distillation.teacher.model import TeacherModel

    overrides = distill_overrides(corpus, teacher, cache_dir / "dump", steps=COMPARED,
                                  **{"data.sources": "{text: 1.0, code: 1.0}", **extra})
    args = parse_args(TeacherCacheArgs, [*overrides, f"cache_dir={cache_dir}", "streams=2", "shard_sequences=8",
                                         "encode_workers=0"])
    tokenizer, cpu = build_tokenizer(args.data.tokenizer), torch.device("cpu")
    manifest = planned_manifest(args, tokenizer)
    cache_dir.mkdir(parents=True)
    manifest.write(cache_dir)
    write_shards(args, StreamReader(args, tokenizer, cache_dir, manifest), TeacherModel(args.distillation, cpu),
                 manifest, list(range(manifest.n_shards)), True, SimpleNamespace(device=cpu, global_rank=0))
    write_json_atomic(cache_dir / INDEX, {"tokens": manifest.n_shards * manifest.shard_sequences * args.data.seq_len})


@pytest.mark.timeout(300)
def test_two_teachers_caches_train_as_the_online_teachers(two_sources, tiny_teacher, second_teacher,
                                                          unbroken_then_killed, tmp_path):
    """The unbroken run's routing from each teacher's cache (teacher 1's written in bf16, as it ran): the same
    losses, KD statistics, gradient norms and evaluation, step for step, with no teacher ranks."""
    write_cache_here(two_sources, tiny_teacher, tmp_path / "cache_0")
    write_cache_here(two_sources, second_teacher, tmp_path / "cache_1", **{"distillation.teacher_dtype": "bf16"})
    teachers = (f"[{{cache_dir: {tmp_path / 'cache_0'}, sources: [text]}}, "
                f"{{cache_dir: {tmp_path / 'cache_1'}, sources: [code], weight: 2.0}}]")
    dump = tmp_path / "run"
    overrides = two_teacher_overrides(two_sources, tiny_teacher, second_teacher, dump,
                                      **{"distillation.teachers": teachers})
    result = torchrun(2, [f"steps={COMPARED}" if o == f"steps={UNBOUNDED}" else o for o in overrides], timeout=LIMIT_S)
    assert_ok(result)
    online, cached = train_rows(unbroken_then_killed.dump), train_rows(dump)
    assert sorted(cached) == list(range(1, COMPARED + 1))
    for step in cached:
        assert {key: cached[step][key] for key in KD_KEYS} == {key: online[step][key] for key in KD_KEYS}, step
        assert "kd/bytes_up" not in cached[step]  # no bridge
    for i in (0, 1):  # each teacher taught some of the steps' rows
        assert sum(row[f"kd/{i}/loss"] for row in cached.values()) > 0
    assert cached[COMPARED]["loss/total"] < cached[1]["loss/total"]  # it learns
    evaluation = (eval_rows(dump)[COMPARED], eval_rows(unbroken_then_killed.dump)[COMPARED])
    assert [row["eval/loss"] for row in evaluation] == [evaluation[1]["eval/loss"]] * 2
    # One cached teacher beside one online teacher (2 students + teacher 1's rank; the students read teacher 0's
    # cache and wait for teacher 1 only): the same run again, step for step (one more launch, about 25 s).
    mixed_dump = tmp_path / "mixed"
    teachers = (f"[{{cache_dir: {tmp_path / 'cache_0'}, sources: [text]}}, "
                f"{{path: {second_teacher}, sources: [code], weight: 2.0, teacher_dtype: bf16}}]")
    overrides = two_teacher_overrides(two_sources, tiny_teacher, second_teacher, mixed_dump,
                                      **{"distillation.teachers": teachers})
    result = torchrun(3, [f"steps={COMPARED}" if o == f"steps={UNBOUNDED}" else o for o in overrides], timeout=LIMIT_S)
    assert_ok(result)
    mixed = train_rows(mixed_dump)
    assert sorted(mixed) == list(range(1, COMPARED + 1))
    for step in mixed:
        assert {key: mixed[step][key] for key in KD_KEYS} == {key: online[step][key] for key in KD_KEYS}, step
        assert "kd/1/bytes_up" in mixed[step] and "kd/0/bytes_up" not in mixed[step]  # teacher 1's bridge only


def console(outputs: dict, rank: int) -> list[str]:
    return "\n".join(outputs[rank].get(stream, "") for stream in ("stdout", "stderr")).splitlines()


def errors(outputs: dict, rank: int) -> list[str]:
    return [line for line in console(outputs, rank) if line.startswith("error: ")]
